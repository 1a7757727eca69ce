"""Judging a caller's diagnoses: the first call reports what it found, the second judges
its keep names (Note [judged on a repeat])."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

from .core import Diagnosis, report, unrecorded
from .messages import keep_unused

__all__ = ["RepeatJudge"]

# Note [judged on a repeat]
# A keep name is "unused" only if no marker of the whole model recorded it, but one
# layer or graph runs before the others have recorded theirs (a graph break splits a
# layer into graphs; one keep set spans many layers). So each caller (a compiled graph
# per module it runs in, an eagerly checkpointed layer) reports what its first call
# found at once, and judges its keep names on its *second* call, when every graph and
# layer of a step has run. After that it is done and costs one WeakSet lookup per call.


class RepeatJudge:
    """Per caller key (a module): report the first call's diagnoses, then judge the keep
    names on the second call (Note [judged on a repeat])."""

    def __init__(self, keep_names: Iterable[str]) -> None:
        self.keep_names = tuple(sorted(keep_names))
        self._calls: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()
        self._done: weakref.WeakSet[object] = weakref.WeakSet()

    def done(self, key: object) -> bool:
        return key in self._done

    def on_call(
        self, key: object, owner_: object, where: str, first: Callable[[], Iterable[Diagnosis]]
    ) -> None:
        """One call by ``key`` (a module) under the root ``owner_``; ``where`` names it."""
        calls = self._calls.get(key, 0) + 1
        if calls == 1:
            for d in first():
                report(d, owner_)  # may raise (strict): then this call does not count
        self._calls[key] = calls
        if self.keep_names:
            if calls < 2:
                return
            names = unrecorded(self.keep_names, owner_)
            if names:
                report(keep_unused(names, where), owner_)
        self._done.add(key)
