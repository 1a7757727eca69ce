"""The marker ops: ``torch.library`` custom ops in the ``sac_compile`` namespace.

Four ops, none with tensor arguments or results:

* ``sac_compile::region_enter(str name)`` / ``region_exit(str name)`` bracket the
  forward ops of a named region (emitted by :func:`sac_compile.region`);
* ``sac_compile::scope_enter(int scope_id, str keep)`` / ``scope_exit(int scope_id,
  str keep)`` bracket a checkpoint *scope* carrying its own keep set (emitted by the seam
  when it is traced by an outer ``torch.compile``). ``keep`` is the text of
  :func:`sac_compile.keep.format_keep` ("*" = every region); the exit repeats it so
  that a graph starting inside a scope (a graph break split it) still knows it.

Why these survive the stack: Dynamo puts a call to a ``torch.ops`` overload in its
graph as-is; make_fx (AOTAutograd) records ops without tensor arguments because the
proxy mode is active in TLS; and the ops are registered with
``torch.fx.node.has_side_effect`` so ``eliminate_dead_code`` keeps them although
nothing uses their (empty) result. Being ordinary nodes they keep their position,
so the joint graph carries them in forward program order. The tagging pass
(:mod:`sac_compile.passes.tag_regions`) reads and then erases them. When a backend
without that pass traces them, :mod:`sac_compile.diagnostics.trace_watch` reports it.

Eagerly the ops call the active *marker sink*, a callable in a ``ContextVar``
that the eager engine installs inside its checkpointed function; outside any
scope there is no sink and a marker is a no-op. Eager callers emit a region marker
through :func:`enter_region` / :func:`exit_region`: with no sink and nothing recording
ops they dispatch nothing (Note [markers unseen in plain eager]); with a sink installed
they hand it the marker directly (no op dispatch) and then call its ``settle()``, where the engine
pushes or pops its dispatch mode, outside any op's dispatch (a mode could not pop itself
while dispatching the exit marker).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.fx.node import has_side_effect

from .._compat import inductor
from .._compat.ops import modes_active
from ..diagnostics import trace_watch
from ..marker_walk import MarkerKind

__all__ = [
    "MARKER_OPS",
    "REGION_ENTER",
    "REGION_EXIT",
    "SCOPE_ENTER",
    "SCOPE_EXIT",
    "call_region",
    "current_sink",
    "marker_sink",
    "enter_module_region",
    "enter_region",
    "exit_module_region",
    "module_output",
    "exit_region",
]

#: ``sink(kind, payload)`` with kind a :class:`~sac_compile.marker_walk.MarkerKind`;
#: installed by the eager engine. A sink may also have a
#: ``settle()`` method, called after each eager region marker op has returned.
MarkerSink = Callable[[MarkerKind, tuple[Any, ...]], None]
_MARKER_SINK: contextvars.ContextVar[MarkerSink | None] = contextvars.ContextVar(
    "sac_compile_marker_sink", default=None
)


@contextlib.contextmanager
def marker_sink(sink: MarkerSink | None) -> Iterator[MarkerSink | None]:
    """Install ``sink`` as the marker sink for the block (the eager engine's session, a
    recorder of yours); the previous one is back on the way out."""
    token = _MARKER_SINK.set(sink)
    try:
        yield sink
    finally:
        _MARKER_SINK.reset(token)


def current_sink() -> MarkerSink | None:
    """The marker sink installed now (None outside the eager engine)."""
    return _MARKER_SINK.get()


def _emit(kind: MarkerKind, payload: tuple[Any, ...]) -> None:
    sink = _MARKER_SINK.get()
    if sink is not None:
        sink(kind, payload)


def _region_marker(kind: MarkerKind, name: str, op: Callable[[str], None]) -> None:
    """Emit a region marker. Under Dynamo (``is_compiling()`` reads True, so the context
    variable is never read in traced code) the op is called, for the graph. Eagerly inside
    the eager engine (a sink is installed) the sink gets the marker directly and settles:
    a custom op's Python dispatch costs microseconds, and the engine sees two markers per
    region per pass. Eagerly with no sink the op is called only when something may record
    it (Note [markers unseen in plain eager])."""
    if torch.compiler.is_compiling():
        op(name)
        return
    sink = _MARKER_SINK.get()
    if sink is not None:
        sink(kind, (name,))
        settle = getattr(sink, "settle", None)
        if settle is not None:
            settle()
    elif modes_active():
        op(name)


# Note [markers unseen in plain eager]
# Eagerly with no sink installed a marker op does nothing: its implementation hands the
# marker to the sink. Dispatching it matters only to what records ops: make_fx's proxy
# mode (AOTAutograd tracing eager code), FakeTensorMode, any TorchDispatchMode of yours
# (all on the dispatch mode stack), and torch-function modes, which see torch.ops calls.
# With none of them active the dispatch is skipped: in plain eager code (inference, or
# training without a checkpoint) each declared module call cost two custom-op
# dispatches, most of what its hooks took.


def enter_region(name: str) -> None:
    """Emit ``region_enter(name)``: in traced code the op; eagerly inside the eager engine,
    straight to its sink; in plain eager code with nothing recording ops, nothing."""
    _region_marker(MarkerKind.REGION_ENTER, name, torch.ops.sac_compile.region_enter)


def exit_region(name: str) -> None:
    """Emit ``region_exit(name)`` (see :func:`enter_region`)."""
    _region_marker(MarkerKind.REGION_EXIT, name, torch.ops.sac_compile.region_exit)


def _sink_method(method: str) -> Callable[..., Any] | None:
    """Eagerly, the installed sink's ``method`` (None under a tracer, with no sink, or when
    the sink has no such method)."""
    if torch.compiler.is_compiling():
        return None
    return getattr(_MARKER_SINK.get(), method, None)


def enter_module_region(name: str, module: object, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A declared module's region opens (its forward pre-hook): :func:`enter_region`,
    except that eagerly a sink with ``enter_module`` takes the call with the module and
    its arguments (the eager engine may skip the body in the recompute)."""
    enter = _sink_method("enter_module")
    if enter is not None:
        enter(name, module, args, kwargs)
    else:
        enter_region(name)


def exit_module_region(name: str, module: object, output: object) -> None:
    """A declared module's region closes (its forward hook): :func:`exit_region`, or the
    sink's ``exit_module`` with the module's output (see :func:`enter_module_region`)."""
    exit_ = _sink_method("exit_module")
    if exit_ is not None:
        exit_(name, module, output)
    else:
        exit_region(name)


def module_output(name: str, module: object, output: object) -> None:
    """Eagerly, a declared module's own output (its first forward hook, before hooks
    registered earlier change it), for a sink with ``module_output``."""
    note = _sink_method("module_output")
    if note is not None:
        note(name, module, output)


def call_region(name: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    """Eagerly, a decorated function's call as region ``name`` (its wrapper): a sink with
    ``call_body`` takes the whole call (the eager engine may skip the body in the recompute);
    otherwise :func:`enter_region`, the call, :func:`exit_region`."""
    call = _sink_method("call_body")
    if call is not None:
        return call(name, fn, args, kwargs)
    enter_region(name)
    try:
        return fn(*args, **kwargs)
    finally:
        exit_region(name)


def _on_trace(kind: MarkerKind, payload: tuple[Any, ...]) -> None:
    # Fake implementations run when Dynamo or AOTAutograd trace a marker. The no-op lowerings
    # are registered once Inductor is loaded: its compile imports its lowerings before
    # AOTAutograd traces the graph again (this runs then); an aot_eager compile never loads them.
    inductor.register_noop_lowerings(MARKER_OPS)
    # (the eager engine's session, when Dynamo compiles a function that an eager checkpoint calls)
    trace_watch.marker_traced(kind, payload, _MARKER_SINK.get())


@torch.library.custom_op("sac_compile::region_enter", mutates_args=())
def region_enter(name: str) -> None:
    _emit(MarkerKind.REGION_ENTER, (name,))


@region_enter.register_fake
def _region_enter_fake(name: str) -> None:
    _on_trace(MarkerKind.REGION_ENTER, (name,))


@torch.library.custom_op("sac_compile::region_exit", mutates_args=())
def region_exit(name: str) -> None:
    _emit(MarkerKind.REGION_EXIT, (name,))


@region_exit.register_fake
def _region_exit_fake(name: str) -> None:
    _on_trace(MarkerKind.REGION_EXIT, (name,))


@torch.library.custom_op("sac_compile::scope_enter", mutates_args=())
def scope_enter(scope_id: int, keep: str) -> None:
    _emit(MarkerKind.SCOPE_ENTER, (scope_id, keep))


@scope_enter.register_fake
def _scope_enter_fake(scope_id: int, keep: str) -> None:
    _on_trace(MarkerKind.SCOPE_ENTER, (scope_id, keep))


@torch.library.custom_op("sac_compile::scope_exit", mutates_args=())
def scope_exit(scope_id: int, keep: str) -> None:
    _emit(MarkerKind.SCOPE_EXIT, (scope_id, keep))


@scope_exit.register_fake
def _scope_exit_fake(scope_id: int, keep: str) -> None:
    _on_trace(MarkerKind.SCOPE_EXIT, (scope_id, keep))


REGION_ENTER = torch.ops.sac_compile.region_enter.default
REGION_EXIT = torch.ops.sac_compile.region_exit.default
SCOPE_ENTER = torch.ops.sac_compile.scope_enter.default
SCOPE_EXIT = torch.ops.sac_compile.scope_exit.default
MARKER_OPS = frozenset({REGION_ENTER, REGION_EXIT, SCOPE_ENTER, SCOPE_EXIT})

# Nothing consumes a marker's result, so without this FX's dead-code elimination
# (run by Dynamo, AOTAutograd and the partitioner) would drop them. This is the
# FX extension point for ops that "cannot be marked via the normal effects
# system"; the effects system (with_effects tokens) would thread tokens through
# the graph signature, which the tagging pass could not then erase cleanly.
for _op in MARKER_OPS:
    has_side_effect(_op)
for _packet in (
    torch.ops.sac_compile.region_enter,
    torch.ops.sac_compile.region_exit,
    torch.ops.sac_compile.scope_enter,
    torch.ops.sac_compile.scope_exit,
):
    has_side_effect(_packet)


_MARKER_KIND = {
    REGION_ENTER: MarkerKind.REGION_ENTER,
    REGION_EXIT: MarkerKind.REGION_EXIT,
    SCOPE_ENTER: MarkerKind.SCOPE_ENTER,
    SCOPE_EXIT: MarkerKind.SCOPE_EXIT,
    torch.ops.sac_compile.region_enter: MarkerKind.REGION_ENTER,
    torch.ops.sac_compile.region_exit: MarkerKind.REGION_EXIT,
    torch.ops.sac_compile.scope_enter: MarkerKind.SCOPE_ENTER,
    torch.ops.sac_compile.scope_exit: MarkerKind.SCOPE_EXIT,
}


def marker_kind(node: torch.fx.Node) -> MarkerKind | None:
    """The node's :class:`~sac_compile.marker_walk.MarkerKind`, or None for other nodes."""
    if node.op != "call_function":
        return None
    return _MARKER_KIND.get(node.target)


def op_marker_kind(op: object) -> MarkerKind | None:
    """The :class:`~sac_compile.marker_walk.MarkerKind` of a marker op (as dispatched), or None."""
    return _MARKER_KIND.get(op)
