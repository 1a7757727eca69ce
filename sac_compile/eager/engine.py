"""The eager engine: region-level selective checkpointing without compile.

A non-reentrant ``torch.utils.checkpoint`` whose ``context_fn`` returns our own
caching / cached dispatch-mode pair (modelled on PyTorch's
``_CachingTorchDispatchMode`` / ``_CachedTorchDispatchMode``). A marker *session*
lives in a ``ContextVar`` that is opened inside the checkpointed callable, so
the recompute rebuilds its own region state; the marker ops update it.

Forward (caching mode), per op, in program order:

* the scope's region policy (:mod:`sac_compile.policy`, the same function the
  compiled pass calls) decides: an op it saves has its output cached (a detached
  alias); every other op is recomputed in the backward. By default that caches
  a kept region's costly ops (matmuls, attention, custom ops) and recomputes
  its cheap ones. Costly ops are cached even when they run with grad disabled:
  a custom op's or ``autograd.Function``'s kernel runs below autograd, and
  serving it from the cache is what makes it run once per step;
* ``c10d`` / ``_c10d_functional`` ops are always recomputed: their destination
  buffer may have been allocated outside the region. Each collective (not its
  ``wait_tensor`` / wrapper companions) is counted, by region; one in a kept
  region is a *forced* recompute (reported by the seam). A recomputed functional
  collective is waited on at once: when only kept ops read it, nothing else
  would, and the process group would hold the unwaited work (and its buffer);
* autocast's casts of parameters are not part of the op sequence (autocast's
  cast cache decides whether they are dispatched at all);
* ``out=`` variants, and ops run with grad disabled inside compiled code (whose
  generated kernels write into buffers this mode never sees) or that the policy
  calls cheap, are re-run rather than served: their buffers may be new in the
  recompute;
* an in-place write (``alias_info.is_write`` on a non-``out`` argument) into a
  value produced in this scope marks every cached value on that storage for
  recompute, with the write: the recompute then rebuilds the buffer and writes
  into it again, bit for bit. A kept write into a tensor from outside the scope
  (a buffer, an input) is served from the cache, so it happens once;
* a random op that is recomputed remembers the RNG state it ran with, so the
  recompute draws the same numbers even when earlier random ops are cached.

Memory: when the forward ends, a liveness walk (reverse program order) finds
what the recompute must rebuild: a recomputed op is *live* when autograd saved
one of its outputs or a live op reads one; otherwise it is *dead* and the
recompute skips it, handing out uninitialised stand-ins of its outputs' geometry
(only ops whose outputs are all floating-point tensors and that write nothing
are ever skipped: Python may read integer results without an op). Cached
floating-point values that neither autograd saved nor a live op reads are
dropped (the recompute gets a stand-in, which nothing reads). Dropping is per
output. What remains is what the backward or the live recompute reads; a kept
value is held beyond what running without checkpointing holds only where a
cheap op that autograd saves is recomputed from it (a cast of a kept matmul's
output, say), the same trade the compiled partitioner makes.

A kept in-place write into a tensor from outside the scope (a buffer, an
input) happens once: the recompute hands back the written argument without
writing again. If a recomputed op read that tensor earlier, the recompute would
see the written value: that is a forward-time error.

Relies on ``torch.utils.checkpoint`` internals (through :mod:`sac_compile._compat.checkpoint`):
version-checked detached aliases, PyTorch's SAC ignored-op set and per-op storage
key, and the innermost saved-tensor hooks, to chain our pack hook in front of the
checkpoint's own (so that we see what autograd saves).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from .._compat.checkpoint import checkpoint_internal_hooks, top_saved_tensors_hooks
from ..keep import KeepSet
from ..markers import ops
from ..policy import SAVE_COSTLY, RegionPolicy
from .modes import _CachedMode, _CachingMode
from .session import _SESSION, EagerSession
from .state import EngineStats, _State

__all__ = ["EagerSession", "EngineStats", "checkpoint_with_regions"]


@contextlib.contextmanager
def _chained_pack_hook(state: _State):
    """Note what autograd saves, then hand it to the checkpoint's own pack hook."""
    top = top_saved_tensors_hooks()
    if top is None:
        yield
        return
    outer_pack, outer_unpack = top

    def pack(t: torch.Tensor):
        state.saved_storages.add_tensor(t)
        return outer_pack(t)

    with checkpoint_internal_hooks(pack, outer_unpack):
        yield


def checkpoint_with_regions(
    fn,
    *args: Any,
    keep: KeepSet,
    policy: RegionPolicy = SAVE_COSTLY,
    preserve_rng_state: bool = True,
    stats_out: list | None = None,
    **kwargs: Any,
):
    """Run ``fn(*args, **kwargs)`` under the eager engine keeping the regions in ``keep``
    as ``policy`` decides (see :mod:`sac_compile.policy`)."""
    state = _State(preserve_rng_state)

    def context_fn():
        return _CachingMode(state), _CachedMode(state)

    def run(*a: Any, **k: Any):
        session = EagerSession(keep, policy)
        s_token = _SESSION.set(session)
        m_token = ops._MARKER_SINK.set(session.sink)
        try:
            if not state.forward_done:
                with _chained_pack_hook(state):
                    out = fn(*a, **k)
                state.stats.regions_entered = session.entered
                state.stats.unbalanced = session.close()
                state.finalize()
            else:
                out = fn(*a, **k)
            return out
        finally:
            ops._MARKER_SINK.reset(m_token)
            _SESSION.reset(s_token)

    out = checkpoint(
        run,
        *args,
        use_reentrant=False,
        context_fn=context_fn,
        preserve_rng_state=preserve_rng_state,
        **kwargs,
    )
    if stats_out is not None:
        stats_out.append(state.stats)
    return out
