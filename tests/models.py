"""Small models for the tests: an MLP, attention, a pre-norm transformer block, stacks."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import sac_compile as sc
from sac_compile.markers import checkpoint_scope


class MLP(nn.Module):
    def __init__(self, d: int = 8, marked: bool = True, dropout: float = 0.0) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)
        self.marked = marked

    def body(self, h: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(torch.relu(h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.marked:
            with sc.region("mlp"):
                h = self.body(h)
        else:
            h = self.body(h)
        return h.sin()


class Attention(nn.Module):
    def __init__(self, d: int = 16, heads: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        with sc.region("attn"):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.drop(self.out(o.transpose(1, 2).reshape(b, s, d)))


class Block(nn.Module):
    """Pre-norm transformer block: regions "attn" (SDPA core) and "mlp" (the MLP body)."""

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
            with sc.region("mlp"):
                h = self.mlp(self.ln2(x))
        else:
            h = self.mlp(self.ln2(x))
        return x + h


class ScopedStack(nn.Module):
    """N blocks, each bracketed by scope markers (what the seam emits under an outer compile)."""

    def __init__(self, n: int = 4, d: int = 16, keep: object = sc.ALL_REGIONS) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.keep = keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            with checkpoint_scope(i, self.keep):
                x = layer(x)
        return x


def grads(module: nn.Module, *inputs: torch.Tensor) -> list[torch.Tensor]:
    return [p.grad for p in module.parameters()] + [t.grad for t in inputs if t.requires_grad]


def run_step(fn, module: nn.Module, *inputs: torch.Tensor):
    """Forward + backward of sum(fn(*inputs)); returns (output, grads) and clears grads."""
    module.zero_grad(set_to_none=True)
    for t in inputs:
        t.grad = None
    out = fn(*inputs)
    out.sum().backward()
    g = [None if t is None else t.clone() for t in grads(module, *inputs)]
    return out.detach(), g
