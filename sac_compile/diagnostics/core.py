"""The reporting mechanism: what a diagnosis is, who owns it, deduplication, strict mode,
and the region names each root model has recorded.

Deduplication is on the whole diagnosis (kind, region, module, text) per *owner*: the
root module, i.e. the outermost ``nn.Module`` whose call is on the Python stack when
the diagnosis is raised (an ``OptimizedModule`` counts as the module it wraps), held
weakly. So a repeated step, a recompile or N identical layers report once, and a
second model reports again. Code outside any module shares one process-wide owner.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch.nn as nn

from .._compat import frames
from .._compat.dynamo import unwrap_compiled
from ..records import user_class_name

__all__ = [
    "KINDS",
    "Diagnosis",
    "SacDiagnosticError",
    "describe_module",
    "make_strict",
    "note_regions",
    "owner",
    "report",
    "reported",
    "set_strict",
    "strict",
    "unrecorded",
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
GRAPH_REUSED = "graph-reused"
UNMARKED = "unmarked"
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
    GRAPH_REUSED,
    UNMARKED,
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


PROCESS = _ProcessOwner()
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
    _strict_owners.add(unwrap_compiled(module))


def _is_strict(owner: object) -> bool:
    return _strict_global or getattr(_strict_depth, "n", 0) > 0 or owner in _strict_owners


def _as_owner(owner: object) -> object:
    return unwrap_compiled(owner) if isinstance(owner, nn.Module) else owner


def owner() -> object:
    """The root module: the outermost ``nn.Module`` with a frame on the stack (else the process)."""
    found = frames.outermost_module()
    return PROCESS if found is None else found


def report(diagnosis: Diagnosis, owner_: object | None = None) -> bool:
    """Log ``diagnosis`` once per owner (raise it when strict); True if it was logged now."""
    key = owner() if owner_ is None else _as_owner(owner_)
    if _is_strict(key):
        raise SacDiagnosticError(diagnosis)
    with _lock:
        seen = _reported.setdefault(key, set())
        if diagnosis in seen:
            return False
        seen.add(diagnosis)
    log.warning("%s", diagnosis.message())
    return True


def reported(owner_: object) -> set[Diagnosis]:
    """What has been reported for ``owner_`` (a root module) so far."""
    with _lock:
        return set(_reported.get(_as_owner(owner_), ()))


def describe_module(module: nn.Module, path: str | None = None) -> str:
    """``Block`` or ``Block (layers.*)`` (the user's class, not the seam's generated one)."""
    cls = user_class_name(type(module))
    return f"{cls} ({path})" if path else cls


# --- Region names recorded per root model (for keep-unused) --------------------------

_recorded: weakref.WeakKeyDictionary[object, set[str]] = weakref.WeakKeyDictionary()
# the same names by the module whose graph or eager scope recorded them: a module that ran
# under one root (a DDP wrapper) and is later called under another (``ddp.module``) keeps
# counting for the models that contain it
_recorded_by_module: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


def note_regions(names: Iterable[str], owner_: object, module: nn.Module | None = None) -> None:
    """Region names that a marker recorded under ``owner_`` (a tagged graph that ran, an
    eager scope), in ``module`` (the layer or graph's module, if any)."""
    names = set(names)
    with _lock:
        _recorded.setdefault(_as_owner(owner_), set()).update(names)
        if module is not None:
            _recorded_by_module.setdefault(module, set()).update(names)


def unrecorded(names: Iterable[str], owner_: object) -> list[str]:
    """The names in ``names`` that no marker recorded under ``owner_``, nor in any module
    that ``owner_`` contains."""
    root = _as_owner(owner_)
    with _lock:
        seen = set(_recorded.get(root, ()))
    missing = sorted(n for n in names if n not in seen)
    if missing and isinstance(root, nn.Module):
        with _lock:
            for m in root.modules():
                seen |= _recorded_by_module.get(m, set())
        missing = [n for n in missing if n not in seen]
    return missing
