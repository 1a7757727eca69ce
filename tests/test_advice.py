"""The planner's advice on a hand-picked keep set: one INFO line when a measured plan
dominates it (<= bytes, fewer recomputed FLOPs), once per graph; silent otherwise."""

from __future__ import annotations

import logging

import pytest
import torch

import sac_compile as sc
from sac_compile.planning import measure
from sac_compile.testing.models import Block, MoETransformer

from .releases import default_torch_only


def _advice(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "[advice]" in r.getMessage()]


def _moe(layers: int):
    torch.manual_seed(0)
    model = MoETransformer(vocab=64, d=32, n_layers=layers, heads=4, n_experts=8, top_k=2)
    sc.declare_regions(model, MoETransformer.REGIONS)
    return model, torch.randint(0, 64, (2, 16))


def _train(keep, layers: int = 2) -> None:
    model, ids = _moe(layers)
    for layer in model.layers:
        layer.compile(backend=sc.make_sac_backend(keep, inner="aot_eager"))
    model(ids).sum().backward()


@default_torch_only
@pytest.mark.slow
def test_a_dominated_keep_set_gets_one_line_naming_the_plan_that_beats_it(caplog):
    # The demo's MoE layer: its attention costs a fraction of the experts, so keeping it alone
    # is beaten by PyTorch's knapsack (torch 2.13 and 2.15 alike); the planner's own table
    # says by what.
    model, ids = _moe(1)
    x = model.embed(ids).detach().requires_grad_()
    table = sc.plan(model.layers[0], x, memory=1.0, eager=False)
    own = next(c for c in table.candidates if c.keep == {"attn"} and c.budget is None)
    better = [
        c
        for c in table.candidates
        if c.saved_bytes <= own.saved_bytes and c.recompute_flops < own.recompute_flops
    ]
    best = min(better, key=lambda c: (c.recompute_flops, c.saved_bytes, c.budget is not None, len(c.keep)))
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="sac_compile"):
        _train({"attn"})
    (line,) = _advice(caplog)  # two identical layers, one graph: one line
    assert line.startswith(
        f"sac_compile [advice] EPBlock: keep attn holds {own.saved_bytes:,} B for the backward and "
        f"recomputes {own.recompute_flops:,} FLOP more than no checkpoint; "
        f"{best.label} holds {best.saved_bytes:,} B and recomputes {best.recompute_flops:,}"
    ), line
    assert f"sac_compile.plan(layer, *example_inputs, memory={own.saved_bytes})" in line


@pytest.mark.slow
def test_a_keep_set_on_the_frontier_is_silent(caplog):
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="sac_compile"):
        _train(sc.ALL_REGIONS, layers=1)  # zero recompute, the least bytes that reach it
    assert _advice(caplog) == []


def test_nothing_is_measured_unless_info_is_enabled(monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise AssertionError("the advice traced a graph with INFO off")

    monkeypatch.setattr(measure.PartitionEach, "__call__", refuse)
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="sac_compile"):
        _train({"attn"}, layers=1)
    assert _advice(caplog) == []


def test_capture_partition_gives_no_advice(monkeypatch, caplog):
    monkeypatch.setattr(measure.PartitionEach, "__call__", pytest.fail)
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="sac_compile"):
        sc.inspection.capture_partition(
            Block(32, heads=4),
            torch.randn(2, 16, 32),
            backend=sc.make_sac_backend({"mlp"}, inner="aot_eager"),
        )
    assert _advice(caplog) == []
