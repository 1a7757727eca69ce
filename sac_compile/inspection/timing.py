"""Interleaved step timing: each configuration once per round, rounds in a shuffled order.

Absolute CPU times are noisy; timing configurations side by side, round after round, in an
order a seeded generator shuffles (the same on every rank of a distributed run), spreads a
shared machine's slow drift over all of them instead of favouring one. Quote medians and
ratios.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Hashable

__all__ = ["interleaved_medians", "interleaved_times"]


def interleaved_times(steps: dict[Hashable, Callable[[], object]], iters: int, seed: int = 0) -> dict:
    """Wall time in seconds of each ``steps[key]()`` in each of ``iters`` rounds."""
    rng = random.Random(seed)
    times: dict = {k: [] for k in steps}
    order = list(steps)
    for _ in range(iters):
        rng.shuffle(order)
        for k in order:
            start = time.perf_counter()
            steps[k]()
            times[k].append(time.perf_counter() - start)
    return times


def interleaved_medians(steps: dict[Hashable, Callable[[], object]], iters: int, seed: int = 0) -> dict:
    """Median wall time in seconds of each ``steps[key]()`` over ``iters`` rounds
    (:func:`interleaved_times`)."""
    return {k: statistics.median(v) for k, v in interleaved_times(steps, iters, seed).items()}
