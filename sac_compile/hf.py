"""Hugging Face ``transformers`` models: checkpointing configurations for every stack.

``transformers`` is imported lazily; nothing here is needed unless you use it.

>>> config_for(model, keep={"attn", "experts"}, compile=True).apply(model)  # doctest: +SKIP
>>> config_for(vlm, keep={"model.language_model.layers": {"attn"}}).apply(vlm)  # doctest: +SKIP

A model's stacks (:func:`stacks`) are the lists of layers transformers itself checkpoints:
a vision tower's blocks, the language decoder's layers, an audio encoder's, both sides of an
encoder-decoder. :func:`regions_for` declares regions in every layer of every stack with one
vocabulary (:mod:`sac_compile.hf_layers` documents it); :func:`config_for`,
:func:`checkpointing_kwargs` and :func:`plan_for` cover every stack, with one keep set for
all or a keep set per stack.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ._compat.dynamo import unwrap_compiled
from .config import SacConfig
from .declare import declare_regions
from .hf_layers import LAYERS, REGION_NAMES, decoder_layers, read_stacks, regions_for, stacks, unchecked
from .keep import ALL_REGIONS, normalize_keep
from .planning import ModelPlan, plan_model
from .planning.peak import Peak
from .policy import SAVE_COSTLY

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
    model: nn.Module, keep: Any = (), *, include: Iterable[str] | None = None, **options: Any
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
    _report_unchecked(
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
        regions=_merged(read),
        **options,
    )


def plan_for(
    model: nn.Module,
    memory: Any,
    *,
    batch: int = 2,
    seq: int = 128,
    inputs: dict[str, Any] | None = None,
    include: Iterable[str] | None = None,
    device: Any = None,
    fsdp: int = 1,
    tp: int = 1,
    compile: bool = True,
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
    (bytes or ``"80GiB"``; None: the device's own) and the plan is the least recompute whose
    predicted step peak fits it (:mod:`sac_compile.planning.device_plan`): a
    :class:`~sac_compile.planning.device_plan.DevicePlan` with ``peak_bytes``, ``fits``,
    ``breakdown`` and ``step_seconds``, for ``batch`` x ``seq`` per device, FSDP and TP
    degrees ``fsdp`` / ``tp``, ``compile=True`` (compiled layers: keep sets and budgets) or
    ``False`` (the eager engine: keep sets only). A model on the meta device is planned at
    its real size without allocating (cast in place to the target's ``param_dtype``), traced
    with the target's attention kernel (:mod:`sac_compile.planning.kernels`). ``options``:
    ``budgets``, ``policies``, ``eager`` of :func:`sac_compile.planning.plan`."""
    read = read_stacks(model, include or ())
    _report_unchecked(
        model,
        include,
        "nor does this plan: include={include!r} plans them too (include=() leaves them out without this warning)",
    )
    patterns = tuple(f"{path}.*" for path, _ in read)
    if device is None:
        if inputs is None:
            ids = torch.randint(
                0, _vocab_size(model), (batch, seq), generator=torch.Generator().manual_seed(1)
            )
            inputs = {"input_ids": ids}
        return plan_model(
            model, layers=patterns, memory=memory, regions=_merged(read), use_cache=False, **inputs, **options
        )
    from .planning.device_plan import choose
    from .planning.devices import Target
    from .planning.kernels import target_kernels

    if isinstance(device, Target):
        target = device if memory is None else device.replace(memory=memory)
    else:
        dtype = next(unwrap_compiled(model).parameters()).dtype
        dtype = torch.bfloat16 if next(unwrap_compiled(model).parameters()).is_meta else dtype
        target = Target(device, memory=memory, fsdp=fsdp, tp=tp, batch=batch, seq=seq, param_dtype=dtype)
    root = unwrap_compiled(model)
    meta = any(p.is_meta for p in root.parameters())
    if meta:
        root.to(target.param_dtype)
    inputs = inputs if inputs is not None else _tokens(model, target, "meta" if meta else "cpu")
    if not compile:
        options.setdefault("budgets", (None,))
    options.setdefault("eager", not compile and not meta)
    with target_kernels(target.device.cuda):  # type: ignore[union-attr]
        planned = plan_model(
            model, layers=patterns, memory=1.0, regions=_merged(read), use_cache=False, **inputs, **options
        )
    params, sizes = _step_sizes(root, planned, target, inputs)
    text = _text_config(root)
    tokens = target.batch * target.seq
    head_flops = 6 * tokens * text.hidden_size * text.vocab_size
    return choose(
        planned.groups, params, sizes, target, compile=compile, layers=planned.layers, head_flops=head_flops
    )


def _tokens(model: nn.Module, target: Any, device: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, _vocab_size(model), (target.batch, target.seq), generator=g)
    return {"input_ids": ids.to(device)}


def _text_config(root: nn.Module) -> Any:
    return root.config.get_text_config() if hasattr(root.config, "get_text_config") else root.config


def _step_sizes(
    root: nn.Module, planned: ModelPlan, target: Any, inputs: dict[str, Any]
) -> tuple[tuple, Any]:
    """Per kind of layer, one layer's parameters; the model's sizes for the step's peak: its
    parameters and the head's terms (transformers' causal-LM loss upcasts the logits to
    float32: its ``log_softmax`` output is held, two gradients of that size live in its
    backward; the final norm saves three hidden-sized values)."""
    from .planning.peak import ModelSizes

    modules = dict(root.named_modules())
    params = tuple(sum(p.numel() for p in modules[g.paths[0]].parameters()) for g in planned.groups)
    text = _text_config(root)
    tokens = int(inputs["input_ids"].numel()) if "input_ids" in inputs else target.batch * target.seq
    width = torch.empty((), dtype=target.param_dtype).element_size()
    logits = tokens * text.vocab_size * 4
    sizes = ModelSizes(
        params=sum(p.numel() for p in root.parameters()),
        head_saved_bytes=logits + 3 * tokens * text.hidden_size * width,
        head_transient_bytes=2 * logits + (tokens * text.vocab_size * width if width != 4 else 0),
    )
    return params, sizes


def predict_peak(
    model: nn.Module,
    target: Any,
    keep: Any = None,
    *,
    inputs: dict[str, Any] | None = None,
    include: Iterable[str] | None = None,
) -> Peak:
    """The predicted peak of one training step of ``model`` on ``target`` (a
    :class:`~sac_compile.planning.devices.Target`), every stack's layers wrapped with the eager
    engine keeping ``keep`` (None: no checkpoint): ``step_figures(model, target).peak(keep)``."""
    return step_figures(model, target, inputs=inputs, include=include).peak(keep)


@dataclass(frozen=True)
class StepFigures:
    """What a step's peak is made of, measured once: one plan table per kind of layer, the
    model's sizes and the target. ``peak(keep)`` composes the step for a keep set."""

    target: Any
    plan: ModelPlan
    layer_params: tuple[int, ...]  # per group: parameters of one layer
    sizes: Any  # planning.peak.ModelSizes

    def peak(self, keep: Any = None) -> Peak:
        """The predicted peak with every layer keeping ``keep`` under the eager engine (None:
        no checkpoint)."""
        from .planning.peak import LayerFigures, step_peak

        keep_set = None if keep is None else normalize_keep(keep)
        layers = []
        for group, params in zip(self.plan.groups, self.layer_params):
            table = group.plan
            plain = table.no_checkpoint_eager_bytes or table.no_checkpoint_bytes
            if keep_set is None:
                saved, transient = plain, table.no_checkpoint_transient
            else:
                kept = (
                    frozenset(table.regions)
                    if keep_set is ALL_REGIONS
                    else frozenset(keep_set) & set(table.regions)
                )
                found = [c for c in table.candidates if c.keep == kept and c.budget is None]
                saved = found[0].eager_bytes or found[0].saved_bytes
                # the recompute restores what the layer would hold unchecked, then runs its backward
                transient = max(plain - saved, 0) + table.no_checkpoint_transient
            layers.append(LayerFigures(len(group.paths), params, saved, transient))
        return step_peak(self.sizes, layers, self.target)


def step_figures(
    model: nn.Module,
    target: Any,
    *,
    inputs: dict[str, Any] | None = None,
    include: Iterable[str] | None = None,
) -> StepFigures:
    """Measure what a training step of ``model`` on ``target`` (a
    :class:`~sac_compile.planning.devices.Target`) is made of: a causal-LM loss on
    ``target.batch`` x ``target.seq`` tokens (or ``inputs``), optimizer ``target.optimizer``.

    One layer of each kind of every stack is measured on this machine (what it holds for the
    backward without a checkpoint and with each keep set; the backward graph's transient:
    :func:`sac_compile.planning.plan`), and the model's terms are read from its sizes: its
    parameters, and the head's — the loss's ``log_softmax`` output and its two gradients
    (float32, batch x seq x vocab) and the final norm's saves.
    :func:`sac_compile.planning.peak.step_peak` composes the step. ``target.device`` must be one
    this machine runs as (``"cpu"``): a CUDA device's attention kernels save other values, which
    this does not trace yet."""
    from .planning.devices import Target

    if not isinstance(target, Target):
        raise TypeError(f"step_figures(target={target!r}): a sac_compile.planning.devices.Target")
    if target.device.cuda:  # type: ignore[union-attr]
        raise NotImplementedError(
            f"a step on {target.device.name}: layers are measured with this machine's kernels "  # type: ignore[union-attr]
            "(CPU attention saves the score matrix; CUDA's flash / efficient kernels do not); use device='cpu'"
        )
    read = read_stacks(model, include or ())
    _report_unchecked(model, include, "nor does this prediction: include={include!r} counts them too")
    if inputs is None:
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, _vocab_size(model), (target.batch, target.seq), generator=g)
        inputs = {"input_ids": ids}
    patterns = tuple(f"{path}.*" for path, _ in read)
    planned = plan_model(
        model, layers=patterns, memory=1.0, regions=_merged(read), use_cache=False, budgets=(None,), **inputs
    )
    params, sizes = _step_sizes(unwrap_compiled(model), planned, target, inputs)
    return StepFigures(target, planned, params, sizes)


def checkpointing_kwargs(
    model: nn.Module,
    keep: Any = (),
    *,
    policy: Any = SAVE_COSTLY,
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
    from .contexts import region_context_fn

    read = read_stacks(model)
    _report_unchecked(
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
    declare_regions(unwrap_compiled(model), _merged(read))
    context_fn = region_context_fn(
        keep_all, policy=policy, preserve_rng_state=preserve_rng_state, early_stop=early_stop
    )
    return {
        "use_reentrant": False,
        "context_fn": context_fn,
        "preserve_rng_state": preserve_rng_state,
        "early_stop": early_stop,
    }


def _report_unchecked(model: nn.Module, include: Iterable[str] | None, fix: str) -> None:
    """Warn, naming them, of the lists of layers transformers does not checkpoint that are left
    out (``include`` None: the caller named none)."""
    if include is not None:
        return
    left = unchecked(model)
    if left:
        lists = ", ".join(map(repr, left))
        warnings.warn(
            f"{type(unwrap_compiled(model)).__name__}: {lists} "
            f"{'is a list' if len(left) == 1 else 'are lists'} of layers transformers does not "
            f"checkpoint (held whole, as without checkpointing), {fix.format(include=list(left))}",
            UserWarning,
            stacklevel=3,
        )


def _merged(read: list[tuple[str, dict[str, str]]]) -> dict[str, str]:
    return {pattern: name for _, regions in read for pattern, name in regions.items()}


def _checked_keep(model: nn.Module, keep: Any, read: list[tuple[str, dict[str, str]]]) -> tuple[Any, dict]:
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


def _vocab_size(model: nn.Module) -> int:
    config = unwrap_compiled(model).config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return text.vocab_size


def batch(model: nn.Module, *, batch: int = 2, seq: int = 16, seed: int = 1) -> torch.Tensor:
    """Random token ids for ``model`` (also usable as labels)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)


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
        return self.layer(hidden_states, **self.kwargs)


def layer_call(model: nn.Module, ids: torch.Tensor, index: int = 0) -> tuple[LayerCall, torch.Tensor]:
    """``(LayerCall for decoder layer `index`, its input hidden states)``."""
    h, kwargs = layer_inputs(model, ids)
    return LayerCall(unwrap_compiled(model).model.layers[index], kwargs), h
