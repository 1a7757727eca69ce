"""Choosing a plan per kind of layer so that a step's predicted peak fits a device, and then
the fastest predicted step among everything that fits (:mod:`.fastest`).

:func:`choose` walks one fixed sequence of plans, from the least recompute toward the least
memory: it starts every kind of layer at its frontier point with the least recomputed FLOPs
and, step by step, moves the kind whose next frontier point frees the most bytes (held for the
backward, times its layers) per recomputed FLOP (times its layers). The first point of the
sequence whose predicted peak (:func:`~sac_compile.planning.peak.step_peak`) fits the target
recomputes the least; :func:`~.fastest.fastest` then takes the shortest predicted step that
fits. When no point fits, the ``ValueError`` names the smallest predicted peak, its largest
term and what shrinks it.

With ``Target.offload`` a second walk runs over frontiers that hold the offloading candidates
too, each costing its recompute plus the copies to the host and back that its layer's compute
does not hide (:mod:`.offload`, counted as the FLOPs the device runs meanwhile); a point fits
when its offloaded values fit ``Target.host_memory`` too. The cheaper of the two walks' plans
is the choice: as a cost is never below the recompute, a plan allowed to offload never
recomputes more than the one that may not, at the same device memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

from ..keep import Regions
from .core import Candidate, Plan
from .devices import Target
from .fastest import NO_AC, bound, describe, fastest, priced, rank_peaks
from .figures import configured, figures_of, layer_figures, no_checkpoint_figures
from .model import LayerGroup, ModelPlan
from .offload import host_bytes, offloaded_per_rank, transfer
from .parallel import held
from .peak import ModelSizes, Peak, step_peak
from .plan_text import layout_text, step_line
from .step_time import StepTime, layer_seconds, step_time

__all__ = ["DevicePlan", "choose", "configured", "figures_of", "layer_figures", "no_checkpoint_figures"]

_FIX = {
    "parameters": "shard wider (a larger fsdp or tp degree)",
    "optimizer_state": "shard wider (a larger fsdp degree), or an optimizer with fewer states",
    "gradients": "shard wider (a larger fsdp degree)",
    "fsdp_buffers": "smaller layers per FSDP unit, or a larger tp degree",
    "activations": "a shorter sequence or smaller batch per device (every layer is already fully recomputed)",
    "backward_transient": "a shorter sequence or smaller batch per device, or a larger tp degree",
    "logits_loss": "a shorter sequence or smaller batch per device, or a chunked loss",
    "pipeline_buffers": "fewer, larger microbatches (pipeline parallelism keeps buffers per microbatch)",
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
    host_bytes: int = 0  # host memory per GPU the offloaded regions take (planning.offload)
    # the answer is a configuration no region plan expresses ("no AC", "torchtitan op SAC":
    # planning.fastest), and why a plan other than the least recompute was taken
    peer: str | None = None
    why: str = ""
    # where the step chose (planning.fastest): each kind's candidate, None for no checkpoint
    chosen_each: tuple[Candidate | None, ...] | None = None

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
        """The predicted reserved peak within the target's usable memory, and what the plan
        offloads within its host memory."""
        if self.peak is None or self.target is None:
            return False
        return self.peak.reserved <= self.target.machine.usable and self.host_bytes <= (
            self.target.machine.host_memory or 0
        )

    def stages(self) -> list[Peak]:
        """Each rank's predicted peak with the plan's choices: every pipeline rank's in rank
        order (:func:`~sac_compile.planning.peak.stage_peaks`), the one without pipelining."""
        assert self.target is not None and self.sizes is not None
        chosen = self.chosen_each or tuple(g.plan.chosen for g in self.groups)
        return rank_peaks(self.measured, self.params, self.sizes, self.target, chosen, compile=self.compile)

    @property
    def transfer_seconds(self) -> float:
        """Seconds a step copies offloaded values to the host and back (hidden or not)."""
        return self.step.transfer if self.step else 0.0

    @property
    def breakdown(self) -> dict[str, int]:
        return dict(self.peak.breakdown) if self.peak else {}

    def format(self) -> str:
        lines = [super().format()]
        if self.peer is not None:
            lines = [f"model plan for {self.layers!r}: {describe(self.peer)}"]
        if self.why:
            lines.append(f"  chosen by predicted step: {self.why}")
        if self.peak is not None and self.target is not None:
            t = self.target
            scale, unit = (2**30, "GiB") if self.peak.bytes >= 2**30 else (2**20, "MiB")
            lines.append(
                f"  on {t.machine.device.name} ({t.machine.memory / 2**30:.1f} GiB, {t.machine.usable / 2**30:.1f} usable; "
                f"fsdp {t.layout.fsdp}, tp {t.layout.tp}{layout_text(t)}, batch {t.workload.batch} x seq {t.workload.seq}): predicted peak "
                f"{self.peak.bytes / scale:.2f} {unit} in the {self.peak.phase}, {self.peak.reserved / scale:.2f} {unit} "
                f"reserved ({'fits' if self.fits else 'does not fit'})"
            )
            for term, value in self.peak.breakdown.items():
                if value:
                    lines.append(f"    {term:<20}{value / scale:>10.2f} {unit}")
            if self.host_bytes:
                lines.append(
                    f"    offloaded: {self.host_bytes / scale:.2f} {unit} a GPU in host memory (of "
                    f"{t.machine.host_memory / scale:.0f} {unit}) over {t.machine.host.name}"  # type: ignore[operator]
                )
            if self.step is not None:
                lines.append(step_line(self.step, self.step_measured))
                lines.append(f"  {bound(self.step)}")
        return "\n".join(lines)

    def apply(self, model: Any, *, compile: Any = None, **options: Any) -> Any:
        """Wrap each planned layer (:meth:`ModelPlan.apply`); a plan whose answer is no
        checkpoint leaves them as they are; one whose answer is torchtitan's per-op SAC is a
        ``ValueError`` saying how to run it."""
        if self.peer == NO_AC:
            return model
        if self.peer is not None:
            raise ValueError(f"this plan is {describe(self.peer)} ({self.why})")
        return super().apply(model, compile=self.compile if compile is None else compile, **options)

    def configuration(
        self, keep: Any, budget: float | None = None, *, offload: Regions = ()
    ) -> tuple[Peak, StepTime]:
        """The predicted peak and step time of every layer running one configuration, from
        the same measurements: ``keep=None`` no checkpoint, ``()`` full recompute, a keep set
        (each kind of layer keeps the regions of it it has), with a measured ``budget``
        (compiled) and ``offload``, or ``"torchtitan-op"``: torchtitan's per-op selective AC
        (:mod:`~sac_compile.planning.op_sac`). What a user would pick instead of the plan, on
        the same target."""
        assert self.target is not None and self.sizes is not None
        peaks, step = predict(
            self.measured,
            self.params,
            self.sizes,
            self.target,
            keep,
            budget,
            offload=offload,
            compile=self.compile,
        )
        return max(peaks, key=lambda p: p.reserved), step


def predict(
    groups: Sequence[LayerGroup],
    params: Sequence[tuple[int, int]],
    sizes: ModelSizes,
    target: Target,
    keep: Any,
    budget: float | None = None,
    *,
    offload: Regions = (),
    compile: bool,
) -> tuple[list[Peak], StepTime]:
    """Every layer running one configuration (:func:`~sac_compile.planning.figures.configured`),
    predicted from the measured tables: the peak of each rank it may fall on
    (:func:`~sac_compile.planning.peak.stage_peaks`) and the step's time. What
    ``DevicePlan.configuration`` and ``hf.StepFigures`` report."""
    chosen = configured(groups, keep, budget, offload=offload)
    return priced(groups, params, sizes, target, chosen, compile=compile)


def _cost(c: Candidate, target: Target, compile: bool, table: Plan) -> float:
    """What a candidate of ``table`` costs per traced unit: its measured step time
    (``estimator="time"``), else its recomputed FLOPs; plus, offloading, the copies the
    layer's compute (its traced forward and backward, the ring's attention under CP: what the
    step estimate counts) does not hide (:mod:`.offload`), as seconds, or as the FLOPs the
    device runs meanwhile at its efficiency. Never below the recompute: a plan allowed to
    offload recomputes no more."""
    base = c.step_time if c.step_time is not None else c.recompute_flops
    if not c.offload:
        return base
    _, exposed = transfer(c, target, compile, *layer_seconds(table, c, target, compile=compile))
    if c.step_time is not None:
        return base + exposed
    device = target.machine.device
    return base + exposed * device.bf16_flops * device.efficiency * target.layout.tp


def _frontier(
    table: Plan, compile: bool, target: Target, offload: bool, excluded: frozenset[Candidate] = frozenset()
) -> list[tuple[Candidate, float]]:
    """The candidates on the (bytes per device, cost) frontier with their costs
    (:func:`_cost`), the cheapest first; ``offload``: offloading ones among them (but those
    ``excluded``). Where the table was timed (``estimator="time"``) its timed points only."""
    pool = [
        c
        for c in table.candidates
        if (compile or c.budget is None) and (offload or not c.offload) and c not in excluded
    ]
    if table.estimator == "time":
        pool = [c for c in pool if c.step_time is not None]
    bytes_of = {c: held(c, target, compile) for c in pool}
    cost = {c: _cost(c, target, compile, table) for c in pool}
    front: list[tuple[Candidate, float]] = []
    for c in sorted(
        pool, key=lambda c: (cost[c], bytes_of[c], c.budget is not None, len(c.offload), len(c.keep))
    ):
        if not front or bytes_of[c] < bytes_of[front[-1][0]]:
            front.append((c, cost[c]))
    return front


@dataclass
class _Walk:
    """One walk along the kinds' frontiers (:func:`choose`): where it stopped."""

    fronts: list[list[tuple[Candidate, float]]]
    state: list[int] | None  # the first point that fits; None: none did
    peak: Peak | None
    smallest: Peak  # the smallest predicted peak passed
    cost: float = 0.0  # the stopping point's cost, summed over the layers
    host: int = 0  # host memory per GPU it offloads


def _states(
    fronts: list[list[tuple[Candidate, float]]], groups: Sequence[LayerGroup], target: Target, compile: bool
) -> Iterator[list[int]]:
    """The walk's points, from every kind at its cheapest frontier point: each next point
    moves the kind whose next point frees the most bytes (times its layers) per cost (times
    its layers). It does not depend on the memory."""
    state = [0] * len(groups)
    while True:
        yield list(state)
        moves = []
        for k, (front, i, g) in enumerate(zip(fronts, state, groups)):
            if i + 1 < len(front):
                freed = (held(front[i][0], target, compile) - held(front[i + 1][0], target, compile)) * len(
                    g.paths
                )
                cost = (front[i + 1][1] - front[i][1]) * len(g.paths)
                moves.append((freed / max(cost, 1e-12 if front[i][0].step_time is not None else 1), k))
        if not moves:
            return
        state[max(moves)[1]] += 1


def _walk(
    groups: Sequence[LayerGroup],
    params: Sequence[tuple[int, int]],
    sizes: ModelSizes,
    target: Target,
    compile: bool,
    offload: bool,
    excluded: frozenset[Candidate] = frozenset(),
) -> _Walk:
    """The first point of :func:`_states` whose predicted peak fits the device and whose
    offloaded values fit the host (``excluded``: candidates left out)."""
    fronts = [_frontier(g.plan, compile, target, offload, excluded) for g in groups]
    smallest: Peak | None = None
    for state in _states(fronts, groups, target, compile):
        chosen = [f[i][0] for f, i in zip(fronts, state)]
        figures = [
            figures_of(c, g.plan, p, len(g.paths), target, compile=compile)
            for c, g, p in zip(chosen, groups, params)
        ]
        peak = step_peak(sizes, figures, target)
        if smallest is None or peak.reserved < smallest.reserved:
            smallest = peak
        host = host_bytes(
            [(len(g.paths), offloaded_per_rank(c, target, compile)) for c, g in zip(chosen, groups)], target
        )
        if peak.reserved <= target.machine.usable and host <= (target.machine.host_memory or 0):
            cost = sum(f[i][1] * len(g.paths) for f, i, g in zip(fronts, state, groups))
            return _Walk(fronts, state, peak, smallest, cost, host)
    assert smallest is not None
    return _Walk(fronts, None, None, smallest)


def _sequence(groups: Sequence[LayerGroup], target: Target, compile: bool) -> Iterator[list[Candidate]]:
    """Every point of the walks (not offloading; offloading where the target may), as the
    chosen candidates: what :func:`~.fastest.fastest` weighs beside the uniform ones."""
    for offload in (False, True) if target.machine.offload else (False,):
        fronts = [_frontier(g.plan, compile, target, offload) for g in groups]
        for state in _states(fronts, groups, target, compile):
            yield [f[i][0] for f, i in zip(fronts, state)]


def choose(
    groups: Sequence[LayerGroup],
    params: Sequence[tuple[int, int]],
    sizes: ModelSizes,
    target: Target,
    *,
    compile: bool,
    layers: Any,
    by_step: bool = True,
) -> DevicePlan:
    """The least-recompute plan per kind of layer whose predicted step peak fits ``target``
    (with ``by_step``, then the fastest predicted step that fits: :mod:`.fastest`).
    With ``target.machine.offload``, the walk that may offload where its cost (the recompute plus the
    copies compute does not hide) is below the plain plan's recompute and its predicted step
    is no slower: so never more recompute, never a slower step, than not offloading. Where
    the walk's point predicts a slower step (its copies exposed where the recompute it saves
    was hidden, behind FSDP's gathers), its offloading candidates are left out and the walk
    runs again."""
    walk = _walk(groups, params, sizes, target, compile, offload=False)
    chosen = None if walk.state is None else _planned(walk, groups, params, sizes, target, compile, layers)
    if target.machine.offload:
        excluded: frozenset[Candidate] = frozenset()
        while True:
            moved = _walk(groups, params, sizes, target, compile, offload=True, excluded=excluded)
            if moved.state is None or (chosen is not None and moved.cost >= walk.cost):
                break
            offloading = _planned(moved, groups, params, sizes, target, compile, layers)
            if chosen is None or cast(float, offloading.step_seconds) <= cast(float, chosen.step_seconds):
                chosen = offloading
                break
            vetoed = {f[i][0] for f, i in zip(moved.fronts, moved.state) if f[i][0].offload}
            if not vetoed:
                break
            excluded |= vetoed
        if chosen is None and moved.smallest.reserved < walk.smallest.reserved:
            walk = moved
    if chosen is not None:
        return fastest(chosen, _sequence(groups, target, compile)) if by_step else chosen
    term = walk.smallest.largest()
    host = f"; offloading within {(target.machine.host_memory or 0) / 2**30:.0f} GiB of host memory"
    raise ValueError(
        f"no plan fits {target.machine.device.name} with {target.machine.usable / 2**30:.3f} GiB usable "
        f"({target.machine.memory / 2**30:.2f} GiB less {target.machine.headroom:.0%} headroom{host if target.machine.offload else ''}): the smallest predicted "
        f"peak is {walk.smallest.reserved / 2**30:.3f} GiB reserved, the figure compared ("
        f"{walk.smallest.bytes / 2**30:.3f} GiB allocated; every layer at its least memory), its largest term {term} "
        f"({walk.smallest.breakdown[term] / 2**30:.2f} GiB): {_FIX[term]}"
    )


def _planned(
    walk: _Walk,
    groups: Sequence[LayerGroup],
    params: Sequence[tuple[int, int]],
    sizes: ModelSizes,
    target: Target,
    compile: bool,
    layers: Any,
) -> DevicePlan:
    """The :class:`DevicePlan` where ``walk`` stopped, its step predicted."""
    assert walk.state is not None
    out = tuple(
        dataclasses.replace(g, plan=dataclasses.replace(g.plan, chosen=f[i][0], memory=f[i][0].saved_bytes))
        for g, f, i in zip(groups, walk.fronts, walk.state)
    )
    timed = all(g.plan.chosen.step_time is not None for g in out)
    # measured on the device: the layers' forward + backward, the head's estimate
    measured = sum(cast(float, g.plan.chosen.step_time) * len(g.paths) for g in out) if timed else None
    step = step_time(
        [(len(g.paths), g.plan, g.plan.chosen, p) for g, p in zip(out, params)],
        sizes,
        target,
        measured=measured,
        compile=compile,
    )
    return DevicePlan(
        layers,
        out,
        target=target,
        peak=walk.peak,
        step=step,
        compile=compile,
        measured=tuple(groups),
        params=tuple(params),
        sizes=sizes,
        step_measured=timed,
        host_bytes=walk.host,
    )
