"""benchmarks/gpu.py runs end to end on a CPU (its GPU figures need a GPU: docs/planning.md)."""

from __future__ import annotations

import pytest

from .bench import run_benchmark
from .releases import default_torch_only, extended

# extended: the predicted peak against the allocator's timeline is checked in CI by test_peak.py;
# this is the benchmark script end to end (make bench runs it too)
pytestmark = [pytest.mark.slow, pytest.mark.subprocess, default_torch_only, extended]


def test_the_gpu_benchmark_runs_every_configuration_on_a_cpu():
    argv = ["--model", "llama", "--device", "cpu", "--layers", "2", "--d", "32", "--heads", "4"]
    argv += ["--batch", "2", "--seq", "16", "--iters", "2", "--inner", "aot_eager"]
    argv += ["--fractions", "0.6", "--plan-budgets", "none,0.3"]
    done = run_benchmark("gpu.py", argv)
    # exit 1: a loss differs, or a predicted whole-step peak is more than 10% off the measured
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    first, steps = done.stdout.split("whole AdamW steps on cpu")
    rows = {line.split("  ")[0]: line.split() for line in first.splitlines() if "  " in line}
    for name in ("no checkpoint", "full recompute", "budget 0.3", "budget 0.5", "keep every region"):
        assert name in rows, done.stdout
    plans = [r for r in rows if r.startswith("plan 0.")]
    assert len(plans) == 1, done.stdout
    held = {name: float(r[-4]) for name, r in rows.items() if name in ("no checkpoint", "full recompute")}
    assert held["full recompute"] < held["no checkpoint"] == 1.0  # held, relative to no checkpoint
    # the whole AdamW steps: predicted beside measured peak (the allocator's timeline on a CPU)
    table = {line[:32].strip(): line[32:].split() for line in steps.splitlines()[3:7]}
    assert set(table) == {"no checkpoint", "full recompute", "keep every region", "plan_for(memory)"}, steps
    for name, (predicted, _, ratio, *_) in table.items():
        assert float(predicted) > 0 and abs(float(ratio) - 1) <= 0.10, (name, steps)
    assert float(table["full recompute"][1]) < float(table["no checkpoint"][1]), steps
