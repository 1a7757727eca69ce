"""``planning.allocator``: the caching allocator's model replayed, and the loss's allocation
sequences it replays, checked against the order CPU autograd allocates and frees them."""

from __future__ import annotations

import pytest
import torch

from sac_compile.planning.allocator import loss_events, loss_slack, replay
from sac_compile.planning.devices import Target
from sac_compile.planning.peak import ModelSizes, head_logits_bytes


def test_replay_takes_the_best_fit_merges_freed_neighbours_and_grows_the_free_tail():
    """Holes of 5 and 3 (units): a request of 3 takes the 3 (first fit would split the 5 and
    leave the 5 no room: 15 reserved); two freed neighbours of 1 and 3 hold a 4 (unmerged they
    would not: 14); a 3 where only the free tail of 1 lies grows the tail (appended: 13)."""
    a = [("alloc", "a", 5), ("alloc", "x", 1), ("alloc", "b", 3), ("alloc", "y", 1)]
    a += [("free", "a", 0), ("free", "b", 0), ("alloc", "c", 3), ("alloc", "d", 5)]
    assert replay(a) == (10, 10)
    a += [("free", "x", 0), ("free", "c", 0), ("alloc", "e", 4)]
    assert replay(a) == (10, 10)
    a += [("free", "y", 0), ("alloc", "g", 3)]
    assert replay(a) == (12, 12)


def test_replay_merges_either_way_and_takes_the_lower_of_equal_holes():
    """The upper of two neighbours freed first, then the lower: one hole of 4 (merged only
    with the block before, the lower would stay apart: a 4 appended, 9). Two holes of 2: a 2
    takes the lower, so a 3 then finds the upper hole and the freed top beside it merged."""
    a = [("alloc", "p", 1), ("alloc", "q", 3), ("alloc", "lock", 1)]
    a += [("free", "q", 0), ("free", "p", 0), ("alloc", "r", 4)]
    assert replay(a) == (5, 5)
    b = [("alloc", "lo", 2), ("alloc", "mid", 1), ("alloc", "hi", 2), ("alloc", "top", 1)]
    b += [
        ("free", "lo", 0),
        ("free", "hi", 0),
        ("alloc", "two", 2),
        ("free", "top", 0),
        ("alloc", "three", 3),
    ]
    # the 2 in the lower hole; the upper hole (2) and the freed top (1) merged hold the 3 (the
    # 2 in the upper hole would leave a free tail of 1, grown to 3: 8)
    assert replay(b) == (6, 6)


def _logits_sized(step, sizes: tuple[int, ...]) -> list[tuple[str, str, int]]:
    """The allocations of ``sizes`` bytes the CPU allocator reports during ``step()`` (the
    profiler's timeline), and their frees, in order."""
    from sac_compile._compat.profiler import allocation_events

    recorded: list[tuple[str, str, int]] = []
    named: dict[int, str] = {}
    for ptr, size in allocation_events(step):
        if size in sizes:
            named[ptr] = f"{ptr}#{len(recorded)}"
            recorded.append(("alloc", named[ptr], size))
        elif -size in sizes and ptr in named:
            recorded.append(("free", named.pop(ptr), 0))
    return recorded


def _recorded(kind: str, dtype: torch.dtype) -> tuple[list[tuple[str, str, int]], int]:
    """torchtitan's loss (``cross_entropy(pred.flatten(0, 1).float(), ...)``, ``del pred``
    before the backward) or transformers' (the logits alive in the model's output), from the
    output projection to its backward, on CPU tensors: the logits-sized allocations."""
    b, s, v, h = 2, 16, 512, 8
    hidden = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
    weight = torch.randn(v, h, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, v, (b, s))

    def step() -> None:
        pred = hidden @ weight.t()
        loss = torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
        if kind == "torchtitan":
            del pred
        loss.backward()

    return _logits_sized(step, (b * s * v * dtype.itemsize, b * s * v * 4)), b * s * v * 4


def _linked(events: list[tuple[str, str, int]]) -> list[tuple[str, int, int]]:
    """Each event as (kind, bytes, the index of the allocation it is or frees)."""
    index: dict[str, int] = {}
    out, made = [], 0
    for kind, name, size in events:
        if kind == "alloc":  # (a name freed may be used again)
            index[name], made = made, made + 1
            out.append((kind, size, index[name]))
        else:
            out.append((kind, 0, index[name]))
    return out


@pytest.mark.parametrize("kind", ["torchtitan", "transformers"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_loss_sequence_replayed_is_the_one_autograd_runs(kind, dtype):
    """The sequence ``loss_events`` writes for an eager loss is, size for size and each free
    to its allocation, what the CPU allocator reports autograd allocating and freeing from the
    output projection on; replayed,
    torchtitan's loss (its logits freed before the backward) leaves a hole of the model's
    logits' size, transformers' none, and a float32 model's none."""
    recorded, f = _recorded(kind, dtype)
    m = f // 2 if dtype == torch.bfloat16 else 0
    ours = loss_events(kind, f, m, parallel=False)
    assert _linked(recorded) == _linked(ours), recorded
    live, reserved = replay(ours)
    assert reserved - live == (m if kind == "torchtitan" else 0)


def test_loss_parallels_sequence_is_the_one_dtensor_runs():
    """Under DTensor's loss parallelism (one gloo rank, the logits sharded on the vocabulary)
    the logits-sized allocations and frees the CPU allocator reports (the profiler's
    timeline), from the output projection to its backward, are ``loss_events``' parallel
    sequence: the shift, the exponential and the log-softmax forward, ``(zeros + exp(x)) *
    grad`` backward."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = init_device_mesh("cpu", (1,))
        b, s, v, h = 2, 16, 512, 8
        hidden = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.randn(v, h, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.randint(0, v, (b, s))

        def step() -> None:
            pred = DTensor.from_local(hidden @ weight.t(), mesh, [Shard(2)])
            with loss_parallel():
                loss = torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
                del pred
                loss.backward()

        m, f = b * s * v * 2, b * s * v * 4
        recorded = _logits_sized(step, (m, f))
    finally:
        dist.destroy_process_group()
    assert _linked(recorded) == _linked(loss_events("torchtitan", f, m, parallel=True)), recorded


def test_the_replayed_live_peak_is_the_heads_logits_term_and_loss_parallel_leaves_the_same_hole():
    """The live peak of each replayed loss is what the step's peak counts at the loss
    (``head_logits_bytes``: three float32 logits, four under loss parallelism, and for
    transformers' loss the model's logits beside them); DTensor's loss parallelism (its
    log-softmax shifts and exponentiates, its backward ``(zeros + exp(x)) * grad``) leaves
    torchtitan's hole too. ``loss_slack`` counts it per rank; a compiled or chunked loss is not
    replayed."""
    f, m = 8 << 20, 4 << 20
    sizes = ModelSizes(
        params=0, head_saved_bytes=0, head_transient_bytes=0, logits_bytes=f, model_logits_bytes=m
    )
    for kind in ("torchtitan", "transformers"):
        for tp in (1, 4):
            target = Target("h100-80gb", tp=tp, loss=kind)
            live, reserved = replay(loss_events(kind, f // tp, m // tp, parallel=tp > 1))
            assert live == head_logits_bytes(sizes, target) // tp, (kind, tp)
            slack = m // tp if kind == "torchtitan" else 0
            assert reserved - live == slack == loss_slack(kind, f, m, tp), (kind, tp)
    assert loss_slack("compiled", f, m, 1) == loss_slack("chunked:4", f, m, 1) == 0
