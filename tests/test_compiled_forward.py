"""A wrapped layer whose whole ``forward`` the user compiled keeps its regions.

xtuner v1's layouts (``sac_compile.testing._dev.xtuner_layouts``): the layer class's ``forward``
compiled in place (``_compile_overwrite``), or the instance's ``forward`` compiled before or after
wrapping (its ``fully_shard``). Each used to keep nothing: an eager checkpoint around the compiled
call discards what its graph saves (full recompute's bytes), or the call, routed as a kept body,
held its whole graph (no checkpoint's bytes). The seam compiles the forward again with the
user's options and its own backend: the compiled graph is the layer's checkpoint scope
(Note [a compiled forward is the layer's scope] in ``sac_compile/compiled_forward.py``).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import sac_compile as sc
from sac_compile._compat.dynamo import torch_compile_call
from sac_compile.compiler.backend import SacBackend
from sac_compile.inspection import autograd_saved_bytes
from sac_compile.testing._dev import xtuner_layouts as xt

from .releases import default_torch_only, extended

pytestmark = pytest.mark.slow  # each case compiles a layer graph (aot_eager: seconds; Inductor: ~30 s)

DEPTH = 32  # real depth: the layers share one compiled graph, under Dynamo's recompile limit
LENGTHS = (13, 21, 17, 29)  # packed sequences of one row, as xtuner feeds its towers


def _backend(name: str):
    return sc.make_sac_backend(sc.ALL_REGIONS, inner="aot_eager") if name == "sac" else name


def _step(model, x, cu):
    """(held bytes, attention kernels run forward in the backward, matmuls run forward in the
    backward, loss, gradients) of one step."""
    held = autograd_saved_bytes(
        lambda a: model(a, cu), x.clone().requires_grad_(), exclude=list(model.parameters())
    )
    model.zero_grad(set_to_none=True)
    xx = x.clone().requires_grad_()
    loss = model(xx, cu).square().mean()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss.backward()
    names = [e.name for e in prof.events()]
    sdpa = sum("scaled_dot_product" in n and "backward" not in n for n in names)
    mms = sum(n in ("aten::mm", "aten::addmm", "aten::bmm") for n in names)
    return held, sdpa, mms, loss.detach(), [xx.grad, *(p.grad for p in model.parameters())]


def _step_counted(results: dict, name: str, model, x, cu, caplog) -> None:
    """``results[name]``: :func:`_step` with the package's warnings captured;
    ``results[name + " frames"]``: the graphs Dynamo compiled for it."""
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with caplog.at_level(logging.WARNING, logger="sac_compile"):
        results[name] = _step(model, x, cu)
    results[name + " frames"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs


def _layout(name: str, backend, layer: torch.nn.Module, keep) -> torch.nn.Module:
    if name == "instance, then wrapped":
        xt.compile_instance_forward(layer, backend=backend, fullgraph=True)
        return sc.apply_selective_checkpointing(layer, keep=keep)
    sc.apply_selective_checkpointing(layer, keep=keep)
    if name in ("wrapped, then instance", "class, wrapped, then instance"):
        xt.compile_instance_forward(layer, backend=backend, fullgraph=True)
    return layer


# ("class, wrapped, then instance": xtuner's dense model as it ships, the seam in its
# checkpoint_wrapper's place: _compile_overwrite, then fully_shard compiling the instance's forward;
# torch.compile refuses that second compile of a class's compiled method without the seam)
LAYOUTS = ["class", "wrapped, then instance", "instance, then wrapped", "class, wrapped, then instance"]


@pytest.fixture(scope="module")
def towers():
    torch.manual_seed(0)
    return {cls.__name__: xt.Tower(cls, n=DEPTH) for cls in (xt.VisionLayer, xt.DenseLayer)}


def _run(towers, cls, layout, backend_name, caplog):
    backend = _backend(backend_name)
    base = towers[cls.__name__]
    x, cu = xt.packed_rows(LENGTHS, 32)
    torch._dynamo.reset()
    results = {"none": _step(base, x, cu)}  # (uncompiled: a class compiled with our backend is checkpointed)
    restore = (
        xt.compile_class_forward(cls, backend=backend, fullgraph=True) if layout.startswith("class") else None
    )
    try:
        for name, keep in (("full", ()), ("attn", {"attn"})):
            model = copy.deepcopy(base)
            for i, layer in enumerate(model.layers):
                model.layers[i] = _layout(layout, backend, layer, keep)
            _step_counted(results, name, model, x, cu, caplog)
    finally:
        if restore is not None:
            restore()
    return results


def _assert_kept(results, caplog, tol: float = 1e-5):
    (held_n, sdpa_n, mm_n, loss_n, grads_n) = results["none"]
    (held_f, _, _, _, _) = results["full"]
    held, sdpa, mms, loss, grads = results["attn"]
    # bytes strictly between full recompute and no checkpoint: neither nothing kept nor all
    assert held_f < held < held_n, (held_f, held, held_n)
    # attention not rerun in the backward; the layers' other matmuls are (none of them without checkpointing)
    assert sdpa == 0 and sdpa_n == 0, (sdpa, sdpa_n)
    assert mms > mm_n, (mms, mm_n)
    torch.testing.assert_close(loss, loss_n, rtol=tol, atol=tol)
    for got, want in zip(grads, grads_n):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # the layers share one compiled forward: one graph for 32 layers
    assert results["attn frames"] == 1, results["attn frames"]
    logged = [r.getMessage() for r in caplog.records if r.name == "sac_compile"]
    assert not [m for m in logged if "[compiled-in-eager]" in m or "[kept-nothing]" in m], logged


@pytest.mark.parametrize(
    ("layout", "backend_name"),
    [(layout, "aot_eager") for layout in LAYOUTS]
    + [("class", "sac"), *(pytest.param(layout, "sac", marks=extended) for layout in LAYOUTS[1:])]
    # (Inductor: the class layout in CI below, on the dense layer; every layout in the breadth)
    + [pytest.param(layout, "inductor", marks=extended) for layout in LAYOUTS],
)
def test_a_compiled_forward_keeps_the_regions_at_depth(towers, layout, backend_name, caplog):
    tol = 1e-4 if backend_name == "inductor" else 1e-5
    _assert_kept(_run(towers, xt.VisionLayer, layout, backend_name, caplog), caplog, tol=tol)


@extended
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_compiled_dense_forward_keeps_the_regions_at_depth(towers, layout, caplog):
    _assert_kept(_run(towers, xt.DenseLayer, layout, "aot_eager", caplog), caplog)


@default_torch_only
def test_a_class_forward_compiled_by_inductor_keeps_the_regions(towers, caplog):
    """xtuner's default (Qwen3-VL vision blocks, the dense decoder): Inductor, ``fullgraph=True``."""
    _assert_kept(_run(towers, xt.DenseLayer, "class", "inductor", caplog), caplog, tol=1e-4)


def test_the_seam_compiles_with_the_users_options():
    """fullgraph, dynamic and Inductor's options travel to the seam's compile; the user's backend
    is the inner one."""
    layer = xt.VisionLayer()
    xt.compile_instance_forward(layer, fullgraph=True, dynamic=False, options={"max_autotune": False})
    sc.apply_selective_checkpointing(layer, keep={"attn"})
    call = torch_compile_call(layer.forward.__func__)
    assert call is not None and call.fullgraph is True and call.dynamic is False
    backend = call.backend
    assert isinstance(backend, SacBackend) and backend.inner == "inductor", backend
    assert dict(backend.inductor_config) == {"max_autotune": False}
    assert backend.actions.keep == {"attn"}


def test_a_backend_the_seam_cannot_wrap_is_refused_at_wrapping_or_first_call():
    """``backend="eager"`` has no AOTAutograd to carry the tagging pass: refused with the fix, at
    wrapping (the class's forward) or at the first call (the instance's, set after wrapping)."""
    restore = xt.compile_class_forward(xt.VisionLayer, backend="eager")
    try:
        with pytest.raises(
            ValueError, match=r"VisionLayer.forward is compiled with backend 'eager'.*compile=True"
        ):
            sc.apply_selective_checkpointing(xt.VisionLayer(), keep={"attn"})
    finally:
        restore()
    tower = xt.Tower(xt.VisionLayer, n=1)
    layer = sc.apply_selective_checkpointing(tower.layers[0], keep={"attn"})
    xt.compile_instance_forward(layer, backend="eager")
    x, cu = xt.packed_rows((3, 4), 32)
    with pytest.raises(
        ValueError, match=r"VisionLayer.forward \(set on the instance\) is compiled with backend 'eager'"
    ):
        tower(x, cu)


def test_removing_the_checkpointing_puts_the_users_compiled_forward_back():
    layer = xt.VisionLayer()
    xt.compile_instance_forward(layer, backend="aot_eager")
    users = layer.forward
    sc.apply_selective_checkpointing(layer, keep={"attn"})
    assert layer.forward is not users
    sc.remove_selective_checkpointing(layer)
    assert layer.forward is users and type(layer) is xt.VisionLayer


# Methods compiled on a submodule's class: routed like the layer's own (Note [compiled methods
# inside the seam] in sac_compile/eager/routing.py).


@pytest.mark.parametrize(
    "backend_name",
    ["aot_eager", pytest.param("sac", marks=extended), pytest.param("inductor", marks=extended)],
)
def test_a_submodules_compiled_forward_keeps_the_regions_at_depth(towers, backend_name, caplog):
    """The attention module's ``forward`` compiled on its class (xtuner's Qwen3.5 / GLM-5
    attention, its MoE block), the layer wrapped eagerly around it."""
    base = towers["VisionLayer"]
    x, cu = xt.packed_rows(LENGTHS, 32)
    torch._dynamo.reset()
    results = {"none": _step(base, x, cu)}
    restore = xt.compile_class_forward(xt.VisionAttention, backend=_backend(backend_name), fullgraph=True)
    try:
        for name, keep in (("full", ()), ("attn", {"attn"})):
            model = copy.deepcopy(base)
            for layer in model.layers:
                sc.apply_selective_checkpointing(layer, keep=keep)
            _step_counted(results, name, model, x, cu, caplog)
    finally:
        restore()
    # (the user's graph was compiled under full recompute; keeping, the attention module's kept
    # body compiles once more, as a scope of the layer's actions: one graph for the 32 layers)
    _assert_kept(results, caplog, tol=1e-4 if backend_name == "inductor" else 1e-5)
    assert type(model.layers[0].attn).__name__ == "VisionAttention"
    sc.remove_selective_checkpointing(model)
    assert type(model.layers[0].attn) is xt.VisionAttention


def test_the_inner_layer_of_a_wrapped_mtp_layer_keeps_its_compiled_methods_regions(caplog):
    """The MTP layer wrapped whole: its inner MoE layer's methods, compiled on that layer's class,
    are a submodule's; its attention is not rerun in the backward."""
    from sac_compile.testing._dev import method_compiled as mc

    torch.manual_seed(0)
    base = mc.MethodCompiledMoE(n=1)
    x, cu = mc.packed((5, 9, 7, 11), 32, generator=torch.Generator().manual_seed(0))
    restore = mc.compile_methods("aot_eager")
    try:
        held, sdpa = {}, {}
        for name, keep in (("none", None), ("full", ()), ("attn", {"attn"})):
            model = copy.deepcopy(base)
            if keep is not None:
                sc.SacConfig(layers=("layers.*", "mtp"), keep=keep).apply(model)
            xx = x.clone().requires_grad_()
            with caplog.at_level(logging.WARNING, logger="sac_compile"):
                held[name] = autograd_saved_bytes(
                    lambda a, m=model: m(a, cu), xx, exclude=list(model.parameters())
                )
                loss = model(x.clone().requires_grad_(), cu)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    loss.backward()
            sdpa[name] = sum(
                "scaled_dot_product" in e.name and "backward" not in e.name for e in prof.events()
            )
        # a pickled / copied wrapped MTP layer routes its inner layer again
        again = copy.deepcopy(model)
        assert type(again.mtp.layer).__dict__.get("_pre_moe_forward") is not None
    finally:
        restore()
    assert held["full"] < held["attn"] < held["none"], held
    assert sdpa["attn"] == 0 and sdpa["full"] > 0, sdpa
    logged = [r.getMessage() for r in caplog.records if r.name == "sac_compile"]
    assert not [m for m in logged if "[compiled-in-eager]" in m or "[kept-nothing]" in m], logged


# The seam inside xtuner's own recompute wrapper, whose forward is compiled (Note [a seam inside
# a checkpoint compiled without the pass] in sac_compile/policy_checkpoint.py).


def _wrapped_in_checkpoint_wrapper(towers, backend_name, caplog):
    backend = _backend(backend_name)
    base = towers["VisionLayer"]
    x, cu = xt.packed_rows(LENGTHS, 32)
    torch._dynamo.reset()
    results = {"none": _step(base, x, cu)}
    for name, keep in (("plain", None), ("full", ()), ("attn", {"attn"})):
        model = copy.deepcopy(base)
        for i, layer in enumerate(model.layers):
            if keep is not None:  # (None: xtuner's layout as it ships, no seam)
                sc.apply_selective_checkpointing(layer, keep=keep)
            model.layers[i] = xt.compile_instance_forward(
                xt.checkpoint_wrapped(layer), backend=backend, fullgraph=True
            )
        caplog.clear()  # (the plain layout's markers are traced without the pass: no-pass, rightly)
        _step_counted(results, name, model, x, cu, caplog)
    return results


@pytest.mark.parametrize("backend_name", ["aot_eager", "sac", pytest.param("inductor", marks=extended)])
def test_the_seam_inside_a_compiled_checkpoint_wrapper_keeps_the_regions(towers, backend_name, caplog):
    """``checkpoint_wrapper(<wrapped layer>)`` with its forward compiled: with our backend the
    checkpoint is a scope and the seam's keep set decides in it; with a backend without the pass,
    the seam keeps its regions through PyTorch's selective checkpointing."""
    results = _wrapped_in_checkpoint_wrapper(towers, backend_name, caplog)
    # as many graphs as xtuner's own layout compiles (no seam): none more per layer
    assert results["attn frames"] == results["plain frames"], results
    results["attn frames"] = 1  # (checked just above against the plain layout)
    _assert_kept(results, caplog, tol=1e-4)
    logged = [r.getMessage() for r in caplog.records if r.name == "sac_compile"]
    assert not [m for m in logged if "[no-pass]" in m], logged


NEVER_SILENT = [
    (layout, backend, budget)
    for layout in [*LAYOUTS, "checkpoint_wrapper"]
    for backend in ("aot_eager", "eager", "sac")
    for budget in (None, 0.5)
]


@pytest.mark.parametrize(("layout", "backend_name", "budget"), NEVER_SILENT)
def test_no_layout_keeps_nothing_or_everything_in_silence(layout, backend_name, budget, caplog):
    """Every layout x backend x keep set: the wrapped layers hold strictly between full recompute's
    and no checkpoint's bytes, or sac_compile says why not (a warning, or an error at wrapping or
    the first call)."""
    torch.manual_seed(0)
    base = xt.Tower(xt.VisionLayer, n=2)
    x, cu = xt.packed_rows(LENGTHS, 32)
    backend = _backend(backend_name)
    torch._dynamo.reset()
    none = _step(base, x, cu)[0]
    held = {}
    restore = (
        xt.compile_class_forward(xt.VisionLayer, backend=backend, fullgraph=True)
        if layout == "class"
        else None
    )
    try:
        for name, keep in (("full", ()), ("attn", {"attn"})):
            model = copy.deepcopy(base)
            caplog.clear()
            try:
                with caplog.at_level(logging.WARNING, logger="sac_compile"):
                    for i, layer in enumerate(model.layers):
                        if layout == "checkpoint_wrapper":
                            sc.apply_selective_checkpointing(
                                layer, keep=keep, budget=budget if keep else None
                            )
                            wrapped = xt.checkpoint_wrapped(layer)
                            model.layers[i] = xt.compile_instance_forward(
                                wrapped, backend=backend, fullgraph=True
                            )
                        elif layout == "instance, then wrapped":
                            xt.compile_instance_forward(layer, backend=backend, fullgraph=True)
                            sc.apply_selective_checkpointing(
                                layer, keep=keep, budget=budget if keep else None
                            )
                        else:
                            sc.apply_selective_checkpointing(
                                layer, keep=keep, budget=budget if keep else None
                            )
                            if layout == "wrapped, then instance":
                                xt.compile_instance_forward(layer, backend=backend, fullgraph=True)
                    held[name] = _step(model, x, cu)[0]
            except ValueError as e:  # refused: said, not silent
                held[name] = f"refused: {e}"
    finally:
        if restore is not None:
            restore()
    said = [r.getMessage() for r in caplog.records if r.name == "sac_compile"]
    if isinstance(held["attn"], str) or said:
        return
    assert isinstance(held["full"], int) and held["full"] < held["attn"] < none, (held, none)


def test_our_backend_inside_an_eager_checkpoint_recomputes_no_more_than_a_plain_compile():
    """Methods compiled by our backend, inside a layer the seam checkpoints eagerly: a method
    recomputed with the layer runs without its own checkpointing (else its matmuls ran a third
    time for no byte saved), a kept one as a scope of the layer's actions, as with a plain
    compile: the same bytes and the same matmuls as methods compiled by ``aot_eager``."""
    from sac_compile.testing._dev import method_compiled as mc

    got = {}
    for name in ("aot_eager", "sac"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = mc.MethodCompiledMoE(n=2)
        x, cu = mc.packed((5, 9, 7, 11), 32, generator=torch.Generator().manual_seed(0))
        restore = mc.compile_methods(_backend(name))
        try:
            sc.SacConfig(layers=("layers.*", "mtp.layer"), keep={"attn"}).apply(model)
            held = autograd_saved_bytes(
                lambda a, m=model, c=cu: m(a, c), x.clone().requires_grad_(), exclude=list(model.parameters())
            )
            loss = model(x.clone().requires_grad_(), cu)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                loss.backward()
        finally:
            restore()
        got[name] = (held, sum(e.name in ("aten::mm", "aten::addmm", "aten::bmm") for e in prof.events()))
    assert got["sac"] == got["aot_eager"], got
