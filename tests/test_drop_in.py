"""The backend as a drop-in: it changes only what it owns, PyTorch's budgets keep their meaning
beside ours, and it composes with any AOTAutograd backend (docs/semantics.md, docs/integrations.md).

PyTorch's own tests of the same behaviours, run with our backend: tests/test_pytorch_ac_port.py.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.nn as nn
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd

import sac_compile as sc

from .test_pytorch_ac_port import held_bytes

D = 32


class Layer(nn.Module):
    """Two matmuls; ``marked``: the first inside region "attn"; ``region_budget``: the whole
    forward under PyTorch's ``region_activation_memory_budget``."""

    def __init__(self, marked=True, region_budget=None):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.marked, self.region_budget = marked, region_budget

    def body(self, x):
        h = self.a(x).sin()
        if self.marked:
            with sc.region("attn"):
                h = torch.matmul(h, h.transpose(-1, -2)).softmax(-1) @ h
        return self.c(self.b(h).relu().cos()).sum()

    def forward(self, x):
        if self.region_budget is None:
            return self.body(x)
        with torch.autograd.graph.region_activation_memory_budget(self.region_budget):
            return self.body(x)


def _held(backend, **layer_kwargs):
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = Layer(**layer_kwargs)
    x = torch.randn(16, D)
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    return held_bytes(lambda: compiled(x), [*layer.parameters(), x])


def test_an_unmarked_graph_is_said_once_and_whole_graph_checkpoints_it(caplog):
    """Red before: an unmarked layer was recomputed whole, silently (no ``unmarked`` kind)."""
    backend = sc.make_sac_backend(inner="aot_eager")
    with caplog.at_level(logging.WARNING, logger="sac_compile"):
        torch._dynamo.reset()
        layer = Layer(marked=False)
        compiled = torch.compile(layer, backend=backend)
        for _ in range(2):
            compiled(torch.randn(16, D)).backward()
    said = [r.getMessage() for r in caplog.records if "[unmarked]" in r.getMessage()]
    assert len(said) == 1 and "whole_graph=True" in said[0], said
    plain = _held("aot_eager", marked=False)
    assert _held(backend, marked=False) == plain > 0
    # the same partitioned graphs, op for op, as PyTorch's aot_eager
    x = torch.randn(16, D)
    ours = sc.inspection.capture_partition(Layer(marked=False), x, backend=backend)
    theirs = sc.inspection.capture_partition(Layer(marked=False), x, backend="aot_eager")
    assert [(v.name, v.op, v.nbytes) for v in ours.graphs[0].saved] == [
        (v.name, v.op, v.nbytes) for v in theirs.graphs[0].saved
    ]
    assert ours.graphs[0].untouched and "compiled untouched" in ours.format()
    # the explicit option: the whole graph one scope, everything recomputed
    assert _held(sc.make_sac_backend(inner="aot_eager", whole_graph=True), marked=False) < plain
    assert sc.make_sac_backend(inner="aot_eager", whole_graph=True) is not backend
    with pytest.raises(TypeError, match="whole_graph must be True or False"):
        sc.make_sac_backend(whole_graph="yes")


def test_a_region_budget_inside_a_scope_is_its_budget():
    """``region_activation_memory_budget(b)`` around a marked layer = ``budget=b`` (red before:
    our MUST_RECOMPUTE tags overrode it, every budget saving the same)."""
    keep = sc.make_sac_backend({"attn"}, inner="aot_eager")
    by_region = {b: _held(keep, region_budget=b) for b in (0.0, 0.5, 1.0)}
    by_ours = {b: _held(sc.make_sac_backend({"attn"}, budget=b, inner="aot_eager")) for b in (0.5, 1.0)}
    assert by_region[0.0] == _held(keep)  # budget 0 is no budget: only the kept region saved
    assert by_region[0.0] < by_region[1.0], by_region
    assert by_region[0.5] == by_ours[0.5] and by_region[1.0] == by_ours[1.0], (by_region, by_ours)


def test_a_budget_and_a_different_region_budget_on_one_scope_name_both():
    torch._dynamo.reset()
    layer = Layer(region_budget=0.5)
    compiled = torch.compile(layer, backend=sc.make_sac_backend({"attn"}, budget=0.3, inner="aot_eager"))
    with pytest.raises(Exception, match=r"budget=0.3 .*region_activation_memory_budget\(0.5\)"):
        compiled(torch.randn(16, D))
    # equal: no conflict
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=sc.make_sac_backend({"attn"}, budget=0.5, inner="aot_eager"))
    compiled(torch.randn(16, D)).backward()


def _recording_aot(calls, **kwargs):
    def compiler(kind):
        def compile_graph(gm, example_inputs):
            calls.append(kind)
            return make_boxed_func(gm.forward)

        return compile_graph

    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"), **kwargs)


def test_a_custom_aot_autograd_backend_keeps_a_region_with_its_compilers_and_partitioner():
    calls, partitions = [], []

    def partition_fn(joint, joint_inputs, **kwargs):
        partitions.append(any("recompute" in n.meta for n in joint.graph.nodes))  # tagged before it
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    mine = _recording_aot(calls, partition_fn=partition_fn)
    kept = _held(sc.make_sac_backend({"attn"}, inner=mine))
    full = _held(sc.make_sac_backend((), inner=mine))
    plain = _held(mine)
    assert full < kept < plain, (full, kept, plain)
    assert {"forward", "backward"} <= set(calls) and partitions and all(partitions[:2])
    # a registered function building aot_autograd(...) inside: the pass reaches its partitioner
    decomp = _held(sc.make_sac_backend({"attn"}, inner="aot_eager_decomp_partition"))
    assert decomp > _held(sc.make_sac_backend((), inner="aot_eager_decomp_partition"))


def test_a_backend_that_never_reaches_a_joint_graph_is_refused_for_a_marked_graph():
    def plain_graph(gm, example_inputs):  # a custom backend without AOTAutograd
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(Layer(), backend=sc.make_sac_backend({"attn"}, inner=plain_graph))
    with pytest.raises(Exception, match="inner='plain_graph' compiled a graph of Layer .*no aot_autograd"):
        compiled(torch.randn(16, D))
    # an unmarked graph is its business: compiled as it compiles it
    torch._dynamo.reset()
    torch.compile(Layer(marked=False), backend=sc.make_sac_backend({"attn"}, inner=plain_graph))(
        torch.randn(16, D)
    )


@pytest.mark.slow
def test_a_compile_fx_partial_keeps_its_inner_compile_and_config():
    """Inductor, once: the user's ``inner_compile`` runs and its ``config_patches`` hold."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    seen = []

    def inner_compile(gm, example_inputs, **kwargs):
        seen.append((kwargs.get("is_backward", False), inductor_config.epilogue_fusion))
        return compile_fx_inner(gm, example_inputs, **kwargs)

    mine = functools.partial(
        compile_fx, inner_compile=inner_compile, config_patches={"epilogue_fusion": False}
    )
    kept = _held(sc.make_sac_backend({"attn"}, inner=mine))
    assert kept > _held(sc.make_sac_backend((), inner=mine))
    assert {b for b, _ in seen} == {False, True} and all(fusion is False for _, fusion in seen), seen
