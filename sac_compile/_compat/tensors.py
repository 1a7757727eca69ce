"""Tensors' version counters and storages' identities.

``Tensor._version`` (the in-place write counter autograd checks saved tensors against) and
``UntypedStorage._cdata`` (the address of the C++ storage: the identity of a storage while
it lives; two tensors viewing one buffer share it) have no public spelling.
"""

from __future__ import annotations

import torch

__all__ = ["storage_id", "version"]


def version(t: torch.Tensor) -> int:
    """``t``'s version counter: bumped by every in-place write into its storage's view."""
    return t._version


def storage_id(storage: torch.UntypedStorage) -> int:
    """The identity of ``storage`` while it lives (its C++ address)."""
    return storage._cdata
