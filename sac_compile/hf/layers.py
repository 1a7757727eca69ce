"""Reading a transformers model: its stacks of layers and the regions in each layer.

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

import warnings
from collections.abc import Iterable

import torch.nn as nn

from .._compat.dynamo import unwrap_compiled
from .._compat.transformers import check_version, is_checkpointing_layer

__all__ = ["LAYERS", "REGION_NAMES", "decoder_layers", "read_stacks", "regions_for", "stacks", "unchecked"]

check_version()  # a transformers release outside the supported range: one clear error, here

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
_MLP_PAIRS = (("fc1", "fc2"), ("intermediate", "output"), ("intermediate_query", "output_query"))
#: layer glue that belongs to no region and runs with the layer (recomputed by a
#: checkpoint): norms, residual scaling / gating, hyper-connections, per-layer input gates
#: path parts of stacks that are not the language decoder (:func:`decoder_layers`)
_NOT_TEXT = ("vision", "visual", "image", "video", "audio", "protein", "sam_", "tower")
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
    if part.endswith(("mlp", "feedforward", "layerff")) or "ffn" in part:
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


def layer_regions(layer: nn.Module) -> dict[str, str]:
    """``{path relative to the layer: region}`` of one layer, as :func:`regions_for` reads it
    (children it does not recognise left out)."""
    return _layer_regions(layer)[0]


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
        elif (inner := _inside_glue(child)) is not None:
            # a region inside what reads as glue: DBRX's DbrxNormAttentionNorm holds the attention
            found.update({f"{path}.{p}": region for p, region in inner[0].items()})
            unknown += [f"{path}.{p}" for p in inner[1]]
        elif kind is None:
            unknown.append(f"{path} ({type(child).__name__})")
    for path in dense:
        found[path] = "shared_experts" if moe else "mlp"
    return found, unknown


def _inside_glue(module: nn.Module) -> tuple[dict[str, str], list[str]] | None:
    """The regions of a child that reads as glue or is not recognised, read as a layer of its
    own, when it holds any (its norms stay glue); else None."""
    if not any(True for _ in module.children()):
        return None
    inner = _layer_regions(module)
    return inner if inner[0] else None


def _is_decoder_list(layers: nn.ModuleList) -> bool:
    """Every entry holds a region (attention, mixer, MoE or MLP: NemotronH has MLP-only and
    MoE-only layers) and some entry holds a token mixer (attention or a state-space mixer)."""
    kinds = [{_kind(name, c, layer) for _, name, c in _entries(layer)} for layer in layers]
    regions = {"attn", "cross_attn", "mixer", "moe", "mlp"}
    return all(k & regions for k in kinds) and any(k & {"attn", "mixer"} for k in kinds)


def stacks(model: nn.Module) -> tuple[str, ...]:
    """The module paths of ``model``'s checkpointable stacks of layers, in module order.

    A stack is a list of the layers transformers' own switch checkpoints (an
    ``nn.ModuleList`` of ``GradientCheckpointingLayer`` modules): a vision tower's blocks, the
    language decoder's layers, an audio encoder's, both sides of an encoder-decoder
    (``("model.visual.blocks", "model.language_model.layers")`` for Qwen2.5-VL). A model
    without such layers has one stack, the list :func:`decoder_layers` finds. A
    ``GradientCheckpointingLayer`` outside such a list is a ``ValueError`` naming it: it
    would be left out."""
    return tuple(path for path, _ in _stacks(model))


def _stacks(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    root = unwrap_compiled(model)
    found: list[tuple[str, nn.ModuleList]] = []
    for path, m in root.named_modules():
        inside = any(path.startswith(f"{p}.") for p, _ in found)  # a list within a stack's layer
        if isinstance(m, nn.ModuleList) and len(m) and not inside and all(map(is_checkpointing_layer, m)):
            found.append((path, m))
    if not found:
        return [_decoder_list(model)]
    listed = {id(layer) for _, layers in found for layer in layers}
    loose = [p for p, m in root.named_modules() if is_checkpointing_layer(m) and id(m) not in listed]
    loose = [p for p in loose if not any(p.startswith(f"{s}.") for s, _ in found)]
    if loose:
        raise ValueError(
            f"{type(root).__name__}: {', '.join(loose)} is a layer transformers checkpoints, outside any list "
            f"of such layers, so sac_compile.hf would leave it out (its stacks: {', '.join(p for p, _ in found)}). "
            "Wrap it yourself: sac_compile.apply_selective_checkpointing(model.get_submodule(path), keep=...)"
        )
    return found


def unchecked(model: nn.Module) -> tuple[str, ...]:
    """The module paths of ``model``'s lists of layers that transformers does not checkpoint:
    an ``nn.ModuleList`` outside every :func:`stacks` list (and outside each other) whose every
    entry holds a region and some entry a token mixer (attention, a state-space mixer), as
    :func:`regions_for` reads layers — Mllama's vision encoder
    (``model.vision_model.transformer.layers`` and ``...global_transformer.layers``),
    Idefics2's perceiver resampler, FSMT's encoder. :func:`sac_compile.hf.config_for` and
    :func:`sac_compile.hf.plan_for` checkpoint them when named in ``include=``, and warn,
    naming them, when not; transformers' own switch never checkpoints them."""
    root = unwrap_compiled(model)
    taken = [path for path, _ in _stacks(model)]
    out: list[str] = []
    for path, m in root.named_modules():
        if any(path == p or path.startswith(f"{p}.") for p in taken + out):
            continue
        if isinstance(m, nn.ModuleList) and len(m) and _is_decoder_list(m):
            out.append(path)
    return tuple(out)


def decoder_layers(model: nn.Module) -> str:
    """The module path pattern of ``model``'s language decoder layers (``"model.layers.*"``,
    ``"transformer.h.*"``, ``"model.language_model.layers.*"``, ...): of its
    :func:`stacks`, those under ``model.get_decoder()`` when it has one, then those whose path
    names no other modality (vision, image, audio, ...), then one whose path says
    ``decoder``, then the largest; without transformers' checkpointing layers,
    the largest ``ModuleList`` whose every entry holds a region (attention, a state-space
    mixer, an MoE block or an MLP) and some entry a token mixer."""
    found = _stacks(model)
    root = unwrap_compiled(model)
    decoder = getattr(root, "get_decoder", None)
    try:
        decoder = decoder() if callable(decoder) else None
    except Exception:  # a model whose get_decoder needs what it lacks
        decoder = None
    if decoder is not None and decoder is not root:
        under = [p for p, m in root.named_modules() if m is decoder]
        inside = [(p, m) for p, m in found if under and p.startswith(f"{under[0]}.")]
        found = inside or found
    text = [(p, m) for p, m in found if not any(w in p for w in _NOT_TEXT)]
    named = [(p, m) for p, m in text or found if "decoder" in p.split(".")]
    path, _ = max(named or text or found, key=lambda item: len(item[1]))
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
    """The region declarations of a transformers model, read layer by layer in every stack.

    Returns ``{module path pattern: region name}`` for :func:`sac_compile.declare_regions` /
    ``SacConfig(regions=...)``: a ``*`` pattern where every layer of a stack has the child,
    explicit layer paths where layers differ (dense and MoE layers, hybrid attention / mixer
    layers). One vocabulary in every stack: a vision block's attention and MLP are ``attn``
    and ``mlp`` too. Raises ``ValueError`` naming the stack and the layer when a layer holds
    no region, or holds a module with parameters it does not recognise.
    """
    return {pattern: name for _, regions in read_stacks(model) for pattern, name in regions.items()}


def read_stacks(model: nn.Module, include: Iterable[str] = ()) -> list[tuple[str, dict[str, str]]]:
    """``[(path of a stack, its regions)]`` for every stack of ``model`` (:func:`regions_for`
    per stack), then for each list of layers named in ``include`` (paths of
    :func:`unchecked`: lists transformers does not checkpoint), read the same way."""
    found = _stacks(model)
    extra = _included(model, include, found)
    return [(path, _stack_regions(model, path, layers)) for path, layers in found + extra]


def _included(
    model: nn.Module, include: Iterable[str], found: list[tuple[str, nn.ModuleList]]
) -> list[tuple[str, nn.ModuleList]]:
    include = [include] if isinstance(include, str) else list(include)
    if not include:
        return []
    root = unwrap_compiled(model)
    modules = dict(root.named_modules())
    candidates = unchecked(model)
    out = []
    for path in dict.fromkeys(p[:-2] if p.endswith(".*") else p for p in include):
        if path in (p for p, _ in found):
            continue  # a stack already: nothing to add
        if path not in candidates:
            what = "is not a module" if path not in modules else f"is a {type(modules[path]).__name__}"
            raise ValueError(
                f"include={path!r}: in {type(root).__name__} it {what}, not a list of layers transformers "
                f"leaves unchecked; those are {', '.join(map(repr, candidates)) or 'none'} "
                "(sac_compile.hf.unchecked(model))"
            )
        out.append((path, modules[path]))
    return out


def _stack_regions(model: nn.Module, path: str, layers: nn.ModuleList) -> dict[str, str]:
    per_layer = []
    for i, layer in enumerate(layers):
        found, unknown = _layer_regions(layer)
        if unknown or not found:
            what = (
                f"holds {', '.join(unknown)}, which regions_for does not recognise"
                if unknown
                else "holds no module regions_for recognises"
            )
            patterns = [f"{p}.*" for p in stacks(model)]
            layers_arg = repr(patterns[0]) if len(patterns) == 1 else f"({', '.join(map(repr, patterns))})"
            raise ValueError(
                f"{type(unwrap_compiled(model)).__name__}: stack {path}, layer {path}.{i} ({type(layer).__name__}) "
                f"{what} (it knows {', '.join(REGION_NAMES)}). Write the configuration by hand: "
                f"sac_compile.SacConfig(layers={layers_arg}, keep=..., regions={{'{path}.*.<child>': '<region>', ...}})"
            )
        per_layer.append(found)
    out: dict[str, str] = {}
    for rel, region in dict.fromkeys((r, n) for found in per_layer for r, n in found.items()):
        where = [i for i, found in enumerate(per_layer) if found.get(rel) == region]
        if len(where) == len(per_layer):
            out[f"{path}.*.{rel}"] = region
        else:
            out.update({f"{path}.{i}.{rel}": region for i in where})
    return out


def report_unchecked(model: nn.Module, include: Iterable[str] | None, fix: str) -> None:
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


def merged(read: list[tuple[str, dict[str, str]]]) -> dict[str, str]:
    return {pattern: name for _, regions in read for pattern, name in regions.items()}


def vocab_size(model: nn.Module) -> int:
    config = unwrap_compiled(model).config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.vocab_size)
