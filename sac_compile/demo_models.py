"""A small pre-norm transformer with marked regions: the default model of the demo,
the benchmarks and the tests.

Regions: ``"attn"`` around the attention core (SDPA) and ``"mlp"`` around the MLP
body. Nothing here is needed to use the library.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .keep import ALL_REGIONS
from .markers import checkpoint_scope, region

__all__ = ["Attention", "Block", "MoE", "MoEBlock", "ScopedStack", "Stack"]


class Attention(nn.Module):
    def __init__(self, d: int = 16, heads: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        if d % heads:
            raise ValueError(f"d={d} must be divisible by heads={heads}")
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        with region("attn"):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.drop(self.out(o.transpose(1, 2).reshape(b, s, d)))


class Block(nn.Module):
    """Pre-norm transformer block; ``marked=False`` builds the same block without markers."""

    def __init__(self, d: int = 16, heads: int = 2, dropout: float = 0.0, marked: bool = True) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads, dropout)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)
        self.marked = marked

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(F.gelu(self.up(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        if self.marked:
            with region("mlp"):
                h = self.mlp(self.ln2(x))
        else:
            h = self.mlp(self.ln2(x))
        return x + h


class Stack(nn.Module):
    """``n`` blocks applied in turn."""

    def __init__(self, n: int = 4, d: int = 16, heads: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d, heads, dropout) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class ScopedStack(Stack):
    """A :class:`Stack` whose layers each run in a checkpoint scope keeping ``keep``.

    This is what wrapping each layer with the seam and compiling the whole model
    produces: one scope (and ``ac_graph_id``) per layer in one graph.
    """

    def __init__(self, n: int = 4, d: int = 16, heads: int = 2, keep: object = ALL_REGIONS) -> None:
        super().__init__(n, d, heads)
        self.keep = keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            with checkpoint_scope(i, self.keep):
                x = layer(x)
        return x


class MoE(nn.Module):
    """Top-k mixture of experts with the accumulation real MoE blocks use:
    ``out = zeros_like(x); out.index_add_(0, token_idx, expert(x[token_idx]) * weight)``.

    Regions: ``"router"`` around the gate, ``"experts"`` around the expert loop.
    """

    def __init__(self, d: int = 16, n_experts: int = 4, top_k: int = 2, hidden: int | None = None) -> None:
        super().__init__()
        hidden = hidden or 2 * d
        self.top_k = top_k
        self.gate = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, hidden), nn.SiLU(), nn.Linear(hidden, d)) for _ in range(n_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        with region("router"):
            probs = torch.softmax(self.gate(x), dim=-1)
            weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        out = torch.zeros_like(x)
        with region("experts"):
            for e, expert in enumerate(self.experts):
                token, slot = torch.where(chosen == e)
                if token.numel() == 0:
                    continue
                y = expert(x[token]) * weights[token, slot, None]
                out.index_add_(0, token, y)
        return out.reshape(shape)


class MoEBlock(nn.Module):
    """Pre-norm block: attention ("attn") then a :class:`MoE` ("router", "experts")."""

    def __init__(self, d: int = 16, heads: int = 2, n_experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.moe = MoE(d, n_experts, top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))
