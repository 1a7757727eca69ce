"""Operator types (``torch._ops``): what kind of callable an FX node or a dispatched op is."""

from __future__ import annotations

import functools
from typing import Any

import torch

from . import private

__all__ = [
    "HigherOrderOperator",
    "OpOverload",
    "OpOverloadPacket",
    "functional_all_to_all",
    "is_effectful",
    "is_view_op",
    "modes_active",
    "op_name",
    "packet_namespace",
    "schema",
]

# torch._ops is where the operator classes live; torch.ops only exposes instances.
OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket
HigherOrderOperator = torch._ops.HigherOrderOperator


# The C calls behind torch.utils._python_dispatch's and torch.overrides' "is a mode
# active" checks: the length of the TorchDispatchMode stack, and whether a
# TorchFunctionMode is enabled (torch.device(...) as a context manager installs one).
_dispatch_mode_depth = torch._C._len_torch_dispatch_stack
_function_mode_enabled = torch._C._is_torch_function_mode_enabled


def modes_active() -> bool:
    """Whether a Python dispatch mode or torch-function mode is active: something that may
    see an op with no tensor argument (make_fx's proxy mode, FakeTensorMode, a mode of yours)."""
    return _dispatch_mode_depth() > 0 or _function_mode_enabled()


def is_view_op(target: Any) -> bool:
    """An ATen overload whose output aliases its input (``OpOverload.is_view``)."""
    return isinstance(target, OpOverload) and target.is_view


@functools.lru_cache(maxsize=4096)
def is_effectful(func: Any) -> bool:
    """An op registered with side effects (``torch.library._register_effectful_op``;
    ``torch._higher_order_ops.effects._get_effect``): ``aten._print``, torchbind calls, a
    user's effectful custom op. Under compile it is threaded with an effect token
    (``with_effects``) and never recomputed. Looked up once per op: effects are
    registered with the op, before it first runs."""
    if not isinstance(func, OpOverload):
        return False
    return private("torch._higher_order_ops.effects", "_get_effect")(func) is not None


def schema(op: Any) -> Any:
    """An operator overload's ``FunctionSchema`` (arguments, returns, alias info)."""
    return op._schema


def packet_namespace(packet: Any) -> str:
    """The namespace of an ``OpOverloadPacket`` (``aten`` for ``torch.ops.aten.mm``)."""
    return str(packet._qualified_op_name).split("::")[0]


def op_name(target: Any) -> str:
    """``aten.mm`` for an overload (its packet's qualified name), else the callable's name."""
    if isinstance(target, OpOverload):
        return str(target.overloadpacket._qualified_op_name).replace("::", ".")
    return getattr(target, "__name__", str(target))


def functional_all_to_all(t: torch.Tensor, group: Any) -> torch.Tensor:
    """Equal-split all-to-all as a differentiable functional collective (its backward is
    the reverse all-to-all): ``torch.distributed._functional_collectives``
    ``all_to_all_single_autograd``, whose ops (``_c10d_functional.all_to_all_single`` +
    ``wait_tensor``) the compiled path can save."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(t, None, None, group)
