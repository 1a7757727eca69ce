"""Count the aten ops a piece of code dispatches (the baseline for the eager engine's
``EngineStats.intercepted``, in tests and ``benchmarks/eager_vs_compiled.py``)."""

from __future__ import annotations

from .._compat.checkpoint import TorchDispatchMode

__all__ = ["CountOps"]


class CountOps(TorchDispatchMode):
    """``with CountOps() as c: fn()``; then ``c.n`` ops were dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))
