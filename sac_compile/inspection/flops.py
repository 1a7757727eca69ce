"""Recomputed FLOPs, counted: the matmul / attention / grouped-matmul FLOPs a backward runs.

A dispatch mode over the backward of an ``aot_eager``-compiled function sees every op the
partitioner put there, recomputed ones included; subtracting the no-checkpoint backward's
count leaves what checkpointing recomputes. Only the ops that dominate a layer's cost are
counted (``costly_flops``), so the figure is noise-free and comparable across configurations.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from .._compat.checkpoint import TorchDispatchMode, tree_map
from .._compat.ops import HigherOrderOperator, OpOverload, is_view_op, op_name

__all__ = [
    "CountFlops",
    "costly_flops",
    "graph_attention_flops",
    "graph_costly_flops",
    "graph_traffic",
    "node_cost",
    "saved_bytes_and_backward_flops",
    "scalar_loss",
    "val_bytes",
]

aten = torch.ops.aten
# The partitioner wraps a recomputed seeded op (the CPU SDPA kernel among them) in one of
# these: (rng_state, op, *args); the op inside is dispatched unseen otherwise.
_RNG_HOPS = {"run_with_rng_state", "run_and_save_rng_state", "graphsafe_run_with_rng_state"}
_HF_GROUPED_MM = "transformers.grouped_mm_fallback"  # transformers' opaque grouped-mm custom op
# the planner's flash kernel for a CUDA target on the meta device (planning/kernels.py)
_PLANNED_FLASH = "sac_compile_plan.flash_attention"
_PLANNED_FLASH_BACKWARD = "sac_compile_plan.flash_attention_backward"


def costly_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """Matmul / attention / grouped-matmul FLOPs of one op call (0 for every other op)."""
    packet = getattr(func, "overloadpacket", None)
    if packet in flop_registry:
        return int(flop_registry[packet](*args, **kwargs, out_val=out))
    name = op_name(func)
    if packet is aten._scaled_dot_product_flash_attention_for_cpu:
        return int(sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape))
    # the planner's flash stand-in for a GPU target: a causal flash kernel skips the blocks
    # above the diagonal, half the work (PyTorch's counter counts them all)
    if name == _PLANNED_FLASH:  # (query, key, value, is_causal, scale)
        flops = int(sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape))
        return flops // 2 if args[3] else flops
    if name == _PLANNED_FLASH_BACKWARD:  # (grad, query, key, value, out, lse, is_causal, scale)
        flops = int(sdpa_backward_flop_count(args[0].shape, args[1].shape, args[2].shape, args[3].shape))
        return flops // 2 if args[6] else flops
    if packet is getattr(aten, "_grouped_mm", None) or name == _HF_GROUPED_MM:
        a, b = args[0], args[1]
        if a.dim() == 2 and b.dim() == 3:  # tokens x k  @  experts x k x n
            return 2 * a.shape[0] * a.shape[1] * b.shape[2]
        if a.dim() == 2 and b.dim() == 2:  # k x tokens  @  tokens x n -> experts x k x n (weight gradients)
            return 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return 2 * math.prod(out.shape) * a.shape[-1]
    return 0


class CountFlops(TorchDispatchMode):
    """``with CountFlops() as c: ...``: ``c.flops`` is the :func:`costly_flops` of every op run."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.flops += _call_flops(func, args, kwargs, out)
        return out


def _call_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """:func:`costly_flops` of one call as a graph or a dispatch mode sees it: an op, or the
    op inside one of the partitioner's RNG wrappers, ``(rng_state, op, *args)``."""
    if isinstance(func, HigherOrderOperator) and func.name() in _RNG_HOPS:
        inner_out = out[1] if func.name() == "run_and_save_rng_state" and out is not None else out
        return costly_flops(args[1], args[2:], kwargs, inner_out)
    if isinstance(func, OpOverload):
        return costly_flops(func, args, kwargs, out)
    return 0


def graph_costly_flops(gm: torch.fx.GraphModule) -> int:
    """The :func:`costly_flops` of every call in a partitioned graph, read off the fake
    tensors in ``node.meta["val"]`` without running it (what :class:`CountFlops` counts when
    the graph runs under ``aot_eager``: the ops of an AOTAutograd graph are what dispatches)."""
    return sum(node_cost(n)[0] for n in gm.graph.nodes)


def graph_attention_flops(gm: torch.fx.GraphModule) -> int:
    """The :func:`costly_flops` of a graph's attention kernels alone (SDPA's, the planner's
    flash stand-in; inside the partitioner's RNG wrappers too): what runs at the device's
    attention rate (``planning.step_time``)."""
    return sum(node_cost(n)[0] for n in gm.graph.nodes if n.op == "call_function" and _is_attention(n))


def _is_attention(n: torch.fx.Node) -> bool:
    target: Any = n.target
    if isinstance(target, HigherOrderOperator) and target.name() in _RNG_HOPS and len(n.args) > 1:
        target = n.args[1]
    return isinstance(target, OpOverload) and "attention" in op_name(target)


def graph_traffic(gm: torch.fx.GraphModule) -> int:
    """The bytes the graph's other ops (every call that is not :func:`costly_flops`'s: the
    memory-bound ones) read and write, each run on its own (unfused: what eager code moves,
    an upper bound on what a fusing compiler moves), read off ``node.meta["val"]``. Views,
    aliases and ``getitem`` move nothing; a copy to or from host memory (an offloaded value's
    ``device_put``) crosses the host link, not the device's memory (planning.offload)."""
    return sum(node_cost(n)[1] for n in gm.graph.nodes)


def node_cost(n: torch.fx.Node) -> tuple[int, int]:
    """One node's ``(costly FLOPs, memory-bound bytes)``: :func:`graph_costly_flops`' and
    :func:`graph_traffic`'s share of it."""
    if n.op != "call_function":
        return 0, 0

    def val(a: Any) -> Any:
        return a.meta.get("val") if isinstance(a, torch.fx.Node) else a

    flops = _call_flops(n.target, tree_map(val, n.args), tree_map(val, dict(n.kwargs)), n.meta.get("val"))
    if flops:
        return flops, 0
    if not isinstance(n.target, (OpOverload, HigherOrderOperator)) or is_view_op(n.target):
        return 0, 0
    if n.target is torch.ops.prims.device_put.default:
        return 0, 0
    return 0, sum(val_bytes(a.meta.get("val")) for a in n.all_input_nodes) + val_bytes(n.meta.get("val"))


def val_bytes(val: Any) -> int:
    """The bytes of a tensor (or a tuple / list of them) in ``node.meta["val"]``; 0 for a
    symbolic size."""
    if isinstance(val, torch.Tensor):
        try:
            return int(val.numel()) * val.element_size()
        except (RuntimeError, TypeError):  # an unbacked or symbolic size
            return 0
    if isinstance(val, (tuple, list)):
        return sum(val_bytes(v) for v in val)
    return 0


def scalar_loss(out: Any) -> torch.Tensor:
    """The float sum of ``out``, or of its first item when it is a tuple or list."""
    return (out[0] if isinstance(out, (tuple, list)) else out).float().sum()


def saved_bytes_and_backward_flops(fn, *args: Any, exclude: Any = ()) -> tuple[int, int]:
    """``(bytes autograd saves, costly backward FLOPs)`` of one forward + backward of ``fn(*args)``.

    Bytes are the distinct storages the forward's saved-tensors hooks see, at their size when
    saved, those of ``exclude`` (pass the parameters) left out; the backward runs under
    :class:`CountFlops`. A first output that is a tuple or list is reduced by its first item.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = scalar_loss(fn(*args))
    counter = CountFlops()
    with counter:
        loss.backward()
    return sum(storages.values()), counter.flops
