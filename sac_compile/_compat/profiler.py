"""The CPU allocator's peak during a call, from ``torch.profiler``'s memory timeline.

``torch.profiler.profile(profile_memory=True)`` records every allocation and free the
allocator reports (CPU included); ``torch.profiler._memory_profiler.MemoryProfile`` (private:
what ``export_memory_timeline`` is built on) turns them into a timeline of ``CREATE`` /
``DESTROY`` events with sizes. The running sum over that timeline is exact at the allocator's
level, compiled code included — where PyTorch's ``MemTracker`` (a dispatch mode) makes compiled
layers fall back to eager. Per-op summaries (``cpu_memory_usage``) would miss a peak inside one
op (an allocation freed before the op returns); the timeline does not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["allocation_peak"]


def allocation_peak(fn: Callable[[], Any]) -> int:
    """The most bytes allocated during ``fn()`` and not yet freed, at any moment: the peak
    above what was live when it started."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        fn()
    live = peak = 0
    for _, action, _, size in MemoryProfile(prof.profiler.kineto_results).timeline:
        if action.name == "CREATE":
            live += size
            peak = max(peak, live)
        elif action.name == "DESTROY":
            live -= size
    return peak
