"""A user's ``torch.compile`` of a function, compiled again with the user's options and a sac
backend wrapping the user's backend (Note [a compiled forward is the layer's scope] in
``sac_compile/compiled_forward.py``; the kept bodies of routed methods, ``sac_compile/eager/routing.py``).
"""

from __future__ import annotations

import functools
import types
from typing import Any

from .._compat import aot, inductor
from .._compat.dynamo import TorchCompileCall, compiled_function, torch_compile_call
from ..actions import Actions
from ..arguments import BACKEND_KEYS, COMPILE_KEYS, SeamConfig, normalize_compile
from .backend import SacBackend, backend_for, baseline_backend

__all__ = [
    "adopted_compile",
    "calling",
    "plain_compile",
    "scope_compile",
    "backend_and_compile_kwargs",
    "compile_options_of",
    "is_adopted",
    "user_function",
]

ADOPTED = "_sac_adopted_forward"  # marks the seam's own compile of a user's compiled forward
_ORIGINAL = "_sac_original_forward"  # on the seam's copy of the function: the function copied
_INNER_BY_NAME = {"inductor": "inductor", "aot_eager": "aot_eager"}


def is_adopted(fn: Any) -> bool:
    """Whether ``fn`` is (a method bound to) the seam's compile of a user's compiled forward."""
    return getattr(getattr(fn, "__func__", fn), ADOPTED, False) is True


def compile_options_of(compiled: Any, where: str) -> tuple[tuple[str, Any], ...]:
    """The seam's ``compile=`` options that compile as the user's ``torch.compile`` did
    (``compiled`` its wrapper; ``where`` names it in the refusal): the user's backend as
    ``inner``, its ``fullgraph`` and ``dynamic``, Inductor's mode / options as
    ``inductor_config``. A ``ValueError`` when the backend cannot carry the tagging pass."""
    call = torch_compile_call(compiled)
    if call is None:
        raise ValueError(
            f"{where} is compiled by torch.compile, but the arguments it was compiled with cannot be read "
            "(this torch release stores them otherwise), so the layer cannot be compiled again as its "
            "checkpoint scope. Compile it through the seam instead: "
            "apply_selective_checkpointing(layer, keep=..., compile={'fullgraph': ..., 'inner': ...})"
        )
    options: dict[str, Any] = {"fullgraph": call.fullgraph, "inner": _inner(call, where)}
    if call.dynamic is not None:
        options["dynamic"] = call.dynamic
    config = dict(call.inductor_config)
    if isinstance(call.backend, SacBackend):
        config.update(call.backend.inductor_config)
        for key in ("mode", "options"):
            if call.backend_kwargs.get(key) is not None:
                options[key] = call.backend_kwargs[key]
    if config:
        options["inductor_config"] = config
    normalized = normalize_compile(options)
    assert normalized is not None
    return normalized


def _inner(call: TorchCompileCall, where: str) -> Any:
    if isinstance(call.backend, SacBackend):
        return call.backend.inner
    inner: Any = _INNER_BY_NAME.get(call.backend_name) if isinstance(call.backend_name, str) else None
    if inner is None and (
        aot.aot_autograd_kwargs(call.backend) is not None or inductor.is_compile_fx(call.backend)
    ):
        inner = call.backend  # an aot_autograd(...) object or a compile_fx partial: the pass runs in it
    if inner is None:
        raise ValueError(
            f"{where} is compiled with backend {call.backend_name!r}, which sac_compile cannot wrap: the "
            "tagging pass runs inside AOTAutograd backends ('inductor', 'aot_eager', an aot_autograd(...) "
            "object, a compile_fx partial or a make_sac_backend(...)), and in an eager checkpoint the compiled graph's saved values are "
            "discarded, so the layer's kept regions would keep nothing. Compile it with one of those "
            "backends, or through the seam: apply_selective_checkpointing(layer, keep=..., compile=True)"
        )
    return inner


_ADOPTED: dict[tuple[Any, ...], Any] = {}


def adopted_compile(function: types.FunctionType, backend: Any, compile_kwargs: dict[str, Any]) -> Any:
    """``torch.compile(<a copy of function>, backend=backend, **compile_kwargs)``, marked as the
    seam's; one per function, backend and options (every layer of a class shares its graphs)."""
    key = (function, backend, repr(sorted(compile_kwargs.items())))
    if key not in _ADOPTED:
        import torch  # (torch.compile imports Dynamo on first use)

        code = function.__code__.replace()  # a code object of its own: Dynamo's cache is per code object
        copy = types.FunctionType(
            code, function.__globals__, function.__name__, function.__defaults__, function.__closure__
        )
        copy.__kwdefaults__ = function.__kwdefaults__
        functools.update_wrapper(copy, function)
        del copy.__dict__["__wrapped__"]  # (Dynamo would trace the original, not the copy)
        setattr(copy, _ORIGINAL, function)
        compiled = torch.compile(copy, backend=backend, **compile_kwargs)
        setattr(compiled, ADOPTED, True)
        _ADOPTED[key] = compiled
    return _ADOPTED[key]


def calling(compiled: Any) -> Any:
    """A plain function calling ``compiled`` (an :func:`adopted_compile`), to stand in a class for
    the function compiled: the user may compile it again through an instance
    (``layer.forward = torch.compile(layer.forward)``: xtuner's ``fully_shard`` after its
    ``_compile_overwrite``), which ``torch.compile`` refuses for a method that is itself a
    ``torch.compile`` wrapper; :func:`user_function` reads the original function behind it."""
    function = getattr(compiled, "_torchdynamo_orig_callable", None)
    original = getattr(function, _ORIGINAL, function)

    def call(*args: Any, **kwargs: Any) -> Any:
        return compiled(*args, **kwargs)

    for name in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(call, name, getattr(original, name, None))
    setattr(call, _ORIGINAL, original)
    return call


def user_function(fn: Any) -> tuple[types.FunctionType | None, Any]:
    """``(the plain function, the instance it was bound to)`` behind a user's compiled forward
    (``torch.compile(cls.forward)`` or ``torch.compile(layer.forward)``), ``(None, None)`` if
    ``fn`` was not compiled by torch.compile or is the seam's own compile."""
    if is_adopted(fn):
        return None, None
    function, bound = compiled_function(fn)
    return getattr(function, _ORIGINAL, function), bound


def backend_and_compile_kwargs(config: SeamConfig) -> tuple[Any, dict[str, Any]]:
    """The backend and the ``torch.compile`` arguments of a ``compile=...`` wrap."""
    opts = config.compile_kwargs()
    backend = backend_for(
        config.actions, **{k: v for k, v in opts.items() if k in BACKEND_KEYS}, whole_graph=True
    )
    backend.compile_patches(opts.get("mode"), opts.get("options"))  # raises for bad ones
    return backend, {k: v for k, v in opts.items() if k in COMPILE_KEYS}


def scope_compile(compiled: Any, actions: Actions, where: str) -> Any:
    """``compiled`` (a user's ``torch.compile`` of a function) compiled again with the user's
    options and ``make_sac_backend(<actions>, inner=<the user's backend>)``: its graph a
    checkpoint scope of ``actions``. A ``ValueError`` naming ``where`` when the user's backend
    cannot carry the tagging pass."""
    function, _ = user_function(compiled)
    assert function is not None, compiled
    backend, kwargs = backend_and_compile_kwargs(
        SeamConfig(actions, True, compile_options_of(compiled, where))
    )
    return adopted_compile(function, backend, kwargs)


def plain_compile(compiled: Any) -> Any:
    """``compiled``, a user's compile of a function with a sac backend that checkpoints, compiled
    again with the same inner compiler and no tagging pass (``baseline_backend``); None for any
    other backend (its compile is plain already). What runs where an eager checkpoint recomputes
    the call anyway: a graph that recomputes inside it too would run its matmuls a third time for
    no byte saved (the checkpoint discards what the first run saves)."""
    call = torch_compile_call(compiled)
    backend = None if call is None else call.backend
    if call is None or not isinstance(backend, SacBackend) or not backend.checkpoint:
        return None
    function, _ = user_function(compiled)
    assert function is not None, compiled
    kwargs: dict[str, Any] = {"fullgraph": call.fullgraph}
    if call.dynamic is not None:
        kwargs["dynamic"] = call.dynamic
    return adopted_compile(function, baseline_backend(backend.inner), kwargs)
