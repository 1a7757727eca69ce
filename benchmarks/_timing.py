"""Interleaved step timing, shared by the benchmarks."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Hashable


def interleaved_times(steps: dict[Hashable, Callable[[], object]], iters: int, seed: int = 0) -> dict:
    """Wall time in seconds of each ``steps[key]()`` in each of ``iters`` rounds.

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
    return times


def interleaved_medians(steps: dict[Hashable, Callable[[], object]], iters: int, seed: int = 0) -> dict:
    """Median wall time in seconds of each ``steps[key]()`` over ``iters`` rounds
    (:func:`interleaved_times`)."""
    return {k: statistics.median(v) for k, v in interleaved_times(steps, iters, seed).items()}


def ratio_interval(
    times: dict[Hashable, list[float]], ratio: Callable[[dict], float], draws: int = 1000
) -> tuple[float, float]:
    """The 95% bootstrap interval of ``ratio`` (a function of each configuration's median):
    its 2.5th and 97.5th percentiles over ``draws`` resamples, with replacement, of the
    interleaved rounds (``times[key][i]`` is round ``i``'s time of ``key``; a round is
    resampled whole, so configurations timed side by side stay paired)."""
    n = len(next(iter(times.values())))
    rng = random.Random(1)
    found = []
    for _ in range(draws):
        pick = [rng.randrange(n) for _ in range(n)]
        found.append(ratio({k: statistics.median(v[i] for i in pick) for k, v in times.items()}))
    found.sort()
    return found[int(0.025 * draws)], found[int(0.975 * draws) - 1]
