"""TorchScript: leaving a method out of a scripted class (``torch.jit._drop``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from . import private

__all__ = ["script_drop"]

_F = TypeVar("_F", bound=Callable[..., Any])


def script_drop(fn: _F) -> _F:
    """Leave ``fn`` out when TorchScript compiles its class (``torch.jit._drop``): its
    body may then use Python TorchScript cannot compile. ``torch.jit.unused`` would
    compile the signature and raise when called; ``_drop`` skips the method entirely,
    which is what a scripted ``with region(...)`` block needs of ``region.__call__``."""
    dropped: _F = private("torch.jit", "_drop")(fn)
    return dropped
