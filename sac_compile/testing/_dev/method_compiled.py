"""A trainer's layout: an MoE decoder whose layers' *methods* are compiled and whose layers
are checkpointed eagerly outside them (xtuner v1's MoE layers, expert-parallel configuration).

* packed sequences: one row of tokens with ``cu_seqlens`` (attention masked per sequence);
* the attention (``_pre_moe_forward``), the experts (``_experts_forward``), the shared experts
  with their gate (``_shared_experts_forward``) and the residual (``_post_moe_forward``) are
  methods of the layer, compiled on the class with ``fullgraph=True`` by :func:`compile_methods`;
* the router normalises its top-k weights in place; a dispatcher, a plain object, sorts the
  tokens by expert and registers a ``grad_fn`` pre-hook on them (which Dynamo refuses under
  ``fullgraph``: the layer's ``forward`` stays uncompiled, as in xtuner);
* an MTP layer wraps one more MoE layer.

Regions: ``attn``, ``router``, ``experts``, ``shared_experts`` (marked in the code). Nothing
here is needed to use the library.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...markers import region

__all__ = ["METHODS", "Dispatcher", "MTPLayer", "MoELayer", "MethodCompiledMoE", "compile_methods", "packed"]

#: the layer methods a trainer compiles
METHODS = ("_pre_moe_forward", "_experts_forward", "_shared_experts_forward", "_post_moe_forward")


def packed(lengths: tuple[int, ...], d: int, *, generator: torch.Generator | None = None) -> tuple:
    """``(x, cu_seqlens)``: sequences of ``lengths`` tokens packed in one row ``[tokens, d]``."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return torch.randn(int(cu[-1]), d, generator=generator), cu


class Dispatcher:
    """Token dispatch and combine (a plain object, as an MoE dispatcher is)."""

    def __init__(self, experts: int, top_k: int) -> None:
        self.experts, self.top_k = experts, top_k
        self.prehooks = 0  # how many times the backward reached the dispatched tokens

    def _count(self, grads: tuple) -> None:
        self.prehooks += 1

    def dispatch(self, x: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        flat = idx.flatten()
        order = flat.argsort(stable=True)
        tokens = x[order // self.top_k]
        if tokens.grad_fn is not None:
            tokens.grad_fn.register_prehook(lambda grads: self._count(grads))
        counts = torch.bincount(flat, minlength=self.experts)
        return tokens, order, counts

    def combine(self, out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, t: int) -> torch.Tensor:
        flat_w = weights.flatten()[order].unsqueeze(-1)
        y = torch.zeros(t, out.shape[-1], dtype=out.dtype, device=out.device)
        return y.index_add(0, order // self.top_k, out * flat_w)


class MoELayer(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.heads, self.top_k = heads, top_k
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.gate = nn.Linear(d, experts, bias=False)
        self.w_up = nn.Parameter(torch.randn(experts, d, 2 * d) / d**0.5)
        self.w_down = nn.Parameter(torch.randn(experts, 2 * d, d) / (2 * d) ** 0.5)
        self.shared_up, self.shared_down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.shared_gate = nn.Linear(d, 1)
        self.dispatcher = Dispatcher(experts, top_k)

    def _pre_moe_forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(t, 3, self.heads, d // self.heads).permute(1, 2, 0, 3)
        seq = torch.searchsorted(cu_seqlens[1:], torch.arange(t, device=x.device), right=True)
        pos = torch.arange(t, device=x.device)
        mask = (seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :])  # causal, per sequence
        with region("attn"):  # (4-D: the attention kernel, not a decomposition into bmm)
            o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)[0]
        return x + self.o(o.transpose(0, 1).reshape(t, d))

    def _route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with region("router"):
            weights, idx = self.gate(h).softmax(-1).topk(self.top_k, dim=-1)
            weights /= weights.sum(-1, keepdim=True)  # in place, as routers normalise
        return weights, idx

    def _experts_forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        expert = torch.repeat_interleave(
            torch.arange(counts.shape[0], device=tokens.device), counts, output_size=tokens.shape[0]
        )
        with region("experts"):  # every expert on every token, each token's own taken (static shapes)
            h = F.silu(torch.einsum("td,edf->tef", tokens, self.w_up)[rows, expert])
            return torch.einsum("tf,efd->ted", h, self.w_down)[rows, expert]

    def _shared_experts_forward(self, h: torch.Tensor) -> torch.Tensor:
        with region("shared_experts"):
            out = self.shared_down(F.silu(self.shared_up(h)))
        return torch.sigmoid(self.shared_gate(h)) * out

    def _post_moe_forward(self, x: torch.Tensor, routed: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        return x + routed + shared

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        x = self._pre_moe_forward(x, cu_seqlens)
        h = self.ln2(x)
        weights, idx = self._route(h)
        tokens, order, counts = self.dispatcher.dispatch(h, idx)
        routed = self.dispatcher.combine(self._experts_forward(tokens, counts), order, weights, h.shape[0])
        return self._post_moe_forward(x, routed, self._shared_experts_forward(h))


class MTPLayer(nn.Module):
    """A multi-token-prediction layer wrapping an MoE layer."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm_h, self.norm_e = nn.LayerNorm(d), nn.LayerNorm(d)
        self.proj = nn.Linear(2 * d, d, bias=False)
        self.layer = MoELayer(d)

    def forward(self, h: torch.Tensor, emb: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        return self.layer(self.proj(torch.cat([self.norm_h(h), self.norm_e(emb)], -1)), cu_seqlens)


class MethodCompiledMoE(nn.Module):
    """``n`` MoE layers and one MTP layer over a packed row; ``forward`` returns a scalar loss."""

    def __init__(self, n: int = 4, d: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MoELayer(d) for _ in range(n))
        self.mtp = MTPLayer(d)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.layers:
            h = layer(h, cu_seqlens)
        return h.square().mean() + self.mtp(h, x, cu_seqlens).square().mean()


def compile_methods(backend: Any = "inductor") -> Callable[[], None]:
    """Compile :data:`METHODS` on :class:`MoELayer` with ``fullgraph=True`` (as a trainer
    patches them on the class); returns the function that puts the originals back."""
    originals = {name: MoELayer.__dict__[name] for name in METHODS}
    for name, fn in originals.items():
        setattr(MoELayer, name, torch.compile(fn, fullgraph=True, backend=backend))

    def restore() -> None:
        for name, fn in originals.items():
            setattr(MoELayer, name, fn)

    return restore
