"""Where users switch checkpointing on: transformers' own switch and ``Trainer``, a plain
``torch.utils.checkpoint`` with ``region_context_fn``, and ``backend="sac_compile"`` by name.

Default transformers configs throughout (``use_cache=True``): checkpointed layers get
transformers' treatment of caches while training.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

pytest.importorskip("transformers")

import sac_compile as sc  # noqa: E402
from sac_compile import hf  # noqa: E402
from sac_compile.context_fn import region_context_fn  # noqa: E402

from .models import Block, bit_identical, lm_step  # noqa: E402
from .releases import every_release  # noqa: E402

INNER = "aot_eager"


def _llama(layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(  # use_cache=True: the default
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
    )
    assert cfg.use_cache is True
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").train()


def _ids():
    return torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))


def _held(model: nn.Module, ids: torch.Tensor) -> int:
    return sc.inspection.autograd_saved_bytes(
        lambda: model(input_ids=ids, labels=ids).loss, exclude=model.parameters()
    )


def _transformers_own(**kwargs):
    model = _llama()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False}, **kwargs)
    return model


# --- the seam on a default config ------------------------------------------------------------


def test_a_default_config_trains_through_the_seam_like_transformers_own_checkpointing(caplog, monkeypatch):
    """Red before: the recompute appended to the KV cache again ("aten.slice.Tensor ran during
    recompute but not in the forward")."""
    from sac_compile._compat import transformers as _transformers

    monkeypatch.setattr(_transformers, "_noted", set())  # (noted once per process)
    ids = _ids()
    want = lm_step(_transformers_own(), ids)
    model = _llama()
    hf.config_for(model, keep={"attn"}).apply(model)
    with caplog.at_level(logging.WARNING, logger="sac_compile"):
        got = [lm_step(model, ids) for _ in range(2)]
    assert all(bit_identical(g, want) for g in got)
    notes = [r.getMessage() for r in caplog.records if "caching is incompatible" in r.getMessage()]
    assert notes == [
        "sac_compile: caching is incompatible with activation checkpointing in LlamaDecoderLayer: calling it "
        "with use_cache=False, cache=None while it is checkpointed (grad enabled), as transformers' own "
        "checkpointing does while training (a cache written in the forward would be written again in the "
        "recompute)"
    ]


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_default_config_in_eval_mode_trains_through_the_seam_like_no_checkpoint(compiled):
    """``eval()`` with grad on (dropout off: reward models, RL): the model makes a KV cache
    (``use_cache=True`` by default) and the seam checkpoints, so caching is turned off as in
    training. Red before: "aten.slice.Tensor ran during the recompute of LlamaDecoderLayer"."""
    ids = _ids()
    want_loss, want = lm_step(_llama().eval(), ids)
    model = _llama().eval()
    hf.config_for(model, keep={"attn"}, compile={"inner": INNER} if compiled else False).apply(model)
    for _ in range(2):
        loss, got = lm_step(model, ids)
        if compiled:
            torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)
        else:
            assert bit_identical((loss, got), (want_loss, want))
    held = _held(model, ids)
    assert held < _held(_llama().eval(), ids)  # checkpointed in eval mode too


@pytest.mark.parametrize("how", ["per-layer", "whole-model"])
def test_a_default_config_trains_compiled_like_transformers_own_checkpointing(how):
    ids = _ids()
    want_loss, want = lm_step(_transformers_own(), ids)
    model = _llama()
    if how == "per-layer":
        hf.config_for(model, keep={"attn"}, compile={"inner": INNER}).apply(model)
    else:
        hf.config_for(model, keep={"attn"}).apply(model)
        model = torch.compile(model, backend=sc.make_sac_backend(sc.ALL_REGIONS, inner=INNER))
    with sc.inspection.collect_records() as recs:
        for _ in range(2):
            loss, got = lm_step(model, ids)
            torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)
    kept = [r.regions["attn"] for r in recs if r.is_training and "attn" in r.regions]
    assert kept and all(s.kept and s.saved_nodes > 0 for s in kept)


def test_checkpointing_a_layer_twice_is_refused():
    """transformers' own switch on top of the seam would nest a full-recompute checkpoint
    inside the selective one."""
    model = _llama()
    hf.config_for(model, keep={"attn"}).apply(model)
    model.activation_checkpointing_enable()
    with pytest.raises(
        ValueError, match=r"LlamaDecoderLayer is checkpointed twice.*activation_checkpointing_disable"
    ):
        model(input_ids=_ids(), labels=_ids())


class _CacheWriter(nn.Module):
    """Appends its keys to a transformers cache given as an argument (not a transformers layer,
    so nothing turns the cache off)."""

    def __init__(self) -> None:
        super().__init__()
        self.k = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, cache) -> torch.Tensor:
        k = self.k(x).unsqueeze(1)  # [batch, heads=1, seq, 8]
        keys, _ = cache.update(k, k, 0)
        if keys.shape[2] != k.shape[2]:  # past keys in the cache (as in transformers' SDPA path)
            keys = keys[:, :, -k.shape[2] :]
        return (keys * k).squeeze(1)


def test_a_recompute_running_other_ops_names_the_op_the_layer_and_the_cache():
    from transformers import DynamicCache

    layer = _CacheWriter()
    sc.declare_regions(layer, {"": "writer"})
    sc.apply_selective_checkpointing(layer, keep={"writer"})
    x = torch.randn(2, 4, 8, requires_grad=True)
    out = layer(x, DynamicCache())
    with pytest.raises(
        RuntimeError,
        match=r"aten\.\w+\.\w+ ran during the recompute of _CacheWriter but not in the forward.*"
        r"called with the cache argument 1 \(DynamicCache\).*use_cache=False",
    ):
        out.sum().backward()


# --- transformers' own switch: activation_checkpointing_kwargs --------------------------------


@pytest.mark.slow
def test_transformers_switch_keeps_regions_eagerly_bit_identical_to_its_own_checkpointing():
    ids = _ids()
    own = _transformers_own()
    want = lm_step(own, ids)
    model = _llama()
    model.activation_checkpointing_enable(
        activation_checkpointing_kwargs=hf.checkpointing_kwargs(model, keep={"attn"})
    )
    assert bit_identical(lm_step(model, ids), want)
    none, full, kept = _held(_llama(), ids), _held(own, ids), _held(model, ids)
    assert full < kept < none, (full, kept, none)
    every = _llama()
    every.activation_checkpointing_enable(
        activation_checkpointing_kwargs=hf.checkpointing_kwargs(every, keep=sc.ALL_REGIONS)
    )
    assert kept < _held(every, ids) <= none


@pytest.mark.slow
def test_every_n_layers_is_honoured():
    ids = _ids()
    model = _llama(layers=4)
    kwargs = hf.checkpointing_kwargs(model, keep={"attn"})
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, every_n_layers=2)
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False, True, False]
    all_layers = _llama(layers=4)
    all_layers.activation_checkpointing_enable(
        activation_checkpointing_kwargs=hf.checkpointing_kwargs(all_layers, keep={"attn"})
    )
    assert _held(all_layers, ids) < _held(model, ids) < _held(_llama(layers=4), ids)
    ref = _llama(layers=4)
    assert bit_identical(lm_step(model, ids), lm_step(ref, ids))


def test_the_kwargs_refuse_a_region_the_model_lacks():
    with pytest.raises(
        ValueError, match=r"LlamaForCausalLM has no region 'experts'; its layers have attn, mlp"
    ):
        hf.checkpointing_kwargs(_llama(), keep={"experts"})


def test_transformers_switch_compiled_marks_each_checkpoint_as_a_scope_with_its_keep_set():
    """Under the sac backend each transformers checkpoint is a scope with the kwargs' keep set
    (the backend's own, every region, does not apply), and the loss outside every scope stays
    untagged (red before: a "whole graph" scope recomputed the loss graph)."""
    ids = _ids()
    want_loss, want = lm_step(_transformers_own(), ids)
    model = _llama()
    model.activation_checkpointing_enable(
        activation_checkpointing_kwargs=hf.checkpointing_kwargs(model, keep={"attn"})
    )
    compiled = torch.compile(model, backend=sc.make_sac_backend(sc.ALL_REGIONS, inner=INNER))
    with sc.strict(), sc.inspection.collect_records() as recs:  # no diagnosis: none of them misfires
        for _ in range(2):
            loss, got = lm_step(compiled, ids)
            torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)
    training = [r for r in recs if r.is_training]
    scopes = [s for r in training for s in r.scopes]
    assert [(s.source, s.keep) for s in scopes] == [("scope markers", frozenset({"attn"}))] * 2
    stats = [r.regions for r in training if r.regions]
    assert stats and stats[0]["attn"].kept and stats[0]["attn"].saved_nodes > 0
    assert not stats[0]["mlp"].kept


def test_an_outer_saved_tensors_hook_still_sees_the_checkpoint_inputs():
    """What transformers' offload=True relies on (``save_on_cpu`` around the checkpoint: it
    needs pinned memory, so it cannot run on a CPU-only machine): the checkpoint's inputs go
    through the outer hooks, and the result is unchanged."""
    block = Block(d=16)
    x = torch.randn(2, 8, 16, requires_grad=True)
    ref = checkpoint(block, x, use_reentrant=False)
    ref.sum().backward()
    want = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    packed: list[torch.Size] = []

    def pack(t):
        packed.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = checkpoint(block, x, use_reentrant=False, context_fn=region_context_fn(keep={"attn"}))
    out.sum().backward()
    assert torch.equal(out, ref)
    assert all(torch.equal(p.grad, w) for p, w in zip(block.parameters(), want))
    assert x.shape in packed


# --- region_context_fn with a plain torch.utils.checkpoint ------------------------------------


def test_region_context_fn_gives_the_seams_engine():
    torch.manual_seed(0)
    a, b = Block(d=16), Block(d=16)
    b.load_state_dict(a.state_dict())
    sc.apply_selective_checkpointing(b, keep={"attn"})
    x = torch.randn(2, 8, 16, requires_grad=True)
    held_seam = sc.inspection.autograd_saved_bytes(lambda: b(x).sum(), exclude=list(b.parameters()) + [x])
    held_ctx = sc.inspection.autograd_saved_bytes(
        lambda: checkpoint(a, x, use_reentrant=False, context_fn=region_context_fn(keep={"attn"})).sum(),
        exclude=list(a.parameters()) + [x],
    )
    held_full = sc.inspection.autograd_saved_bytes(
        lambda: checkpoint(a, x, use_reentrant=False).sum(), exclude=list(a.parameters()) + [x]
    )
    assert held_ctx == held_seam > held_full
    a.zero_grad(), b.zero_grad()
    torch.manual_seed(1)
    out_a = checkpoint(a, x, use_reentrant=False, context_fn=region_context_fn(keep={"attn"}))
    out_a.sum().backward()
    ga = [p.grad.clone() for p in a.parameters()]
    torch.manual_seed(1)
    b(x).sum().backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(ga, b.parameters()))


def test_region_context_fn_validates_its_arguments():
    with pytest.raises(TypeError, match="keep=None is ambiguous"):
        region_context_fn(keep=None)
    with pytest.raises(TypeError, match="early_stop must be a bool"):
        region_context_fn(keep={"attn"}, early_stop="yes")
    block = Block(d=16)
    x = torch.randn(2, 8, 16, requires_grad=True)
    with pytest.raises(ValueError, match=r"region_context_fn: budget=0\.5 runs in the eager engine"):
        checkpoint(block, x, use_reentrant=False, context_fn=region_context_fn(keep={"attn"}, budget=0.5))


def test_region_context_fn_pickles():
    import pickle

    fn = region_context_fn(keep={"attn", "mlp"}, policy=sc.SAVE_ALL)
    again = pickle.loads(pickle.dumps(fn))
    assert again.func is fn.func and again.args == fn.args


# --- Trainer ---------------------------------------------------------------------------------


def _train(tmp_path, kind: str, compile_backend=None, steps: int = 3):
    from transformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": (t := torch.randint(0, 128, (32,), generator=g)), "labels": t} for _ in range(8)]
    model = _llama()
    if kind == "transformers":
        kwargs = {"use_reentrant": False}
    else:
        kwargs = hf.checkpointing_kwargs(model, keep={"attn"})
    if compile_backend is not None:
        model.compile(backend=compile_backend)
    args = TrainingArguments(
        output_dir=str(tmp_path / kind),
        max_steps=steps,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        activation_checkpointing=True,  # (gradient_checkpointing=True, its deprecated alias, too)
        activation_checkpointing_kwargs=kwargs,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer


@pytest.mark.slow
def test_trainer_trains_with_regions_kept_eagerly(tmp_path):
    want, own = _train(tmp_path, "transformers")
    got, trainer = _train(tmp_path, "sac")
    assert got == want and len(got) == 3  # bit-identical losses, step by step
    model, ids = trainer.model.train(), _ids()
    assert _held(own.model.train(), ids) < _held(model, ids) < _held(_llama(), ids)


@pytest.mark.slow
@every_release
def test_trainer_trains_compiled_with_the_named_backend(tmp_path):
    """``model.compile(backend="sac_compile")`` before the Trainer (accelerate's
    ``torch_compile_backend`` takes only the backends it lists: see docs/integrations.md)."""
    want, _ = _train(tmp_path, "transformers")
    with sc.inspection.collect_records() as recs:
        got, _ = _train(tmp_path, "sac", compile_backend="sac_compile")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5)
    scopes = [s for r in recs if r.is_training for s in r.scopes]
    assert scopes and all(s.keep == frozenset({"attn"}) for s in scopes)
    assert any(r.regions.get("attn") is not None and r.regions["attn"].saved_nodes for r in recs)


# --- backend="sac_compile" by name ------------------------------------------------------------


@pytest.mark.subprocess
@every_release
def test_the_backend_is_found_by_name_in_a_process_that_never_imported_sac_compile():
    code = textwrap.dedent(
        """
        import sys, torch
        from torch.utils.checkpoint import checkpoint
        lin = torch.nn.Linear(8, 8)
        def f(x):
            return checkpoint(lambda y: lin(torch.relu(lin(y))), x, use_reentrant=False).sum()
        x = torch.randn(4, 8)
        assert "sac_compile" not in sys.modules
        out = torch.compile(f, backend="sac_compile")(x)
        out.backward()
        import sac_compile
        assert torch._dynamo.lookup_backend("sac_compile") is sac_compile.sac_backend
        torch.testing.assert_close(out, f(x))
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
