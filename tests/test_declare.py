"""declare_regions (regions by module path, no model code change) and SacConfig."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn

import sac_compile as sc
from sac_compile import diagnostics

from .models import grads, run_step


class PlainBlock(nn.Module):
    """No markers anywhere: regions come only from declarations."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x).tanh()


class PlainModel(nn.Module):
    def __init__(self, n: int = 2, d: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PlainBlock(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _pair(n: int = 2) -> tuple[PlainModel, PlainModel]:
    torch.manual_seed(0)
    ref = PlainModel(n)
    model = PlainModel(n)
    model.load_state_dict(ref.state_dict())
    return ref, model


X_SHAPE = (2, 6, 16)


def test_declared_regions_are_kept_in_eager_with_bit_identical_gradients():
    from sac_compile.eager import checkpoint_with_regions

    ref, model = _pair()
    sc.declare_regions(model, {"layers.*.mlp": "mlp", "layers.*.attn": "attn"})
    x = torch.randn(*X_SHAPE, requires_grad=True)
    stats: list = []
    checkpoint_with_regions(model.layers[0], x, keep={"mlp"}, stats_out=stats)
    assert stats[0].regions_entered == {"mlp": 1, "attn": 1}
    assert stats[0].held_by_region.get("mlp", 0) > 0  # declared + kept -> held
    for layer in model.layers:
        sc.apply_selective_checkpointing(layer, keep={"mlp"})
    out_ref, g_ref = run_step(ref, ref, x)
    out, g = run_step(model, model, x)
    assert torch.equal(out, out_ref)
    assert all(torch.equal(a, b) for a, b in zip(g, g_ref))


@pytest.mark.parametrize("fullgraph", [False, True])
def test_declared_regions_under_whole_model_compile_show_in_the_partition(fullgraph):
    ref, model = _pair()
    sc.declare_regions(model, {"layers.*.mlp": "mlp"})
    for layer in model.layers:
        sc.apply_selective_checkpointing(layer, keep={"mlp"})
    x = torch.randn(*X_SHAPE, requires_grad=True)
    backend = sc.make_sac_backend({"mlp"}, inner="aot_eager")
    report = sc.inspection.capture_partition(lambda t: model(t), x, backend=backend)
    assert len(report.graphs) == 1
    rec = report.graphs[0].record
    assert [s.source for s in rec.scopes] == ["scope markers", "scope markers"]  # one per layer
    assert rec.regions["mlp"].entered == 2 and rec.regions["mlp"].saved_nodes > 0
    assert "mlp" in report.saved_regions()
    # without the declaration nothing inside the layers is kept
    bare = PlainModel()
    bare.load_state_dict(ref.state_dict())
    for layer in bare.layers:
        sc.apply_selective_checkpointing(layer, keep={"mlp"})
    torch._dynamo.reset()
    plain = sc.inspection.capture_partition(lambda t: bare(t), x, backend=backend)
    assert plain.saved_regions() == set()
    assert report.activation_bytes > plain.activation_bytes
    # gradients match the unwrapped model
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=fullgraph)
    _, g = run_step(compiled, model, x)
    _, g_ref = run_step(ref, ref, x)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_patterns_match_whole_components_from_the_root():
    model = PlainModel(3)
    handle = sc.declare_regions(model, {"layers.*.mlp.0": "up", "layers.1": "second"})
    assert handle.modules == {
        "layers.0.mlp.0": ("up",),
        "layers.1.mlp.0": ("up",),
        "layers.2.mlp.0": ("up",),
        "layers.1": ("second",),
    }
    assert sc.declare.declared_regions(model) == handle.modules


def test_a_pattern_matching_nothing_lists_near_misses():
    model = PlainModel()
    with pytest.raises(ValueError, match=r"'layer\.\*\.mlp' matches no module.*'layers\.\*\.mlp'"):
        sc.declare_regions(model, {"layer.*.mlp": "mlp"})
    with pytest.raises(ValueError, match="matches no module"):
        sc.declare_regions(model, {"layers.*.mlp.5": "mlp"})
    # nothing was installed by the failed call (validation happens before any hook)
    with pytest.raises(ValueError):
        sc.declare_regions(model, {"layers.*.mlp": "mlp", "nope": "x"})
    assert sc.declare.declared_regions(model) == {}


@pytest.mark.parametrize(
    "declarations, error, match",
    [
        (["layers.*.mlp"], TypeError, "mapping"),
        ({3: "mlp"}, TypeError, "must be a str"),
        ({"layers..mlp": "mlp"}, ValueError, "empty component"),
        ({"layers.*.ml*": "mlp"}, ValueError, "mixes a wildcard"),
        ({"layers.*.mlp": ""}, ValueError, "empty"),
        ({"layers.*.mlp": 5}, TypeError, "str"),
    ],
)
def test_bad_declarations_are_rejected(declarations, error, match):
    with pytest.raises(error, match=match):
        sc.declare_regions(PlainModel(), declarations)


def test_declaring_twice_is_idempotent_and_handles_remove():
    model = PlainModel()
    mlp = model.layers[0].mlp
    before = (len(mlp._forward_pre_hooks), len(mlp._forward_hooks))
    first = sc.declare_regions(model, {"layers.*.mlp": "mlp"})
    second = sc.declare_regions(model, {"layers.*.mlp": "mlp"})
    # one pre-hook (enter), two forward hooks (the module's own output, first; exit, last)
    assert (len(mlp._forward_pre_hooks), len(mlp._forward_hooks)) == (before[0] + 1, before[1] + 2)
    second.remove()  # installed nothing: removes nothing
    assert sc.declare.declared_regions(model)
    first.remove()
    assert sc.declare.declared_regions(model) == {}
    assert (len(mlp._forward_pre_hooks), len(mlp._forward_hooks)) == before
    with sc.declare_regions(model, {"layers.0": "layer"}):
        assert sc.declare.declared_regions(model) == {"layers.0": ("layer",)}
    assert sc.declare.declared_regions(model) == {}
    sc.declare_regions(model, {"layers.*": "layer", "layers.*.mlp": "mlp"})
    assert sc.declare.undeclare_regions(model) == 4


def test_paths_are_unchanged_by_the_seam_and_by_torch_compile():
    model = PlainModel()
    for layer in model.layers:
        sc.apply_selective_checkpointing(layer, keep={"mlp"})
    compiled = torch.compile(model, backend=sc.make_sac_backend({"mlp"}, inner="aot_eager"))
    handle = sc.declare_regions(compiled, {"layers.*.mlp": "mlp"})
    assert sorted(handle.modules) == ["layers.0.mlp", "layers.1.mlp"]


def test_a_declared_module_that_raises_leaves_the_engine_clean():
    """The exit hook is not ``always_call`` (Dynamo guards that dict by hook id: one graph per
    layer, see test_depth.py), so a declared module that raises closes no region; the eager
    engine's pass ends what is open on the way out: nothing is left pushed, and the next
    step's gradients are bit-identical to no checkpoint."""
    ref, model = _pair()
    sc.SacConfig(layers="layers.*", keep={"mlp"}, regions={"layers.*.mlp": "mlp"}).apply(model)
    fail = [True]

    def boom(module, args):
        if fail[0]:
            raise RuntimeError("boom")

    handle = model.layers[1].mlp[0].register_forward_pre_hook(boom)
    x = torch.randn(*X_SHAPE, requires_grad=True)
    with pytest.raises(RuntimeError, match="boom"):
        model(x)
    assert torch._C._len_torch_dispatch_stack() == 0
    fail[0] = False
    handle.remove()
    _, g_ref = run_step(ref, ref, x)
    _, g = run_step(model, model, x)
    assert all(torch.equal(a, b) for a, b in zip(g_ref, g))


# --- SacConfig ---------------------------------------------------------------------------


def test_config_applies_declarations_and_wraps_every_layer():
    ref, model = _pair(3)
    cfg = sc.SacConfig(layers="layers.*", keep={"mlp"}, regions={"layers.*.mlp": "mlp"})
    assert cfg.apply(model) is model
    assert cfg.apply(model) is model  # idempotent
    assert all(type(layer).__name__ == "SelectiveCheckpointedPlainBlock" for layer in model.layers)
    assert sc.declare.declared_regions(model) == {f"layers.{i}.mlp": ("mlp",) for i in range(3)}
    x = torch.randn(*X_SHAPE, requires_grad=True)
    out_ref, g_ref = run_step(ref, ref, x)
    out, g = run_step(model, model, x)
    assert torch.equal(out, out_ref) and all(torch.equal(a, b) for a, b in zip(g, g_ref))
    with pytest.raises(ValueError, match="already wrapped"):
        sc.SacConfig(layers="layers.*", keep={"attn"}).apply(model)


def test_config_with_compile_matches_the_reference():
    ref, model = _pair(2)
    cfg = sc.SacConfig(
        layers="layers.*", keep={"mlp"}, regions={"layers.*.mlp": "mlp"}, compile={"inner": "aot_eager"}
    )
    cfg.apply(model)
    x = torch.randn(*X_SHAPE, requires_grad=True)
    _, g_ref = run_step(ref, ref, x)
    _, g = run_step(model, model, x)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert grads(model, x)  # the step really produced gradients


def test_config_is_frozen_hashable_and_validated():
    cfg = sc.SacConfig(
        layers="layers.*", keep=["mlp"], regions={"layers.*.mlp": "mlp"}, compile={"fullgraph": True}
    )
    assert cfg.keep == frozenset({"mlp"})
    assert cfg == sc.SacConfig(
        layers="layers.*", keep={"mlp"}, regions={"layers.*.mlp": "mlp"}, compile={"fullgraph": True}
    )
    hash(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.keep = frozenset()  # type: ignore[misc]
    with pytest.raises(TypeError, match="layers must be a non-empty"):
        sc.SacConfig(layers="")
    with pytest.raises(ValueError, match="not understood"):
        sc.SacConfig(layers="layers.*", compile={"fulgraph": True})
    with pytest.raises(TypeError, match="strict must be a bool"):
        sc.SacConfig(layers="layers.*", strict=1)
    with pytest.raises(TypeError, match="keep"):
        sc.SacConfig(layers="layers.*", keep=None)
    with pytest.raises(ValueError, match=r"SacConfig.layers.*'layer\.\*' matches no module"):
        sc.SacConfig(layers="layer.*").apply(PlainModel())


def test_strict_config_raises_for_its_model_only():
    class ViewsOnly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Identity()])
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x.view(-1, 16)).view(2, 6, 16)
            return self.lin(x)

    cfg = sc.SacConfig(layers="layers.*", keep={"v"}, regions={"layers.*": "v"}, strict=True)
    model = cfg.apply(ViewsOnly())
    x = torch.randn(*X_SHAPE, requires_grad=True)
    with pytest.raises(diagnostics.SacDiagnosticError, match=r"\[kept-nothing\] region 'v'"):
        model(x)
    lenient = dataclasses.replace(cfg, strict=False).apply(ViewsOnly())
    lenient(x).sum().backward()  # logged, not raised


@pytest.mark.parametrize("declared", [0, 1])
def test_layers_of_one_class_declared_differently_compile_apart(declared):
    """Dynamo does not guard on module hooks by default (skip_nnmodule_hook_guards): the
    code compiled for the first layer was reused for the other, so a region declared on
    one layer only was dropped (declared on layer 1) or kept in both (declared on layer 0).
    Red before: one graph for both layers."""
    torch._dynamo.reset()
    _, model = _pair(2)
    cfg = sc.SacConfig(
        layers="layers.*",
        keep={"mlp"},
        regions={f"layers.{declared}.mlp": "mlp"},
        compile={"inner": "aot_eager"},
    )
    with sc.inspection.collect_records() as records:
        cfg.apply(model)
        run_step(model, model, torch.randn(*X_SHAPE, requires_grad=True))
    training = [rec for rec in records if rec.is_training]
    assert len(training) == 2, [rec.summary() for rec in training]
    kept = [bool(rec.regions.get("mlp") and rec.regions["mlp"].saved_nodes) for rec in training]
    assert sorted(kept) == [False, True], [rec.summary() for rec in training]


# --- methods of plain objects, by path ---------------------------------------------------


class Projector:
    """A plain object (no nn.Module) whose method does a layer's costly work: an MoE dispatcher."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight).relu()


class DispatchBlock(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d**0.5)
        self.dispatcher = Projector(self.w)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(self.dispatcher.dispatch(x)).tanh()


_PROJECTOR_DISPATCH = Projector.dispatch


def _dispatch_model(n: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(DispatchBlock() for _ in range(n)))


def test_a_method_of_a_plain_object_is_a_region_by_path_without_editing_its_class():
    from sac_compile.inspection import autograd_saved_bytes

    ref = _dispatch_model(3)
    held = {}
    for keep in ((), {"dispatch"}):
        model = copy.deepcopy(ref)
        handle = sc.declare_regions(model, {"*.dispatcher.dispatch": "dispatch"})
        assert sc.declare.declared_regions(model) == {
            f"{i}.dispatcher.dispatch": ("dispatch",) for i in range(3)
        }
        assert vars(Projector)["dispatch"] is _PROJECTOR_DISPATCH  # the class is not edited
        for layer in model:
            sc.apply_selective_checkpointing(layer, keep=keep)
        x = torch.randn(*X_SHAPE, requires_grad=True)
        held[keep and "dispatch"] = autograd_saved_bytes(model, x, exclude=list(model.parameters()))
        _, g_ref = run_step(ref, ref, x)
        _, g = run_step(model, model, x)
        assert all(torch.equal(a, b) for a, b in zip(g_ref, g))
        copied = copy.deepcopy(model)  # (the declaration travels with the object)
        assert sc.declare.declared_regions(copied) == sc.declare.declared_regions(model)
        handle.remove()
        assert "dispatch" not in vars(model[0].dispatcher) and not sc.declare.declared_regions(model)
    assert held[()] < held["dispatch"], held  # the matmul in the dispatcher is kept


def test_declared_methods_compile_one_graph_for_32_layers():
    from torch._dynamo.utils import counters

    model = _dispatch_model(32)
    sc.SacConfig(
        layers="*",
        keep={"dispatch"},
        regions={"*.dispatcher.dispatch": "dispatch"},
        compile={"inner": "aot_eager"},
    ).apply(model)
    with sc.inspection.collect_records() as recs:
        counters.clear()
        for s in (6, 9, 6):
            model(torch.randn(2, s, 16, requires_grad=True)).sum().backward()
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])  # a static and a dynamic graph
    assert any("dispatch" in r.regions for r in recs if r.is_training), [r.regions for r in recs]


def test_a_method_path_that_is_not_a_method_is_refused():
    model = _dispatch_model(1)
    with pytest.raises(ValueError, match=r"'0\.dispatcher\.weight' is not a method"):
        sc.declare_regions(model, {"*.dispatcher.weight": "w"})
    with pytest.raises(ValueError, match="matches no module"):
        sc.declare_regions(model, {"*.nothing.here": "w"})
