"""Choosing a plan per kind of layer so that a step's predicted peak fits a device.

:func:`choose` walks one fixed sequence of plans, from the least recompute toward the least
memory: it starts every kind of layer at its frontier point with the least recomputed FLOPs
and, step by step, moves the kind whose next frontier point frees the most bytes (held for the
backward, times its layers) per recomputed FLOP (times its layers). The first point of the
sequence whose predicted peak (:func:`~sac_compile.planning.peak.step_peak`) fits the target
is the choice. The sequence does not depend on the memory, and recompute never decreases
along it, so a larger memory never gives more recompute. When no point fits, the
``ValueError`` names the smallest predicted peak, its largest term and what shrinks it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from .core import Candidate, Plan
from .devices import Target
from .model import LayerGroup, ModelPlan
from .parallel import per_rank_bytes
from .peak import LayerFigures, ModelSizes, Peak, step_peak
from .step_time import StepTime, step_time

__all__ = ["DevicePlan", "choose", "configured", "figures_of", "layer_figures", "no_checkpoint_figures"]

_FIX = {
    "parameters": "shard wider (a larger fsdp or tp degree)",
    "optimizer_state": "shard wider (a larger fsdp degree), or an optimizer with fewer states",
    "gradients": "shard wider (a larger fsdp degree)",
    "fsdp_buffers": "smaller layers per FSDP unit, or a larger tp degree",
    "activations": "a shorter sequence or smaller batch per device (every layer is already fully recomputed)",
    "backward_transient": "a shorter sequence or smaller batch per device, or a larger tp degree",
    "logits_loss": "a shorter sequence or smaller batch per device, or a chunked loss",
    "other": "an optimizer without temporaries (fused)",
}


@dataclass(frozen=True)
class DevicePlan(ModelPlan):
    """A :class:`ModelPlan` chosen for a :class:`~sac_compile.planning.devices.Target`, with
    the step's predicted peak (``peak``: bytes, phase, terms) and step time."""

    target: Target | None = None
    peak: Peak | None = None
    step: StepTime | None = None  # the step's time by term (planning.step_time)
    step_measured: bool = False  # estimator="time": each layer's step measured on the device
    compile: bool = True
    measured: tuple[LayerGroup, ...] = ()  # every kind of layer's whole candidate table
    params: tuple[tuple[int, int], ...] = ()
    sizes: ModelSizes | None = None

    def select(self, memory: Any) -> DevicePlan:
        """The same measurements, chosen for another device ``memory`` (nothing measured
        again)."""
        assert self.target is not None and self.sizes is not None
        target = self.target.replace(memory=memory)
        return choose(
            self.measured,
            self.params,
            self.sizes,
            target,
            compile=self.compile,
            layers=self.layers,
        )

    @property
    def step_seconds(self) -> float | None:
        """The step's predicted seconds (:mod:`~sac_compile.planning.step_time`), the layers
        measured on the device where ``step_measured``."""
        return self.step.seconds if self.step else None

    @property
    def peak_bytes(self) -> int:
        """The most bytes allocated at once in a step (the predicted peak's)."""
        return self.peak.bytes if self.peak else 0

    @property
    def reserved_bytes(self) -> int:
        """What the caching allocator holds at the step's high-water mark: FSDP2's collectives
        allocate in their own streams, whose pools the default stream cannot reuse
        (:func:`~sac_compile.planning.peak.step_peak`); a plan fits on this."""
        return self.peak.reserved if self.peak else 0

    @property
    def fits(self) -> bool:
        return self.peak is not None and self.target is not None and self.peak.reserved <= self.target.usable

    @property
    def breakdown(self) -> dict[str, int]:
        return dict(self.peak.breakdown) if self.peak else {}

    def format(self) -> str:
        lines = [super().format()]
        if self.peak is not None and self.target is not None:
            t = self.target
            scale, unit = (2**30, "GiB") if self.peak.bytes >= 2**30 else (2**20, "MiB")
            lines.append(
                f"  on {t.device.name} ({t.memory / 2**30:.1f} GiB, {t.usable / 2**30:.1f} usable; "  # type: ignore[union-attr,operator]
                f"fsdp {t.fsdp}, tp {t.tp}{_tp_layout(t)}{_more_layout(t)}, batch {t.batch} x seq {t.seq}): predicted peak "
                f"{self.peak.bytes / scale:.2f} {unit} in the {self.peak.phase}, {self.peak.reserved / scale:.2f} {unit} "
                f"reserved ({'fits' if self.fits else 'does not fit'})"
            )
            for term, value in self.peak.breakdown.items():
                if value:
                    lines.append(f"    {term:<20}{value / scale:>10.2f} {unit}")
            if self.step is not None:
                lines.append(_step_line(self.step, self.step_measured))
        return "\n".join(lines)

    def apply(self, model: Any, *, compile: Any = None, **options: Any) -> Any:
        return super().apply(model, compile=self.compile if compile is None else compile, **options)

    def configuration(self, keep: Any, budget: float | None = None) -> tuple[Peak, StepTime]:
        """The predicted peak and step time of every layer running one configuration, from
        the same measurements: ``keep=None`` no checkpoint, ``()`` full recompute, a keep set
        (each kind of layer keeps the regions of it it has), with a measured ``budget``
        (compiled), or ``"torchtitan-op"``: torchtitan's per-op selective AC
        (:mod:`~sac_compile.planning.op_sac`). What a user would pick instead of the plan, on
        the same target."""
        assert self.target is not None and self.sizes is not None
        chosen = configured(self.measured, keep, budget)
        figures = [
            layer_figures(c, g.plan, params, len(g.paths), self.target, compile=self.compile)
            for g, params, c in zip(self.measured, self.params, chosen)
        ]
        layers = [(len(g.paths), g.plan, c, p) for g, c, p in zip(self.measured, chosen, self.params)]
        return step_peak(self.sizes, figures, self.target), step_time(layers, self.sizes, self.target)


def configured(
    groups: Sequence[LayerGroup], keep: Any, budget: float | None = None
) -> list[Candidate | None]:
    """Per kind of layer, the measured candidate of one configuration: ``keep=None`` no
    checkpoint (``None``), ``"torchtitan-op"`` torchtitan's per-op SAC, else the keep set
    (``()`` full recompute, ``ALL_REGIONS`` or ``"all"`` every region; each kind keeps the
    regions of it it has) with ``budget``. A region no layer has, or a budget not measured,
    is a ``ValueError``."""
    from ..keep import ALL_REGIONS, normalize_keep
    from .op_sac import TORCHTITAN_OP

    if keep is None:
        return [None] * len(groups)
    if isinstance(keep, str) and keep == TORCHTITAN_OP:
        missing = [g.kind for g in groups if g.plan.op_sac is None]
        if missing:
            raise ValueError(f"torchtitan's per-op SAC was not measured for {', '.join(missing)}")
        return [g.plan.op_sac for g in groups]
    known = {r for g in groups for r in g.plan.regions}
    named = normalize_keep(keep)
    if named is not ALL_REGIONS and (unknown := set(cast("frozenset[str]", named)) - known):
        raise ValueError(
            f"keep={sorted(unknown)}: no layer has such a region (the layers' regions: {sorted(known)})"
        )
    out: list[Candidate | None] = []
    for g in groups:
        table = g.plan
        regions = frozenset(table.regions)
        kept = regions if named is ALL_REGIONS else cast("frozenset[str]", named) & regions
        same_keep = [c for c in table.candidates if c.keep == kept]
        found = [c for c in same_keep if c.budget == budget]  # (the first policy measured)
        if not found:
            budgets = sorted({c.budget for c in same_keep if c.budget is not None})
            raise ValueError(
                f"keep={sorted(kept)}, budget={budget!r} was not measured for {g.kind}: "
                + (
                    f"its budgets: {budgets} (or None: the keep set alone)"
                    if same_keep
                    else "not among its keep sets"
                )
            )
        out.append(found[0])
    return out


def layer_figures(
    c: Candidate | None, table: Plan, params: tuple[int, int], count: int, target: Target, *, compile: bool
) -> LayerFigures:
    """:func:`figures_of` for a candidate, :func:`no_checkpoint_figures` for ``None``."""
    if c is None:
        return no_checkpoint_figures(table, params, count, target, compile=compile)
    return figures_of(c, table, params, count, target, compile=compile)


def _step_line(step: StepTime, measured: bool) -> str:
    how = "layers measured on the device, the head estimated" if measured else "estimated"
    comms = ", ".join(f"{k} {v:.3f}" for k, v in step.terms().items() if k != "compute" and v)
    return (
        f"  step: {step.seconds:.3f} s {how} (compute {step.compute:.3f}"
        + (f", exposed communication: {comms}" if comms else "")
        + f"); {step.tokens_per_second:,.0f} tokens/s per GPU, MFU {step.mfu:.1%}"
    )


def _more_layout(t: Target) -> str:
    parts = [f"ep {t.ep}"] if t.ep > 1 else []
    parts += [f"cp {t.cp}"] if t.cp > 1 else []
    if t.pp > 1:
        parts.append(f"pp {t.pp} {t.pp_schedule}, {t.microbatches} microbatches of {t.microbatch_size}")
    return "".join(f", {p}" for p in parts)


def _tp_layout(t: Target) -> str:
    if t.tp == 1:
        return ""
    parts = [name for name, on in (("sequence", t.sequence_parallel), ("loss", t.loss_parallel)) if on]
    return f" ({' and '.join(parts)} parallel)" if parts else " (no sequence or loss parallel)"


def figures_of(
    c: Candidate, table: Plan, params: tuple[int, int], count: int, target: Target, *, compile: bool
) -> LayerFigures:
    """One kind of layer's figures for :func:`step_peak` with candidate ``c``, per device of
    ``target``: compiled, what its partition saves and its backward graph's transient; eager,
    what the eager engine holds (when measured) and the recompute's restoring what the layer
    holds unchecked. Under tensor parallelism a rank's share (:mod:`.parallel`: the
    partition's saved values split by kind; the eager figures and the transients scaled
    alike). ``params``: one layer's (parameters, of them the routed experts')."""
    share = _share(c.saved_bytes, c.tp_split, target)
    if compile:
        return LayerFigures(
            count, params[0], int(c.saved_bytes * share), c.transient_bytes // target.tp, params[1]
        )
    plain = (table.no_checkpoint_eager_bytes or table.no_checkpoint_bytes) * _share(
        table.no_checkpoint_bytes, table.no_checkpoint_tp, target
    )
    saved = (c.eager_bytes if c.eager_bytes is not None else c.saved_bytes) * share
    transient = max(plain - saved, 0) + table.no_checkpoint_transient / target.tp
    return LayerFigures(count, params[0], int(saved), int(transient), params[1])


def no_checkpoint_figures(
    table: Plan, params: tuple[int, int], count: int, target: Target, *, compile: bool = False
) -> LayerFigures:
    """One kind of layer's figures without a checkpoint, per device of ``target``: what the
    compiled layer saves (``compile``), else what autograd holds eagerly where measured."""
    plain = (
        table.no_checkpoint_bytes if compile else table.no_checkpoint_eager_bytes or table.no_checkpoint_bytes
    )
    share = _share(table.no_checkpoint_bytes, table.no_checkpoint_tp, target)
    return LayerFigures(
        count, params[0], int(plain * share), table.no_checkpoint_transient // target.tp, params[1]
    )


def _share(total: int, split: tuple[int, int, int], target: Target) -> float:
    """The fraction of a layer's saved bytes one tensor-parallel rank holds."""
    if target.tp == 1 or total == 0:
        return 1.0
    return per_rank_bytes(total, split, target.tp, target.sequence_parallel) / total


def _cost(c: Candidate) -> float:
    """What a candidate costs: its measured step time (``estimator="time"``), else its
    recomputed FLOPs."""
    return c.step_time if c.step_time is not None else c.recompute_flops


def _held(c: Candidate, target: Target, compile: bool) -> int:
    """What a layer with candidate ``c`` holds per device of ``target`` (as :func:`figures_of`
    counts it): under tensor parallelism a rank's share; eager, the engine's bytes."""
    held = c.saved_bytes if compile or c.eager_bytes is None else c.eager_bytes
    return int(held * _share(c.saved_bytes, c.tp_split, target))


def _frontier(table: Plan, compile: bool, target: Target) -> list[Candidate]:
    """The candidates on the (bytes per device, cost) frontier, the cheapest first: cost is the
    measured step time where the table was timed (``estimator="time"``: its timed points), else
    the recomputed FLOPs."""
    pool = [c for c in table.candidates if compile or c.budget is None]
    if table.estimator == "time":
        pool = [c for c in pool if c.step_time is not None]
    held = {c: _held(c, target, compile) for c in pool}
    front: list[Candidate] = []
    for c in sorted(pool, key=lambda c: (_cost(c), held[c], c.budget is not None, len(c.keep))):
        if not front or held[c] < held[front[-1]]:
            front.append(c)
    return front


def choose(
    groups: Sequence[LayerGroup],
    params: Sequence[tuple[int, int]],
    sizes: ModelSizes,
    target: Target,
    *,
    compile: bool,
    layers: Any,
) -> DevicePlan:
    """The least-recompute plan per kind of layer whose predicted step peak fits ``target``."""
    fronts = [_frontier(g.plan, compile, target) for g in groups]
    state = [0] * len(groups)

    def peak_of(state: list[int]) -> Peak:
        figures = [
            figures_of(f[i], g.plan, p, len(g.paths), target, compile=compile)
            for f, i, g, p in zip(fronts, state, groups, params)
        ]
        return step_peak(sizes, figures, target)

    best: tuple[list[int], Peak] | None = None
    smallest: Peak | None = None
    while True:
        peak = peak_of(state)
        if smallest is None or peak.reserved < smallest.reserved:
            smallest = peak
        if peak.reserved <= target.usable:
            best = (list(state), peak)
            break
        moves = []
        for k, (front, i, g) in enumerate(zip(fronts, state, groups)):
            if i + 1 < len(front):
                freed = (_held(front[i], target, compile) - _held(front[i + 1], target, compile)) * len(
                    g.paths
                )
                cost = (_cost(front[i + 1]) - _cost(front[i])) * len(g.paths)
                moves.append((freed / max(cost, 1e-12 if front[i].step_time is not None else 1), k))
        if not moves:
            break
        state[max(moves)[1]] += 1
    if best is None:
        assert smallest is not None
        term = smallest.largest()
        raise ValueError(
            f"no plan fits {target.device.name} with {target.usable / 2**30:.3f} GiB usable "  # type: ignore[union-attr]
            f"({target.memory / 2**30:.2f} GiB less {target.headroom:.0%} headroom): the smallest predicted peak is "  # type: ignore[operator]
            f"{smallest.bytes / 2**30:.3f} GiB (every layer at its least memory), its largest term {term} "
            f"({smallest.breakdown[term] / 2**30:.2f} GiB): {_FIX[term]}"
        )
    chosen, peak = best
    out = tuple(
        dataclasses.replace(g, plan=dataclasses.replace(g.plan, chosen=f[i], memory=f[i].saved_bytes))
        for g, f, i in zip(groups, fronts, chosen)
    )
    timed = all(g.plan.chosen.step_time is not None for g in out)
    # measured on the device: the layers' forward + backward, the head's estimate
    measured = sum(cast(float, g.plan.chosen.step_time) * len(g.paths) for g in out) if timed else None
    step = step_time(
        [(len(g.paths), g.plan, g.plan.chosen, p) for g, p in zip(out, params)],
        sizes,
        target,
        measured=measured,
    )
    return DevicePlan(
        layers,
        out,
        target=target,
        peak=peak,
        step=step,
        compile=compile,
        measured=tuple(groups),
        params=tuple(params),
        sizes=sizes,
        step_measured=timed,
    )
