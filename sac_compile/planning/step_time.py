"""A training step's time on a target: compute at the rate published runs reach, plus the
communication compute does not hide.

One model for every configuration (:func:`step_time`):

* **compute**: the step's roofline — every matmul / attention / grouped-matmul FLOP (forward,
  backward, recomputed, the LM head) at the device's peak dense bf16 rate and every byte the
  other ops move at its memory bandwidth — divided by the device's ``efficiency``: the
  fraction of that roofline a whole compiled step of a published run reached
  (:attr:`~sac_compile.planning.devices.Device.efficiency_source` names the run). Split
  ``tp`` ways. Attention FLOPs (the traced forward's attention kernels', the ring's) run
  instead at the rate the device's attention kernel was measured at, where one was
  (:attr:`~sac_compile.planning.devices.Device.attention_flops`). Eager layers take
  :data:`~sac_compile.planning.devices.EAGER_SLOWDOWN` times as long (from a published pair
  of runs, eager and compiled).
* **FSDP**: each layer's parameters all-gathered in the forward and again in the backward
  (FSDP2 reshards after the forward; not again with ``Target.fsdp_reshard_after_forward``
  ``False``), its gradients reduce-scattered in ``reduce_dtype``; a
  ring moves ``(n - 1) / n`` of the unsharded bytes per rank. They overlap the neighbouring
  layer's compute (FSDP2 prefetches one layer): per layer only what exceeds that layer's
  forward / backward compute is exposed, plus the first all-gather and the last
  reduce-scatter.
* **TP** (torchtitan's layout): per layer two all-gathers and two reduce-scatters of the
  residual stream with sequence parallelism (two all-reduces without), in the forward, again
  in the backward, and in the recomputed forward in proportion to the FLOPs recomputed;
  exposed. With sequence parallelism DTensor's collectives also copy the whole stream around
  them (:func:`sequence_parallel_copies`), at the device's memory bandwidth (under async TP
  its fused ops instead: not counted). With ``Target.async_tp`` (compiled layers) each
  pass's collectives run in ``tp`` chunks under the projection matmuls beside them (the
  forward's, the input gradients' of the backward: as many FLOPs, the recompute's): all but
  the first chunk's matmul hides them, what exceeds it is exposed (the chunked matmuls'
  lower rate is not modelled).
* **EP**: per MoE layer the tokens' dispatch and combine all-to-all (``top_k`` copies of the
  stream), forward and backward; not overlapped.
* **offload**: an offloaded region's values copied to host memory and back over the host link
  (:mod:`~sac_compile.planning.offload`): compiled, what the layer's own forward / backward
  does not hide; eager, every copy. ``transfer`` is every copy, hidden or not.

A collective runs over the node's GPU link (:attr:`Device.link`) when its group fits in a
node (``Target.gpus_per_node``; the mesh is torchtitan's, ``tp`` innermost), else over the
network (``Target.network`` bytes/s per GPU), at :data:`LINK_EFFICIENCY` of either.
``tokens_per_second`` is per GPU as torchtitan logs it (a data-parallel rank's tokens over
the step, divided by ``tp``); ``mfu`` counts the model's FLOPs (no recompute) at the peak rate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from .core import Candidate, Plan
from .devices import EAGER_SLOWDOWN, Target, parse_loss
from .host import WORLD
from .offload import transfer
from .peak import ModelSizes, dtype_bytes, kept_params
from .pipeline import makespan, stage_layers

__all__ = [
    "LINK_EFFICIENCY",
    "StepTime",
    "layer_seconds",
    "ring_flops",
    "sequence_parallel_copies",
    "step_time",
]

#: the fraction of a link's bandwidth a large ring collective reaches (``world.json``: NCCL's
#: bus bandwidth in nccl-tests on NVLink and 400 Gb/s InfiniBand is about 80-90% of the link's)
LINK_EFFICIENCY: float = WORLD["links"]["collective_efficiency"]["value"]


@dataclass(frozen=True)
class StepTime:
    """A step's predicted seconds, by term, and what they make."""

    compute: float
    fsdp: float  # exposed: not hidden behind compute
    tp: float
    ep: float
    tokens: int  # a data-parallel rank's tokens per step
    ranks_per_replica: int  # tp x cp x pp: the GPUs that share those tokens
    model_flops: float  # per GPU, without recompute
    peak_flops: float
    cp: float = 0.0  # ring attention's passes not hidden behind attention
    bubble: float = 0.0  # the pipeline's fill and drain
    dp: float = 0.0  # the replicas' gradient sync (DDP, HSDP, ZeRO) not hidden behind the backward
    offload: float = 0.0  # copies to and from host memory not hidden behind compute
    transfer: float = 0.0  # every copy to and from host memory (hidden or not: not a term)

    @property
    def seconds(self) -> float:
        return sum(self.terms().values())

    @property
    def tokens_per_second(self) -> float:
        """Per GPU, as torchtitan logs it."""
        return self.tokens / self.seconds / self.ranks_per_replica

    @property
    def mfu(self) -> float:
        return self.model_flops / self.seconds / self.peak_flops

    def terms(self) -> dict[str, float]:
        return {
            "compute": self.compute,
            "fsdp": self.fsdp,
            "tp": self.tp,
            "ep": self.ep,
            "cp": self.cp,
            "bubble": self.bubble,
            "dp": self.dp,
            "offload": self.offload,
        }


def _link(target: Target, group: int, inner: int) -> float:
    """Bytes/s a ring over ``group`` ranks reaches, ``inner`` ranks apart in the mesh."""
    device = target.machine.device
    inside = group * inner <= target.machine.gpus_per_node and device.link > 0
    return (device.link if inside else target.machine.network) * LINK_EFFICIENCY


@dataclass
class _Sum:
    compute: float = 0.0
    model: float = 0.0
    fsdp: float = 0.0
    gathers: list[float] = dataclasses.field(default_factory=list)  # with pp: per layer
    first: float = 0.0  # without pp: the first all-gather and the last reduce-scatter
    last: float = 0.0
    tp: float = 0.0
    ep: float = 0.0
    cp: float = 0.0
    offload: float = 0.0
    transfer: float = 0.0
    backward: float = 0.0  # the layers' backward compute (what hides the replicas' sync)
    sync: float = 0.0  # the replicas' gradient sync, every layer's
    sync_last: float = 0.0  # the last layer's (nothing after it to hide it)
    gather: float = 0.0  # ZeRO: the updated parameters all-gathered after the step


def step_time(
    layers: Sequence[tuple[int, Plan, Candidate | None, tuple[int, int]]],
    sizes: ModelSizes,
    target: Target,
    *,
    measured: float | None = None,
    compile: bool = True,
) -> StepTime:
    """The step of ``target`` with, per kind of layer, its count, plan table, candidate (None:
    no checkpoint) and one layer's (parameters, of them routed experts'). ``measured``: the
    layers' forward + backward seconds measured on the device itself (the head estimated).
    Layer figures are per traced unit (one microbatch, one rank's share of the sequence): a
    rank runs ``1 / pp`` of the layers for each of ``target.microbatches``. ``compile``: the
    layers compiled (offload copies overlap compute: :mod:`.offload`) or eager."""
    rate = target.machine.device.bf16_flops
    runs = target.microbatches / target.layout.pp  # traced units of every layer a rank runs a step
    head_flops = sizes.head_flops * 4 // 3 if _chunked(target) else sizes.head_flops
    head = target.compute_seconds(head_flops, sizes.head_traffic)
    total = _Sum(compute=head * runs, model=sizes.head_flops * runs)
    for count, table, c, params in layers:
        _layer(total, count * runs, table, c, params, sizes, target, compile)
    if measured is not None:  # (the device's own figure replaces the layers' estimate)
        total.compute = head * runs + measured * target.microbatches / target.layout.pp
    fsdp = total.fsdp
    if target.layout.pp > 1 and total.gathers:  # gathered once and reduced once a step, hidden behind it all
        fsdp = max(sum(total.gathers) - total.compute, 0.0)
    fsdp += total.first + total.last
    bubble = _bubble(layers, head, total.compute, sizes, target, compile) if target.layout.pp > 1 else 0.0
    dp = max(total.sync - total.backward, 0.0) + total.sync_last + total.gather if total.sync else 0.0
    return StepTime(
        total.compute,
        fsdp,
        total.tp,
        total.ep,
        tokens=target.workload.batch * target.workload.seq,
        ranks_per_replica=target.layout.tp * target.layout.cp * target.layout.pp,
        model_flops=total.model / target.layout.tp,
        peak_flops=rate,
        cp=total.cp,
        bubble=bubble,
        dp=dp,
        offload=total.offload,
        transfer=total.transfer,
    )


def _bubble(
    layers: Sequence[tuple[int, Plan, Candidate | None, tuple[int, int]]],
    head: float,
    compute: float,
    sizes: ModelSizes,
    target: Target,
    compile: bool,
) -> float:
    """The pipeline's bubble as its schedule has it: PyTorch's schedule run with each stage's
    forward and backward seconds (its layers', the head's on the last stage: a third forward,
    two thirds backward; scaled as ``compute`` is, a measured step) and the send of one
    microbatch's residual stream between neighbouring ranks (torchtitan's mesh puts them
    ``replicate x fsdp x cp x tp`` ranks apart; :func:`~.pipeline.makespan`), less a rank's
    compute: the fill, the drain, the stages' imbalance and the sends nothing hides."""
    every: list[tuple[float, float]] = []
    for count, table, c, _ in layers:  # (one kind's layers alike: priced once)
        every += [layer_seconds(table, c, target, compile)] * count
    split = stage_layers(len(every), target.layout.stages)
    forward = [sum(every[i][0] for i in r) for r in split]
    backward = [sum(every[i][1] for i in r) for r in split]
    forward[-1] += head / 3
    backward[-1] += 2 * head / 3
    estimated = (sum(forward) + sum(backward)) * target.microbatches / target.layout.pp
    scale = compute / estimated if estimated else 1.0
    apart = target.layout.replicate * target.layout.fsdp * target.layout.cp * target.layout.tp
    send = sizes.stage_stream_bytes(target) / _link(target, 2, apart)
    span = makespan(target, [f * scale for f in forward], [b * scale for b in backward], send)
    return max(span - compute, 0.0)


#: the share of its all-to-alls a configuration redoes in the backward (``Candidate.all_to_all``)
_REDONE = {"saved": 0.0, "recomputed": 1.0}


def ring_flops(table: Plan, target: Target) -> float:
    """The attention FLOPs context parallelism adds to a traced unit's forward: each rank
    attends to the whole sequence, ``cp`` times the traced attention."""
    return (target.layout.cp - 1) * table.forward_attention_flops


def _work(table: Plan, c: Candidate | None, target: Target) -> tuple[float, float, float]:
    """A traced unit's ring attention FLOPs (:func:`ring_flops`), its recompute FLOPs with
    candidate ``c``, and the share of its forward that recompute redoes."""
    recompute = c.recompute_flops if c else 0
    redo = recompute / table.forward_flops if table.forward_flops else 0.0
    return ring_flops(table, target), recompute, redo


def _weight_pass_recompute(c: Candidate | None, target: Target) -> float:
    """The FLOPs a split backward's ``W`` recomputes beyond ``I``'s recompute: a checkpointed
    layer once per weight group that recomputes it (PyTorch's; :mod:`.split_backward`), once
    with ``Target.pp_recompute_once``. Counted on every stage (the first stage's ``W`` is
    one whole backward: over by its share)."""
    if c is None or not c.split_recompute.groups or not target.weight_pass:
        return 0.0
    return (1 if target.layout.pp_recompute_once else c.split_recompute.groups) * c.recompute_flops


def layer_seconds(
    table: Plan, c: Candidate | None, target: Target, compile: bool = True
) -> tuple[float, float]:
    """One traced unit of a layer's forward and backward seconds on ``target`` with candidate
    ``c`` (its recompute in the backward), at the rate published runs reach, compiled or
    eager (:data:`~sac_compile.planning.devices.EAGER_SLOWDOWN` times as long); with context
    parallelism the ring's attention FLOPs (:func:`ring_flops`) are added to the forward (the
    backward runs 2.5 times as many, and the recompute its share). Attention (the traced
    forward's, ``table.forward_attention_flops``, and the ring's) runs at the device's
    measured attention rate (:meth:`~sac_compile.planning.devices.Target.attention_seconds`),
    the rest at its roofline."""
    ring, recompute, redo = _work(table, c, target)
    forward_flops = table.forward_flops + ring
    backward_flops = table.no_checkpoint_flops + 2.5 * ring + recompute + redo * ring
    backward_flops += _weight_pass_recompute(c, target)
    attend = table.forward_attention_flops + ring
    attend_back = min((2.5 + redo) * attend, backward_flops)
    forward = target.compute_seconds(forward_flops - attend, table.forward_traffic)
    backward = target.compute_seconds(
        backward_flops - attend_back, table.no_checkpoint_traffic + (c.recompute_traffic if c else 0)
    )
    forward += target.attention_seconds(attend)
    backward += target.attention_seconds(attend_back)
    slowdown = 1.0 if compile else EAGER_SLOWDOWN
    return forward * slowdown, backward * slowdown


def _layer(
    total: _Sum,
    units: float,
    table: Plan,
    c: Candidate | None,
    params: tuple[int, int],
    sizes: ModelSizes,
    target: Target,
    compile: bool,
) -> None:
    """Add one kind of layer's terms, run ``units`` times (layers x traced units) a step:
    offloaded, its copies to the host and back (:func:`~sac_compile.planning.offload.transfer`)."""
    tp, cp, ep, shard = (
        target.layout.tp,
        target.layout.cp,
        target.layout.ep,
        target.layout.fsdp * target.layout.cp,
    )
    ring, _, redo = _work(table, c, target)
    forward, backward = layer_seconds(table, c, target, compile)
    total.compute += units * (forward + backward)
    total.backward += units * backward
    copying, exposed = transfer(c, target, compile, forward, backward)
    total.transfer += units * copying
    total.offload += units * exposed
    total.model += units * (table.forward_flops + table.no_checkpoint_flops + 3.5 * ring)
    param_b = dtype_bytes(target.workload.param_dtype)
    reduce_b = dtype_bytes(target.workload.reduce_dtype)
    if shard > 1:
        dense, routed = (params[0] - params[1]) / tp, params[1] / ep
        seconds = _ring(dense, shard, _link(target, shard, tp))
        seconds += _ring(routed, shard // ep, _link(target, shard // ep, tp * ep))
        gather, scatter = seconds * param_b, seconds * reduce_b
        if target.layout.pp > 1:  # this stage's layers: gathered once, reduced once a step
            total.gathers += [gather + scatter] * round(units / target.microbatches)
            total.first = total.first or gather
        else:
            again = gather if target.layout.fsdp_reshard_after_forward else 0.0  # (the backward's gather)
            total.fsdp += units * (max(gather - forward, 0.0) + max(again + scatter - backward, 0.0))
            total.first, total.last = total.first or gather, scatter
    if target.layout.replicate > 1:
        _replicas(total, units / target.microbatches, params, target, reduce_b, param_b)
    stream = sizes.tokens * sizes.hidden_size * param_b  # one residual-stream tensor of the unit
    if tp > 1:  # two all-gathers and two reduce-scatters (SP), or two all-reduces: as many bytes
        collectives = 4 * (tp - 1) / tp * stream / _link(target, tp, 1)  # one pass's
        if target.layout.async_tp and compile:  # (under the projections: forward, input gradients, recompute)
            matmuls = target.compute_seconds(table.forward_flops - table.forward_attention_flops)
            collectives = max(collectives - matmuls * (tp - 1) / tp, 0.0)
        elif target.layout.sequence_parallel:  # (each copy reads and writes the whole stream once)
            copies = sequence_parallel_copies(target.traced[0])
            collectives += copies * 2 * stream / target.machine.device.bandwidth
        total.tp += units * (2 + redo) * collectives
    if ep > 1 and params[1]:
        moved = 2 * sizes.top_k * stream / tp * (ep - 1) / ep
        again = _REDONE.get(c.all_to_all, redo) if c is not None else 0.0
        total.ep += units * (2 + again) * moved / _link(target, ep, tp)
    if cp > 1:  # keys and values around the ring (and their gradients back), beside the attention
        passes = (cp - 1) * sizes.kv_bytes / tp * (1 + 2 + redo) / _link(target, cp, tp)
        hidden = target.attention_seconds(4.5 * ring)
        total.cp += units * max(passes - hidden, 0.0)


def sequence_parallel_copies(batch: int) -> int:
    """Whole copies of the residual stream one pass of a sequence-parallel layer makes around
    its collectives as DTensor runs them (``[batch, seq, hidden]`` sharded on the sequence,
    PyTorch's functional collectives): each reduce-scatter chunks its input on the sequence
    and concatenates the chunks (``reduce_scatter_single``); each all-gather gathers on the
    first dimension and concatenates on the sequence, a view where ``batch`` is 1
    (``_maybe_view_chunk_cat``). Two of each a pass; counted on gloo ranks
    (``tests/test_tensor_parallel.py``)."""
    return 4 if batch > 1 else 2


def _replicas(
    total: _Sum, layers: float, params: tuple[int, int], target: Target, reduce_b: int, param_b: int
) -> None:
    """The replicas' gradient sync of ``layers`` layers a step (once a step, after the last
    microbatch's backward of each): DDP all-reduces each layer's gradients, HSDP its sharded
    ones, ZeRO reduce-scatters them and all-gathers the updated parameters after the step
    (exposed); the ring runs over the replicas, ``fsdp x cp x tp`` ranks apart (torchtitan's
    mesh)."""
    r = target.layout.replicate
    elements = kept_params(params[0], params[1], target)
    link = _link(target, r, target.layout.fsdp * target.layout.cp * target.layout.tp)
    passes = 1 if target.layout.zero else 2  # (a reduce-scatter; an all-reduce is two passes)
    seconds = passes * _ring(elements, r, link) * reduce_b
    total.sync += layers * seconds
    total.sync_last = seconds
    if target.layout.zero:
        total.gather += layers * _ring(elements, r, link) * param_b


def _ring(elements: float, ranks: int, bandwidth: float) -> float:
    """Seconds per byte-width of a ring all-gather / reduce-scatter of ``elements`` over ``ranks``."""
    return 0.0 if ranks <= 1 else (ranks - 1) / ranks * elements / bandwidth


def _chunked(target: Target) -> bool:
    return parse_loss(target.workload.loss)[0] == "chunked"
