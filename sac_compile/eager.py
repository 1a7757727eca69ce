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

Relies on ``torch.utils.checkpoint`` internals: ``_VersionWrapper`` and
``_detach_helper`` (version-checked detached aliases), and on
``torch._C._autograd._top_saved_tensors_default_hooks`` to chain our pack hook
in front of the checkpoint's own (so that we see what autograd saves).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import _detach_helper, _VersionWrapper, checkpoint

from . import ops
from ._torch_internals import running_compiled_code
from .keep import KeepSet
from .policy import MATMULS, SAVE_COSTLY, RegionPolicy, checked_decision, is_costly, saves

__all__ = ["EagerSession", "EngineStats", "checkpoint_with_regions"]

_IGNORED = {torch.ops.aten.detach.default, torch.ops.prim.device.default} | set(ops.MARKER_OPS)
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
# recomputed with their collective, but not communication themselves
_COLLECTIVE_COMPANIONS = frozenset(
    {"_c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd"}
)
_LIFT_FRESH = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}


class EagerSession:
    """Open regions while a checkpointed function runs (one per forward / recompute)."""

    def __init__(self, keep: KeepSet, policy: RegionPolicy = SAVE_COSTLY) -> None:
        self.keep = keep
        self.policy = policy
        self.open: Counter[str] = Counter()
        self.entered: Counter[str] = Counter()
        self.unbalanced: list[tuple[str, str]] = []

    def sink(self, kind: str, payload: tuple) -> None:
        if kind == "region_enter":
            self.open[payload[0]] += 1
            self.entered[payload[0]] += 1
        elif kind == "region_exit":
            # an exit without an enter is a no-op here (nothing was open)
            if self.open[payload[0]] > 0:
                self.open[payload[0]] -= 1
            else:
                self.unbalanced.append((payload[0], "exit without enter"))

    def close(self) -> list[tuple[str, str]]:
        """End of the checkpointed call: the unbalanced markers seen in it."""
        left_open = [(n, "enter without exit") for n, c in sorted(self.open.items()) for _ in range(c)]
        return self.unbalanced + left_open

    def open_names(self) -> tuple[str, ...]:
        return tuple(sorted(n for n, c in self.open.items() if c > 0))

    def kept(self) -> bool:
        return any(n in self.keep for n, c in self.open.items() if c > 0)

    def saves(self, func: Any, regions: tuple[str, ...]) -> bool:
        """Whether the region policy saves ``func`` run with ``regions`` (this session's
        :meth:`open_names`) open; outside every region, never."""
        return bool(regions) and saves(checked_decision(self.policy, func, regions, self.keep))


_SESSION: contextvars.ContextVar[EagerSession | None] = contextvars.ContextVar(
    "sac_compile_eager_session", default=None
)


@dataclass
class _Entry:
    func: Any
    regions: tuple[str, ...]
    cached: bool
    value: Any = None  # tree of _VersionWrapper when cached
    storages: tuple[int, ...] = ()
    inputs: tuple[int, ...] = ()
    dropped: bool = False  # every output dropped (the recompute gets stand-ins)
    # a recomputed op whose outputs are all floating-point tensors and that writes nothing:
    # the recompute may skip it when nothing live reads it (value then holds _Geometry leaves)
    skippable: bool = False
    dead: bool = False  # skipped in the recompute (see _State.finalize)
    shrink_of: int | None = None  # cached as a small read of this cached matmul output
    rng_state: Any = None
    served_write: Any = None  # (args, kwargs) -> result, for kept writes into outside tensors


@dataclass
class EngineStats:
    """What one checkpointed call did (for parity reports and diagnostics)."""

    cached_ops: int = 0
    recomputed_ops: int = 0
    dropped_ops: int = 0
    skipped_ops: int = 0  # recomputed ops nothing live reads: skipped in the recompute
    # (regions open, op name, forced: in a kept region, recomputed anyway) of every
    # collective this call ran, in order
    collectives: list[tuple[tuple[str, ...], str, bool]] = field(default_factory=list)
    mutated_recomputes: int = 0
    held_bytes: int = 0  # bytes of cached values held after the forward
    held_by_region: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    regions_entered: Counter = field(default_factory=Counter)
    unbalanced: list = field(default_factory=list)  # (region, "enter without exit" | "exit without enter")

    @property
    def forced_collectives(self) -> int:
        """Collectives in kept regions, recomputed anyway."""
        return sum(forced for _, _, forced in self.collectives)


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):
        return None


class _StorageSet:
    """Storages by address, ignoring addresses whose storage has since been freed.

    A freed storage's address is soon reused by a new tensor; weak references
    tell the two apart.
    """

    def __init__(self) -> None:
        self._refs: dict[int, StorageWeakRef] = {}

    def add_tensor(self, t: torch.Tensor) -> None:
        try:
            ref = StorageWeakRef(t.untyped_storage())
        except (NotImplementedError, RuntimeError):
            return
        self._refs[ref.cdata] = ref

    def __contains__(self, cdata: object) -> bool:
        ref = self._refs.get(cdata)  # type: ignore[arg-type]
        return ref is not None and not ref.expired()

    def ever(self) -> tuple[int, ...]:
        """Every storage ever added, freed or not."""
        return tuple(self._refs)

    def live(self) -> tuple[int, ...]:
        return tuple(c for c, r in self._refs.items() if not r.expired())


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _tensor_storages(tree: Any) -> tuple[int, ...]:
    out = []
    for t in tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            s = _storage(t)
            if s is not None:
                out.append(s)
    return tuple(out)


@dataclass
class _Writes:
    """What an op writes, read off its schema (not its name)."""

    in_place: list[torch.Tensor]  # ``alias_info.is_write`` on a non-``out`` argument
    out: list[torch.Tensor]  # ``out=`` arguments
    # An ``out=`` variant writes its result into a caller's buffer: never served
    # from the cache, since in the recompute the buffer may be a new one
    # (Inductor's extern kernels allocate theirs), which only re-running fills.
    has_out: bool


def _writes(func: Any, args: tuple, kwargs: dict) -> _Writes:
    writes = _Writes([], [], False)
    schema = getattr(func, "_schema", None)
    if schema is None:
        return writes
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if not arg.is_out and (info is None or not info.is_write):
            continue
        passed = arg.name in kwargs or i < len(args)
        value = kwargs.get(arg.name, args[i] if i < len(args) else None)
        tensors = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
        if arg.is_out:
            writes.out.extend(tensors)
            writes.has_out = writes.has_out or passed
        else:
            writes.in_place.extend(tensors)
    return writes


def _served_write(func: Any):
    """For a kept in-place write into an outside tensor: return that argument in the recompute.

    Only for ops that return nothing, or whose single return aliases the
    (first) written argument (``add_``, ``mul_``, ``copy_`` ...); None otherwise
    (the op is then cached as usual).
    """
    schema = func._schema
    rets = schema.returns
    index, arg = next(
        (
            (i, a)
            for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        ),
        (None, None),
    )
    if arg is None:
        return None
    if len(rets) == 0:
        return lambda args, kwargs: None
    if len(rets) == 1 and rets[0].alias_info is not None:
        if set(rets[0].alias_info.before_set) == set(arg.alias_info.before_set):
            return lambda args, kwargs: kwargs[arg.name] if arg.name in kwargs else args[index]
    return None


def _autocast_weight_cast(func: Any, args: tuple) -> bool:
    """autocast's cast of a leaf that requires grad (a parameter): autocast caches these casts
    for the length of its ``with`` block, so whether the op is dispatched at all depends on
    what ran before (the forward may find a cached cast, the recompute in a fresh autocast
    block will not). Such casts run, and are neither cached nor counted, in both modes: the
    recompute casts again (cheap), exactly as without checkpointing."""
    if func is not torch.ops.aten._to_copy.default or not args:
        return False
    t = args[0]
    # (torch.is_autocast_enabled() reads False here: autocast excludes its own dispatch key
    # while it redispatches the cast. Any cast of a grad-requiring leaf is treated alike.)
    return isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad


def _is_collective(func: Any) -> bool:
    """A ``c10d`` / ``_c10d_functional`` op, communication or companion (always recomputed)."""
    return getattr(func, "namespace", None) in _COLLECTIVE_NAMESPACES


def _communicates(func: Any) -> bool:
    """A collective proper (counted), as opposed to its wait / wrapper companions."""
    return _is_collective(func) and func._schema.name not in _COLLECTIVE_COMPANIONS


def _wait_functional(func: Any, out: Any) -> None:
    if func.namespace == "_c10d_functional":
        for t in _tensors(out):
            torch.ops._c10d_functional.wait_tensor.default(t)


def _is_random(func: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())


def _rng_state(tree: Any) -> tuple:
    """The RNG state a random op will draw from: an explicit generator's, else the defaults'."""
    generators = [g for g in tree_leaves(tree) if isinstance(g, torch.Generator)]
    if generators:
        return tuple((g, g.get_state()) for g in generators)
    devices = {t.device for t in tree_leaves(tree) if isinstance(t, torch.Tensor)}
    state = [("cpu", torch.get_rng_state())]
    for dev in devices:
        if dev.type == "cuda":
            state.append((dev, torch.cuda.get_rng_state(dev)))
    return tuple(state)


def _set_rng_state(state: tuple) -> None:
    for dev, s in state:
        if isinstance(dev, torch.Generator):
            dev.set_state(s)
        elif dev == "cpu":
            torch.set_rng_state(s)
        else:
            torch.cuda.set_rng_state(s, dev)


class _State:
    """Shared by the caching (forward) and cached (recompute) modes of one call."""

    def __init__(self, preserve_rng_state: bool) -> None:
        self.preserve_rng_state = preserve_rng_state
        self.entries: dict[Any, list[_Entry]] = defaultdict(list)
        self.matmul_bytes: dict[int, int] = {}  # storage of a cached matmul output -> its bytes
        self.order: list[_Entry] = []  # every entry in program order (for liveness)
        self.by_storage: dict[int, list[_Entry]] = defaultdict(list)
        self.produced = _StorageSet()  # storages created by ops in this scope
        self.saved_storages = _StorageSet()  # what autograd saved for backward
        self.stats = EngineStats()
        self.forward_done = False
        self.stand_ins = _StorageSet()  # dropped entries' stand-ins (recompute)
        self.needed_storages: set[int] = set()  # read by autograd or by a recomputed op
        self.read_by_recomputed = _StorageSet()  # tensors recomputed ops read
        # storages holding random numbers or values computed from them
        self.random_derived = _StorageSet()

    # -- forward bookkeeping --------------------------------------------------
    def mark_needed(self, storages: tuple[int, ...]) -> None:
        self.needed_storages.update(storages)

    def _keep_or_drop(self, leaf: Any) -> Any:
        if isinstance(leaf, _VersionWrapper) and isinstance(leaf.val, torch.Tensor):
            t = leaf.val
            if _storage(t) not in self.needed_storages and (t.is_floating_point() or t.is_complex()):
                return _Geometry(t)
        return leaf

    def mark_mutated(self, storage: int, func: Any, regions: tuple[str, ...], target: torch.Tensor) -> None:
        """A write into a value produced in this scope: recompute all cached values on it."""
        if storage in self.random_derived and not self.preserve_rng_state:
            cached = [e for e in self.by_storage.get(storage, ()) if e.cached]
            if cached:
                raise RuntimeError(
                    f"sac_compile: {func} writes in place into a tensor of shape {tuple(target.shape)} "
                    f"({target.dtype}) made by {cached[0].func} in region(s) "
                    f"{'+'.join(cached[0].regions) or '-'} from random numbers; the write forces it to be "
                    "recomputed, and with preserve_rng_state=False the recompute draws different numbers. "
                    "Pass preserve_rng_state=True, or write into a copy (y = y.clone()) first."
                )
        for e in self.by_storage.get(storage, ()):
            if e.cached:
                e.cached = False
                e.value = None
                self.stats.mutated_recomputes += 1

    def _settle_shrinking_reads(self) -> None:
        """Keep the small reads of a cached matmul output cached only if every read is one
        and together they are at most half its size.

        Then the recompute never reads the matmul output and it is dropped (unless autograd
        saved it); otherwise the reads are recomputed from it as usual. The compiled pass
        applies the same rule (``passes.saving_rules.save_small_reads_of_kept_matmuls``).
        """
        readers: dict[int, list[_Entry]] = defaultdict(list)
        for e in self.order:
            if getattr(e.func, "is_view", False):
                continue  # a view shares the storage: its readers are read off the storage too
            for s in set(e.inputs):
                if s in self.matmul_bytes and s not in e.storages:
                    readers[s].append(e)
        saved = set(self.saved_storages.ever())
        for s, found in readers.items():
            # (if autograd saved the matmul output - var_mean's gradient reads its input - it
            # is held anyway, and caching the small reads too would only add to it)
            small = 2 * sum(_cached_bytes(e) for e in found) <= self.matmul_bytes[s]
            if s not in saved and small and all(e.shrink_of == s and e.cached for e in found):
                continue
            for e in found:
                if e.shrink_of == s and e.cached:
                    e.cached, e.value, e.shrink_of = False, None, None
                    self.stats.cached_ops -= 1
                    self.stats.recomputed_ops += 1

    def finalize(self) -> None:
        """End of the forward: find the live recomputed ops, drop cached values nothing will read."""
        self.forward_done = True
        # Every storage autograd saved, freed or not: the checkpoint's pack hook keeps no
        # reference, so what only autograd saved is already freed here, and the recompute
        # must rebuild it. (A reused address can only make more ops live.)
        self.mark_needed(self.saved_storages.ever())
        self._settle_shrinking_reads()
        for e in reversed(self.order):
            if e.cached or e.served_write is not None:
                continue  # served in the recompute: it reads nothing
            if e.skippable and not any(s in self.needed_storages for s in e.storages):
                e.dead = True
                e.rng_state = None  # never replayed
                self.stats.skipped_ops += 1
                continue
            e.skippable, e.value = False, None
            self.mark_needed(e.inputs)
        seen: set[int] = set()
        for entries in self.entries.values():
            for e in entries:
                if e.cached:
                    e.rng_state = None  # served from the cache: its RNG state is never replayed
                elif e.rng_state is not None:
                    nbytes = sum(t.numel() * t.element_size() for _, t in e.rng_state)
                    self.stats.held_bytes += nbytes
                    self.stats.held_by_region["rng"] += nbytes
                if not e.cached:
                    continue
                # Per output: a value is dropped when nothing reads it. Only
                # floating-point values: Python can read integer results
                # (indices) without an aten op (.tolist()), which we cannot see.
                e.value = tree_map(self._keep_or_drop, e.value)
                if e.storages and not _cached_tensors(e.value):
                    e.dropped = True
                    self.stats.dropped_ops += 1
                    continue
                for t in _cached_tensors(e.value):
                    s = _storage(t)
                    # a view of an input or parameter costs no memory of its own
                    if s not in seen and s in self.produced:
                        seen.add(s)
                        nbytes = t.untyped_storage().nbytes()
                        self.stats.held_bytes += nbytes
                        key = "+".join(e.regions) or "-"
                        self.stats.held_by_region[key] += nbytes


def _cached_bytes(e: _Entry) -> int:
    return sum(t.numel() * t.element_size() for t in _cached_tensors(e.value)) if e.cached else 0


def _cached_tensors(value: Any) -> list[torch.Tensor]:
    return [
        w.val
        for w in tree_leaves(value, is_leaf=lambda x: isinstance(x, _VersionWrapper))
        if isinstance(w, _VersionWrapper) and isinstance(w.val, torch.Tensor)
    ]


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
        if func in _IGNORED or _autocast_weight_cast(func, args):
            return func(*args, **kwargs)
        st = self.state
        session = _SESSION.get()
        kept = session is not None and session.kept()
        regions = session.open_names() if session is not None else ()
        save = session is not None and session.saves(func, regions)
        inputs = _tensor_storages((args, kwargs))
        writes = _writes(func, args, kwargs)
        rng = None
        if _is_random(func) and st.preserve_rng_state:
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
            shrink_of = _shrinking_read(st, func, inputs, out, writes)
            cached = shrink_of is not None
        if _is_collective(func):
            if _communicates(func):
                # (a functional collective's forward runs with grad disabled, under its
                # autograd kernel: kept is what the region asked for)
                st.stats.collectives.append((regions, str(func.overloadpacket), kept))
            cached = False
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
            entry.value = tree_map(lambda x: _VersionWrapper(_detach_helper(x)), out)
            entry.storages = out_storages
            for s in out_storages:
                st.by_storage[s].append(entry)
            if getattr(func, "overloadpacket", None) in MATMULS and shrink_of is None:
                for t in _tensors(out):
                    st.matmul_bytes[_storage(t)] = t.untyped_storage().nbytes()
            st.stats.cached_ops += 1
        else:
            entry.storages = out_storages
            if not (writes.in_place or writes.out or _is_collective(func)) and _all_float_tensors(out):
                entry.skippable = True
                entry.value = tree_map(lambda x: _Geometry(x) if isinstance(x, torch.Tensor) else x, out)
            for t in _tensors((args, kwargs)):
                st.read_by_recomputed.add_tensor(t)
            st.stats.recomputed_ops += 1
        for t in _tensors(out):
            # lift_fresh returns its input: a torch.tensor(...) literal made in the scope
            if _storage(t) not in inputs or func in _LIFT_FRESH:
                st.produced.add_tensor(t)
        if _is_random(func) or any(s in st.random_derived for s in inputs):
            for t in _tensors(out) + writes.in_place:
                st.random_derived.add_tensor(t)
        st.entries[func].append(entry)
        st.order.append(entry)
        return out


def _shrinking_read(st: _State, func: Any, inputs: tuple[int, ...], out: Any, writes: _Writes) -> int | None:
    """The cached matmul output ``func`` reads and is at most half the size of, if it is a
    cheap, deterministic, non-writing, non-view op with floating-point outputs."""
    if getattr(func, "is_view", False) or is_costly(func) or _is_random(func) or _is_collective(func):
        return None
    if writes.in_place or writes.out or not _all_float_tensors(out):
        return None
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(out))
    return next((s for s in inputs if 2 * nbytes <= st.matmul_bytes.get(s, 0)), None)


def _all_float_tensors(out: Any) -> bool:
    leaves = tree_leaves(out)
    return bool(leaves) and all(
        isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) for t in leaves
    )


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
        if func in _IGNORED or _autocast_weight_cast(func, args):
            return func(*args, **kwargs)
        st = self.state
        idx = self.counter[func]
        self.counter[func] += 1
        entries = st.entries.get(func, [])
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
        if _communicates(func):
            _wait_functional(func, out)
        return out


class _Geometry:
    """Shape, strides, dtype and device of a dropped cached output."""

    __slots__ = ("device", "dtype", "shape", "stride")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.stride, self.dtype, self.device = t.shape, t.stride(), t.dtype, t.device


def _serve_leaf(leaf: Any, st: _State) -> Any:
    if isinstance(leaf, _VersionWrapper):
        val = leaf.get_val(False)
        return _detach_helper(val) if isinstance(val, torch.Tensor) else val
    if isinstance(leaf, _Geometry):
        t = torch.empty_strided(leaf.shape, leaf.stride, dtype=leaf.dtype, device=leaf.device)
        st.stand_ins.add_tensor(t)
        return t
    return leaf


@contextlib.contextmanager
def _chained_pack_hook(state: _State):
    """Note what autograd saves, then hand it to the checkpoint's own pack hook."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None:
        yield
        return
    outer_pack, outer_unpack = top

    def pack(t: torch.Tensor):
        state.saved_storages.add_tensor(t)
        return outer_pack(t)

    with torch.autograd.graph.saved_tensors_hooks(pack, outer_unpack):
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
