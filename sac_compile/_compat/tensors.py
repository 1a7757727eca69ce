"""Tensors' version counters, storages' identities, and fake tensors.

``Tensor._version`` (the in-place write counter autograd checks saved tensors against) and
``UntypedStorage._cdata`` (the address of the C++ storage: the identity of a storage while
it lives; two tensors viewing one buffer share it) have no public spelling. Nor does
``FakeTensorMode`` (``torch._subclasses``), the mode Dynamo traces with: the planner runs a
model on the meta device under it, so that code asking a tensor's value sees a trace.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException

__all__ = ["DataDependentOutputException", "fake_mode", "storage_id", "version"]


def version(t: torch.Tensor) -> int:
    """``t``'s version counter: bumped by every in-place write into its storage's view."""
    return t._version


def storage_id(storage: torch.UntypedStorage) -> int:
    """The identity of ``storage`` while it lives (its C++ address)."""
    return int(storage._cdata)


def fake_mode() -> Any:
    """A ``FakeTensorMode`` accepting real (meta) tensors: parameters on the meta device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)
