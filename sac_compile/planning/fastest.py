"""The plan is the fastest configuration that fits: every point of the choice's sequence and
every configuration a user would run instead, by predicted step.

:func:`~sac_compile.planning.device_plan.choose`'s sequence runs from each kind of layer's
least-recompute frontier point toward the least memory, and its first fitting point recomputes
the least. The least recompute is not always the shortest step: a kept region's layer still
recomputes cheap ops whose memory traffic counts, FSDP's gathers can hide recompute, and a
configuration no region plan expresses (no checkpoint; torchtitan's per-op SAC) may fit and
step faster. :func:`fastest` predicts the step of every point of the sequence and of every
uniform configuration measured — each keep set, budget and offload set on every kind of layer,
no checkpoint, torchtitan's per-op SAC — keeps those whose predicted peak fits the device (and
whose offloaded values fit the host), and takes the shortest step (ties: the least recompute,
then the sequence's order). The pool does not depend on the memory, so a larger memory never
gives a slower predicted step, and the plan is never slower than the least-recompute one. A
plan whose layers' steps were measured on the device (``estimator="time"``) stays as chosen.
Where the answer is no checkpoint or torchtitan's per-op SAC, the plan says so
(``DevicePlan.peer``) and why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .candidates import Candidate
from .devices import Target
from .figures import configured, configured_figures
from .offload import host_bytes, offloaded_per_rank
from .peak import ModelSizes, Peak, stage_peaks
from .step_time import StepTime, step_time

if TYPE_CHECKING:
    from .model import LayerGroup

__all__ = ["NO_AC", "SHORTER", "TORCHTITAN_OP_SAC", "bound", "describe", "fastest", "priced", "rank_peaks"]

#: how much shorter (a fraction) a step must be predicted to leave the least-recompute plan:
#: below it the estimates do not tell the two apart
SHORTER = 1e-3

#: the peers a region plan cannot express, as ``DevicePlan.peer`` names them
NO_AC = "no AC"
TORCHTITAN_OP_SAC = "torchtitan op SAC"


@dataclasses.dataclass(frozen=True)
class _Point:
    chosen: tuple[Candidate | None, ...]
    peak: Peak
    step: StepTime
    host: int
    order: int  # (ties: the sequence first)

    @property
    def recompute(self) -> int:
        return sum(c.recompute_flops for c in self.chosen if c is not None)


def fastest(plan: Any, sequence: Iterator[Sequence[Candidate]]) -> Any:
    """``plan`` (a ``DevicePlan``: the sequence's first fitting point), or the configuration
    with a shorter predicted step that fits: among the points of ``sequence`` and every
    uniform configuration of ``plan.measured``."""
    assert plan.target is not None and plan.sizes is not None and plan.step is not None
    if plan.step_measured:  # (its layers' steps measured on the device: the estimates do not compare)
        return plan
    target, groups = plan.target, plan.measured
    pool = [*sequence, *_uniform(groups, plan.compile)]
    best: _Point | None = None
    for order, chosen in enumerate(pool):
        point = _predict(plan, tuple(chosen), order)
        fits = point.peak.reserved <= target.machine.usable and point.host <= (
            target.machine.host_memory or 0
        )
        if fits and (best is None or (point.step.seconds, point.recompute, order) < _key(best)):
            best = point
    if best is None or best.step.seconds >= plan.step.seconds * (1 - SHORTER):
        return plan
    peer = _peer(groups, best.chosen)
    shorter = 1 - best.step.seconds / plan.step.seconds
    least = ", ".join(g.plan.chosen.label for g in plan.groups)
    why = (
        f"it fits ({best.peak.reserved / 2**30:.2f} GiB reserved) and its predicted step is {shorter:.1%} shorter "
        f"than the least-recompute plan that fits ({least}: {plan.step.seconds:.4g} s)"
    )
    out = tuple(
        dataclasses.replace(g, plan=dataclasses.replace(g.plan, chosen=c, memory=c.saved_bytes))
        for g, c in zip(plan.groups, _candidates(groups, best.chosen))
    )
    return dataclasses.replace(
        plan,
        groups=out,
        peak=best.peak,
        step=best.step,
        step_measured=False,
        host_bytes=best.host,
        peer=peer,
        why=why,
        chosen_each=best.chosen,
    )


def _key(p: _Point) -> tuple[float, int, int]:
    return (p.step.seconds, p.recompute, p.order)


def rank_peaks(
    groups: Sequence[LayerGroup],
    params: Sequence[tuple[int, int]],
    sizes: ModelSizes,
    target: Target,
    chosen: Sequence[Candidate | None],
    *,
    compile: bool,
) -> list[Peak]:
    """Each rank's predicted peak (:func:`~.peak.stage_peaks`) with ``chosen``, a candidate
    per kind of layer (``None``: no checkpoint)."""
    return stage_peaks(
        sizes, configured_figures(groups, params, chosen, sizes, target, compile=compile), target
    )


def priced(
    groups: Sequence[LayerGroup],
    params: Sequence[tuple[int, int]],
    sizes: ModelSizes,
    target: Target,
    chosen: Sequence[Candidate | None],
    *,
    compile: bool,
) -> tuple[list[Peak], StepTime]:
    """:func:`rank_peaks` and the step's predicted time (:func:`~.step_time.step_time`)."""
    layers = [(len(g.paths), g.plan, c, p) for g, c, p in zip(groups, chosen, params)]
    peaks = rank_peaks(groups, params, sizes, target, chosen, compile=compile)
    return peaks, step_time(layers, sizes, target, compile=compile)


def _predict(plan: Any, chosen: tuple[Candidate | None, ...], order: int) -> _Point:
    target, groups = plan.target, plan.measured
    peaks, step = priced(groups, plan.params, plan.sizes, target, chosen, compile=plan.compile)
    moved = [
        (len(g.paths), offloaded_per_rank(c, target, plan.compile) if c else 0.0)
        for g, c in zip(groups, chosen)
    ]
    peak = max(peaks, key=lambda p: p.reserved)
    return _Point(chosen, peak, step, host_bytes(moved, target), order)


def _uniform(groups: Sequence[LayerGroup], compile: bool) -> Iterator[list[Candidate | None]]:
    """Every configuration measured on every kind of layer alike (each kind keeping the
    regions of it it has), no checkpoint, and torchtitan's per-op SAC."""
    from .op_sac import TORCHTITAN_OP

    yield [None] * len(groups)
    if all(g.plan.op_sac is not None for g in groups):
        yield configured(groups, TORCHTITAN_OP)
    seen = set()
    for g in groups:
        for c in g.plan.candidates:
            spec = (c.keep, c.budget, c.offload)
            if spec in seen or (c.budget is not None and not compile):
                continue
            seen.add(spec)
            try:
                yield configured(groups, c.keep, c.budget, offload=c.offload)
            except ValueError:  # (a keep set another kind of layer was not measured with)
                continue


def _peer(groups: Sequence[LayerGroup], chosen: tuple[Candidate | None, ...]) -> str | None:
    if all(c is None for c in chosen):
        return NO_AC
    if any(c is not None and c is g.plan.op_sac for g, c in zip(groups, chosen)):
        return TORCHTITAN_OP_SAC
    return None


def _candidates(groups: Sequence[LayerGroup], chosen: tuple[Candidate | None, ...]) -> list[Candidate]:
    """The chosen candidates, no checkpoint standing as a candidate that saves what no
    checkpoint saves and recomputes nothing (``DevicePlan.peer`` says it is none)."""
    from ..actions import Actions

    return [
        c
        if c is not None
        else Candidate(
            Actions(),
            g.plan.no_checkpoint_bytes,
            0,
            transient_bytes=g.plan.no_checkpoint_transient,
            routed_transient=g.plan.no_checkpoint_routed,
        )
        for g, c in zip(groups, chosen)
    ]


def bound(step: Any) -> str:
    """Which term bounds a predicted step: where communication is exposed, recompute runs in
    its shadow and configurations step alike."""
    terms = {k: v for k, v in step.terms().items() if k not in ("compute", "offload") and v}
    if not terms:
        return "compute bounds the step"
    name = max(terms, key=lambda k: terms[k])
    return (
        f"{name} bounds the step beside compute ({terms[name]:.3f} s exposed): recompute runs where it is hidden, so "
        "configurations that recompute more can step alike"
    )


def describe(peer: str | None) -> str:
    """How a peer plan is applied."""
    if peer == NO_AC:
        return "no checkpoint: apply() leaves every layer as it is"
    return (
        "torchtitan's per-op SAC (--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option "
        "op): apply it with torchtitan's activation checkpointing, not this plan's apply()"
    )
