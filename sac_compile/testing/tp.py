"""Tensor-parallel fixtures: a Llama-style block sharded the way torchtitan shards Llama.

``LlamaBlock`` (RMSNorm, attention with separate ``wq``/``wk``/``wv``/``wo``, a SwiGLU feed
forward ``w1``/``w3``/``w2``, pre-norm residuals) and ``tp_plan()``: ``ColwiseParallel`` for
q/k/v and w1/w3, ``RowwiseParallel`` for wo and w2 (torchtitan's Llama plan, without its
sequence parallelism). Heads are read off the local shard (``view(b, t, -1, head_dim)``), so
the same block runs whole and sharded. Regions: ``REGIONS`` declares ``attention`` as
``attn`` and ``feed_forward`` as ``mlp``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["HEAD_DIM", "REGIONS", "LlamaBlock", "LlamaStack", "parallelize", "tp_plan"]

HEAD_DIM = 8
REGIONS = {"layers.*.attention": "attn", "layers.*.feed_forward": "mlp"}


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, HEAD_DIM).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d, 2 * d, bias=False)
        self.w3 = nn.Linear(d, 2 * d, bias=False)
        self.w2 = nn.Linear(2 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(d)
        self.attention = Attention(d)
        self.ffn_norm = nn.RMSNorm(d)
        self.feed_forward = FeedForward(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class LlamaStack(nn.Module):
    def __init__(self, n: int = 2, d: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LlamaBlock(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def tp_plan(sequence_parallel: bool = False) -> dict[str, Any]:
    """torchtitan's Llama tensor-parallel plan for one block; with ``sequence_parallel`` its
    full plan: the norms ``SequenceParallel`` (activations sharded on the sequence between
    the blocks), the attention's and feed forward's inputs gathered
    (``PrepareModuleInput``), ``wo`` / ``w2`` reduce-scattering back to sequence shards."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    rowwise = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
    plan: dict[str, Any] = {f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
    plan.update({f"feed_forward.{w}": ColwiseParallel() for w in ("w1", "w3")})
    plan.update({"attention.wo": rowwise, "feed_forward.w2": rowwise})
    if sequence_parallel:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
        plan.update({"attention": gather, "feed_forward": gather})
    return plan


def parallelize(stack: LlamaStack, mesh: Any, sequence_parallel: bool = False) -> LlamaStack:
    """Shard every block of ``stack`` over the 1-D ``mesh`` with :func:`tp_plan`. With
    ``sequence_parallel`` the residual stream between the blocks is each rank's chunk of
    the sequence (``x.chunk(world_size, dim=1)[rank]``, as torchtitan's embedding hands it
    on), DTensors only inside the norms and projections."""
    from torch.distributed.tensor.parallel import parallelize_module

    for layer in stack.layers:
        parallelize_module(layer, mesh, tp_plan(sequence_parallel))
    return stack
