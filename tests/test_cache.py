"""Cache safety in fresh processes sharing one cache dir, FX-graph and AOTAutograd caches on."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _probe(keep: str, cache_dir: Path) -> dict:
    env = dict(os.environ)
    env.update(
        TORCHINDUCTOR_CACHE_DIR=str(cache_dir),
        TORCHINDUCTOR_FX_GRAPH_CACHE="1",
        TORCHINDUCTOR_AUTOGRAD_CACHE="1",
        TORCHINDUCTOR_FORCE_DISABLE_CACHES="0",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "tests.cache_probe", keep],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.subprocess
def test_same_configuration_hits_and_another_keep_set_does_not(tmp_path):
    first_a = _probe("a", tmp_path)
    second_a = _probe("a", tmp_path)
    then_b = _probe("b", tmp_path)

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
