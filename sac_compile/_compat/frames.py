"""Reading the Python stack: torch's own frames and the frames of our wrappers.

Some facts are only on the stack: which modules' calls a compiled frame runs inside
(a graph break compiles the frames below a module call one by one while its callers
wait), which model a diagnosis belongs to, whether Dynamo is calling a backend. This
module is the one place that walks frames and reads their locals; each function says
which frame names (torch's or ours) it relies on.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

from .dynamo import unwrap_compiled

__all__ = [
    "SEAM_CALL_PREFIX",
    "compiled_modules",
    "frame_self",
    "fresh_function",
    "frames",
    "frames_above_running_graph",
    "inside_backend_call",
    "innermost_module",
    "is_compile_entry",
    "module_call_self",
    "outermost_module",
    "own_frame_local",
    "stack_trace_mentions",
    "stack_trace_outermost",
    "user_call_site",
]

_TORCH_RUNTIME = tuple(
    os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), d) + os.sep
    for d in ("_dynamo", "_functorch", "_inductor", "autograd")
)
_MODULE_FILE = os.path.normcase(os.path.abspath(torch.nn.modules.module.__file__))
_EVAL_FRAME = os.path.join("_dynamo", "eval_frame.py")
_OUTPUT_GRAPH = os.path.join("_dynamo", "output_graph.py")


def fresh_function(template: Any, name: str) -> Any:
    """A copy of ``template`` with a code object of its own named ``name``: Dynamo keys its
    cache (and recompile budget) on code objects, and :func:`own_frame_local` finds the
    copy's frames by ``name``."""
    code = template.__code__.replace(co_name=name)
    return types.FunctionType(code, template.__globals__, name, template.__defaults__)


def frames() -> Iterator[Any]:
    """The caller's frame and every frame below it, innermost first."""
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None:
        yield frame
        frame = frame.f_back


def frames_above_running_graph() -> Iterator[Any]:
    """Called while a compiled graph runs (from a wrapper around it): the frames of its
    callers, innermost first, without the frame whose compiled code called the graph.

    Relies on Dynamo running a compiled frame's graph from that frame itself (its
    transformed code keeps the function's name and file) through its runtime wrappers in
    ``torch/_dynamo`` / ``torch/_functorch`` (``eval_frame._fn``, AOT runtime wrappers):
    the first frame past those and our own (the reporter's) is the compiled one. While
    Dynamo compiled it, that frame was not on the stack, so these are the frames its
    compile-time context (``markers.context.enclosing_context``) was read from.
    """
    it = frames()
    for frame in it:
        file = os.path.abspath(frame.f_code.co_filename)
        ours = file.startswith(_OUR_PACKAGE) and file not in _OUR_COMPILABLE
        if not ours and not file.startswith(_TORCH_RUNTIME):
            break  # the compiled frame
    yield from it


_OUR_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: our files whose functions Dynamo can compile as frames of their own (a decorated
#: region's wrapper, the seam's call); our other frames are the reporter's and backend's
_OUR_COMPILABLE = frozenset(
    os.path.join(_OUR_PACKAGE, f) for f in (os.path.join("markers", "regions.py"), "seam.py")
)

#: The seam's generated ``_call_impl`` functions are named ``<prefix><Class>``
#: (sac_compile/seam.py): such a frame is the wrapped module's call.
SEAM_CALL_PREFIX = "_sac_call_impl_"


def frame_self(frame: Any) -> torch.nn.Module | None:
    """The module a method frame runs on (its first argument, usually ``self``), unwrapped
    from ``torch.compile``'s ``OptimizedModule``. Frames of sac_compile's own functions do
    not count (a helper taking a module or a GraphModule is not a module call), except the
    seam's generated call of a wrapped module."""
    code = frame.f_code
    if code.co_argcount == 0:
        return None
    if code.co_filename.startswith(_OUR_PACKAGE) and not code.co_name.startswith(SEAM_CALL_PREFIX):
        return None
    candidate = frame.f_locals.get(code.co_varnames[0])
    if not isinstance(candidate, torch.nn.Module) or isinstance(candidate, torch.fx.GraphModule):
        return None  # (a backend's `fn(gm, example_inputs)` is not a module call)
    module: torch.nn.Module = unwrap_compiled(candidate)
    return module


def outermost_module() -> torch.nn.Module | None:
    """The outermost module with a method frame on the stack (the root model), if any."""
    found = None
    for frame in frames():
        module = frame_self(frame)
        if module is not None:
            found = module
    return found


def innermost_module() -> torch.nn.Module | None:
    """The innermost module with a method frame on the stack, if any."""
    for frame in frames():
        module = frame_self(frame)
        if module is not None:
            return module
    return None


def module_call_self(frame: Any) -> torch.nn.Module | None:
    """The module whose call ``frame`` runs, if it is ``nn.Module._call_impl`` or the
    ``inner`` function it defines for hooks (``torch/nn/modules/module.py``); else None.

    Relies on those two function names and their ``self`` local. While Dynamo compiles a
    nested frame (a graph break split the module call), these frames are on the stack:
    the module's forward hooks ran around the frame being compiled.
    """
    code = frame.f_code
    if code.co_name not in ("_call_impl", "inner"):
        return None
    if os.path.normcase(os.path.abspath(code.co_filename)) != _MODULE_FILE:
        return None
    obj = frame.f_locals.get("self")
    return obj if isinstance(obj, torch.nn.Module) else None


def is_compile_entry(frame: Any) -> bool:
    """Whether ``frame`` is the wrapper ``torch.compile`` put around the compiled callable
    (``compile_wrapper`` in ``torch/_dynamo/eval_frame.py``, locals ``fn`` and ``args``)."""
    code = frame.f_code
    return bool(code.co_name == "compile_wrapper" and code.co_filename.endswith(_EVAL_FRAME))


def compiled_modules(entry_frame: Any) -> list[torch.nn.Module]:
    """The modules a ``compile_wrapper`` frame compiles: its ``fn`` (a module, or a bound
    method of one, as ``OptimizedModule`` and ``Module.compile`` pass it) and the modules
    among its ``args`` (a compiled function called with the model), the first one last."""
    args = entry_frame.f_locals.get("args")
    found = [obj for obj in (args if isinstance(args, tuple) else ()) if isinstance(obj, torch.nn.Module)]
    fn = entry_frame.f_locals.get("fn")
    owner = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        found.append(owner)
    return found


def own_frame_local(frame: Any, function: str, file: str, local: str, *, prefix: bool = False) -> Any:
    """``frame``'s local ``local`` if ``frame`` runs our function ``function`` (or, with
    ``prefix``, one whose name starts with it) defined in ``file``; else None. For our own
    wrappers, whose names are fixed where they are defined (``markers`` names its
    decorator wrapper, ``seam`` its generated call functions)."""
    code = frame.f_code
    name_ok = code.co_name.startswith(function) if prefix else code.co_name == function
    if not name_ok or os.path.normcase(code.co_filename) != os.path.normcase(file):
        return None
    return frame.f_locals.get(local)


def inside_backend_call() -> bool:
    """Whether Dynamo is calling a backend on this thread (``OutputGraph._call_user_compiler``
    is on the Python stack): a marker traced now is traced by the backend (AOTAutograd),
    not by Dynamo itself."""
    for frame in frames():
        code = frame.f_code
        if code.co_name == "_call_user_compiler" and code.co_filename.endswith(_OUTPUT_GRAPH):
            return True
    return False


def stack_trace_mentions(node: torch.fx.Node, function: str) -> bool:
    """Whether the user stack Dynamo recorded for ``node`` (``meta["stack_trace"]``, the
    traceback text of the traced call) passes through a function named ``function``."""
    return f", in {function}\n" in (node.meta.get("stack_trace") or "") + "\n"


def stack_trace_outermost(node: torch.fx.Node) -> tuple[str, str] | None:
    """``(file, function)`` of the outermost frame of the user stack Dynamo recorded for
    ``node`` (``meta["stack_trace"]``: traceback text, ``File "f", line N, in fn`` lines),
    i.e. the frame Dynamo compiled; None if there is none."""
    for line in (node.meta.get("stack_trace") or "").splitlines():
        line = line.strip()
        if line.startswith('File "') and ", in " in line:
            file = line[len('File "') : line.index('"', len('File "'))]
            return file, line.rpartition(", in ")[2]
    return None


def user_call_site() -> str:
    """The user frame running the code Dynamo traces: the first frame outside torch and
    sac_compile *below* Dynamo's frames (a custom backend above them is skipped)."""
    seen_torch = False
    for frame in frames():
        fname = frame.f_code.co_filename
        in_torch = f"{os.sep}torch{os.sep}" in fname
        seen_torch = seen_torch or in_torch
        if seen_torch and not in_torch and f"{os.sep}sac_compile{os.sep}" not in fname:
            return f"{fname}:{frame.f_lineno} in {frame.f_code.co_name}"
    return "<unknown>"
