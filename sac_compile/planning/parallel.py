"""What one tensor-parallel rank holds of what a layer saves: the saved values split by kind.

A layer is measured whole, on one device. Under tensor parallelism as torchtitan lays it out
(Megatron's column / row split of each block's projections: ``ColwiseParallel`` for the
projections that read the residual stream, ``RowwiseParallel`` for those that write back to
it), each rank holds of each saved value:

* **sharded**: a value between a column-parallel projection and the row-parallel one after
  it (queries, keys, values, the attention's output and logsumexp, the MLP's hidden
  activations): ``1 / tp`` of it, split by heads or hidden units;
* **gathered**: the residual stream's value a column-parallel projection reads (the norm's
  output): the whole of it on every rank. Without sequence parallelism it is replicated;
  with it (torchtitan's ``PrepareModuleInput``) it is all-gathered from the sequence shards,
  and the projection saves the gathered tensor (Megatron-LM instead saves its shard and
  gathers it again in the backward: ``1 / tp``, not modelled);
* **stream**: every other value of the residual stream (the layer's input, the norms' inputs
  and statistics, the residual sums): whole without sequence parallelism, ``1 / tp`` with it
  (each rank holds its chunk of the sequence).

With sequence parallelism torchtitan gathers a block's input at the attention's and the
feed forward's entry (``PrepareModuleInput``), inside the region: a kept region saves the
gathered tensor its projections read, whole, though the norm's output it is gathered from is
recomputed (the third figure of :func:`tensor_parallel_split`; measured on 2 gloo ranks:
``tests/test_tensor_parallel.py``).

:func:`tensor_parallel_split` classifies the saved values of a partitioned forward graph by
following it from its inputs: a matmul with a parameter operand is a projection; it is
column-parallel when its activation operand is not sharded (its output is), row-parallel
when it is (its output is back in the stream); any other op's output is sharded when one of
its activation inputs is. What TP leaves whole is never sharded: the values of the regions
named in :data:`WHOLE_REGIONS` (a router, the routed experts: expert parallelism splits
those, and under sequence parallelism each rank routes its chunk of the tokens, so they are
the stream's), and integer values (indices, counts), which only route.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .._compat.aot import is_tangent, offloaded_source
from .._compat.ops import is_view_op
from .._compat.tensors import storage_id

if TYPE_CHECKING:
    from .candidates import Candidate
    from .devices import Target

__all__ = [
    "WHOLE_REGIONS",
    "eager_held",
    "eager_share",
    "held",
    "per_rank_bytes",
    "rank_share",
    "sequence_split_input",
    "tensor_parallel_split",
    "tensor_parallel_splits",
]

#: Regions whose values tensor parallelism leaves whole (the names ``hf.regions_for`` and the
#: torchtitan plugin declare)
WHOLE_REGIONS = frozenset({"router", "experts"})

_WEIGHT, _SHARDED, _STREAM = "weight", "sharded", "stream"
# a forward graph classified (parallel._classify): each node's kind, the row-parallel
# projections, each view's base, each stream value a column-parallel projection reads -> those
_Layout = tuple[
    dict[torch.fx.Node, str],
    list[torch.fx.Node],
    dict[torch.fx.Node, torch.fx.Node],
    dict[torch.fx.Node, list[torch.fx.Node]],
]

aten = torch.ops.aten
# (op, index of the activation operand, index of the weight operand)
_PROJECTIONS = {
    aten.mm.default: (0, 1),
    aten.addmm.default: (1, 2),
    aten.linear.default: (0, 1),
    aten.matmul.default: (0, 1),
}


def tensor_parallel_split(
    fw: torch.fx.GraphModule,
    bw: torch.fx.GraphModule,
    is_param: Callable[[str], bool],
    regions: Callable[[str], tuple[str, ...]] = lambda name: (),
    saving: Callable[[tuple[str, ...]], bool] = lambda regions: False,
) -> tuple[int, int, int, int]:
    """``(sharded, gathered, gathered_in_region, row_outputs)``: the bytes of the values ``bw`` reads from
    ``fw`` (distinct storages; parameters left out, as the planner's saved bytes leave them)
    that are sharded ``tp`` ways, and those that a column-parallel projection reads from the
    residual stream; the rest of the saved bytes is the stream's. ``gathered_in_region``:
    bytes not saved here that a rank saves with sequence parallelism, the stream values a
    saved column-parallel projection reads (gathered in its region). ``is_param``: whether a
    placeholder of ``fw`` (by name) is a parameter; ``regions``: the regions a node (by name)
    belongs to. ``row_outputs``: the outputs of row-parallel projections in a region
    ``saving`` says is saved (kept or offloaded) that are not saved here: under tensor
    parallelism the eager engine holds each (before its all-reduce or reduce-scatter, whole on
    every rank), because the collective TP adds reads it inside the region."""
    layout = _classify(fw, is_param, regions)
    return _count(layout, fw, bw, regions, saving, offloaded=False)


def tensor_parallel_splits(
    fw: torch.fx.GraphModule,
    bw: torch.fx.GraphModule,
    is_param: Callable[[str], bool],
    regions: Callable[[str], tuple[str, ...]],
    saving: Callable[[tuple[str, ...]], bool],
    moving: Callable[[tuple[str, ...]], bool],
) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """:func:`tensor_parallel_split` of the values ``bw`` reads from ``fw``, and the same figures
    for the values it brings back from host memory (what an offloaded region sends, split as
    the values a rank holds are; ``moving``: whether a region is offloaded), from one
    classification of ``fw``."""
    layout = _classify(fw, is_param, regions)
    return (
        _count(layout, fw, bw, regions, saving, offloaded=False),
        _count(layout, fw, bw, regions, moving, offloaded=True),
    )


def _count(
    layout: _Layout,
    fw: torch.fx.GraphModule,
    bw: torch.fx.GraphModule,
    regions: Callable[[str], tuple[str, ...]],
    saving: Callable[[tuple[str, ...]], bool],
    *,
    offloaded: bool,
) -> tuple[int, int, int, int]:
    """:func:`tensor_parallel_split`'s figures over ``bw``'s saved values, or (``offloaded``)
    the values it brings back from the host."""
    kind, rows, base, column_inputs = layout
    nodes = {n.name: n for n in fw.graph.nodes}
    sharded = gathered = 0
    seen: set[torch.fx.Node] = set()
    storages: set[int] = set()  # (a storage counts once, as the partition report counts it)
    for p in bw.graph.nodes:
        name = offloaded_source(p.name) if p.op == "placeholder" else p.name
        if p.op != "placeholder" or is_tangent(p.name) or name not in nodes or offloaded != (name != p.name):
            continue
        node = nodes[name]
        root = base.get(node, node)
        val = node.meta.get("val")
        if root in seen or not isinstance(val, torch.Tensor):
            continue
        seen.add(root)
        seen.add(node)
        if (key := storage_id(val.untyped_storage())) in storages:
            continue
        storages.add(key)
        if kind.get(root) == _WEIGHT and root.op == "placeholder":
            continue
        nbytes = _nbytes(root)
        if kind.get(node) in (_SHARDED, _WEIGHT) or kind.get(root) == _SHARDED:
            sharded += nbytes
        elif root in column_inputs:
            gathered += nbytes
    in_region = sum(
        _nbytes(value)
        for value, projections in column_inputs.items()
        if value not in seen and any(n in seen for n in projections)
    )
    row_outputs = sum(_nbytes(n) for n in rows if n not in seen and saving(regions(n.name)))
    return sharded, gathered, in_region, row_outputs


def _classify(
    fw: torch.fx.GraphModule, is_param: Callable[[str], bool], regions: Callable[[str], tuple[str, ...]]
) -> _Layout:
    """Each forward node's kind (weight, sharded or stream), the row-parallel projections, each
    view's base, and each stream value a column-parallel projection reads with those projections."""
    kind: dict[torch.fx.Node, str] = {}
    rows: list[torch.fx.Node] = []  # row-parallel projections
    base: dict[torch.fx.Node, torch.fx.Node] = {}
    column_inputs: dict[torch.fx.Node, list[torch.fx.Node]] = {}  # stream value -> projections
    for n in fw.graph.nodes:
        if n.op == "placeholder":
            kind[n] = _WEIGHT if is_param(n.name) else _STREAM
            continue
        if n.op != "call_function":
            continue
        inputs = n.all_input_nodes
        if (is_view_op(n.target) or n.target is aten._unsafe_view.default) and inputs:
            base[n] = base.get(inputs[0], inputs[0])  # (an _unsafe_view aliases its input too)
        activations = [a for a in inputs if kind.get(a) != _WEIGHT]
        projection = _PROJECTIONS.get(n.target)
        if inputs and not activations:
            kind[n] = _WEIGHT  # computed from parameters alone (a transpose, a cast)
        elif WHOLE_REGIONS & set(regions(n.name)) or not _floating(n):
            kind[n] = _STREAM  # left whole by TP, or only routing (indices, counts)
        elif projection and _kind(n.args, projection[1], kind) == _WEIGHT:
            act = n.args[projection[0]]
            if kind.get(act) == _SHARDED:
                kind[n] = _STREAM  # row-parallel: reduced back into the stream
                rows.append(n)
            else:
                kind[n] = _SHARDED  # column-parallel
                column_inputs.setdefault(base.get(act, act), []).append(n)
        elif any(kind.get(a) == _SHARDED for a in activations):
            kind[n] = _SHARDED
        else:
            kind[n] = _STREAM
    return kind, rows, base, column_inputs


def _nbytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    return int(val.untyped_storage().nbytes()) if isinstance(val, torch.Tensor) else 0


def _floating(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value is floating point (a tuple: its first tensor's); no value: yes."""
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    return not isinstance(val, torch.Tensor) or val.is_floating_point()


def _kind(args: tuple, index: int, kind: dict[torch.fx.Node, str]) -> str | None:
    value = args[index] if index < len(args) else None
    return kind.get(value) if isinstance(value, torch.fx.Node) else None


def per_rank_bytes(total: int, split: tuple[int, ...], tp: int, sequence_parallel: bool) -> int:
    """What one of ``tp`` ranks holds of ``total`` saved bytes split as
    :func:`tensor_parallel_split` splits them (its first three figures)."""
    if tp == 1:
        return total
    sharded, gathered, in_region = split[:3]
    stream = max(total - sharded - gathered, 0)
    if sequence_parallel:
        return int(sharded / tp + gathered + in_region + stream / tp)
    return int(sharded / tp + gathered + stream)


def rank_share(total: int, split: tuple[int, int, int], target: Target) -> float:
    """The fraction of a layer's saved bytes one tensor-parallel rank holds."""
    if target.layout.tp == 1 or total == 0:
        return 1.0
    return per_rank_bytes(total, split, target.layout.tp, target.layout.sequence_parallel) / total


def held(c: Candidate, target: Target, compile: bool) -> int:
    """What a layer with candidate ``c`` holds per device of ``target`` (as
    :func:`~sac_compile.planning.figures.figures_of` counts it): under tensor parallelism a
    rank's share; eager, the engine's bytes (:func:`eager_held`), before ``figures_of`` takes
    off the layer input's split under sequence parallelism (:func:`sequence_split_input`: the
    same for every candidate of a layer, so the frontier's order and the offloaded
    differences read from ``held`` do not depend on it)."""
    if compile:
        return int(c.saved_bytes * rank_share(c.saved_bytes, c.tp_split, target))
    return int(eager_held(c, eager_share(c, target), target))


def eager_share(c: Candidate, target: Target) -> float:
    """The share of ``c``'s bytes the eager engine holds on one tensor-parallel rank: split as
    without sequence parallelism, which splits nothing it holds but the layer's input (the
    checkpoint's; :func:`sequence_split_input`). Measured on two gloo ranks: under sequence
    parallelism every keep set held exactly the bytes it held without, less half the input."""
    return rank_share(c.saved_bytes, c.tp_split, target.replace(sequence_parallel=False))


def sequence_split_input(stream_input_bytes: int, target: Target) -> int:
    """What sequence parallelism takes off a checkpointed layer's eager bytes on one rank: the
    part of its input (the residual stream, ``Plan.stream_input_bytes``) other ranks hold."""
    if target.layout.tp == 1 or not target.layout.sequence_parallel:
        return 0
    return stream_input_bytes - stream_input_bytes // target.layout.tp


def eager_held(c: Candidate, share: float, target: Target) -> float:
    """What the eager engine holds for a layer with ``c`` on one rank: as much of its bytes as
    the partition saves, split as the partition's (``share``); what it holds beyond (RNG
    states) and, under tensor parallelism, the row-parallel projections' outputs its saved
    regions hold before their reduction (``Candidate.tp_row_outputs``), whole on every rank."""
    if c.eager_bytes is None:
        return c.saved_bytes * share
    beyond = max(c.eager_bytes - c.saved_bytes, 0)
    rows = c.tp_row_outputs if target.layout.tp > 1 else 0
    return (c.eager_bytes - beyond) * share + beyond + rows
