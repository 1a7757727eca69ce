"""What one eager checkpointed call remembers between its forward and its recompute:
an entry per op, the engine's statistics, and the end-of-forward liveness walk."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from .._compat.checkpoint import VersionWrapper as _VersionWrapper
from .._compat.checkpoint import storage_holders, storage_tensor
from .._compat.tensors import storage_id, version
from ..keep import NO_REGION, RNG
from .host_copy import LayerOffload, offloading, shared_spans, to_host
from .op_facts import Geometry, StorageSet, byte_span, flat_leaves, map_leaves, storage_of, untyped_storage_of

__all__ = ["EngineStats"]


class Entry:
    """One op of a kept span (one is made per op: a plain class, its defaults on the class)."""

    value: Any = None  # tree of _VersionWrapper when cached
    storages: tuple[int, ...] = ()
    dropped: bool = False  # every output dropped (the recompute gets stand-ins)
    # a recomputed op whose outputs are all floating-point tensors and that writes nothing:
    # the recompute may skip it when nothing live reads it (value then holds Geometry leaves)
    skippable: bool = False
    dead: bool = False  # skipped in the recompute (see EngineState.finalize)
    # a random op's RNG state after its draw: set in the recompute where the draw is
    # skipped (served or dead), so the ops after it draw what they drew in the forward
    rng_after: Any = None
    served_write: Any = None  # (args, kwargs) -> result, for kept writes into outside tensors
    write_refs: tuple[Any, ...] = ()  # (of a served write) the storages it wrote, weakly
    write_spans: tuple[Any, ...] = ()  # (of a served write) the byte span it wrote in each: byte_span

    def __init__(
        self,
        func: Any,
        regions: tuple[str, ...],
        cached: bool,
        inputs: tuple[int, ...] = (),
        shrink_of: int | None = None,
        span: int = 0,
    ) -> None:
        self.func = func
        self.regions = regions
        self.cached = cached
        self.inputs = inputs
        self.shrink_of = shrink_of  # cached as a small read of this cached matmul output
        self.span = span  # the kept span it ran in (1, 2, ... in program order)


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
    held_bytes: int = 0  # bytes of cached values held after the forward (on the device)
    held_by_region: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # cached values of offloaded regions, copied to host memory at the end of the forward
    offloaded_bytes: int = 0
    offloaded_by_region: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    regions_entered: Counter[str] = field(default_factory=Counter)
    unbalanced: list[tuple[str, str]] = field(
        default_factory=list
    )  # (region, "enter without exit" | "exit without enter")
    # ops the engine's dispatch modes intercepted, by (pass, where): pass "forward" or
    # "recompute", where "kept" (a kept region was open) or "outside" (none: 0, the mode
    # is pushed for kept spans only) or "watch" (a recompute that serves kept writes into
    # outside tensors watches reads until they are served); the recompute's counts grow
    # when the backward runs.
    intercepted: Counter[tuple[str, str]] = field(default_factory=Counter)
    spans: int = 0  # kept spans: stretches of the forward with a kept region open
    # kept module bodies (policy SAVE_ALL, eager/kept_bodies.py): "skipped" in the recompute
    # (their outputs handed back), "rerun" there, or "unreached" (early stop)
    bodies: Counter[str] = field(default_factory=Counter)

    @property
    def forced_collectives(self) -> int:
        """Collectives in kept regions, recomputed anyway."""
        return sum(forced for _, _, forced in self.collectives)


class EngineState:
    """Shared by the caching (forward) and cached (recompute) modes of one call."""

    def __init__(self, preserve_rng_state: bool) -> None:
        self.preserve_rng_state = preserve_rng_state
        self.entries: dict[Any, list[Entry]] = defaultdict(list)
        self.matmul_bytes: dict[int, int] = {}  # storage of a cached matmul output -> its bytes
        self.order: list[Entry] = []  # every entry in program order (for liveness)
        self.by_storage: dict[int, list[Entry]] = defaultdict(list)
        self.produced = StorageSet()  # storages created by ops in this scope
        self.saved_storages = StorageSet()  # what autograd saved for backward
        self.stats = EngineStats()
        self.forward_done = False
        self.stand_ins = StorageSet()  # dropped entries' stand-ins (recompute)
        self.needed_storages: set[int] = set()  # read by autograd or by a recomputed op
        # storages holding random numbers or values computed from them
        self.random_derived = StorageSet()
        self.span = 0  # the kept span running now (forward)
        self.span_entries: list[Entry] = []
        self.span_produced: list[int] = []
        # storages made in a kept span and still held by a tensor when it ended (-> the
        # span): ops outside kept regions, which the engine does not see, may read them
        self.escaped: dict[int, int] = {}
        self.spans_ended = 0
        self.packed_after = 0  # spans ended when autograd last saved a tensor
        self.packs = 0  # tensors the checkpoint saved so far (forward)
        self.pack_hook: Any = None  # (forward) our pack hook, on top of the checkpoint's
        self.early_stop = True  # the checkpoint stops its recompute at the last saved tensor
        self.where = ("", "")  # (name, hint) of the checkpointed function, for recompute errors
        self.recompute_hooks = 1  # saved-tensor hook pairs the recompute pushed: the checkpoint's, ours
        self.write_targets = StorageSet()  # written by served writes (outside tensors)
        # (regions open) -> whether an op's cached value goes to host memory (Actions.offloads)
        self.offloads: Any = None
        self.offloaded: LayerOffload | None = None  # the cached values it sent to host memory
        # (recompute) served writes into outside tensors still ahead:
        # storage -> [(the write, the byte span it writes there)]
        self.pending_writes: dict[int, list[tuple[Entry, tuple[int, int]]]] = {}

    # -- forward bookkeeping --------------------------------------------------
    def mark_needed(self, storages: Any) -> None:
        self.needed_storages.update(storages)

    def add_produced(self, storage: Any) -> None:
        self.produced.add_storage(storage)
        self.span_produced.append(storage_id(storage))

    def span_start(self) -> None:
        self.span += 1
        self.stats.spans += 1

    def span_end(self) -> None:
        """A kept span ended (forward): note the storages it made that a tensor still holds.

        Nothing outside the span can read a storage no tensor holds any more except through
        what autograd saved (seen by the pack hook) or our own cached aliases; every other
        storage the span made may be read by unwatched ops later (see :meth:`_escaped_needed`)."""
        ours = _our_aliases(self.span_entries)
        for s in self.span_produced:
            ref = self.produced.ref(s)
            if ref is not None and storage_holders(ref) > ours[s]:
                self.escaped[s] = self.span
        self.spans_ended = self.span
        self.span_entries.clear()
        self.span_produced.clear()

    def _escaped_needed(self) -> set[int]:
        """The escaped storages the recompute may read: those of spans after which autograd
        saved something. The checkpoint stops its recompute at the last tensor autograd
        saved (early stop, on by default), so the ops after a span with no save after it
        never run again, and what only they read is not needed."""
        if not self.early_stop:
            return set(self.escaped)
        return {s for s, span in self.escaped.items() if self.packed_after >= span}

    def note_external_writes(self, e: Entry, targets: list[torch.Tensor]) -> None:
        for t in targets:
            self.write_targets.add_tensor(t)
        e.write_refs = tuple(self.write_targets.ref(storage_of(t)) for t in targets)
        e.write_spans = tuple(byte_span(t) for t in targets)

    # -- recompute -----------------------------------------------------------
    def start_recompute(self) -> bool:
        """Whether this recompute must watch reads of outside tensors written by served writes."""
        # Every served write is skipped, so the recompute finds each outside tensor as the
        # forward's last write left it: a read sees what the forward read unless a served
        # write still ahead of it (in program order) writes bytes it reads. Each served
        # write stays pending until it is reached, with the bytes it writes.
        if self.offloaded is not None:
            self.offloaded.prefetch()  # (copied back as the recompute starts, and the next layer's)
        self.pending_writes = {}
        for e in self.order:
            if e.served_write is not None:
                for ref, span in zip(e.write_refs, e.write_spans, strict=True):
                    if ref is not None and not ref.expired():
                        self.pending_writes.setdefault(ref.cdata, []).append((e, span))
        return bool(self.pending_writes)

    @staticmethod
    def same_write_targets(e: Entry, targets: list[torch.Tensor]) -> bool:
        """Whether a served write's targets in the recompute are the forward's tensors (from
        outside the checkpoint), not ones the recompute made anew (outside kept regions)."""
        return len(targets) == len(e.write_refs) and all(
            ref is not None and not ref.expired() and ref.cdata == storage_of(t)
            for ref, t in zip(e.write_refs, targets, strict=True)
        )

    def served_external_write(self, e: Entry) -> None:
        for ref in e.write_refs:
            pending = self.pending_writes.get(ref.cdata)
            if pending is not None:
                pending[:] = [(w, span) for w, span in pending if w is not e]
                if not pending:
                    del self.pending_writes[ref.cdata]

    def check_read(self, storage: int, t: torch.Tensor, reader: Any) -> None:
        """(recompute) ``reader`` reads ``t``, on a storage with served writes still ahead:
        raise if one of them writes bytes ``t`` spans (in the forward it read them before
        that write; here it would read them after). Byte spans, not elements: a read that
        interleaves with a write (every other column) without sharing an element raises too."""
        start, end = byte_span(t)
        for e, (w_start, w_end) in self.pending_writes[storage]:
            if start < w_end and w_start < end:
                self._read_before_served_write(e, reader)

    @staticmethod
    def _read_before_served_write(e: Entry, reader: Any) -> None:
        raise RuntimeError(
            f"sac_compile: {e.func} writes in place, in kept region(s) {'+'.join(e.regions)}, into a "
            f"tensor from outside the checkpoint that {reader} read earlier in the checkpointed "
            "function; the write happens once, in the forward, so the recompute would read the "
            "written value. Move the write out of the kept region, or out of the checkpointed function."
        )

    def _keep_or_drop(self, leaf: Any) -> Any:
        if isinstance(leaf, _VersionWrapper) and isinstance(leaf.val, torch.Tensor):
            t = leaf.val
            if storage_of(t) not in self.needed_storages and (t.is_floating_point() or t.is_complex()):
                return Geometry(t)
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

    def _settle_shrinking_reads(self, escaped: set[int]) -> None:
        """Keep the small reads of a cached matmul output cached only if every read is one
        and together they are at most half its size (Note [small reads of a kept matmul]
        in passes/saving_rules.py).

        Then the recompute never reads the matmul output and it is dropped (unless autograd
        saved it); otherwise the reads are recomputed from it as usual. Eagerly only reads in
        the kept span count: when a tensor still holds the output as the span ends, ops
        outside kept regions (which the engine does not see) may read it, and it is held. The compiled pass
        applies the same rule (``passes.saving_rules.save_small_reads_of_kept_matmuls``).
        """
        readers: dict[int, list[Entry]] = defaultdict(list)
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
            # (if it escaped its kept span, unwatched ops may read it too: it is held)
            if (
                s not in saved
                and s not in self.escaped
                and small
                and all(e.shrink_of == s and e.cached for e in found)
            ):
                continue
            for e in found:
                if e.shrink_of == s and e.cached:
                    e.cached, e.value, e.shrink_of = False, None, None
                    self.stats.cached_ops -= 1
                    self.stats.recomputed_ops += 1

    def _uncache_written_since(self) -> None:
        """A cached value written in place after it was cached, outside kept regions (where
        no write is seen): its version counter moved. Recompute it, and the write with it."""
        for e in self.order:
            if e.cached and any(
                w.version is not None and version(w.val) != w.version for w in _wrappers(e.value)
            ):
                e.cached, e.value, e.shrink_of = False, None, None
                self.stats.mutated_recomputes += 1

    def end_recompute(self) -> None:
        """Let the copies back go that the recompute did not serve (it stopped early)."""
        if self.offloaded is not None:
            self.offloaded.drop()

    def finalize(self) -> None:
        """End of the forward: find the live recomputed ops, drop cached values nothing will read."""
        self.forward_done = True
        self._uncache_written_since()
        # Every storage autograd saved, freed or not: the checkpoint's pack hook keeps no
        # reference, so what only autograd saved is already freed here, and the recompute
        # must rebuild it. (A reused address can only make more ops live.)
        self.mark_needed(self.saved_storages.ever())
        escaped = self._escaped_needed()
        self.mark_needed(escaped)
        self._settle_shrinking_reads(escaped)
        for e in reversed(self.order):
            if e.cached:
                continue  # served in the recompute: it reads nothing
            if (
                e.skippable
                and e.served_write is None
                and not any(s in self.needed_storages for s in e.storages)
            ):
                e.dead = True
                self.stats.skipped_ops += 1
                continue
            # (a served write runs again if the recompute made its target anew)
            e.skippable, e.value = False, None
            self.mark_needed(e.inputs)
        seen: set[int | None] = set()  # (s in self.produced is False for None)
        offloaded: list[Entry] = []  # (entries whose cached values go to host memory)
        for e in self.order:
            if e.rng_after is not None:
                if not (e.cached or e.dead or e.served_write is not None):
                    e.rng_after = None  # it draws again in the recompute: in step by itself
                else:
                    nbytes = sum(t.numel() * t.element_size() for _, t in e.rng_after)
                    self.stats.held_bytes += nbytes
                    self.stats.held_by_region[RNG] += nbytes
            if not e.cached:
                continue
            # Per output: a value is dropped when nothing reads it. Only
            # floating-point values: Python can read integer results
            # (indices) without an aten op (.tolist()), which we cannot see.
            e.value = map_leaves(self._keep_or_drop, e.value)
            if e.storages and not _cached_tensors(e.value):
                e.dropped = True
                self.stats.dropped_ops += 1
                continue
            host = self.offloads is not None and self.offloads(e.regions)
            for t in _cached_tensors(e.value):
                s = storage_of(t)
                # a view of an input or parameter costs no memory of its own
                if s not in seen and s in self.produced:
                    seen.add(s)
                    # (offloaded: the elements copied, of a DTensor its shard's)
                    inner = storage_tensor(t)
                    nbytes = inner.numel() * inner.element_size() if host else untyped_storage_of(t).nbytes()
                    key = "+".join(e.regions) or NO_REGION
                    if host:
                        self.stats.offloaded_bytes += nbytes
                        self.stats.offloaded_by_region[key] += nbytes
                    else:
                        self.stats.held_bytes += nbytes
                        self.stats.held_by_region[key] += nbytes
            if host:
                offloaded.append(e)
        self._offload(offloaded)
        self._release_forward_refs()

    def _offload(self, entries: list[Entry]) -> None:
        """Send ``entries``' cached values to host memory (:mod:`.host_copy`): their device
        memory goes once nothing else holds it (the checkpoint does not). A value whose storage
        a tensor outside the engine still holds (the layer's output, say) may be written after
        the forward: those are copied first, and the compute stream waits for their copies."""
        if not entries:
            return
        ours = _our_aliases(self.order)

        def held_outside(e: Entry) -> bool:
            for t in _cached_tensors(e.value):
                s = storage_of(t)
                ref = self.produced.ref(s)
                if ref is None or storage_holders(ref) > ours[s]:  # (not made here: an input's)
                    return True
            return False

        outside = [held_outside(e) for e in entries]
        with offloading() as batch:
            self.offloaded = batch
            made = [t for e in entries for t in _cached_tensors(e.value) if storage_of(t) in self.produced]
            batch.spans = shared_spans(made)
            for fenced in (True, False):
                for e, held in zip(entries, outside, strict=True):
                    if held == fenced:
                        e.value = map_leaves(lambda leaf: to_host(leaf, batch, self.produced), e.value)
                if fenced:
                    batch.fence()

    def _release_forward_refs(self) -> None:
        """Drop the weak references only the forward reads (Note [weak references to storages])."""
        # Note [weak references to storages]
        # A weak reference to a storage keeps its C++ object alive (not its memory). The
        # forward holds one per storage a kept span made and per tensor autograd saved, so
        # that an address freed and reused within the forward is not mistaken for the first
        # storage. Held on to the end of the backward, those small objects sit between the
        # freed activations and fragment glibc's heap: the backward then allocates fresh
        # pages instead of reusing them (a Qwen3-MoE layer keeping nothing: backward 2.8 ms,
        # 8%, slower than full recompute's). The recompute needs none of them.
        self.produced = StorageSet()
        self.saved_storages = StorageSet()
        self.random_derived = StorageSet()


def _our_aliases(entries: list[Entry]) -> Counter[int | None]:
    """Per storage, how many of the cached aliases of ``entries`` hold it (a storage a tensor
    holds beyond these, ``storage_holders``, is held outside the engine)."""
    ours: Counter[int | None] = Counter()
    for e in entries:
        if e.cached:
            for t in _cached_tensors(e.value):
                ours[storage_of(t)] += 1
    return ours


def _cached_bytes(e: Entry) -> int:
    return sum(t.numel() * t.element_size() for t in _cached_tensors(e.value)) if e.cached else 0


def _wrappers(value: Any) -> list[_VersionWrapper]:
    """The cached aliases in an entry's value (a leaf, or a tree of leaves)."""
    leaves = flat_leaves(value) if isinstance(value, (tuple, list, dict)) else (value,)
    return [w for w in leaves if isinstance(w, _VersionWrapper)]


def _cached_tensors(value: Any) -> list[torch.Tensor]:
    return [w.val for w in _wrappers(value) if isinstance(w.val, torch.Tensor)]
