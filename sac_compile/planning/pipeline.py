"""Pipeline parallelism as PyTorch runs it: the layers each stage holds, the stages each rank
runs, and what a rank holds whenever a backward runs, read off the schedule's own actions.

* **The split** (:func:`stage_layers`): torchtitan's ``generate_llm_fqn_per_model_part``
  with its defaults: the embeddings and the final norm with the head each weigh one layer,
  ``layers + 2`` spread evenly over the stages, the remainder to the first ones.
* **The schedule** (:func:`rank_schedules`): each rank's compute actions as PyTorch's
  schedule class lists them (:func:`~sac_compile._compat.pipelining.schedule_actions`), for
  the target's ``pp``, stages a rank (``Target.stages_per_rank``) and microbatches. Walking
  them gives, at every backward (``B``, or ``I`` and ``W`` of the zero-bubble schedules),
  the microbatches whose activations each of the rank's stages holds and the stages whose
  gradients exist: a :class:`Moment`. A forward adds its microbatch to its stage; a full
  backward frees it; a backward to the input (``I``) keeps its graph for the weights'
  gradients (``W``, ``stage_backward_input`` retains it), which free it. A forward run
  beside a backward (DualPipeV's ``OVERLAP_F_B``) is held during it. On PyTorch's action
  runtime (every schedule but GPipe and 1F1B) what a stage sent to another rank stays alive
  to the step's end (:func:`~sac_compile._compat.pipelining.holds_sends`): its outputs past
  their backward and its input gradients (``Moment.sent``). A ``step`` that returns the
  outputs (PyTorch's default; ``Target.pp_return_outputs``) keeps the last stage's output of
  every microbatch it ran to the next step (``Moment.returned``: those past their backward).

:func:`~sac_compile.planning.peak.stage_peaks` prices each moment's phases.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .._compat.pipelining import holds_sends, schedule_actions

__all__ = ["Moment", "RankSchedule", "in_flight", "makespan", "rank_schedules", "stage_layers"]


def stage_layers(layers: int, stages: int) -> list[range]:
    """The layers (forward order) each of ``stages`` pipeline stages holds, as torchtitan
    splits a model (``generate_llm_fqn_per_model_part``, input and output weight 1): a
    ``ValueError`` where a stage would hold nothing."""
    if stages == 1:
        return [range(layers)]
    per, extra = divmod(layers + 2, stages)
    if per < 1:
        raise ValueError(
            f"{layers} layers cannot fill {stages} pipeline stages (the embeddings and the head count as a "
            "layer each): fewer stages (pp or pp_virtual_stages)"
        )
    out, start = [], 0
    for s in range(stages):
        count = per + (s < extra) - (s == 0) - (s == stages - 1)
        stop = min(start + max(count, 0), layers)
        out.append(range(start, stop))
        start = stop
    return out


@dataclass(frozen=True)
class Moment:
    """A backward running on a rank and what the rank holds meanwhile."""

    stage: int  # the stage whose backward runs
    held: tuple[tuple[int, int], ...]  # (stage, microbatches held beside the running one)
    grads: frozenset[int]  # the stages whose gradients an earlier backward made
    kind: str = "B"  # "B", "I" or "W"
    # microbatch tensors sent to another rank and held by their sends beyond the held
    # microbatches (outputs whose backward ran, input gradients): PyTorch's action runtime
    sent: int = 0
    # (stage, microbatches whose backward to the input ran and whose weights' has not): a
    # split backward's recorded gradients, held from I to W
    pending: tuple[tuple[int, int], ...] = ()
    # the last stage's microbatches whose backward to the input ran (B or I): their outputs
    # left its cache and stay alive only where the schedule keeps them to return them
    # (``Target.pp_return_outputs``)
    returned: int = 0


@dataclass(frozen=True)
class RankSchedule:
    """One pipeline rank: the stages it runs (forward order) and its distinct moments."""

    rank: int
    stages: tuple[int, ...]
    moments: tuple[Moment, ...]

    def held(self, moment: Moment, stage: int) -> int:
        return dict(moment.held).get(stage, 0)


@functools.lru_cache(maxsize=64)
def _schedules(schedule: str, pp: int, microbatches: int, v: int) -> tuple[RankSchedule, ...]:
    out, last, holds = [], pp * v - 1, holds_sends(schedule)
    for rank, actions in enumerate(schedule_actions(schedule, pp, microbatches, v)):
        stages = tuple(sorted({s for _, s, _ in actions}))
        held = dict.fromkeys(stages, 0)
        done: set[int] = set()
        sent, returned, pending = 0, 0, dict.fromkeys(stages, 0)
        moments: dict[Moment, None] = {}
        for kind, stage, _ in actions:
            if kind == "F":
                held[stage] += 1
                continue
            others = tuple((s, held[s] - (s == stage)) for s in stages)
            # (its own, recorded as it runs; the first stage's I does nothing: its input needs no
            # gradient, its W runs the whole backward)
            split = kind != "B" and stage != 0
            pending[stage] += split and kind == "I"
            moments.setdefault(
                Moment(stage, others, frozenset(done), kind, sent, tuple(pending.items()), returned)
            )
            pending[stage] -= split and kind == "W"
            returned += stage == last and kind in "BI"
            if holds:  # (an output past its backward; an input gradient, made by B or I)
                sent += kind in "BW" and stage != last and stage + 1 not in stages
                sent += kind in "BI" and stage != 0 and stage - 1 not in stages
            if kind in "BW":
                held[stage] -= 1
                done.add(stage)
        out.append(RankSchedule(rank, stages, tuple(moments)))
    return tuple(out)


def rank_schedules(target) -> tuple[RankSchedule, ...]:  # noqa: ANN001 (a Target)
    """Each pipeline rank's stages and moments under ``target``'s schedule."""
    return _schedules(
        target.layout.pp_schedule, target.layout.pp, target.microbatches, target.layout.stages_per_rank
    )


def in_flight(target, rank: int) -> float:  # noqa: ANN001 (a Target)
    """The most microbatches rank ``rank`` holds the activations of at once (the running one
    included), in units of its whole share of the layers (its stages' microbatches over the
    stages it runs)."""
    sched = rank_schedules(target)[rank]
    return max(sum(n for _, n in m.held) + 1 for m in sched.moments) / len(sched.stages)


def makespan(target, forward: list[float], backward: list[float], send: float = 0.0) -> float:  # noqa: ANN001 (a Target)
    """Seconds PyTorch's schedule takes for one step when stage ``s`` runs a microbatch's
    forward in ``forward[s]`` and its backward in ``backward[s]`` (a split backward's input
    and weight halves half each): every rank runs its actions in the schedule's order, each
    starting when its rank is free and what it needs is done (the previous stage's forward
    of the microbatch; the next stage's backward of it, or on the last stage its own
    forward) and, from another rank, sent (``send`` seconds: one microbatch's activations or
    their gradient between neighbouring ranks). What it exceeds a rank's own work by is the
    pipeline's bubble, as this schedule has it."""
    actions = schedule_actions(
        target.layout.pp_schedule, target.layout.pp, target.microbatches, target.layout.stages_per_rank
    )
    last = len(forward) - 1
    rank_of = {stage: r for r, todo in enumerate(actions) for _, stage, _ in todo}
    done: dict[tuple[str, int, int], float] = {}
    free, at = [0.0] * len(actions), [0] * len(actions)
    seconds = {"F": forward, "B": backward, "I": [b / 2 for b in backward], "W": [b / 2 for b in backward]}
    while any(i < len(a) for i, a in zip(at, actions)):
        moved = False
        for r, todo in enumerate(actions):
            while at[r] < len(todo):
                kind, s, m = todo[at[r]]
                needs = _needs(kind, s, m, last)
                if any(n not in done for n in needs):
                    break
                ready = (done[n] + (send if rank_of[n[1]] != r else 0.0) for n in needs)
                end = max([free[r], *ready]) + seconds[kind][s]
                done[kind, s, m] = free[r] = end
                if kind in "BI":
                    done["G", s, m] = end  # (the gradient it sends the stage before)
                at[r] += 1
                moved = True
        if not moved:
            raise RuntimeError(
                f"{target.layout.pp_schedule}: its actions wait on each other (PyTorch's schedule changed?)"
            )
    return max(free)


def _needs(kind: str, stage: int, mb: int, last: int) -> list[tuple[str, int, int]]:
    if kind == "F":
        return [("F", stage - 1, mb)] if stage else []
    if kind == "W":
        return [("I", stage, mb)]
    return [("F", stage, mb)] + ([("G", stage + 1, mb)] if stage < last else [])
