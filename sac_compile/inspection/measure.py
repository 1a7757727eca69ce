"""Measurements that check reports independently: saved bytes seen by autograd's hooks,
and collectives counted by a dispatch mode."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from .._compat.checkpoint import TorchDispatchMode
from ..policy import communicates

__all__ = ["autograd_saved_bytes", "collectives_run"]


def autograd_saved_bytes(fn, *args: Any, exclude: Any = ()) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn(*args)`` runs.

    An independent check of a partition report (and the eager no-checkpoint
    baseline): ``saved_tensors_hooks`` see what the compiled graph or the eager
    ops hand to autograd. Storages of the tensors in ``exclude`` (pass the
    parameters) are left out. Runs ``fn(*args).sum().backward()``.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    out.sum().backward()
    return sum(storages.values())


def collectives_run(fn, *args: Any, **kwargs: Any) -> tuple[Any, Counter]:
    """Run ``fn(*args, **kwargs)`` and count the collectives it runs, by op.

    Counts ``c10d`` / ``_c10d_functional`` communication ops (not ``wait_tensor``
    and the async wrapper) seen by a ``TorchDispatchMode``, including those a
    backward run inside ``fn`` executes (autograd carries the mode into the
    backward) and those that compiled code calls (Inductor and ``aot_eager``
    call collectives as ops). Returns ``(fn's result, Counter)``.
    """
    counts: Counter = Counter()

    class _Count(TorchDispatchMode):
        supports_higher_order_operators = True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if communicates(func):
                counts[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        out = fn(*args, **kwargs)
    return out, counts
