"""What the caching allocator reserves beyond the bytes live at the loss: the loss's
logits-sized allocations and frees, in the order the loss runs them, replayed through a model
of PyTorch's CUDA caching allocator with expandable segments (torchtitan's launcher sets
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``).

The model (``c10/cuda/CUDACachingAllocator.cpp``): a request takes the smallest cached free
block that holds it (the lowest address among equals), the rest of a larger block split off
as a free block; a freed block merges with its free neighbours; where no free block holds the
request the segment grows at its end, reusing its free tail. The segment never shrinks
(nothing empties the cache), so what it reaches is what is reserved. The rest of the step is
taken as lying below the loss's blocks, with no hole a logits-sized block fits (a layer's
blocks are far smaller than the logits at a 128k vocabulary); rounding (512 B, 2 MiB pages)
is left out.

Replayed, torchtitan's eager loss leaves one hole of the model's own logits' size: the
logits (in the model's dtype) are freed before the backward next to their float32 copy, the
backward's first float32 gradient takes the front of the two holes and its second grows the
segment; the rest (the size of the model's logits) waits for the logits' gradient.
Without expandable segments (a cudaMalloc'd segment per request no cached block holds,
segments never merged) the replay leaves the same hole: the freed logits' segment is too small
for a float32 gradient. Transformers' loss keeps the model's logits alive (its output) and
leaves none. A compiled or chunked loss is not replayed (Inductor's buffers; one chunk's): no
slack counted. Never checked against a GPU's ``max_memory_reserved`` (``benchmarks/gpu.py``
prints the two).
"""

from __future__ import annotations

from collections.abc import Sequence

from .devices import parse_loss

__all__ = ["Event", "loss_events", "loss_slack", "replay"]

#: ``("alloc", name, bytes)`` or ``("free", name, 0)``
Event = tuple[str, str, int]


def replay(events: Sequence[Event]) -> tuple[int, int]:
    """``(live, reserved)``: the most bytes live at once and the size the one segment
    reaches, replaying ``events`` through the allocator's model (the module's docstring)."""
    blocks: list[list] = []  # [size, name or None] in address order, from the segment's start
    live = most = 0
    for kind, name, size in events:
        if kind == "free":
            i = next(i for i, b in enumerate(blocks) if b[1] == name)
            live -= blocks[i][0]
            blocks[i][1] = None
            if i + 1 < len(blocks) and blocks[i + 1][1] is None:
                blocks[i][0] += blocks.pop(i + 1)[0]
            if i > 0 and blocks[i - 1][1] is None:
                blocks[i - 1][0] += blocks.pop(i)[0]
            continue
        fits = [i for i, b in enumerate(blocks) if b[1] is None and b[0] >= size]
        if fits:
            i = min(fits, key=lambda i: blocks[i][0])  # (the first of the smallest: the lowest address)
            if blocks[i][0] > size:
                blocks.insert(i + 1, [blocks[i][0] - size, None])
            blocks[i] = [size, name]
        elif blocks and blocks[-1][1] is None:  # the free tail grown to the request
            blocks[-1] = [size, name]
        else:
            blocks.append([size, name])
        live += size
        most = max(most, live)
    return most, sum(b[0] for b in blocks)


def loss_events(kind: str, logits: int, model_logits: int, parallel: bool) -> list[Event]:
    """The logits-sized allocations of one eager loss, forward and backward, in order:
    ``logits`` the float32 logits' bytes, ``model_logits`` the model's own (0 when they are
    float32: the upcast is then no copy). ``kind``: ``"torchtitan"`` (the logits freed
    before the backward: ``del pred``) or ``"transformers"`` (kept alive in the model's
    output). ``parallel``: DTensor's loss parallelism
    (``torch.distributed.tensor.parallel.loss``: ``_log_softmax`` shifts, exponentiates and
    subtracts in float32; its backward is ``(zeros + exp(x)) * grad``)."""
    f, m = logits, model_logits
    out: list[Event] = [("alloc", "logits", m or f)]
    if m:
        out.append(("alloc", "float", f))
    if parallel:
        out += [("alloc", "shifted", f), ("alloc", "exp", f), ("free", "exp", 0)]
        out += [("alloc", "log_softmax", f), ("free", "shifted", 0)]
    else:
        out.append(("alloc", "log_softmax", f))
    if m:
        out.append(("free", "float", 0))  # (the loss function returned)
    if kind == "torchtitan":
        out.append(("free", "logits", 0))
    if parallel:
        out += [("alloc", "zeros", f), ("alloc", "exp", f), ("alloc", "sum", f), ("free", "exp", 0)]
        out += [("alloc", "grad", f), ("free", "sum", 0), ("free", "zeros", 0)]
    else:
        out += [("alloc", "nll_grad", f), ("alloc", "grad", f), ("free", "nll_grad", 0)]
    out.append(("free", "log_softmax", 0))
    if m:
        out += [("alloc", "logits_grad", m), ("free", "grad", 0), ("free", "logits_grad", 0)]
    else:
        out.append(("free", "grad", 0))
    if kind == "transformers":
        out.append(("free", "logits", 0))
    return out


def loss_slack(loss: str, logits: int, model_logits: int, split: int) -> int:
    """Bytes the allocator reserves beyond the live peak of a ``loss`` (``Target.loss``) over
    logits of ``logits`` float32 bytes (``model_logits`` in the model's dtype, 0 when float32),
    split ``split`` ways by loss parallelism, per device: its eager loss replayed
    (:func:`loss_events`); 0 for a compiled or chunked loss."""
    kind, _ = parse_loss(loss)
    if kind not in ("torchtitan", "transformers") or not logits:
        return 0
    live, reserved = replay(loss_events(kind, logits // split, model_logits // split, split > 1))
    return reserved - live
