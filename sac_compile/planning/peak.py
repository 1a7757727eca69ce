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

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .._compat.ops import is_view_op
from ..inspection.flops import val_bytes
from .devices import OPTIMIZER_STATES, Target, parse_loss

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


@dataclass(frozen=True)
class Peak:
    """The predicted peak of a step, the phase it falls in and its terms there."""

    bytes: int
    phase: str
    breakdown: dict[str, int] = field(default_factory=dict)

    def largest(self) -> str:
        return max(self.breakdown, key=lambda k: self.breakdown[k])


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def step_peak(model: ModelSizes, layers: Sequence[LayerFigures], target: Target) -> Peak:
    """The predicted peak of one training step on ``target`` (per device)."""
    fsdp, tp = target.fsdp, target.tp
    master = _bytes(target.master_dtype)  # type: ignore[arg-type]
    layer_params = sum(g.params * g.count for g in layers)
    other_params = max(model.params - layer_params, 0)

    def sharded(elements: float, per: int) -> int:
        return int(elements * per / fsdp)

    params_all = sharded(layer_params / tp + other_params, master)
    states = OPTIMIZER_STATES[target.optimizer]
    optimizer = states * params_all
    # the layers in backward order (last first)
    order = [g for g in layers for _ in range(g.count)][::-1]
    grads_of = [sharded(g.params / tp, master) for g in order]
    grads_head = sharded(other_params, master)
    acts = [g.saved_bytes for g in order]
    held_all = sum(acts)
    phases: list[tuple[str, dict[str, int]]] = []

    def terms(**found: int) -> dict[str, int]:
        return {t: found.get(t, 0) for t in TERMS}

    param_b = _bytes(target.param_dtype)  # type: ignore[arg-type]
    reduce_b = _bytes(target.reduce_dtype)  # type: ignore[arg-type]
    # FSDP2 keeps the root's parameters (embeddings, final norm, head: everything outside the
    # layers) unsharded from the forward to the end of the backward
    root = int(other_params * param_b) if fsdp > 1 else 0
    phases.append(
        (
            "loss backward",
            terms(
                parameters=params_all,
                optimizer_state=optimizer,
                fsdp_buffers=root,
                activations=held_all,
                logits_loss=_head(model, target),
            ),
        )
    )
    done_grads = grads_head
    for i, g in enumerate(order):
        # FSDP: this layer's parameters all-gathered (and the next one's prefetched), and
        # its gradients unsharded before the reduce-scatter
        gathered = (g.params - g.expert_params) / tp + g.expert_params / target.ep
        buffers = root + int(2 * gathered * param_b + gathered * reduce_b) if fsdp > 1 else 0
        phases.append(
            (
                f"backward of layer {len(order) - 1 - i}",
                terms(
                    parameters=params_all,
                    gradients=done_grads,
                    optimizer_state=optimizer,
                    fsdp_buffers=buffers,
                    activations=sum(acts[i:]),
                    backward_transient=g.transient_bytes,
                ),
            )
        )
        done_grads += grads_of[i]
    # The optimizer step: foreach implementations (CUDA's default) make one temporary the
    # size of the parameters; the single-tensor loop (CPU's default) one of the largest.
    largest = max([g.params for g in layers] + [0]) / tp
    temp = params_all if target.device.cuda else sharded(largest, master)  # type: ignore[union-attr]
    phases.append(
        (
            "optimizer step",
            terms(
                parameters=params_all,
                gradients=done_grads,
                optimizer_state=optimizer,
                other=temp if states else 0,
            ),
        )
    )
    phase, breakdown = max(phases, key=lambda p: sum(p[1].values()))
    return Peak(sum(breakdown.values()), phase, breakdown)


def head_logits_bytes(model: ModelSizes, target: Target) -> int:
    """The logits' share of the head's peak (before any loss parallelism), by ``target.loss``
    (:data:`~sac_compile.planning.devices.LOSSES`): the float32 log-softmax held and two
    gradients of it in its backward, and for transformers' loss the model's own logits alive
    in its output; a chunked loss one chunk's logits, log-softmax and gradient."""
    kind, chunks = parse_loss(target.loss)
    if kind == "chunked":
        return 3 * model.logits_bytes // chunks
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
