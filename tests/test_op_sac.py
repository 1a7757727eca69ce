"""torchtitan's per-op selective AC as a planner configuration (``planning.op_sac``): what the
planner measures for it equals what torchtitan's own ``SelectiveAC`` holds when compiled, and
the device planner predicts it beside no AC and full AC."""

from __future__ import annotations

import pytest
import torch

import sac_compile as sc
from sac_compile.inspection.measure import autograd_saved_bytes
from sac_compile.testing.models import Block

titan_ac = pytest.importorskip("torchtitan.distributed.activation_checkpoint")


def test_measured_bytes_equal_torchtitans_selective_ac_compiled():
    torch.manual_seed(0)
    block = Block(d=32, heads=2)
    x = torch.randn(2, 16, 32, requires_grad=True)
    table = sc.plan(block, x, memory=1.0, budgets=(None,), eager=False)
    op = table.op_sac
    assert op is not None
    full = next(c for c in table.candidates if not c.keep)
    # between full recompute and no checkpoint, in bytes and in recompute
    assert full.saved_bytes < op.saved_bytes < table.no_checkpoint_bytes
    assert 0 < op.recompute_flops < full.recompute_flops
    wrapped = titan_ac.SelectiveAC(titan_ac.SelectiveAC.Config())._wrap_block(block)
    torch._dynamo.reset()
    compiled = torch.compile(wrapped, backend="aot_eager")
    held = autograd_saved_bytes(compiled, x, exclude=list(block.parameters()))
    assert op.saved_bytes == held
    # eager, a selective checkpoint holds every output its policy saves (and its inputs)
    assert op.eager_bytes == autograd_saved_bytes(wrapped, x, exclude=list(block.parameters()))
    assert op.eager_bytes > op.saved_bytes


def test_device_plan_predicts_torchtitans_op_sac_beside_the_peers():
    from sac_compile import hf
    from sac_compile.planning.devices import Target
    from sac_compile.testing.hf_families import tiny_llama

    model = tiny_llama(layers=2, hidden=64, vocab=256).train()
    target = Target("cpu", batch=2, seq=64, param_dtype=torch.float32, memory="100GiB")
    plan = hf.plan_for(model, None, device=target, compile=True, include=())
    none, full, op = (plan.configuration(k)[0].bytes for k in (None, (), "torchtitan-op"))
    assert full < op < none
    with pytest.raises(ValueError, match="no layer has such a region"):
        plan.configuration({"nope"})
