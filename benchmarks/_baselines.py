"""PyTorch's own alternatives that the benchmarks compare against."""

from __future__ import annotations

import torch._functorch.config as functorch_config

from sac_compile.compiler.backend import baseline_backend


class BudgetBackend:
    """The plain compile (no sac pass) with ``activation_memory_budget`` set for its partition."""

    def __init__(self, budget: float, inner: str) -> None:
        self.budget = budget
        self.inner = baseline_backend(inner)

    def __call__(self, gm, example_inputs):
        with functorch_config.patch(activation_memory_budget=self.budget):
            return self.inner(gm, example_inputs)
