"""The eager engine: region-level selective checkpointing without compile.

A non-reentrant ``torch.utils.checkpoint`` whose checkpointed function opens a marker
*session* (a ``ContextVar``, rebuilt by the recompute), fed by the region markers. The
engine's dispatch modes (modelled on PyTorch's ``_CachingTorchDispatchMode`` /
``_CachedTorchDispatchMode``) are pushed only for *kept spans*: from the first kept
region opening to the last one closing (the session's ``settle``, after each eager marker).
Outside kept regions ops run with no Python dispatch mode, in the forward and in the
recompute, exactly as under plain non-reentrant checkpointing: that is where the time goes
(a Python mode costs every op it sees a round trip), and only kept regions need one.

Forward (caching mode), per op of a kept span, in program order:

* the scope's region policy (:mod:`sac_compile.policy`, the same function the
  compiled pass calls) decides: an op it saves has its output cached (a detached
  alias); every other op is recomputed in the backward. By default that caches
  a kept region's costly ops (matmuls, attention, custom ops) and recomputes
  its cheap ones. Costly ops are cached even when they run with grad disabled:
  a custom op's or ``autograd.Function``'s kernel runs below autograd, and
  serving it from the cache is what makes it run once per step;
* ``c10d`` / ``_c10d_functional`` ops are always recomputed: their destination
  buffer may have been allocated outside the region. Each collective (not its
  ``wait_tensor`` / wrapper companions) is counted, by region, as a *forced*
  recompute (reported by the seam). A recomputed functional collective is waited
  on at once: when only kept ops read it, nothing else would, and the process
  group would hold the unwaited work (and its buffer). Collectives outside kept
  regions are recomputed like every op there, unseen;
* autocast's casts of parameters are not part of the op sequence (autocast's
  cast cache decides whether they are dispatched at all);
* ``out=`` variants, and ops run with grad disabled inside compiled code (whose
  generated kernels write into buffers this mode never sees) or that the policy
  calls cheap, are re-run rather than served: their buffers may be new in the
  recompute;
* an in-place write (``alias_info.is_write`` on a non-``out`` argument) into a
  value a kept op made marks every cached value on that storage for recompute,
  with the write: the recompute then rebuilds the buffer and writes into it again,
  bit for bit. A write outside kept regions into a cached value is found at the end
  of the forward by its version counter, with the same effect;
* a kept write into a tensor no kept op made is served from the cache when, in the
  recompute, its target is the forward's very tensor (from outside the checkpoint: a
  buffer, an input), so it happens once; when the recompute made the target anew (an
  op outside kept regions made it) it is written again. An op that reads bytes of such
  an outside tensor before a served write into them would read the written value in the
  recompute: a watch mode, pushed for such recomputes only until the last served write,
  raises then;
* a random op remembers the RNG state after its draw; where the recompute skips the
  draw (served from the cache, or dead) it sets the generator there, so what follows,
  watched or not, draws what it drew in the forward.

Memory: when a kept span ends, the storages it made that a tensor still holds are
noted (*escaped*: ops outside kept regions, which the engine does not see, may read
them). When the forward ends, a liveness walk (reverse program order) finds what the
recompute must rebuild: a recomputed kept op is *live* when autograd saved one of its
outputs, an output escaped its span, or a live op reads one; otherwise it is *dead* and
the recompute skips it, handing out uninitialised stand-ins of its outputs' geometry
(only ops whose outputs are all floating-point tensors and that write nothing are ever
skipped: Python may read integer results without an op). Cached floating-point values
that neither autograd saved, nor escaped, nor a live op reads are dropped (the recompute
gets a stand-in, which nothing reads). Dropping is per output. What remains is what the
backward or the live recompute may read: a region's output still held as it closes is
held to the backward, as PyTorch's SAC holds every value its policy saves.

Relies on ``torch.utils.checkpoint`` internals (through :mod:`sac_compile._compat.checkpoint`):
version-checked detached aliases, PyTorch's SAC ignored-op set and per-op storage
key, the innermost saved-tensor hooks, to chain our pack hook in front of the
checkpoint's own (in the forward, so that we see what autograd saves; in the recompute,
to set our mode aside while the checkpoint's hook detaches), pushing and popping a dispatch
mode by hand, and a storage's use count (who still holds it as a span ends).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, cast

import torch
from torch.utils.checkpoint import checkpoint

from .._compat.checkpoint import (
    checkpoint_early_stop,
    checkpoint_internal_hooks,
    pop_dispatch_mode,
    push_dispatch_mode,
    top_saved_tensors_hooks,
)
from ..actions import Actions
from ..keep import Keep, Regions
from ..markers import ops
from ..policy import SAVE_COSTLY, RegionPolicy
from .kept_bodies import Bodies
from .modes import CachedMode, CachingMode, WatchMode
from .session import SESSION, EagerSession
from .state import EngineState, EngineStats

__all__ = ["EagerSession", "EngineStats", "checkpoint_with_regions", "engine_contexts"]


@contextlib.contextmanager
def _chained_pack_hook(state: EngineState) -> Iterator[None]:
    """Note what autograd saves, then hand it to the checkpoint's own pack hook."""
    top = top_saved_tensors_hooks()
    if top is None:
        yield
        return
    outer_pack, outer_unpack = top

    def pack(t: torch.Tensor) -> Any:
        state.saved_storages.add_tensor(t)
        state.packed_after = state.spans_ended
        state.packs += 1
        return outer_pack(t)

    state.pack_hook = pack  # (a kept module body steps out of it: eager/kept_bodies.py)
    with checkpoint_internal_hooks(pack, outer_unpack):
        yield


@contextlib.contextmanager
def _recompute_pack_hook(spans: _Spans) -> Iterator[None]:
    """In the recompute, hand what autograd saves to the checkpoint's pack hook with our
    dispatch mode set aside: the hook detaches each tensor, an op the mode would only pass
    through, at a dispatch round trip each (of the ops a layer's recompute intercepted: demo
    11 of 48, Llama 12 of 54, Qwen3-MoE 29 of 91)."""
    top = top_saved_tensors_hooks()
    if top is None:
        yield
        return
    outer_pack, outer_unpack = top
    mode = spans.mode

    def pack(t: torch.Tensor) -> Any:
        if spans.pushed and pop_dispatch_mode(mode):
            try:
                return outer_pack(t)
            finally:
                push_dispatch_mode(mode)
        return outer_pack(t)

    spans.state.recompute_hooks = 2
    try:
        with checkpoint_internal_hooks(pack, outer_unpack):
            yield
    finally:
        spans.state.recompute_hooks = 1


class _Spans:
    """Pushes one pass's dispatch mode while a kept region is open (the session's
    ``settle``, after each region marker, starts and ends the spans), and in a recompute
    that will serve kept writes into outside tensors, the watch below it."""

    def __init__(self, state: EngineState, forward: bool) -> None:
        self.state = state
        self.forward = forward
        self.mode = CachingMode(state) if forward else CachedMode(state)
        self.watch: WatchMode | None = None
        self.pushed = False

    def start(self) -> None:
        if self.forward:
            self.state.span_start()
        push_dispatch_mode(self.mode)
        self.pushed = True

    def end(self, aborted: bool = False) -> None:
        counts = self.state.stats.intercepted
        name = "forward" if self.forward else "recompute"
        counts[name, "kept"] += self.mode.kept
        counts[name, "outside"] += self.mode.outside
        self.mode.kept = self.mode.outside = 0
        self.pushed = not pop_dispatch_mode(self.mode)
        if self.pushed and not aborted:
            raise RuntimeError(
                "sac_compile: a dispatch mode (a TorchDispatchMode entered inside a kept region) "
                "is still active where the last kept region closes; exit it inside the region, "
                "or enter it outside the checkpointed function"
            )
        if self.forward and not aborted:
            self.state.span_end()
        self._pop_finished_watch()

    def start_recompute(self) -> None:
        if self.state.start_recompute():
            self.watch = WatchMode(self.state)
            push_dispatch_mode(self.watch)

    def _pop_finished_watch(self) -> None:
        if self.watch is not None and not self.state.pending_writes and pop_dispatch_mode(self.watch):
            self.watch = None

    def close(self) -> None:
        if self.pushed:  # a span ended in error: pop what is left (close runs on the way out)
            self.pushed = not pop_dispatch_mode(self.mode)
        if self.watch is not None:
            pop_dispatch_mode(self.watch)
            self.watch = None


class _Pass:
    """One pass of the engine over the checkpointed function, as a context manager: the
    forward (``forward=True``, entered as the checkpoint's forward context) or a recompute
    (entered as its recompute context, once per recompute). Installs the marker session
    and sink for the pass and, in the forward, notes what autograd saves; on the way out
    the forward settles what the recompute needs (:meth:`EngineState.finalize`)."""

    def __init__(
        self,
        state: EngineState,
        bodies: Bodies,
        actions: Actions,
        forward: bool,
        early_stop: bool,
        on_forward: Callable[[EngineStats], object] | None = None,
    ) -> None:
        self.state, self.bodies, self.actions = state, bodies, actions
        self.forward, self.early_stop = forward, early_stop
        self.on_forward = on_forward
        self._hooks: contextlib.ExitStack | None = None

    def __enter__(self) -> _Pass:
        state = self.state
        self.spans = _Spans(state, self.forward)
        self.session = EagerSession(self.actions, self.spans, self.bodies, self.forward)
        self._token = SESSION.set(self.session)
        self._sink = ops.marker_sink(self.session)
        self._sink.__enter__()
        self._hooks = contextlib.ExitStack()
        if self.forward:
            state.early_stop = checkpoint_early_stop(self.early_stop)
            self._hooks.enter_context(_chained_pack_hook(state))
        else:
            self.spans.start_recompute()
            self.bodies.start_recompute()
            self._hooks.enter_context(_recompute_pack_hook(self.spans))
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        state, session = self.state, self.session
        try:
            try:
                if self.forward and exc_type is not None:
                    self.bodies.abort()  # (inside our pack hook: a body put its hooks back)
            finally:
                cast(contextlib.ExitStack, self._hooks).close()  # (made by __enter__)
            if self.forward and exc_type is None:
                session.end_span()  # a kept region left open ends with the function
                state.stats.regions_entered = session.entered
                state.stats.unbalanced = session.close()
                self.bodies.finalize(state.early_stop)
                state.finalize()
                if self.on_forward is not None:
                    self.on_forward(state.stats)
        finally:
            state.pack_hook = None  # (it holds the checkpoint's frame: no cycle through us)
            if not self.forward:
                state.end_recompute()
                self.bodies.end_recompute()
            # (the recompute stops early by raising once autograd has what it needs)
            session.end_span(aborted=True)
            self.spans.close()
            self._sink.__exit__(None, None, None)
            SESSION.reset(self._token)


class _Recomputes:
    """The recompute context: a fresh :class:`_Pass` each time it is entered (a second
    backward with ``retain_graph=True`` recomputes again)."""

    def __init__(self, make: Callable[[], _Pass]) -> None:
        self._make = make
        self._passes: list[_Pass] = []

    def __enter__(self) -> None:
        p = self._make()
        self._passes.append(p)
        p.__enter__()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._passes.pop().__exit__(exc_type, exc, tb)


def engine_contexts(
    actions: Actions,
    preserve_rng_state: bool = True,
    early_stop: bool = True,
    on_forward: Callable[[EngineStats], object] | None = None,
    where: tuple[str, str] = ("", ""),
) -> tuple[EngineState, _Pass, _Recomputes]:
    """``(state, forward context, recompute context)`` of one eager engine checkpoint: the
    two contexts are what a non-reentrant ``torch.utils.checkpoint`` enters around the
    forward and each recompute of its function (its ``context_fn``). ``on_forward(stats)``,
    if given, is called with the forward's :class:`EngineStats` as the forward ends; ``where``:
    ``(name, hint)`` of the checkpointed function (a layer), for recompute errors."""
    state = EngineState(preserve_rng_state)
    state.where = where
    state.offloads = actions.offloads if actions.offload else None
    bodies = Bodies(state)
    forward = _Pass(state, bodies, actions, True, early_stop, on_forward)
    return state, forward, _Recomputes(lambda: _Pass(state, bodies, actions, False, early_stop))


def checkpoint_with_regions(
    fn: Callable[..., Any],
    *args: Any,
    keep: Keep,
    policy: RegionPolicy = SAVE_COSTLY,
    offload: Regions = (),
    preserve_rng_state: bool = True,
    early_stop: bool = True,
    stats_out: list[EngineStats] | None = None,
    where: tuple[str, str] = ("", ""),
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` under the eager engine keeping the regions in ``keep``
    as ``policy`` decides (see :mod:`sac_compile.policy`). ``early_stop`` and the other
    keyword arguments of ``torch.utils.checkpoint.checkpoint`` (``debug``,
    ``determinism_check``) go to it, as under plain checkpointing; the rest go to ``fn``.
    ``where``: ``(name, hint)`` of the checkpointed function, for recompute errors."""
    actions = Actions.of(keep, policy, offload=offload)
    state, forward, recompute = engine_contexts(actions, preserve_rng_state, early_stop, where=where)
    out = checkpoint(
        fn,
        *args,
        use_reentrant=False,
        preserve_rng_state=preserve_rng_state,
        early_stop=early_stop,
        context_fn=lambda: (forward, recompute),
        **kwargs,
    )
    if stats_out is not None:
        stats_out.append(state.stats)
    return out
