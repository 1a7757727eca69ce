"""Operator types (``torch._ops``): what kind of callable an FX node or a dispatched op is."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["OpOverload", "OpOverloadPacket", "HigherOrderOperator", "is_view_op", "op_name"]

# torch._ops is where the operator classes live; torch.ops only exposes instances.
OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket
HigherOrderOperator = torch._ops.HigherOrderOperator


def is_view_op(target: Any) -> bool:
    """An ATen overload whose output aliases its input (``OpOverload.is_view``)."""
    return isinstance(target, OpOverload) and target.is_view


def op_name(target: Any) -> str:
    """``aten.mm`` for an overload (its packet's qualified name), else the callable's name."""
    if isinstance(target, OpOverload):
        return target.overloadpacket._qualified_op_name.replace("::", ".")
    return getattr(target, "__name__", str(target))
