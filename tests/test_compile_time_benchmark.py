"""benchmarks/compile_time.py compares the same program compiled two ways: PyTorch's SAC
with the benchmark's op policy (``torch-X``) and our keep set (``ours-X``). Checked here
with ``aot_eager`` by what each saves and recomputes, so that a change to either side that
made them different programs (and the timing comparison meaningless) fails."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import compile_time  # noqa: E402

from sac_compile.inspection.flops import saved_bytes_and_backward_flops  # noqa: E402


def _measure(how: str) -> tuple[int, int]:
    torch._dynamo.reset()
    model, backend = compile_time._model(how, layers=2, inner="aot_eager")
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(4, 64, 64, requires_grad=True)
    return saved_bytes_and_backward_flops(compiled, x, exclude=model.parameters())


@pytest.mark.parametrize("keep", ["attn", "all"])
def test_torch_sac_configuration_makes_our_keep_sets_decisions(keep):
    ours, theirs, plain = _measure(f"ours-{keep}"), _measure(f"torch-{keep}"), _measure("plain")
    assert ours == theirs, (ours, theirs)
    # both recompute something the plain program saves, else the comparison times nothing
    assert ours[0] < plain[0], (ours, plain)


def test_keep_sets_differ():
    assert _measure("ours-attn")[0] < _measure("ours-all")[0]
