"""What ``pip install sac-compile`` gets: the wheel ``python -m build`` makes holds the package
and its type marker and nothing else (no tests, benchmarks, examples or the project's own test
fixtures), builds without a warning, and carries the version written in one place."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import sac_compile

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.subprocess


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, str]:
    """The wheel built from a copy of what a clean clone holds (no build leftovers in the
    checkout), without build isolation (setuptools and build come with the test extra), and
    the build's output."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "sac_compile", src / "sac_compile", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    done = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(src / "dist"), str(src)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    (path,) = (src / "dist").glob("*.whl")
    return path, out


def test_the_wheel_holds_the_package_its_type_marker_and_nothing_else(wheel):
    """What ships: every module of the package except the project's own test fixtures
    (``sac_compile/testing/_dev``); of ``sac_compile.testing``, exactly the modules of
    ``testing.PUBLIC`` (what the README, docs and examples import) and its ``__init__``."""
    from sac_compile.testing import PUBLIC

    path, _ = wheel
    names = zipfile.ZipFile(path).namelist()
    info = f"sac_compile-{sac_compile.__version__}.dist-info/"
    assert {n.split("/")[0] + "/" for n in names} == {"sac_compile/", info}, sorted(names)
    assert "sac_compile/py.typed" in names
    assert "sac_compile/planning/world.json" in names  # (the device planner's data)
    sources = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "sac_compile").rglob("*.py")
        if "__pycache__" not in p.parts and "_dev" not in p.parts
    }
    assert sources == {n for n in names if n.endswith(".py")}, sources ^ set(names)
    testing = {n.removeprefix("sac_compile/testing/") for n in names if n.startswith("sac_compile/testing/")}
    assert testing == {"__init__.py"} | {f"{m}.py" for m in PUBLIC}, testing
    assert (ROOT / "sac_compile" / "testing" / "_dev" / "method_compiled.py").exists()  # (in the checkout)
    assert f"{info}licenses/LICENSE" in names
    assert (
        "sac_compile = sac_compile.compiler:sac_backend"
        in zipfile.ZipFile(path).read(f"{info}entry_points.txt").decode()
    )


def test_the_wheel_builds_without_a_warning_and_declares_an_spdx_license(wheel):
    path, out = wheel
    assert not [line for line in out.splitlines() if "warning" in line.lower()], out
    metadata = (
        zipfile.ZipFile(path).read(f"sac_compile-{sac_compile.__version__}.dist-info/METADATA").decode()
    )
    assert "License-Expression: BSD-3-Clause" in metadata
    assert f"Version: {sac_compile.__version__}\n" in metadata


def test_the_version_is_written_once_and_heads_the_changelog():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "sac_compile.__version__"}
    first = re.search(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert first and first.group(1) == sac_compile.__version__, (
        first and first.group(1),
        sac_compile.__version__,
    )
