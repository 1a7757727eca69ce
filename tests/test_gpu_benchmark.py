"""benchmarks/gpu.py runs end to end on a CPU (its GPU figures need a GPU: docs/planning.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .releases import default_torch_only

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.subprocess, default_torch_only]


def test_the_gpu_benchmark_runs_every_configuration_on_a_cpu():
    argv = ["--device", "cpu", "--layers", "2", "--d", "32", "--heads", "4", "--vocab", "64"]
    argv += ["--batch", "2", "--seq", "16", "--iters", "2", "--inner", "aot_eager"]
    argv += ["--fractions", "0.3,0.5", "--plan-budgets", "none,0.3"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), *argv],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT / "benchmarks",
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]  # exit 1: a loss differs
    rows = {line.split("  ")[0]: line.split() for line in done.stdout.splitlines() if "  " in line}
    for name in ("no checkpoint", "full recompute", "budget 0.3", "budget 0.5", "keep every region"):
        assert name in rows, done.stdout
    plans = [r for r in rows if r.startswith("plan 0.")]
    assert len(plans) == 2, done.stdout
    held = {name: float(r[-5]) for name, r in rows.items() if name in ("no checkpoint", "full recompute")}
    assert held["full recompute"] < held["no checkpoint"]
