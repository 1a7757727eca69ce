"""Tiny random-weight models of transformers 5.x decoder families (CPU, no download).

Each entry builds a 2-layer (NemotronH: 4-layer) ``*ForCausalLM`` whose layers differ where the family lets
them (dense first layer of DeepSeek-V3 and Llama-4, Qwen3-MoE's ``mlp_only_layers``,
the state-space / recurrent / linear-attention and attention layers of Jamba,
Granite-MoE-hybrid, RecurrentGemma, OLMo-hybrid and NemotronH), so per-layer region
reading is exercised. Used by ``tests/test_hf_families.py`` and
``benchmarks/hf_families.py``.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn as nn

from .._compat.transformers import from_config

__all__ = ["FAMILIES", "build", "held_bytes", "tiny_llama", "tiny_qwen3_moe"]

_COMMON: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    intermediate_size=64,
    pad_token_id=0,
    bos_token_id=0,
    eos_token_id=0,
)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)

#: family -> (config class, model class, config overrides)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8)),
    "qwen2-moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(_MOE, num_experts=4, shared_expert_intermediate_size=32),
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(_MOE, num_experts=4, mlp_only_layers=[0], head_dim=8),
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2)),
    "deepseek-v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            _MOE,
            n_routed_experts=4,
            num_key_value_heads=4,  # MLA: no grouped KV heads
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        ),
    ),
    "llama4": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(
            num_local_experts=4,
            num_experts_per_tok=1,
            intermediate_size_mlp=64,
            interleave_moe_layer_step=2,
            head_dim=8,
        ),
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=8)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=8)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),
    "granite-moe": (
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2),
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64)),
    "gpt-neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    "falcon": ("FalconConfig", "FalconForCausalLM", {}),
    "jamba": (
        "JambaConfig",
        "JambaForCausalLM",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            mamba_d_state=8,
            mamba_dt_rank=4,
        ),
    ),
    "jetmoe": (  # the router of transformers 4.x MoE (expert_size.tolist()), two *Experts children
        "JetMoeConfig",
        "JetMoeForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, kv_channels=8),
    ),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(ffn_dim=64, word_embed_proj_dim=32)),  # fc1 + fc2
    "roberta": (  # positions start past the padding index: room for seq 64
        "RobertaConfig",
        "RobertaForCausalLM",
        dict(is_decoder=True, type_vocab_size=1, max_position_embeddings=80),
    ),
    "recurrent-gemma": (  # an RG-LRU layer, then a local-attention layer, both called temporal_block
        "RecurrentGemmaConfig",
        "RecurrentGemmaForCausalLM",
        dict(block_types=["recurrent", "attention"], lru_width=32, head_dim=8, attention_window_size=16),
    ),
    "olmo-hybrid": (  # a gated-DeltaNet linear-attention layer, then a softmax-attention layer
        "OlmoHybridConfig",
        "OlmoHybridForCausalLM",
        dict(layer_types=["linear_attention", "full_attention"]),
    ),
    "nemotron-h": (  # one block per layer, always called mixer: Mamba-2, MoE, attention, MLP
        "NemotronHConfig",
        "NemotronHForCausalLM",
        dict(
            layers_block_type=["mamba", "moe", "attention", "mlp"],
            num_hidden_layers=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=16,
            mamba_num_heads=4,
            mamba_head_dim=16,
            ssm_state_size=8,
            n_groups=1,
            head_dim=8,
        ),
    ),
    "granite-moe-hybrid": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=["mamba", "attention"],
            mamba_d_state=8,
            mamba_n_heads=4,
            mamba_d_head=16,
            shared_intermediate_size=32,
        ),
    ),
}


def build(name: str, *, seed: int = 0, layers: int | None = None) -> nn.Module:
    """The family's tiny model in training mode (dropout as the family's config sets it);
    ``layers``: that many decoder layers, the family's per-layer pattern (a list as long as its
    layers: RecurrentGemma's, OLMo-hybrid's, NemotronH's types) repeated."""
    import transformers

    config_cls, model_cls, extra = FAMILIES[name]
    overrides = {**_COMMON, **extra}
    if layers is not None:
        overrides = _deeper(overrides, layers)
    cfg = getattr(transformers, config_cls)(**overrides)
    torch.manual_seed(seed)
    # Gemma-2's soft-capped attention has no SDPA path; every other family runs SDPA
    attn = "eager" if name == "gemma2" else "sdpa"
    return from_config(getattr(transformers, model_cls), cfg, attn_implementation=attn).train()


def _deeper(overrides: dict[str, Any], layers: int) -> dict[str, Any]:
    """``overrides`` for ``layers`` decoder layers: the layer count (GPT-2's ``n_layer`` too) and
    every per-layer list (as long as the family's own layers) repeated."""
    if layers < 1:
        raise ValueError(f"layers={layers}: a model needs at least one layer")
    n = overrides.get("n_layer", overrides["num_hidden_layers"])
    out = dict(overrides)
    for key, value in overrides.items():
        if isinstance(value, list) and len(value) == n:
            out[key] = (value * (layers // n + 1))[:layers]
    out["num_hidden_layers"] = layers
    if "n_layer" in out:
        out["n_layer"] = layers
    return out


def held_bytes(family: str, keep: Any, ids: torch.Tensor, *, compiled: bool = False) -> int:
    """Bytes one forward of ``family`` holds for the backward (``autograd_saved_bytes``,
    parameters excluded), every decoder layer wrapped by ``hf.config_for(keep=...)``;
    ``keep`` None: no checkpoint. ``compiled``: each layer compiled with ``aot_eager`` (no
    checkpoint: the same compile without the tagging pass)."""
    import sac_compile as sc
    from sac_compile import hf
    from sac_compile._compat.dynamo import reset_compile_caches
    from sac_compile.compiler.backend import baseline_backend

    if compiled:
        reset_compile_caches()
    model = build(family)
    if keep is not None:
        hf.config_for(model, keep=keep, compile={"inner": "aot_eager"} if compiled else False).apply(model)
    elif compiled:
        for layer in cast(nn.ModuleList, model.get_submodule(hf.decoder_layers(model)[:-2])):
            layer.compile(backend=baseline_backend("aot_eager"))

    def logits(ids: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(0)  # the same dropout masks in every configuration
        return model(input_ids=ids).logits

    return sc.inspection.autograd_saved_bytes(logits, ids, exclude=model.parameters())


# Larger single-family models for examples and benchmarks (hidden 64 by default).
_TINY: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)


def tiny_llama(*, layers: int = 2, hidden: int = 64, vocab: int = 128, seed: int = 0) -> nn.Module:
    """A ``LlamaForCausalLM`` from a tiny random config (CPU, float32, SDPA attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = {"num_hidden_layers": layers, "hidden_size": hidden, "vocab_size": vocab}
    cfg = LlamaConfig(**{**_TINY, **sizes}, intermediate_size=2 * hidden)
    torch.manual_seed(seed)
    return from_config(LlamaForCausalLM, cfg, attn_implementation="sdpa")


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
        # (head_dim: a config attribute Qwen3MoeConfig's typed fields leave out)
        **{**_TINY, "num_hidden_layers": layers, "hidden_size": hidden, "head_dim": hidden // 4},
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        num_experts=experts,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        mlp_only_layers=[],
    )
    torch.manual_seed(seed)
    return from_config(
        Qwen3MoeForCausalLM, cfg, attn_implementation="sdpa", experts_implementation=experts_implementation
    )
