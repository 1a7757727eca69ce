"""Hugging Face ``transformers`` models: checkpointing configurations for every stack.

``transformers`` is imported lazily; nothing here is needed unless you use it.

>>> config_for(model, keep={"attn", "experts"}, compile=True).apply(model)  # doctest: +SKIP
>>> config_for(vlm, keep={"model.language_model.layers": {"attn"}}).apply(vlm)  # doctest: +SKIP

A model's stacks (:func:`stacks`) are the lists of layers transformers itself checkpoints:
a vision tower's blocks, the language decoder's layers, an audio encoder's, both sides of an
encoder-decoder. :func:`regions_for` declares regions in every layer of every stack with one
vocabulary (:mod:`sac_compile.hf.layers` documents it); :func:`config_for`,
:func:`checkpointing_kwargs` and :func:`plan_for` cover every stack, with one keep set for
all or a keep set per stack.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, cast, overload

import torch
import torch.nn as nn

from .._compat.dynamo import forward_side_effects_under_checkpoint, unwrap_compiled
from .._compat.transformers import kernelized_classes
from ..config import SacConfig
from ..declare import declare_regions
from ..keep import ALL_REGIONS, Keep, Regions, normalize_keep
from ..memory import Memory
from ..planning import ModelPlan, plan_model
from ..policy import SAVE_COSTLY, RegionPolicy
from .layers import (
    LAYERS,
    REGION_NAMES,
    decoder_layers,
    merged,
    read_stacks,
    regions_for,
    report_unchecked,
    stacks,
    unchecked,
    vocab_size,
)
from .plan import StepFigures, predict_peak, step_figures

if TYPE_CHECKING:
    from ..planning.device_plan import DevicePlan
    from ..planning.devices import Device, Target

__all__ = [
    "LAYERS",
    "REGION_NAMES",
    "LayerCall",
    "batch",
    "checkpointing_kwargs",
    "config_for",
    "decoder_layers",
    "layer_call",
    "layer_inputs",
    "plan_for",
    "StepFigures",
    "predict_peak",
    "step_figures",
    "regions_for",
    "stacks",
    "unchecked",
]


def config_for(
    model: nn.Module, keep: Keep = (), *, include: Iterable[str] | None = None, **options: Any
) -> SacConfig:
    """A :class:`SacConfig` checkpointing every layer of every stack of ``model`` (:func:`stacks`)
    with its regions declared (:func:`regions_for`).

    ``keep``: region names (or ``ALL_REGIONS``) kept in every stack, or ``{stack path: keep
    set}`` for a keep set per stack (``{"model.language_model.layers": {"attn"}}``: attention
    kept in the language decoder, the vision tower fully recomputed); a stack the mapping does
    not name keeps nothing (full recompute: it is still checkpointed). A name no layer of
    this model has, or a key that is not a stack, is a ``ValueError`` here.

    ``include``: lists of layers transformers does not checkpoint (:func:`unchecked`: Mllama's
    vision encoder, Idefics2's perceiver resampler) to checkpoint too, read and kept like a
    stack (``keep`` may name them). Left as None while the model has such lists, they are not
    checkpointed and a ``UserWarning`` names them; ``include=()`` leaves them out quietly."""
    read = read_stacks(model, include or ())  # the stacks are found once
    report_unchecked(
        model,
        include,
        "nor does this configuration: include={include!r} checkpoints them too (include=() leaves them out "
        "without this warning)",
    )
    keep_all, per_stack = _checked_keep(model, keep, read)
    patterns = tuple(f"{path}.*" for path, _ in read)
    return SacConfig(
        layers=patterns[0] if len(patterns) == 1 else patterns,
        keep=keep_all,
        stack_keep={f"{path}.*": k for path, k in per_stack.items()},
        regions=merged(read),
        **options,
    )


@overload
def plan_for(
    model: nn.Module,
    memory: int | float,
    *,
    batch: int = 2,
    seq: int = 128,
    inputs: dict[str, Any] | None = None,
    include: Iterable[str] | None = None,
    device: None = None,
    fsdp: int = 1,
    tp: int = 1,
    ep: int = 1,
    compile: bool = True,
    loss: str | None = None,
    **options: Any,
) -> ModelPlan: ...


@overload
def plan_for(
    model: nn.Module,
    memory: Memory | None,
    *,
    batch: int = 2,
    seq: int = 128,
    inputs: dict[str, Any] | None = None,
    include: Iterable[str] | None = None,
    device: str | Device | Target,
    fsdp: int = 1,
    tp: int = 1,
    ep: int = 1,
    compile: bool = True,
    loss: str | None = None,
    **options: Any,
) -> DevicePlan: ...


def plan_for(
    model: nn.Module,
    memory: Memory | None,
    *,
    batch: int = 2,
    seq: int = 128,
    inputs: dict[str, Any] | None = None,
    include: Iterable[str] | None = None,
    device: str | Device | Target | None = None,
    fsdp: int = 1,
    tp: int = 1,
    ep: int = 1,
    compile: bool = True,
    loss: str | None = None,
    **options: Any,
) -> ModelPlan:
    """Plan the layers of every stack of ``model``, one plan per kind of layer (dense and MoE
    layers, vision blocks and decoder layers apart), measured on ``inputs`` (the model's
    keyword arguments: a vision-language model's ``pixel_values`` and the rest) or, without
    them, a random batch of ``batch`` x ``seq`` tokens; declares the regions
    (:func:`regions_for`). A stack whose layers do not run on the inputs (a vision tower fed
    text only) is a ``ValueError`` naming it. ``include`` as in :func:`config_for`.
    ``.apply(model)`` wraps the layers.

    Without ``device``, ``memory`` is per layer (bytes, or a fraction of a layer's
    no-checkpoint bytes). With ``device`` (a kind of :data:`sac_compile.planning.devices.DEVICES`,
    ``"cpu"``, or a :class:`~sac_compile.planning.devices.Target`), ``memory`` is the device's
    (bytes, ``"80GiB"``, or a fraction of the device's memory, :mod:`sac_compile.memory`; None:
    the device's own) and the plan is the least recompute whose
    predicted step peak fits it (:mod:`sac_compile.planning.device_plan`): a
    :class:`~sac_compile.planning.device_plan.DevicePlan` with ``peak_bytes``, ``fits``,
    ``reserved_bytes``, ``breakdown`` and ``step`` (time, tokens/s, MFU), for ``batch`` x ``seq`` per device, FSDP, TP and
    expert-parallel degrees ``fsdp`` / ``tp`` / ``ep``, ``compile=True`` (compiled layers: keep sets and budgets) or
    ``False`` (the eager engine: keep sets only). A model on the meta device is planned at
    its real size without allocating (cast in place to the target's ``param_dtype``), traced
    with the target's attention kernel (:mod:`sac_compile.planning.kernels`). ``options``:
    ``budgets``, ``policies``, ``eager`` of :func:`sac_compile.planning.plan`. ``loss``
    (with ``device``): how the trainer's loss holds the logits,
    :data:`sac_compile.planning.devices.LOSSES` (default ``"transformers"``; a ``Target``
    passed as ``device`` carries its own)."""
    _check_plan_for(memory, batch, seq, device, loss)
    read = read_stacks(model, include or ())
    report_unchecked(
        model,
        include,
        "nor does this plan: include={include!r} plans them too (include=() leaves them out without this warning)",
    )
    patterns = tuple(f"{path}.*" for path, _ in read)
    if device is None:
        if inputs is None:
            ids = torch.randint(
                0, vocab_size(model), (batch, seq), generator=torch.Generator().manual_seed(1)
            )
            inputs = {"input_ids": ids}
        return plan_model(
            model,
            layers=patterns,
            memory=cast("int | float", memory),  # (a str or None refused above)
            regions=merged(read),
            use_cache=False,
            **inputs,
            **options,
        )
    from .plan import plan_for_device

    parallel = {"fsdp": fsdp, "tp": tp, "ep": ep, "loss": loss}
    return plan_for_device(model, memory, read, batch, seq, inputs, device, parallel, compile, options)


def _check_plan_for(memory: object, batch: object, seq: object, device: object, loss: object) -> None:
    """``plan_for``'s arguments checked before any work."""
    for name, value in (("batch", batch), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"plan_for({name}={value!r}): a positive int ({'sequences' if name == 'batch' else 'tokens a sequence'} "
                "per device)"
            )
    if device is None and (memory is None or isinstance(memory, str)):
        raise TypeError(
            f"plan_for(memory={memory!r}) without device=: per layer, bytes (an int) or a fraction of each "
            "layer's no-checkpoint bytes (a float); a device's memory ('80GB', None: the device's own) needs "
            "device=..."
        )
    if loss is not None and device is None:
        raise ValueError(
            f"plan_for(loss={loss!r}) without device=: the loss is part of a device's step (pass device=...)"
        )


def checkpointing_kwargs(
    model: nn.Module,
    keep: Keep = (),
    *,
    policy: RegionPolicy = SAVE_COSTLY,
    offload: Regions = (),
    preserve_rng_state: bool = True,
    early_stop: bool = True,
) -> dict[str, Any]:
    """Keyword arguments for transformers' own activation-checkpointing switch that keep
    ``model``'s regions in ``keep``; declares the regions on ``model`` (:func:`regions_for`).

    >>> kwargs = checkpointing_kwargs(model, keep={"attn"})             # doctest: +SKIP
    >>> model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)  # doctest: +SKIP
    >>> TrainingArguments(..., gradient_checkpointing=True, gradient_checkpointing_kwargs=kwargs)  # doctest: +SKIP

    transformers calls ``torch.utils.checkpoint.checkpoint(layer.forward, ..., **kwargs)``
    for each layer of every stack (turning cache writes off while training, honouring
    ``every_n_layers``); the ``context_fn`` among these kwargs
    (:func:`sac_compile.region_context_fn`) runs the eager engine there, and under
    ``torch.compile`` with the ``"sac_compile"`` backend marks each checkpoint as a scope
    with this keep set. ``offload=True`` moves what the checkpoint saves of each layer's
    inputs to the host; the values kept regions hold stay where they were made.

    ``keep`` is as in :func:`config_for`. transformers hands every layer the same
    ``context_fn``, so a keep set per stack is made by declaring in each stack only the
    regions it keeps. A ``keep`` name no layer of ``model`` has is a ``ValueError``.
    """
    from ..context_fn import region_context_fn

    read = read_stacks(model)
    report_unchecked(
        model,
        None,
        "nor does transformers' switch with these kwargs: "
        "sac_compile.hf.config_for(model, keep, include={include!r}).apply(model) checkpoints them with the rest",
    )
    keep_all, per_stack = _checked_keep(model, keep, read)
    if per_stack:
        keeps = [per_stack.get(path, keep_all) for path, _ in read]
        read = [(path, {p: n for p, n in r.items() if n in k}) for (path, r), k in zip(read, keeps)]
        keep_all = ALL_REGIONS if ALL_REGIONS in keeps else frozenset().union(*keeps)
    declare_regions(unwrap_compiled(model), merged(read))
    _trace_kernelized_forwards(model)
    context_fn = region_context_fn(
        keep_all, policy=policy, offload=offload, preserve_rng_state=preserve_rng_state, early_stop=early_stop
    )
    return {
        "use_reentrant": False,
        "context_fn": context_fn,
        "preserve_rng_state": preserve_rng_state,
        "early_stop": early_stop,
    }


def _trace_kernelized_forwards(model: nn.Module) -> None:
    """transformers 5.25+ wraps each attention's forward with kernels' function router, which
    sets a context variable while Dynamo traces: refused inside ``torch.utils.checkpoint``, that
    breaks the graph at every layer transformers checkpoints under ``torch.compile`` (so no
    checkpoint becomes a scope, PyTorch's own as much as ours). Dynamo's switch for it is turned
    on, process-wide, and said once (:func:`~sac_compile._compat.transformers.kernelized_classes`)."""
    classes = kernelized_classes(unwrap_compiled(model))
    if classes and forward_side_effects_under_checkpoint():
        logging.getLogger("sac_compile").warning(
            "sac_compile: set torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True "
            "(process-wide): the forward of %s sets the context variable of kernels' function router "
            "(transformers' kernelized functions), a side effect Dynamo refuses inside "
            "torch.utils.checkpoint; under torch.compile every checkpointed layer would break the graph. "
            "The router sets and resets it: there is nothing for the recompute to replay",
            ", ".join(classes),
        )


def _checked_keep(
    model: nn.Module, keep: Any, read: list[tuple[str, dict[str, str]]]
) -> tuple[Any, dict[str, Any]]:
    """``(keep set for every stack, {stack path: its own keep set})``, each name checked
    against the regions of the stacks it applies to."""
    have = {path: set(regions.values()) for path, regions in read}
    name = type(unwrap_compiled(model)).__name__
    if not isinstance(keep, Mapping):
        return _known(name, normalize_keep(keep), set().union(*have.values()), "its layers"), {}
    per_stack = {}
    for key, value in keep.items():
        path = key[:-2] if isinstance(key, str) and key.endswith(".*") else key
        if path not in have:
            raise ValueError(
                f"keep={{{key!r}: ...}}: {name} has no stack {key!r}; its stacks are "
                f"{', '.join(map(repr, have))} (sac_compile.hf.stacks(model))"
            )
        per_stack[path] = _known(name, normalize_keep(value), have[path], f"its stack {path!r}")
    return frozenset(), per_stack


def _known(model_name: str, keep_set: Any, have: set[str], where: str) -> Any:
    if keep_set is not ALL_REGIONS:
        missing = sorted(set(keep_set) - have)
        if missing:
            raise ValueError(
                f"keep={sorted(keep_set)}: {model_name} has no region "
                f"{', '.join(repr(m) for m in missing)}; {where} have {', '.join(sorted(have))} "
                f"(sac_compile.hf.regions_for(model) lists where)"
            )
    return keep_set


def batch(model: nn.Module, *, batch: int = 2, seq: int = 16, seed: int = 1) -> torch.Tensor:
    """Random token ids for ``model`` (also usable as labels)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cast(Any, model.config).vocab_size, (batch, seq), generator=g)


def layer_inputs(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """``(hidden_states, kwargs)`` to call one decoder layer as the model does (no padding)."""
    from transformers.masking_utils import create_causal_mask

    inner = unwrap_compiled(model).model
    h = inner.embed_tokens(ids).detach().requires_grad_(True)
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    cos_sin = inner.rotary_emb(h, position_ids=pos)
    mask = create_causal_mask(
        config=model.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=pos
    )
    return h, {"attention_mask": mask, "position_embeddings": cos_sin, "position_ids": pos}


class LayerCall(nn.Module):
    """One decoder layer called as the model calls it, as a one-argument module
    (for ``capture_partition`` / ``parity_report`` on a single layer)."""

    def __init__(self, layer: nn.Module, kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.layer = layer
        self.kwargs = kwargs

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layer(hidden_states, **self.kwargs)
        return out


def layer_call(model: nn.Module, ids: torch.Tensor, index: int = 0) -> tuple[LayerCall, torch.Tensor]:
    """``(LayerCall for decoder layer `index`, its input hidden states)``."""
    h, kwargs = layer_inputs(model, ids)
    return LayerCall(unwrap_compiled(model).model.layers[index], kwargs), h
