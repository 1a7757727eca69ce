"""Hugging Face ``transformers`` decoder models: region declarations and tiny test models.

``transformers`` is imported lazily; nothing here is needed unless you use it.

>>> model = tiny_qwen3_moe()                       # random weights, no download
>>> config_for(model, keep={"attn", "experts"}, compile=True).apply(model)  # doctest: +SKIP

:func:`regions_for` reads each decoder layer's children by type and structure (not by
fixed paths), so mixed layers are declared layer by layer: dense first layers of
DeepSeek-V3, Qwen3-MoE's ``mlp_only_layers``, hybrid Jamba / Granite-MoE-hybrid layers.
One vocabulary of region names (:data:`REGION_NAMES`):

==================  ============================================================
region              what it declares in a decoder layer
==================  ============================================================
``attn``            the self-attention module (``*Attention*``: ``self_attn``,
                    ``attn``, ``attention``, ``self_attention``)
``cross_attn``      a cross-attention module (``encoder_attn``, ``crossattention``)
``mixer``           a token mixer that is not softmax attention: state-space
                    (``*Mamba*``, ``*Mixer``), recurrent (RG-LRU, xLSTM), linear
                    attention (``linear_attn``, gated DeltaNet), short convolution
``mlp``             a dense feed-forward module (``*MLP`` / ``*FeedForward`` /
                    ``*FFN*``: ``mlp``, ``feed_forward``, ``ffn``), or a pair of
                    sibling modules (``fc1`` + ``fc2``; BERT-style
                    ``intermediate`` + ``output``)
``router``          an MoE block's router (``*Router`` / ``*Gating``, ``gate``)
``experts``         an MoE block's routed experts (``experts``, every
                    ``*Experts`` child)
``shared_experts``  an MoE block's shared expert(s), or a dense MLP beside the MoE
                    block in the same layer
==================  ============================================================

Layer glue (norms, residual scaling, hyper-connections, per-layer input gates) is in
no region; any other child with parameters that fits none of these, in the layer or
in its MoE block, is an error naming it, never silently left out.

MoE experts in transformers 5.x run through a selectable implementation
(``config._experts_implementation``): ``"grouped_mm"`` (the default; one
grouped GEMM per projection, under ``torch.compile`` an opaque custom op) or
``"eager"`` (a Python loop over the experts hit, accumulating with
``index_add_``; its ``nonzero`` is a graph break under ``torch.compile``, so
that loop runs uncompiled). Both are supported; see README for what each gives.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ._compat.dynamo import unwrap_compiled
from .config import SacConfig
from .declare import declare_regions
from .keep import ALL_REGIONS, normalize_keep
from .planning import ModelPlan, plan_model
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
    "regions_for",
]

#: The decoder layers of Llama-style ``*ForCausalLM`` models (:func:`decoder_layers` finds
#: any family's).
LAYERS = "model.layers.*"

#: The region names :func:`regions_for` declares.
REGION_NAMES = ("attn", "cross_attn", "mixer", "mlp", "router", "experts", "shared_experts")

_MLP_NAMES = ("mlp", "feed_forward", "ffn", "mlp_block", "shared_mlp")
_ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention", "self_att")
_CROSS_NAMES = ("cross_attn", "crossattention", "encoder_attn", "cross_attention")
#: class-name parts of token mixers that are not softmax attention: state-space
#: (Mamba), recurrent (RG-LRU, xLSTM), linear attention (gated DeltaNet), short convolution
_MIXER_PARTS = ("mamba", "mixer", "deltanet", "recurrent", "lstm", "shortconv")
_MIXER_NAMES = ("mamba", "mixer", "linear_attn", "conv", "temporal_block")
#: a dense feed-forward made of two sibling modules in the layer (the activation
#: between them runs in the layer's own forward, outside the region)
_MLP_PAIRS = (("fc1", "fc2"), ("intermediate", "output"))
#: layer glue that belongs to no region and runs with the layer (recomputed by a
#: checkpoint): norms, residual scaling / gating, hyper-connections, per-layer input gates
_GLUE_PARTS = ("norm", "residual", "scaling", "scale", "hyperconnection", "per_layer")


def _component(module: nn.Module, parent: nn.Module) -> str:
    """The lower-cased class name of ``module`` less the family prefix it shares with
    ``parent``'s (``RecurrentGemmaMlp`` in ``RecurrentGemmaDecoderLayer`` -> ``mlp``), so a
    family name (RecurrentGemma, FalconMamba, Mixtral) is not read as a component."""
    cls, outer = type(module).__name__, type(parent).__name__
    n = 0
    while n < min(len(cls), len(outer)) and cls[n] == outer[n]:
        n += 1
    while 0 < n < len(cls) and not cls[n].isupper():
        n -= 1  # back to the start of a CamelCase word
    return cls[n:].lower() if n < len(cls) else cls.lower()


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _is_glue(name: str, module: nn.Module, parent: nn.Module) -> bool:
    part = _component(module, parent)
    return any(k in part or k in name for k in _GLUE_PARTS) or not _has_parameters(module)


def _kind(name: str, module: nn.Module, parent: nn.Module) -> str | None:
    """What a child of a decoder layer is: ``attn``, ``cross_attn``, ``mixer``, ``moe``,
    ``mlp``, ``list``, ``glue`` or None (not recognised). The class name decides before the
    attribute name (NemotronH calls every layer's one block ``mixer``: Mamba, attention,
    MoE or MLP)."""
    part = _component(module, parent)
    if isinstance(module, nn.ModuleList):
        return "list"
    cross = name in _CROSS_NAMES or "cross" in name or "cross" in part
    if any(k in part for k in _MIXER_PARTS):
        return "mixer"
    if ("attention" in part or part.endswith("attn") or part == "mla") and not part.endswith("norm"):
        return "cross_attn" if cross else "attn"
    if _moe_parts(module) is not None:
        return "moe"
    if part.endswith(("mlp", "feedforward")) or "ffn" in part:
        return "mlp"
    if _is_glue(name, module, parent):
        return "glue"
    if name in _MIXER_NAMES or "lstm" in name:
        return "mixer"
    if name in _ATTENTION_NAMES or name in _CROSS_NAMES:
        return "cross_attn" if cross else "attn"
    if name in _MLP_NAMES:
        return "mlp"
    return None


def _moe_parts(module: nn.Module) -> tuple[dict[str, str], list[str]] | None:
    """``({child name: region}, [children not recognised])`` of an MoE block (a module
    with an ``experts`` child, or children whose class holds "experts": JetMoE's
    ``input_linear`` / ``output_linear``), else None."""
    children = dict(module.named_children())
    experts = [n for n, c in children.items() if n == "experts" or "experts" in type(c).__name__.lower()]
    if not experts:
        return None
    parts = dict.fromkeys(experts, "experts")
    unknown = []
    for n, c in children.items():
        if n in parts:
            continue
        part = _component(c, module)
        if "router" in part or "gating" in part or n in ("gate", "router"):
            parts[n] = "router"
        elif (n.startswith("shared_expert") and not n.endswith("_gate")) or _kind(n, c, module) == "mlp":
            parts[n] = "shared_experts"
        elif not (_is_glue(n, c, module) or n.endswith("_gate")):
            unknown.append(f"{n} ({type(c).__name__})")
    return parts, unknown


def _entries(layer: nn.Module) -> list[tuple[str, str, nn.Module]]:
    """``(path, attribute name, module)`` of a layer's children, a ``ModuleList`` child read
    entry by entry (LongCat-Flash: two attentions, two MLPs)."""
    found = []
    for name, child in layer.named_children():
        if isinstance(child, nn.ModuleList):
            found += [(f"{name}.{i}", name, c) for i, c in enumerate(child)]
        else:
            found.append((name, name, child))
    return found


def _layer_regions(layer: nn.Module) -> tuple[dict[str, str], list[str]]:
    """``({path relative to the layer: region}, [children not recognised])``."""
    found: dict[str, str] = {}
    dense: list[str] = []
    moe = False
    unknown = []
    children = dict(layer.named_children())
    paired = {n for pair in _MLP_PAIRS if all(n in children for n in pair) for n in pair}
    for path, name, child in _entries(layer):
        kind = "mlp" if path in paired else _kind(name, child, layer)
        if kind in ("attn", "cross_attn", "mixer"):
            found[path] = kind
        elif kind == "moe":
            moe = True
            parts, not_read = _moe_parts(child)  # type: ignore[misc]
            found.update({f"{path}.{n}": region for n, region in parts.items()})
            unknown += [f"{path}.{n}" for n in not_read]
        elif kind == "mlp":
            dense.append(path)
        elif kind is None:
            unknown.append(f"{path} ({type(child).__name__})")
    for path in dense:
        found[path] = "shared_experts" if moe else "mlp"
    return found, unknown


def _is_decoder_list(layers: nn.ModuleList) -> bool:
    """Every entry holds a region (attention, mixer, MoE or MLP: NemotronH has MLP-only and
    MoE-only layers) and some entry holds a token mixer (attention or a state-space mixer)."""
    kinds = [{_kind(name, c, layer) for _, name, c in _entries(layer)} for layer in layers]
    regions = {"attn", "cross_attn", "mixer", "moe", "mlp"}
    return all(k & regions for k in kinds) and any(k & {"attn", "mixer"} for k in kinds)


def decoder_layers(model: nn.Module) -> str:
    """The module path pattern of ``model``'s decoder layers (``"model.layers.*"``,
    ``"transformer.h.*"``, ...): the largest ``ModuleList`` whose every entry holds a
    region (attention, a state-space mixer, an MoE block or an MLP) and some entry a
    token mixer (attention or a state-space mixer)."""
    path, _ = _decoder_list(model)
    return f"{path}.*"


def _decoder_list(model: nn.Module) -> tuple[str, nn.ModuleList]:
    root = unwrap_compiled(model)
    best: tuple[str, nn.ModuleList] | None = None
    for path, m in root.named_modules():
        if not isinstance(m, nn.ModuleList) or not len(m):
            continue
        if _is_decoder_list(m):
            if best is None or len(m) > len(best[1]):
                best = (path, m)
    if best is None:
        raise ValueError(
            f"{type(root).__name__}: regions_for found no list of decoder layers (an nn.ModuleList whose "
            "every entry holds attention, a state-space mixer, an MoE block or an MLP). Write the configuration by hand: "
            "sac_compile.SacConfig(layers='<path of the layers>.*', keep=..., "
            "regions={'<path of the layers>.*.<attention child>': 'attn', ...})"
        )
    return best


def regions_for(model: nn.Module) -> dict[str, str]:
    """The region declarations of a transformers decoder model, read layer by layer.

    Returns ``{module path pattern: region name}`` for :func:`sac_compile.declare_regions` /
    ``SacConfig(regions=...)``: a ``*`` pattern where every layer has the child, explicit
    layer paths where layers differ (dense and MoE layers, hybrid attention / mixer layers).
    Raises ``ValueError`` naming the layer when a layer holds neither attention nor a mixer,
    or holds a module with parameters it does not recognise.
    """
    return _read(model)[1]


def _read(model: nn.Module) -> tuple[str, dict[str, str]]:
    """``(path of the decoder layers' list, regions_for(model))``."""
    path, layers = _decoder_list(model)
    per_layer = []
    for i, layer in enumerate(layers):
        found, unknown = _layer_regions(layer)
        if unknown:
            raise ValueError(
                f"{type(unwrap_compiled(model)).__name__}: layer {path}.{i} ({type(layer).__name__}) holds "
                f"{', '.join(unknown)}, which regions_for does not recognise (it knows {', '.join(REGION_NAMES)}). "
                f"Write the configuration by hand: sac_compile.SacConfig(layers='{path}.*', keep=..., "
                f"regions={{'{path}.*.<child>': '<region>', ...}})"
            )
        per_layer.append(found)
    out: dict[str, str] = {}
    for rel, region in dict.fromkeys((r, n) for found in per_layer for r, n in found.items()):
        where = [i for i, found in enumerate(per_layer) if found.get(rel) == region]
        if len(where) == len(per_layer):
            out[f"{path}.*.{rel}"] = region
        else:
            out.update({f"{path}.{i}.{rel}": region for i in where})
    return path, out


def config_for(model: nn.Module, keep: Any = (), **options: Any) -> SacConfig:
    """A :class:`SacConfig` checkpointing every decoder layer of ``model`` with its regions
    declared (:func:`regions_for`). A ``keep`` name that no layer of this model has is a
    ``ValueError`` here, at configuration time."""
    path, regions = _read(model)  # the layer list is found once
    keep_set = _checked_keep(model, keep, regions)
    return SacConfig(layers=f"{path}.*", keep=keep_set, regions=regions, **options)


def plan_for(
    model: nn.Module, memory: int | float, *, batch: int = 2, seq: int = 128, **options: Any
) -> ModelPlan:
    """Plan ``model``'s decoder layers within ``memory`` per layer (bytes, or a fraction of a
    layer's no-checkpoint bytes), one plan per kind of layer (dense and MoE layers apart),
    measured on a random batch of ``batch`` x ``seq`` tokens; declares the regions
    (:func:`regions_for`). ``options``: ``budgets``, ``policies``, ``eager`` of
    :func:`sac_compile.planning.plan`. ``.apply(model)`` on the result wraps the layers."""
    path, regions = _read(model)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    return plan_model(
        model, ids, layers=f"{path}.*", memory=memory, regions=regions, use_cache=False, **options
    )


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
    for each decoder layer (turning cache writes off while training, honouring
    ``every_n_layers``); the ``context_fn`` among these kwargs
    (:func:`sac_compile.region_context_fn`) runs the eager engine there, and under
    ``torch.compile`` with the ``"sac_compile"`` backend marks each checkpoint as a scope
    with this keep set. ``offload=True`` moves what the checkpoint saves of each layer's
    inputs to the host; the values kept regions hold stay where they were made.

    A ``keep`` name no layer of ``model`` has is a ``ValueError``, as in :func:`config_for`.
    """
    from .contexts import region_context_fn

    _, regions = _read(model)
    keep_set = _checked_keep(model, keep, regions)
    declare_regions(unwrap_compiled(model), regions)
    context_fn = region_context_fn(
        keep_set, policy=policy, preserve_rng_state=preserve_rng_state, early_stop=early_stop
    )
    return {
        "use_reentrant": False,
        "context_fn": context_fn,
        "preserve_rng_state": preserve_rng_state,
        "early_stop": early_stop,
    }


def _checked_keep(model: nn.Module, keep: Any, regions: dict[str, str]):
    keep_set = normalize_keep(keep)
    if keep_set is not ALL_REGIONS:
        have = set(regions.values())
        missing = sorted(set(keep_set) - have)
        if missing:
            raise ValueError(
                f"keep={sorted(keep_set)}: {type(unwrap_compiled(model)).__name__} has no region "
                f"{', '.join(repr(m) for m in missing)}; its layers have {', '.join(sorted(have))} "
                f"(sac_compile.hf.regions_for(model) lists where)"
            )
    return keep_set


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
