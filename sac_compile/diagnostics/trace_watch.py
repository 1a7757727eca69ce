"""Trace time: markers compiled by a backend that does not run the tagging pass (``no-pass``),
and layers wrapped with ``compile=True`` swallowed by an outer compile (``compile-swallowed``).

Two sightings of the same marker make the verdict, so that nothing is guessed:
Dynamo traces it first (the fake impl runs with Dynamo's translator current: we
note the region and the module around it), then, if and only if the graph is
really compiled by an AOTAutograd-based backend (Inductor, aot_eager, ...),
AOTAutograd traces it again inside the backend call. If no sac backend claimed
that Dynamo trace (:func:`claim_trace`, called by every sac backend before it
compiles), the markers reached a compile that drops them. A Dynamo trace that is
abandoned (a restart after a graph break) never gets the second sighting, and a
custom backend that hands the graph to a sac backend is compiling through ours.
Backends that do not use AOTAutograd ("eager", custom ones) cannot checkpoint
anything and are not reported.

A warm AOTAutograd cache serves a foreign backend's graph without tracing it again,
so AOTAutograd's sighting never comes. Per Dynamo compile (compile id), the sightings
are kept until the compile ends; if no sac backend compiled in it and the
AOTAutograd cache served a graph meanwhile, they are reported then (logged: Dynamo
runs end-of-compile callbacks under its own lock, where raising is unsafe).
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from .._compat import TorchApiMoved, dynamo, frames
from ..actions import keep_of_text
from ..keep import ALL_REGIONS
from ..marker_walk import POLICY_SCOPE, MarkerKind
from ..records import describe_stack_entry, user_class_name
from . import messages
from .core import (
    COMPILE_SWALLOWED,
    NO_PASS,
    Diagnosis,
    SacDiagnosticError,
    describe_module,
    note_regions,
    owner,
    report,
)
from .eager import where_in

__all__ = [
    "claim_trace",
    "marker_traced",
    "note_routed",
    "regions_compiled_in",
    "report_unkept_in_checkpoint",
]

log = logging.getLogger("sac_compile")

Key = tuple[str, str]  # (diagnosis kind, region)
_SCOPE = "<scope keep="  # the "region" of a wrapped layer's scope markers: "<scope keep=attn,mlp>"


@dataclass
class _Trace:
    """One Dynamo trace attempt (its ``OutputGraph``; an abandoned attempt's is dropped with it)."""

    seen: dict[Key, str] = field(default_factory=dict)  # sighted by Dynamo -> where
    open_scopes: int = 0  # scope markers entered and not yet exited, as traced
    done: set[Key] = field(default_factory=set)  # already reported
    claimed: bool = False  # a sac backend compiles this trace's graph


@dataclass
class _Watch:
    """Sightings of one Dynamo compile (compile id), for a warm-cache hit."""

    hits: int
    backend: str
    sightings: dict[Key, str] = field(default_factory=dict)
    reported: set[Key] = field(default_factory=set)
    sac: bool = False


_lock = threading.Lock()
# OutputGraph defines __eq__ without __hash__: keyed by id, dropped by a finalizer
_traces: dict[int, _Trace] = {}
_watched: dict[str | None, _Watch] = {}
# code of a compiled method the seam routes through the eager engine -> the region names Dynamo
# traced in it (sac_compile/eager/session.py, EagerSession.call_compiled)
_compiled_regions: dict[Any, frozenset[str]] = {}


# codes of the compiled methods a seam routes (note_routed): their regions are noted whenever
# Dynamo traces them, inside the engine or not (a method first compiled by a layer left
# unwrapped, or under a full recompute, is kept from then on: its code's graphs are cached)
_routed_codes: set[Any] = set()


def note_routed(code: Any) -> None:
    """A seam routes the compiled method whose code is ``code`` through the eager engine."""
    with _lock:
        _routed_codes.add(code)


def regions_compiled_in(code: Any) -> frozenset[str]:
    """The region names Dynamo traced so far in the compiled method whose code is ``code``,
    while the eager engine ran it (empty until it has been compiled so)."""
    return _compiled_regions.get(code, frozenset())


def _trace_state(trace: object) -> _Trace:
    key = id(trace)
    state = _traces.get(key)
    if state is None:
        state = _traces[key] = _Trace()
        weakref.finalize(trace, _traces.pop, key, None)
    return state


def claim_trace() -> None:
    """A sac backend is compiling the graph of the current Dynamo trace: no ``no-pass``."""
    tx = dynamo.current_dynamo_tx()
    cid = dynamo.current_compile_id()
    with _lock:
        if tx is not None:
            _trace_state(dynamo.tx_trace(tx)).claimed = True
        if cid in _watched:
            _watched[cid].sac = True


def marker_traced(kind: str, payload: tuple, sink: object = None) -> None:
    """Called by the markers' fake implementations (Dynamo and AOTAutograd tracing);
    ``sink``: the marker sink installed where Dynamo traces (the eager engine's session when
    an eagerly checkpointed layer calls a compiled function).

    Never breaks a compile: only a strict-mode diagnosis propagates.
    """
    try:
        if not _routed_method(kind, payload, sink) and not _inside_eager_checkpoint(kind, payload, sink):
            _marker_traced(kind, payload)
    except (SacDiagnosticError, TorchApiMoved):
        raise  # strict mode; a private torch API that moved must be loud, not a silent no-op
    except Exception as e:  # a diagnostics bug must not fail the user's compile
        log.debug("sac_compile: trace-time diagnostics failed: %r", e)


def _routed_method(kind: str, payload: tuple, sink: object) -> bool:
    """Dynamo traces a region in a compiled method that a seam routes, outside the eager engine
    (the engine's own sightings: :func:`_inside_eager_checkpoint`; a layer of the class left
    unwrapped, or fully recomputed): noted for the engine, whose later calls keep it (the code's
    graphs are cached from then on); nothing to report outside the engine."""
    if sink is not None or MarkerKind(kind).is_scope or not _routed_codes:
        return False
    code = getattr(dynamo.current_dynamo_tx(), "f_code", None)
    if code is None or code not in _routed_codes:
        return False
    _note_compiled_region(code, str(payload[0]))
    return True


def _note_compiled_region(code: Any, name: str) -> None:
    with _lock:
        _compiled_regions[code] = _compiled_regions.get(code, frozenset()) | {name}


def _inside_eager_checkpoint(kind: str, payload: tuple, sink: object) -> bool:
    """Dynamo traces a kept region's marker in a function compiled inside the eager engine's
    forward (trainers that compile methods and checkpoint the layer eagerly outside them): the
    checkpoint discards what the compiled graph saves and runs the call again in the backward,
    so the region keeps nothing whatever the backend. Reported once (``compiled-in-eager``),
    instead of ``no-pass`` (whose fix, our backend, would not help here)."""
    keep = getattr(sink, "keep", None)
    if keep is None or MarkerKind(kind).is_scope:
        return False
    tx = dynamo.current_dynamo_tx()
    if tx is None:
        return False
    name = str(payload[0])
    routed = getattr(sink, "compiled_call", None)
    if routed is not None:
        # a compiled method of the layer that the seam routes through the engine, which keeps
        # it whole in the forward and hands its outputs back in the recompute when a region
        # it holds is kept (eager/session.py): noted, nothing to report
        _note_compiled_region(routed, name)
        return True
    if not getattr(sink, "forward", False):
        return False
    kept = keep is ALL_REGIONS or name in keep
    if not kept or kind != MarkerKind.REGION_ENTER or frames.inside_backend_call():
        return True  # (not kept: the full recompute the layer asked for; AOTAutograd's sighting)
    obj, function = dynamo.tx_where(tx)
    compiled = (
        function if obj is None or isinstance(obj, type) else f"{user_class_name(type(obj))}.{function}"
    )
    layer = frames.innermost_module()
    root = owner()
    note_regions({name}, root, layer)  # (it ran: not keep-unused)
    where = where_in(layer, root) if layer is not None else f"{function}()"
    report(
        messages.compiled_function_in_eager(name, where, compiled, _backend_name(dynamo.tx_backend(tx))), root
    )
    return True


def _marker_traced(kind: str, payload: tuple) -> None:
    tx = dynamo.current_dynamo_tx()
    if tx is None:
        return
    trace = dynamo.tx_trace(tx)
    region_name = str(payload[0]) if kind.startswith("region") else f"{_SCOPE}{payload[1]}>"
    cid = dynamo.current_compile_id()
    backend = _backend_name(dynamo.tx_backend(tx))
    if not frames.inside_backend_call():
        # Dynamo's sighting: remember where the marker is
        module_stack = dynamo.tx_module_stack(tx)
        found = []
        with _lock:
            state = _trace_state(trace)
            inside_scope = state.open_scopes > 0
            if kind == MarkerKind.SCOPE_ENTER:
                state.open_scopes += 1
            elif kind == MarkerKind.SCOPE_EXIT and inside_scope:
                state.open_scopes -= 1
        if kind == MarkerKind.SCOPE_ENTER and payload[0] == 1 and module_stack:
            found.append(((COMPILE_SWALLOWED, "-"), _where_in_trace(tx, module_stack)))
        if kind == MarkerKind.SCOPE_ENTER and payload[0] == POLICY_SCOPE:
            pass  # kept by PyTorch's selective checkpointing: not a layer traced without the pass
        elif kind == MarkerKind.SCOPE_ENTER or (not MarkerKind(kind).is_scope and not inside_scope):
            # a wrapped layer is reported once, as a layer (its regions, kept or not, are
            # all left unchecked with it); a region outside every wrapped layer, as a region
            found.append(((NO_PASS, region_name), _where_in_trace(tx, module_stack)))
        for key, where in found:
            with _lock:
                _trace_state(trace).seen.setdefault(key, where)
            _watch(cid, key, where, backend)
        return
    # AOTAutograd's sighting inside a backend call
    with _lock:
        state = _trace_state(trace)
        if state.claimed:
            return  # a sac backend is compiling this graph
        todo = [
            (k, w)
            for k, w in state.seen.items()
            if k not in state.done and (k[0] != NO_PASS or k[1] == region_name)
        ]
        state.done.update(k for k, _ in todo)
        if cid in _watched:
            _watched[cid].reported.update(k for k, _ in todo)
    root = owner()
    for key, where in todo:
        report(_trace_diagnosis(key, where, backend), root)


def _trace_diagnosis(key: Key, where: str, backend: str, note: str = "") -> Diagnosis:
    kind, region = key
    if kind == COMPILE_SWALLOWED:
        return messages.compile_swallowed(where, backend)
    if region.startswith(_SCOPE):
        return messages.no_pass_layer(keep_of_text(region[len(_SCOPE) : -1]), where, backend, note)
    return messages.no_pass(region, where, backend, note)


def _watch(cid: str | None, key: Key, where: str, backend: str) -> None:
    if cid is None:
        return
    dynamo.on_dynamo_compile_end(_on_compile_end)
    with _lock:
        state = _watched.get(cid)
        if state is None:
            state = _watched[cid] = _Watch(hits=dynamo.aot_cache_hits(), backend=backend)
        state.sightings.setdefault(key, where)


def _on_compile_end(cid: str) -> None:
    with _lock:
        state = _watched.pop(cid, None)
    if state is None or state.sac or dynamo.aot_cache_hits() <= state.hits:
        return
    root = owner()
    for key, where in state.sightings.items():
        if key in state.reported:
            continue
        d = _trace_diagnosis(key, where, state.backend, " (the graph was served from the compile cache)")
        try:
            report(d, root)
        except SacDiagnosticError:
            log.error("%s", d.message())


def report_unkept_in_checkpoint(keep: Any, what: str) -> None:
    """Dynamo traces a wrapped layer inside a checkpoint's body, with a backend without the tagging
    pass, and the layer asks for what only the pass applies (``what``: a budget, an offload):
    the checkpoint recomputes the layer whole (Note [a seam inside a checkpoint compiled without the
    pass] in sac_compile/policy_checkpoint.py). Reported at once: a backend without AOTAutograd
    gives no later sighting."""
    tx = dynamo.current_dynamo_tx()
    if tx is None:
        return
    where = _where_in_trace(tx, dynamo.tx_module_stack(tx))
    note = f"; traced inside a torch.utils.checkpoint, which recomputes it whole: its {what} needs the pass"
    report(messages.no_pass_layer(keep, where, _backend_name(dynamo.tx_backend(tx)), note), owner())


def _where_in_trace(tx, module_stack: list) -> str:
    if module_stack:
        return describe_stack_entry(*module_stack[-1])
    obj, function = dynamo.tx_where(tx)
    if isinstance(obj, nn.Module):
        return describe_module(obj)
    # a decorator's wrapper or a resume function after a graph break: the module whose
    # call is running below the frame Dynamo compiles (its _call_impl is on the stack)
    module = frames.innermost_module()
    if module is not None:
        return describe_module(module)
    return f"{function}()"


def _backend_name(backend: object) -> str:
    name = getattr(backend, "compiler_name", None) or getattr(backend, "__name__", None)
    return repr(name or type(backend).__name__)
