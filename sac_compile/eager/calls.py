"""Kept spans seen call by call: the recompute intercepts only the calls it serves from.

A Python dispatch mode costs every op it sees a round trip to Python; a torch function
mode costs a call far less (torch hands it the call it is about to make: ``F.linear``,
``Tensor.view``, ``torch.ops.x.y``; what runs inside it is not seen again). In the
forward, a :class:`_ForwardCalls` function mode sits above the caching dispatch mode for
each kept span and notes which ops (entries) each call ran. When the forward ends,
:func:`plan` marks the calls the recompute must intercept: those with an op served from
the cache, skipped (dead), or a served write or draw to step over. In the recompute a
:class:`_RecomputeCalls` function mode replaces the dispatch mode: every other call runs
natively, as under plain checkpointing; an intercepted call runs under the cached
dispatch mode, looking up that call's entries only.

The recompute falls back to the dispatch mode for the whole span (every op seen, as
before) when the forward ran an op inside a kept span that no call held (one a function
mode cannot see), or when it must watch reads of outside tensors (eager/modes.py,
``_WatchMode``).
"""

from __future__ import annotations

from collections import Counter, defaultdict

import torch
from torch.overrides import TorchFunctionMode

from .._compat.checkpoint import pop_dispatch_mode, push_dispatch_mode
from .modes import _CachedMode
from .state import _Entry, _State


class _ForwardCalls(TorchFunctionMode):
    """(forward, kept spans) Notes each torch-level call and the entries its ops made."""

    def __init__(self, state: _State) -> None:
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        st = self.state
        start = len(st.order)
        st.in_call = True
        try:
            return func(*args, **(kwargs or {}))
        finally:
            st.in_call = False
            if len(st.order) > start:
                st.calls.append((func, start, len(st.order), _shapes(args)))
            else:  # (a getter, or an op it ignores: also what hooks call, in one pass only)
                try:
                    st.idle_calls.add(func)
                except TypeError:  # (an unhashable callable: its calls cannot be counted)
                    st.calls_ok = False


def _shapes(args: tuple) -> tuple:
    return tuple(a.shape for a in args if isinstance(a, torch.Tensor))


def _served(e: _Entry) -> bool:
    """The recompute must see this op: served, skipped, or a draw or write it steps over."""
    return e.cached or e.dead or e.served_write is not None or e.rng_after is not None


def plan(st: _State) -> dict | None:
    """(end of the forward) For each function with a call the recompute must intercept,
    per call of it that ran ops (in order): None, it runs natively; else (its argument
    shapes, its entries by key). None: the recompute sees every op (a function whose call
    is intercepted also ran without ops, so its calls cannot be counted)."""
    found: dict = {}
    for func, start, end, shapes in st.calls:
        entries = st.order[start:end]
        lookup = None
        if any(_served(e) for e in entries):
            lookup = defaultdict(list)
            for e in entries:
                lookup[e.key].append(e)
        try:
            found.setdefault(func, []).append(None if lookup is None else (shapes, lookup))
        except TypeError:  # (an unhashable callable)
            return None
    plans = {f: calls for f, calls in found.items() if any(c is not None for c in calls)}
    try:
        if any(f in st.idle_calls for f in plans):
            return None
    except TypeError:
        return None
    return plans


class _RecomputeCalls(TorchFunctionMode):
    """(recompute, kept spans) Runs each call natively, or under ``cached`` when it has an
    op to serve (see :func:`plan`)."""

    def __init__(self, state: _State, cached: _CachedMode, plans: dict) -> None:
        super().__init__()
        self.state = state
        self.cached = cached
        self.plans = plans
        self.seen: Counter = Counter()  # calls of each planned function so far
        self.counts = state.stats.recompute_calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            calls = self.plans.get(func)
        except TypeError:  # (unhashable: never planned)
            calls = None
        if calls is None:
            self.counts["native"] += 1
            return func(*args, **kwargs)
        i = self.seen[func]
        self.seen[func] += 1
        planned = calls[i] if i < len(calls) else None
        if planned is None:
            self.counts["native"] += 1
            return func(*args, **kwargs)
        shapes, lookup = planned
        if _shapes(args) != shapes:
            raise RuntimeError(
                f"sac_compile: call {i + 1} of {func} in kept regions had arguments of shapes "
                f"{[tuple(s) for s in shapes]} in the forward and {[tuple(s) for s in _shapes(args)]} "
                "in the recompute (the checkpointed function is not deterministic in the ops it runs)"
            )
        self.counts["intercepted"] += 1
        cached = self.cached
        cached.lookup, cached.counter = lookup, Counter()
        push_dispatch_mode(cached)
        try:
            return func(*args, **kwargs)
        finally:
            pop_dispatch_mode(cached)
