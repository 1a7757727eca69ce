"""A pipeline's split backward recomputing each checkpointed layer once.

PyTorch's zero-bubble schedules (``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV``) split a stage's backward into ``I`` (its input's gradient) and ``W``
(its weights'): ``stage_backward_weight`` calls ``torch.autograd.grad`` once per weight group,
and a non-reentrant checkpoint recomputes its function once per call. A Llama layer has 9
weight groups: its ``W`` recomputes the layer 9 times and keeps each copy that a node only
``I`` runs saves until the stage's ``W`` ends (5x what the stage holds without a checkpoint,
measured; ``sac_compile.planning.split_backward`` reads it off the layer's graph).
:func:`recompute_once` runs each ``W`` inside one ``torch.utils.checkpoint.GraphExecGroup``
(PyTorch's own context for backward calls over disjoint parts of one graph): the groups share
one recompute, the gradients are the same.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from torch.utils.checkpoint import GraphExecGroup

from ._compat.pipelining import current_graph_exec_group, schedule_stages

__all__ = ["recompute_once"]

_WRAPPED = "_sac_recompute_once"


def recompute_once(stages: Any) -> list[Any]:
    """Make each stage's weight pass (``W``) recompute a checkpointed layer once instead of
    once per weight group. ``stages``: a ``torch.distributed.pipelining.PipelineStage``, an
    iterable of them, or a PyTorch pipeline schedule (its stages). Returns the stages.
    Idempotent; a ``W`` already inside a ``GraphExecGroup`` (the caller's, or a later
    PyTorch's) runs as it is. Schedules without a split backward never call ``W``: nothing
    changes there. A stage whose weight groups share an autograd node (a weight used by two
    groups' ops) fails loudly in PyTorch's ``CheckpointError``, never silently."""
    found = schedule_stages(stages)
    if found is None:
        found = [stages] if hasattr(stages, "backward_weight_one_chunk") else _listed(stages)
    for stage in found:
        if not hasattr(stage, "backward_weight_one_chunk"):
            raise TypeError(
                f"recompute_once: {type(stage).__name__} is not a pipeline stage (a "
                "torch.distributed.pipelining.PipelineStage, has no backward_weight_one_chunk); "
                "pass the stages or the schedule that runs them"
            )
    for stage in found:
        if not getattr(stage, _WRAPPED, False):
            stage.backward_weight_one_chunk = _grouped(stage.backward_weight_one_chunk)
            setattr(stage, _WRAPPED, True)
    return found


def _listed(stages: Any) -> list[Any]:
    if isinstance(stages, Iterable) and not isinstance(stages, (str, bytes)):
        return list(stages)
    raise TypeError(
        f"recompute_once: expected a PipelineStage, an iterable of them or a pipeline schedule, "
        f"got {type(stages).__name__}"
    )


def _grouped(weight_pass: Any) -> Any:
    @functools.wraps(weight_pass)
    def run(*args: Any, **kwargs: Any) -> Any:
        if current_graph_exec_group() is not None:
            return weight_pass(*args, **kwargs)
        with GraphExecGroup():
            return weight_pass(*args, **kwargs)

    return run
