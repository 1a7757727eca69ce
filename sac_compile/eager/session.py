"""The marker session of one checkpointed call: the regions open while the function runs
(one per forward and per recompute), in a ``ContextVar`` the dispatch modes read.

The session is the marker sink (:mod:`sac_compile.markers.ops`). Its :meth:`~EagerSession.settle`,
called after each eager region marker, starts a *kept span* when the first kept region
opens and ends it when the last one closes: the engine's dispatch mode is pushed for the
span only, so ops outside kept regions run with no Python dispatch mode at all.
"""

from __future__ import annotations

import contextvars
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from ..actions import Actions
from ..diagnostics.trace_watch import regions_compiled_in
from ..keep import KeepSet
from ..marker_walk import MarkerKind, OpenRegions
from ..policy import SAVE_ALL, SAVE_COSTLY, Op, RegionPolicy, checked_decision, saves

__all__ = ["EagerSession"]


class Spans(Protocol):
    """What the engine does when a kept span starts and ends."""

    def start(self) -> None: ...

    def end(self, aborted: bool = False) -> None: ...


class BodySkipper(Protocol):
    """What the session asks of the kept module bodies that skip the recompute
    (implemented by :class:`sac_compile.eager.kept_bodies.Bodies`)."""

    def enter(
        self, region: str, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any | None: ...

    def exit(self, body: Any, output: Any) -> None: ...

    def arm(self, module: Any) -> bool: ...

    def next_call(self, fn: Any) -> Any | None: ...

    def decline(self, fn: Any, region: str) -> None: ...

    def replay(self, body: Any, run: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...


class EagerSession:
    """Open regions while a checkpointed function runs (one per forward / recompute)."""

    def __init__(
        self,
        actions: Actions,
        spans: Spans | None = None,
        bodies: BodySkipper | None = None,
        forward: bool = True,
    ) -> None:
        self.actions = actions
        keep, policy = actions.saving, actions.policy  # (an offloaded region's values are cached too)
        self.keep = keep  # (read for every region marker: one attribute, not two)
        self.spans = spans
        # Under SAVE_ALL a kept declared module with no kept region open around it runs
        # with no mode in the forward and is not run in the recompute (eager/kept_bodies.py)
        self.bodies = bodies if policy is SAVE_ALL and not actions.offload else None
        # compiled methods of the layer are kept whole under every policy (call_compiled)
        self.compiled_bodies = bodies
        self.compiled_call: Any = None  # (the code of) the compiled method running now
        self.forward = forward
        self.skipping = 0  # module regions open inside a body that skips the recompute
        self._body: Any = None  # (forward) that body
        self.in_span = False
        self.regions = OpenRegions()
        self.entered: Counter[str] = Counter()
        # entries of kept regions open now: kept() is asked for every op the modes see
        self._kept_open = 0
        # the policy's answers, by (id(op), regions): (op, answer)
        self._saves: dict[tuple[int, tuple[str, ...]], tuple[Any, bool]] = _answers(policy, keep)

    def __call__(self, kind: MarkerKind, payload: tuple[Any, ...]) -> None:
        """The marker sink: a marker op ran."""
        if self.compiled_call is not None:
            return  # (inside a routed compiled method, whose graph a backend left them in: call_compiled)
        if kind is MarkerKind.REGION_ENTER:
            self.regions.enter(payload[0])
            self.entered[payload[0]] += 1
            self._kept_open += payload[0] in self.keep
        elif kind is MarkerKind.REGION_EXIT and self.regions.exit(payload[0]):
            self._kept_open -= payload[0] in self.keep
        # (an exit without an enter closes nothing: the walk records it)

    def enter_module(self, name: str, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A declared module's region opens (its forward pre-hook)."""
        self(MarkerKind.REGION_ENTER, (name,))
        if self.skipping:
            self.skipping += 1
            return
        if self.bodies is not None and not self.in_span and name in self.keep:
            if self.forward:
                self._body = self.bodies.enter(name, module, args, kwargs)
                if self._body is not None:
                    self.skipping = 1
                    return
            elif self.bodies.arm(module):
                self.skipping = 1
                return
        self.settle()

    def module_output(self, name: str, module: Any, output: Any) -> None:
        """A declared module's own output (its first forward hook: before hooks registered
        earlier change it, which run again on the handed-back output in the recompute)."""
        if self._body is not None and self._body.module is module:
            body, self._body = self._body, None
            self.bodies.exit(body, output)  # type: ignore[union-attr]

    def exit_module(self, name: str, module: Any, output: Any) -> None:
        """A declared module's region closes (its last forward hook), or a decorated
        function's (also when it raised, with ``output`` None)."""
        if self.skipping:
            self.skipping -= 1
            if not self.skipping and self._body is not None:  # (no output was handed over)
                body, self._body = self._body, None
                self.bodies.exit(body, None)  # type: ignore[union-attr]
        self(MarkerKind.REGION_EXIT, (name,))
        self.settle()

    def call_body(
        self, name: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """A decorated function's call, as region ``name`` (its wrapper, eagerly): as a
        declared module's, the function in the module's place; in the recompute the skip is
        decided here (the wrapper is ours: no forward to replace)."""
        eligible = self.bodies is not None and not self.skipping and not self.in_span and name in self.keep
        if eligible and not self.forward:
            body = self.bodies.next_call(fn)  # type: ignore[union-attr]
            if body is not None:
                self(MarkerKind.REGION_ENTER, (name,))
                self.skipping = 1
                try:
                    return self.bodies.replay(body, fn, args, kwargs)  # type: ignore[union-attr]
                finally:
                    self.skipping = 0
                    self(MarkerKind.REGION_EXIT, (name,))
        self.enter_module(name, fn, args, kwargs)
        out = None
        try:
            out = fn(*args, **kwargs)
            self.module_output(name, fn, out)
            return out
        finally:
            self.exit_module(name, fn, out)

    def call_compiled(
        self,
        fn: Callable[..., Any],
        run: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        kept_run: Callable[[], Callable[..., Any] | None] | None = None,
    ) -> Any:
        """A compiled method of the checkpointed layer (``torch.compile`` of a function on its
        class, routed here by the seam's class): ``fn`` the original function, ``run`` the
        compiled call. An eager checkpoint around compiled code would drop what the compiled
        graph saves and run it again in the backward; when the method holds a kept region
        (Dynamo traced one in it, :func:`~sac_compile.diagnostics.trace_watch.regions_compiled_in`:
        from its first compile on), it runs once instead, as a kept body: in the forward off the
        checkpoint's hooks (its graph holds what it saves: with our backend the kept regions'
        costly values, its cheap ops recomputed in its own backward), in the recompute its
        outputs are handed back. Otherwise it is recomputed with the rest of the layer.
        ``kept_run()``: how it runs as a kept body (the method compiled as a scope of this layer's
        actions, :func:`sac_compile.eager.routing._kept_run`), None for ``run``."""
        bodies, code = self.compiled_bodies, fn.__code__
        if bodies is None:
            return run(*args, **kwargs)
        names = regions_compiled_in(code)
        kept = sorted(n for n in names if n in self.keep)
        for name in names:
            self.entered[name] += self.forward
        if self.skipping:
            body = None  # inside a kept body: it runs, or is skipped, with that body
        elif self.forward:
            if kept and not self.in_span:
                body = bodies.enter("+".join(kept), fn, args, kwargs)  # (None: it declined, noted)
            else:
                body = None
                bodies.decline(fn, "+".join(kept))  # (the recompute runs it too)
        else:
            body = bodies.next_call(fn)
        previous, self.compiled_call = self.compiled_call, code
        if body is not None:
            self.skipping += 1
        out = None
        try:
            if body is not None and not self.forward:
                return bodies.replay(body, run, args, kwargs)
            if body is not None and kept_run is not None:
                run = kept_run() or run
            out = run(*args, **kwargs)
            return out
        finally:
            self.compiled_call = previous
            if body is not None:
                self.skipping -= 1
                if self.forward:
                    bodies.exit(body, out)

    def settle(self) -> None:
        """After a marker op: start or end the kept span if a kept region opened or closed."""
        if self.spans is None or self.skipping or self.in_span == (self._kept_open > 0):
            return
        self.in_span = not self.in_span
        if self.in_span:
            self.spans.start()
        else:
            self.spans.end()

    def end_span(self, aborted: bool = False) -> None:
        """End a span still open (the function returned or raised inside a kept region)."""
        if self.in_span and self.spans is not None:
            self.in_span = False
            self.spans.end(aborted)

    def close(self) -> list[tuple[str, str]]:
        """End of the checkpointed call: the unbalanced markers seen in it."""
        return self.regions.unbalanced + sorted(self.regions.left_open())

    def open_names(self) -> tuple[str, ...]:
        return self.regions.names()

    def kept(self) -> bool:
        return self._kept_open > 0

    def saves(self, func: Op, regions: tuple[str, ...]) -> bool:
        """Whether the region policy saves ``func`` run with ``regions`` (this session's
        :meth:`open_names`) open; outside every region, never."""
        if not regions:
            return False
        key = (id(func), regions)  # (an op's own hash is a Python call)
        found = self._saves.get(key)
        if found is None or found[0] is not func:  # (an id reused by another op)
            # (a region policy is a function of the op and the regions: asked once per pass)
            decision = checked_decision(self.actions.policy, func, regions, self.keep)
            found = self._saves[key] = (func, saves(decision))
        return found[1]


# The built-in policies' answers depend on the op, the regions and the keep set only: kept
# for every pass of every call with the same keep set (a user's policy is asked once per
# pass, as it may change between calls).
_BUILT_IN_ANSWERS: dict[tuple[Any, Any], dict[Any, Any]] = {}


def _answers(policy: RegionPolicy, keep: KeepSet) -> dict[Any, Any]:
    if policy is not SAVE_COSTLY and policy is not SAVE_ALL:
        return {}
    try:
        return _BUILT_IN_ANSWERS.setdefault((policy, keep), {})
    except TypeError:  # (an unhashable keep set)
        return {}


SESSION: contextvars.ContextVar[EagerSession | None] = contextvars.ContextVar(
    "sac_compile_eager_session", default=None
)


def current_session() -> EagerSession | None:
    """The eager engine's session of the pass running now (None outside the engine)."""
    return SESSION.get()
