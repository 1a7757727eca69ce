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
from .session import current_session

__all__ = ["routed_compiled_methods"]


# Note [compiled methods inside the seam]
# Trainers compile a layer's methods (xtuner: the attention, the MoE block's stages, with
# fullgraph=True) and checkpoint the layer eagerly outside them. An eager checkpoint around
# compiled code drops what the compiled graph saved and runs it again in the backward: a kept
# region in such a method would keep nothing. The generated class overrides every method of
# the layer's class that torch.compile wrapped (found when the class is generated) with one
# that hands the call to the eager engine's session (EagerSession.call_compiled), which runs
# it once per step when it holds a kept region. Traced by an outer compile, or outside the
# engine, the override calls the compiled method as it is.


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
    def method(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return compiled(self, *args, **kwargs)
        session = current_session()
        if session is None:
            return compiled(self, *args, **kwargs)
        return session.call_compiled(original, functools.partial(compiled, self), args, kwargs)

    functools.update_wrapper(method, original)
    cast(Any, method).__wrapped__ = compiled  # (the class key in _subclass_for reads it)
    return method
