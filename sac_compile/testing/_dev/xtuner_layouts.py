"""xtuner v1's ways of compiling a layer it checkpoints, at tiny width (InternLM/xtuner,
``xtuner/v1/model``). Nothing here is needed to use the library.

* :class:`VisionLayer`: a Qwen3-VL vision block (``modeling_vision.Qwen3VLVisionLayer``): two
  LayerNorms, an attention submodule (fused ``qkv``, rotary embeddings, variable-length attention
  over packed sequences given ``cu_seqlens``, ``proj``), a GELU MLP; the tower feeds one row of
  patches ``[tokens, d]`` with the images' boundaries.
* :class:`DenseLayer`: a dense decoder layer (``DenseDecoderLayer``): RMSNorms, causal
  grouped-query attention over packed sequences, a SwiGLU MLP.
* Layouts, as xtuner writes them: :func:`compile_class_forward` (``BaseModel._compile_overwrite``:
  ``setattr(cls, "forward", torch.compile(cls.forward, **options))``, the default for Qwen3-VL's
  vision blocks and the dense decoder), :func:`compile_instance_forward` (``fully_shard`` of the
  vision towers and the dense model: ``layer.forward = torch.compile(layer.forward,
  fullgraph=True)`` on the layer it just wrapped), :func:`checkpoint_wrapped` (the wrapper it
  compiles there: ``checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.REENTRANT)``).

Region: ``attn`` (the attention kernel), marked in the code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..._compat.checkpoint import reentrant_checkpoint_wrapper
from ...markers import region

__all__ = [
    "DenseLayer",
    "Tower",
    "VisionLayer",
    "checkpoint_wrapped",
    "compile_class_forward",
    "compile_instance_forward",
    "packed_rows",
]


def packed_rows(lengths: tuple[int, ...], d: int, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, cu_seqlens)``: sequences of ``lengths`` tokens packed in one row ``[tokens, d]``."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return torch.randn(int(cu[-1]), d, generator=torch.Generator().manual_seed(seed)), cu


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, causal: bool
) -> torch.Tensor:
    """Attention within each packed sequence (``[heads, tokens, head_dim]``), as xtuner's
    varlen flash attention computes it: one SDPA call with a block-diagonal mask."""
    t = q.shape[1]
    pos = torch.arange(t, device=q.device)
    seq = torch.searchsorted(cu_seqlens[1:].to(pos.dtype), pos, right=True)
    mask = seq[:, None] == seq[None, :]
    if causal:
        mask = mask & (pos[:, None] >= pos[None, :])
    with region("attn"):
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)[0]


class VisionAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, h: torch.Tensor, cu_seqlens: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        t, d = h.shape
        q, k, v = self.qkv(h).reshape(t, 3, self.heads, -1).permute(1, 0, 2, 3).unbind(0)
        cos, sin = rope
        q, k = (x * cos[:, None] + _rotate_half(x) * sin[:, None] for x in (q, k))
        o = _varlen_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), cu_seqlens, causal=False
        )
        return {"projected_output": self.proj(o.transpose(0, 1).reshape(t, d))}


class VisionLayer(nn.Module):
    """A Qwen3-VL vision block."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d, eps=1e-6), nn.LayerNorm(d, eps=1e-6)
        self.attn = VisionAttention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

    def forward(
        self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        hidden_states = (
            hidden_states + self.attn(self.norm1(hidden_states), cu_seqlens, rope)["projected_output"]
        )
        return hidden_states + self.mlp(self.norm2(hidden_states))


class DenseLayer(nn.Module):
    """A dense decoder layer: causal grouped-query attention (2 query heads per key head), SwiGLU."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.kv_heads = heads, heads // 2
        hd = d // heads
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(d), nn.RMSNorm(d)
        self.q_proj, self.kv_proj = (
            nn.Linear(d, d, bias=False),
            nn.Linear(d, 2 * self.kv_heads * hd, bias=False),
        )
        self.o_proj = nn.Linear(d, d, bias=False)
        self.gate_up, self.down = nn.Linear(d, 6 * d, bias=False), nn.Linear(3 * d, d, bias=False)

    def forward(
        self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        t, d = hidden_states.shape
        h = self.input_layernorm(hidden_states)
        q = self.q_proj(h).view(t, self.heads, -1)
        k, v = self.kv_proj(h).view(t, 2, self.kv_heads, -1).unbind(1)
        cos, sin = rope
        q, k = (x * cos[:, None] + _rotate_half(x) * sin[:, None] for x in (q, k))
        k, v = (x.repeat_interleave(self.heads // self.kv_heads, dim=1) for x in (k, v))
        o = _varlen_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), cu_seqlens, causal=True
        )
        hidden_states = hidden_states + self.o_proj(o.transpose(0, 1).reshape(t, d))
        gate, up = self.gate_up(self.post_attention_layernorm(hidden_states)).chunk(2, dim=-1)
        return hidden_states + self.down(F.silu(gate) * up)


class Tower(nn.Module):
    """``n`` layers of ``layer`` (a class) over one packed row; ``forward`` returns the last hidden states."""

    def __init__(self, layer: type[nn.Module], n: int = 2, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.head_dim = d // heads
        self.layers = nn.ModuleList(layer(d, heads) for _ in range(n))

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[0], device=x.device) - cu_seqlens[:-1].repeat_interleave(cu_seqlens.diff())
        freqs = pos[:, None].float() / 10000 ** (
            torch.arange(0, self.head_dim, 2, device=x.device) / self.head_dim
        )
        emb = torch.cat((freqs, freqs), dim=-1)
        rope = (emb.cos(), emb.sin())
        for layer in self.layers:
            x = layer(x, cu_seqlens, rope)
        return x


def compile_class_forward(cls: type[nn.Module], **options: Any) -> Callable[[], None]:
    """xtuner's ``_compile_overwrite`` of ``<cls>.forward``: the class's forward compiled in
    place; returns the function that puts the original back."""
    original = cls.__dict__["forward"]
    cls.forward = torch.compile(original, **options)

    def restore() -> None:
        cls.forward = original

    return restore


def compile_instance_forward(layer: nn.Module, **options: Any) -> nn.Module:
    """xtuner's ``fully_shard``: ``layer.forward = torch.compile(layer.forward, **options)``."""
    layer.forward = torch.compile(layer.forward, **options)
    return layer


def checkpoint_wrapped(layer: nn.Module) -> nn.Module:
    """xtuner's recompute wrapper: ``checkpoint_wrapper(layer, checkpoint_impl=REENTRANT)``."""
    return reentrant_checkpoint_wrapper(layer)
