"""A small pre-norm transformer with marked regions: the default model of the demo,
the benchmarks and the tests.

Regions: ``"attn"`` around the attention core (SDPA) and ``"mlp"`` around the MLP
body. Nothing here is needed to use the library.
"""

from __future__ import annotations

import contextlib
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._compat.ops import functional_all_to_all
from ..keep import ALL_REGIONS
from ..markers import checkpoint_scope, region

__all__ = [
    "Attention",
    "Block",
    "EPBlock",
    "EPStack",
    "ExpertParallelMoE",
    "Experts",
    "MoE",
    "MoEBlock",
    "MoETransformer",
    "Router",
    "ScopedStack",
    "Stack",
]


def _marked(name: str, marked: bool):
    return region(name) if marked else contextlib.nullcontext()


class Attention(nn.Module):
    def __init__(self, d: int = 16, heads: int = 2, dropout: float = 0.0, marked: bool = True) -> None:
        super().__init__()
        if d % heads:
            raise ValueError(f"d={d} must be divisible by heads={heads}")
        self.heads = heads
        self.marked = marked
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        with _marked("attn", self.marked):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.drop(self.out(o.transpose(1, 2).reshape(b, s, d)))


class Block(nn.Module):
    """Pre-norm transformer block; ``marked=False`` builds the same block without markers."""

    def __init__(self, d: int = 16, heads: int = 2, dropout: float = 0.0, marked: bool = True) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads, dropout, marked=marked)
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


class Router(nn.Module):
    """Top-k gate: for every (token, choice) its gate weight, token index and expert slot.

    The slot of a choice is ``expert * tokens + its arrival order at that expert``:
    each expert has ``tokens`` slots, so no token is ever dropped.
    """

    def __init__(self, d: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
        self.n_experts, self.top_k = n_experts, top_k
        self.gate = nn.Linear(d, n_experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens = x.shape[0]
        probs = torch.softmax(self.gate(x), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        expert = chosen.reshape(-1)
        token = torch.arange(tokens, device=x.device).repeat_interleave(self.top_k)
        one_hot = F.one_hot(expert, self.n_experts)
        position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # arrival order within the expert
        return weights.reshape(-1), token, expert * tokens + position


class Experts(nn.Module):
    """``local`` experts (two batched GEMMs with SiLU between) over slots laid out
    ``[source rank, expert, slot, d]``."""

    def __init__(self, local: int, d: int, hidden: int, world: int = 1) -> None:
        super().__init__()
        self.world = world
        self.w_in = nn.Parameter(torch.randn(local, d, hidden) / d**0.5)
        self.w_out = nn.Parameter(torch.randn(local, hidden, d) / hidden**0.5)

    def forward(self, received: torch.Tensor, capacity: int) -> torch.Tensor:
        local, d = self.w_in.shape[0], received.shape[-1]
        h = received.view(self.world, local, capacity, d).transpose(0, 1).reshape(local, -1, d)
        y = torch.bmm(F.silu(torch.bmm(h, self.w_in)), self.w_out)
        return y.view(local, self.world, capacity, d).transpose(0, 1).reshape(-1, d)


class ExpertParallelMoE(nn.Module):
    """Top-k mixture of experts whose experts are split over the ranks of ``group``
    (expert parallelism): router -> dispatch all-to-all -> expert GEMMs -> combine all-to-all.

    Every shape is static (GShard-style fixed capacity: each expert has ``C`` slots
    per source rank, ``C`` = the number of local tokens, so no token is ever
    dropped and the result equals a single process holding every expert), so the
    all-to-alls have equal splits and compile without data-dependent sizes. The
    collectives are the autograd-aware functional ones
    (``all_to_all_single_autograd``): their backward is itself an all-to-all.

    Regions, per micro-batch (``marked=False`` leaves them out, for declaring
    regions by module path instead): ``"moe.router"`` (the :class:`Router`),
    ``"moe.dispatch"`` (scatter into expert slots + all-to-all), ``"moe.experts"``
    (the :class:`Experts`), ``"moe.combine"`` (all-to-all back + weighted gather).
    With ``micro_batches=2`` the tokens are split in two whose stages interleave
    inside the layer (dispatch 0, dispatch 1, experts 0, combine 0, experts 1,
    combine 1), so that micro-batch 1's dispatch can overlap micro-batch 0's
    experts; each stage of each micro-batch is its own region.

    ``group=None`` runs every expert in this process (no collective): the
    single-process reference. :meth:`shard_from` copies a reference's weights,
    this rank's slice of the experts.
    """

    def __init__(
        self,
        d: int = 16,
        n_experts: int = 4,
        top_k: int = 2,
        hidden: int | None = None,
        group: torch.distributed.ProcessGroup | None = None,
        micro_batches: int = 1,
        marked: bool = True,
    ) -> None:
        super().__init__()
        import torch.distributed as dist

        self.world = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        if n_experts % self.world:
            raise ValueError(f"n_experts={n_experts} must be divisible by the group size {self.world}")
        if micro_batches not in (1, 2):
            raise ValueError(f"micro_batches={micro_batches!r}: expected 1 or 2")
        self.group, self.n_experts, self.micro_batches, self.marked = group, n_experts, micro_batches, marked
        self.router = Router(d, n_experts, top_k)
        self.experts = Experts(n_experts // self.world, d, hidden or 2 * d, self.world)

    @torch.no_grad()
    def shard_from(self, full: ExpertParallelMoE) -> ExpertParallelMoE:
        """Copy ``full``'s router and this rank's slice of its experts."""
        local = self.experts.w_in.shape[0]
        mine = slice(self.rank * local, (self.rank + 1) * local)
        self.router.gate.weight.copy_(full.router.gate.weight)
        self.experts.w_in.copy_(full.experts.w_in[mine])
        self.experts.w_out.copy_(full.experts.w_out[mine])
        return self

    def _all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return t
        return functional_all_to_all(t, self.group)

    def _dispatch(self, x: torch.Tensor, token: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        send = x.new_zeros(self.n_experts * x.shape[0], x.shape[1]).index_add(0, slot, x[token])
        return self._all_to_all(send)  # [world (source), local experts, C, d]

    def _combine(self, y: torch.Tensor, weights, token, slot, tokens: int) -> torch.Tensor:
        back = self._all_to_all(y)  # [experts * C, d], this rank's tokens
        out = back.new_zeros(tokens, back.shape[-1])
        return out.index_add(0, token, back[slot] * weights[:, None].to(back.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        chunks = x.reshape(-1, shape[-1]).chunk(self.micro_batches)
        routes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
        routes, received, outs = [], [], []
        for mb in chunks:
            with _marked("moe.router", self.marked):
                routes.append(self.router(mb))
        for mb, (_, token, slot) in zip(chunks, routes):
            with _marked("moe.dispatch", self.marked):
                received.append(self._dispatch(mb, token, slot))
        for mb, route, recv in zip(chunks, routes, received):
            with _marked("moe.experts", self.marked):
                y = self.experts(recv, mb.shape[0])
            with _marked("moe.combine", self.marked):
                outs.append(self._combine(y, *route, mb.shape[0]))
        return torch.cat(outs).reshape(shape)


class EPBlock(nn.Module):
    """Pre-norm block: attention (``"attn"``) then an :class:`ExpertParallelMoE`."""

    def __init__(
        self,
        d: int = 16,
        heads: int = 2,
        n_experts: int = 4,
        top_k: int = 2,
        group: torch.distributed.ProcessGroup | None = None,
        micro_batches: int = 1,
        marked: bool = True,
    ) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads, marked=marked)
        self.ln2 = nn.LayerNorm(d)
        self.moe = ExpertParallelMoE(
            d, n_experts, top_k, group=group, micro_batches=micro_batches, marked=marked
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class EPStack(nn.Module):
    """``n`` :class:`EPBlock` layers; ``group=None`` is the single-process reference."""

    def __init__(
        self, n: int = 2, d: int = 16, heads: int = 2, n_experts: int = 4, top_k: int = 2, **kw
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EPBlock(d, heads, n_experts, top_k, **kw) for _ in range(n))

    @torch.no_grad()
    def shard_from(self, full: EPStack) -> EPStack:
        """Copy ``full``'s replicated weights and this rank's slice of every layer's experts."""
        for mine, ref in zip(self.layers, full.layers, strict=True):
            for name, p in mine.named_parameters():
                if not name.startswith("moe."):
                    p.copy_(ref.get_parameter(name))
            cast(EPBlock, mine).moe.shard_from(cast(EPBlock, ref).moe)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class MoETransformer(nn.Module):
    """The demo's language model: embedding, ``n_layers`` unmarked :class:`EPBlock` layers
    (attention + a single-process :class:`ExpertParallelMoE`), final norm and head.

    No markers in its code: :attr:`REGIONS` declares them by module path
    (``sac_compile.declare_regions(model, MoETransformer.REGIONS)``).
    """

    REGIONS = {"layers.*.attn": "attn", "layers.*.moe.router": "router", "layers.*.moe.experts": "experts"}

    def __init__(
        self,
        vocab: int = 256,
        d: int = 64,
        n_layers: int = 4,
        heads: int = 4,
        n_experts: int = 8,
        top_k: int = 2,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(
            EPBlock(d, heads, n_experts, top_k, marked=False) for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))
