"""``torch.utils.checkpoint``'s selective-checkpointing internals, autograd's saved-tensor
hooks, Python dispatch modes and pytree helpers, as the eager engine uses them.

The engine is modelled on PyTorch's ``_CachingTorchDispatchMode`` /
``_CachedTorchDispatchMode``; where upstream exposes the pieces it shares
(the ignored-op set, the per-op storage key, version-checked detached aliases)
we use upstream's, so fixes there reach us.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint

# Public: the partitioner's and SAC's tag values.
from torch.utils.checkpoint import CheckpointPolicy

from . import private

__all__ = [
    "CheckpointPolicy",
    "TorchDispatchMode",
    "VersionWrapper",
    "detach_helper",
    "sac_ignored_ops",
    "sac_storage_key",
    "top_saved_tensors_hooks",
    "checkpoint_internal_hooks",
    "tree_leaves",
    "tree_map",
]

# torch.utils._python_dispatch.TorchDispatchMode: the base class of dispatch modes
# (private module, the documented way to write one).
TorchDispatchMode = private("torch.utils._python_dispatch", "TorchDispatchMode")
# A cached value as SAC stores it: a detached alias wrapped with the version counter it
# had when cached (get_val raises if it was written in place since).
VersionWrapper = private("torch.utils.checkpoint", "_VersionWrapper")
detach_helper = private("torch.utils.checkpoint", "_detach_helper")


def sac_ignored_ops() -> frozenset:
    """Ops SAC neither caches nor counts (``torch.utils.checkpoint.SAC_IGNORED_OPS``: detach,
    ``prim.device`` and ``FunctionalTensor.metadata_fns``, which checkpoint's own checks may
    run a different number of times in the forward and the recompute)."""
    return frozenset(private("torch.utils.checkpoint", "SAC_IGNORED_OPS"))


_STORAGE_KEY = getattr(torch.utils.checkpoint, "_sac_storage_key", None)


def sac_storage_key(func: Any, args: tuple) -> Any:
    """The key of ``func``'s per-op FIFO of cached values (``_sac_storage_key``): the op,
    except that each Inductor-compiled region called as ``inductor_compiled_code`` gets its
    own queue (upstream gh-175258: one shared queue served the wrong entry when a cached
    region was skipped in the recompute). Torch without it: the op."""
    return func if _STORAGE_KEY is None else _STORAGE_KEY(func, args)


def top_saved_tensors_hooks() -> tuple[Any, Any] | None:
    """The innermost ``saved_tensors_hooks`` pair in effect (the checkpoint's own, inside
    a non-reentrant checkpoint), or None (``torch._C._autograd``)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


@contextlib.contextmanager
def checkpoint_internal_hooks(pack: Callable, unpack: Callable) -> Iterator[None]:
    """``saved_tensors_hooks(pack, unpack)`` that a checkpoint nested inside takes for the
    checkpoint's own, not the user's.

    Since torch 2.15 selective checkpointing routes the tensors it caches through the
    *user's* saved-tensors hooks (``respect_saved_tensors_hooks``; a ``FutureWarning`` while
    it defaults to off), found by ``_current_user_saved_tensors_hooks``, which skips pack
    hooks marked ``_checkpoint_internal`` and follows their ``_user_hooks`` to the pair that
    was in effect below them (``torch/utils/checkpoint.py``). Our pack hook wraps the
    checkpoint's own, so it is marked the same way; before 2.15 the marks are unread.
    """
    current = getattr(torch.utils.checkpoint, "_current_user_saved_tensors_hooks", None)
    if current is not None:
        pack._checkpoint_internal = True  # type: ignore[attr-defined]
        pack._user_hooks = current()  # type: ignore[attr-defined]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        if current is not None:
            del pack._user_hooks  # type: ignore[attr-defined]  # (upstream: no reference cycle)


# torch.utils._pytree: flattening op arguments and outputs (no public equivalent in 2.13).
tree_leaves = private("torch.utils._pytree", "tree_leaves")
tree_map = private("torch.utils._pytree", "tree_map")
