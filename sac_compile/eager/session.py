"""The marker session of one checkpointed call: the regions open while the function runs
(one per forward and per recompute), in a ``ContextVar`` the dispatch modes read."""

from __future__ import annotations

import contextvars
from collections import Counter
from typing import Any

from ..keep import KeepSet
from ..policy import SAVE_COSTLY, RegionPolicy, checked_decision, saves

__all__ = ["EagerSession"]


class EagerSession:
    """Open regions while a checkpointed function runs (one per forward / recompute)."""

    def __init__(self, keep: KeepSet, policy: RegionPolicy = SAVE_COSTLY) -> None:
        self.keep = keep
        self.policy = policy
        self.open: Counter[str] = Counter()
        self.entered: Counter[str] = Counter()
        self.unbalanced: list[tuple[str, str]] = []
        # entries of kept regions open now: kept() is asked for every op the modes see
        self._kept_open = 0

    def sink(self, kind: str, payload: tuple) -> None:
        if kind == "region_enter":
            self.open[payload[0]] += 1
            self.entered[payload[0]] += 1
            self._kept_open += payload[0] in self.keep
        elif kind == "region_exit":
            # an exit without an enter is a no-op here (nothing was open)
            if self.open[payload[0]] > 0:
                self.open[payload[0]] -= 1
                self._kept_open -= payload[0] in self.keep
            else:
                self.unbalanced.append((payload[0], "exit without enter"))

    def close(self) -> list[tuple[str, str]]:
        """End of the checkpointed call: the unbalanced markers seen in it."""
        left_open = [(n, "enter without exit") for n, c in sorted(self.open.items()) for _ in range(c)]
        return self.unbalanced + left_open

    def open_names(self) -> tuple[str, ...]:
        return tuple(sorted(n for n, c in self.open.items() if c > 0))

    def kept(self) -> bool:
        return self._kept_open > 0

    def saves(self, func: Any, regions: tuple[str, ...]) -> bool:
        """Whether the region policy saves ``func`` run with ``regions`` (this session's
        :meth:`open_names`) open; outside every region, never."""
        return bool(regions) and saves(checked_decision(self.policy, func, regions, self.keep))


_SESSION: contextvars.ContextVar[EagerSession | None] = contextvars.ContextVar(
    "sac_compile_eager_session", default=None
)
