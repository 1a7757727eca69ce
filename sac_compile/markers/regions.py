"""``region(name)``: the user-facing marker, as a context manager and a decorator.

Both forms emit ``sac_compile::region_enter`` / ``region_exit`` (see
:mod:`sac_compile.markers.ops`) around the marked code, in program order.

Graph breaks. Dynamo cannot resume a graph break inside a user-defined context
manager: the frame holding the ``with region(...)`` block then runs eagerly
(``__enter__`` and ``__exit__`` are compiled as tiny graphs of their own, which
the backend recognises and records, see :func:`sac_compile.markers.context.with_block_fallbacks`). The
decorator therefore does not use a ``with`` block: under compile its wrapper is
straight-line code (enter; call; exit), so a graph break inside the decorated
function bubbles up to the wrapper's call site and the caller keeps compiling.
The wrapper frame then runs on its own, and the decorated function's graphs are
compiled while ``_region_wrapper`` frames are on the Python stack. The seam's call
(a wrapped layer's scope) and a declared module's call (its hooks' regions) work the
same way: :func:`sac_compile.markers.context.enclosing_context` reads those frames, so the graphs compiled below
them start inside their scopes and regions. (Dynamo does not guard on this context:
a function whose body is compiled as separate frames keeps the context of its first
compile.)
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .._compat import frames
from .._compat.jit import script_drop
from ..keep import format_keep, normalize_keep, validate_region_name
from ..records import SEAM_PREFIX
from . import ops

__all__ = [
    "DECLARED_ATTR",
    "LEGACY_ATTR",
    "SEAM_CALL_PREFIX",
    "WRAPPER_NAME",
    "checkpoint_scope",
    "declared_names",
    "exporting",
    "region",
    "seam_scope_args",
]

_F = TypeVar("_F", bound=Callable[..., Any])
#: The name of the decorator's wrapper function (see _make_wrapper): the context reader
#: finds its frames on the stack, the tagging pass finds it in recorded stack traces.
WRAPPER_NAME = "_region_wrapper"


# Note [markers export as nothing]
# Checkpointing is a training concern; a program exported for inference (torch.export,
# torch.onnx.export, which exports through it, torch.jit.trace, the legacy ONNX path) has
# no use for it. So while one of them traces, no marker op is emitted (region, the
# decorator, declared modules' hooks) and a wrapped layer runs its plain call: the program
# holds no sac_compile::* node and loads where sac_compile is not installed. Dynamo reads
# torch.compiler.is_exporting() as the live flag and torch.jit.is_tracing() as False, so
# the check costs nothing in compiled code.


def exporting() -> bool:
    """Whether a program is being exported or traced for inference (see the Note above)."""
    return torch.compiler.is_exporting() or torch.jit.is_tracing()  # type: ignore[attr-defined,no-untyped-call,unused-ignore]  # (not scripted)


class region:
    """Mark the forward ops run inside as the region ``name``.

    Use as ``with region("attn"): ...`` or as a decorator ``@region("attn")`` on a
    function or a ``forward`` method. Regions nest and overlap; the same name may
    be open more than once (entries are counted). Outside any checkpoint scope a
    marker is a no-op, not even dispatched unless something records ops (Note
    [markers unseen in plain eager]); in compiled code the markers are erased by the tagging
    pass and cost nothing at run time. Exported and traced programs hold no
    marker (Note [markers export as nothing]); ``torch.jit.script`` compiles a
    ``with region(...)`` block to nothing.
    """

    # TorchScript compiles this class when a scripted forward holds a ``with region(...)``
    # block: __init__, __enter__ and __exit__ are written so that it can (the
    # is_scripting() branches are resolved at compile time), the rest is dropped. Spelled
    # torch.jit.is_scripting: a `# type:` comment breaks TorchScript's parse, and the function
    # imported from torch._jit_internal changes what Dynamo makes of a graph break in the block.
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        if not torch.jit.is_scripting():
            name = validate_region_name(name)
        self.name = name

    @script_drop
    def __repr__(self) -> str:
        return f"region({self.name!r})"

    def __enter__(self) -> region:
        if not torch.jit.is_scripting():
            if not exporting():
                ops.enter_region(self.name)
        return self

    def __exit__(self, exc_type: Any = None, exc: Any = None, tb: Any = None) -> None:
        if not torch.jit.is_scripting():
            if not exporting():
                ops.exit_region(self.name)

    @script_drop
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
        if not exporting():
            torch.ops.sac_compile.scope_enter(self.scope_id, self.keep_text)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not exporting():
            torch.ops.sac_compile.scope_exit(self.scope_id, self.keep_text)


# Note [straight-line under compile]
# Dynamo cannot resume a graph break inside a try/with block of a frame it compiles: the
# whole frame then runs eagerly. So code that brackets a call with markers while Dynamo
# traces it (the decorator's wrapper here, the seam's call of a wrapped layer) emits
# enter; call; exit as straight-line code. A graph break inside the call then splits the
# caller around it, the caller keeps compiling, and the graphs compiled below the waiting
# wrapper frame find its region or scope on the Python stack (markers.context).


def wrap_in_region(name: str, fn: _F) -> _F:
    """``fn`` run as region ``name``, as ``@region(name)`` makes it (declarations by path of
    methods of plain objects use it: sac_compile/declare.py)."""
    return _make_wrapper(name, fn)


def _make_wrapper(name: str, fn: _F) -> _F:
    # Keep the name `_region_wrapper` (WRAPPER_NAME): markers.context finds these frames
    # on the stack by it, and the tagging pass finds it in Dynamo's recorded stack traces.
    @functools.wraps(fn)
    def _region_wrapper(*args: Any, **kwargs: Any) -> Any:
        if exporting():  # See Note [markers export as nothing].
            return fn(*args, **kwargs)
        if torch.compiler.is_compiling():
            # See Note [straight-line under compile].
            torch.ops.sac_compile.region_enter(name)
            out = fn(*args, **kwargs)
            torch.ops.sac_compile.region_exit(name)
            return out
        return ops.call_region(name, fn, args, kwargs)

    _region_wrapper.__sac_region__ = name  # type: ignore[attr-defined]
    return _region_wrapper  # type: ignore[return-value]


#: Set this attribute to True on a module whose forward relies on grad-mode tricks
#: (state that must see the original forward run exactly once, reentrantly).
LEGACY_ATTR = "sac_legacy_checkpoint"

# The seam's generated call functions are named _sac_call_impl_<Class> (sac_compile/seam.py).
SEAM_CALL_PREFIX = frames.SEAM_CALL_PREFIX
SEAM_CLASS_PREFIX = SEAM_PREFIX  # ... and its generated classes SelectiveCheckpointed<Class>
SEAM_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "seam.py")

#: Module attribute holding the regions declared on a module (sac_compile.declare writes
#: it: {region name: (pre-hook handle, post-hook handle)}); read here for the context.
DECLARED_ATTR = "_sac_declared"


def declared_names(module: torch.nn.Module) -> tuple[str, ...]:
    """The region names declared on ``module`` itself (not its children)."""
    return tuple(module.__dict__.get(DECLARED_ATTR, ()))


def seam_scope_args(module: torch.nn.Module) -> tuple[int, str]:
    """The ``(scope_id, scope text)`` a wrapped module's scope markers carry.

    Scope id 1 says that the layer asked for its own compile (``compile=True``; an
    outer compile swallowing it is reported), 0 otherwise; constant per wrap site,
    so Dynamo does not specialise on a counter. A legacy (reentrant) layer keeps nothing.
    """
    config: Any = module._sac_seam  # the seam's SeamConfig (sac_compile.seam)
    legacy = getattr(module, LEGACY_ATTR, False) is True
    return (0 if config.compile_options is None else 1), ("" if legacy else config.actions.text)
