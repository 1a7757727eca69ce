"""A training step's peak memory per device, predicted and broken down.

What runs out of memory is not what one layer holds but a step's peak: parameters, gradients
and optimizer state (sharded by FSDP), FSDP's unsharded buffers while a layer runs, what every
layer holds for the backward, the backward's transient (the layer being recomputed and its
gradients), and logits and loss. :func:`step_peak` composes those terms from figures the
planner measures per kind of layer (the bytes a layer holds for the backward, and the
transient of its backward graph: :func:`graph_transient`) and from the model's sizes,
following the step in time:

* the loss's backward: every layer's activations held, the head's saved values and its
  backward temporaries (``logits_loss``);
* the backward of layer ``i`` (last to first): the activations of layers ``<= i``, the
  gradients of the layers after it and of the head, layer ``i``'s transient, and under FSDP
  layer ``i``'s unsharded parameters and gradients;
* the optimizer step: parameters, every gradient, optimizer state and the optimizer's
  temporaries (``other``).

The step's peak is the largest; :class:`Peak` holds it and the terms at that moment.
Gradients are freed before the next forward (``zero_grad(set_to_none=True)``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .._compat.ops import is_view_op
from ..inspection.flops import val_bytes
from .devices import OPTIMIZER_STATES, PP_SCHEDULES, Target, parse_loss

__all__ = ["TERMS", "LayerFigures", "ModelSizes", "Peak", "graph_transient", "head_logits_bytes", "step_peak"]

#: The terms of :attr:`Peak.breakdown`, in this order.
TERMS = (
    "parameters",
    "gradients",
    "optimizer_state",
    "fsdp_buffers",
    "activations",
    "backward_transient",
    "logits_loss",
    "other",
)


@dataclass(frozen=True)
class LayerFigures:
    """One kind of layer: how many, and per layer (per device) its parameters, the bytes it
    holds for the backward and its backward's transient."""

    count: int
    params: int  # parameters (elements, whole, before any sharding)
    saved_bytes: int
    transient_bytes: int
    expert_params: int = 0  # of ``params``, the routed experts' (split by expert parallelism)


@dataclass(frozen=True)
class ModelSizes:
    """What the step's terms need of the model outside its layers."""

    params: int  # every parameter (elements)
    head_saved_bytes: int  # held for the backward outside the layers (embedding out, norm, logits / loss)
    head_transient_bytes: int  # the loss's and the head's backward temporaries
    head_flops: int = 0  # the output projection's forward and backward FLOPs
    # of head_saved_bytes, the residual stream's (the final norm's saves: the rest is logits)
    head_stream_bytes: int = 0
    # where set, the head's logits terms follow the target's loss (Target.loss) instead of
    # head_saved_bytes / head_transient_bytes: the float32 logits' bytes, and the model's own
    # logits' (in param_dtype; 0 when that is float32)
    logits_bytes: int = 0
    model_logits_bytes: int = 0
    head_traffic: int = 0  # bytes the loss's memory-bound ops move (forward and backward)
    # for the step's communication (planning.step_time): the tokens a data-parallel rank
    # runs a step, the residual stream's width, and the experts a token is routed to
    tokens: int = 0  # (of one microbatch, one rank's share of the sequence)
    hidden_size: int = 0
    top_k: int = 0
    embedding_params: int = 0  # the input embeddings' (on the first pipeline stage); 0: half the rest
    attention_flops: int = 0  # one layer's forward attention FLOPs at the traced shape (causal)
    kv_bytes: int = 0  # one layer's keys and values at the traced shape (what ring attention passes)


@dataclass(frozen=True)
class Peak:
    """The predicted peak of a step, the phase it falls in and its terms there."""

    bytes: int
    phase: str
    breakdown: dict[str, int] = field(default_factory=dict)
    # what the caching allocator holds at the step's high-water mark (reserved_bytes)
    reserved: int = 0

    def largest(self) -> str:
        return max(self.breakdown, key=lambda k: self.breakdown[k])


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def step_peak(model: ModelSizes, layers: Sequence[LayerFigures], target: Target) -> Peak:
    """The predicted peak of one training step on ``target`` (per device). With pipeline
    parallelism, the larger of the first stage's (embeddings, the most microbatches in
    flight) and the last stage's (the head, its loss)."""
    order = [dataclasses.replace(g, count=1) for g in layers for _ in range(g.count)]  # forward order
    if target.pp == 1:
        return _rank_peak(model, order, target, _Stage(0, len(order), True, True, 1.0))
    per = math.ceil(len(order) / target.pp)
    first = _rank_peak(model, order, target, _Stage(0, per, True, False, in_flight(target, 0)))
    last_stage = _Stage(len(order) - per, len(order), False, True, in_flight(target, target.pp - 1))
    last = _rank_peak(model, order, target, last_stage)
    return max(first, last, key=lambda p: p.reserved)


@dataclass(frozen=True)
class _Stage:
    start: int  # its layers: every[start:stop], in forward order
    stop: int
    embed: bool  # holds the embeddings
    head: bool  # holds the final norm, the output projection and the loss
    in_flight: float  # microbatches whose activations it holds at once (in whole stages)


def in_flight(target: Target, rank: int) -> float:
    """Microbatches pipeline rank ``rank`` holds the activations of at once, in units of its
    whole stage: GPipe all of them; 1F1B ``pp - rank`` (its warm-up forwards, then one
    backward per forward); interleaved 1F1B with ``v`` stages a rank, ``(v - 1) pp + 2 (pp - 1
    - rank) + 1`` chunks of ``1 / v`` of them (PyTorch's ``ScheduleInterleaved1F1B`` warm-up)."""
    pp, n = target.pp, target.microbatches
    if target.pp_schedule == "gpipe":
        return float(n)
    v = PP_SCHEDULES[target.pp_schedule]
    if v == 1:
        return float(min(pp - rank, n))
    return min((v - 1) * pp + 2 * (pp - 1 - rank) + 1, v * n) / v


def _rank_peak(model: ModelSizes, every: list[LayerFigures], target: Target, stage: _Stage) -> Peak:
    """The peak of one rank running the stage ``stage`` of the model's layers ``every``."""
    layers = every[stage.start : stage.stop]
    shard, tp = target.fsdp * target.cp, target.tp  # (torchtitan shards parameters over fsdp x cp)
    master = _bytes(target.master_dtype)  # type: ignore[arg-type]
    param_b = _bytes(target.param_dtype)  # type: ignore[arg-type]
    reduce_b = _bytes(target.reduce_dtype)  # type: ignore[arg-type]
    other = max(model.params - sum(g.params for g in every), 0)  # embeddings, final norm, head
    embedding = model.embedding_params or other // 2
    other = (embedding if stage.embed else 0) + (other - embedding if stage.head else 0)
    params_all = int((sum(g.params for g in layers) / tp + other) * master / shard)
    states = OPTIMIZER_STATES[target.optimizer]
    optimizer = states * params_all
    order = layers[::-1]  # backward order
    gathered = [(g.params - g.expert_params) / tp + g.expert_params / target.ep for g in order]
    acts = [g.saved_bytes for g in order]
    others_held = int((stage.in_flight - 1) * sum(acts))  # other microbatches' activations
    pipelined = target.pp > 1
    # FSDP2 keeps the root's parameters (everything outside the layers) unsharded from the
    # forward to the end of the backward; with pp it reshards nothing between microbatches
    # and accumulates unsharded gradients (in reduce_dtype) until the last one
    root = int(other * param_b) if shard > 1 else 0
    stage_buffers = int(sum(gathered) * (param_b + reduce_b)) if shard > 1 and pipelined else 0
    grads_of = [int(g.params / tp * master / shard) for g in order]
    done = int(other * master / shard)
    if pipelined and shard == 1:  # gradients accumulated over the earlier microbatches
        done += sum(grads_of)
    phases: list[tuple[str, dict[str, int]]] = []
    base = {"parameters": params_all, "optimizer_state": optimizer}
    if stage.head:
        held = others_held + sum(acts)
        extra = {
            "fsdp_buffers": root + stage_buffers,
            "activations": held,
            "logits_loss": _head(model, target),
        }
        phases.append(("loss backward", _terms(**base, **extra)))
    for i, g in enumerate(order):
        # FSDP: this layer's parameters all-gathered (and the next one's prefetched), and
        # its gradients unsharded before the reduce-scatter
        one = int(2 * gathered[i] * param_b + gathered[i] * reduce_b) if shard > 1 and not pipelined else 0
        extra = {
            "gradients": done if not (pipelined and shard > 1) else 0,
            "fsdp_buffers": root + stage_buffers + one,
            "activations": others_held + sum(acts[i:]),
            "backward_transient": g.transient_bytes,
        }
        phases.append(
            (f"backward of layer {every.index(layers[len(order) - 1 - i])}", _terms(**base, **extra))
        )
        if not pipelined:
            done += grads_of[i]
    if pipelined and shard > 1:
        done += sum(grads_of)
    # The optimizer step: foreach implementations (CUDA's default) make one temporary the
    # size of the parameters; the single-tensor loop (CPU's default) one of the largest.
    largest = max([g.params for g in layers] + [0]) / tp
    temp = params_all if target.device.cuda else int(largest * master / shard)  # type: ignore[union-attr]
    phases.append(("optimizer step", _terms(**base, gradients=done, other=temp if states else 0)))
    phase, breakdown = max(phases, key=lambda p: sum(p[1].values()))
    reserved = sum(breakdown.values())
    if shard > 1:  # FSDP2's all-gathers and reduce-scatters allocate in their own streams' pools
        most = max(gathered + [0])
        gather_pool = root + (stage_buffers if pipelined else int(2 * most * param_b))
        scatter_pool = done + int(most * reduce_b)
        pooled = ("gradients", "fsdp_buffers")
        reserved = max(sum(v for k, v in t.items() if k not in pooled) for _, t in phases)
        reserved += gather_pool + scatter_pool
    return Peak(sum(breakdown.values()), phase, breakdown, reserved)


def _terms(**found: int) -> dict[str, int]:
    return {t: found.get(t, 0) for t in TERMS}


def head_logits_bytes(model: ModelSizes, target: Target) -> int:
    """The logits' share of the head's peak (before any loss parallelism), by ``target.loss``
    (:data:`~sac_compile.planning.devices.LOSSES`): the float32 log-softmax held and two
    gradients of it in its backward, and for transformers' loss the model's own logits alive
    in its output; a compiled loss the model's logits and their gradient; a chunked loss one
    chunk's logits, log-softmax and gradient."""
    kind, chunks = parse_loss(target.loss)
    if kind == "chunked":
        return 3 * model.logits_bytes // chunks
    if kind == "compiled":  # the logits saved and their gradient, in the model's dtype
        return 2 * (model.model_logits_bytes or model.logits_bytes)
    return 3 * model.logits_bytes + (model.model_logits_bytes if kind == "transformers" else 0)


def _head(model: ModelSizes, target: Target) -> int:
    """The head's saved values and its backward's temporaries per device: the logits' and
    loss's split ``tp`` ways with loss parallelism, the final norm's with sequence parallelism."""
    tp = target.tp
    logits = model.head_saved_bytes - model.head_stream_bytes + model.head_transient_bytes
    if model.logits_bytes:
        logits = head_logits_bytes(model, target)
    logits = logits // tp if target.loss_parallel else logits
    stream = model.head_stream_bytes // tp if target.sequence_parallel else model.head_stream_bytes
    return logits + stream


def graph_transient(gm: torch.fx.GraphModule) -> int:
    """The most bytes a backward graph allocates beyond its inputs while it runs: each op's
    outputs (views and aliases allocate nothing; a view keeps its base alive) live from the op
    to their last use, inputs (saved values, incoming gradients) freed after theirs, outputs
    (the gradients it returns) live to the end. Returns ``max(live) - inputs``: what the
    backward of a layer adds on top of what the layer held, at its peak."""
    nodes = list(gm.graph.nodes)
    base: dict[torch.fx.Node, torch.fx.Node] = {}
    size: dict[torch.fx.Node, int] = {}
    for n in nodes:
        if (
            n.op == "call_function"
            and is_view_op(n.target)
            and n.args
            and isinstance(n.args[0], torch.fx.Node)
        ):
            base[n] = base.get(n.args[0], n.args[0])
        elif n.op in ("placeholder", "call_function"):
            size[n] = val_bytes(n.meta.get("val"))
    last: dict[torch.fx.Node, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            root = base.get(a, a)
            last[root] = i if n.op != "output" else len(nodes)
    inputs = sum(size[n] for n in nodes if n.op == "placeholder")
    live = inputs
    peak = live
    for i, n in enumerate(nodes):
        if n in size and n.op == "call_function":
            live += size[n]
            peak = max(peak, live)
        for a in n.all_input_nodes:
            root = base.get(a, a)
            if last.get(root) == i and root in size:
                live -= size[root]
                last.pop(root)
    return max(peak - inputs, 0)
