"""The eager engine's offloaded values: copies to host memory at the end of a checkpointed
call's forward and back for its recompute.

On CUDA the copies run on a side stream of the device (:class:`CudaCopies`), as PyTorch's
partitioner pass runs the compiled ones (``torch._functorch._activation_offloading``):

* **to the host**, at the end of a layer's forward: the side stream waits for the compute
  stream (the values are made there) and copies each value into pinned memory; the value is
  recorded on the side stream (``Tensor.record_stream``), so its device memory, freed when the
  engine lets it go, is not handed out again before the copy has read it. The next layer's
  forward runs meanwhile. At most one layer's copies are in flight: before a layer starts its
  own, the compute stream waits for the previous layer's (which bounds what the device holds
  for copies not yet done to one layer's offloaded values). A value that a tensor outside the
  engine still holds (the layer's output, say) may be written by what runs next: those are
  copied first, and the compute stream waits for their copies at once (:meth:`LayerOffload.fence`).
* **back**, at the start of the layer's recompute: every offloaded value of the layer is
  copied back on the side stream at once (prefetched); the compute stream waits for them only
  where the recompute first serves one, and the copies are recorded on the compute stream
  (their memory came from the side stream's pool). A copy back the recompute did not serve
  (it stopped early) is let go as the recompute ends; a second recompute copies back again.

Elsewhere (a CPU: the host is the device) a value is cloned at once, and served as it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from .._compat.checkpoint import map_inner

__all__ = ["CudaCopies", "DeviceCopies", "HostCopy", "LayerOffload", "copies_for", "offloading"]


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

    def wait(self, token: Any, copies: list[torch.Tensor]) -> None:
        """Make the compute stream wait for the copies up to ``token``, which it then reads."""


class CudaCopies:
    """:class:`DeviceCopies` of one CUDA device, on its side stream (the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.offloaded: torch.cuda.Event | None = None  # the last layer's copies to the host

    def begin_offload(self) -> None:
        current = torch.cuda.current_stream(self.device)
        if self.offloaded is not None:
            current.wait_event(self.offloaded)
        self.stream.wait_stream(current)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        with torch.cuda.stream(self.stream):
            host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
        t.record_stream(self.stream)
        return host

    def fence(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def end_offload(self) -> None:
        self.offloaded = self.stream.record_event()

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        with torch.cuda.stream(self.stream):
            return host.to(self.device, non_blocking=True)

    def mark(self) -> Any:
        return self.stream.record_event()

    def wait(self, token: Any, copies: list[torch.Tensor]) -> None:
        current = torch.cuda.current_stream(self.device)
        current.wait_event(token)
        for t in copies:
            t.record_stream(current)


_CUDA: dict[torch.device, CudaCopies] = {}


def copies_for(device: torch.device) -> DeviceCopies | None:
    """The copies of ``device``: CUDA's side stream (one per device), else None (a clone)."""
    if device.type != "cuda":
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _CUDA:
        _CUDA[device] = CudaCopies(device)
    return _CUDA[device]


class LayerOffload:
    """The devices one layer's copies to the host started on (:func:`offloading`)."""

    def __init__(self) -> None:
        self.begun: list[DeviceCopies] = []

    def copies(self, device: torch.device) -> DeviceCopies | None:
        c = copies_for(device)
        if c is not None and not any(b is c for b in self.begun):
            c.begin_offload()
            self.begun.append(c)
        return c

    def fence(self) -> None:
        """The compute stream waits for the copies started so far (values a tensor outside
        the engine holds: the forward's caller may write them next)."""
        for c in self.begun:
            c.fence()


@contextmanager
def offloading() -> Iterator[LayerOffload]:
    """One layer's copies to the host: :class:`HostCopy` values made inside it."""
    batch = LayerOffload()
    try:
        yield batch
    finally:
        for c in batch.begun:
            c.end_offload()


class HostCopy:
    """A cached value of an offloaded region, in host memory (pinned when it came from CUDA);
    :meth:`prefetch` starts its copy back, :meth:`back` is the tensor on its device again,
    for the recompute. A ``DTensor`` is copied shard by shard and keeps its placements
    (``map_inner``)."""

    __slots__ = ("devices", "ready", "val")

    def __init__(self, t: torch.Tensor, batch: LayerOffload) -> None:
        self.devices: list[torch.device] = []
        self.ready: tuple[torch.Tensor, list[tuple[DeviceCopies, Any, list[torch.Tensor]]]] | None = None

        def to_host(inner: torch.Tensor) -> torch.Tensor:
            self.devices.append(inner.device)
            c = batch.copies(inner.device)
            return inner.clone() if c is None else c.to_host(inner)

        self.val = map_inner(t.detach(), to_host)

    def prefetch(self) -> None:
        """Start copying back (once per recompute)."""
        if self.ready is not None:
            return
        devices = iter(self.devices)
        started: list[tuple[DeviceCopies, torch.Tensor]] = []

        def back(host: torch.Tensor) -> torch.Tensor:
            device = next(devices)
            c = copies_for(device)
            if c is None:
                return host.to(device)
            started.append((c, c.to_device(host)))
            return started[-1][1]

        value = map_inner(self.val, back)
        waits = [(c, c.mark(), [t for d, t in started if d is c]) for c in _distinct(d for d, _ in started)]
        self.ready = (value, waits)

    def back(self) -> torch.Tensor:
        """The value on its device, the copies back awaited (started here if not prefetched)."""
        self.prefetch()
        value, waits = self.ready  # type: ignore[misc]  # (set by prefetch)
        self.ready = None
        for c, token, copies in waits:
            c.wait(token, copies)
        return value

    def drop(self) -> None:
        """Let a copy back the recompute did not serve go."""
        self.ready = None


def _distinct(items: Iterator[DeviceCopies]) -> list[DeviceCopies]:
    out: list[DeviceCopies] = []
    for c in items:
        if not any(o is c for o in out):
            out.append(c)
    return out
