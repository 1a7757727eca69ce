"""The CPU allocator's peak during a call, from ``torch.profiler``'s memory timeline.

``torch.profiler.profile(profile_memory=True)`` records every allocation and free the
allocator reports (CPU included), as ``Allocation`` events of the profiler's event tree
(``kineto_results.experimental_event_tree()``, private: what ``export_memory_timeline`` reads;
its ``MemoryProfile`` also builds a data-flow graph, which asserts on some FSDP steps, so the
events are summed here directly). The running sum of their sizes in time order is exact at
the allocator's level, compiled code included — where PyTorch's ``MemTracker`` (a dispatch mode) makes compiled
layers fall back to eager. Per-op summaries (``cpu_memory_usage``) would miss a peak inside one
op (an allocation freed before the op returns); the timeline does not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["allocation_events", "allocation_peak"]


def allocation_events(fn: Callable[[], Any]) -> list[tuple[int, int]]:
    """``(address, bytes)`` of every allocation (bytes > 0) and free (bytes < 0) the allocator
    reports during ``fn()``, in time order (stable: a free and an allocation at one time stay
    in order)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.typed[0] == _EventType.Allocation:
            events.append((event.start_time_ns, event.typed[1].ptr, event.typed[1].alloc_size))
    return [(ptr, size) for _, ptr, size in sorted(events, key=lambda e: e[0])]


def allocation_peak(fn: Callable[[], Any]) -> int:
    """The most bytes allocated during ``fn()`` and not yet freed, at any moment: the peak
    above what was live when it started."""
    live = peak = 0
    for _, size in allocation_events(fn):
        live += size
        peak = max(peak, live)
    return peak
