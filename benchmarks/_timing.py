"""Interleaved step timing, shared by the benchmarks."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Hashable


def interleaved_medians(steps: dict[Hashable, Callable[[], object]], iters: int, seed: int = 0) -> dict:
    """Median wall time in seconds of each ``steps[key]()`` over ``iters`` rounds.

    Every round runs each configuration once, in an order shuffled by a seeded
    generator (so the same on every rank of a distributed run), so that slow drift
    of a shared CPU spreads over all configurations instead of favouring one.
    """
    rng = random.Random(seed)
    times: dict = {k: [] for k in steps}
    order = list(steps)
    for _ in range(iters):
        rng.shuffle(order)
        for k in order:
            start = time.perf_counter()
            steps[k]()
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}
