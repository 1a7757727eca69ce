"""Diagnostics: a configuration that silently does nothing is reported, once.

Every diagnosis goes to the standard ``logging`` logger ``"sac_compile"`` at
WARNING, names the region and the module, and says what to do. The kinds (the
product spec's numbering):

==========================  ==================================================================
kind                        situation
==========================  ==================================================================
1 ``keep-unused``           a name in a keep set that no marker recorded in this root model (judged when the
                            layer or graph that carries the keep set runs a second time, so
                            that every graph of a step has had its chance to record it)
2 ``kept-nothing``          a kept region that was entered but saved nothing (only views or
                            collectives inside, or the backward needs none of its values)
3 ``no-pass``               markers traced into a graph whose backend does not run the
                            tagging pass (caught while Dynamo traces the marker)
4 ``unbalanced``            an enter without an exit (or the reverse) within one graph or scope
4 ``graph-break``           a graph break split a decorated region across graphs
4 ``eager-fallback``        a graph break inside ``with region(...)``: the frame ran eagerly,
                            neither compiled nor checkpointed
5 ``compiled-in-eager``     a module checkpointed eagerly by the seam contains compiled code
5 ``no-scope``              one graph spans several layers and holds no checkpoint scope
- ``compile-swallowed``     an outer ``torch.compile`` traced a layer wrapped with
                            ``compile=True``: the layer's own backend never runs
- ``compile-fallback``      a layer wrapped with ``compile=True`` runs eagerly (Dynamo did not
                            compile it: recompile limit, skipped frame); the eager engine runs
- ``legacy-keep-ignored``   a layer opted into reentrant checkpointing with a non-empty keep
- ``collective-recomputed`` the eager engine ran a collective inside a kept region: it is
                            recomputed (communicates again) in the backward all the same
==========================  ==================================================================

Deduplication is on the whole diagnosis (kind, region, module, text) per
*owner*: the root module, i.e. the outermost ``nn.Module`` whose call is on the
Python stack when the diagnosis is raised (an ``OptimizedModule`` counts as the
module it wraps), held in a ``weakref.WeakKeyDictionary``. So a repeated step,
a recompile or N identical layers report once, and a second model reports again.
Code outside any module shares one process-wide owner.

Compiled graphs: the backend computes a graph's diagnoses when it compiles it,
and the graph reports them when it runs (its first call under each module), so
a graph shared by many layers, or served by Dynamo's cache to a second model,
still reports for each root model. On a warm FX-graph / AOTAutograd cache hit
the tagging pass does not run; the diagnoses and the regions it recorded are
then read back from a small side file written when the pass last ran (under
Inductor's cache directory, keyed by the Dynamo graph's code and the pass's
``uuid()``), so a warm start reports the same as a cold one. If that file is
missing, an INFO record says the graph could not be checked.

``strict``: :func:`set_strict` (process-wide), :func:`strict` (a ``with`` block)
or ``SacConfig(strict=True)`` (one model) turn every diagnosis into a
:class:`SacDiagnosticError`. Errors raised while Dynamo compiles (kinds 3 and
``compile-swallowed``) reach the caller unless Dynamo's
``torch._dynamo.config.suppress_errors`` is set, which swallows them and runs
the frame eagerly; the others are raised when the graph or layer runs.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch.nn as nn

__all__ = [
    "Diagnosis",
    "SacDiagnosticError",
    "report",
    "set_strict",
    "strict",
]

log = logging.getLogger("sac_compile")

KEEP_UNUSED = "keep-unused"
KEPT_NOTHING = "kept-nothing"
NO_PASS = "no-pass"
UNBALANCED = "unbalanced"
GRAPH_BREAK = "graph-break"
EAGER_FALLBACK = "eager-fallback"
COMPILED_IN_EAGER = "compiled-in-eager"
NO_SCOPE = "no-scope"
COMPILE_SWALLOWED = "compile-swallowed"
COMPILE_FALLBACK = "compile-fallback"
LEGACY_KEEP_IGNORED = "legacy-keep-ignored"
COLLECTIVE_RECOMPUTED = "collective-recomputed"
KINDS = (
    KEEP_UNUSED,
    KEPT_NOTHING,
    NO_PASS,
    UNBALANCED,
    GRAPH_BREAK,
    EAGER_FALLBACK,
    COMPILED_IN_EAGER,
    NO_SCOPE,
    COMPILE_SWALLOWED,
    COMPILE_FALLBACK,
    LEGACY_KEEP_IGNORED,
    COLLECTIVE_RECOMPUTED,
)


@dataclass(frozen=True)
class Diagnosis:
    """One reportable finding. Equal diagnoses are reported once per owner."""

    kind: str
    region: str  # the region name(s) concerned, "-" for none
    module: str  # the module (class and path) concerned
    text: str  # what happens and what to do

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown diagnosis kind {self.kind!r}; expected one of {KINDS}")

    def message(self) -> str:
        return f"sac_compile [{self.kind}] region {self.region!r} in {self.module}: {self.text}"

    def to_json(self) -> list[str]:
        return [self.kind, self.region, self.module, self.text]

    @classmethod
    def from_json(cls, data: list[str]) -> Diagnosis:
        return cls(*data)


class SacDiagnosticError(RuntimeError):
    """A diagnosis raised as an error (``strict`` mode)."""

    def __init__(self, diagnosis: Diagnosis) -> None:
        super().__init__(diagnosis.message() + " (raised because sac_compile diagnostics are strict)")
        self.diagnosis = diagnosis


class _ProcessOwner:
    """The owner of diagnoses raised outside any module."""

    def __repr__(self) -> str:
        return "<no module>"


_PROCESS = _ProcessOwner()
_lock = threading.Lock()
_reported: weakref.WeakKeyDictionary[object, set[Diagnosis]] = weakref.WeakKeyDictionary()
_strict_owners: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_strict_global = False
_strict_depth = threading.local()


def set_strict(enabled: bool) -> None:
    """Process-wide: raise :class:`SacDiagnosticError` instead of logging."""
    global _strict_global
    if not isinstance(enabled, bool):
        raise TypeError(f"set_strict takes a bool, got {enabled!r}")
    _strict_global = enabled


@contextlib.contextmanager
def strict() -> Iterator[None]:
    """Raise every diagnosis produced inside the block (on this thread)."""
    _strict_depth.n = getattr(_strict_depth, "n", 0) + 1
    try:
        yield
    finally:
        _strict_depth.n -= 1


def make_strict(module: nn.Module) -> None:
    """Raise every diagnosis whose owner is ``module`` (``SacConfig(strict=True)``)."""
    _strict_owners.add(_unwrap(module))


def _is_strict(owner: object) -> bool:
    return _strict_global or getattr(_strict_depth, "n", 0) > 0 or owner in _strict_owners


def _unwrap(module: nn.Module) -> nn.Module:
    # torch.compile(model) returns an OptimizedModule around the model
    return getattr(module, "_orig_mod", module)


def _frame_module(frame) -> nn.Module | None:
    """The module a method frame runs on (its first argument, usually ``self``)."""
    code = frame.f_code
    if code.co_argcount == 0:
        return None
    candidate = frame.f_locals.get(code.co_varnames[0])
    return _unwrap(candidate) if isinstance(candidate, nn.Module) else None


def owner_on_stack(depth: int = 1) -> object:
    """The root module: the outermost ``nn.Module`` with a frame on the stack (else the process)."""
    frame = sys._getframe(depth)
    found: object = _PROCESS
    while frame is not None:
        module = _frame_module(frame)
        if module is not None:
            found = module
        frame = frame.f_back
    return found


def innermost_module_on_stack(depth: int = 1) -> nn.Module | None:
    frame = sys._getframe(depth)
    while frame is not None:
        module = _frame_module(frame)
        if module is not None:
            return module
        frame = frame.f_back
    return None


def report(diagnosis: Diagnosis, owner: object | None = None) -> bool:
    """Log ``diagnosis`` once per owner (raise it when strict); True if it was logged now."""
    if owner is None:
        owner = owner_on_stack(2)
    elif isinstance(owner, nn.Module):
        owner = _unwrap(owner)
    if _is_strict(owner):
        raise SacDiagnosticError(diagnosis)
    with _lock:
        seen = _reported.get(owner)
        if seen is None:
            seen = _reported[owner] = set()
        if diagnosis in seen:
            return False
        seen.add(diagnosis)
    log.warning("%s", diagnosis.message())
    return True


def reported(owner: object) -> set[Diagnosis]:
    """What has been reported for ``owner`` (a root module) so far."""
    if isinstance(owner, nn.Module):
        owner = _unwrap(owner)
    with _lock:
        return set(_reported.get(owner, ()))


# --- Region names recorded per root model (for keep-unused) --------------------------

_recorded: weakref.WeakKeyDictionary[object, set[str]] = weakref.WeakKeyDictionary()


def note_regions(names, owner: object) -> None:
    """Region names that a marker recorded under ``owner`` (a tagged graph that ran, an eager scope)."""
    if isinstance(owner, nn.Module):
        owner = _unwrap(owner)
    with _lock:
        _recorded.setdefault(owner, set()).update(names)


def unrecorded(names, owner: object) -> list[str]:
    """The names in ``names`` that no marker recorded under ``owner``."""
    if isinstance(owner, nn.Module):
        owner = _unwrap(owner)
    with _lock:
        seen = _recorded.get(owner, set())
        return sorted(n for n in names if n not in seen)


def keep_unused(names: list[str], module: str) -> Diagnosis:
    plural = "s" if len(names) > 1 else ""
    return Diagnosis(
        KEEP_UNUSED,
        ",".join(names),
        module,
        f"keep names region{plural} {', '.join(map(repr, names))} but no marker with that name ever "
        "ran, so nothing is kept for it. Check the spelling against the region(...) markers and "
        "declare_regions names, or drop it from keep.",
    )


def describe_module(module: nn.Module, path: str | None = None) -> str:
    """``Block`` or ``Block (layers.*)`` (the user's class, not the seam's generated one)."""
    from .records import user_class_name

    cls = user_class_name(type(module))
    return f"{cls} ({path})" if path else cls


# --- Compiled graphs -------------------------------------------------------------


def graph_diagnoses(
    graph_records: list,
    *,
    saved_names: list[str] | None,
    with_fallbacks: list[tuple[str, str, str]],
    layer_paths: list[str],
    module: str,
    swallowed: list[str] = (),
    backend_name: str = "",
    grad_enabled: bool = True,
) -> list[Diagnosis]:
    """What one compiled graph's tagging records say is wrong (kinds 2, 4 and 5)."""
    from .records import describe_modules

    found: list[Diagnosis] = []

    def add(d: Diagnosis) -> None:
        if d not in found:
            found.append(d)

    for rec in graph_records:

        def where(name: str, rec=rec) -> str:
            return describe_modules(rec.region_modules[name]) if name in rec.region_modules else module

        for hop, name in rec.hop_markers:
            if hop != "invoke_subgraph":
                add(
                    Diagnosis(
                        KEPT_NOTHING,
                        name,
                        where(name),
                        f"region markers inside a {hop} body are not honoured (the body is not partitioned "
                        "by region); they were removed. Move the region(...) around the call instead.",
                    )
                )
        # a region split across graphs is judged by its graph-break/unbalanced report instead
        split = set(rec.starts_inside) | {name for name, _ in rec.unbalanced}
        if rec.is_training:
            for name, stats in sorted(rec.regions.items()):
                if not stats.kept or name in split or any(name == n for _, n in rec.hop_markers):
                    continue
                if stats.saved_nodes == 0:
                    why = (
                        "it is kept, but the region policy saves none of the ops it ran: no costly op "
                        "(matmul, convolution, attention, custom kernel, collective), only cheap ops, views "
                        "or waits, which are recomputed from their inputs"
                    )
                elif saved_names is not None and not any(
                    name in rec.node_regions.get(v, ()) for v in saved_names
                ):
                    why = "it is kept, but the backward reads none of the values computed in it"
                else:
                    continue
                add(
                    Diagnosis(
                        KEPT_NOTHING,
                        name,
                        where(name),
                        f"{why}, so keeping it saves nothing. Mark the op whose output the backward needs "
                        "(e.g. the matmul or attention core), or drop the name from keep.",
                    )
                )
        # A graph without a backward compiled while gradients were on (a graph break
        # left it only a marker, or nothing in it needs grad) still splits the region;
        # under no_grad / inference mode markers mean nothing and are not reported.
        unbalanced = rec.unbalanced if (rec.is_training or grad_enabled) else []
        split_decorated = sorted(
            set(rec.starts_inside)
            | {n for n, how in unbalanced if how == "enter without exit" and n in rec.decorated_enters}
        )
        # a decorated or declared region split by a graph break: one graph-break report, not unbalanced
        unbalanced = [(n, how) for n, how in unbalanced if n not in split_decorated]
        for name, how in sorted(set(unbalanced)):
            add(
                Diagnosis(
                    UNBALANCED,
                    name,
                    where(name),
                    f"{how} within one graph: "
                    + (
                        "the region stays open to the graph's end"
                        if how == "enter without exit"
                        else "the region was open from the graph's start"
                    )
                    + ". Usually a graph break split the region (see TORCH_LOGS=graph_breaks) or an "
                    "exception skipped the exit; use region(...) as a with-block or decorator.",
                )
            )
        for name in split_decorated:
            add(
                Diagnosis(
                    GRAPH_BREAK,
                    name,
                    where(name),
                    "a graph break inside the region (a decorated function or a declared module) split it "
                    "across graphs; each part is still "
                    "kept in its own graph, but the boundaries between graphs are saved and the graphs "
                    "are partitioned separately. Remove the graph break (TORCH_LOGS=graph_breaks) to get one graph.",
                )
            )
        if rec.whole_graph_scope and len(layer_paths) >= 2:
            add(
                Diagnosis(
                    NO_SCOPE,
                    "-",
                    module,
                    f"one graph holds {len(layer_paths)} layers ({_compact(layer_paths)}) and no checkpoint "
                    "scope, so the whole graph is one scope: the backward recomputes the entire forward at "
                    "once. Wrap each layer with apply_selective_checkpointing (it emits one scope per layer "
                    "under torch.compile), or compile each layer on its own.",
                )
            )
    for where in sorted(set(swallowed)):
        add(compile_swallowed(where, backend_name))
    for _kind, name, site in sorted(set(with_fallbacks)):
        add(
            Diagnosis(
                EAGER_FALLBACK,
                name,
                module,
                f"a graph break inside `with region({name!r})` at {site} made Dynamo run that whole frame "
                "eagerly: its ops are neither compiled nor checkpointed. Use @region(...) as a decorator on "
                "the code with the graph break (the caller then keeps compiling), or remove the break.",
            )
        )
    return found


def _compact(paths: list[str]) -> str:
    return ", ".join(paths) if len(paths) <= 3 else f"{paths[0]}, {paths[1]}, ... {paths[-1]}"


class GraphReporter:
    """Reports a compiled graph's diagnoses when the graph runs, once per root module.

    Called at the start of every call of a compiled graph that has something to
    report; after a module has been checked it costs one WeakSet lookup.
    """

    def __init__(
        self, diagnoses: list[Diagnosis], keep_names: set[str], where: str, regions: set[str] = frozenset()
    ) -> None:
        self.diagnoses = tuple(diagnoses)
        self.keep_names = tuple(sorted(keep_names))
        self.regions = tuple(sorted(regions))  # what the graph records when it runs
        self.where = where
        self._calls: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()
        self._done: weakref.WeakSet[object] = weakref.WeakSet()

    def needed(self) -> bool:
        return bool(self.diagnoses or self.keep_names or self.regions)

    def on_call(self) -> None:
        inner = innermost_module_on_stack(2) or _PROCESS
        if inner in self._done:
            return
        owner = owner_on_stack(2)
        # regions are recorded per root model: a graph records them for each model it runs in
        note_regions(self.regions, owner)
        calls = self._calls.get(owner, 0) + 1
        if calls == 1:
            for d in self.diagnoses:
                report(d, owner)  # may raise (strict): then this call does not count
        self._calls[owner] = calls
        if self.keep_names:
            if calls < 2:
                return  # judged on a repeat, once every graph of a step has run
            names = unrecorded(self.keep_names, owner)
            if names:
                report(keep_unused(names, self.where), owner)
        self._done.add(inner)


def with_reporter(compiled, reporter: GraphReporter):
    """Wrap a compiled graph so that it reports when it runs (only if there is anything)."""
    if not reporter.needed():
        return compiled

    def run(*args, **kwargs):
        reporter.on_call()
        return compiled(*args, **kwargs)

    if getattr(compiled, "_boxed_call", False):
        run._boxed_call = True  # type: ignore[attr-defined]
    run.sac_reporter = reporter  # type: ignore[attr-defined]
    return run


# --- Trace time: markers compiled by a backend without the pass ------------------------
#
# Two sightings of the same marker make the verdict, so that nothing is guessed:
# Dynamo traces it first (the fake impl runs with Dynamo's translator current: we
# note the region and the module around it), then, if and only if the graph is
# really compiled by an AOTAutograd-based backend (Inductor, aot_eager, ...),
# AOTAutograd traces it again inside the backend call. If no sac backend is
# compiling at that moment, the markers reached a compile that drops them. A
# Dynamo trace that is abandoned (a restart after a graph break) never gets the
# second sighting, and a custom backend that hands the graph to a sac backend is
# compiling through ours. Backends that do not use AOTAutograd ("eager", custom
# ones) cannot checkpoint anything and are not reported.

_trace_lock = threading.Lock()
# per Dynamo trace (its OutputGraph; an abandoned attempt's is dropped with it):
# {(kind, region): where} sighted by Dynamo, and the keys already reported
# (OutputGraph defines __eq__ without __hash__: keyed by id, dropped by a finalizer)
_traces: dict[int, tuple[dict[tuple[str, str], str], set[tuple[str, str]]]] = {}


def _trace_state(trace: object) -> tuple[dict[tuple[str, str], str], set[tuple[str, str]]]:
    key = id(trace)
    state = _traces.get(key)
    if state is None:
        state = _traces[key] = ({}, set())
        weakref.finalize(trace, _traces.pop, key, None)
    return state


def marker_traced(kind: str, payload: tuple) -> None:
    """Called by the markers' fake implementations (Dynamo and AOTAutograd tracing).

    Never breaks a compile: only a strict-mode diagnosis propagates.
    """
    try:
        _marker_traced(kind, payload)
    except SacDiagnosticError:
        raise
    except Exception as e:  # a diagnostics bug must not fail the user's compile
        log.debug("sac_compile: trace-time diagnostics failed: %r", e)


def _marker_traced(kind: str, payload: tuple) -> None:
    from . import _torch_internals as ti
    from .backend import compiling_unit

    tx = ti.current_dynamo_tx()
    if tx is None:
        return
    trace = tx.output
    region_name = str(payload[0]) if kind.startswith("region") else f"<scope keep={payload[1]!r}>"
    cid = ti.current_compile_id()
    backend = _backend_name(ti.unwrap_dynamo_backend(tx.output.compiler_fn))
    if not ti.inside_backend_call():
        # Dynamo's sighting: remember where the marker is
        module_stack = list(getattr(tx, "nn_module_stack", {}).values())
        found = []
        if kind == "scope_enter" and payload[0] == 1 and module_stack:
            found.append(((COMPILE_SWALLOWED, "-"), _where_in_trace(tx, module_stack)))
        if kind.startswith("region"):
            found.append(((NO_PASS, region_name), _where_in_trace(tx, module_stack)))
        for key, where in found:
            _remember(trace, key, where)
            _watch(cid, key, where, backend)
        return
    if compiling_unit() is not None:
        return  # a sac backend is compiling this graph
    # AOTAutograd's sighting inside a backend that is not ours
    with _trace_lock:
        seen_now, done = _trace_state(trace)
        seen = dict(seen_now)
        todo = [(k, w) for k, w in seen.items() if k not in done and (k[0] != NO_PASS or k[1] == region_name)]
        done.update(k for k, _ in todo)
        if cid in _watched:
            _watched[cid]["reported"].update(k for k, _ in todo)
    owner = owner_on_stack(3)
    for key, where in todo:
        report(_trace_diagnosis(key, where, backend), owner)


def _trace_diagnosis(key: tuple[str, str], where: str, backend: str, note: str = "") -> Diagnosis:
    kind, region = key
    if kind == COMPILE_SWALLOWED:
        return compile_swallowed(where, backend)
    return Diagnosis(
        NO_PASS,
        region,
        where,
        f"its markers were compiled by torch.compile with backend {backend}, which does not run "
        "sac_compile's tagging pass, so the region keeps nothing (and no checkpointing happens "
        f"in the graph){note}. Compile with backend=sac_compile.sac_backend or make_sac_backend(keep=...).",
    )


# A warm AOTAutograd cache serves a foreign backend's graph without tracing it again,
# so AOTAutograd's sighting never comes. Per Dynamo compile (compile id), the sightings
# are kept until the compile ends; if no sac backend compiled in it and the
# AOTAutograd cache served a graph meanwhile, they are reported then (logged: Dynamo
# runs end-of-compile callbacks under its own lock, where raising is unsafe).
_watched: dict[str | None, dict] = {}


def _watch(cid: str | None, key: tuple[str, str], where: str, backend: str) -> None:
    from . import _torch_internals as ti

    if cid is None:
        return
    ti.on_dynamo_compile_end(_on_compile_end)
    with _trace_lock:
        state = _watched.get(cid)
        if state is None:
            state = _watched[cid] = {
                "hits": ti.aot_cache_hits(),
                "sightings": {},
                "reported": set(),
                "sac": False,
                "backend": backend,
            }
        state["sightings"].setdefault(key, where)


def note_sac_backend() -> None:
    """A sac backend is compiling in the current Dynamo compile."""
    from . import _torch_internals as ti

    cid = ti.current_compile_id()
    with _trace_lock:
        if cid in _watched:
            _watched[cid]["sac"] = True


def _on_compile_end(cid: str) -> None:
    from . import _torch_internals as ti

    with _trace_lock:
        state = _watched.pop(cid, None)
    if state is None or state["sac"] or ti.aot_cache_hits() <= state["hits"]:
        return
    owner = owner_on_stack(2)
    for key, where in state["sightings"].items():
        if key in state["reported"]:
            continue
        d = _trace_diagnosis(key, where, state["backend"], " (the graph was served from the compile cache)")
        try:
            report(d, owner)
        except SacDiagnosticError:
            log.error("%s", d.message())


def _where_in_trace(tx, module_stack: list) -> str:
    from .records import describe_stack_entry

    if module_stack:
        return describe_stack_entry(*module_stack[-1])
    code = tx.f_code
    if code.co_argcount > 0:
        obj = tx.f_locals.get(code.co_varnames[0])
        if isinstance(obj, nn.Module):
            return describe_module(obj)
    return f"{code.co_name}()"


def _remember(trace: object, key: tuple[str, str], where: str) -> None:
    with _trace_lock:
        _trace_state(trace)[0].setdefault(key, where)


def compile_swallowed(where: str, backend_name: str) -> Diagnosis:
    return Diagnosis(
        COMPILE_SWALLOWED,
        "-",
        where,
        "this layer was wrapped with apply_selective_checkpointing(..., compile=True), but an outer "
        f"torch.compile (backend {backend_name}) traced it as part of a larger graph: the layer's own "
        "compile and backend never run. Its keep set still applies as a checkpoint scope if the outer "
        "backend is a sac_compile backend. Drop compile=True, or do not compile the enclosing model.",
    )


def _backend_name(backend: object) -> str:
    from .backend import SacBackend

    if isinstance(backend, SacBackend):
        return repr(backend)
    name = getattr(backend, "compiler_name", None) or getattr(backend, "__name__", None)
    return repr(name or type(backend).__name__)
