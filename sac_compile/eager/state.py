"""What one eager checkpointed call remembers between its forward and its recompute:
an entry per op, the engine's statistics, and the end-of-forward liveness walk."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from .._compat.checkpoint import VersionWrapper as _VersionWrapper
from .._compat.checkpoint import tree_leaves, tree_map
from ..keep import NO_REGION, RNG
from .op_facts import _Geometry, _storage, _StorageSet

__all__ = ["EngineStats"]


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
    rng_state: Any = None  # the RNG state before a random op, to replay it (see _drop_in_sync_rng)
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
    # ops the engine's dispatch modes intercepted, by (pass, where): pass "forward" or
    # "recompute", where "kept" (a kept region was open) or "outside"; the recompute's
    # counts grow when the backward runs. What issue #17 wants at 0: ("*", "outside").
    intercepted: Counter = field(default_factory=Counter)

    @property
    def forced_collectives(self) -> int:
        """Collectives in kept regions, recomputed anyway."""
        return sum(forced for _, _, forced in self.collectives)


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
        and together they are at most half its size (Note [small reads of a kept matmul]
        in passes/saving_rules.py).

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
                e.dead = True  # (its RNG state is dropped by _drop_in_sync_rng: never replayed)
                self.stats.skipped_ops += 1
                continue
            e.skippable, e.value = False, None
            self.mark_needed(e.inputs)
        self._drop_in_sync_rng()
        seen: set[int] = set()
        for entries in self.entries.values():
            for e in entries:
                if e.cached:
                    e.rng_state = None  # served from the cache: its RNG state is never replayed
                elif e.rng_state is not None:
                    nbytes = sum(t.numel() * t.element_size() for _, t in e.rng_state)
                    self.stats.held_bytes += nbytes
                    self.stats.held_by_region[RNG] += nbytes
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
                        key = "+".join(e.regions) or NO_REGION
                        self.stats.held_by_region[key] += nbytes

    def _drop_in_sync_rng(self) -> None:
        """Drop the RNG states the recompute reaches by itself.

        The checkpoint restores the forward's starting RNG state before the recompute
        (``preserve_rng_state``), and the recompute runs the ops in the forward's order; so
        a replayed random op with no random op served from the cache or skipped before it
        (since the start, or since the last replayed one) finds the generator exactly where
        the forward left it. Only the first replayed random op after a served or skipped one
        needs its state set (a CPU generator's state is 5,056 B, held per op until the
        backward).
        """
        in_sync = True
        for e in self.order:
            if e.rng_state is None:
                continue  # not a random op (or RNG state is not preserved: nothing is replayed)
            if e.cached or e.dead or e.served_write is not None:
                in_sync = False  # its draw is not replayed: the stream is behind from here
                if e.dead:
                    e.rng_state = None  # skipped in the recompute
            else:
                if in_sync:
                    e.rng_state = None
                in_sync = True


def _cached_bytes(e: _Entry) -> int:
    return sum(t.numel() * t.element_size() for t in _cached_tensors(e.value)) if e.cached else 0


def _cached_tensors(value: Any) -> list[torch.Tensor]:
    return [
        w.val
        for w in tree_leaves(value, is_leaf=lambda x: isinstance(x, _VersionWrapper))
        if isinstance(w, _VersionWrapper) and isinstance(w.val, torch.Tensor)
    ]
