"""PyTorch's pipeline schedules (``torch.distributed.pipelining``) as the actions each rank runs.

The device planner reads the microbatches a pipeline stage holds off the schedule PyTorch
runs, not a formula: :func:`schedule_actions` builds the schedule class on stand-in stages
(``_schedule_visualizer.get_schedule_ops``, PyTorch's own way to list a schedule without
process groups) and returns each rank's compute actions in order. Relies on
``torch.distributed.pipelining._schedule_visualizer.get_schedule_ops`` and the
``_Action`` / ``_ComputationType`` names of ``schedules``.
"""

from __future__ import annotations

import functools
from typing import Any

from . import private

__all__ = ["SCHEDULES", "current_graph_exec_group", "holds_sends", "schedule_actions", "schedule_stages"]

#: the schedules a plan may name -> (PyTorch's name for ``get_schedule_class``, stages a rank
#: holds: ``None`` any number from 2, else exactly that many)
SCHEDULES: dict[str, tuple[str, int | None]] = {
    "gpipe": ("GPipe", 1),
    "1f1b": ("1F1B", 1),
    "interleaved-1f1b": ("Interleaved1F1B", None),
    "looped-bfs": ("LoopedBFS", None),
    "interleaved-zero-bubble": ("InterleavedZeroBubble", None),
    "zbv-zero-bubble": ("ZBVZeroBubble", 2),
    "dualpipev": ("DualPipeV", 2),
}


@functools.lru_cache(maxsize=16)
def holds_sends(schedule: str) -> bool:
    """Whether PyTorch runs ``schedule`` on its action runtime (``_PipelineScheduleRuntime``),
    which waits on every send only when the step ends ("mainly for hygiene"): each stage
    output and input gradient sent to another rank stays alive until then, its send's work
    holding it. The single-stage schedules wait on each send before the next."""
    get_schedule_class = private("torch.distributed.pipelining.schedules", "get_schedule_class")
    runtime = private("torch.distributed.pipelining.schedules", "_PipelineScheduleRuntime")
    return issubclass(get_schedule_class(SCHEDULES[schedule][0]), runtime)


#: an action: (kind, stage, microbatch); kind "F" forward, "B" full backward, "I" the
#: backward to the stage's input (its graph kept for "W"), "W" the weights' gradients
Action = tuple[str, int, int]


@functools.lru_cache(maxsize=256)
def schedule_actions(
    schedule: str, pp: int, microbatches: int, stages_per_rank: int
) -> tuple[tuple[Action, ...], ...]:
    """Each pipeline rank's compute actions, in the order PyTorch's ``schedule`` runs them
    with ``pp`` ranks, ``stages_per_rank`` stages a rank and ``microbatches`` microbatches. A
    forward and a backward run overlapped (DualPipeV's ``OVERLAP_F_B``) are listed forward
    first. A schedule PyTorch refuses for these figures raises its own error as a
    ``ValueError``."""
    get_schedule_ops = private("torch.distributed.pipelining._schedule_visualizer", "get_schedule_ops")
    name = SCHEDULES[schedule][0]
    try:
        ops = get_schedule_ops(name, pp, microbatches, stages_per_rank)
    except (AssertionError, ValueError, RuntimeError) as e:
        raise ValueError(
            f"PyTorch's {name} schedule refuses pp={pp}, {microbatches} microbatches, {stages_per_rank} "
            f"stage(s) a rank: {e}"
        ) from None
    return tuple(_numbered(_compute(rank), microbatches) for rank in ops)


def _numbered(actions: list[Action], microbatches: int) -> tuple[Action, ...]:
    """A rank's actions with each stage's forwards numbered ``0 .. microbatches - 1`` in the
    order they run where PyTorch's list numbers them otherwise: 2.13's ``Schedule1F1B`` lists
    its last rank's forwards as 1 .. n (its IR, which only its visualizer reads; the schedule
    itself runs 0 .. n - 1)."""
    forwards: dict[int, list[int]] = {}
    for kind, stage, mb in actions:
        if kind == "F":
            forwards.setdefault(stage, []).append(mb)
    broken = {s for s, mbs in forwards.items() if sorted(mbs) != list(range(microbatches))}
    seen: dict[int, int] = {}
    out = []
    for kind, stage, mb in actions:
        if kind == "F" and stage in broken:
            mb = seen[stage] = seen.get(stage, -1) + 1
        out.append((kind, stage, mb))
    return tuple(out)


_KINDS = frozenset("FBIW")


def _compute(actions: Any) -> list[Action]:  # (torch's _Action list)
    out: list[Action] = []
    for a in actions:
        if a is None:
            continue
        if a.sub_actions:  # (OVERLAP_F_B: a forward and a backward at once)
            out += _compute(a.sub_actions)
        elif a.computation_type.value in _KINDS:
            out.append((a.computation_type.value, a.stage_index, a.microbatch_index))
    return out


def current_graph_exec_group() -> Any:
    """The ``torch.utils.checkpoint.GraphExecGroup`` open now, or ``None`` (its private
    ``_get_current_group``: groups cannot nest)."""
    from torch.utils.checkpoint import GraphExecGroup

    return GraphExecGroup._get_current_group()


def schedule_stages(schedule: Any) -> list[Any] | None:
    """The ``PipelineStage`` objects a PyTorch pipeline schedule runs (``_stages`` on a
    multi-stage schedule, ``_stage`` on a single-stage one), ``None`` for anything else."""
    stages = getattr(schedule, "_stages", None)
    if stages is None and getattr(schedule, "_stage", None) is not None:
        stages = [schedule._stage]
    return list(stages) if stages is not None else None
