"""`make demo` as a smoke test: examples/demo.py with tiny settings, end to end."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from .releases import default_torch_only

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo.py"

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(DEMO), *argv], capture_output=True, text=True, timeout=600, cwd=ROOT
    )


@default_torch_only
def test_demo_trains_compares_and_plots(tmp_path):
    plot = tmp_path / "demo.png"
    done = _run("--tiny", "--inner", "aot_eager", "--keep", "attn,experts", "--plot", str(plot))
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    # the progress bar went to stderr and reached the end
    assert "21/21" in done.stderr
    # per-region table of one compiled layer: the kept regions saved something, the other did not
    table = {
        m[0]: (m[1], int(m[2])) for m in re.findall(r"^(attn|router|experts)\s+(yes|no)\s+(\d+)", out, re.M)
    }
    assert table["attn"][0] == "yes" and table["attn"][1] > 0, out
    assert table["experts"][0] == "yes" and table["experts"][1] > 0, out
    assert table["router"] == ("no", 0), out
    # seven configurations, each with held bytes, step ratio and loss agreement
    comparison = re.findall(r"^(.+?)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s+([\d.e+-]+)$", out, re.M)
    names = [c[0].strip() for c in comparison]
    assert names == [
        "no checkpoint",
        "full recompute",
        "eager SAC keep=attn+experts",
        "PyTorch SAC keep=attn+experts",
        "compiled, no checkpoint",
        "compiled, full recompute",
        "compiled SAC keep=attn+experts",
    ], out
    held = {c[0].strip(): float(c[2]) for c in comparison}  # ratio to no checkpoint
    assert held["full recompute"] < held["eager SAC keep=attn+experts"] < 1.0
    assert held["full recompute"] < held["PyTorch SAC keep=attn+experts"] < 1.0
    # the eager row (SAVE_ALL) runs its two kept modules with no dispatch mode, skipped in the
    # recompute; the default policy intercepts ops in kept regions only
    bodies = re.search(r"engine \(SAVE_ALL\) intercepted (\d+) of them: its (\d+) kept module calls", out)
    assert bodies and bodies[1] == "0" and bodies[2] == "2", out
    seen = re.search(
        r"default policy intercepts (\d+) in the forward and (\d+) in the recompute, .*\((\d+) \+ (\d+) outside\)",
        out,
    )
    assert seen and int(seen[1]) > 0 and int(seen[2]) > 0 and seen[3] == seen[4] == "0", out
    assert "USDT" not in out + done.stderr  # (the profiler's start/stop lines)
    assert held["compiled, full recompute"] < held["compiled SAC keep=attn+experts"] < 1.0
    assert max(float(c[5]) for c in comparison) < 1e-4  # every configuration trains alike
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--keep", "attention"], "--keep names ['attention'] are not regions of the model"),
        (["--steps", "0"], "--steps must be at least 1"),
    ],
)
def test_demo_rejects_bad_options(argv, message):
    done = _run(*argv)
    assert done.returncode == 2 and message in done.stderr, done.stderr
