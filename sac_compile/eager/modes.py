"""The caching (forward) and cached (recompute) dispatch modes of the eager engine."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from .._compat.aot import running_compiled_code
from .._compat.checkpoint import (
    TorchDispatchMode,
    detach_helper,
    dynamo_free,
    mark_dynamo_free,
    sac_ignored_ops,
    sac_storage_key,
)
from .._compat.checkpoint import VersionWrapper as _VersionWrapper
from .._compat.ops import HigherOrderOperator, is_effectful
from .._compat.tensors import storage_id
from ..markers import ops
from ..op_classes import MATMULS, communicates, is_collective, is_costly
from .host_copy import HostCopy, HostView
from .op_facts import (
    NO_WRITES,
    Geometry,
    Writes,
    all_float_tensors,
    arg_storages,
    autocast_weight_cast,
    is_random,
    map_leaves,
    restore_rng_state,
    rng_state,
    seeded,
    storage_objects,
    storage_of,
    tensor_storages,
    tensors_in,
    wait_functional,
    write_server,
    writes_of,
    written_args,
)
from .session import SESSION
from .state import EngineState, Entry

# PyTorch's SAC ignores these (detach, prim.device, FunctionalTensor's metadata ops: run a
# different number of times in the forward and the recompute); the markers are ours.
_IGNORED = sac_ignored_ops() | ops.MARKER_OPS
_LIFT_FRESH = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}


class _OpInfo:
    """What the modes ask of an op, looked up once per op (an op's hash is a Python call)."""

    __slots__ = (
        "collective",
        "communicates",
        "costly",
        "effectful",
        "func",
        "ignored",
        "keyed",
        "lift_fresh",
        "matmul",
        "seeded",
        "to_copy",
        "view",
        "written",
    )

    def __init__(self, func: Any) -> None:
        self.func = func  # (keeps the op alive: _INFO is keyed by its id)
        self.ignored = func in _IGNORED
        # the key of the op's FIFO of entries: the op's id, except for a higher-order op
        # (an Inductor-compiled region has one FIFO per region: sac_storage_key)
        self.keyed = isinstance(func, HigherOrderOperator)
        self.written = written_args(func)
        self.seeded = seeded(func)
        self.view = bool(getattr(func, "is_view", False))
        self.costly = is_costly(func)
        self.collective = is_collective(func)
        self.communicates = self.collective and communicates(func)
        self.effectful = is_effectful(func)
        self.matmul = getattr(func, "overloadpacket", None) in MATMULS
        self.lift_fresh = func in _LIFT_FRESH
        self.to_copy = func is torch.ops.aten._to_copy.default  # (autocast's casts: autocast_weight_cast)


_INFO: dict[int, _OpInfo] = {}  # by id(op): an op's own hash is a Python call


def _info(func: Any) -> _OpInfo:
    info = _INFO.get(id(func))
    if info is None:
        info = _INFO[id(func)] = _OpInfo(func)
    return info


def _key(info: _OpInfo, func: Any, args: tuple) -> Any:
    return sac_storage_key(func, args) if info.keyed else id(func)


def _cache_leaf(x: Any) -> Any:
    return _VersionWrapper(detach_helper(x))


def _geometry_leaf(x: Any) -> Any:
    return Geometry(x) if isinstance(x, torch.Tensor) else x


class _EngineMode(TorchDispatchMode):
    """What the engine's modes share: higher-order ops seen, Dynamo kept out by
    ``dynamo_free`` on each subclass (Note [our dispatch modes run outside Dynamo])."""

    supports_higher_order_operators = True

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # dynamo_free does it

    def __init__(self, state: EngineState) -> None:
        super().__init__()
        mark_dynamo_free(self)
        self.state = state
        self.kept = self.outside = 0  # ops intercepted (EngineStats.intercepted)

    def _count(self) -> tuple[Any, bool]:
        """The marker session, and whether a kept region is open; counts the op."""
        session = SESSION.get()
        kept = session is not None and session.kept()
        if kept:
            self.kept += 1
        else:
            self.outside += 1
        return session, kept


@dynamo_free
class CachingMode(_EngineMode):
    # (runs for every op of a kept span: what can be read off the op once is in _OpInfo)
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        st = self.state
        session, kept = self._count()
        info = _info(func)
        if info.ignored or (info.to_copy and autocast_weight_cast(func, args)):
            return func(*args, **kwargs)
        regions = session.open_names() if session is not None else ()
        save = session is not None and session.saves(func, regions)
        inputs = arg_storages(args) + arg_storages(kwargs.values()) if kwargs else arg_storages(args)
        writes = writes_of(func, args, kwargs, info.written) if info.written else NO_WRITES
        random = info.seeded is not None and is_random(func, args, kwargs, info.seeded)
        out = func(*args, **kwargs)
        grad = torch.is_grad_enabled()

        cached, shrink_of = _served(st, info, func, args, kwargs, inputs, out, writes, save, grad)
        if info.collective:
            if info.communicates:
                # (a functional collective's forward runs with grad disabled, under its
                # autograd kernel: kept is what the region asked for)
                st.stats.collectives.append((regions, str(func.overloadpacket), kept))
            cached = False
        elif info.effectful and not writes.has_out and not running_compiled_code():
            cached = True  # its effect happens once, in the forward (as compiled code does)
        external_writes, rewritten = _note_writes(st, func, regions, writes) if info.written else ((), False)
        if rewritten:
            cached = False  # the write is redone on the rebuilt buffer
        if external_writes and kept and grad and not writes.has_out:
            # Whatever the policy: a kept region's write into a tensor from outside
            # the scope (a buffer, an input) happens once, in the forward.
            cached = True
        entry = Entry(func, regions, cached, inputs, shrink_of, st.span)
        if random and st.preserve_rng_state:
            entry.rng_after = rng_state((args, kwargs, out))  # set again if the recompute skips the draw
        if external_writes and cached:
            entry.served_write = write_server(func)
            cached = entry.cached = entry.served_write is None and cached
            if entry.served_write is not None:
                st.note_external_writes(entry, external_writes)
        _record(st, info, entry, out, inputs, writes, random)
        st.entries[_key(info, func, args)].append(entry)
        st.order.append(entry)
        st.span_entries.append(entry)
        return out


def _served(
    st: EngineState, info: _OpInfo, func, args, kwargs, inputs, out, writes: Writes, save: bool, grad: bool
):
    """``(cached, shrink_of)``: whether the recompute serves this op's output (the policy
    saves it), or a small read of a kept matmul's output instead of the matmul's."""
    # With grad disabled only costly ops are served (a custom op's or an
    # autograd.Function's kernel runs below autograd), and not inside compiled
    # code, which allocates, reuses and fills its own buffers with kernels this
    # mode never sees (an Inductor kernel may write into a fallback op's output).
    cached = save and not writes.has_out
    if cached and not grad:
        cached = info.costly and not running_compiled_code()
    shrink_of = None
    if not cached and st.matmul_bytes and grad and any(s in st.matmul_bytes for s in inputs):
        shrink_of = _shrinking_read(st, info, func, args, kwargs, inputs, out, writes)
        cached = shrink_of is not None
    return cached, shrink_of


def _note_writes(st: EngineState, func, regions: tuple[str, ...], writes: Writes) -> tuple[list, bool]:
    """Mark the values this op writes into that kept ops made (recomputed with the write).
    Returns the in-place targets made elsewhere (outside the checkpoint: a buffer, an input;
    or by an unwatched op of this scope: the recompute tells which, CachedMode), and whether
    it wrote in place into a value a kept op made."""
    external_writes = []
    rewritten = False
    for t in writes.in_place:
        s = storage_of(t)
        if s is not None and s in st.produced:
            st.mark_mutated(s, func, regions, t)
            rewritten = True
        elif s is not None:
            external_writes.append(t)
    for t in writes.out:
        s = storage_of(t)
        if s is not None and s in st.produced:
            st.mark_mutated(s, func, regions, t)
    return external_writes, rewritten


def _record(st: EngineState, info: _OpInfo, entry: Entry, out, inputs, writes: Writes, random: bool) -> None:
    """Note the op's outputs: cached (served), or the geometry a skipped recompute stands in
    with; the storages it made; what a random draw made."""
    single = isinstance(out, torch.Tensor)
    out_tensors = [out] if single else tensors_in(out)
    objects = storage_objects(out_tensors)
    entry.storages = tuple(storage_id(o) for o in objects if o is not None)
    if entry.served_write is not None:
        st.stats.cached_ops += 1
    elif entry.cached:
        entry.value = map_leaves(_cache_leaf, out)
        for s in entry.storages:
            st.by_storage[s].append(entry)
        if info.matmul and entry.shrink_of is None:
            for o in objects:
                if o is not None:
                    st.matmul_bytes[storage_id(o)] = o.nbytes()
        st.stats.cached_ops += 1
    else:
        if not (writes.in_place or writes.out or info.collective):
            if single:
                if out.is_floating_point() or out.is_complex():
                    entry.skippable = True
                    entry.value = Geometry(out)
            elif all_float_tensors(out):
                entry.skippable = True
                entry.value = map_leaves(_geometry_leaf, out)
        st.stats.recomputed_ops += 1
    for o in objects:
        # lift_fresh returns its input: a torch.tensor(...) literal made in the scope
        if o is not None and (storage_id(o) not in inputs or info.lift_fresh):
            st.add_produced(o)
    if random or (st.random_derived._refs and any(s in st.random_derived for s in inputs)):
        for t in out_tensors + writes.in_place:
            st.random_derived.add_tensor(t)


def _shrinking_read(
    st: EngineState,
    info: _OpInfo,
    func: Any,
    args: tuple,
    kwargs: dict,
    inputs: tuple[int, ...],
    out: Any,
    writes: Writes,
) -> int | None:
    """The cached matmul output ``func`` reads and is at most half the size of, if it is a
    cheap, deterministic, non-writing, non-view op with floating-point outputs."""
    if info.view or info.costly or info.collective or is_random(func, args, kwargs, info.seeded):
        return None
    if writes.in_place or writes.out or not all_float_tensors(out):
        return None
    nbytes = sum(t.numel() * t.element_size() for t in tensors_in(out))
    return next((s for s in inputs if 2 * nbytes <= st.matmul_bytes.get(s, 0)), None)


@dynamo_free
class CachedMode(_EngineMode):
    def __init__(self, state: EngineState) -> None:
        super().__init__(state)
        self.counter: Counter = Counter()  # one mode per recompute, pushed for each kept span

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        st = self.state
        session, kept = self._count()
        info = _info(func)
        if info.ignored or autocast_weight_cast(func, args):
            return func(*args, **kwargs)
        key = _key(info, func, args)
        idx = self.counter[key]
        self.counter[key] += 1
        entries = st.entries.get(key, [])
        if idx >= len(entries):
            name, hint = st.where
            raise RuntimeError(
                f"sac_compile: {func} ran during the recompute{f' of {name}' if name else ''} but not in "
                "the forward: the checkpointed function ran other ops the second time (state it reads "
                f"changed between the forward and the backward){hint}"
            )
        e = entries[idx]
        if e.served_write is not None and st.same_write_targets(
            e, writes_of(func, args, kwargs, info.written).in_place
        ):
            # a kept write into a tensor from outside the checkpoint: it happened once,
            # in the forward; hand back the written argument without writing again.
            # (Its target made anew by this recompute, it is written again below.)
            st.served_external_write(e)
            if e.rng_after is not None:
                restore_rng_state(e.rng_after)
            return e.served_write(args, kwargs)
        if e.cached or e.dead:
            # a fresh alias per recompute (autograd attaches view metadata to what it
            # gets); a dropped output, or a dead op's, gets a stand-in of its geometry,
            # which nothing reads. A random op's draw is skipped: the generator is set to
            # where the forward left it, so that what follows draws the same numbers
            out = map_leaves(lambda leaf: _serve_leaf(leaf, st), e.value)
            if e.rng_after is not None:
                restore_rng_state(e.rng_after)
            return out
        if st.stand_ins and any(s in st.stand_ins for s in tensor_storages((args, kwargs))):
            raise AssertionError(
                f"sac_compile internal error: {func} would read a dropped cache entry during recompute; "
                "please report this with the model"
            )
        out = func(*args, **kwargs)
        if info.communicates:
            wait_functional(func, out)
        return out


@dynamo_free
class WatchMode(_EngineMode):
    """In a recompute that will serve kept writes into tensors from outside the checkpoint:
    an op that reads one of those tensors before its write is served reads the written
    value, not the one the forward read (``EngineState.check_read`` raises).
    Pushed at the start of such a recompute only, below the kept spans' mode, and popped
    once every such write is served."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        st = self.state
        st.stats.intercepted["recompute", "watch"] += 1
        info = _info(func)
        if st.pending_writes and not info.ignored and not info.view:
            for t in tensors_in((args, kwargs)):
                s = storage_of(t)
                if s in st.pending_writes:
                    st.check_read(s, t, func)
        return func(*args, **kwargs)


def _serve_leaf(leaf: Any, st: EngineState) -> Any:
    if isinstance(leaf, (HostCopy, HostView)):
        return leaf.back()
    if isinstance(leaf, _VersionWrapper):
        val = leaf.get_val(False)
        return detach_helper(val) if isinstance(val, torch.Tensor) else val
    if isinstance(leaf, Geometry):
        t = leaf.make()
        st.stand_ins.add_tensor(t)
        return t
    return leaf
