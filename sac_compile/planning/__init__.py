"""The planner: the least recompute that fits a memory target, chosen from measured candidates.

* :func:`plan` (``core``): one layer; the candidate table, the choice, :class:`Plan`;
* :func:`plan_model` (``model``): one plan per kind of layer of a model, :class:`ModelPlan`;
* ``measure``: one trace, one partition per candidate; what the eager engine holds.

Method, guarantees and limits: ``docs/planning.md``.
"""

from .core import DEFAULT_BUDGETS, LEAST, MAX_EXHAUSTIVE_REGIONS, Candidate, Plan, plan
from .model import LayerGroup, ModelPlan, plan_model

__all__ = [
    "DEFAULT_BUDGETS",
    "LEAST",
    "MAX_EXHAUSTIVE_REGIONS",
    "Candidate",
    "LayerGroup",
    "ModelPlan",
    "Plan",
    "plan",
    "plan_model",
]
