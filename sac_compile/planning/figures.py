"""One kind of layer's figures for a step's peak (:func:`figures_of`): what a candidate holds
per device of a target, under tensor parallelism a rank's share, compiled or eager; and the
measured candidate of one configuration per kind of layer (:func:`configured`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

from .candidates import Candidate, SplitCopies
from .core import Plan
from .devices import Target
from .model import LayerGroup
from .offload import offloaded_per_rank
from .parallel import held, rank_share, sequence_split_input
from .peak import LayerFigures, ModelSizes, dtype_bytes

__all__ = [
    "configured",
    "configured_figures",
    "figures_of",
    "layer_figures",
    "no_checkpoint_figures",
    "rank_transient",
    "recorded_gradients",
    "ring_transient",
]


def configured(
    groups: Sequence[LayerGroup], keep: Any, budget: float | None = None, offload: Any = ()
) -> list[Candidate | None]:
    """Per kind of layer, the measured candidate of one configuration: ``keep=None`` no
    checkpoint (``None``), ``"torchtitan-op"`` torchtitan's per-op SAC, else the keep set
    (``()`` full recompute, ``ALL_REGIONS`` or ``"all"`` every region; each kind keeps the
    regions of it it has) with ``budget``, offloading ``offload`` (measured where the plan
    offloads: ``Target(offload=True)``). A region no layer has, or a configuration not
    measured, is a ``ValueError``."""
    from ..keep import ALL_REGIONS, normalize_keep
    from .op_sac import TORCHTITAN_OP, TORCHTITAN_OP_2025_08

    if keep is None:
        return [None] * len(groups)
    if isinstance(keep, str) and keep in (TORCHTITAN_OP, TORCHTITAN_OP_2025_08):
        missing = [g.kind for g in groups if g.plan.op_sac is None]
        if missing:
            raise ValueError(f"torchtitan's per-op SAC was not measured for {', '.join(missing)}")
        if keep == TORCHTITAN_OP:
            return [g.plan.op_sac for g in groups]
        return [
            dataclasses.replace(cast("Candidate", g.plan.op_sac), all_to_all="recomputed") for g in groups
        ]
    known = {r for g in groups for r in g.plan.regions}
    named = normalize_keep(keep)
    moved = frozenset(offload)
    named_set = set() if named is ALL_REGIONS else set(cast("frozenset[str]", named))
    if unknown := (named_set | moved) - known:
        raise ValueError(
            f"{sorted(unknown)}: no layer has such a region (the layers' regions: {sorted(known)})"
        )
    out: list[Candidate | None] = []
    for g in groups:
        table = g.plan
        regions = frozenset(table.regions)
        kept = regions if named is ALL_REGIONS else cast("frozenset[str]", named) & regions
        same_keep = [c for c in table.candidates if c.keep == kept and c.offload == moved & regions]
        found = [c for c in same_keep if c.budget == budget]  # (the first policy measured)
        if not found:
            budgets = sorted({c.budget for c in same_keep if c.budget is not None})
            offloaded = f", offload={sorted(moved & regions)}" if moved else ""
            raise ValueError(
                f"keep={sorted(kept)}{offloaded}, budget={budget!r} was not measured for {g.kind}: "
                + (
                    f"its budgets: {budgets} (or None: the keep set alone)"
                    if same_keep
                    else "not among its keep sets"
                )
            )
        out.append(found[0])
    return out


def configured_figures(
    groups: Sequence[LayerGroup],
    params: Sequence[tuple[int, int]],
    chosen: Sequence[Candidate | None],
    sizes: ModelSizes,
    target: Target,
    *,
    compile: bool,
) -> list[LayerFigures]:
    """Every kind of layer's figures with its candidate of one configuration (:func:`configured`).
    torchtitan's per-op SAC saves the outputs of its expert-parallel all-to-alls
    (``torchtitan/distributed/activation_checkpoint.py``'s communication ops: the tokens
    dispatched to the experts and combined back; ``Candidate.all_to_all == "saved"``), which
    a one-process trace does not have: with ``ep > 1`` each MoE layer holds two ``tokens x
    top_k x hidden`` tensors more (``"torchtitan-op-2025-08"``, the policy before it saved
    them, holds none and redoes them)."""
    out = []
    for g, p, c in zip(groups, params, chosen):
        figures = layer_figures(c, g.plan, p, len(g.paths), target, compile=compile)
        if c is not None and c.all_to_all == "saved" and target.layout.ep > 1 and p[1]:
            width = dtype_bytes(target.workload.param_dtype)
            exchanged = 2 * sizes.tokens * sizes.top_k * sizes.hidden_size * width // target.layout.tp
            figures = dataclasses.replace(figures, saved_bytes=figures.saved_bytes + exchanged)
        out.append(figures)
    return out


def layer_figures(
    c: Candidate | None, table: Plan, params: tuple[int, int], count: int, target: Target, *, compile: bool
) -> LayerFigures:
    """:func:`figures_of` for a candidate, :func:`no_checkpoint_figures` for ``None``."""
    if c is None:
        return no_checkpoint_figures(table, params, count, target, compile=compile)
    return figures_of(c, table, params, count, target, compile=compile)


def figures_of(
    c: Candidate, table: Plan, params: tuple[int, int], count: int, target: Target, *, compile: bool
) -> LayerFigures:
    """One kind of layer's figures for :func:`step_peak` with candidate ``c``, per device of
    ``target``: compiled, what its partition saves and its backward graph's transient; eager,
    what the eager engine holds (when measured) and the recompute's restoring what the layer
    holds unchecked; offloading on a GPU, the values it sends (the last layer's stay on the
    device through the loss: the engine holds them until the compute stream waited for their
    copies) and, in its backward, the next layer's, brought back meanwhile. Under tensor
    parallelism a rank's share (:mod:`.parallel`: the partition's saved values split by kind;
    the eager figures and the transients scaled alike). ``params``: one layer's (parameters,
    of them the routed experts')."""
    if compile:
        return LayerFigures(
            count,
            params[0],
            held(c, target, compile=True),
            rank_transient(c.transient_bytes, c.ring_transient, c.routed_transient, target)
            // target.layout.tp,
            params[1],
            weight_gradient_inputs=recorded_gradients(table, target),
            split_recompute=_per_rank(c.split_recompute, target),
        )
    plain = (table.no_checkpoint_eager_bytes or table.no_checkpoint_bytes) * rank_share(
        table.no_checkpoint_bytes, table.no_checkpoint_tp, target
    )
    saved = held(c, target, compile=False) - sequence_split_input(table.stream_input_bytes, target)
    backward = rank_transient(
        table.no_checkpoint_transient, table.no_checkpoint_ring, table.no_checkpoint_routed, target
    )
    # (on a GPU the engine holds a layer's offloaded values until their copies are awaited, and
    # brings the next layer's back during this one's backward: eager/host_copy.py)
    moved = offloaded_per_rank(c, target, compile=False) if target.machine.device.cuda else 0
    transient = max(plain - saved, 0) + backward / target.layout.tp + moved
    split = recorded_gradients(table, target)
    return LayerFigures(
        count,
        params[0],
        int(saved),
        int(transient),
        params[1],
        int(moved),
        split,
        _per_rank(c.split_recompute, target),
    )


def _per_rank(split: SplitCopies, target: Target) -> tuple[int, int]:
    """A split backward's recomputed copies (:func:`~.split_backward.split_recompute`: once
    per weight group, PyTorch's, or once with ``Target.pp_recompute_once``) on one
    tensor-parallel rank: split ``tp`` ways, as the transients."""
    left, last = (
        (split.left_once, split.last_once) if target.layout.pp_recompute_once else (split.left, split.last)
    )
    return (left // target.layout.tp, last // target.layout.tp)


def no_checkpoint_figures(
    table: Plan, params: tuple[int, int], count: int, target: Target, *, compile: bool = False
) -> LayerFigures:
    """One kind of layer's figures without a checkpoint, per device of ``target``: what the
    compiled layer saves (``compile``), else what autograd holds eagerly where measured.
    Compiled under context parallelism (a plain ``torch.compile``: no tagging pass) the layer
    also saves ``cp + 1`` copies of its keys and values: the partitioner saves every collective
    it is not told to recompute, so the ring backward's all-gather of the keys and values
    (which reads no gradient) runs in the forward and its output is held, beside the ring's
    contiguous copies of them (read off the compiled forward graph on two gloo ranks;
    ``benchmarks/context_parallel.py``; ``passes.backward_collectives`` keeps it in the
    backward of the layers the seam compiles)."""
    plain = (
        table.no_checkpoint_bytes if compile else table.no_checkpoint_eager_bytes or table.no_checkpoint_bytes
    )
    saved = int(plain * rank_share(table.no_checkpoint_bytes, table.no_checkpoint_tp, target))
    if compile and target.layout.cp > 1:
        saved += (target.layout.cp + 1) * table.no_checkpoint_ring[1] // target.layout.tp
    backward = rank_transient(
        table.no_checkpoint_transient, table.no_checkpoint_ring, table.no_checkpoint_routed, target
    )
    split = recorded_gradients(table, target)
    return LayerFigures(
        count, params[0], saved, backward // target.layout.tp, params[1], weight_gradient_inputs=split
    )


def recorded_gradients(table: Plan, target: Target) -> int:
    """The gradients a split backward records for the weights and holds from I to W, per
    device (:func:`~.graph_memory.weight_gradient_inputs`): split ``tp`` ways, which
    under-counts a row-parallel projection's output gradient (whole on every rank)."""
    return table.weight_gradient_inputs // target.layout.tp


def rank_transient(
    transient: int, ring: tuple[int, int], routed: tuple[tuple[int, int], ...], target: Target
) -> int:
    """A backward's transient on one rank of ``target``: under expert parallelism with its
    routed experts' part (their weights and gradients, ``routed``:
    :func:`~.graph_memory.routed_transient`) split ``ep`` ways, as the rank holds them; with
    context parallelism at least its attention's ring (:func:`ring_transient`)."""
    if target.layout.ep > 1 and routed:
        transient = max(a + b // target.layout.ep for a, b in routed)
    return ring_transient(transient, ring, target)


def ring_transient(transient: int, ring: tuple[int, int], target: Target) -> int:
    """A backward's transient on ``target``: with context parallelism at least what its
    attention holds run as ring attention on ``cp`` ranks (:func:`~.graph_memory.graph_ring`)."""
    if target.layout.cp == 1 or not ring[1]:
        return transient
    return max(transient, ring[0] + target.layout.cp * ring[1])
