"""Tracing with a target's kernels on the meta device.

What runs on the meta device is the CPU's dispatch: ``F.scaled_dot_product_attention`` takes
the math path there, which saves the ``seq x seq`` attention probabilities for the backward. A
GPU runs flash attention (or the memory-efficient kernel), which saves its output and the
logsumexp (``batch x heads x seq`` float32) instead. :func:`target_kernels` makes a trace see
what the target runs: for a CUDA (or ROCm) target, every ``scaled_dot_product_attention`` call
becomes the flash kernel (``sac_compile_plan::flash_attention``: output and logsumexp saved,
its backward the flash backward's shapes). Grouped-query attention stays grouped, as in
FlashAttention-2 and cuDNN's kernels: the keys and values saved are the ``kv_heads`` ones, not
repeated to the query's heads (on the CPU the stand-in repeats them inside the op, where
nothing sees them) — unless the target's trainer repeats them before the kernel
(``Target.repeat_kv``: torchtitan's Llama until 2026-01, transformers' SDPA path given a mask),
where the trace repeats them as those do (an expand and a copy, its backward a sum), and the
kernel saves them and makes their gradients the query's heads wide. A mask handed to the call is taken for a causal
or padding mask (flash's ``is_causal``): on the meta device values do not matter, only what
the kernel saves. Nothing changes for a CPU target.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["flash_attention", "target_kernels"]

_SDPA = F.scaled_dot_product_attention


# The flash kernel as one op that is not tagged ``nondeterministic_seeded`` (aten's flash ops
# are, for dropout: the partitioner would wrap a recomputed call in ``run_and_save_rng_state``,
# which has no meta kernel). Its namespace is not PyTorch's, so the policies count it costly
# (``op_classes.is_costly``), and ``inspection.flops`` counts its FLOPs as flash attention's.
# Off the meta device it runs the CPU flash kernel: same values, same saved tensors.
def _grouped(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values repeated to the query's heads (grouped-query attention): for the CPU
    kernel inside the op, and before it for a trainer that repeats them (``repeat_kv``)."""
    group = query.shape[-3] // key.shape[-3]
    if group == 1:
        return key, value
    # (each head ``group`` times in a row, as ``repeat_interleave``: an expand and a copy)
    keys, values = (
        t.unsqueeze(-3).expand(*t.shape[:-2], group, *t.shape[-2:]).flatten(-4, -3) for t in (key, value)
    )
    return keys, values


@torch.library.custom_op("sac_compile_plan::flash_attention", mutates_args=())
def _flash(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    key, value = _grouped(query, key, value)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, scale=scale
    )
    return out, lse


@_flash.register_fake
def _(query, key, value, is_causal, scale):
    b, h, s = query.shape[:3]
    out = query.new_empty((*query.shape[:-1], value.shape[-1]))  # MLA: values narrower than queries
    return out, query.new_empty((b, h, s), dtype=torch.float32)


@torch.library.custom_op("sac_compile_plan::flash_attention_backward", mutates_args=())
def _flash_backward(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    is_causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    keys, values = _grouped(query, key, value)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, query, keys, values, out, lse, 0.0, is_causal, scale=scale
    )
    if keys is not key:  # each kv head's gradient: the sum over the query heads that share it
        dk = dk.unflatten(-3, (key.shape[-3], -1)).sum(-3)
        dv = dv.unflatten(-3, (value.shape[-3], -1)).sum(-3)
    return dq, dk, dv


@_flash_backward.register_fake
def _(grad, query, key, value, out, lse, is_causal, scale):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _setup(ctx, inputs, output) -> None:
    query, key, value, ctx.is_causal, ctx.scale = inputs
    ctx.save_for_backward(query, key, value, *output)


def _backward(ctx, grad, _grad_lse):
    query, key, value, out, lse = ctx.saved_tensors
    dq, dk, dv = _flash_backward(grad.contiguous(), query, key, value, out, lse, ctx.is_causal, ctx.scale)
    return dq, dk, dv, None, None


_flash.register_autograd(_backward, setup_context=_setup)


def flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    repeat_kv: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention``'s signature, run as the flash kernel: it saves its
    output and the logsumexp for the backward (no ``seq x seq`` matrix). With ``repeat_kv``
    grouped keys and values are first repeated to the query's heads, as torchtitan's
    ``repeat_kv`` did (a copy: the kernel's inputs)."""
    if repeat_kv:
        key, value = _grouped(query, key, value)
    causal = bool(is_causal) or attn_mask is not None
    out, _ = _flash(query, key, value, causal, scale)
    return out


def _repeating(*args: Any, **kwargs: Any) -> torch.Tensor:
    """:func:`flash_attention` with ``repeat_kv=True``, as a named function (PyTorch's
    override tables read the ``__name__`` of ``F.scaled_dot_product_attention``)."""
    return flash_attention(*args, **kwargs, repeat_kv=True)


@contextlib.contextmanager
def target_kernels(cuda: bool, repeat_kv: bool = False) -> Iterator[None]:
    """While open, ``torch.nn.functional.scaled_dot_product_attention`` is the target's kernel
    (:func:`flash_attention` when ``cuda``, its keys and values repeated with ``repeat_kv``;
    unchanged otherwise). Code that looks the function up when it calls it
    (transformers' ``sdpa_attention_forward``, torchtitan's attention) sees the substitute, in
    eager code and in what Dynamo traces."""
    if not cuda:
        yield
        return
    F.scaled_dot_product_attention = _repeating if repeat_kv else flash_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = _SDPA
