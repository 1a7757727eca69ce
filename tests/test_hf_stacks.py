"""Every stack of a model: vision-language models' vision towers and language decoders.

``sac_compile.hf`` reads every list of layers transformers itself checkpoints
(``hf.stacks``), declares regions in each with one vocabulary, and wraps each. Tiny random
LLaVA, Qwen2.5-VL and Gemma-3 models trained on a batch with images
(``sac_compile.testing.hf_vision``): gradients equal transformers' own checkpointing (eager
exactly, compiled per layer within 1e-4), through ``config_for`` and through transformers'
switch with ``checkpointing_kwargs``; each stack's held bytes rise from full recompute to
keeping attention to not checkpointing it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

pytest.importorskip("transformers")

import sac_compile as sc  # noqa: E402
from sac_compile import hf  # noqa: E402
from sac_compile.testing import hf_vision  # noqa: E402

from .releases import TORCH, beyond, default_torch_only  # noqa: E402

FAMILIES = ["llava", "qwen2_5_vl", "gemma3"]  # (hf_vision.FAMILIES holds more: benchmarks)
STACKS = {
    "llava": ("model.vision_tower.encoder.layers", "model.language_model.layers"),
    "qwen2_5_vl": ("model.visual.blocks", "model.language_model.layers"),
    "gemma3": ("model.vision_tower.encoder.layers", "model.language_model.layers"),
}


def _step(model: nn.Module, inputs: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _transformers_own(name: str, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model, inputs = hf_vision.build(name)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False, **kwargs})
    return _step(model, inputs)


def _held(model: nn.Module, inputs: dict) -> int:
    return sc.inspection.autograd_saved_bytes(lambda: model(**inputs).loss, exclude=model.parameters())


def _equal(got, want) -> None:
    (loss, grads), (want_loss, want_grads) = got, want
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want_grads.keys()
    assert [k for k in grads if not torch.equal(grads[k], want_grads[k])] == []


@pytest.mark.parametrize("name", FAMILIES)
def test_every_stack_is_read_with_one_vocabulary(name):
    model, _ = hf_vision.build(name)
    assert hf.stacks(model) == STACKS[name]
    assert hf.unchecked(model) == ()  # nothing left out: no warning from config_for
    assert hf.decoder_layers(model) == "model.language_model.layers.*"
    regions = hf.regions_for(model)
    for stack in STACKS[name]:
        assert {r for p, r in regions.items() if p.startswith(f"{stack}.")} == {"attn", "mlp"}, regions
    vision_grads = _step(model, hf_vision.build(name)[1])[1]
    assert any(k.startswith(STACKS[name][0]) and g.abs().sum() > 0 for k, g in vision_grads.items())


@pytest.mark.parametrize("name", FAMILIES)
def test_eager_keep_attn_in_every_stack_equals_transformers_own_checkpointing(name):
    want = _transformers_own(name)
    model, inputs = hf_vision.build(name)
    cfg = hf.config_for(model, keep={"attn"})
    assert cfg.layers == tuple(f"{s}.*" for s in STACKS[name])
    cfg.apply(model)
    wrapped = [p for p, m in model.named_modules() if getattr(m, "_sac_seam", None) is not None]
    assert {p.rsplit(".", 1)[0] for p in wrapped} == set(STACKS[name])  # every layer of both stacks
    with sc.inspection.collect_records() as recs:
        _equal(_step(model, inputs), want)
    assert recs == []  # eager: nothing compiled


@pytest.mark.parametrize("name", FAMILIES)
def test_transformers_switch_with_checkpointing_kwargs_keeps_regions_in_every_stack(name):
    want = _transformers_own(name)
    model, inputs = hf_vision.build(name)
    kwargs = hf.checkpointing_kwargs(model, keep={"attn"})
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    _equal(_step(model, inputs), want)
    plain, _ = hf_vision.build(name)
    plain.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert _held(plain, inputs) < _held(model, inputs)  # attention kept: more than full recompute
    declared = sc.declare.declared_regions(model)
    for stack in STACKS[name]:
        assert ("attn",) in [names for p, names in declared.items() if p.startswith(f"{stack}.")]


@pytest.mark.slow
@default_torch_only  # the seam's and engine's bytes on every release: test_hf, test_hf_families
@pytest.mark.parametrize("name", beyond(FAMILIES, "llava", "qwen2_5_vl"))
def test_each_stack_holds_full_below_keep_attn_below_no_checkpoint(name):
    model, inputs = hf_vision.build(name)
    regions = hf.regions_for(model)
    patterns = tuple(f"{s}.*" for s in STACKS[name])

    def held(config: sc.SacConfig | None) -> int:
        model, inputs = hf_vision.build(name)
        if config is not None:
            config.apply(model)
        return _held(model, inputs)

    full = held(sc.SacConfig(layers=patterns, regions=regions))
    for stack, pattern in zip(STACKS[name], patterns):
        others = tuple(p for p in patterns if p != pattern)
        attn = held(hf.config_for(model, keep={stack: {"attn"}}))  # the others: full recompute
        unwrapped = held(sc.SacConfig(layers=others, regions=regions))
        assert full < attn < unwrapped, (stack, full, attn, unwrapped)
    assert max(full, attn) < held(None)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2_5_vl"] if TORCH > (2, 13) else beyond(FAMILIES, "llava", "gemma3"))
def test_compiled_per_layer_matches_transformers_own_checkpointing(name):
    want_loss, want = _transformers_own(name)
    model, inputs = hf_vision.build(name)
    hf.config_for(model, keep={"attn"}, compile={"inner": "aot_eager"}).apply(model)
    with sc.inspection.collect_records() as recs:
        loss, got = _step(model, inputs)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=k)
    kept = [r.regions["attn"] for r in recs if r.is_training and "attn" in r.regions]
    assert len(kept) >= 2 and all(s.kept and s.saved_nodes > 0 for s in kept)  # a graph per stack's layer


@pytest.mark.slow
def test_a_keep_set_per_stack():
    name = "llava"
    vision, language = STACKS[name]
    model, _ = hf_vision.build(name)
    cfg = hf.config_for(model, keep={language: {"attn"}})
    assert cfg.keep == frozenset() and cfg.stack_keep == ((f"{language}.*", frozenset({"attn"})),)
    cfg.apply(model)
    keeps = {
        p.rsplit(".", 1)[0]: m._sac_seam.actions.keep
        for p, m in model.named_modules()
        if hasattr(m, "_sac_seam")
    }
    assert keeps == {vision: frozenset(), language: frozenset({"attn"})}
    # through transformers' switch: the vision tower declares none of the regions it does not keep
    model, inputs = hf_vision.build(name)
    kwargs = hf.checkpointing_kwargs(model, keep={f"{language}.*": {"attn"}})
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    _equal(_step(model, inputs), _transformers_own(name))
    switch_held = _held(model, inputs)
    model, inputs = hf_vision.build(name)
    hf.config_for(model, keep={language: {"attn"}}).apply(model)
    assert switch_held == _held(model, inputs)


def test_bad_stack_keeps_are_refused():
    model, _ = hf_vision.build("llava")
    with pytest.raises(ValueError, match=r"has no stack 'model\.visual\.blocks'; its stacks are "):
        hf.config_for(model, keep={"model.visual.blocks": {"attn"}})
    with pytest.raises(ValueError, match=r"has no region 'experts'; its stack 'model.vision_tower"):
        hf.config_for(model, keep={"model.vision_tower.encoder.layers": {"experts"}})
    with pytest.raises(ValueError, match="stack_keep names 'x.*', which is not one of layers"):
        sc.SacConfig(layers="model.language_model.layers.*", stack_keep={"x.*": ()})


@pytest.mark.slow
@default_torch_only  # planning on every release: test_planning
def test_plan_for_plans_every_stack_and_names_a_stack_the_inputs_do_not_run():
    model, inputs = hf_vision.build("llava")
    with pytest.raises(ValueError, match=r"no layer of 'model\.vision_tower\.encoder\.layers\.\*' ran"):
        hf.plan_for(model, 1.0, seq=16)
    model, inputs = hf_vision.build("llava")
    inputs = {k: v for k, v in inputs.items() if k != "labels"}
    plan = hf.plan_for(model, 1.0, inputs=inputs, budgets=(None,))
    assert {g.kind for g in plan.groups} == {"CLIPEncoderLayer", "LlamaDecoderLayer"}
    plan.apply(model)
    wrapped = {p.rsplit(".", 1)[0] for p, m in model.named_modules() if hasattr(m, "_sac_seam")}
    assert wrapped == set(STACKS["llava"])


MLLAMA_VISION = ("model.vision_model.transformer.layers", "model.vision_model.global_transformer.layers")


def test_lists_of_layers_transformers_does_not_checkpoint_are_reported_or_included():
    """Mllama's vision encoder layers are not transformers checkpointing layers: its switch and
    hf's stacks leave them out. That is a warning naming them, never silence; ``include=``
    checkpoints them with the same regions (gradients bit-identical, held bytes lower)."""
    from sac_compile.testing._dev import hf_multimodal

    model, inputs = hf_multimodal.build("mllama")
    assert hf.stacks(model) == ("model.language_model.layers",)
    assert hf.unchecked(model) == MLLAMA_VISION
    for call in (hf.config_for, hf.checkpointing_kwargs):
        with pytest.warns(
            UserWarning, match=r"'model\.vision_model\.transformer\.layers', .*global_transformer"
        ):
            call(model, keep={"attn"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet = hf.config_for(model, keep={"attn"}, include=())
    assert quiet.layers == "model.language_model.layers.*"
    with pytest.raises(
        ValueError, match=r"include='model\.vision_model': .* those are 'model\.vision_model\.transformer"
    ):
        hf.config_for(model, include=["model.vision_model"])

    def trained(include) -> tuple[int, tuple]:
        model, inputs = hf_multimodal.build("mllama")
        cfg = hf.config_for(model, keep={"model.language_model.layers": {"attn"}}, include=include)
        cfg.apply(model)
        return _held(model, inputs), _step(model, inputs)

    want = _step(*hf_multimodal.build("mllama"))
    left_out, got_left_out = trained(())
    included, got_included = trained(MLLAMA_VISION)
    _equal(got_left_out, want)
    _equal(got_included, want)
    assert included < left_out  # the vision encoder's activations are checkpointed too
