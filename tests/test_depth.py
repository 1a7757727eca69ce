"""Real depth: declared regions never cost a compiled graph per layer.

Dynamo keys its cache (and its recompile limit, 8) on code objects: N identical layers
compiled per layer share one entry list, so anything guarded per layer (a hook's id, a
module's identity) makes a graph per layer, and from the 9th layer on the layer runs
eagerly (``[compile-fallback]``). Toy depth (2-4 layers) never reaches the limit, so every
test here is at the depth real models have (32+ layers, tiny width), compares with plain
per-layer ``torch.compile`` on the same model, and steps through varying sequence lengths
(dynamic shapes) and a packed batch (two sequences in one row, positions restarting).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch._dynamo.utils import counters

import sac_compile as sc
from sac_compile import hf
from sac_compile.compiler import make_sac_backend
from sac_compile.inspection import autograd_saved_bytes
from sac_compile.testing.hf_families import tiny_llama, tiny_qwen3_moe

from .releases import default_torch_only, extended
from .test_declare import PlainModel

# 32-48 layers compiled per layer, several ways (the compiles take most of it: ~10 s per graph
# of a Qwen3-MoE layer with aot_eager). The transformers models run on the default release;
# the model of our own, which guards the same hooks, on every release.
pytestmark = pytest.mark.slow

INNER = {"inner": "aot_eager"}  # the partitions Inductor would compile, without its codegen


def _batches() -> list[dict[str, torch.Tensor]]:
    """Three lengths, then a packed row (sequences of 12 and 20 tokens, positions restarting)."""
    g = torch.Generator().manual_seed(0)
    out = [{"input_ids": torch.randint(0, 128, (2, s), generator=g)} for s in (16, 24, 40)]
    packed = torch.cat([torch.arange(12), torch.arange(20)])[None]
    out.append({"input_ids": torch.randint(0, 128, (1, 32), generator=g), "position_ids": packed})
    return out


def _train(model: torch.nn.Module) -> tuple[int, list[torch.Tensor], dict[str, torch.Tensor]]:
    """Four steps: (graphs Dynamo compiled, losses, the last step's gradients)."""
    counters.clear()
    losses = []
    for batch in _batches():
        model.zero_grad(set_to_none=True)
        loss = model(**batch, labels=batch["input_ids"], use_cache=False).loss
        loss.backward()
        losses.append(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return counters["stats"]["unique_graphs"], losses, grads


def _held(model: torch.nn.Module) -> int:
    ids = _batches()[0]["input_ids"]

    def loss(i: torch.Tensor) -> torch.Tensor:
        return model(input_ids=i, labels=i, use_cache=False).loss

    return autograd_saved_bytes(loss, ids, exclude=list(model.parameters()), warmup=False)


def _plain_per_layer(model: torch.nn.Module) -> torch.nn.Module:
    for layer in model.model.layers:
        layer.compile(backend="aot_eager")
    return model


def _check_deep_model(base: torch.nn.Module, keep: set[str], caplog) -> int:
    """Returns plain per-layer compile's graph count."""
    ref_graphs, ref_losses, ref_grads = _train(copy.deepcopy(base))
    assert ref_graphs == 0
    plain_graphs, _, _ = _train(_plain_per_layer(copy.deepcopy(base)))

    model = copy.deepcopy(base)
    with caplog.at_level(logging.WARNING, logger="sac_compile"):
        hf.config_for(model, keep=keep, compile=INNER).apply(model)
        graphs, losses, grads = _train(model)
    assert "compile-fallback" not in caplog.text, caplog.text
    # plain per-layer compile: a static graph, a dynamic one from the second length on, and
    # the packed row's; before the fix one graph per layer up to the limit, then eager
    assert 0 < graphs <= plain_graphs, (graphs, plain_graphs)
    for a, b in zip(losses, ref_losses):
        torch.testing.assert_close(a, b)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5, msg=name)

    full = copy.deepcopy(base)
    hf.config_for(full, keep=()).apply(full)  # full recompute (eager: a plain checkpoint per layer)
    held, held_full, held_none = _held(model), _held(full), _held(base)
    assert held_full < held < held_none, (held_full, held, held_none)
    return plain_graphs


@default_torch_only
def test_a_32_layer_llama_compiled_per_layer_keeps_attention_in_as_many_graphs_as_plain_compile(caplog):
    base = tiny_llama(layers=32, hidden=32)
    plain_graphs = _check_deep_model(base, {"attn"}, caplog)
    # transformers' own switch with our context_fn, each layer compiled with our backend: a
    # torch.utils.checkpoint scope inside every compiled layer, regions declared by hooks
    model = copy.deepcopy(base)
    model.activation_checkpointing_enable(
        activation_checkpointing_kwargs=hf.checkpointing_kwargs(model, keep={"attn"})
    )
    backend = make_sac_backend({"attn"}, **INNER)
    for layer in model.model.layers:
        layer.compile(backend=backend)
    graphs, _, _ = _train(model)
    assert 0 < graphs <= plain_graphs, (graphs, plain_graphs)


@default_torch_only
@extended  # depth in CI: the 32-layer Llama above and our own 32-layer stack
def test_a_48_layer_qwen3_moe_compiled_per_layer_keeps_regions_in_as_many_graphs_as_plain_compile(caplog):
    _check_deep_model(tiny_qwen3_moe(layers=48, hidden=32), {"attn", "experts"}, caplog)


def test_sac_config_on_a_32_layer_model_of_our_own_compiles_one_graph_per_shape(caplog):
    """``SacConfig`` with regions declared on modules of a model that has no markers, four lengths."""
    model = PlainModel(32)
    ref = copy.deepcopy(model)
    plain = copy.deepcopy(model)
    for layer in plain.layers:
        layer.compile(backend="aot_eager")
    cfg = sc.SacConfig(
        layers="layers.*",
        keep={"mlp"},
        regions={"layers.*.mlp": "mlp", "layers.*.attn": "attn"},
        compile=INNER,
    )
    with caplog.at_level(logging.WARNING, logger="sac_compile"):
        cfg.apply(model)
        counted = []
        for m in (plain, model):
            counters.clear()
            for s in (6, 9, 14, 6):
                x = torch.randn(2, s, 16, requires_grad=True)
                m(x).sum().backward()
                if m is model:
                    y = x.detach().requires_grad_()
                    torch.testing.assert_close(x.grad, _grad(ref, y), rtol=1e-4, atol=1e-5)
            counted.append(counters["stats"]["unique_graphs"])
    assert "compile-fallback" not in caplog.text, caplog.text
    assert 0 < counted[1] <= counted[0], counted


def _grad(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    model(x).sum().backward()
    return x.grad
