"""The compile session: which graph a sac backend is compiling now, and who is watching.

State is passed explicitly: a backend call opens a :class:`CompileUnit` with
:func:`compiling` (one ``ContextVar``); the tagging pass, running inside that call,
hands its records to :func:`publish`, which files them on the current unit and in
the record history. :func:`capture_units` is the public way to collect the units
compiled inside a block (``capture_partition`` and the tests use it). The lazily
compiled backward of a graph runs after the backend call returned; the backend
reaches its unit through a closure.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from .. import records
from .._compat import logs
from ..markers.context import NO_CONTEXT, Enclosing

__all__ = [
    "Advisor",
    "CompileUnit",
    "advise",
    "capture_units",
    "capturing",
    "compiling",
    "current_unit",
    "publish",
    "set_advisor",
]


@dataclass
class CompileUnit:
    """One Dynamo graph compiled by a sac backend: what reports and diagnostics need."""

    module: str  # the module whose frame Dynamo compiled ("Block", "fn()"), for diagnostics
    context: Enclosing = NO_CONTEXT  # the scopes and regions the graph starts inside of
    # (kind, region, call site) of markers compiled as region.__enter__/__exit__'s own frame
    with_fallbacks: list[tuple[str, str, str]] = field(default_factory=list)
    layer_paths: list[str] = field(default_factory=list)  # sibling layers the graph spans
    swallowed: list[str] = field(default_factory=list)  # compile=True layers an outer compile traced
    grad_enabled: bool = True
    # per Dynamo graph input (AOTAutograd's primals_1, primals_2, ... in order): True for
    # parameters and buffers, whose saving costs no activation memory
    input_is_param: list[bool] = field(default_factory=list)
    records: list[records.GraphRecord] = field(default_factory=list)  # the tagging pass's
    graphs: dict[str, Any] = field(default_factory=dict)  # "forward"/"backward"/"inference" -> snapshot
    saved_names: list[str] | None = None  # what the partitioned forward saves
    untouched: bool = False  # compiled exactly as the inner backend compiles it (no marker of ours)


_CURRENT: contextvars.ContextVar[CompileUnit | None] = contextvars.ContextVar(
    "sac_compile_compile_unit", default=None
)
_lock = threading.Lock()
_captures: list[list[CompileUnit]] = []


def current_unit() -> CompileUnit | None:
    """The graph a sac backend is compiling in this context right now, if any."""
    return _CURRENT.get()


def capturing() -> bool:
    """Whether a :func:`capture_units` block is open (graph snapshots are then taken)."""
    with _lock:
        return bool(_captures)


@contextlib.contextmanager
def compiling(unit: CompileUnit) -> Iterator[CompileUnit]:
    """A sac backend compiles ``unit`` inside the block."""
    with _lock:
        for sink in _captures:
            sink.append(unit)
    token = _CURRENT.set(unit)
    try:
        yield unit
    finally:
        _CURRENT.reset(token)


@contextlib.contextmanager
def capture_units() -> Iterator[list[CompileUnit]]:
    """Collect every :class:`CompileUnit` a sac backend compiles inside the block."""
    sink: list[CompileUnit] = []
    with _lock:
        _captures.append(sink)
    try:
        yield sink
    finally:
        with _lock:
            _captures.remove(sink)


def publish(record: records.GraphRecord) -> None:
    """The tagging pass's account of one graph: filed on the unit being compiled (if a sac
    backend runs the pass), in the record history (:func:`sac_compile.inspection.collect_records`) and
    in PyTorch's structured trace (artifact ``sac_compile_regions``)."""
    unit = current_unit()
    if unit is not None:
        record.eager_fallbacks = list(unit.with_fallbacks)
        unit.records.append(record)
    records.publish(record)
    # next to the graphs in tlparse (TORCH_TRACE=dir): what the pass kept and recomputed
    logs.trace_artifact("sac_compile_regions", record.summary)


# The planner's advice on a hand-picked keep set (sac_compile.planning.advice): set once by
# the package's root module, which sits above both; consulted by every sac backend call.
class Advisor(Protocol):
    """What the compile session consults before a sac backend compiles a training graph
    (the planner's :func:`sac_compile.planning.advice.advise`)."""

    def __call__(self, backend: Any, gm: Any, example_inputs: list[Any], unit: CompileUnit) -> None: ...


_advisor: Advisor | None = None


def set_advisor(advisor: Advisor | None) -> None:
    """``advisor(backend, gm, example_inputs, unit)`` is called before each training graph a
    sac backend compiles (outside :func:`capture_units` blocks); ``None`` turns it off."""
    global _advisor
    _advisor = advisor


def advise(backend: Any, gm: Any, example_inputs: list[Any], unit: CompileUnit) -> None:
    if _advisor is not None and unit.grad_enabled and not capturing():
        _advisor(backend, gm, example_inputs, unit)
