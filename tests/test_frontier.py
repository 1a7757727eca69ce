"""The frontier benchmark: its FLOP counting, and its verdict on an outside model, end to end."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import sac_compile as sc
from sac_compile.testing.models import Block

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import frontier  # noqa: E402

from .bench import run_benchmark  # noqa: E402
from .releases import default_torch_only, extended  # noqa: E402


def test_recomputed_flops_of_full_recompute_are_the_forward_matmuls():
    """keep=() recomputes the attention core and every matmul whose output the backward reads
    (not the MLP's down projection: nothing reads its output), counted inside the
    run_with_rng_state wrapper the partitioner puts around the (seeded) CPU SDPA kernel."""
    torch.manual_seed(0)
    d, b, s, heads = 32, 2, 16, 4
    block = Block(d, heads=heads)
    x = torch.randn(b, s, d, requires_grad=True)
    params = list(block.parameters())
    _, base = frontier.measure(
        torch.compile(block, backend=frontier.baseline_backend("aot_eager")), x, params
    )
    torch._dynamo.reset()
    _, full = frontier.measure(
        torch.compile(block, backend=sc.make_sac_backend((), inner="aot_eager")), x, params
    )
    tokens = b * s
    matmuls = 2 * tokens * d * (3 * d + d + 4 * d)  # qkv, out, up
    attention = 4 * b * s * s * d  # q @ k^T and p @ v over all heads
    assert full - base == matmuls + attention


def test_dominance():
    a = {"bytes": 10, "flops": 5}
    assert frontier.dominates(a, {"bytes": 11, "flops": 5})
    assert not frontier.dominates(a, {"bytes": 10, "flops": 5})  # equal is not better
    assert not frontier.dominates(a, {"bytes": 11, "flops": 4})


@pytest.mark.slow
@pytest.mark.subprocess
@default_torch_only  # a benchmark script end to end (tests/releases.py)
@extended  # make bench runs it too; CI: the FLOP counting above, the planner in test_planning.py
def test_every_llama_keep_set_is_on_the_frontier(tmp_path):
    plot = tmp_path / "frontier.png"
    argv = ["--models", "llama", "--batch", "2", "--seq", "32", "--hidden", "64", "--no-inductor"]
    argv += ["--keep-budgets", "", "--iters", "1"]  # keep+budget points are not judged; timing is not
    done = run_benchmark("frontier.py", [*argv, "--plot", str(plot)])
    # exit 0: no keep set dominated, keep-everything <= the zero-recompute point (+1%) and
    # <= no checkpoint, compiled and eager (keep + budget points are reported, not judged)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for row in ("keep attn ", "keep mlp ", "keep attn+mlp ", "op-list SAC", "budget 0.5", "budget 1.0"):
        assert row in out, row
    assert "every keep set is on the frontier" in out
    # the planner beside every PyTorch budget point (exit 0: never worse, strictly better somewhere)
    assert "planner (llama)" in out and "strictly better than" in out, out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
