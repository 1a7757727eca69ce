"""Compiled methods of a checkpointed layer, routed through the eager engine.

See Note [compiled methods inside the seam]: the seam's generated class overrides each
method of the layer's class that ``torch.compile`` wrapped with one that hands the call to
:meth:`EagerSession.call_compiled <sac_compile.eager.session.EagerSession.call_compiled>`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn as nn

from .._compat.dynamo import compiled_original
from ..actions import Actions
from ..compiler.adopt import plain_compile, scope_compile
from ..diagnostics.trace_watch import note_routed
from .session import current_session

__all__ = ["route_submodules", "routed_compiled_methods", "unroute_submodules"]


# Note [compiled methods inside the seam]
# Trainers compile a layer's methods (xtuner: the attention, the MoE block's stages, with
# fullgraph=True) and checkpoint the layer eagerly outside them. An eager checkpoint around
# compiled code drops what the compiled graph saved and runs it again in the backward: a kept
# region in such a method would keep nothing. The generated class overrides every method of
# the layer's class that torch.compile wrapped (found when the class is generated) with one
# that hands the call to the eager engine's session (EagerSession.call_compiled), which runs
# it once per step when it holds a kept region. Traced by an outer compile, or outside the
# engine, the override calls the compiled method as it is. Methods compiled on a submodule's
# class (xtuner: the MoE block's forward, the attention module's forward, the inner decoder
# layer of an MTP layer) are routed the same way: the seam swaps each such submodule's class for
# a generated subclass with the overrides (route_submodules), named as the original, pickled as
# the original (the seam routes it again when the wrapped layer is unpickled or copied).


def routed_compiled_methods(cls: type[nn.Module]) -> dict[str, Any]:
    """``{name: override}`` for each method of ``cls`` (or a base) that ``torch.compile`` wrapped."""
    found: dict[str, Any] = {}
    for klass in reversed(cls.__mro__[:-2]):  # (less nn.Module and object)
        for name, value in vars(klass).items():
            original = compiled_original(value)
            if original is not None:
                found[name] = _route(value, original)
            elif name in found:
                del found[name]  # (a subclass put an uncompiled method in its place)
    return found


def _route(compiled: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    note_routed(original.__code__)
    plain: list[Any] = []  # (made on first use: plain_compile(compiled), or None)

    def method(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return compiled(self, *args, **kwargs)
        session = current_session()
        if session is None:
            return compiled(self, *args, **kwargs)
        if not plain:
            plain.append(plain_compile(compiled))
        # recomputed with the layer: a graph that checkpoints itself would recompute a third time
        run = functools.partial(plain[0] or compiled, self)
        kept = functools.partial(_kept_run, compiled, original, session.actions, self)
        return session.call_compiled(original, run, args, kwargs, kept)

    functools.update_wrapper(method, original)
    cast(Any, method).__wrapped__ = compiled  # (the class key in _subclass_for reads it)
    return method


# (user's compiled method, the layer's actions' text) -> the method compiled as a scope, or None
_KEPT: dict[tuple[Any, str], Any] = {}


def _kept_run(compiled: Any, original: Any, actions: Actions, owner: nn.Module) -> Callable[..., Any] | None:
    """How a routed method runs as a kept body: compiled again with the user's options and
    ``make_sac_backend(<the layer's actions>, inner=<the user's backend>)``, so that its graph holds
    its kept regions' costly values and recomputes the rest in its own backward (the user's compile,
    run whole off the checkpoint, would hold every activation of the method); None when the
    user's backend cannot be wrapped (the user's compile then runs)."""
    key = (compiled, actions.text)
    if key not in _KEPT:
        try:
            _KEPT[key] = scope_compile(compiled, actions, original.__qualname__)
        except ValueError:
            _KEPT[key] = None
    run = _KEPT[key]
    return None if run is None else functools.partial(run, owner)


_ROUTED_CLASS = "_sac_routed_class"  # marks route_submodules's generated classes
_SUBCLASSES: dict[tuple[Any, ...], type[nn.Module]] = {}


def route_submodules(module: nn.Module) -> list[str]:
    """Route the compiled methods of every submodule of ``module`` (not ``module`` itself, whose
    class the seam generates, nor a submodule wrapped by a seam of its own); returns the paths
    of the submodules routed."""
    routed: list[str] = []
    stack = [("", child, name) for name, child in module.named_children()]
    while stack:
        prefix, sub, name = stack.pop()
        path = f"{prefix}{name}"
        if "_sac_seam" in sub.__dict__:
            continue  # (its own seam routes its methods)
        cls = type(sub)
        if cls.__dict__.get(_ROUTED_CLASS) is not True:
            klass = _routing_class(cls)
            if klass is not None:
                sub.__class__ = klass
                routed.append(path)
        stack.extend((f"{path}.", child, n) for n, child in sub.named_children())
    return routed


def unroute_submodules(module: nn.Module) -> None:
    """Undo :func:`route_submodules` on every module under ``module``."""
    for sub in module.modules():
        if type(sub).__dict__.get(_ROUTED_CLASS) is True:
            sub.__class__ = type(sub).__mro__[1]


def _routing_class(cls: type[nn.Module]) -> type[nn.Module] | None:
    """``cls`` with its compiled methods routed (None when it has none)."""
    routed = routed_compiled_methods(cls)
    if not routed:
        return None
    key = (cls, tuple(sorted((name, id(fn.__wrapped__)) for name, fn in routed.items())))
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = cast(
            "type[nn.Module]",
            type(
                cls.__name__,
                (cls,),
                {
                    **routed,
                    "__module__": cls.__module__,
                    "__qualname__": cls.__qualname__,
                    _ROUTED_CLASS: True,
                    "__reduce_ex__": _routed_reduce_ex,
                },
            ),
        )
    return _SUBCLASSES[key]


def _routed_reduce_ex(self: nn.Module, protocol: Any) -> Any:
    klass = type(self)
    if klass.__dict__.get(_ROUTED_CLASS) is not True:  # a class made from ours (fully_shard): its own way
        return object.__reduce_ex__(self, protocol)
    return _unrouted, (klass.__mro__[1],), self.__getstate__()


def _unrouted(cls: type[nn.Module]) -> nn.Module:
    """An instance of the original class (the wrapped layer's unpickling routes it again)."""
    return cls.__new__(cls)
