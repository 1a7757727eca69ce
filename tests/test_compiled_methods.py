"""Trainers that compile methods inside an eager checkpoint keep their regions.

The layout of xtuner's MoE layers (``sac_compile.testing._dev.method_compiled``): the layer's
methods (attention, experts, shared experts, residual) compiled on the class with
``fullgraph=True``, the layer checkpointed eagerly by the seam outside them, packed sequences
(``cu_seqlens``), a router normalising in place, a dispatcher object registering a
``grad_fn`` pre-hook, an MTP layer wrapping an MoE layer. An eager checkpoint around compiled
code drops what the compiled graph saved and runs it again in the backward; the seam routes
the compiled methods to the eager engine, which keeps a method holding a kept region whole.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import sac_compile as sc
from sac_compile.inspection import autograd_saved_bytes
from sac_compile.testing._dev import method_compiled as mc

from .releases import default_torch_only, extended

# each backend compiles four methods (Inductor: C++ kernels, ~40 s); our backend on every
# release, plain Inductor and real depth on the default one
pytestmark = pytest.mark.slow

LAYERS = ("layers.*", "mtp.layer")


def _backend(name: str):
    if name == "sac":
        return sc.make_sac_backend(sc.ALL_REGIONS, inner="aot_eager")
    return name  # plain torch.compile: "inductor" is what xtuner compiles with


def _sdpa_in_backward(model, x, cu) -> tuple[int, torch.Tensor, list[torch.Tensor]]:
    """Attention kernels the backward runs forward (a recompute), counted by the profiler (a
    dispatch mode would stop Dynamo compiling in the recompute); and the gradients."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    loss = model(x, cu)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss.backward()
    names = [e.name for e in prof.events()]
    n = sum(1 for e in names if "scaled_dot_product" in e and "backward" not in e)
    return n, loss.detach(), [x.grad, *(p.grad for p in model.parameters())]


@pytest.fixture
def methods_compiled(request):
    restore = mc.compile_methods(_backend(request.param))
    try:
        yield request.param
    finally:
        restore()


@pytest.mark.parametrize(
    "methods_compiled",
    # (aot_eager behaves as Inductor here, a backend without our pass: test_diagnostics.py reports
    # it where the seam does not route the method)
    [pytest.param("inductor", marks=[default_torch_only, extended]), "sac"],
    indirect=True,
)
def test_compiled_methods_keep_attention_across_the_eager_checkpoint(methods_compiled, caplog):
    torch.manual_seed(0)
    base = mc.MethodCompiledMoE(n=4)
    x, cu = mc.packed((5, 9, 7, 11), 32, generator=torch.Generator().manual_seed(0))
    models = {"none": base}
    for name, keep in (("full", ()), ("attn", {"attn"})):
        models[name] = copy.deepcopy(base)
        sc.SacConfig(layers=LAYERS, keep=keep).apply(models[name])
    held, sdpa, results = {}, {}, {}
    with caplog.at_level(logging.WARNING, logger="sac_compile"):
        for name, model in models.items():
            xx = x.clone().requires_grad_()
            # (a first call compiles: Dynamo then knows which methods hold which regions)
            held[name] = autograd_saved_bytes(
                lambda a, m=model: m(a, cu), xx, exclude=list(model.parameters())
            )
            sdpa[name], *results[name] = _sdpa_in_backward(model, x, cu)
    assert held["full"] < held["attn"] < held["none"], held
    # the attention ran once per step: none of it in the backward, where full recompute runs it again
    assert sdpa["attn"] == 0 and sdpa["full"] > 0, sdpa
    for name in ("full", "attn"):
        torch.testing.assert_close(results[name][0], results["none"][0])
        for got, want in zip(results[name][1], results["none"][1]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # kept, so nothing to report (no-pass, compiled-in-eager, kept-nothing would all be wrong here)
    checkpointed = [r.getMessage() for r in caplog.records if r.name == "sac_compile"]
    assert not [m for m in checkpointed if "[compiled-in-eager]" in m or "[kept-nothing]" in m], checkpointed
    # the dispatcher's grad_fn pre-hook ran once per backward (two: the measurement's, the count's)
    assert models["attn"].layers[0].dispatcher.prehooks == 3


def test_a_method_compiled_after_wrapping_is_reported_not_silently_recomputed(caplog):
    """The seam finds compiled methods when it generates the layer's class: one compiled
    afterwards is not routed, and its kept region is reported with the fix."""
    torch.manual_seed(0)
    model = mc.MethodCompiledMoE(n=2)
    sc.SacConfig(layers=LAYERS, keep={"attn"}).apply(model)
    restore = mc.compile_methods(_backend("sac"))
    try:
        x, cu = mc.packed((5, 9), 32)
        with caplog.at_level(logging.WARNING, logger="sac_compile"):
            model(x.requires_grad_(), cu).backward()
    finally:
        restore()
    got = [r.getMessage() for r in caplog.records if "[compiled-in-eager]" in r.getMessage()]
    assert len(got) == 1 and "MoELayer._pre_moe_forward" in got[0], got


@default_torch_only
@pytest.mark.parametrize("methods_compiled", ["sac"], indirect=True)
def test_compiled_methods_at_real_depth_compile_once_for_every_layer(methods_compiled):
    """32 MoE layers and the MTP layer share each method's graph: Dynamo compiles one graph per
    method (then one per method for a new length), not one per layer up to its recompile limit."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    torch._dynamo.reset()  # (a test before, in this process, may have compiled these methods)
    model = mc.MethodCompiledMoE(n=32)
    sc.SacConfig(layers=LAYERS, keep={"attn"}).apply(model)
    counters.clear()
    for lengths in ((5, 9, 7, 11), (5, 9, 7, 11)):
        x, cu = mc.packed(lengths, 32)
        model(x.requires_grad_(), cu).backward()
    # (+1: the method holding the kept region, compiled again as a scope of the layer's actions
    # for its kept body, eager/routing.py _kept_run; its user's graph is never compiled when an
    # earlier test in this process told its regions already: it is kept from its first call)
    graphs = counters["stats"]["unique_graphs"]
    assert len(mc.METHODS) <= graphs <= len(mc.METHODS) + 1, dict(counters["stats"])
    # the second step kept attention in every layer: its graphs ran once (no recompute of them)
    x, cu = mc.packed((5, 9, 7, 11), 32)
    assert _sdpa_in_backward(model, x, cu)[0] == 0
