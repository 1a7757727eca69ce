"""What an op is, as both engines and the region policies see it: costly (worth saving),
a collective, communication proper, a matmul.

``op`` is what the op is in both engines: an ``OpOverload`` (``aten.mm.default``), a
custom op's overload, an ``OpOverloadPacket``, or a higher-order op.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from ._compat import ops as op_types
from ._compat.ops import packet_namespace, schema

__all__ = ["MATMULS", "communicates", "is_collective", "is_costly"]

_aten = torch.ops.aten

# The matmul family, convolutions and attention kernels (forward ops as they appear
# in joint graphs and under a dispatch mode: composite ops like linear/matmul
# decompose into these before either engine sees them).
_COSTLY_PACKETS = tuple(
    getattr(_aten, name)
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "addbmm",
        "_addmm_activation",
        "matmul",
        "linear",
        "_int_mm",
        "_grouped_mm",
        "_scaled_mm",
        "_scaled_mm_v2",
        "_scaled_grouped_mm",
        "_weight_int4pack_mm",
        "_weight_int4pack_mm_for_cpu",
        "_weight_int8pack_mm",
        "convolution",
        "_convolution",
        "conv1d",
        "conv2d",
        "conv3d",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
        "_flash_attention_forward",
        "_efficient_attention_forward",
        "scaled_dot_product_attention",
        "_native_multi_head_attention",
    )
    if hasattr(_aten, name)
)
_COSTLY = frozenset(_COSTLY_PACKETS)
#: Matmul outputs: costly values whose own backward reads only their inputs (an attention
#: kernel's output, by contrast, is read by its backward). A small read of one may be saved
#: instead of it (the "shrinking read" rule of the pass and the eager engine).
MATMULS = frozenset(
    getattr(_aten, name) for name in ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm") if hasattr(_aten, name)
)
# Namespaces whose ops are PyTorch's own decomposed / primitive ops, not opaque kernels.
_TRANSPARENT_NAMESPACES = frozenset({"aten", "prims", "prim", "quantized_decomposed", "sac_compile"})
_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d", "c10d_functional"})
# Higher-order ops that are control flow or bookkeeping, not kernels.
_STRUCTURAL_HOPS = frozenset(
    {
        "cond",
        "while_loop",
        "map",
        "scan",
        "associative_scan",
        "with_effects",
        "auto_functionalized_v2",
        "run_and_save_rng_state",
        "run_with_rng_state",
        "graphsafe_run_with_rng_state",
        "tag_activation_checkpoint",
        "wrap",
        "wrap_with_set_grad_enabled",
        "wrap_with_autocast",
    }
)


def is_costly(op: Any) -> bool:
    """Whether ``op``'s output is *costly* to recompute (see Note [What a kept region saves]).

    True for the matmul family, convolutions and attention kernels (every SDPA
    variant, ``flex_attention``), grouped and scaled matmuls, collectives, opaque
    custom ops (any namespace but PyTorch's own) and kernel-like higher-order ops
    (``flex_attention``, user Triton kernels, ``auto_functionalized`` custom ops,
    ``invoke_subgraph``).
    """
    if op is operator.getitem:
        return False
    if isinstance(op, op_types.OpOverload):
        if op.overloadpacket in _COSTLY:
            return True
        ns = op.namespace
        if ns in _COLLECTIVE_NAMESPACES:
            return schema(op).name != "_c10d_functional::wait_tensor"  # waits follow their producer
        return ns not in _TRANSPARENT_NAMESPACES
    if isinstance(op, op_types.OpOverloadPacket):
        return op in _COSTLY or packet_namespace(op) not in _TRANSPARENT_NAMESPACES
    if isinstance(op, op_types.HigherOrderOperator):
        return op.name() not in _STRUCTURAL_HOPS
    return False


# recomputed with their collective, but not communication themselves
_COLLECTIVE_COMPANIONS = frozenset(
    {
        "_c10d_functional::wait_tensor",
        "_c10d_functional::_wrap_tensor_autograd",
        "c10d_functional::wait_tensor",  # the legacy namespace's wait
    }
)


def is_collective(op: Any) -> bool:
    """A ``c10d`` / ``_c10d_functional`` op, communication or companion (wait, wrapper)."""
    return getattr(op, "namespace", None) in _COLLECTIVE_NAMESPACES


def communicates(op: Any) -> bool:
    """A collective proper (counted), as opposed to its wait / wrapper companions."""
    return is_collective(op) and schema(op).name not in _COLLECTIVE_COMPANIONS
