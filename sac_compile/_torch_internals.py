"""Every private PyTorch API sac-compile relies on, in one place.

Each import says what we rely on, so that a PyTorch upgrade that moves or
changes one of them breaks here, loudly, and nowhere else. Target: torch 2.13.
"""

from __future__ import annotations

import functools
import os
import sys

import torch
from functorch.compile import make_boxed_func

# Dynamo backend helpers.
from torch._dynamo.backends.common import aot_autograd

# The min-cut partitioner, used directly by the aot_eager inner backend.
from torch._functorch.partitioners import min_cut_rematerialization_partition

# Inductor's custom-pass extension point (torch/_inductor/custom_graph_pass.py):
# config.joint_custom_pre_pass runs on the joint graph before Inductor's own joint
# passes (and so before replace_random_passes); uuid() enters the FX graph cache
# and AOTAutograd cache keys.
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

# The partitioner's contract (torch/_functorch/partitioners.py): a forward node's
# node.meta["recompute"] holds a CheckpointPolicy, node.meta["ac_graph_id"] an int
# that increases in program order across checkpoint regions. MUST_SAVE bans
# recomputation (it is saved only if the backward needs it); MUST_RECOMPUTE /
# PREFER_RECOMPUTE forbid saving it. cleanup_recompute_tags() saves the boundary
# between two regions whose ac_graph_ids differ.
from torch.utils.checkpoint import CheckpointPolicy  # public

__all__ = [
    "CheckpointPolicy",
    "CustomGraphPass",
    "aot_autograd",
    "compile_fx",
    "get_hash_for_files",
    "inductor_config",
    "autograd_cache_config",
    "make_boxed_func",
    "min_cut_rematerialization_partition",
    "seed_ops",
]


def compile_fx(gm, example_inputs, **kwargs):
    """Inductor's entry point; ``config_patches`` is re-applied for the lazily compiled backward."""
    from torch._inductor.compile_fx import compile_fx as _compile_fx

    return _compile_fx(gm, example_inputs, **kwargs)


def inductor_config():
    import torch._inductor.config as config

    return config


def autograd_cache_config():
    """``torch._functorch.config`` holds ``enable_autograd_cache`` (the AOTAutograd cache)."""
    import torch._functorch.config as config

    return config


@functools.cache
def seed_ops() -> frozenset:
    """Ops that produce random *seeds* (never to be forced to recompute).

    Inductor's replace_random_passes introduces these after our pre-pass; AOT's
    own rng functionalization wraps random ops in run_and_save_rng_state. We list
    them so that a graph that already carries them is handled too.
    """
    from torch._inductor import inductor_prims

    found = {inductor_prims.seed, inductor_prims.seeds, inductor_prims.lookup_seed}
    hops = torch.ops.higher_order
    for name in ("run_and_save_rng_state", "run_with_rng_state", "graphsafe_run_with_rng_state"):
        op = getattr(hops, name, None)
        if op is not None:
            found.add(op)
    return frozenset(found)


_noop_lowerings_registered = False


def register_inductor_noop_lowerings(ops) -> None:
    """Lower the marker ops to nothing in Inductor (once, lazily).

    The tagging pass erases markers before Inductor lowers a graph; this covers
    graphs compiled by Inductor *without* the pass (plain ``torch.compile`` on a
    marked model). There, a no-output side-effectful fallback kernel next to
    Inductor's random seeds made the wrapper free a seed buffer before its last
    use (torch 2.13: "cannot access local variable 'bufN'"). Dropping the
    markers at lowering avoids that and leaves no call in the generated code.
    Relies on ``torch._inductor.lowering.register_lowering`` / ``lowerings``.
    Called from the markers' fake implementations, which Dynamo and AOTAutograd
    run before any lowering, so importing ``sac_compile`` stays light.
    """
    global _noop_lowerings_registered
    if _noop_lowerings_registered:
        return
    _noop_lowerings_registered = True
    from torch._inductor import lowering

    def _drop_marker(*args, **kwargs):
        return None

    for op in ops:
        if op not in lowering.lowerings:
            lowering.register_lowering(op, type_promotion_kind=None)(_drop_marker)


# --- Diagnostics: what Dynamo is compiling right now ----------------------------------


def current_dynamo_tx():
    """The root ``InstructionTranslator`` while Dynamo traces a frame, else None.

    Relies on ``torch._dynamo.symbolic_convert.InstructionTranslator.current_tx``
    (a thread-local set for the whole trace, including the backend call), its
    ``output.compiler_fn`` (the backend, wrapped), ``nn_module_stack`` (module key
    -> (path, class) for the module calls being inlined) and ``f_code``.
    """
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        return InstructionTranslator.current_tx()
    except AttributeError:
        return None


def unwrap_dynamo_backend(fn):
    """The user's backend behind Dynamo's wrappers (``WrapBackendDebug``, ``torch.compile``'s)."""
    for _ in range(8):
        inner = getattr(fn, "_torchdynamo_orig_backend", None)
        if inner is None and type(fn).__name__ == "_TorchCompileWrapper":
            inner = getattr(fn, "compiler_fn", None)
        if inner is None or inner is fn:
            return fn
        fn = inner
    return fn


_end_callbacks: dict = {}


def on_dynamo_compile_end(callback) -> None:
    """``callback(compile_id: str)`` after each Dynamo frame compile (``torch._dynamo.callback``).

    Idempotent; call it before relying on it, since ``torch._dynamo.reset()``
    clears Dynamo's callbacks. The callback must not raise: Dynamo runs it
    holding a lock and a counter.
    """
    from torch._dynamo.callback import CallbackTrigger, callback_handler

    run = _end_callbacks.get(callback)
    if run is None:

        def run(args) -> None:
            if args.callback_trigger == CallbackTrigger.DYNAMO:
                callback(str(args.compile_id))

        _end_callbacks[callback] = run
    if run not in callback_handler.end_callbacks:
        callback_handler.register_end_callback(run)


def current_compile_id() -> str | None:
    from torch._guards import CompileContext

    cid = CompileContext.current_compile_id()
    return None if cid is None else str(cid)


def inside_backend_call() -> bool:
    """Whether Dynamo is calling a backend on this thread (``OutputGraph._call_user_compiler``
    is on the Python stack): a marker traced now is traced by the backend (AOTAutograd),
    not by Dynamo itself."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_call_user_compiler" and code.co_filename.endswith(_OUTPUT_GRAPH):
            return True
        frame = frame.f_back
    return False


# --- The Python stack while Dynamo compiles a frame ----------------------------------------

_MODULE_FILE = os.path.normcase(os.path.abspath(torch.nn.modules.module.__file__))
_EVAL_FRAME = os.path.join("_dynamo", "eval_frame.py")


def module_call_self(frame) -> torch.nn.Module | None:
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


def is_compile_entry(frame) -> bool:
    """Whether ``frame`` is the wrapper ``torch.compile`` put around the compiled callable
    (``compile_wrapper`` in ``torch/_dynamo/eval_frame.py``, locals ``fn`` and ``args``)."""
    code = frame.f_code
    return code.co_name == "compile_wrapper" and code.co_filename.endswith(_EVAL_FRAME)


def compiled_modules(entry_frame) -> list[torch.nn.Module]:
    """The modules a ``compile_wrapper`` frame compiles: its ``fn`` (a module, or a bound
    method of one, as ``OptimizedModule`` and ``Module.compile`` pass it) and the modules
    among its ``args`` (a compiled function called with the model), the first one last."""
    found = []
    for obj in frame_args(entry_frame):
        if isinstance(obj, torch.nn.Module):
            found.append(obj)
    fn = entry_frame.f_locals.get("fn")
    owner = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        found.append(owner)
    return found


def frame_args(frame) -> tuple:
    args = frame.f_locals.get("args")
    return tuple(args) if isinstance(args, tuple) else ()


def compiling_resume_of(function_prefix: str) -> bool:
    """Whether Dynamo is compiling a resume function (the code after a graph break) of a
    function whose name starts with ``function_prefix``. Relies on Dynamo naming them
    ``torch_dynamo_resume_in_<function>_at_<line>`` (``torch/_dynamo/resume_execution.py``)."""
    from torch._dynamo.resume_execution import TORCH_DYNAMO_RESUME_IN_PREFIX

    code = getattr(current_dynamo_tx(), "f_code", None)
    return code is not None and code.co_name.startswith(f"{TORCH_DYNAMO_RESUME_IN_PREFIX}_{function_prefix}")


def skip_frame(fn) -> None:
    """Never compile ``fn``'s code as a frame of its own; traced inline it is still traced.

    Relies on ``torch._dynamo.eval_frame.skip_code``, which sets the code's frame
    execution strategy only (``torch._dynamo.skip`` also marks the function disabled,
    which makes inlining it a graph break).
    """
    from torch._dynamo.eval_frame import skip_code

    skip_code(fn.__code__)


_OUTPUT_GRAPH = os.path.join("_dynamo", "output_graph.py")
_AOT_RUNTIME = os.path.join("_functorch", "_aot_autograd") + os.sep


def running_compiled_code(max_depth: int = 64) -> bool:
    """Whether an AOTAutograd-compiled graph (aot_eager or Inductor) is running on this thread.

    Relies on compiled graphs running under AOTAutograd's runtime wrappers
    (``torch/_functorch/_aot_autograd/runtime_wrappers.py``: ``CompiledFunction.forward``
    and friends) being on the Python stack below the ops they dispatch. Only called
    for costly ops run with grad disabled inside a kept region, so the walk is rare.
    """
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return False
        if _AOT_RUNTIME in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def aot_cache_hits() -> int:
    """How many graphs the AOTAutograd cache has served in this process
    (``torch._dynamo.utils.counters["aot_autograd"]["autograd_cache_hit"]``)."""
    from torch._dynamo.utils import counters

    return int(counters["aot_autograd"]["autograd_cache_hit"])


def forward_saved_outputs(gm: torch.fx.GraphModule) -> list[str] | None:
    """Names of the values a partitioned forward graph saves for the backward.

    AOTAutograd's forward returns (mutated inputs, user outputs, intermediate
    bases, rng offsets, *saved values*); ``fw_metadata.num_forward`` counts the
    part before the saved values (torch/_functorch/_aot_autograd/schemas.py).
    Read from the ``TracingContext`` while the forward compiler runs.
    """
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None)
    num_forward = getattr(meta, "num_forward", None)
    if num_forward is None:
        return None
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = out.args[0] if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    return [v.name for v in values[num_forward:] if isinstance(v, torch.fx.Node)]


def cache_dir() -> str:
    """Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR`` or the default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as _cache_dir

    return _cache_dir()


def compile_caches_enabled() -> bool:
    """Whether FX-graph / AOTAutograd caches may serve a graph without running our pass."""
    import torch._functorch.config as fconfig

    if torch.compiler.config.force_disable_caches if hasattr(torch.compiler, "config") else False:
        return False
    return bool(inductor_config().fx_graph_cache or fconfig.enable_autograd_cache)
