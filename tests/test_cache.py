"""Cache safety in fresh processes sharing one cache dir, FX-graph and AOTAutograd caches on."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .releases import every_release

ROOT = Path(__file__).resolve().parent.parent


def _probe(keep: str, cache_dir: Path, *extra: str) -> dict:
    env = dict(os.environ)
    env.update(
        TORCHINDUCTOR_CACHE_DIR=str(cache_dir),
        TORCHINDUCTOR_FX_GRAPH_CACHE="1",
        TORCHINDUCTOR_AUTOGRAD_CACHE="1",
        TORCHINDUCTOR_FORCE_DISABLE_CACHES="0",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "tests.cache_probe", keep, *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cold_warm(tmp_path_factory) -> tuple[dict, dict, Path]:
    """keep={"a","zz"} compiled twice in fresh processes sharing one cache dir ("zz" never
    appears); the two tests below read both runs (each probe is an Inductor compile)."""
    cache = tmp_path_factory.mktemp("cache")
    return _probe("a,zz", cache), _probe("a,zz", cache), cache


@pytest.mark.subprocess
@every_release
def test_same_configuration_hits_and_another_keep_set_does_not(cold_warm):
    first_a, second_a, cache = cold_warm
    then_b = _probe("b", cache)

    assert first_a["autograd_cache_miss"] == 1 and first_a["autograd_cache_hit"] == 0
    assert first_a["pass_ran"] == 1
    # warm cache, same configuration: served from the cache, the pass does not run
    assert second_a["autograd_cache_hit"] == 1 and second_a["pass_ran"] == 0
    assert second_a["saved_shapes"] == first_a["saved_shapes"]
    # another keep set must not be served the partition made for keep={"a"}
    assert then_b["autograd_cache_hit"] == 0 and then_b["pass_ran"] == 1
    assert then_b["saved_shapes"] != first_a["saved_shapes"]
    # the gradients do not depend on what was saved
    assert then_b["grad"] == pytest.approx(first_a["grad"], rel=1e-5)


@pytest.mark.subprocess
def test_diagnostics_neither_misfire_nor_go_silent_on_a_warm_cache(cold_warm):
    """keep={"a","zz"}: "zz" never appears. Cold: the pass reports it. Warm (the pass does
    not run): the same report, read from the side file, and "a" is not reported although
    no marker was traced into a tagging pass in that process. Red without the side file:
    the warm run logs nothing (silent); without the regions it stores, "a" misfires."""
    cold, warm, tmp_path = cold_warm
    assert cold["pass_ran"] == 1 and warm["pass_ran"] == 0 and warm["autograd_cache_hit"] == 1
    warnings = [[m for lvl, m in run["logged"] if lvl == "WARNING"] for run in (cold, warm)]
    assert len(warnings[0]) == 1 and "[keep-unused] region 'zz'" in warnings[0][0]
    assert warnings[1] == warnings[0]

    # Without the side file a warm hit cannot be checked: said at INFO, nothing misfires.
    side = tmp_path / "sac_compile"
    assert side.is_dir()
    for f in side.rglob("*.json"):
        f.unlink()
    unchecked = _probe("a,zz", tmp_path)
    assert unchecked["pass_ran"] == 0
    assert [lvl for lvl, _ in unchecked["logged"]] == ["INFO"]
    assert "was not checked" in unchecked["logged"][0][1]


@pytest.mark.subprocess
def test_no_pass_is_reported_when_the_plain_compile_is_served_from_the_cache(tmp_path):
    """Plain torch.compile (Inductor, no pass) of a marked model: cold, AOTAutograd traces
    the markers and no-pass fires; warm, the cache serves the graph without tracing it.
    Red without diagnostics.trace_watch._on_compile_end's cache-hit check: the warm run is silent."""
    cold = _probe("", tmp_path, "--plain")
    warm = _probe("", tmp_path, "--plain")
    assert warm["autograd_cache_hit"] == 1
    for run in (cold, warm):
        warnings = sorted(m.split(":")[0] for lvl, m in run["logged"] if lvl == "WARNING")
        assert warnings == [
            "sac_compile [no-pass] region 'a' in TwoRegions",
            "sac_compile [no-pass] region 'b' in TwoRegions",
        ], run["logged"]
