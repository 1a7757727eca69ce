"""The backends: memoisation, recompile safety, dropout, no runtime trace, training, inference."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import sac_compile as sc
from sac_compile.compiler.backend import baseline_backend
from sac_compile.markers import Enclosing

from .models import MLP, Block, run_step
from .releases import every_release
from .scenarios import with_block_graph_break

INNERS = ["aot_eager", "inductor"]
AOT = "aot_eager"  # for what Dynamo and the pass decide, Inductor adds only codegen


def saved_for_backward(fn, *inputs):
    """Tensors the autograd graph packs during fn's forward (compiled functions included)."""
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    out.sum().backward()
    return packed


class TestMemoisation:
    def test_same_configuration_same_object(self):
        assert sc.make_sac_backend({"a", "b"}) is sc.make_sac_backend(["b", "a"])
        assert sc.make_sac_backend(sc.ALL_REGIONS) is sc.sac_backend
        assert sc.make_sac_backend({"a"}, inner="aot_eager") is sc.make_sac_backend(("a",), inner="aot_eager")

    def test_different_configuration_different_object(self):
        assert sc.make_sac_backend({"a"}) is not sc.make_sac_backend({"b"})
        assert sc.make_sac_backend({"a"}) is not sc.make_sac_backend({"a"}, inner="aot_eager")
        assert sc.make_sac_backend(()) is not sc.sac_backend
        a = sc.make_sac_backend({"a"}, inductor_config={"max_autotune": False})
        assert a is not sc.make_sac_backend({"a"})
        assert a is sc.make_sac_backend({"a"}, inductor_config={"max_autotune": False})

    def test_pass_uuid_covers_keep_and_options(self):
        uuids = {
            sc.make_sac_backend({"a"}).tagging_pass().uuid(),
            sc.make_sac_backend({"b"}).tagging_pass().uuid(),
            sc.make_sac_backend(sc.ALL_REGIONS).tagging_pass().uuid(),
            sc.make_sac_backend({"a"}, inductor_config={"max_autotune": False}).tagging_pass().uuid(),
            sc.make_sac_backend({"a"}).tagging_pass(Enclosing(regions=("outer",))).uuid(),
            sc.make_sac_backend({"a"}).tagging_pass(Enclosing(scopes=((0, "b"),))).uuid(),
            sc.make_sac_backend({"a"}).tagging_pass(Enclosing(wrapped_inside=True)).uuid(),
        }
        assert len(uuids) == 7
        assert (
            sc.make_sac_backend({"a"}).tagging_pass().uuid()
            == sc.make_sac_backend({"a"}).tagging_pass().uuid()
        )

    def test_bad_inductor_config(self):
        with pytest.raises(ValueError, match="not a torch._inductor.config option"):
            sc.make_sac_backend({"a"}, inductor_config={"no_such_option": 1})
        with pytest.raises(ValueError, match="does nothing with inner='aot_eager'"):
            sc.make_sac_backend({"a"}, inner="aot_eager", inductor_config={"max_autotune": False})
        with pytest.raises(ValueError, match="installs its own"):
            sc.make_sac_backend({"a"}, inductor_config={"joint_custom_pre_pass": None})

    @pytest.mark.slow
    def test_inductor_config_is_not_set_globally(self):
        import torch._inductor.config as config

        assert config.joint_custom_pre_pass is None
        torch.compile(MLP(), backend=sc.sac_backend)(torch.randn(2, 8, requires_grad=True)).sum().backward()
        assert config.joint_custom_pre_pass is None


class TestRecompileSafety:
    def test_twelve_layers_all_compile_and_keep_their_regions(self):
        layers = [Block(16) for _ in range(12)]
        x = torch.randn(2, 4, 16, requires_grad=True)
        eager_saved = len(saved_for_backward(layers[0], x))
        with sc.inspection.collect_records() as recs:
            counts = [
                len(
                    saved_for_backward(
                        torch.compile(layer, backend=sc.make_sac_backend({"attn"}, inner=AOT)), x
                    )
                )
                for layer in layers
            ]
        # one graph serves all twelve layers (Dynamo guards on the backend's identity)
        assert len([r for r in recs if r.is_training]) == 1
        assert recs[0].regions["attn"].kept and not recs[0].regions["mlp"].kept
        # every layer ran compiled with SAC: SDPA's out+logsumexp plus inputs, not eager's many
        assert counts == [counts[0]] * 12
        assert counts[0] < eager_saved

    @pytest.mark.slow
    def test_a_new_backend_object_per_layer_falls_back_after_the_limit(self):
        """The failure the memoisation prevents (this is why make_sac_backend is memoised)."""
        base = sc.make_sac_backend({"attn"}, inner="aot_eager")
        layers = [Block(16) for _ in range(10)]
        x = torch.randn(2, 4, 16, requires_grad=True)
        counts = [
            len(saved_for_backward(torch.compile(layer, backend=lambda gm, ex: base(gm, ex)), x))
            for layer in layers
        ]
        assert counts[:8] == [counts[0]] * 8
        assert counts[8] > counts[0]  # uncompiled: no checkpointing at all

    @pytest.mark.parametrize("inner", ["aot_eager"])  # Dynamo/pass behaviour: Inductor adds nothing
    def test_two_instances_with_different_keep_sets(self, inner):
        a, b = Block(16), Block(16)
        x = torch.randn(2, 4, 16, requires_grad=True)
        with sc.inspection.collect_records() as recs:
            saved_a = saved_for_backward(
                torch.compile(a, backend=sc.make_sac_backend({"attn"}, inner=inner)), x
            )
            saved_b = saved_for_backward(
                torch.compile(b, backend=sc.make_sac_backend({"mlp"}, inner=inner)), x
            )
        training = [r for r in recs if r.is_training]
        assert [sorted(n for n, s in r.regions.items() if s.kept) for r in training] == [["attn"], ["mlp"]]
        shapes_a = sorted(tuple(t.shape) for t in saved_a)
        shapes_b = sorted(tuple(t.shape) for t in saved_b)
        assert (2, 2, 4) in shapes_a and (2, 2, 4) not in shapes_b  # SDPA logsumexp kept only by a
        # the MLP's up-projection output (the addmm, before its view) kept only by b
        assert (8, 64) in shapes_b and (8, 64) not in shapes_a


class TestDropout:
    @pytest.mark.slow
    @pytest.mark.parametrize("inner", INNERS)
    def test_sac_equals_no_checkpoint_under_the_same_seed(self, inner):
        """Dropout in the kept MLP region and in the recomputed attention output."""
        block = Block(16, dropout=0.3)
        x = torch.randn(2, 4, 16, requires_grad=True)
        plain = torch.compile(block, backend=baseline_backend(inner))
        sac = torch.compile(block, backend=sc.make_sac_backend({"mlp"}, inner=inner))
        torch.manual_seed(123)
        ref_out, ref_grads = run_step(plain, block, x)
        torch.manual_seed(123)
        out, grads = run_step(sac, block, x)
        torch.testing.assert_close(out, ref_out)
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, r)
        # the dropout is live: another seed gives another result
        torch.manual_seed(7)
        other, _ = run_step(sac, block, x)
        assert not torch.allclose(other, out)


class TestNoRuntimeTrace:
    @pytest.mark.parametrize("inner", ["aot_eager"])  # Dynamo/pass behaviour: Inductor adds nothing
    def test_marked_model_with_nothing_kept_equals_unmarked(self, inner):
        """Same partitioned graphs (op for op) with and without markers, nothing kept."""
        from sac_compile.compiler import session

        torch.manual_seed(0)
        marked = Block(16, marked=True)
        unmarked = Block(16, marked=False)
        unmarked.load_state_dict(marked.state_dict())
        x = torch.randn(2, 4, 16, requires_grad=True)
        # (whole_graph: the unmarked module is checkpointed too; by default it would compile untouched)
        backend = sc.make_sac_backend((), inner=inner, whole_graph=True)

        def graphs_of(module):
            torch._dynamo.reset()
            with session.capture_units() as units, sc.inspection.collect_records() as recs:
                torch.compile(module, backend=backend)(x).sum().backward()
            (unit,) = units
            regions = {name for rec in recs for name in rec.regions}
            return regions, {k: sorted(op for _, op, _ in g["calls"]) for k, g in unit.graphs.items()}

        (r_marked, g_marked), (r_unmarked, g_unmarked) = graphs_of(marked), graphs_of(unmarked)
        assert r_marked == {"attn", "mlp"} and r_unmarked == set()  # the two really differ in markers
        assert set(g_marked) == {"forward", "backward"}
        assert g_marked == g_unmarked
        assert not any("sac_compile" in op for ops in g_marked.values() for op in ops)

    @pytest.mark.slow
    def test_inductor_code_carries_no_marker(self):
        block = Block(16)
        x = torch.randn(2, 4, 16, requires_grad=True)
        compiled = torch.compile(block, backend=sc.sac_backend)

        def step():
            compiled(x).sum().backward()

        _, codes = run_and_get_code(step)
        assert len(codes) == 2  # forward and backward
        assert all("sac_compile" not in code for code in codes)

    def test_plain_inductor_compile_of_a_marked_model(self):
        """Markers under a backend without the pass: no crash, no trace in the code.

        Red before the no-op lowering: with dropout next to the no-output marker
        fallback kernel, Inductor freed a seed buffer before its last use
        ("cannot access local variable 'buf12'").
        """
        block = Block(16, dropout=0.3)
        x = torch.randn(2, 4, 16, requires_grad=True)
        compiled = torch.compile(block)

        def step():
            compiled(x).sum().backward()

        _, codes = run_and_get_code(step)
        assert len(codes) == 2
        assert all("sac_compile" not in code for code in codes)
        assert all(p.grad is not None for p in block.parameters())


class TestTrainingAndInference:
    @pytest.mark.slow
    @every_release
    def test_fullgraph_block_trains_and_infers(self):
        torch.manual_seed(0)
        block = Block(16, dropout=0.1)
        compiled = torch.compile(block, backend=sc.sac_backend, fullgraph=True)
        opt = torch.optim.SGD(block.parameters(), lr=0.05)
        x = torch.randn(4, 8, 16)
        target = torch.randn(4, 8, 16)
        losses = []
        with sc.inspection.collect_records() as recs:
            for _ in range(5):
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(compiled(x), target)
                loss.backward()
                opt.step()
                losses.append(loss.item())
        assert losses[-1] < losses[0]
        assert all(torch.isfinite(torch.tensor(losses)))
        assert [r.is_training for r in recs] == [True]
        assert recs[0].regions["attn"].kept and recs[0].regions["mlp"].kept

        block.eval()
        with torch.no_grad(), sc.inspection.collect_records() as recs:
            out, codes = run_and_get_code(compiled, x)
        torch.testing.assert_close(out, block(x), rtol=1e-5, atol=1e-5)
        assert [r.is_training for r in recs] == [False]
        assert recs[0].markers_erased == 4
        assert all("sac_compile" not in code for code in codes)

    @pytest.mark.parametrize("inner", INNERS)
    def test_inference_graph_only_loses_markers(self, inner):
        block = Block(16)
        x = torch.randn(2, 4, 16)
        with torch.no_grad(), sc.inspection.collect_records() as recs:
            out = torch.compile(block, backend=sc.make_sac_backend({"attn"}, inner=inner))(x)
        torch.testing.assert_close(out, block(x), rtol=1e-5, atol=1e-5)
        (rec,) = recs
        assert not rec.is_training and rec.scopes == [] and rec.markers_erased == 4


class TestGraphBreakInDecoratedRegion:
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 8) / 8**0.5)

        @sc.region("r")
        def inner(self, x):
            h = torch.tanh(x @ self.w)
            torch._dynamo.graph_break()
            return torch.sigmoid(h @ self.w)

        def forward(self, x):
            return (self.inner(torch.relu(x @ self.w)) @ self.w).cos()

    @pytest.mark.parametrize("inner", ["aot_eager"])  # Dynamo/pass behaviour: Inductor adds nothing
    def test_pieces_are_kept_and_the_caller_compiles(self, inner):
        model = self.Model()
        x = torch.randn(4, 8, requires_grad=True)
        report = sc.inspection.capture_partition(model, x, backend=sc.make_sac_backend({"r"}, inner=inner))
        training = [g for g in report.graphs if g.record is not None and g.record.is_training]
        # the two pieces of `inner` are tagged; the caller before and after the call hold no
        # marker and start inside no region: compiled untouched (no record)
        assert len(training) == 2 and sum(g.untouched for g in report.graphs) == 2
        pieces = [g for g in training if g.record.starts_inside == ("r",)]
        assert len(pieces) == 2
        # each piece saves its matmul (the costly value); tanh / sigmoid are recomputed from it
        assert [{v.op for v in g.saved if not v.is_input} for g in pieces] == [{"aten.mm"}, {"aten.mm"}]
        assert all(v.region == "r" for g in pieces for v in g.saved if not v.is_input)
        ref = torch.autograd.grad(model(x).sum(), [x, model.w])
        torch._dynamo.reset()
        out = torch.compile(model, backend=sc.make_sac_backend({"r"}, inner=inner))(x)
        got = torch.autograd.grad(out.sum(), [x, model.w])
        for g, r in zip(got, ref, strict=True):
            torch.testing.assert_close(g, r)

    def test_with_block_fallback_is_recorded(self):
        x = torch.randn(3, requires_grad=True)
        with sc.inspection.collect_records() as recs:
            torch.compile(with_block_graph_break, backend=sc.make_sac_backend({"r"}, inner="aot_eager"))(x)
        fallbacks = [fb for r in recs for fb in r.eager_fallbacks]
        assert [(k, n) for k, n, _ in fallbacks] == [("region_enter", "r"), ("region_exit", "r")]
        assert all("scenarios.py" in where for _, _, where in fallbacks)


class TestStructuredTrace:
    def test_each_tagged_graph_is_a_trace_artifact_for_tlparse(self):
        """TORCH_TRACE / tlparse users see each graph's regions next to the graphs: an
        artifact "sac_compile_regions" with the scopes, regions and tags the pass chose."""
        import json
        import logging

        artifacts = []

        class Catch(logging.Handler):
            def emit(self, record):
                meta = getattr(record, "metadata", {})
                if meta.get("artifact", {}).get("name") == "sac_compile_regions":
                    artifacts.append((meta, json.loads(record.payload)))

        trace_log = logging.getLogger("torch.__trace")  # the structured trace's logger
        handler, level = Catch(), trace_log.level
        trace_log.addHandler(handler)
        trace_log.setLevel(logging.DEBUG)
        try:
            block = Block(16)
            x = torch.randn(2, 4, 16, requires_grad=True)
            torch.compile(block, backend=sc.make_sac_backend({"attn"}, inner="aot_eager"))(x).sum().backward()
        finally:
            trace_log.removeHandler(handler)
            trace_log.setLevel(level)
        (meta, payload) = artifacts[-1]
        assert meta["artifact"]["encoding"] == "json" and "frame_id" in meta  # attached to its compile
        assert payload["is_training"] and payload["scopes"][0]["keep"] == "attn"
        assert payload["regions"]["attn"]["kept"] and not payload["regions"]["mlp"]["kept"]
        assert payload["tags"]["MUST_SAVE"] >= 1
