"""Interleaved step timing, shared by the benchmarks."""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Hashable

from sac_compile.inspection.timing import interleaved_medians, interleaved_times

__all__ = ["interleaved_medians", "interleaved_times", "ratio_interval"]


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
