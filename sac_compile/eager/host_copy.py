"""The eager engine's offloaded values: copies to host memory at the end of a checkpointed
call's forward and back for its recompute.

On CUDA the copies run on a side stream of the device (:class:`CudaCopies`), as PyTorch's
partitioner pass runs the compiled ones (``torch._functorch._activation_offloading``):

* **to the host**, at the end of a layer's forward: the side stream waits for the compute
  stream (the values are made there) and copies each value into pinned memory; the next
  layer's forward runs meanwhile. The values are held (not ``Tensor.record_stream``, which
  PyTorch's own offload ops avoid: with the CPU running ahead the allocator cannot reuse the
  recorded blocks and grows) until the compute stream has waited for their copies: before the
  next layer starts its own copies, or, for the last layer, as its recompute starts. So one
  layer's offloaded values stay on the device beyond the layer's forward. A value that a
  tensor outside the engine still holds (the layer's output, say) may be written by what runs
  next: those are copied first, and the compute stream waits for their copies at once
  (:meth:`LayerOffload.fence`).
* **back**, ahead of the layer's recompute: as a layer's recompute starts, every offloaded
  value of the layer the backward reaches next (the offloading layer before it in the forward,
  :data:`_LAYERS`) is copied back on the side stream (prefetched), behind this layer's
  backward; the compute stream waits for a value only where its recompute serves it. (The
  first layer in the backward has nothing before it: its copies start with its recompute.)
  As in PyTorch's ``ao.reload`` the device tensor is allocated on the compute stream, and the
  side stream waits for the compute stream before copying into it. A copy back the recompute
  did not serve (it stopped early) is awaited and let go as the recompute ends; a second
  recompute (``retain_graph``) copies back again, with its own recompute.

Views of one storage the layer cached (``SAVE_ALL`` caches a view beside its base) travel as
one copy of the span they cover and come back as views of one buffer (:class:`HostView`).

Elsewhere (a CPU: the host is the device) a value is cloned at once, and served as it is.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol, cast

import torch

from .._compat.checkpoint import VersionWrapper, map_inner
from .op_facts import StorageSet, byte_span, storage_of

__all__ = [
    "CudaCopies",
    "DeviceCopies",
    "HostCopy",
    "HostView",
    "LayerOffload",
    "copies_for",
    "offloading",
    "shared_spans",
    "to_host",
]


class DeviceCopies(Protocol):
    """One device's copies to the host and back, in the order they are issued."""

    def begin_offload(self) -> None:
        """Before a layer's copies to the host: order them after the compute that made the values."""

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """Start copying ``t`` to host memory; the host tensor (filled once the copy is done)."""

    def fence(self) -> None:
        """Make the compute stream wait for the copies to the host issued so far."""

    def end_offload(self) -> None:
        """After a layer's copies to the host."""

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """Start copying ``host`` back; the device tensor (filled once the copy is done)."""

    def mark(self) -> Any:
        """A token for the copies issued so far (:meth:`wait` for them)."""

    def wait(self, token: Any) -> None:
        """Make the compute stream wait for the copies up to ``token`` (it then reads them)."""


class CudaCopies:
    """:class:`DeviceCopies` of one CUDA device, on its side stream (the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.offloaded: torch.cuda.Event | None = None  # the last layer's copies to the host
        self.sources: list[torch.Tensor] = []  # what they read, held until the compute stream waits
        self.compute: torch.cuda.Stream | None = None  # the stream that made (and frees) them

    def _release(self) -> None:
        """The stream that made the last layer's sources waits for their copies; they may go."""
        if self.offloaded is not None and self.sources:
            cast(torch.cuda.Stream, self.compute).wait_event(self.offloaded)
            self.sources.clear()

    def begin_offload(self) -> None:
        self._release()
        self.compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(self.compute)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        # (empty_like: a dense value's strides, else contiguous: no buffer sized to a view's gaps)
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
        self.sources.append(t)
        return host

    def fence(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def end_offload(self) -> None:
        self.offloaded = self.stream.record_event()

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        self._release()
        current = torch.cuda.current_stream(self.device)
        dev = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            dev.copy_(host, non_blocking=True)
        return dev

    def mark(self) -> Any:
        return self.stream.record_event()

    def wait(self, token: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(token)


_CUDA: dict[torch.device, CudaCopies] = {}


def copies_for(device: torch.device) -> DeviceCopies | None:
    """The copies of ``device``: CUDA's side stream (one per device), else None (a clone)."""
    if device.type != "cuda":
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _CUDA[device] if device in _CUDA else _CUDA.setdefault(device, CudaCopies(device))


class LayerOffload:
    """One layer's values sent to host memory (:func:`offloading`) and the devices their copies
    started on."""

    __slots__ = ("__weakref__", "begun", "shared", "spans", "values")

    def __init__(self) -> None:
        self.begun: list[DeviceCopies] = []
        self.values: list[HostCopy] = []
        # storages several cached views of which travel as one span (:func:`shared_spans`),
        # and each one's copy once made
        self.spans: dict[int | None, tuple[int, int]] = {}
        self.shared: dict[int | None, HostCopy] = {}

    def copies(self, device: torch.device) -> DeviceCopies | None:
        c = copies_for(device)
        if c is not None and c not in self.begun:
            c.begin_offload()
            self.begun.append(c)
        return c

    def fence(self) -> None:
        """The compute stream waits for the copies started so far (values a tensor outside
        the engine holds: the forward's caller may write them next)."""
        for c in self.begun:
            c.fence()

    def prefetch(self) -> None:
        """As this layer's recompute starts: its values' copies back (if not started yet), and
        those of the offloading layer the backward reaches next (the one before it in
        :data:`_LAYERS`), which leaves that list with this one."""
        for h in self.values:
            h.prefetch()
        with _REGISTRY:
            alive = [layer for layer in (r() for r in _LAYERS) if layer is not None]
            _LAYERS[:] = [weakref.ref(layer) for layer in alive if layer is not self]
        here = next((i for i, layer in enumerate(alive) if layer is self), 0)
        if here > 0:
            for h in alive[here - 1].values:
                h.prefetch()

    def drop(self) -> None:
        """As the recompute ends: let the copies back go that it did not serve."""
        for h in self.values:
            h.drop()


#: The layers whose copies run on a side stream, in forward order, until their recompute starts
#: (weakly: a forward whose backward never runs leaves nothing behind once its graph goes). The
#: layer before another here is the one the backward reaches next when the two are one
#: forward's; when they are not (two forwards, then their backwards; a forward never run
#: backward), one layer's values come back early and wait on the device for their recompute.
_LAYERS: list[weakref.ref[LayerOffload]] = []
_REGISTRY = threading.Lock()


@contextmanager
def offloading() -> Iterator[LayerOffload]:
    """One layer's copies to the host: :class:`HostCopy` values made inside it."""
    batch = LayerOffload()
    try:
        yield batch
    finally:
        for c in batch.begun:
            c.end_offload()
        if batch.begun:
            with _REGISTRY:
                _LAYERS[:] = [r for r in _LAYERS if r() is not None] + [weakref.ref(batch)]


class HostCopy:
    """A cached value of an offloaded region, in host memory (pinned when it came from CUDA);
    :meth:`prefetch` starts its copy back, :meth:`back` is the tensor on its device again,
    for the recompute. A ``DTensor`` is copied shard by shard and keeps its placements
    (``map_inner``)."""

    __slots__ = ("copies", "ready", "shared", "val")

    def __init__(self, t: torch.Tensor, batch: LayerOffload, shared: bool = False) -> None:
        # per inner tensor: its device's copies (the same stream both ways), or its device (a clone)
        self.copies: list[DeviceCopies | torch.device] = []
        self.ready: tuple[torch.Tensor, list[tuple[DeviceCopies, Any]]] | None = None  # (value, waits)
        self.shared = shared  # (a span several views are served from: kept until dropped)

        def to_host(inner: torch.Tensor) -> torch.Tensor:
            c = batch.copies(inner.device)
            self.copies.append(inner.device if c is None else c)
            return inner.clone() if c is None else c.to_host(inner)

        self.val = map_inner(t.detach(), to_host)

    def prefetch(self) -> None:
        """Start copying back (once per recompute)."""
        if self.ready is not None:
            return
        copies = iter(self.copies)
        started: dict[DeviceCopies, None] = {}  # (the devices copying back, in order)

        def back(host: torch.Tensor) -> torch.Tensor:
            c = next(copies)
            if isinstance(c, torch.device):
                return host.to(c).detach()  # (a fresh alias: what the recompute serves gets a grad_fn)
            started[c] = None
            return c.to_device(host)

        value = map_inner(self.val, back)
        self.ready = (value, [(c, c.mark()) for c in started])

    def back(self) -> torch.Tensor:
        """The value on its device, the copies back awaited (started here if not prefetched).
        A shared span stays served, for its other views, until the recompute ends (:meth:`drop`)."""
        self.prefetch()
        value, waits = self.ready  # type: ignore[misc]  # (set by prefetch)
        self.ready = (value, []) if self.shared else None
        for c, token in waits:
            c.wait(token)
        return value

    def drop(self) -> None:
        """Let a copy back the recompute did not serve go, once the compute stream has waited
        for it (its memory is the compute stream's to reuse)."""
        if self.ready is not None:
            for c, token in self.ready[1]:
                c.wait(token)
            self.ready = None

    def __del__(self) -> None:
        # (a copy back started and never served nor dropped: a recompute that failed to start,
        # or a graph that went before its recompute ran)
        try:
            self.drop()
        except Exception:  # (at interpreter exit torch may be gone)
            pass


class HostView:
    """A cached view of a storage whose span travels as one copy (:func:`shared_spans`): served
    as the same view of that copy back, so the views come back sharing one storage, as the
    forward made them."""

    __slots__ = ("copy", "geometry")

    def __init__(self, copy: HostCopy, t: torch.Tensor, lo: int) -> None:
        self.copy = copy
        self.geometry = (tuple(t.shape), tuple(t.stride()), t.storage_offset() - lo)

    def back(self) -> torch.Tensor:
        size, stride, offset = self.geometry
        return self.copy.back().as_strided(size, stride, offset)


def shared_spans(tensors: list[torch.Tensor]) -> dict[int | None, tuple[int, int]]:
    """Per storage two or more of ``tensors`` read (plain tensors of one dtype and device: the
    views ``SAVE_ALL`` caches beside their base), the elements ``[lo, hi)`` they cover, where
    copying that span once moves no more than copying each of them."""
    groups: dict[int | None, list[torch.Tensor]] = {}
    for t in tensors:
        if type(t) is torch.Tensor:
            groups.setdefault(storage_of(t), []).append(t)
    spans: dict[int | None, tuple[int, int]] = {}
    for s, ts in groups.items():
        if s is None or len(ts) < 2 or len({(t.dtype, t.device) for t in ts}) > 1:
            continue
        size = ts[0].element_size()
        lo = min(cast(int, t.storage_offset()) for t in ts)
        hi = max(byte_span(t)[1] // size if t.numel() else cast(int, t.storage_offset()) for t in ts)
        if hi - lo <= sum(t.numel() for t in ts):
            spans[s] = (lo, hi)
    return spans


def to_host(leaf: Any, batch: LayerOffload, produced: StorageSet) -> Any:
    """A cached leaf of an offloaded region, sent to host memory (one of ``batch.values``) when
    it is a tensor the layer made: a view of an input or a parameter stays (it costs the device
    nothing, the host a copy); a value written since it was cached raises. Views of a storage
    in ``batch.spans`` travel as one copy of its span (:class:`HostView`)."""
    if (
        isinstance(leaf, VersionWrapper)
        and isinstance(leaf.val, torch.Tensor)
        and storage_of(leaf.val) in produced
    ):
        t = leaf.get_val(False)
        s = storage_of(t)
        span = batch.spans.get(s) if type(t) is torch.Tensor else None
        if span is None:
            batch.values.append(HostCopy(t, batch))
            return batch.values[-1]
        if s not in batch.shared:
            lo, hi = span
            batch.shared[s] = HostCopy(t.as_strided((hi - lo,), (1,), lo), batch, shared=True)
            batch.values.append(batch.shared[s])
        return HostView(batch.shared[s], t, span[0])
    return leaf
