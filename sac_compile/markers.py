"""``region(name)``: the user-facing marker, as a context manager and a decorator.

Both forms emit ``sac_compile::region_enter`` / ``region_exit`` (see
:mod:`sac_compile.ops`) around the marked code, in program order.

Graph breaks. Dynamo cannot resume a graph break inside a user-defined context
manager: the frame holding the ``with region(...)`` block then runs eagerly
(``__enter__`` and ``__exit__`` are compiled as tiny graphs of their own, which
the backend recognises and records, see :func:`with_block_fallbacks`). The
decorator therefore does not use a ``with`` block: under compile its wrapper is
straight-line code (enter; call; exit), so a graph break inside the decorated
function bubbles up to the wrapper's call site and the caller keeps compiling.
The wrapper frame then runs on its own, and the decorated function's graphs are
compiled while ``_region_wrapper`` frames are on the Python stack. The seam's call
(a wrapped layer's scope) and a declared module's call (its hooks' regions) work the
same way: :func:`enclosing_context` reads those frames, so the graphs compiled below
them start inside their scopes and regions. (Dynamo does not guard on this context:
a function whose body is compiled as separate frames keeps the context of its first
compile.)
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from . import _torch_internals as ti
from . import ops  # noqa: F401  (registers the marker ops)
from .declare import declared_names
from .keep import format_keep, normalize_keep, validate_region_name
from .records import SEAM_PREFIX

__all__ = [
    "NO_CONTEXT",
    "Enclosing",
    "LEGACY_ATTR",
    "checkpoint_scope",
    "enclosing_context",
    "region",
    "seam_scope_args",
]

_F = TypeVar("_F", bound=Callable[..., Any])
_WRAPPER_NAME = "_region_wrapper"


class region:
    """Mark the forward ops run inside as the region ``name``.

    Use as ``with region("attn"): ...`` or as a decorator ``@region("attn")`` on a
    function or a ``forward`` method. Regions nest and overlap; the same name may
    be open more than once (entries are counted). Outside any checkpoint scope a
    marker is a no-op; in compiled code the markers are erased by the tagging
    pass and cost nothing at run time.
    """

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = validate_region_name(name)

    def __repr__(self) -> str:
        return f"region({self.name!r})"

    def __enter__(self) -> region:
        torch.ops.sac_compile.region_enter(self.name)
        return self

    def __exit__(self, *exc_info: object) -> None:
        torch.ops.sac_compile.region_exit(self.name)

    def __call__(self, fn: _F) -> _F:
        if not callable(fn):
            raise TypeError(
                f"region({self.name!r}) decorates a function or a forward method, "
                f"got {type(fn).__name__} {fn!r}"
            )
        if inspect.isclass(fn):
            raise TypeError(
                f"region({self.name!r}) cannot decorate the class {fn.__qualname__}; "
                "decorate its forward method, or use sac_compile.declare_regions"
            )
        return _make_wrapper(self.name, fn)


class checkpoint_scope:
    """Emit the scope markers for one checkpoint scope with its own keep set.

    Used by the seam when an outer ``torch.compile`` traces a wrapped module:
    instead of an eager checkpoint, the module's forward is bracketed by
    ``scope_enter`` / ``scope_exit`` carrying ``scope_id`` (a constant per wrap
    site, so Dynamo does not specialise on a counter) and the keep set.
    """

    __slots__ = ("keep_text", "scope_id")

    def __init__(self, scope_id: int, keep: object) -> None:
        if not isinstance(scope_id, int) or isinstance(scope_id, bool) or scope_id < 0:
            raise TypeError(f"scope_id must be a non-negative int, got {scope_id!r}")
        self.scope_id = scope_id
        self.keep_text = format_keep(normalize_keep(keep))

    def __enter__(self) -> checkpoint_scope:
        torch.ops.sac_compile.scope_enter(self.scope_id, self.keep_text)
        return self

    def __exit__(self, *exc_info: object) -> None:
        torch.ops.sac_compile.scope_exit(self.scope_id, self.keep_text)


def _make_wrapper(name: str, fn: _F) -> _F:
    # Keep the name `_region_wrapper`: enclosing_context() finds these
    # frames on the stack by it.
    @functools.wraps(fn)
    def _region_wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            # Straight-line on purpose: a graph break inside `fn` must not sit in
            # a try/with block, or Dynamo falls back for the whole frame.
            torch.ops.sac_compile.region_enter(name)
            out = fn(*args, **kwargs)
            torch.ops.sac_compile.region_exit(name)
            return out
        torch.ops.sac_compile.region_enter(name)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.ops.sac_compile.region_exit(name)

    _region_wrapper.__sac_region__ = name  # type: ignore[attr-defined]
    return _region_wrapper  # type: ignore[return-value]


#: Set this attribute to True on a module whose forward relies on grad-mode tricks
#: (state that must see the original forward run exactly once, reentrantly).
LEGACY_ATTR = "sac_legacy_checkpoint"

# The seam's generated call functions are named _sac_call_impl_<Class> (sac_compile/seam.py).
SEAM_CALL_PREFIX = "_sac_call_impl_"
SEAM_CLASS_PREFIX = SEAM_PREFIX  # ... and its generated classes SelectiveCheckpointed<Class>
_SEAM_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seam.py")


def seam_scope_args(module: torch.nn.Module) -> tuple[int, str]:
    """The ``(scope_id, scope text)`` a wrapped module's scope markers carry.

    Scope id 1 says that the layer asked for its own compile (``compile=True``; an
    outer compile swallowing it is reported), 0 otherwise; constant per wrap site,
    so Dynamo does not specialise on a counter. A legacy (reentrant) layer keeps nothing.
    """
    config = module._sac_seam
    legacy = getattr(module, LEGACY_ATTR, False) is True
    return (0 if config.compile_options is None else 1), ("" if legacy else config.scope_text)


@dataclass(frozen=True)
class Enclosing:
    """What a graph Dynamo compiles right now starts inside of, read from the Python stack.

    When a graph break splits a module call, Dynamo compiles the frames below it one by
    one while the callers' frames wait on the stack: the wrapped layer's seam call
    (its checkpoint scope), a declared module's call (its forward hooks opened its regions)
    and a decorated function's wrapper (its region). The frame being compiled is not on the
    stack yet, so these are exactly the scopes and regions open at the graph's start.
    """

    #: regions open at the start, outermost first (decorated and declared)
    regions: tuple[str, ...] = ()
    #: the decorated ones among them (for the graph-break report)
    decorated: tuple[str, ...] = ()
    #: checkpoint scopes of wrapped layers, outermost first: (scope id, scope text)
    scopes: tuple[tuple[int, str], ...] = ()
    #: the compiled callable contains wrapped layers: code outside every scope is not
    #: the user's checkpoint unit and stays untagged
    wrapped_inside: bool = False
    #: (region, module path, class name) of each declared region among ``regions``, for
    #: diagnostics (the path is relative to the compiled callable)
    region_owners: tuple[tuple[str, str, str], ...] = ()


#: A graph compiled on its own (no enclosing scope, region or wrapped layers).
NO_CONTEXT = Enclosing()


def enclosing_context(compiled_self: object = None) -> Enclosing:
    """The :class:`Enclosing` context of the frame Dynamo is compiling (called by the backend).

    ``compiled_self``: the ``self`` of the frame being compiled, if any (it is not on the
    stack). The compiled callable is read from ``torch.compile``'s entry frame: a module,
    a module's method, or a function whose arguments include modules; failing those, the
    outermost module called between that entry and the compiled frame.
    """
    regions: list[str] = []
    owners: list[tuple[str, torch.nn.Module]] = []
    decorated: list[str] = []
    scopes: list[tuple[int, str]] = []
    roots: list[torch.nn.Module] = []
    if isinstance(compiled_self, torch.nn.Module):
        roots.append(compiled_self)
    # A resume function of the seam's call is called by that (transformed) seam frame: it
    # holds the scope_enter or the scope_exit itself, so the markers say whether it is inside.
    own_seam_frame = ti.compiling_resume_of(SEAM_CALL_PREFIX)
    last_module = None
    in_compile = True  # frames above torch.compile's entry belong to this compile
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == _WRAPPER_NAME and code.co_filename == __file__:
            name = frame.f_locals.get("name")
            if isinstance(name, str):
                regions.append(name)
                decorated.append(name)
        elif code.co_name.startswith(SEAM_CALL_PREFIX) and code.co_filename == _SEAM_FILE:
            module = frame.f_locals.get("self")
            if own_seam_frame:
                own_seam_frame = False
            elif getattr(module, "_sac_seam", None) is not None:
                scopes.append(seam_scope_args(module))
        elif ti.is_compile_entry(frame) and in_compile:
            in_compile = False
            roots.extend(ti.compiled_modules(frame))
        else:
            module = ti.module_call_self(frame)
            if module is not None and module is not last_module:  # _call_impl and its inner
                last_module = module
                regions.extend(declared_names(module))
                owners.extend((name, module) for name in declared_names(module))
                if in_compile:
                    roots.append(module)
        frame = frame.f_back
    # the compiled callable (a module, a module's method, or a function taking modules),
    # else the outermost module called inside the compile
    root = getattr(roots[-1], "_orig_mod", roots[-1]) if roots else None
    wrapped_inside = root is not None and any(
        getattr(m, "_sac_seam", None) is not None for m in root.modules()
    )
    paths = {id(m): p for p, m in root.named_modules()} if root is not None and owners else {}
    region_owners = tuple(
        sorted(
            {
                (name, paths.get(id(m), ""), type(m).__name__.removeprefix(SEAM_CLASS_PREFIX))
                for name, m in owners
            }
        )
    )
    return Enclosing(
        tuple(reversed(regions)),
        tuple(reversed(decorated)),
        tuple(reversed(scopes)),
        wrapped_inside,
        region_owners,
    )


def with_block_fallbacks(gm: torch.fx.GraphModule) -> list[tuple[str, str, str]]:
    """Markers in ``gm`` that Dynamo compiled as ``region.__enter__``/``__exit__``'s own frame.

    That happens when the frame around a ``with region(...)`` block fell back to
    eager (a graph break inside the block): the region's ops then ran neither
    compiled nor checkpointed. Returns ``(kind, name, where)`` with ``where`` the
    user's ``with`` statement when it can be found on the stack.
    """
    found = []
    for node in gm.graph.nodes:
        kind = ops.marker_kind(node)
        if kind not in ("region_enter", "region_exit"):
            continue
        trace = node.meta.get("stack_trace") or ""
        frames = [ln for ln in trace.splitlines() if ln.strip().startswith("File ")]
        if frames and __file__ in frames[0] and ("__enter__" in frames[0] or "__exit__" in frames[0]):
            found.append((kind, str(node.args[0]), _user_call_site()))
    return found


def _user_call_site() -> str:
    """The user frame that ran the ``with`` statement: the first frame outside torch and
    sac_compile *below* Dynamo's frames (a custom backend above them is skipped)."""
    frame = sys._getframe(1)
    seen_torch = False
    while frame is not None:
        fname = frame.f_code.co_filename
        in_torch = f"{os.sep}torch{os.sep}" in fname
        seen_torch = seen_torch or in_torch
        if seen_torch and not in_torch and f"{os.sep}sac_compile{os.sep}" not in fname:
            return f"{fname}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "<unknown>"
