"""PyTorch's own alternatives that the benchmarks compare against."""

from __future__ import annotations

import functools

import torch
import torch._functorch.config as functorch_config
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from sac_compile.compiler.backend import baseline_backend
from sac_compile.testing.baselines import LayerWrapper

aten = torch.ops.aten

#: What op-list SAC saves (torchtitan's op-list AC): the matmul family and attention kernels.
OP_LIST = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention.default,
    }
    | ({aten._grouped_mm.default} if hasattr(aten, "_grouped_mm") else set())
)


def _hf_grouped_mm():
    """transformers' own grouped-matmul op (its MoE experts under ``torch.compile``), if registered."""
    ns = getattr(torch.ops, "transformers", None)
    op = getattr(ns, "grouped_mm_fallback", None) if ns is not None else None
    return None if op is None else op.default


def op_list_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """``MUST_SAVE`` for :data:`OP_LIST` and transformers' grouped matmul, else ``PREFER_RECOMPUTE``."""
    saved = op in OP_LIST or (op is not None and op == _hf_grouped_mm())
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


class OpListSAC(LayerWrapper):
    """``layer`` under PyTorch's SAC saving :data:`OP_LIST` (non-reentrant ``torch.utils.checkpoint``)."""

    def forward(self, *args, **kwargs):
        ctx = functools.partial(create_selective_checkpoint_contexts, op_list_policy)
        return checkpoint(self.layer, *args, use_reentrant=False, context_fn=ctx, **kwargs)


class BudgetBackend:
    """The plain compile (no sac pass) with ``activation_memory_budget`` set for its partition."""

    def __init__(self, budget: float, inner: str) -> None:
        self.budget = budget
        self.inner = baseline_backend(inner)

    def __call__(self, gm, example_inputs):
        with functorch_config.patch(activation_memory_budget=self.budget):
            return self.inner(gm, example_inputs)
