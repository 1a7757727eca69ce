"""Measurements that check reports independently: the bytes held for the backward (seen by
autograd's hooks and by the garbage collector), and collectives counted by a dispatch mode."""

from __future__ import annotations

import gc
import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, Protocol, cast

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .._compat.checkpoint import TorchDispatchMode, storage_tensor
from .._compat.tensors import storage_id
from ..op_classes import communicates

__all__ = ["autograd_saved_bytes", "collectives_run"]


class _StorageRef(Protocol):
    """A ``StorageWeakRef`` as read here (torch leaves it unannotated)."""

    def expired(self) -> bool: ...


def _weak_ref(storage: torch.UntypedStorage) -> _StorageRef:
    return cast(_StorageRef, cast(Any, StorageWeakRef)(storage))


def _storage(t: torch.Tensor) -> tuple[int, _StorageRef, int, str] | None:
    """``(address, weak reference, bytes, device)`` of the storage holding ``t``'s bytes (a tensor
    subclass's, a DTensor's: its inner tensor's, Note [tensor subclasses in the eager engine]
    in sac_compile/_compat/checkpoint.py)."""
    try:
        s = storage_tensor(t).untyped_storage()
    except (NotImplementedError, RuntimeError):
        return None
    if s.device.type == "meta":
        return None  # a fake tensor of a trace
    return storage_id(s), _weak_ref(s), s.nbytes(), str(s.device)


def _live_storages() -> dict[int, tuple[_StorageRef, int, str]]:
    """Every storage a Python tensor object that the collector tracks (not frozen) references now."""
    gc.collect()
    found = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): reading __class__ of some objects warns (torch.distributed.reduce_op)
        if issubclass(type(obj), torch.Tensor) and (s := _storage(obj)) is not None:
            found[s[0]] = s[1:]
    return found


def _on(device: torch.device, where: torch.device) -> bool:
    return where.type == device.type and device.index in (None, where.index)


def autograd_saved_bytes(
    fn: Callable[..., Any],
    *args: Any,
    exclude: Iterable[torch.Tensor] = (),
    warmup: bool = True,
    device: torch.device | str | None = None,
) -> int:
    """Bytes of the distinct storages held for the backward once ``fn(*args)`` has returned.

    Counted whatever runs ``fn`` (unwrapped, compiled, or checkpointed by the eager
    engine), from two independent sightings: what autograd saves (``saved_tensors_hooks``:
    the eager and compiled graphs' saved values), and every storage made during the call
    that a live Python object still references afterwards (the garbage collector: what a
    checkpoint holds, its inputs and RNG state, and the eager engine's cache, which
    autograd's hooks never see). Storages of ``fn``'s output and of the tensors in
    ``exclude`` (pass the parameters) are left out. A storage counts at its size once ``fn``
    has returned, so one freed in place during the call (FSDP2 resizes the unsharded
    parameters a layer's graph saves to 0 after its forward) holds nothing. Runs ``fn(*args).sum().backward()``,
    first once unmeasured when ``warmup`` (what a first call makes and keeps — a
    compilation's constants, lazy state — is not held for the backward); gradients
    accumulate accordingly. Agrees with ``torch.profiler``'s memory events within 1%
    (``tests/test_hf_families.py``). A heap frozen with ``gc.freeze()`` is unfrozen (every
    tensor must be seen) and left so: freeze it again after the call if you want it frozen.
    ``device`` (``"cuda:0"``, a ``torch.device``): count only the storages on it -- a region's
    offloaded values are on the host (``"cpu"``), the rest on the device. On a CPU the host is
    the device: ``device="cpu"`` counts both.
    """
    exclude = list(exclude)
    if warmup:
        fn(*args).sum().backward()
    skip = {s[0] for t in exclude if (s := _storage(t)) is not None}
    # A heap frozen by the caller (gc.freeze(): a trainer's, this project's tests') is unfrozen,
    # so that the first sighting sees every tensor (it walks the collector's generations only)
    gc.unfreeze()
    before = _live_storages()
    packed: dict[int, tuple[_StorageRef, int, str, weakref.ref[Any]]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = _storage(t)
        if s is not None:
            packed[s[0]] = (*s[1:], weakref.ref(t))
        return t

    # What exists now is frozen for the call (gc.freeze), so that the second scan walks
    # only the objects the call made: a test process holds millions. (A storage made in
    # the call that only an older tensor object references -- one `set_` to new memory --
    # is missed by this sighting; autograd's hooks still see it if it is saved.)
    gc.freeze()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(*args)
        after = _live_storages()
    finally:
        gc.unfreeze()
    # Garbage the call left in reference cycles with objects older than the call (frozen, so
    # not collected by the sighting: a cache entry dropped during the call, say) holds its
    # tensors until a full collection: one more storage of 4096 B in some runs of a
    # tensor-parallel layer's measurement (tests/test_tensor_parallel.py). It is collected
    # now, and a storage it freed (expired below) is not held for the backward.
    gc.collect()
    made = {c: v for c, v in after.items() if c not in before or before[c][0].expired()}
    if (s := _storage(out)) is not None:
        skip.add(s[0])  # the output is fn's, not held for the backward
    # A saved storage counts at its size once fn has returned: one that was freed in place
    # meanwhile (FSDP's resharding: the unsharded parameters a compiled graph saves are
    # resized to 0 after the layer's forward and gathered again for its backward) holds nothing.
    # (Where the Python object is gone, autograd holds the tensor alone: its size when packed.)
    for c, (ref, n, where, saved) in packed.items():
        t = saved()
        made[c] = (ref, s[2] if t is not None and (s := _storage(t)) is not None else n, where)
    on = None if device is None else torch.device(device)
    held = {
        c: n
        for c, (ref, n, where) in made.items()
        if c not in skip and not ref.expired() and (on is None or _on(on, torch.device(where)))
    }
    out.sum().backward()
    return sum(held.values())


def collectives_run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, Counter[str]]:
    """Run ``fn(*args, **kwargs)`` and count the collectives it runs, by op.

    Counts ``c10d`` / ``_c10d_functional`` communication ops (not ``wait_tensor``
    and the async wrapper) seen by a ``TorchDispatchMode``, including those a
    backward run inside ``fn`` executes (autograd carries the mode into the
    backward) and those that compiled code calls (Inductor and ``aot_eager``
    call collectives as ops). Returns ``(fn's result, Counter)``.
    """
    counts: Counter[str] = Counter()

    class _Count(TorchDispatchMode):
        supports_higher_order_operators = True

        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
        ) -> Any:
            if communicates(func):
                counts[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        out = fn(*args, **kwargs)
    return out, counts
