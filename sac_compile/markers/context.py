"""What a graph Dynamo compiles right now starts inside of, read from the Python stack.

When a graph break splits a module call, Dynamo compiles the frames below it one by
one while the callers' frames wait on the stack: the wrapped layer's seam call (its
checkpoint scope), a declared module's call (its forward hooks opened its regions) and
a decorated function's wrapper (its region). Dynamo does not guard on this context: a
function whose body is compiled as separate frames keeps the context of its first
compile, also when it later runs for another module of the same class in other regions;
:func:`running_regions` reads the context again when the graph runs, so that the
diagnostics can report that (``graph-reused``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._compat import dynamo, frames
from .._compat import transformers as transformers_layers
from ..marker_walk import MarkerKind
from . import ops
from . import regions as _regions
from .regions import (
    SEAM_CALL_PREFIX,
    SEAM_CLASS_PREFIX,
    SEAM_FILE,
    WRAPPER_NAME,
    declared_names,
    seam_scope_args,
)

__all__ = ["NO_CONTEXT", "Enclosing", "enclosing_context", "running_regions", "with_block_fallbacks"]


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
    #: the compiled callable contains wrapped layers (or layers transformers' own switch
    #: checkpoints): code outside every scope is not the user's checkpoint unit and stays
    #: untagged
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
    own_seam_frame = dynamo.compiling_resume_of(SEAM_CALL_PREFIX)
    last_module = None
    in_compile = True  # frames above torch.compile's entry belong to this compile
    for frame in frames.frames():
        name = frames.own_frame_local(frame, WRAPPER_NAME, _regions.__file__, "name")
        seam_self = frames.own_frame_local(frame, SEAM_CALL_PREFIX, SEAM_FILE, "self", prefix=True)
        if isinstance(name, str):
            regions.append(name)
            decorated.append(name)
        elif seam_self is not None:
            if own_seam_frame:
                own_seam_frame = False
            elif getattr(seam_self, "_sac_seam", None) is not None:
                scopes.append(seam_scope_args(seam_self))
        elif in_compile and frames.is_compile_entry(frame):
            in_compile = False
            roots.extend(frames.compiled_modules(frame))
        else:
            module = frames.module_call_self(frame)
            if module is not None and module is not last_module:  # _call_impl and its inner
                last_module = module
                regions.extend(declared_names(module))
                owners.extend((name, module) for name in declared_names(module))
                if in_compile:
                    roots.append(module)
    # the compiled callable (a module, a module's method, or a function taking modules),
    # else the outermost module called inside the compile
    root = dynamo.unwrap_compiled(roots[-1]) if roots else None
    wrapped_inside = root is not None and (
        any(getattr(m, "_sac_seam", None) is not None for m in root.modules())
        or transformers_layers.checkpoints_inside(root)
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


def running_regions() -> tuple[str, ...]:
    """The regions open above the compiled graph running now (outermost first), read from
    the same frames as :func:`enclosing_context` read them when the graph was compiled:
    decorated wrappers and declared modules' calls."""
    found: list[str] = []
    last_module = None
    for frame in frames.frames_above_running_graph():
        name = frames.own_frame_local(frame, WRAPPER_NAME, _regions.__file__, "name")
        if isinstance(name, str):
            found.append(name)
            continue
        module = frames.module_call_self(frame)
        if module is not None and module is not last_module:  # _call_impl and its inner
            last_module = module
            found.extend(declared_names(module))
    return tuple(reversed(found))


def with_block_fallbacks(gm: torch.fx.GraphModule) -> list[tuple[str, str, str]]:
    """Markers in ``gm`` that Dynamo compiled as ``region.__enter__``/``__exit__``'s own frame.

    That happens when the frame around a ``with region(...)`` block fell back to
    eager (a graph break inside the block): the region's ops then ran neither
    compiled nor checkpointed. Returns ``(kind, name, where)`` with ``where`` the
    user's ``with`` statement when it can be found on the stack.
    """
    found: list[tuple[str, str, str]] = []
    for node in gm.graph.nodes:
        kind = ops.marker_kind(node)
        if kind not in (MarkerKind.REGION_ENTER, MarkerKind.REGION_EXIT):
            continue
        outermost = frames.stack_trace_outermost(node)
        if (
            outermost is not None
            and outermost[0] == _regions.__file__
            and outermost[1] in ("__enter__", "__exit__")
        ):
            found.append((kind, str(node.args[0]), frames.user_call_site()))
    return found
