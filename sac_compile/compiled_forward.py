"""A wrapped layer whose ``forward`` the user compiled: compiled again as the layer's checkpoint scope.

Note [a compiled forward is the layer's scope]
Trainers compile a checkpointed layer's whole ``forward``: on its class (xtuner's
``_compile_overwrite``: ``setattr(cls, "forward", torch.compile(cls.forward, fullgraph=True))``)
or on the instance, before or after wrapping it (``layer.forward = torch.compile(layer.forward)``).
Run inside the seam's eager checkpoint, that compiled call keeps nothing: the checkpoint discards
what its graph saved (full recompute), or, routed as a kept body because it holds a kept region,
its whole graph is held (no checkpoint at all). So the seam compiles the same function again,
with the user's ``torch.compile`` options (``fullgraph``, ``dynamic``, Inductor's mode and
options) and ``make_sac_backend(<the layer's keep set, policy, budget, offload>, inner=<the
user's backend>)``, and runs it with no eager checkpoint around it: the compiled graph is the
layer's checkpoint scope, as with ``compile=`` (kept regions saved, the rest recomputed in its
backward). The copy has a code object of its own (Dynamo's cache and recompile limit are per
code object: the user's compile of the same function, still run by unwrapped layers of the
class, keeps its own entries) and is shared by every layer of the class and configuration (one
graph for N layers). A backend the seam cannot wrap (one without AOTAutograd) is refused when it
is found, with the fix.
"""

from __future__ import annotations

import functools
import types
from typing import Any

from ._compat.dynamo import TorchCompileCall, compiled_function, torch_compile_call
from .arguments import normalize_compile
from .compiler.backend import SacBackend

__all__ = ["adopted_forward", "compile_options_of", "is_adopted", "user_forward"]

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


def _inner(call: TorchCompileCall, where: str) -> str:
    if isinstance(call.backend, SacBackend):
        return call.backend.inner
    inner = _INNER_BY_NAME.get(call.backend_name) if isinstance(call.backend_name, str) else None
    if inner is None:
        raise ValueError(
            f"{where} is compiled with backend {call.backend_name!r}, which sac_compile cannot wrap: the "
            "tagging pass runs inside AOTAutograd backends ('inductor', 'aot_eager' or a "
            "make_sac_backend(...)), and in an eager checkpoint the compiled graph's saved values are "
            "discarded, so the layer's kept regions would keep nothing. Compile it with one of those "
            "backends, or through the seam: apply_selective_checkpointing(layer, keep=..., compile=True)"
        )
    return inner


_ADOPTED: dict[tuple[Any, ...], Any] = {}


def adopted_forward(function: types.FunctionType, backend: Any, compile_kwargs: dict[str, Any]) -> Any:
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


def user_forward(fn: Any) -> tuple[types.FunctionType | None, Any]:
    """``(the plain function, the instance it was bound to)`` behind a user's compiled forward
    (``torch.compile(cls.forward)`` or ``torch.compile(layer.forward)``), ``(None, None)`` if
    ``fn`` was not compiled by torch.compile or is the seam's own compile."""
    if is_adopted(fn):
        return None, None
    function, bound = compiled_function(fn)
    return getattr(function, _ORIGINAL, function), bound
