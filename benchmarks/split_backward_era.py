"""What PyTorch's zero-bubble pipelining does with a checkpointed stage, in plain torch, so that
one release can be set beside another: run it in a venv of the release a published run used
(``pip install torch==2.6.0``, January 2025) and in the project's (docs/planning.md,
*Validating runs*: the 405B zero-bubble run).

* **The schedule**: ``ScheduleInterleavedZeroBubble``'s action order for ``--pp`` ranks, two
  stages a rank and ``--microbatches`` microbatches, each rank's list as PyTorch computes it;
  and per stage but the first the most microbatches whose input backward (``I``) has run and
  whose weight backward (``W``) has not: the gradients ``I`` records for ``W``, held at once.
* **The split backward** (one process): ``stage_backward_input`` then
  ``stage_backward_weight`` on a stage of ``--layers`` Llama layers, written as torchtitan's of
  January 2025 (its RMSNorm, SDPA, SwiGLU) under its full AC (``checkpoint_wrapper``,
  non-reentrant, ``preserve_rng_state=False``) and without AC: the weight groups, how often
  ``W`` runs each layer's forward again, the bytes ``I`` records for ``W``, and the
  allocator's peak during ``W`` above its start (the profiler's allocation events).
* ``--tp``: the same on two gloo ranks, the layers under DTensor tensor parallelism with
  sequence parallelism (torchtitan's Llama plan); ``--fsdp``: four ranks, FSDP2 x TP 2,
  ``reshard_after_forward=False`` (torchtitan's setting under PP) and the flags
  ``PipelineStage`` sets before a microbatch's backward (FSDP2 on a CPU needs PyTorch 2.7 on).

Prints one JSON object (``--json PATH`` writes it too). Imports nothing of ``sac_compile``
(whose PyTorch range the old release is outside of); the schedule is read through the
schedule class's own per-rank method, a private one (``_calculate_single_rank_operations``).

    python benchmarks/split_backward_era.py [--layers 2] [--pp 8] [--microbatches 8] [--tp] [--fsdp]
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

DIM, HEADS, FFN, SEQ, BATCH = 256, 4, 688, 256, 2
MARK = 12_345  # bytes: an allocation nothing else makes (where W starts)


class RMSNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    """A Llama layer; ``tp`` ranks each run ``1 / tp`` of its heads and hidden units."""

    def __init__(self, tp: int = 1) -> None:
        super().__init__()
        self.tp = tp
        self.attention_norm, self.ffn_norm = RMSNorm(), RMSNorm()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(DIM, FFN, bias=False), nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)
        self.attention_in, self.ffn_in = nn.Identity(), nn.Identity()  # (where TP gathers the sequence)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        h = self.attention_in(self.attention_norm(x))
        q, k, v = (
            w(h).view(b, -1, HEADS // self.tp, DIM // HEADS).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, -1, DIM // self.tp))
        h = self.ffn_in(self.ffn_norm(x))
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def schedule(pp: int, microbatches: int) -> dict:
    """Each rank's zero-bubble actions, and per stage the most I's run before their W's."""
    from torch.distributed.pipelining.schedules import BACKWARD_INPUT, BACKWARD_WEIGHT
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble as Z

    ranks, held = {}, {}
    for rank in range(pp):
        s = object.__new__(Z)  # (the class's own arithmetic, without the stages it would run)
        s.pp_group_size, s.n_local_stages, s.rank, s._n_microbatches = pp, 2, rank, microbatches
        s.number_of_rounds = max(1, microbatches // pp)
        s.microbatches_per_round = microbatches // s.number_of_rounds
        actions = [a for a in Z._calculate_single_rank_operations(s, rank) if a is not None]
        ranks[rank] = " ".join(map(str, actions))
        pending: dict[int, int] = {}
        for a in actions:
            kind, stage = a.computation_type, a.stage_index
            pending[stage] = pending.get(stage, 0) + (kind == BACKWARD_INPUT) - (kind == BACKWARD_WEIGHT)
            held[stage] = max(held.get(stage, 0), pending[stage])
    # (the first stage's I records nothing: its input needs no gradient, its W runs the whole backward)
    held.pop(0, None)
    return {"actions": ranks, "most_recorded_microbatches_by_stage": dict(sorted(held.items()))}


def _allocations(fn) -> list[int]:  # noqa: ANN001
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.typed[0] == _EventType.Allocation:
            events.append((e.start_time_ns, e.typed[1].alloc_size))
    return [size for _, size in sorted(events)]


def split_backward(stage: nn.Module, blocks: list, x: torch.Tensor) -> dict:
    """``I`` then ``W`` on ``stage`` (its ``blocks``' forwards counted), from input ``x``."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    runs = [0] * len(blocks)
    for n, b in enumerate(blocks):
        b.attention_norm.register_forward_hook(lambda *_, n=n: runs.__setitem__(n, runs[n] + 1))
    h = stage(x)
    h = h.to_local() if hasattr(h, "to_local") else h
    out: dict = {}

    def backward() -> None:
        _, groups = stage_backward_input([h], [torch.randn_like(h)], [x], stage.parameters())
        out["groups"] = len(groups)
        grads = (g for group in groups for gs in group["grads"] for g in gs if g is not None)
        local = (g.to_local() if hasattr(g, "to_local") else g for g in grads)  # (a DTensor: its shard)
        out["recorded"] = sum(
            {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in local}.values()
        )
        out["mark"] = torch.empty(MARK, dtype=torch.uint8)
        runs[:] = [0] * len(runs)
        stage_backward_weight(stage.parameters(), groups)

    sizes = _allocations(backward)
    live = list(itertools.accumulate(sizes))
    w = live[sizes.index(MARK) :]
    return {
        "weight_groups": out["groups"],
        "W_forwards_per_layer": runs,
        "recorded_by_I_KiB": round(out["recorded"] / 1024),
        "W_peak_above_start_KiB": round((max(w) - w[0]) / 1024),
        "every_weight_has_a_gradient": all(p.grad is not None for p in stage.parameters()),
    }


def _stage(layers: int, ac: bool, tp_mesh=None, dp_mesh=None) -> tuple[nn.Module, list]:  # noqa: ANN001
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    blocks = [Block(tp_mesh.size() if tp_mesh is not None else 1) for _ in range(layers)]
    if tp_mesh is not None:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel as Col
        from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel, parallelize_module
        from torch.distributed.tensor.parallel import RowwiseParallel as Row

        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan = {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
        plan |= {"attention_in": gather, "ffn_in": gather, "wo": Row(output_layouts=Shard(1))}
        plan |= {
            "wq": Col(),
            "wk": Col(),
            "wv": Col(),
            "w1": Col(),
            "w3": Col(),
            "w2": Row(output_layouts=Shard(1)),
        }
        for b in blocks:
            parallelize_module(b, tp_mesh, plan)
    stage = nn.Sequential(*(checkpoint_wrapper(b, preserve_rng_state=False) if ac else b for b in blocks))
    if dp_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for layer in stage:
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=False)
        fully_shard(stage, mesh=dp_mesh, reshard_after_forward=False)
        # (what PipelineStage sets before a microbatch's backward that is not the step's last)
        stage.set_is_last_backward(False)
        stage.set_reshard_after_backward(False)
        stage.set_requires_gradient_sync(False)
    return stage, blocks


def _rank(rank: int, world: int, path: str, layers: int, fsdp: bool, queue) -> None:  # noqa: ANN001
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    result = {}
    for ac in (True, False):
        stage, blocks = _stage(layers, ac, mesh["tp"], mesh["dp"] if fsdp else None)
        result["full_ac" if ac else "no_ac"] = split_backward(
            stage, blocks, torch.randn(BATCH, SEQ // 2, DIM, requires_grad=True)
        )
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def on_ranks(layers: int, fsdp: bool) -> dict:
    world, ctx = 4 if fsdp else 2, mp.get_context("spawn")
    queue, path = ctx.Queue(), tempfile.mktemp()
    procs = [ctx.Process(target=_rank, args=(r, world, path, layers, fsdp, queue)) for r in range(world)]
    for p in procs:
        p.start()
    result = queue.get(timeout=600)
    for p in procs:
        p.join()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--pp", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--tp", action="store_true", help="two gloo ranks, DTensor TP 2 with sequence parallelism")
    p.add_argument("--fsdp", action="store_true", help="four gloo ranks, FSDP2 x TP 2")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    out = {
        "torch": torch.__version__,
        "layers": args.layers,
        "pp": args.pp,
        "microbatches": args.microbatches,
    }
    out["schedule"] = schedule(args.pp, args.microbatches)
    if args.tp or args.fsdp:
        out["fsdp_x_tp" if args.fsdp else "tp"] = on_ranks(args.layers, args.fsdp)
    else:
        for ac in (True, False):
            stage, blocks = _stage(args.layers, ac)
            x = torch.randn(BATCH, SEQ, DIM, requires_grad=True)
            out["full_ac" if ac else "no_ac"] = split_backward(stage, blocks, x)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
