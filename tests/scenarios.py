"""Functions and modules for the partition-report tests, each with a keep set."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import sac_compile as sc

from .models import MLP, Block, ScopedStack


class TwoRegions(nn.Module):
    """Two regions in sequence: "a" (a matmul + tanh) and "b" (a matmul + sigmoid)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(d, d) / d**0.5)
        self.w2 = nn.Parameter(torch.randn(d, d) / d**0.5)

    def forward(self, x):
        with sc.region("a"):
            h = torch.tanh(x @ self.w1)
        with sc.region("b"):
            h = torch.sigmoid(h @ self.w2)
        return h.cos()


class NestedOverlap(nn.Module):
    """ "outer" holds "inner"; "x" overlaps "outer" (opened inside it, closed after it)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d**0.5)

    def forward(self, x):
        outer = sc.region("outer")
        over = sc.region("x")
        outer.__enter__()
        h = torch.tanh(x @ self.w)  # outer
        with sc.region("inner"):
            h = torch.sigmoid(h @ self.w)  # outer+inner
        over.__enter__()
        h = torch.tanh(h @ self.w)  # outer+x
        outer.__exit__(None, None, None)
        h = torch.sigmoid(h @ self.w)  # x
        over.__exit__(None, None, None)
        return (h @ self.w).cos()  # none


class Unbalanced(nn.Module):
    """ "late" is entered and never exited; "early" is exited without being entered."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d**0.5)

    def forward(self, x):
        h = torch.tanh(x @ self.w)  # early (open since the graph's start)
        sc.region("early").__exit__(None, None, None)
        h = torch.sigmoid(h @ self.w)  # none
        sc.region("late").__enter__()
        h = torch.tanh(h @ self.w)  # late (open to the graph's end)
        return h.cos()


class InCheckpoint(nn.Module):
    """A region inside an explicit torch.utils.checkpoint, plus ops outside it."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d**0.5)

    def inner(self, x):
        h = torch.tanh(x @ self.w)
        with sc.region("core"):
            h = torch.sigmoid(h @ self.w)
        return torch.tanh(h @ self.w)

    def forward(self, x):
        h = torch.relu(x @ self.w)
        h = checkpoint(self.inner, h, use_reentrant=False)
        return (h @ self.w).cos()


def with_block_graph_break(x):
    """A graph break inside a `with region(...)` block: Dynamo runs this frame eagerly."""
    a = x * 2
    with sc.region("r"):
        y = a.sin()
        torch._dynamo.graph_break()
        b = y.cos()
    return b + 1


def cases():
    """name -> (module factory, input factory, keep)."""
    d = 8
    return {
        "mlp_kept": (lambda: MLP(d), lambda: torch.randn(4, d), {"mlp"}),
        "attn_kept_mlp_recomputed": (lambda: Block(16), lambda: torch.randn(2, 4, 16), {"attn"}),
        "two_regions_one_kept": (lambda: TwoRegions(d), lambda: torch.randn(4, d), {"a"}),
        "nested_overlap_keep_inner_x": (lambda: NestedOverlap(d), lambda: torch.randn(4, d), {"inner", "x"}),
        "unbalanced": (lambda: Unbalanced(d), lambda: torch.randn(4, d), {"early", "late"}),
        "in_checkpoint": (lambda: InCheckpoint(d), lambda: torch.randn(4, d), {"core"}),
        "scoped_stack": (
            lambda: ScopedStack(4, 16, keep={"attn"}),
            lambda: torch.randn(2, 4, 16),
            sc.ALL_REGIONS,
        ),
    }
