"""Diagnostics: each situation is reported once per root model, and a correct setup says nothing.

Red before green: each test names the code whose removal turns it red. They were
run red by disabling exactly that code (see the closing note of issue #4).
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
import torch.nn as nn

import sac_compile as sc
from sac_compile import diagnostics

from .models import Stack

AOT = {"inner": "aot_eager"}


@pytest.fixture
def reports(caplog):
    """The sac_compile WARNING messages logged so far in the test."""
    caplog.set_level(logging.WARNING, logger="sac_compile")

    def get(kind: str | None = None) -> list[str]:
        msgs = [
            r.getMessage() for r in caplog.records if r.name == "sac_compile" and r.levelno >= logging.WARNING
        ]
        return [m for m in msgs if kind is None or f"[{kind}]" in m]

    return get


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*(shape or (2, 8, 16)), requires_grad=True)


def _steps(model, n: int = 2, x: torch.Tensor | None = None) -> None:
    x = _x() if x is None else x
    for _ in range(n):
        model(x).sum().backward()


def _stack(n: int = 3, keep=(), compile=False) -> Stack:
    model = Stack(n=n, d=16)
    for layer in model.layers:
        sc.apply_selective_checkpointing(layer, keep=keep, compile=compile)
    return model


class ViewRegion(nn.Module):
    """A kept region holding only views of the layer's input: nothing to save."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with sc.region("only_views"):
            y = x.view(2, 8, 4, 4).transpose(1, 2)
        return self.lin(y.reshape(2, 8, 16)).relu()


class UnreadRegion(nn.Module):
    """A kept region whose costly value the backward never reads (a linear, then a scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.lin2 = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        with sc.region("unread"):
            h = self.lin2(y)
        return h * 2.0


class HalfOpen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sc.region("half_open").__enter__()  # never exited
        return self.lin(x).relu()


class BreakInWith(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with sc.region("broken_with"):
            y = self.lin(x)
            torch._dynamo.graph_break()
            return y.relu()


class BreakInDecorated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    @sc.region("broken_decorated")
    def inner(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x).sin()
        torch._dynamo.graph_break()
        return y.cos()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 2


# --- 1. keep names no marker recorded ------------------------------------------------


@pytest.mark.parametrize("compile", [False, AOT], ids=["eager", "compiled"])
def test_keep_name_never_recorded_is_reported_once_per_model(reports, compile):
    # Red without: diagnostics.compiled.GraphReporter.on_call's / diagnostics.eager.check_engine_call's keep-unused check (both through diagnostics.unused_keep).
    model = _stack(keep={"attn", "atn_typo_1"}, compile=compile)
    _steps(model, 3)
    got = reports("keep-unused")
    assert len(got) == 1, got  # 3 layers x 3 steps: once
    assert "region 'atn_typo_1'" in got[0] and "Block" in got[0]
    assert "'attn'" not in got[0].split(":")[0]  # the name that exists is not reported
    # a second model still gets its own report
    _steps(_stack(keep={"attn", "atn_typo_1"}, compile=compile), 2)
    assert len(reports("keep-unused")) == 2


class Unmarked(nn.Module):
    """A layer with no region markers at all."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu()


@pytest.mark.parametrize("compile", [False, AOT], ids=["eager", "compiled"])
def test_a_region_recorded_by_one_model_does_not_hide_keep_unused_for_another(reports, compile):
    # Red before the fix: regions were recorded process-wide, so model A running "attn"
    # made model B's keep={"attn"} (no such marker in B) look used.
    _steps(_stack(keep={"attn"}, compile=compile), 2)
    assert reports("keep-unused") == []
    other = nn.Sequential(Unmarked(), Unmarked())
    for layer in other:
        sc.apply_selective_checkpointing(layer, keep={"attn"}, compile=compile)
    _steps(other, 2)
    got = reports("keep-unused")
    assert len(got) == 1 and "region 'attn'" in got[0] and "Unmarked" in got[0], got


class BreakThenRegion(nn.Module):
    """A graph break, then a region: compiled, two graphs, the region only in the second."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).relu()
        torch._dynamo.graph_break()
        with sc.region("late"):
            return self.b(h)


def test_layers_called_under_a_new_root_model_do_not_misfire_keep_unused(reports):
    # Red before the per-module record: trained inside a wrapper (one root), then called on
    # its own (another root), the first graph was judged on its second call before the
    # second graph, which holds "late", had run under the new root.
    layer = sc.apply_selective_checkpointing(BreakThenRegion(), keep={"late"}, compile=AOT)
    _steps(nn.Sequential(layer), 1)
    _steps(layer, 2)
    assert reports("keep-unused") == []


# --- 2. kept region that kept nothing -------------------------------------------------


@pytest.mark.parametrize("compile", [False, AOT], ids=["eager", "aot_eager"])
def test_kept_region_holding_only_views_is_reported(reports, compile):
    # Red without: the saved_nodes == 0 branch of diagnostics.compiled.graph_diagnoses / the held check in diagnostics.eager._first_call.
    model = sc.apply_selective_checkpointing(ViewRegion(), keep={"only_views"}, compile=compile)
    _steps(model, 3, _x())
    got = reports("kept-nothing")
    assert len(got) == 1 and "region 'only_views'" in got[0] and "ViewRegion" in got[0], got
    assert "view" in got[0].split(":", 1)[1]  # the reason, not only the name


@pytest.mark.parametrize("compile", [AOT, {}], ids=["aot_eager", "inductor"])
def test_kept_region_the_backward_never_reads_is_reported(reports, compile):
    # Red without: the saved_names branch of graph_diagnoses (the ops are tagged MUST_SAVE,
    # but the partitioner saves none of them).
    model = sc.apply_selective_checkpointing(UnreadRegion(), keep={"unread"}, compile=compile)
    _steps(model, 2)
    got = reports("kept-nothing")
    assert len(got) == 1 and "backward reads none" in got[0], got


# --- 3. markers traced by a backend without the pass -------------------------------------


def test_markers_compiled_by_a_plain_backend_are_reported_at_compile_time(reports):
    # Red without: diagnostics.trace_watch.marker_traced (called from the markers' fake impls).
    model = Stack(n=2, d=16)
    compiled = torch.compile(model, backend="aot_eager")
    _steps(compiled, 2)
    got = reports("no-pass")
    assert sorted(m.split(" in ")[0] for m in got) == [
        "sac_compile [no-pass] region 'attn'",
        "sac_compile [no-pass] region 'mlp'",
    ]
    assert all("backend 'aot_eager'" in m and "(layers.*" in m for m in got)


def _decorated(fn):
    """A decorator as transformers applies them to forward (``wrapped_func``: no ``self``)."""

    def wrapped_func(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapped_func


class DecoratedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    @_decorated
    def forward(self, x):
        with sc.region("a"):
            return torch.tanh(self.lin(x))


def test_no_pass_names_the_module_behind_a_decorated_forward(reports):
    # Red before: "region 'a' in wrapped_func()" (the frame Dynamo compiles has no self).
    compiled = torch.compile(DecoratedForward(), backend="aot_eager")
    compiled(torch.randn(2, 8, requires_grad=True)).sum().backward()
    got = reports("no-pass")
    assert len(got) == 1 and "region 'a' in DecoratedForward:" in got[0], got


@pytest.mark.parametrize("keep", [{"attn"}, set()], ids=["attn", "nothing"])
def test_wrapped_layers_compiled_by_a_plain_backend_are_reported_as_layers(reports, keep):
    # Red before: one report per region, kept or not ("region 'mlp' ... keeps nothing" for a
    # region nobody asked to keep), none naming the layer's lost checkpointing.
    _steps(torch.compile(_stack(n=2, keep=keep), backend="aot_eager"), 2)
    got = reports("no-pass")
    want = "{'attn'}" if keep else "{}"
    assert len(got) == 1 and "region '-'" in got[0] and f"(keep={want})" in got[0], got
    assert "not checkpointed at all" in got[0] and " in Block (layers.*):" in got[0], got


def test_a_plain_compiled_layer_with_a_policy_and_budget_names_its_keep_set_alone(reports):
    # Red before: the scope marker's text was shown as the keep set: {'attn;policy=save_all;budget=0.5'}
    model = Stack(n=2, d=16)
    for layer in model.layers:
        sc.apply_selective_checkpointing(layer, keep={"attn"}, policy=sc.SAVE_ALL, budget=0.5)
    _steps(torch.compile(model, backend="aot_eager"), 1)
    got = reports("no-pass")
    assert len(got) == 1 and "(keep={'attn'})" in got[0], got


def test_a_custom_backend_that_delegates_to_the_sac_backend_is_not_reported(reports):
    # Not guessed: the verdict comes from AOTAutograd tracing the markers for a backend
    # call that is not a sac backend's; here the sac backend is the one compiling.
    backend = sc.make_sac_backend(inner="aot_eager")

    def my_backend(gm, example_inputs):
        return backend(gm, example_inputs)

    def not_delegating(gm, example_inputs):
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    model = _stack(n=2, keep={"attn"})
    _steps(torch.compile(model, backend=my_backend), 2)
    assert reports() == []
    torch._dynamo.reset()
    _steps(torch.compile(Stack(n=2, d=16), backend=not_delegating), 1)
    assert len(reports("no-pass")) == 2 and "'not_delegating'" in reports("no-pass")[0]


# --- 4. unbalanced markers, graph breaks ------------------------------------------------


@pytest.mark.parametrize("compile", [False, AOT], ids=["eager", "compiled"])
def test_enter_without_exit_is_reported(reports, compile):
    # Red without: the unbalanced loop of graph_diagnoses / of diagnostics.eager._first_call.
    model = sc.apply_selective_checkpointing(HalfOpen(), keep=sc.ALL_REGIONS, compile=compile)
    _steps(model, 3)
    got = reports("unbalanced")
    assert len(got) == 1 and "region 'half_open'" in got[0] and "enter without exit" in got[0]


def test_graph_break_in_a_with_region_reports_the_eager_fallback_with_its_line(reports):
    # Red without: the with_fallbacks loop of graph_diagnoses.
    model = sc.apply_selective_checkpointing(BreakInWith(), keep=sc.ALL_REGIONS, compile=AOT)
    x = _x()
    ref = BreakInWith()
    ref.load_state_dict(model.state_dict())
    model(x).sum().backward()
    g = x.grad.clone()
    x.grad = None
    ref(x).sum().backward()
    torch.testing.assert_close(g, x.grad)  # correct, only not compiled
    model(x).sum().backward()
    got = reports("eager-fallback")
    assert len(got) == 1, got
    assert "with region('broken_with')" in got[0] and "test_diagnostics.py" in got[0]
    assert "BreakInWith" in got[0]


def test_graph_break_in_a_decorated_region_is_reported_once(reports):
    # Red without: the decorated_context loop of graph_diagnoses.
    model = sc.apply_selective_checkpointing(BreakInDecorated(), keep=sc.ALL_REGIONS, compile=AOT)
    _steps(model, 3)
    got = reports()
    assert len(got) == 1 and "[graph-break] region 'broken_decorated' in BreakInDecorated" in got[0], got


# --- 5. compiled code in an eager checkpoint; a whole model without scopes -----------------


def test_compiled_module_inside_an_eager_checkpoint_is_reported(reports):
    # Red without: seam._report_compiled_inside.
    model = Stack(n=2, d=16)
    for layer in model.layers:
        layer.attn.compile(backend="aot_eager")
        sc.apply_selective_checkpointing(layer, keep={"mlp"})
    _steps(model, 2)
    got = reports("compiled-in-eager")
    assert len(got) == 1 and "Block (layers.*)" in got[0] and "(attn)" in got[0], got


class MethodCompiled(nn.Module):
    """A trainer's layout (xtuner's MoE layers): the layer is checkpointed eagerly, and a
    method holding the attention region is compiled (patched on the class, fullgraph)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = Stack(n=1, d=d).layers[0].attn  # its SDPA call is region "attn"
        self.up = nn.Linear(d, d)

    def pre(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.ln(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        return h + self.up(h).relu()


@pytest.mark.parametrize("backend", ["sac", "aot_eager"])
def test_a_kept_region_in_a_method_compiled_inside_an_eager_checkpoint_is_reported(
    reports, monkeypatch, backend
):
    # Red before: nothing with our backend (the region kept nothing, silently); with aot_eager,
    # no-pass, whose fix (our backend) does not help, and keep-unused / kept-nothing.
    # (compiled after wrapping: the seam routes the methods compiled when it wraps, which then
    # keep their regions, tests/test_compiled_methods.py; this one it does not know)
    model = nn.Sequential(*(MethodCompiled() for _ in range(3)))
    for layer in model:
        sc.apply_selective_checkpointing(layer, keep={"attn"})
    compiled = sc.make_sac_backend({"attn"}, **AOT) if backend == "sac" else backend
    monkeypatch.setattr(
        MethodCompiled, "pre", torch.compile(MethodCompiled.pre, fullgraph=True, backend=compiled)
    )
    _steps(model, 2)
    got = reports("compiled-in-eager")
    assert len(got) == 1, reports()
    assert (
        "region 'attn' in MethodCompiled (*)" in got[0] and "compiled function MethodCompiled.pre" in got[0]
    )
    assert "compile=True" in got[0], got
    assert not reports("no-pass") and not reports("keep-unused"), reports()


def test_whole_model_graph_without_scopes_is_reported(reports):
    # Red without: the NO_SCOPE branch of graph_diagnoses.
    compiled = torch.compile(Stack(n=3, d=16), backend=sc.make_sac_backend(inner="aot_eager"))
    _steps(compiled, 2)
    got = reports("no-scope")
    assert len(got) == 1 and "3 layers (layers.0, layers.1, layers.2)" in got[0] and "Stack" in got[0]


def test_outer_compile_swallowing_per_layer_compile_is_reported(reports):
    # Red without: diagnostics.compile_swallowed's callers (backend._swallowed_layers for a
    # sac outer backend, marker_traced for any other).
    model = _stack(n=2, keep={"attn"}, compile=AOT)
    _steps(torch.compile(model, backend=sc.make_sac_backend(inner="aot_eager")), 2)
    got = reports("compile-swallowed")
    assert len(got) == 1 and "Block (layers.*)" in got[0], got
    torch._dynamo.reset()
    model = _stack(n=2, keep={"attn"}, compile=AOT)
    _steps(torch.compile(model, backend="aot_eager"), 1)
    assert len(reports("compile-swallowed")) == 2  # another model, another (trace-time) report


def test_a_compile_true_layer_running_eagerly_is_reported(reports):
    # Red without: seam._report_compile_fallback.
    model = _stack(n=2, keep={"attn"}, compile=AOT)
    with torch.compiler.set_stance("force_eager"):
        _steps(model, 2)
    got = reports("compile-fallback")
    assert len(got) == 1 and "Block (layers.*)" in got[0], got
    assert reports("compiled-in-eager") == []  # a layer's own compile is not "compiled code inside"


@pytest.mark.slow
def test_many_keep_sets_on_one_layer_class_all_compile(reports):
    # One generated code object per (class, configuration): Dynamo's recompile_limit (8)
    # counts per code object, so ten keep sets on one class must not exhaust it.
    names = [f"k{i}" for i in range(10)]
    model = Stack(n=10, d=16)
    for layer, name in zip(model.layers, names):
        sc.apply_selective_checkpointing(layer, keep={"attn", name}, compile=AOT)
    with sc.inspection.collect_records() as recs:
        _steps(model, 1)
    assert len(recs) == 10
    assert reports("compile-fallback") == []


# --- Correct configurations, deduplication, strict ------------------------------------------


@pytest.mark.parametrize(
    "setup",
    # one Inductor case: the side file and the saved-names read differ under Inductor
    ["eager", "per-layer aot_eager", "per-layer inductor", "whole model with seams"],
)
def test_a_correct_configuration_reports_nothing(reports, setup):
    if setup == "eager":
        model = _stack(keep={"attn"})
    elif setup == "per-layer aot_eager":
        model = _stack(keep={"attn", "mlp"}, compile=AOT)
    elif setup == "per-layer inductor":
        model = _stack(n=2, keep={"attn"}, compile=True)
    else:
        model = torch.compile(_stack(keep={"attn"}), backend=sc.make_sac_backend({"attn"}, inner="aot_eager"))
    _steps(model, 3)
    assert reports() == []


def test_reports_are_deduplicated_across_steps_and_recompiles(reports):
    model = _stack(n=2, keep={"atn_typo_2"}, compile=AOT)
    _steps(model, 2, _x(2, 8, 16))
    _steps(model, 2, _x(3, 5, 16))  # new shapes: recompiles
    _steps(model, 2, _x(4, 7, 16))
    assert len(reports("keep-unused")) == 1
    assert len(diagnostics.reported(model)) == 1


def test_strict_raises_the_diagnosis(reports):
    model = sc.apply_selective_checkpointing(ViewRegion(), keep={"only_views"}, compile=AOT)
    with diagnostics.strict(), pytest.raises(diagnostics.SacDiagnosticError, match=r"\[kept-nothing\]"):
        model(_x())
    # outside the block it is a log record again
    model(_x())
    assert len(reports("kept-nothing")) == 1


def test_strict_at_trace_time_reaches_the_caller():
    # Raised while Dynamo traces the marker: not swallowed (suppress_errors is off).
    with diagnostics.strict(), pytest.raises(Exception, match=r"\[no-pass\]"):
        torch.compile(Stack(n=1, d=16), backend="aot_eager")(_x())


def test_strict_is_per_thread_in_a_block():
    seen = []

    def other():
        model = sc.apply_selective_checkpointing(ViewRegion(), keep={"only_views"})
        model(_x()).sum().backward()
        seen.append("ran")

    with diagnostics.strict():
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen == ["ran"]


def test_diagnosis_kinds_are_validated():
    with pytest.raises(ValueError, match="unknown diagnosis kind"):
        diagnostics.Diagnosis("typo", "-", "m", "t")
    with pytest.raises(TypeError, match="set_strict takes a bool"):
        diagnostics.set_strict("yes")
