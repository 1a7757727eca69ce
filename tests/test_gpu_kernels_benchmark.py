"""benchmarks/gpu_kernels.py runs end to end on a CPU at a tiny size (its rates need a GPU)."""

from __future__ import annotations

import json

import pytest

from .bench import run_benchmark
from .releases import default_torch_only

pytestmark = [pytest.mark.subprocess, default_torch_only]


def test_the_kernel_rates_benchmark_times_every_shape_and_names_what_a_backend_refuses(tmp_path):
    out = tmp_path / "rates.json"
    argv = ["--device", "cpu", "--scale", "64", "--iters", "1", "--tokens", "128,1536", "--json", str(out)]
    done = run_benchmark("gpu_kernels.py", argv, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    grouped = {
        (r["model"], r["projection"], r["tokens_per_expert"], r["pass"])
        for r in rows
        if r["kind"] == "grouped_mm"
    }
    passes = ("forward", "input gradient", "weight gradient", "dense mm")
    models = ("deepseek_v3_16b", "qwen3_30b_a3b", "deepseek_v3")
    assert grouped == {
        (m, p, t, s) for m in models for p in ("gate/up", "down") for t in (8, 24) for s in passes
    }
    assert all(r["tflops"] > 0 for r in rows if r["kind"] == "grouped_mm")
    sdpa = {(r["shape"].split()[0], r["backend"]): r for r in rows if r["kind"] == "sdpa"}
    # flash takes no MLA head (queries and keys 192 wide, values 128): refused, not timed
    assert "refused" in sdpa["mla", "flash"] and sdpa["llama", "flash"]["forward_tflops"] > 0
    assert sdpa["mla", "math"]["forward_backward_tflops"] > 0
