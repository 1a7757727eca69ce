"""The caching (forward) and cached (recompute) dispatch modes of the eager engine."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from .._compat.aot import running_compiled_code
from .._compat.checkpoint import (
    TorchDispatchMode,
    detach_helper,
    sac_ignored_ops,
    sac_storage_key,
    tree_map,
)
from .._compat.checkpoint import VersionWrapper as _VersionWrapper
from .._compat.ops import is_effectful
from ..markers import ops
from ..policy import MATMULS, communicates, is_collective, is_costly
from .op_facts import (
    _all_float_tensors,
    _autocast_weight_cast,
    _Geometry,
    _is_random,
    _rng_state,
    _served_write,
    _set_rng_state,
    _storage,
    _tensor_storages,
    _tensors,
    _wait_functional,
    _Writes,
    _writes,
)
from .session import _SESSION
from .state import _Entry, _State

# PyTorch's SAC ignores these (detach, prim.device, FunctionalTensor's metadata ops: run a
# different number of times in the forward and the recompute); the markers are ours.
_IGNORED = sac_ignored_ops() | ops.MARKER_OPS
_LIFT_FRESH = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}


def _kept_external_write(st: _State, func: Any, regions: tuple[str, ...], writes: list) -> Any:
    """Decide how the recompute treats a kept in-place write into a tensor from outside the scope."""
    for s, t in writes:
        if s in st.read_by_recomputed:
            raise RuntimeError(
                f"sac_compile: {func} writes in place, in kept region(s) {'+'.join(regions)}, into a tensor "
                f"of shape {tuple(t.shape)} ({t.dtype}) from outside the checkpoint that a recomputed op read "
                "earlier; the recompute would read the written value. Move the write out of the kept "
                "region, or keep the earlier reader too."
            )
    return _served_write(func)


class _CachingMode(TorchDispatchMode):
    supports_higher_order_operators = True

    def __init__(self, state: _State) -> None:
        super().__init__()
        self.state = state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        st = self.state
        session = _SESSION.get()
        kept = session is not None and session.kept()
        st.stats.intercepted["forward", "kept" if kept else "outside"] += 1
        if func in _IGNORED or _autocast_weight_cast(func, args):
            return func(*args, **kwargs)
        regions = session.open_names() if session is not None else ()
        save = session is not None and session.saves(func, regions)
        inputs = _tensor_storages((args, kwargs))
        writes = _writes(func, args, kwargs)
        rng = None
        random = _is_random(func, args, kwargs)
        if random and st.preserve_rng_state:
            rng = _rng_state((args, kwargs))
        out = func(*args, **kwargs)

        # With grad disabled only costly ops are served (a custom op's or an
        # autograd.Function's kernel runs below autograd), and not inside compiled
        # code, which allocates, reuses and fills its own buffers with kernels this
        # mode never sees (an Inductor kernel may write into a fallback op's output).
        cached = save and not writes.has_out
        if cached and not torch.is_grad_enabled():
            cached = is_costly(func) and not running_compiled_code()
        shrink_of = None
        if not cached and st.matmul_bytes and torch.is_grad_enabled():
            shrink_of = _shrinking_read(st, func, args, kwargs, inputs, out, writes)
            cached = shrink_of is not None
        if is_collective(func):
            if communicates(func):
                # (a functional collective's forward runs with grad disabled, under its
                # autograd kernel: kept is what the region asked for)
                st.stats.collectives.append((regions, str(func.overloadpacket), kept))
            cached = False
        elif is_effectful(func) and not writes.has_out and not running_compiled_code():
            cached = True  # its effect happens once, in the forward (as compiled code does)
        external_writes = []
        for t in writes.in_place:
            s = _storage(t)
            if s is not None and s in st.produced:
                st.mark_mutated(s, func, regions, t)
                cached = False  # the write is redone on the rebuilt buffer
            elif s is not None:
                external_writes.append((s, t))
        for t in writes.out:
            s = _storage(t)
            if s is not None and s in st.produced:
                st.mark_mutated(s, func, regions, t)
        if external_writes and kept and torch.is_grad_enabled() and not writes.has_out:
            # Whatever the policy: a kept region's write into a tensor from outside
            # the scope (a buffer, an input) happens once, in the forward.
            cached = True
        entry = _Entry(func, regions, cached, inputs=inputs, rng_state=rng, shrink_of=shrink_of)
        if external_writes and cached:
            entry.served_write = _kept_external_write(st, func, regions, external_writes)
            cached = entry.cached = entry.served_write is None and cached
        out_storages = _tensor_storages(out)
        if entry.served_write is not None:
            st.stats.cached_ops += 1
        elif cached:
            entry.value = tree_map(lambda x: _VersionWrapper(detach_helper(x)), out)
            entry.storages = out_storages
            for s in out_storages:
                st.by_storage[s].append(entry)
            if getattr(func, "overloadpacket", None) in MATMULS and shrink_of is None:
                for t in _tensors(out):
                    st.matmul_bytes[_storage(t)] = t.untyped_storage().nbytes()
            st.stats.cached_ops += 1
        else:
            entry.storages = out_storages
            if not (writes.in_place or writes.out or is_collective(func)) and _all_float_tensors(out):
                entry.skippable = True
                entry.value = tree_map(lambda x: _Geometry(x) if isinstance(x, torch.Tensor) else x, out)
            for t in _tensors((args, kwargs)):
                st.read_by_recomputed.add_tensor(t)
            st.stats.recomputed_ops += 1
        for t in _tensors(out):
            # lift_fresh returns its input: a torch.tensor(...) literal made in the scope
            if _storage(t) not in inputs or func in _LIFT_FRESH:
                st.produced.add_tensor(t)
        if random or any(s in st.random_derived for s in inputs):
            for t in _tensors(out) + writes.in_place:
                st.random_derived.add_tensor(t)
        st.entries[sac_storage_key(func, args)].append(entry)
        st.order.append(entry)
        return out


def _shrinking_read(
    st: _State, func: Any, args: tuple, kwargs: dict, inputs: tuple[int, ...], out: Any, writes: _Writes
) -> int | None:
    """The cached matmul output ``func`` reads and is at most half the size of, if it is a
    cheap, deterministic, non-writing, non-view op with floating-point outputs."""
    if (
        getattr(func, "is_view", False)
        or is_costly(func)
        or _is_random(func, args, kwargs)
        or is_collective(func)
    ):
        return None
    if writes.in_place or writes.out or not _all_float_tensors(out):
        return None
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(out))
    return next((s for s in inputs if 2 * nbytes <= st.matmul_bytes.get(s, 0)), None)


class _CachedMode(TorchDispatchMode):
    supports_higher_order_operators = True

    def __init__(self, state: _State) -> None:
        super().__init__()
        self.state = state
        self.counter: Counter = Counter()

    def __enter__(self):
        self.counter.clear()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        st = self.state
        session = _SESSION.get()
        kept = session is not None and session.kept()
        st.stats.intercepted["recompute", "kept" if kept else "outside"] += 1
        if func in _IGNORED or _autocast_weight_cast(func, args):
            return func(*args, **kwargs)
        key = sac_storage_key(func, args)  # the op; per compiled region for Inductor's code
        idx = self.counter[key]
        self.counter[key] += 1
        entries = st.entries.get(key, [])
        if idx >= len(entries):
            raise RuntimeError(
                f"sac_compile: {func} ran during recompute but not in the forward "
                "(the checkpointed function is not deterministic in the ops it runs)"
            )
        e = entries[idx]
        if e.served_write is not None:
            # a kept write into a tensor from outside the scope: it happened once, in
            # the forward; hand back the written argument without writing again
            return e.served_write(args, kwargs)
        if e.cached or e.dead:
            # a fresh alias per recompute (autograd attaches view metadata to what it
            # gets); a dropped output, or a dead op's, gets a stand-in of its geometry,
            # which nothing reads
            out = tree_map(lambda leaf: _serve_leaf(leaf, st), e.value)
            return out
        if any(s in st.stand_ins for s in _tensor_storages((args, kwargs))):
            raise AssertionError(
                f"sac_compile internal error: {func} would read a dropped cache entry during recompute; "
                "please report this with the model"
            )
        if e.rng_state is not None:
            _set_rng_state(e.rng_state)
        out = func(*args, **kwargs)
        if communicates(func):
            _wait_functional(func, out)
        return out


def _serve_leaf(leaf: Any, st: _State) -> Any:
    if isinstance(leaf, _VersionWrapper):
        val = leaf.get_val(False)
        return detach_helper(val) if isinstance(val, torch.Tensor) else val
    if isinstance(leaf, _Geometry):
        t = torch.empty_strided(leaf.shape, leaf.stride, dtype=leaf.dtype, device=leaf.device)
        st.stand_ins.add_tensor(t)
        return t
    return leaf
