"""benchmarks/split_backward_era.py, the script that sets one PyTorch release's zero-bubble
pipelining beside another's (docs/planning.md: the 405B zero-bubble run), runs in plain torch on
the project's release and reports what the planner prices (one process; its ``--tp`` and
``--fsdp`` gloo modes are run by hand)."""

from __future__ import annotations

import json

import pytest

from .bench import run_benchmark
from .releases import default_torch_only

pytestmark = [pytest.mark.subprocess, default_torch_only]


def test_the_split_backward_script_reports_the_schedule_and_the_weight_pass(tmp_path):
    out = tmp_path / "era.json"
    done = run_benchmark("split_backward_era.py", ["--layers", "2", "--json", str(out)], timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    # PyTorch's interleaved zero bubble, 8 ranks, 8 microbatches: the last stage runs every
    # microbatch's I before its first W (the gradients recorded for W, held at once)
    held = report["schedule"]["most_recorded_microbatches_by_stage"]
    assert (
        held["15"] == 8
        and "0" not in held
        and set(report["schedule"]["actions"]) == {str(r) for r in range(8)}
    )
    ac, none = report["full_ac"], report["no_ac"]
    # W runs a checkpointed layer's forward once per weight group (9 a Llama layer), none without AC
    assert ac["W_forwards_per_layer"] == [ac["weight_groups"] // 2] * 2 == [9, 9]
    assert none["W_forwards_per_layer"] == [0, 0] and none["recorded_by_I_KiB"] == ac["recorded_by_I_KiB"] > 0
    assert ac["W_peak_above_start_KiB"] > 10 * none["W_peak_above_start_KiB"]
    assert ac["every_weight_has_a_gradient"] and none["every_weight_has_a_gradient"]
