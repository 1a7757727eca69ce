"""apply_selective_checkpointing: every decision-table row, identity, idempotence, compile."""

import copy
import dataclasses
import logging

import pytest
import torch

import sac_compile as sc
from sac_compile import seam
from sac_compile.testing.models import Block, Stack


def _wrapped(module: torch.nn.Module) -> bool:
    return getattr(module, "_sac_seam", None) is not None


@pytest.fixture
def stack():
    torch.manual_seed(0)
    return Stack(4, 16)


@pytest.fixture
def x():
    return torch.randn(2, 6, 16, requires_grad=True)


def outputs_and_grads(model, x):
    model.zero_grad(set_to_none=True)
    x.grad = None
    out = model(x)
    out.sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


AOT = {"inner": "aot_eager"}  # compile=True's checks are Dynamo's and the pass's, not Inductor's


def wrap_layers(model, keep, **kwargs):
    for layer in model.layers:
        sc.apply_selective_checkpointing(layer, keep, **kwargs)
    return model


class Spy:
    def __init__(self, monkeypatch, name):
        self.calls = []
        real = getattr(seam, name)

        def spy(*args, **kwargs):
            self.calls.append(kwargs)
            return real(*args, **kwargs)

        monkeypatch.setattr(seam, name, spy)


class TestDecisionTable:
    def test_legacy_module_gets_reentrant_and_keep_is_reported(self, monkeypatch, caplog, x):
        block = Block(16)
        block.sac_legacy_checkpoint = True
        sc.apply_selective_checkpointing(block, {"attn"})
        engine = Spy(monkeypatch, "checkpoint_with_regions")
        with caplog.at_level(logging.WARNING, logger="sac_compile"):
            out = block(x)
            block(x)
        assert "CheckpointFunction" in out.grad_fn.name()  # reentrant
        assert engine.calls == []
        warnings = [r for r in caplog.records if "sac_legacy_checkpoint=True" in r.getMessage()]
        assert len(warnings) == 1 and "keep='attn' is ignored" in warnings[0].getMessage()

    def test_a_legacy_module_called_with_keyword_arguments_is_an_error(self, x):
        """Reentrant checkpointing passes positional arguments only; red before: `early_stop`
        went to torch.utils.checkpoint, silently (other names raised its ValueError)."""

        class Legacy(Block):
            def forward(self, x, early_stop=False):
                return super().forward(x) * (2 if early_stop else 1)

        block = Legacy(16)
        block.sac_legacy_checkpoint = True
        sc.apply_selective_checkpointing(block, ())
        with pytest.raises(TypeError, match=r"keyword argument\(s\) early_stop\. Pass them positionally"):
            block(x, early_stop=True)
        torch.testing.assert_close(block(x, True), 2 * block(x))

    def test_traced_by_an_outer_compile_emits_scope_markers_not_a_checkpoint(self, stack, x):
        wrap_layers(stack, {"attn"})
        graphs = []

        def backend(gm, example_inputs):
            graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
            return gm

        torch.compile(stack, backend=backend, fullgraph=True)(x)
        (targets,) = graphs
        assert targets.count("sac_compile.scope_enter") == 4 and targets.count("sac_compile.scope_exit") == 4
        assert not any("checkpoint" in t for t in targets)

    def test_compile_true_compiles_with_the_memoised_backend(self, stack, x):
        ref = outputs_and_grads(copy.deepcopy(stack), x)
        wrap_layers(stack, {"attn"}, compile=AOT)  # (Inductor: tests/test_diagnostics.py, test_hf.py)
        assert all(layer._compiled_call_impl is not None for layer in stack.layers)
        with sc.inspection.collect_records() as recs:
            out, grads = outputs_and_grads(stack, x)
        assert "CompiledFunction" in stack.layers[-1](x).grad_fn.name()  # no eager checkpoint around it
        (rec,) = recs  # one graph serves the four layers
        assert [s.source for s in rec.scopes] == ["scope markers"]
        assert rec.regions["attn"].kept and not rec.regions["mlp"].kept
        torch.testing.assert_close(out, ref[0])
        for g, r in zip(grads, ref[1], strict=True):
            torch.testing.assert_close(g, r)

    def test_eager_empty_keep_is_plain_non_reentrant_checkpoint(self, monkeypatch, stack, x):
        ref = outputs_and_grads(copy.deepcopy(stack), x)
        wrap_layers(stack, ())
        engine = Spy(monkeypatch, "checkpoint_with_regions")
        plain = Spy(monkeypatch, "checkpoint")
        got = outputs_and_grads(stack, x)
        assert engine.calls == [] and len(plain.calls) == 4
        assert all(c["use_reentrant"] is False for c in plain.calls)
        assert torch.equal(got[0], ref[0]) and all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))

    @pytest.mark.parametrize("keep", [{"attn"}, {"mlp"}, sc.ALL_REGIONS], ids=["attn", "mlp", "all"])
    def test_eager_keep_runs_the_engine_bit_identically(self, monkeypatch, stack, x, keep):
        ref = outputs_and_grads(copy.deepcopy(stack), x)
        wrap_layers(stack, keep)
        engine = Spy(monkeypatch, "checkpoint_with_regions")
        got = outputs_and_grads(stack, x)
        assert len(engine.calls) == 4
        assert torch.equal(got[0], ref[0]) and all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))

    def test_compiled_code_inside_the_eager_engine_is_reported_and_correct(self, caplog, x):
        torch.manual_seed(0)
        block = Block(16)
        block.attn.compile()
        ref_out = block(x)
        ref = torch.autograd.grad(ref_out.sum(), [x, *block.parameters()])
        sc.apply_selective_checkpointing(block, {"attn", "mlp"})
        with caplog.at_level(logging.WARNING, logger="sac_compile"):
            out = block(x)
            got = torch.autograd.grad(out.sum(), [x, *block.parameters()])
            block(x)
        # red before the report existed: nothing was logged
        msgs = [r.getMessage() for r in caplog.records if "contains compiled code (attn)" in r.getMessage()]
        assert len(msgs) == 1 and "compile=True" in msgs[0]
        torch.testing.assert_close(out, ref_out)
        for g, r in zip(got, ref, strict=True):
            torch.testing.assert_close(g, r)

    def test_no_grad_runs_the_module_plainly(self, monkeypatch, stack, x):
        wrap_layers(stack, {"attn"})
        engine = Spy(monkeypatch, "checkpoint_with_regions")
        plain = Spy(monkeypatch, "checkpoint")
        with torch.no_grad():
            stack(x)
        assert engine.calls == [] and plain.calls == []


class TestIdentity:
    def test_state_dict_parameters_and_paths_are_unchanged(self, stack):
        keys = list(stack.state_dict())
        names = [n for n, _ in stack.named_modules()]
        params = [id(p) for p in stack.parameters()]
        wrap_layers(stack, {"attn"})
        assert list(stack.state_dict()) == keys
        assert [n for n, _ in stack.named_modules()] == names
        assert [id(p) for p in stack.parameters()] == params
        assert isinstance(stack.layers[0], Block)

    def test_state_dict_round_trips_between_wrapped_and_unwrapped(self, stack, x):
        wrapped = wrap_layers(copy.deepcopy(stack), {"attn"})
        for p in wrapped.parameters():
            p.data.add_(0.5)
        stack.load_state_dict(wrapped.state_dict())
        torch.testing.assert_close(stack(x), wrapped(x))
        fresh = wrap_layers(Stack(4, 16), ())
        fresh.load_state_dict(stack.state_dict())
        torch.testing.assert_close(fresh(x), stack(x))

    def test_hooks_run_inside_the_checkpoint(self, x):
        block = Block(16)
        calls = []
        block.register_forward_pre_hook(lambda m, a: calls.append(torch.is_grad_enabled()))
        sc.apply_selective_checkpointing(block, ())
        block(x).sum().backward()
        assert len(calls) == 2  # forward, and again in the recompute

    @pytest.mark.parametrize("keep", [{"attn"}, ()], ids=["engine", "plain-checkpoint"])
    @pytest.mark.parametrize("name", ["debug", "early_stop", "keep", "policy"])
    def test_the_layers_keyword_arguments_reach_its_forward(self, keep, name):
        """Red when they went through the checkpoint's **kwargs: torch.utils.checkpoint took
        `debug` and `early_stop` for its own (a silently different output), and `keep` /
        `policy` collided with the engine's (TypeError)."""

        class Layer(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(4, 4)

            def forward(self, x, **flags):
                with sc.region("attn"):
                    y = self.lin(x)
                return y.sin() * (2.0 if flags.get(name) else 1.0)

        torch.manual_seed(0)
        layer, x = Layer(), torch.randn(2, 4)
        ref = layer(x, **{name: True})
        sc.apply_selective_checkpointing(layer, keep)
        out = layer(x, **{name: True})
        assert torch.equal(out, ref)
        out.sum().backward()
        assert layer.lin.weight.grad is not None

    def test_wrapping_twice_is_idempotent_or_rejected(self):
        block = Block(16)
        assert sc.apply_selective_checkpointing(block, {"attn"}) is block
        cls = type(block)
        assert sc.apply_selective_checkpointing(block, ["attn"]) is block
        assert type(block) is cls
        with pytest.raises(
            ValueError, match=r"already wrapped .* keep=\['attn'\].*would nest two checkpoints"
        ):
            sc.apply_selective_checkpointing(block, {"mlp"})

    def test_bad_arguments(self):
        with pytest.raises(TypeError, match="wraps an nn.Module"):
            sc.apply_selective_checkpointing(lambda x: x, ())
        with pytest.raises(TypeError, match="compile must be a bool or a dict"):
            sc.apply_selective_checkpointing(Block(16), (), compile="yes")
        with pytest.raises(ValueError, match=r"compile options \['backend'\] are not understood"):
            sc.apply_selective_checkpointing(
                Block(16), (), compile={"backend": "inductor"}
            )  # make_sac_backend's choice
        with pytest.raises(TypeError, match="keep=None is ambiguous"):
            sc.apply_selective_checkpointing(Block(16), None)


class TestCompiled:
    @pytest.mark.slow
    def test_twelve_wrapped_layers_with_compile_true_all_compile(self, x):
        torch.manual_seed(0)
        layers = [sc.apply_selective_checkpointing(Block(16), {"attn"}, compile=AOT) for _ in range(12)]
        packed = []
        with sc.inspection.collect_records() as recs:
            for layer in layers:
                count = []
                with torch.autograd.graph.saved_tensors_hooks(
                    lambda t, c=count: c.append(t) or t, lambda t: t
                ):
                    out = layer(x)
                out.sum().backward()
                packed.append(len(count))
        assert len([r for r in recs if r.is_training]) == 1
        assert packed == [packed[0]] * 12
        eager = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: eager.append(t) or t, lambda t: t):
            Block(16)(x)
        assert packed[0] < len(eager)

    @pytest.mark.slow
    def test_whole_model_compile_saves_the_layer_boundaries(self, stack, x):
        wrap_layers(stack, {"attn"})
        report = sc.inspection.capture_partition(
            stack, x, backend=sc.make_sac_backend(sc.ALL_REGIONS, inner="aot_eager")
        )
        (graph,) = report.graphs
        assert [s.source for s in graph.record.scopes] == ["scope markers"] * 4
        boundaries = [v for v in graph.saved if v.op == "aten.add" and v.region == "-"]
        assert len(boundaries) == 3  # the outputs of layers 1-3 feed layers 2-4
        assert {v.region for v in graph.saved if not v.is_input} == {"attn", "-"}
        # the whole forward is not recomputed at once: each layer's attention is kept
        assert sum(1 for v in graph.saved if v.region == "attn") == 8


class TestContainers:
    """A ModuleList / ModuleDict has no forward: wrapping it checkpointed nothing, silently
    (saved bytes = no checkpoint, nothing reported even under strict)."""

    @pytest.mark.parametrize(
        "container",
        [torch.nn.ModuleList([torch.nn.Linear(4, 4)]), torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4)})],
        ids=["ModuleList", "ModuleDict"],
    )
    def test_wrapping_a_container_is_an_error_naming_the_fix(self, container):
        with pytest.raises(
            TypeError, match=r"cannot wrap a Module(List|Dict): it has no forward.*Wrap each layer"
        ):
            sc.apply_selective_checkpointing(container, {"attn"})
        assert not _wrapped(container)

    def test_a_layers_pattern_matching_a_container_is_an_error_naming_the_pattern(self, stack):
        with pytest.raises(
            ValueError, match=r"layers='layers' matches ModuleList 'layers'.*layers='layers\.\*'"
        ):
            sc.SacConfig(layers="layers", keep={"attn"}, regions={"layers.*.attn": "attn"}).apply(stack)
        assert not any(_wrapped(m) for m in stack.modules())
        assert not sc.declare.declared_regions(stack)  # nothing half-applied

    def test_sequential_has_a_forward_and_is_wrapped(self):
        seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
        sc.apply_selective_checkpointing(seq, {"attn"})
        assert _wrapped(seq)


# One bad value per argument, and the message every entry point gives for it.
BAD_ARGUMENTS = [
    ({"keep": 5}, TypeError, "keep"),
    ({"policy": 3}, TypeError, "policy"),
    ({"budget": 2.0}, ValueError, "budget"),
    ({"offload": "mlp"}, TypeError, "offload must be a collection of region names"),
    ({"keep": {"attn"}, "offload": {"attn"}}, ValueError, "attn"),
]


@pytest.mark.parametrize("bad,error,says", BAD_ARGUMENTS)
def test_every_entry_point_refuses_a_bad_argument_with_the_one_check(bad, error, says):
    """Validation in one place: apply_selective_checkpointing, SacConfig, region_context_fn,
    make_sac_backend and the eager engine refuse the same value with the same message (one
    function makes it: sac_compile.arguments / Actions.of), before any work."""
    from sac_compile.eager import checkpoint_with_regions

    calls = {
        "apply_selective_checkpointing": lambda: sc.apply_selective_checkpointing(Block(16), **bad),
        "SacConfig": lambda: sc.SacConfig(layers="layers.*", **bad),
        "region_context_fn": lambda: sc.region_context_fn(**bad),
        "make_sac_backend": lambda: sc.make_sac_backend(**bad),
        "checkpoint_with_regions": lambda: checkpoint_with_regions(
            torch.sin, torch.ones(1), **{"keep": (), **bad}
        ),
    }
    messages = {}
    for name, call in calls.items():
        if name == "checkpoint_with_regions" and "budget" in bad:
            continue  # (the eager engine takes no budget)
        with pytest.raises(error) as raised:
            call()
        messages[name] = str(raised.value)
    assert all(says in m for m in messages.values()), messages
    assert len(set(messages.values())) == 1, messages


def test_sac_config_checks_its_arguments_once_and_wraps_with_them(stack):
    """A SacConfig checks every argument in its constructor (a bad one fails there, with no
    model) and ``apply`` wraps each layer with the value made then: the layer's stored
    configuration is the SacConfig's own object, per stack of layers."""
    with pytest.raises(TypeError, match="preserve_rng_state must be a bool"):
        sc.SacConfig(layers="layers.*", preserve_rng_state="yes")
    with pytest.raises(TypeError, match="compile must be a bool or a dict"):
        sc.SacConfig(layers="layers.*", compile="inductor")
    cfg = sc.SacConfig(layers="layers.*", keep={"attn"}, compile=AOT)
    cfg.apply(stack)
    (made,) = [s for _, s in cfg._seams]
    assert all(layer._sac_seam is made for layer in stack.layers)
    assert made == seam.SeamConfig.of({"attn"}, compile=AOT)  # what apply_selective_checkpointing makes
    again = dataclasses.replace(cfg, keep={"mlp"})  # a dict of options round-trips (red before)
    assert again._seams[0][1].compile_options == made.compile_options
