"""``nn.Module``'s call machinery, as the seam overrides it."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CALL_IMPL", "next_call_impl"]

#: ``nn.Module.__call__`` runs ``self._call_impl`` (hooks, then ``forward``;
#: torch/nn/modules/module.py). The seam's generated subclass overrides it, as
#: ``fully_shard``'s generated class does, so that the whole call (hooks included) runs
#: inside the checkpoint.
CALL_IMPL = "_call_impl"


def next_call_impl(klass: type, module: torch.nn.Module) -> Any:
    """The ``_call_impl`` after ``klass`` in ``module``'s MRO, bound to ``module``."""
    return getattr(super(klass, module), CALL_IMPL)
