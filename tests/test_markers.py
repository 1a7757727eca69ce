"""The marker ops and `region`: validation, program order, survival through Dynamo/AOT/DCE."""

import functools

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

import sac_compile as sc
from sac_compile.markers import checkpoint_scope, enclosing_context, ops

from .scenarios import with_block_graph_break


def _marker_sequence(graph: torch.fx.Graph) -> list[tuple[str, tuple]]:
    return [(ops.marker_kind(n), tuple(n.args)) for n in graph.nodes if ops.marker_kind(n)]


def _targets(graph):
    return [n.target for n in graph.nodes if n.op == "call_function"]


class TestValidation:
    @pytest.mark.parametrize("bad", [None, 3, b"attn", ("attn",)])
    def test_non_str_name_is_type_error(self, bad):
        with pytest.raises(TypeError, match="region name must be a str"):
            sc.region(bad)

    @pytest.mark.parametrize("bad", ["", " attn", "attn\n", "a,b", "*"])
    def test_bad_str_name_is_value_error(self, bad):
        with pytest.raises(ValueError, match="region name"):
            sc.region(bad)

    def test_decorating_a_non_callable(self):
        with pytest.raises(TypeError, match="decorates a function"):
            sc.region("attn")(42)

    def test_decorating_a_class(self):
        with pytest.raises(TypeError, match="cannot decorate the class"):
            sc.region("attn")(torch.nn.Linear)

    @pytest.mark.parametrize("keep", [None, "attn", 5])
    def test_bad_keep(self, keep):
        with pytest.raises(TypeError, match="keep"):
            sc.make_sac_backend(keep)

    def test_bad_inner(self):
        with pytest.raises(ValueError, match="inner='eager' runs the graph without AOTAutograd"):
            sc.make_sac_backend({"attn"}, inner="eager")
        with pytest.raises(ValueError, match="no torch.compile backend is registered as 'no_such'"):
            sc.make_sac_backend({"attn"}, inner="no_such")
        with pytest.raises(TypeError, match="inner must be a backend name"):
            sc.make_sac_backend({"attn"}, inner=3)
        with pytest.raises(ValueError, match="is a sac backend already"):
            sc.make_sac_backend({"attn"}, inner=sc.sac_backend)


class TestEager:
    @pytest.mark.slow
    def test_marker_outside_any_scope_is_a_no_op(self):
        """No sink outside a scope: the markers record nothing, and autograd sees the same
        program (the same values, the same saved tensors) as without them."""
        w = torch.randn(4, 4, requires_grad=True)

        def plain(x):
            return torch.tanh(x @ w).sin()

        @sc.region("a")
        def marked(x):
            with sc.region("b"):
                h = torch.tanh(x @ w)
            return h.sin()

        x = torch.randn(3, 4, requires_grad=True)
        assert ops.current_sink() is None
        assert torch.equal(marked(x), plain(x))
        assert (
            sc.inspection.autograd_saved_bytes(marked, x) == sc.inspection.autograd_saved_bytes(plain, x) > 0
        )

    def test_plain_eager_dispatches_no_marker_op(self):
        """No sink, no tracer, no mode: a region marker (a `with` block, a declared module)
        dispatches nothing (Note [markers unseen in plain eager]); the profiler, which hooks
        the dispatcher without a Python mode, sees no marker op."""
        block = torch.nn.Linear(4, 4)
        sc.declare_regions(block, {"": "whole"})
        x = torch.randn(2, 4)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with sc.region("r"):
                block(x)
        names = {e.name for e in prof.events()}
        assert "aten::linear" in names or "aten::addmm" in names  # (the profiler saw the ops)
        assert not {n for n in names if n.startswith("sac_compile::")}

    def test_markers_reach_dispatch_and_function_modes(self):
        """Anything that records ops (make_fx's proxy mode, FakeTensorMode, a mode of yours)
        still sees the markers in plain eager code."""
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        class Dispatched(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.seen = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.seen.append(func)
                return func(*args, **(kwargs or {}))

        class Called(TorchFunctionMode):
            def __init__(self):
                super().__init__()
                self.seen = []

            def __torch_function__(self, func, types, args=(), kwargs=None):
                self.seen.append(func)
                return func(*args, **(kwargs or {}))

        block = torch.nn.Linear(4, 4)
        sc.declare_regions(block, {"": "whole"})
        x = torch.randn(2, 4)
        for mode, enter, exit_ in (
            (Dispatched(), ops.REGION_ENTER, ops.REGION_EXIT),
            (Called(), torch.ops.sac_compile.region_enter, torch.ops.sac_compile.region_exit),
        ):
            with mode:
                block(x)
            markers = [f for f in mode.seen if f in (enter, exit_)]
            assert markers == [enter, exit_], type(mode).__name__

    def test_make_fx_records_eager_markers(self):
        from torch.fx.experimental.proxy_tensor import make_fx

        def f(x):
            with sc.region("r"):
                return x.sin()

        graph = make_fx(f)(torch.randn(3)).graph
        assert _marker_sequence(graph) == [("region_enter", ("r",)), ("region_exit", ("r",))]

    def test_sink_sees_markers_in_program_order(self):
        seen = []
        with ops.marker_sink(lambda kind, payload: seen.append((kind, payload))):

            @sc.region("inner")
            def inner(x):
                return x * 2

            with checkpoint_scope(7, {"outer"}):
                with sc.region("outer"):
                    inner(torch.ones(2))
        assert seen == [
            ("scope_enter", (7, "outer")),
            ("region_enter", ("outer",)),
            ("region_enter", ("inner",)),
            ("region_exit", ("inner",)),
            ("region_exit", ("outer",)),
            ("scope_exit", (7, "outer")),
        ]

    def test_decorator_exits_on_exception_in_eager(self):
        seen = []
        with ops.marker_sink(lambda kind, payload: seen.append(kind)):

            @sc.region("r")
            def boom():
                raise RuntimeError("x")

            with pytest.raises(RuntimeError):
                boom()
        assert seen == ["region_enter", "region_exit"]

    def test_decorated_method_keeps_signature_and_name(self):
        class M(torch.nn.Module):
            @sc.region("attn")
            def forward(self, x, *, scale=2.0):
                return x * scale

        m = M()
        assert M.forward.__name__ == "forward"
        assert M.forward.__sac_region__ == "attn"
        assert torch.equal(m(torch.ones(2), scale=3.0), torch.full((2,), 3.0))


def _f(x, w):
    a = x @ w
    with sc.region("mlp"):
        b = torch.relu(a) * 2
        c = b @ w
    return c.sin().sum()


class TestSurvival:
    @pytest.mark.parametrize("fullgraph", [False, True])
    def test_markers_survive_dynamo_in_program_order(self, fullgraph):
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm

        x, w = torch.randn(4, 4), torch.randn(4, 4)
        torch.compile(_f, backend=backend, fullgraph=fullgraph)(x, w)
        assert len(graphs) == 1
        targets = _targets(graphs[0].graph)
        enter = targets.index(torch.ops.sac_compile.region_enter)
        exit_ = targets.index(torch.ops.sac_compile.region_exit)
        # relu, mul, matmul lie strictly between the markers
        assert exit_ - enter == 4
        assert torch.relu in targets[enter:exit_]

    def test_markers_survive_aot_joint_graph_and_dce(self):
        joints = []

        def partition(joint, inputs, **kwargs):
            joints.append(_marker_sequence(joint.graph))
            joint.graph.eliminate_dead_code()
            joints.append(_marker_sequence(joint.graph))
            order = [n.target for n in joint.graph.nodes if n.op == "call_function"]
            joints.append(order)
            return min_cut_rematerialization_partition(joint, inputs, **kwargs)

        backend = aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g), partition_fn=partition)
        x = torch.randn(4, 4, requires_grad=True)
        w = torch.randn(4, 4, requires_grad=True)
        torch.compile(_f, backend=backend, fullgraph=True)(x, w).backward()
        before, after, order = joints
        assert before == [("region_enter", ("mlp",)), ("region_exit", ("mlp",))]
        assert after == before
        enter = order.index(ops.REGION_ENTER)
        exit_ = order.index(ops.REGION_EXIT)
        assert torch.ops.aten.relu.default in order[enter:exit_]
        assert torch.ops.aten.relu.default not in order[:enter]

    def test_scope_markers_carry_id_and_keep(self):
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm

        def f(x):
            with checkpoint_scope(3, {"b", "a"}):
                return x.sin()

        torch.compile(f, backend=backend, fullgraph=True)(torch.randn(2))
        seq = _marker_sequence(graphs[0].graph)
        assert seq == [("scope_enter", (3, "a,b")), ("scope_exit", (3, "a,b"))]


class TestGraphBreaks:
    def test_decorator_graph_break_splits_the_caller(self):
        """A break inside @region: the caller's code before and after still compiles."""
        graphs = []

        def backend(gm, example_inputs):
            graphs.append((_targets(gm.graph), enclosing_context().regions))
            return gm

        @sc.region("r")
        def g(x):
            y = x.sin()
            torch._dynamo.graph_break()
            return y.cos()

        def caller(x):
            return g(x * 2) + 1

        out = torch.compile(caller, backend=backend)(torch.ones(3))
        assert torch.allclose(out, (torch.ones(3) * 2).sin().cos() + 1)
        import operator

        targets = [t for t, _ in graphs]
        # the caller's own ops compiled: the multiply before and the add after the call
        assert any(operator.mul in t for t in targets)
        assert any(operator.add in t for t in targets)
        # the decorated function's two pieces compiled while its wrapper was open
        contexts = [ctx for t, ctx in graphs if not any(m in t for m in (operator.mul, operator.add))]
        assert ("r",) in contexts
        assert len(graphs) == 6

    def test_with_block_graph_break_falls_back_and_is_recorded(self):
        """A break inside `with region(...)`: Dynamo runs that frame eagerly."""
        from sac_compile.markers import with_block_fallbacks

        found = []
        compiled_ops = []

        def backend(gm, example_inputs):
            found.extend(with_block_fallbacks(gm))
            compiled_ops.extend(_targets(gm.graph))
            return gm

        torch.compile(with_block_graph_break, backend=backend)(torch.ones(3))
        import operator

        # nothing of f itself compiled: the frame fell back to eager
        assert operator.mul not in compiled_ops and operator.add not in compiled_ops
        assert [(k, n) for k, n, _ in found] == [("region_enter", "r"), ("region_exit", "r")]
        assert all("scenarios.py" in where for _, _, where in found)

    def test_traced_with_block_is_not_a_fallback(self):
        from sac_compile.markers import with_block_fallbacks

        found = []

        def backend(gm, example_inputs):
            found.extend(with_block_fallbacks(gm))
            return gm

        torch.compile(functools.partial(_f), backend=backend)(torch.randn(4, 4), torch.randn(4, 4))
        assert found == []
