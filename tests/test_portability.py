"""Models with regions keep their life outside training: pickle, torch.save, deepcopy, unwrap,
torch.export, ONNX, TorchScript, and torch.compile's own arguments (mode, options, dynamic)."""

from __future__ import annotations

import copy
import logging
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import sac_compile as sc
from sac_compile.testing.models import Block, Stack
from tests.models import run_step
from tests.releases import extended

D = 16


def _x(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 8, D, requires_grad=True)


def _wrapped(compile: bool) -> Stack:
    """A stack with a declared region on one layer and every layer wrapped."""
    torch.manual_seed(0)
    model = Stack(2, D)
    sc.SacConfig(
        layers="layers.*",
        keep={"attn", "norm"},
        regions={"layers.0.ln1": "norm"},
        compile={"inner": "aot_eager"} if compile else False,
    ).apply(model)
    return model


class _Marked(nn.Module):
    """Every way of marking a region: a with block, the decorator, a declared module."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)
        self.c = nn.Linear(D, D)

    @sc.region("mlp")
    def tail(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(x).relu()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with sc.region("attn"):
            x = self.a(x).relu()
        return self.tail(self.b(x))


def _marked_everywhere() -> nn.Module:
    torch.manual_seed(0)
    model = _Marked()
    sc.declare_regions(model, {"b": "proj"})
    return model


def _sac_nodes(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if "sac_compile" in str(n.target)]


# -- pickle, torch.save, deepcopy ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "compile, how",
    [(False, "pickle"), pytest.param(True, "pickle", marks=extended)]
    + [pytest.param(False, "deepcopy", marks=extended), (True, "deepcopy")],
    ids=["eager-pickle", "compiled-pickle", "eager-deepcopy", "compiled-deepcopy"],
)
def test_a_wrapped_model_pickles_and_deep_copies_with_its_wrapping(compile, how, caplog):
    model = _wrapped(compile)
    other = pickle.loads(pickle.dumps(model)) if how == "pickle" else copy.deepcopy(model)
    for mine, theirs in zip(model.layers, other.layers):
        assert type(theirs) is type(mine) and type(mine).__name__ == "SelectiveCheckpointedBlock"
        assert theirs._sac_seam == mine._sac_seam and theirs is not mine
        # a compile=True layer stays compiled (nn.Module.__getstate__ drops the compiled call)
        assert (getattr(theirs, "_compiled_call_impl", None) is not None) == compile
    assert (
        sc.declare.declared_regions(other)
        == sc.declare.declared_regions(model)
        == {"layers.0.ln1": ("norm",)}
    )
    assert other.state_dict().keys() == model.state_dict().keys()

    x = _x()
    with caplog.at_level(logging.WARNING, logger="sac_compile"):
        out, g = run_step(model, model, x)
        got, h = run_step(other, other, x)
    assert "compile-fallback" not in caplog.text  # the copy ran eagerly before
    torch.testing.assert_close(got, out, rtol=0, atol=0)
    for a, b in zip(h, g):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the same activations are kept: the copy's regions (its declared one too) are in place
    held = [sc.inspection.autograd_saved_bytes(m, x, exclude=m.parameters()) for m in (model, other)]
    assert held[0] == held[1]
    sc.remove_selective_checkpointing(other)
    assert held[1] < sc.inspection.autograd_saved_bytes(other, x, exclude=other.parameters())


def test_a_layer_that_lost_its_compiled_call_says_why_and_rewrapping_compiles_it(caplog):
    layer = sc.apply_selective_checkpointing(Block(D), keep={"attn"}, compile={"inner": "aot_eager"})
    del layer._compiled_call_impl  # what a copy made from __dict__ gives
    with caplog.at_level(logging.WARNING, logger="sac_compile"):
        layer(_x()).sum().backward()
    assert "compile-fallback" in caplog.text and "compiled call is gone" in caplog.text, caplog.text
    assert "recompile limit" not in caplog.text  # not the causes that do not apply
    assert sc.apply_selective_checkpointing(layer, keep={"attn"}, compile={"inner": "aot_eager"}) is layer
    assert getattr(layer, "_compiled_call_impl", None) is not None


# -- remove_selective_checkpointing ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_remove_selective_checkpointing_restores_the_plain_model(compile):
    torch.manual_seed(0)
    plain = Stack(2, D)
    model = _wrapped(compile)
    model.load_state_dict(plain.state_dict())
    keys = list(model.state_dict())
    assert sc.remove_selective_checkpointing(model) is model
    for layer in model.layers:
        assert type(layer) is Block and "_sac_seam" not in layer.__dict__
        assert getattr(layer, "_compiled_call_impl", None) is None
    assert sc.declare.declared_regions(model) == {} and list(model.state_dict()) == keys
    pickle.dumps(model)
    x = _x()
    assert sc.inspection.autograd_saved_bytes(
        model, x, exclude=model.parameters()
    ) == sc.inspection.autograd_saved_bytes(plain, x, exclude=plain.parameters())
    # and it can be wrapped again, differently
    sc.apply_selective_checkpointing(model.layers[0], keep=())


def test_remove_selective_checkpointing_refuses_a_layer_wrapped_again_on_top():
    layer = sc.apply_selective_checkpointing(Block(D), keep={"attn"})
    layer.__class__ = type("FSDPLike", (type(layer),), {})  # what fully_shard does
    with pytest.raises(ValueError, match="remove the outer wrapping first"):
        sc.remove_selective_checkpointing(layer)
    with pytest.raises(TypeError, match="nn.Module"):
        sc.remove_selective_checkpointing(lambda x: x)


# -- torch.export, ONNX, TorchScript -----------------------------------------------------------


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_export_holds_no_marker(strict):
    x = torch.randn(2, 8, D)
    for model in (_marked_everywhere(), _wrapped(compile=False)):
        program = torch.export.export(model, (x,), strict=strict)
        assert _sac_nodes(program.graph_module) == [], program.graph_module.code
        torch.testing.assert_close(program.module()(x), model(x))
    # markers still work after an export (the flag is read at each call)
    report = sc.inspection.capture_partition(
        _marked_everywhere(), _x(), backend=sc.make_sac_backend(inner="aot_eager")
    )
    assert {v.region for v in report.saved} >= {"attn", "mlp"}, report.format()


def test_onnx_export_with_both_exporters_holds_no_marker(tmp_path):
    onnx = pytest.importorskip("onnx", reason="the test extra installs onnx and onnxscript")
    x = torch.randn(2, 8, D)
    for dynamo in (True, False):
        path = tmp_path / f"model-{dynamo}.onnx"
        torch.onnx.export(_marked_everywhere(), (x,), str(path), dynamo=dynamo)
        proto = onnx.load(str(path))
        onnx.checker.check_model(proto)
        ops = {(n.domain, n.op_type) for n in proto.graph.node}
        assert not [op for op in ops if "sac" in op[0] or "region" in op[1]], ops
        assert ("", "MatMul") in ops or ("", "Gemm") in ops


def test_torchscript_trace_and_script_hold_no_marker():
    x = torch.randn(2, 8, D)
    model = _marked_everywhere()
    traced = torch.jit.trace(model, (x,))
    with pytest.raises(TypeError, match="undeclare_regions"):  # hooks are not TorchScript
        torch.jit.script(model)
    assert sc.declare.declared_regions(model) == {"b": ("proj",)}  # and the model is untouched
    sc.declare.undeclare_regions(model)
    scripted = torch.jit.script(model)  # the with block and the decorated method
    for m in (traced, scripted):
        # no marker op (the scripted region object is TorchScript's own copy of the class)
        assert "sac_compile::" not in str(m.inlined_graph), m.inlined_graph
        torch.testing.assert_close(m(x), model(x))


# -- a fresh process: no sac_compile needed for exports, the wrapping back for pickles ------------

_CHILD = textwrap.dedent(
    """
    import sys
    import torch
    d = sys.argv[1]
    x, expected, expected_marked = torch.load(f"{d}/io.pt")
    program = torch.export.load(f"{d}/program.pt2")
    torch.testing.assert_close(program.module()(x), expected)
    for name in ("traced", "scripted"):
        torch.testing.assert_close(torch.jit.load(f"{d}/{name}.pt")(x), expected_marked)
    assert "sac_compile" not in sys.modules, "loading the exports imported sac_compile"

    model = torch.load(f"{d}/model.pt", weights_only=False)  # imports sac_compile
    import sac_compile as sc
    layers = list(model.layers)
    assert [type(m).__name__ for m in layers] == ["SelectiveCheckpointedBlock"] * 2
    assert getattr(layers[1], "_compiled_call_impl", None) is not None, "layer 1 lost its compile"
    assert sc.declare.declared_regions(model) == {"layers.0.ln1": ("norm",)}
    out = model(x.requires_grad_())
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    print("child ok")
    """
)


@pytest.mark.subprocess
def test_saved_models_and_exports_load_in_a_fresh_process(tmp_path):
    torch.manual_seed(0)
    model = Stack(2, D)
    sc.declare_regions(model, {"layers.0.ln1": "norm"})
    sc.apply_selective_checkpointing(model.layers[0], keep={"attn", "norm"})
    sc.apply_selective_checkpointing(model.layers[1], keep={"attn"}, compile={"inner": "aot_eager"})
    marked = _marked_everywhere()
    sc.declare.undeclare_regions(marked)  # TorchScript cannot compile their hooks
    x = torch.randn(2, 8, D)
    expected, expected_marked = model(x), marked(x)
    torch.save((x, expected.detach(), expected_marked.detach()), tmp_path / "io.pt")
    torch.save(model, tmp_path / "model.pt")
    torch.export.save(torch.export.export(model, (x,)), tmp_path / "program.pt2")
    # (torch.jit.trace refuses any module.compile()d module: the marked model here)
    torch.jit.save(torch.jit.trace(marked, (x,)), tmp_path / "traced.pt")
    torch.jit.save(torch.jit.script(marked), tmp_path / "scripted.pt")
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "child ok" in done.stdout, done.stderr[-3000:]


# -- torch.compile(mode=, options=, dynamic=) ---------------------------------------------------


@pytest.fixture
def compile_fx_patches(monkeypatch):
    """The config_patches each compile hands Inductor."""
    from sac_compile._compat import inductor

    seen: list[dict] = []
    real = inductor.compile_fx

    def spy(gm, example_inputs, **kwargs):
        seen.append(dict(kwargs.get("config_patches") or {}))
        return real(gm, example_inputs, **kwargs)

    monkeypatch.setattr(inductor, "compile_fx", spy)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs, key, value",
    [
        ({"mode": "reduce-overhead"}, "triton.cudagraphs", True),
        ({"options": {"epilogue_fusion": False}}, "epilogue_fusion", False),
    ],
    ids=["mode", "options"],
)
def test_torch_compile_mode_and_options_reach_inductor(kwargs, key, value, compile_fx_patches):
    torch.manual_seed(0)
    block = Block(D)
    x = _x()
    want, want_g = run_step(block, block, x)
    compiled = torch.compile(block, backend=sc.make_sac_backend({"attn"}), **kwargs)
    got, got_g = run_step(compiled, block, x)
    torch.testing.assert_close(got, want)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b)
    assert compile_fx_patches and all(p[key] == value for p in compile_fx_patches), compile_fx_patches
    assert all("joint_custom_pre_pass" in p for p in compile_fx_patches)  # still our pass


def test_compile_mode_without_inductor_fails_naming_the_fix():
    block = Block(D)
    compiled = torch.compile(
        block, backend=sc.make_sac_backend({"attn"}, inner="aot_eager"), mode="max-autotune"
    )
    with pytest.raises(Exception, match="inner='aot_eager'.*inductor_config"):
        compiled(_x())
    # the seam checks when it wraps
    with pytest.raises(ValueError, match="configures Inductor"):
        sc.apply_selective_checkpointing(
            Block(D), keep={"attn"}, compile={"inner": "aot_eager", "mode": "max-autotune"}
        )
    with pytest.raises(RuntimeError, match="Unrecognized mode"):
        sc.apply_selective_checkpointing(Block(D), keep={"attn"}, compile={"mode": "fastest"})
    with pytest.raises(RuntimeError, match="Unexpected optimization option"):
        sc.apply_selective_checkpointing(Block(D), keep={"attn"}, compile={"options": {"no_such_option": 1}})
    with pytest.raises(ValueError, match="joint_custom_pre_pass"):
        sc.make_sac_backend().compile_patches(options={"joint_custom_pre_pass": None})


@pytest.mark.slow
def test_dynamic_shapes_compile_once_for_two_batch_sizes():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend(sc.make_sac_backend({"attn"}, inner="aot_eager"))
    block = Block(D)
    compiled = torch.compile(block, backend=counter, dynamic=True)
    compiled(_x(2)).sum().backward()
    frames = counter.frame_count
    compiled(_x(3)).sum().backward()
    assert frames >= 1 and counter.frame_count == frames  # no recompile for the new size
    layer = sc.apply_selective_checkpointing(
        Block(D), keep={"attn"}, compile={"inner": "aot_eager", "dynamic": True}
    )
    for batch in (2, 3):
        layer(_x(batch)).sum().backward()
