"""Hugging Face ``transformers`` decoder models: region declarations and tiny test models.

``transformers`` is imported lazily; nothing here is needed unless you use it.

>>> model = tiny_qwen3_moe()                       # random weights, no download
>>> config_for(model, keep={"attn", "experts"}, compile=True).apply(model)  # doctest: +SKIP

Regions declared for the supported families (module paths as ``named_modules()``
reports them on ``*ForCausalLM``):

============  =====================================  ==========================================
region        Llama / Mistral-style dense            Qwen3-MoE / Mixtral (transformers 5.x)
============  =====================================  ==========================================
``attn``      ``model.layers.*.self_attn``           ``model.layers.*.self_attn``
``mlp``       ``model.layers.*.mlp``                 --
``router``    --                                     ``model.layers.*.mlp.gate``
``experts``   --                                     ``model.layers.*.mlp.experts``
============  =====================================  ==========================================

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

__all__ = [
    "LAYERS",
    "LayerCall",
    "batch",
    "config_for",
    "layer_call",
    "layer_inputs",
    "regions_for",
    "tiny_llama",
    "tiny_qwen3_moe",
]

#: The decoder layers of every ``*ForCausalLM`` supported here.
LAYERS = "model.layers.*"

_DENSE = {"model.layers.*.self_attn": "attn", "model.layers.*.mlp": "mlp"}
_MOE = {
    "model.layers.*.self_attn": "attn",
    "model.layers.*.mlp.gate": "router",
    "model.layers.*.mlp.experts": "experts",
}


def regions_for(model: nn.Module) -> dict[str, str]:
    """The region declarations for a supported decoder model (see the module docstring)."""
    root = unwrap_compiled(model)
    paths = {p for p, _ in root.named_modules()}
    if "model.layers.0.mlp.experts" in paths:
        return dict(_MOE)
    if "model.layers.0.self_attn" in paths and "model.layers.0.mlp" in paths:
        return dict(_DENSE)
    raise ValueError(
        f"{type(root).__name__} does not have the module layout regions_for knows "
        "(model.layers.N.self_attn and model.layers.N.mlp[.experts]); declare its regions with "
        "sac_compile.declare_regions(model, {pattern: name})"
    )


def config_for(model: nn.Module, keep: Any = (), **options: Any) -> SacConfig:
    """A :class:`SacConfig` checkpointing every decoder layer of ``model`` with its regions declared."""
    return SacConfig(layers=LAYERS, keep=keep, regions=regions_for(model), **options)


_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    use_cache=False,
)


def tiny_llama(*, layers: int = 2, hidden: int = 64, seed: int = 0) -> nn.Module:
    """A ``LlamaForCausalLM`` from a tiny random config (CPU, float32, SDPA attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        **{**_COMMON, "num_hidden_layers": layers, "hidden_size": hidden}, intermediate_size=2 * hidden
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")


def tiny_qwen3_moe(
    *,
    experts_implementation: str = "grouped_mm",
    layers: int = 2,
    hidden: int = 64,
    experts: int = 4,
    seed: int = 0,
) -> nn.Module:
    """A ``Qwen3MoeForCausalLM`` from a tiny random config: ``experts`` experts, top-2.

    ``experts_implementation``: ``"grouped_mm"`` (transformers' default) or ``"eager"``
    (per-expert loop with ``index_add_``).
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        **{**_COMMON, "num_hidden_layers": layers, "hidden_size": hidden},
        head_dim=hidden // 4,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        num_experts=experts,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        mlp_only_layers=[],
    )
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM._from_config(
        cfg, attn_implementation="sdpa", experts_implementation=experts_implementation
    )


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
