"""What Dynamo is compiling right now, and how compiled modules are wrapped.

Relies on ``torch._dynamo`` internals named in each function. Dynamo is imported on
first use only.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from . import private

__all__ = [
    "TorchCompileCall",
    "aot_cache_hits",
    "compiled_function",
    "compiled_original",
    "compiled_self",
    "compiling_resume_of",
    "current_compile_id",
    "current_dynamo_tx",
    "dynamo_config",
    "forward_side_effects_under_checkpoint",
    "guard_module_hooks",
    "node_module_stack",
    "has_compiled_call",
    "lookup_backend",
    "on_dynamo_compile_end",
    "skip_frame",
    "trace_time_constant",
    "traced_inside_checkpoint",
    "torch_compile_call",
    "tx_module_stack",
    "tx_where",
    "unwrap_compiled",
    "unwrap_dynamo_backend",
]


def unwrap_compiled(obj: Any) -> Any:
    """The module behind ``torch.compile(module)`` (``OptimizedModule._orig_mod``), else ``obj``."""
    return getattr(obj, "_orig_mod", obj)


def compiled_original(fn: Any) -> Any:
    """The function ``torch.compile(fn)`` wrapped, when ``fn`` is such a wrapper (a function with
    ``_torchdynamo_orig_callable``, which ``torch/_dynamo/eval_frame.py`` sets), else None."""
    original = getattr(fn, "_torchdynamo_orig_callable", None) if callable(fn) else None
    return original if getattr(original, "__code__", None) is not None else None


@dataclass(frozen=True)
class TorchCompileCall:
    """What ``torch.compile(fn, ...)`` was called with, read off the wrapper it returned."""

    backend: Any  # "inductor", or the backend torch.compile was given (a name's callable)
    backend_name: str  # as torch.compile names it ("inductor", "aot_eager", a class's name)
    fullgraph: bool
    dynamic: bool | None
    inductor_config: dict[str, Any]  # backend="inductor": the config its mode / options set
    backend_kwargs: dict[str, Any]  # any other backend: the mode / options passed on to it


def torch_compile_call(fn: Any) -> TorchCompileCall | None:
    """The arguments of the ``torch.compile`` that returned ``fn``, or None when they cannot be
    read (``fn`` is not such a wrapper, or torch stores them otherwise).

    Relies on ``torch/_dynamo/eval_frame.py``: the wrapper (``compile_wrapper``) closes over the
    ``OptimizeContext`` (free variable ``self``: ``fullgraph``, ``_dynamic``, ``callback``); the
    callback's ``_torchdynamo_orig_backend`` chain ends at ``torch.compile``'s backend wrapper
    (``_TorchCompileInductorWrapper``: ``config``; ``_TorchCompileWrapper``: ``compiler_fn``,
    ``compiler_name``, ``kwargs``) in ``torch/__init__.py``.
    """
    if not callable(getattr(fn, "_torchdynamo_orig_callable", None)):
        return None
    code = getattr(fn, "__code__", None)
    cells = dict(zip(getattr(code, "co_freevars", ()), getattr(fn, "__closure__", None) or ()))
    try:
        context = cells["self"].cell_contents
        fullgraph, dynamic, backend = bool(context.fullgraph), context._dynamic, context.callback
    except (KeyError, AttributeError, ValueError):
        return None
    backend = _behind_dynamo_wrappers(backend)
    kind = type(backend).__name__
    if kind == "_TorchCompileInductorWrapper":
        config = getattr(backend, "config", None)
        if not isinstance(config, dict):
            return None
        return TorchCompileCall("inductor", "inductor", fullgraph, dynamic, dict(config), {})
    if kind == "_TorchCompileWrapper":
        name, compiler, kwargs = (
            getattr(backend, k, None) for k in ("compiler_name", "compiler_fn", "kwargs")
        )
        if compiler is None or not isinstance(kwargs, dict):
            return None
        return TorchCompileCall(
            unwrap_dynamo_backend(compiler), str(name), fullgraph, dynamic, {}, dict(kwargs)
        )
    return None


def compiled_function(fn: Any) -> Any:
    """The plain function behind ``torch.compile`` wrappers and bound methods of them (a
    method compiled, then its class's compiled method compiled again through an instance),
    with the instance it was bound to: ``(function, self or None)``; ``(None, None)`` when
    ``fn`` was not compiled."""
    bound, compiled = None, False
    for _ in range(8):
        if isinstance(fn, types.MethodType):
            bound, fn = fn.__self__, fn.__func__
            continue
        inner = getattr(fn, "_torchdynamo_orig_callable", None) if callable(fn) else None
        if inner is None:
            break
        compiled, fn = True, inner
    if not compiled or not isinstance(fn, types.FunctionType):
        return None, None
    return fn, bound


def has_compiled_call(module: torch.nn.Module) -> bool:
    """Whether ``module.compile()`` made its calls compiled (``Module._compiled_call_impl``)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def drop_compiled_call(module: torch.nn.Module) -> None:
    """Undo ``module.compile()``: its calls run ``_call_impl`` again."""
    module.__dict__.pop("_compiled_call_impl", None)


def dynamo_config() -> Any:
    """``torch._dynamo.config`` (a config module: ``patch()``, settings as attributes)."""
    return private("torch._dynamo", "config")


def current_dynamo_tx() -> Any:
    """The root ``InstructionTranslator`` while Dynamo traces a frame, else None.

    Relies on ``torch._dynamo.symbolic_convert.InstructionTranslator.current_tx``
    (a thread-local set for the whole trace, including the backend call), its
    ``output.compiler_fn`` (the backend, wrapped), ``nn_module_stack`` (module key
    -> (path, class) for the module calls being inlined) and ``f_code`` / ``f_locals``.
    """
    current_tx = private("torch._dynamo.symbolic_convert", "InstructionTranslator.current_tx")
    try:
        return current_tx()
    except AttributeError:  # no trace on this thread (the thread-local is unset)
        return None


def compiled_self(tx: Any = None) -> Any:
    """The ``self`` (first argument) of the frame Dynamo is compiling, if any."""
    tx = current_dynamo_tx() if tx is None else tx
    code = getattr(tx, "f_code", None)
    if code is not None and code.co_argcount > 0:
        return getattr(tx, "f_locals", {}).get(code.co_varnames[0])
    return None


def compiled_code_name(tx: Any = None) -> str | None:
    """The name of the function whose frame Dynamo is compiling."""
    tx = current_dynamo_tx() if tx is None else tx
    code = getattr(tx, "f_code", None)
    return None if code is None else code.co_name


def tx_module_stack(tx: Any) -> list[tuple[str, Any]]:
    """``(module path, class)`` of the module calls Dynamo is inlining, outermost first."""
    return list(getattr(tx, "nn_module_stack", {}).values())


def node_module_stack(node: Any) -> list[tuple[str, Any]]:
    """``(module path, class)`` of the module calls around an FX node Dynamo traced,
    outermost first (``node.meta["nn_module_stack"]``, which Dynamo records and AOTAutograd
    carries onto the joint graph)."""
    return list((node.meta.get("nn_module_stack") or {}).values())


def trace_time_constant(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Have Dynamo call ``fn`` (with constant arguments) while it traces, its result a constant
    of the trace, instead of tracing into it: ``torch._dynamo.assume_constant_result``, which sets
    the attribute ``_dynamo_marked_constant`` that ``UserFunctionVariable`` reads (set here without
    importing Dynamo)."""
    cast(Any, fn)._dynamo_marked_constant = True
    return fn


def traced_inside_checkpoint(tx: Any = None) -> bool:
    """Whether Dynamo is tracing the body of a ``torch.utils.checkpoint`` now (or code nested in
    one): a subgraph tracer for the ``tag_activation_checkpoint`` higher-order op is open.

    Relies on ``OutputGraph.current_tracer`` and ``SubgraphTracer.parent`` / ``source_target``
    (the higher-order op whose body it traces) in ``torch/_dynamo/output_graph.py``.
    """
    tx = current_dynamo_tx() if tx is None else tx
    hop = private("torch._higher_order_ops.wrap", "tag_activation_checkpoint")
    tracer = getattr(getattr(tx, "output", None), "current_tracer", None)
    for _ in range(64):
        if tracer is None:
            return False
        if getattr(tracer, "source_target", None) is hop:
            return True
        tracer = getattr(tracer, "parent", None)
    return False


def tx_backend(tx: Any) -> Any:
    """The backend the traced frame is compiled with (behind Dynamo's wrappers)."""
    return unwrap_dynamo_backend(tx.output.compiler_fn)


def tx_trace(tx: Any) -> Any:
    """The object identifying one Dynamo trace attempt (its ``OutputGraph``)."""
    return tx.output


def tx_where(tx: Any) -> tuple[Any, str]:
    """``(self of the traced frame or None, the traced function's name)``."""
    return compiled_self(tx), tx.f_code.co_name


def unwrap_dynamo_backend(fn: Any) -> Any:
    """The user's backend behind Dynamo's wrappers (``WrapBackendDebug``, ``torch.compile``'s)."""
    for _ in range(8):
        fn = _behind_dynamo_wrappers(fn)
        inner = getattr(fn, "compiler_fn", None) if type(fn).__name__ == "_TorchCompileWrapper" else None
        if inner is None or inner is fn:
            return fn
        fn = inner
    return fn


def lookup_backend(name: str) -> Callable[..., Any]:
    """The backend registered as ``name`` (``torch._dynamo.backends.registry.lookup_backend``:
    PyTorch's own and the ``torch_dynamo_backends`` entry points); ``ValueError`` if none is."""
    registry = private("torch._dynamo.backends", "registry")
    try:
        found: Callable[..., Any] = registry.lookup_backend(name)
    except Exception as e:  # InvalidBackend (a torch._dynamo.exc class)
        known = ", ".join(sorted(registry.list_backends(exclude_tags=())))
        raise ValueError(f"no torch.compile backend is registered as {name!r} (registered: {known})") from e
    return found


def _behind_dynamo_wrappers(fn: Any) -> Any:
    """The end of a backend's ``_torchdynamo_orig_backend`` chain (Dynamo's ``ConvertFrame``,
    ``WrapBackendDebug``, ...): ``torch.compile``'s own backend wrapper, or the backend itself."""
    for _ in range(8):
        inner = getattr(fn, "_torchdynamo_orig_backend", None)
        if inner is None or inner is fn:
            return fn
        fn = inner
    return fn


def reset_compile_caches() -> None:
    """Forget every compiled frame (``torch._dynamo.reset``): a fresh start for a
    measurement that builds and compiles a new model, so that the recompile limit is not
    reached across models and nothing compiled for the last one runs for the next."""
    private("torch._dynamo", "reset")()


_end_callbacks: dict[Callable[[str], None], Callable[[Any], None]] = {}


def on_dynamo_compile_end(callback: Callable[[str], None]) -> None:
    """``callback(compile_id: str)`` after each Dynamo frame compile (``torch._dynamo.callback``).

    Idempotent; call it before relying on it, since ``torch._dynamo.reset()``
    clears Dynamo's callbacks. The callback must not raise: Dynamo runs it
    holding a lock and a counter.
    """
    trigger = private("torch._dynamo.callback", "CallbackTrigger")
    handler = private("torch._dynamo.callback", "callback_handler")
    run = _end_callbacks.get(callback)
    if run is None:

        def run(args: Any) -> None:
            if args.callback_trigger == trigger.DYNAMO:
                callback(str(args.compile_id))

        _end_callbacks[callback] = run
    if run not in handler.end_callbacks:
        handler.register_end_callback(run)


def current_compile_id() -> str | None:
    """Dynamo's id of the frame compile in progress (``torch._guards.CompileContext``)."""
    cid = private("torch._guards", "CompileContext").current_compile_id()
    return None if cid is None else str(cid)


def compiling_resume_of(function_prefix: str) -> bool:
    """Whether Dynamo is compiling a resume function (the code after a graph break) of a
    function whose name starts with ``function_prefix``. Relies on Dynamo naming them
    ``torch_dynamo_resume_in_<function>_at_<line>`` (``torch/_dynamo/resume_execution.py``)."""
    prefix = private("torch._dynamo.resume_execution", "TORCH_DYNAMO_RESUME_IN_PREFIX")
    name = compiled_code_name()
    return name is not None and name.startswith(f"{prefix}_{function_prefix}")


def skip_frame(fn: Callable[..., Any]) -> None:
    """Never compile ``fn``'s code as a frame of its own; traced inline it is still traced.

    Relies on ``torch._dynamo.eval_frame.skip_code``, which sets the code's frame
    execution strategy only (``torch._dynamo.skip`` also marks the function disabled,
    which makes inlining it a graph break).
    """
    private("torch._dynamo.eval_frame", "skip_code")(fn.__code__)


def guard_module_hooks() -> None:
    """Make Dynamo guard on ``nn.Module`` hooks, process-wide.

    Relies on ``torch._dynamo.config.skip_nnmodule_hook_guards`` (True by default: "if
    your model actually has hooks and you remove them, or doesn't and you add them,
    dynamo will not notice and will execute whichever version you first compiled").
    Region declarations are hooks, so with the default, code compiled for one module is
    run for another of the same class declared differently (a region declared on one
    layer only was dropped or copied to the others, silently).
    """
    dynamo_config().skip_nnmodule_hook_guards = False


def forward_side_effects_under_checkpoint() -> bool:
    """Let Dynamo trace a ``torch.utils.checkpoint`` body that mutates Python state, process-wide;
    returns whether it was off before.

    Relies on ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint`` (False by
    default: Dynamo refuses such a side effect inside the checkpoint's higher-order op and
    breaks the graph, because eager checkpointing would replay it in the recompute; True: the
    side effect is applied once, in the forward, as compiled code applies every side effect).
    """
    config = dynamo_config()
    was_off = not config.skip_fwd_side_effects_in_bwd_under_checkpoint
    config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    return was_off


def aot_cache_hits() -> int:
    """How many graphs the AOTAutograd cache has served in this process
    (``torch._dynamo.utils.counters["aot_autograd"]["autograd_cache_hit"]``)."""
    counters = private("torch._dynamo.utils", "counters")
    return int(counters["aot_autograd"]["autograd_cache_hit"])
