"""A training step's peak memory per device, predicted and broken down.

What runs out of memory is not what one layer holds but a step's peak: parameters, gradients
and optimizer state (sharded by FSDP), FSDP's unsharded buffers while a layer runs, what every
layer holds for the backward, the backward's transient (the layer being recomputed and its
gradients), and logits and loss. :func:`step_peak` composes those terms from figures the
planner measures per kind of layer (the bytes a layer holds for the backward, and the
transient of its backward graph: :func:`~.graph_memory.graph_transient`) and from the
model's sizes, following the step in time:

* the loss's backward: every layer's activations held, the head's saved values and its
  backward temporaries (``logits_loss``);
* the backward of layer ``i`` (last to first): the activations of layers ``<= i``, the
  gradients of the layers after it and of the head, layer ``i``'s transient, and under FSDP
  layer ``i``'s unsharded parameters and gradients;
* the optimizer step: parameters, every gradient, optimizer state and the optimizer's
  temporaries (``other``);
* with pipeline parallelism, in every phase, what PyTorch's pipelining keeps per microbatch
  (``pipeline_buffers``).

The step's peak is the largest; :class:`Peak` holds it and the terms at that moment.
Gradients are freed before the next forward (``zero_grad(set_to_none=True)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .allocator import loss_slack
from .devices import OPTIMIZER_STATES, Target
from .head import head_logits_bytes, head_terms, held_heads, logits_split, pipeline_head, returned_output
from .pipeline import Moment, RankSchedule, in_flight, rank_schedules, stage_layers
from .sizes import LayerFigures, ModelSizes

__all__ = [
    "TERMS",
    "LayerFigures",
    "ModelSizes",
    "Peak",
    "head_logits_bytes",
    "in_flight",
    "kept_params",
    "stage_peaks",
    "step_peak",
]

#: The terms of :attr:`Peak.breakdown`, in this order.
TERMS = (
    "parameters",
    "gradients",
    "optimizer_state",
    "fsdp_buffers",
    "activations",
    "backward_transient",
    "split_recompute",
    "logits_loss",
    "pipeline_buffers",
    "ddp_buckets",
    "other",
)


#: the phase of the loss's backward (where an eager loss's allocator slack is reserved)
LOSS_PHASE = "loss backward"


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


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes an element of ``dtype`` takes (the planning package's one reading of it)."""
    return dtype.itemsize


def kept_params(params: float, expert_params: float, target: Target) -> float:
    """Of a layer's ``params`` (``expert_params`` of them routed experts'), the elements a
    rank keeps: split ``tp`` ways, the dense ones sharded over ``fsdp x cp``, the experts
    split ``ep`` ways and FSDP-sharded over the rest (without FSDP, ``ep`` ways alone)."""
    shard = target.layout.fsdp * target.layout.cp
    return (
        (params - expert_params) / shard + expert_params / max(shard, target.layout.ep)
    ) / target.layout.tp


def step_peak(model: ModelSizes, layers: Sequence[LayerFigures], target: Target) -> Peak:
    """The predicted peak of one training step on ``target`` (per device): with pipeline
    parallelism, the largest of its stages' (:func:`stage_peaks`)."""
    return max(stage_peaks(model, layers, target), key=lambda p: p.reserved)


def stage_peaks(model: ModelSizes, layers: Sequence[LayerFigures], target: Target) -> list[Peak]:
    """The predicted peak of each rank: without pipeline parallelism the one; with it each
    pipeline rank's, in rank order: the layers of the stages it runs
    (:func:`~.pipeline.stage_layers`: torchtitan's split), the embeddings where it runs the
    first stage, the head and its loss where it runs the last, and at every backward its
    schedule runs (:func:`~.pipeline.rank_schedules`) the microbatches each of its stages
    holds then, the gradients made so far and the pipeline's buffers."""
    order = [dataclasses.replace(g, count=1) for g in layers for _ in range(g.count)]  # forward order
    if target.layout.pp == 1:
        return [_rank_peak(model, order, target, _Stage((range(len(order)),), True, True))]
    split = stage_layers(len(order), target.layout.stages)
    last = len(split) - 1
    return [
        _rank_peak(
            model,
            order,
            target,
            _Stage(tuple(split[s] for s in r.stages), 0 in r.stages, last in r.stages, r),
        )
        for r in rank_schedules(target)
    ]


@dataclass(frozen=True)
class _Stage:
    """What one rank runs: its pipeline stages' layers (forward order), and where it runs
    the first or the last stage (the embeddings; the final norm, the head and the loss)."""

    layers: tuple[range, ...]
    embed: bool
    head: bool
    schedule: RankSchedule | None = None  # with pipeline parallelism

    @property
    def ids(self) -> tuple[int, ...]:
        """Its pipeline stages' indices (its schedule's)."""
        return self.schedule.stages if self.schedule else ()


@dataclass
class _Rank:
    """What one rank's phases are made of (per device), in backward order."""

    base: dict[str, int]  # parameters and optimizer state
    grads_of: list[int]  # each layer's sharded gradients (master dtype)
    gathered: list[float]  # each layer's parameters a rank all-gathers (elements)
    acts: list[int]
    transients: list[int]
    split: list[int]  # each layer's gradients a split backward holds from I to W
    recomputes: list[tuple[int, int]]  # each layer's recomputed copies under a split W
    outside: int  # the sharded gradients of the parameters outside the layers
    last_offloaded: int  # the last layer's offloaded values, on the device through the loss
    root: int  # FSDP2's unsharded root parameters
    param_b: int
    reduce_b: int


def _rank_peak(model: ModelSizes, every: list[LayerFigures], target: Target, stage: _Stage) -> Peak:
    """The peak of one rank running the stage ``stage`` of the model's layers ``every``."""
    layers = [every[i] for r in stage.layers for i in r]
    shard, tp = (
        target.layout.fsdp * target.layout.cp,
        target.layout.tp,
    )  # (torchtitan shards parameters over fsdp x cp)
    master = dtype_bytes(target.workload.master_dtype)
    param_b = dtype_bytes(target.workload.param_dtype)
    other = max(model.params - sum(g.params for g in every), 0)  # embeddings, final norm, head
    embedding = model.embedding_params or other // 2
    # (with tp the embeddings and the output projection are split on the vocabulary, as
    # torchtitan's and Megatron's plans split them; the final norm's few are counted with them)
    outside = ((embedding if stage.embed else 0) + (other - embedding if stage.head else 0)) / tp

    def kept(g: LayerFigures) -> float:
        return kept_params(g.params, g.expert_params, target)

    params_all = int((sum(kept(g) for g in layers) + outside / shard) * master)
    states = OPTIMIZER_STATES[target.workload.optimizer]
    # ZeRO over DDP's replicas: stage 1 the optimizer state, stage 2 the gradients too
    zero_state, zero_grads = (target.layout.replicate if target.layout.zero >= z else 1 for z in (1, 2))
    order = layers[::-1]  # backward order
    # DDP's buckets, from the wrap on: a second copy of the gradients (its default); under ZeRO-1
    # the one gradient buffer, the gradients views into it (``gradient_as_bucket_view``, as
    # Megatron's buffer); ZeRO-2 reduces each gradient into its shard as it is made
    ddp = target.layout.replicate > 1 and shard == 1 and target.layout.zero < 2
    views = 0 if ddp and target.layout.zero == 1 else 1
    rank = _Rank(
        base={
            "parameters": params_all,
            "optimizer_state": states * params_all // zero_state,
            "ddp_buckets": params_all if ddp else 0,
        },
        grads_of=[int(kept(g) * master / zero_grads) * views for g in order],
        gathered=[(g.params - g.expert_params) / tp + g.expert_params / target.layout.ep for g in order],
        acts=[g.saved_bytes for g in order],
        transients=[g.transient_bytes for g in order],
        split=[g.weight_gradient_inputs for g in order],
        recomputes=[g.split_recompute for g in order],
        outside=int(outside * master / shard / zero_grads) * views,
        last_offloaded=order[0].offloaded_bytes if order else 0,
        # FSDP2 keeps the root's parameters (everything outside the layers) unsharded from
        # the forward to the end of the backward
        root=int(outside * param_b) if shard > 1 else 0,
        param_b=param_b,
        reduce_b=dtype_bytes(target.workload.reduce_dtype),
    )
    if stage.schedule is None:
        phases = _backward_phases(rank, model, target, stage)
    else:
        phases = _pipeline_phases(rank, model, target, stage, stage.schedule)
    done = rank.outside + sum(rank.grads_of)
    # (the largest tensor the optimizer steps: a layer's, the embeddings' or the head's)
    largest = max(
        [model.largest_tensor or max([g.params for g in layers] + [0])]
        + [embedding * stage.embed, (other - embedding) * stage.head]
    )
    temp = _optimizer_temp(params_all // zero_state, largest / tp * master / shard, target)
    buffers = _pipeline_buffers(model, target, stage, None)  # (the receive buffers stay)
    phases.append(
        ("optimizer step", _terms(**rank.base, gradients=done, other=temp, pipeline_buffers=buffers))
    )
    if stage.head and target.layout.pp_return_outputs:  # (step()'s return: every output concatenated)
        merged = buffers + target.microbatches * returned_output(model, target)
        phases.append(("merging the outputs", _terms(**rank.base, gradients=done, pipeline_buffers=merged)))
    phase, breakdown = max(phases, key=lambda p: sum(p[1].values()))
    return Peak(
        sum(breakdown.values()), phase, breakdown, _reserved(rank, model, target, stage, phases, done)
    )


def _reserved(
    rank: _Rank,
    model: ModelSizes,
    target: Target,
    stage: _Stage,
    phases: list[tuple[str, dict[str, int]]],
    done: int,
) -> int:
    """What the caching allocator holds at the rank's high-water mark: its ``phases`` on the
    default stream, the loss's slack, FSDP2's streams' pools (``done``: every gradient)."""
    shard = target.layout.fsdp * target.layout.cp
    # a GPU's caching allocator's slack at an eager loss (the loss's holes no other block fits:
    # .allocator), reserved from the loss's backward on; a pipeline's head is not replayed
    # (with TP but no loss parallelism the logits are all-gathered first: not replayed)
    slack = 0
    replayed = target.layout.tp == 1 or target.layout.loss_parallel
    if stage.head and target.layout.pp == 1 and replayed and target.machine.device.cuda:
        slack = loss_slack(
            target.workload.loss, model.logits_bytes, model.model_logits_bytes, logits_split(target)
        )
    pooled: tuple[str, ...] = ()
    pools = 0
    if shard > 1:  # FSDP2's all-gathers and reduce-scatters allocate in their own streams' pools
        # (with pp the stage's unsharded parameters and gradients stay in fsdp_buffers all
        # along: counted as they are)
        most = max(rank.gathered + [0])
        gathers = 2 * most if target.layout.fsdp_reshard_after_forward else sum(rank.gathered)
        gather_pool = 0 if target.layout.pp > 1 else rank.root + int(gathers * rank.param_b)
        pooled = ("gradients",) if target.layout.pp > 1 else ("gradients", "fsdp_buffers")
        pools = gather_pool + done + int(most * rank.reduce_b)
    default_stream = max(
        sum(v for k, v in t.items() if k not in pooled) + (slack if name == LOSS_PHASE else 0)
        for name, t in phases
    )
    return default_stream + pools


def _optimizer_temp(params: int, largest: float, target: Target) -> int:
    """The optimizer step's temporary on a rank of ``params`` bytes of parameters (``largest``
    the largest tensor's): foreach (CUDA's default) one of all; the single-tensor loop (CPU's)
    two of the largest at once (AdamW's ``exp_avg_sq.sqrt() / c``); none without state."""
    if not OPTIMIZER_STATES[target.workload.optimizer]:
        return 0
    return params if target.machine.device.cuda else int(2 * largest)


def _backward_phases(
    rank: _Rank, model: ModelSizes, target: Target, stage: _Stage
) -> list[tuple[str, dict[str, int]]]:
    """Without pipeline parallelism: the loss's backward and each layer's, last to first,
    the gradients of the layers after it made."""
    sharded = target.layout.fsdp * target.layout.cp > 1
    # without resharding after the forward every layer's parameters stay unsharded from its
    # forward to its backward (and need no gathering again): all of them at the loss
    kept = 0.0 if target.layout.fsdp_reshard_after_forward else sum(rank.gathered)
    done = rank.outside
    extra = {
        "fsdp_buffers": rank.root + int(kept * rank.param_b),
        "activations": sum(rank.acts) + rank.last_offloaded,
        "logits_loss": head_terms(model, target),
    }
    phases = [(LOSS_PHASE, _terms(**rank.base, **extra))]  # (the head's gradients: made in its backward)
    for i, gathered in enumerate(rank.gathered):
        # FSDP: this layer's parameters all-gathered (and the next one's prefetched), and
        # its gradients unsharded before the reduce-scatter
        # (not resharding: this layer's and those before it still unsharded, none prefetched)
        unsharded = sum(rank.gathered[i:]) if kept else 2 * gathered
        one = int(unsharded * rank.param_b + gathered * rank.reduce_b) if sharded else 0
        extra = {
            "gradients": done,
            "fsdp_buffers": rank.root + one,
            "activations": sum(rank.acts[i:]),
            "backward_transient": rank.transients[i],
        }
        phases.append((f"backward of layer {len(rank.acts) - 1 - i}", _terms(**rank.base, **extra)))
        done += rank.grads_of[i]
    return phases


def _pipeline_phases(
    rank: _Rank, model: ModelSizes, target: Target, stage: _Stage, schedule: RankSchedule
) -> list[tuple[str, dict[str, int]]]:
    """With pipeline parallelism, one phase per distinct moment of the rank's schedule (a
    backward of one of its stages, :class:`~.pipeline.Moment`): the activations its stages
    hold for the other microbatches in flight then, the running stage's own (its layer whose
    remaining activations, transient and, in the stage's first backward, gradients made so
    far are the most), the gradients the earlier backwards made, on the last stage the
    loss's backward, and the pipeline's buffers. With FSDP, torchtitan reshards nothing
    between microbatches and accumulates unsharded gradients (in ``reduce_dtype``) until
    the last microbatch: the rank's stages' parameters stay unsharded all along."""
    sharded = target.layout.fsdp * target.layout.cp > 1
    blocks, end = {}, len(rank.acts)  # each stage's layers in the backward-ordered lists
    for sid, layers in zip(stage.ids, stage.layers):
        blocks[sid] = slice(end - len(layers), end)
        end -= len(layers)
    acts = {sid: sum(rank.acts[b]) for sid, b in blocks.items()}
    split = {sid: sum(rank.split[b]) for sid, b in blocks.items()}
    grads = {sid: sum(rank.grads_of[b]) for sid, b in blocks.items()}
    gathered = {sid: sum(rank.gathered[b]) for sid, b in blocks.items()}
    last = target.layout.stages - 1
    phases: list[tuple[str, dict[str, int]]] = []
    for m in schedule.moments:
        # (a zero-bubble schedule's recorded gradients counted with what the stages hold)
        held = sum(n * acts[s] for s, n in m.held) + sum(n * split[s] for s, n in m.pending)
        if sharded:
            unsharded = (
                sum(gathered.values()) * rank.param_b + sum(gathered[s] for s in m.grads) * rank.reduce_b
            )
            common = {"fsdp_buffers": rank.root + int(unsharded)}
        else:
            common = {"gradients": rank.outside + sum(grads[s] for s in m.grads)}
        common["pipeline_buffers"] = _pipeline_buffers(model, target, stage, m)
        own, transients = rank.acts[blocks[m.stage]], rank.transients[blocks[m.stage]]
        where = f"stage {m.stage}, microbatches held {'/'.join(str(n) for _, n in m.held)}"
        # the last stage's microbatches in flight beside the running one, and of those the
        # split ones (their I ran): what each keeps of the head, at every moment of the rank
        heads = (schedule.held(m, last), dict(m.pending).get(last, 0) - (m.stage == last and m.kind in "IW"))
        if m.stage == last and m.kind != "W":
            extra = {
                "activations": held + sum(own),
                "logits_loss": pipeline_head(model, target, 1 + heads[0], heads[1]),
            }
            phases.append((f"{LOSS_PHASE} ({where})", _terms(**rank.base, **common, **extra)))
        if own:
            # a stage's first backward makes its gradients layer by layer (unsharded, in
            # reduce_dtype, under FSDP): those of the layers after the running one
            first = m.stage not in m.grads
            made = rank.gathered[blocks[m.stage]] if sharded else rank.grads_of[blocks[m.stage]]
            width = rank.reduce_b if sharded else 1
            growing = [int(sum(made[:i]) * width) if first else 0 for i in range(len(own))]
            i = max(range(len(own)), key=lambda i: sum(own[i:]) + transients[i] + growing[i])
            layer = stage.layers[stage.ids.index(m.stage)].stop - 1 - i
            extra = {"activations": held + sum(own[i:]), "backward_transient": transients[i]}
            if last in stage.ids:
                extra["logits_loss"] = held_heads(model, target, *heads)
            if m.kind == "W" and m.stage != 0:  # (the first stage's W: one whole backward)
                # a split W runs its weights' gradient ops alone (what they make: gradients)
                extra["backward_transient"] = 0
                extra["split_recompute"] = _split_copies(rank.recomputes[blocks[m.stage]])
            grown = (
                {"fsdp_buffers": common["fsdp_buffers"] + growing[i]}
                if sharded
                else {"gradients": common["gradients"] + growing[i]}
            )
            phases.append(
                (f"backward of layer {layer} ({where})", _terms(**rank.base, **{**common, **grown}, **extra))
            )
    return phases


def _split_copies(recomputes: list[tuple[int, int]]) -> int:
    """The most a stage's split backward ``W`` holds of its checkpointed layers' recomputed
    copies (``recomputes``: per layer, backward order, what it leaves and its most as the
    stage's last, :func:`~.split_backward.split_recompute`): the groups run in the
    parameters' order, the first layer's first, what each layer leaves alive while the
    later layers' groups run."""
    if not recomputes:
        return 0
    earlier = sum(left for left, _ in recomputes[1:])
    return earlier + recomputes[0][1]


def _pipeline_buffers(model: ModelSizes, target: Target, stage: _Stage, moment: Moment | None) -> int:
    """What PyTorch's pipelining (``PipelineStage``) holds on a rank beyond its layers' saved
    values at ``moment`` (``None``: between steps), in residual-stream units (one
    microbatch's stage input, one rank's share: split ``tp`` ways with sequence parallelism,
    as torchtitan's stages pass it): a stage that is not the first preallocates a receive
    buffer for every microbatch's input, one that is not the last one for every
    microbatch's output gradient, both kept for the whole run; a stage that is not the last
    keeps each microbatch's output from its forward to its backward (``fwd_cache``), and on
    PyTorch's action runtime what it sent past that, to the step's end (``Moment.sent``). An
    in-flight microbatch's input buffer is its first layer's saved input, counted there."""
    if stage.schedule is None:
        return 0
    stream = model.stage_stream_bytes(target)
    last, n = target.layout.stages - 1, target.microbatches
    inputs, gradients = sum(s != 0 for s in stage.ids), sum(s != last for s in stage.ids)
    flight = dict(moment.held) if moment is not None else {}
    if moment is not None:
        flight[moment.stage] += 1  # (the running microbatch's)
    kept = sum(c for s, c in flight.items() if s != last) - sum(c for s, c in flight.items() if s != 0)
    kept += moment.sent if moment is not None else 0  # (held by their sends: the action runtime's)
    returned = 0
    if target.layout.pp_return_outputs and last in stage.ids:  # (kept to the next step to return)
        returned = (moment.returned if moment is not None else n) * returned_output(model, target)
    return int((n * (inputs + gradients) + kept) * stream) + returned


def _terms(**found: int) -> dict[str, int]:
    return {t: found.get(t, 0) for t in TERMS}
