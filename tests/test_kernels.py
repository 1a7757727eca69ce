"""The planner's stand-in for a GPU's flash kernel (sac_compile/planning/kernels.py), run on the CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sac_compile.planning.kernels import flash_attention


def _qkv(heads: int, kv_heads: int):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, 16, 8, generator=g, requires_grad=True)
    k = torch.randn(2, kv_heads, 16, 8, generator=g, requires_grad=True)
    v = torch.randn(2, kv_heads, 16, 8, generator=g, requires_grad=True)
    return q, k, v


def _saved_shapes(*args, **kwargs) -> tuple[torch.Tensor, list[torch.Size]]:
    """:func:`flash_attention`'s output and the shapes autograd saves for its backward."""
    saved: list[torch.Size] = []

    def pack(t):
        saved.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = flash_attention(*args, **kwargs)
    return out, saved


def test_grouped_query_attention_matches_sdpa_and_saves_the_kv_heads_only():
    """Keys and values are saved at their own heads, as FlashAttention-2 and cuDNN save them
    (red before: repeated to the query's 8 heads, 4x the bytes: the planner's per-layer bytes
    for Llama's GQA were too high)."""
    q, k, v = _qkv(8, 2)
    out, saved = _saved_shapes(q, k, v, is_causal=True)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want_grads = torch.autograd.grad(want.sum(), (q, k, v))
    torch.testing.assert_close(out, want)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected)
    assert sorted(saved) == sorted([q.shape, k.shape, v.shape, out.shape, torch.Size([2, 8, 16])]), saved


def test_multi_head_attention_is_unchanged():
    q, k, v = _qkv(4, 4)
    out = flash_attention(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))


def test_transformers_hands_grouped_keys_to_the_kernel_when_tracing_for_a_gpu(monkeypatch):
    """With a mask (as a trace on another device builds one) transformers repeats keys and
    values to the query's heads; on a GPU, training without padding, it skips the mask and
    passes them grouped (``enable_gqa``). ``grouped_query_sdpa`` makes a trace do the GPU's
    (red before: the planner's no-checkpoint bytes of a Llama-3 layer counted the repeats)."""
    import pytest

    pytest.importorskip("transformers")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from sac_compile._compat.transformers import grouped_query_sdpa

    seen = []

    def sdpa(query, key, value, attn_mask=None, **kwargs):
        seen.append((key.shape[1], kwargs.get("enable_gqa", False)))
        return flash_attention(query, key, value, attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 4, True
    q, k, v = _qkv(8, 2)
    mask = torch.zeros(2, 1, 16, 16)
    sdpa_attention_forward(module, q, k, v, mask)
    with grouped_query_sdpa():
        sdpa_attention_forward(module, q, k, v, mask)
    with grouped_query_sdpa(False):
        sdpa_attention_forward(module, q, k, v, mask)
    assert seen == [(8, False), (2, True), (8, False)]


def test_a_causal_flash_kernel_counts_half_the_attention_flops():
    """The stand-in for a GPU's flash kernel: causal skips the blocks above the diagonal, so a
    step's time is not charged the masked half (PyTorch's own counter charges every block)."""
    from sac_compile.inspection.flops import costly_flops

    q = torch.empty(1, 4, 128, 16, device="meta")
    k = v = torch.empty(1, 2, 128, 16, device="meta")
    forward = torch.ops.sac_compile_plan.flash_attention.default
    full = costly_flops(forward, (q, k, v, False, None), {}, None)
    assert full == 2 * (2 * 4 * 128 * 128 * 16)  # q @ k^T and p @ v, every query head
    assert costly_flops(forward, (q, k, v, True, None), {}, None) == full // 2
    backward = torch.ops.sac_compile_plan.flash_attention_backward.default
    args = (q, q, k, v, q, None)
    assert costly_flops(backward, (*args, True, None), {}, None) * 2 == costly_flops(
        backward, (*args, False, None), {}, None
    )


def test_keys_and_values_repeated_before_the_kernel_are_saved_the_query_heads_wide():
    """``Target.repeat_kv``'s kernel (torchtitan's Llama until 2026-01 repeated grouped keys
    and values before SDPA): same values and gradients, the keys and values saved at the
    query's 8 heads, not their own 2."""
    q, k, v = _qkv(8, 2)
    out, saved = _saved_shapes(q, k, v, is_causal=True, repeat_kv=True)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, want)
    for got, expected in zip(
        torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v))
    ):
        torch.testing.assert_close(got, expected)
    assert sorted(saved) == sorted([q.shape, q.shape, q.shape, out.shape, torch.Size([2, 8, 16])]), saved
