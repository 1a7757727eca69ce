"""Expert-parallel MoE on 2 CPU ranks (gloo): which all-to-alls the backward runs again.

Each layer of ``sac_compile.testing.models.EPStack`` routes its tokens to experts
split over the two ranks: router -> dispatch all-to-all -> expert GEMMs ->
combine all-to-all, in regions ``moe.router`` / ``moe.dispatch`` /
``moe.experts`` / ``moe.combine`` (with ``--micro-batches 2`` the two halves of
the batch interleave inside the layer, each stage in its own region). Every
layer is wrapped with ``apply_selective_checkpointing(layer, keep=...)``, eagerly
and with ``compile=True``, trained for a few steps against one process holding
every expert, and the all-to-alls each backward runs are counted:

* eager: collectives are always recomputed (a kept one is reported as
  ``collective-recomputed``), so the backward runs every forward all-to-all again;
* compiled: a kept all-to-all is saved; the partition of layer 0 shows what is
  saved and what the backward recomputes.

    python examples/ep_moe.py [--keep moe.dispatch,moe.experts,moe.combine] [--micro-batches 1|2]
                              [--steps 3] [--inner aot_eager|inductor]
"""

from __future__ import annotations

import argparse
import logging

import torch

import sac_compile as sc
from sac_compile.testing.ranks import run_ranks

A2A = "_c10d_functional.all_to_all_single"


def train(rank: int, world_size: int, args, mode: str) -> dict:
    import torch.distributed as dist

    from sac_compile.testing.models import EPBlock, EPStack

    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(name)s: %(message)s")
    group = dist.group.WORLD
    torch.manual_seed(0)
    ref = EPStack(n=2, d=32, micro_batches=args.micro_batches)  # every expert, one process
    model = EPStack(n=2, d=32, group=group, micro_batches=args.micro_batches).shard_from(ref)
    for layer in model.layers:
        compile = {"inner": args.inner} if mode == "compiled" else False
        sc.apply_selective_checkpointing(layer, keep=args.keep, compile=compile)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    lines = []
    for step in range(args.steps):
        x = torch.randn(8, 16, 32, generator=g)
        loss = model(x.chunk(world_size)[rank]).pow(2).sum() / x[..., 0].numel()
        _, collectives = sc.inspection.collectives_run(loss.backward)
        ref_loss = ref(x).pow(2).sum() / x[..., 0].numel()
        ref_loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        lines.append(
            f"step {step}: loss {total.item():.6f} (one process: {ref_loss.item():.6f}); "
            f"backward all-to-alls {collectives[A2A]}"
        )
        for name, p in model.named_parameters():
            if not name.endswith(("moe.experts.w_in", "moe.experts.w_out")):
                dist.all_reduce(p.grad)  # replicated weights: data parallel over the ranks
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    report = ""
    if mode == "compiled":
        torch.manual_seed(0)
        layer = EPBlock(d=32, group=group, micro_batches=args.micro_batches)
        x = torch.randn(4, 16, 32)
        backend = sc.make_sac_backend(args.keep, inner=args.inner)
        report = sc.inspection.capture_partition(layer, x, backend=backend).format()
    return {"lines": lines, "report": report}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--keep", default="moe.dispatch,moe.experts,moe.combine")
    parser.add_argument("--micro-batches", type=int, default=1, choices=[1, 2])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--inner", default="aot_eager", choices=["aot_eager", "inductor"])
    args = parser.parse_args()
    args.keep = {k for k in args.keep.split(",") if k}
    forward = 2 * 2 * args.micro_batches
    print(f"keep = {sorted(args.keep)}, {args.micro_batches} micro-batch(es), 2 layers, 2 ranks")
    print(f"each forward runs {forward} all-to-alls; the backward's own gradients need as many again\n")
    for mode in ("eager", "compiled"):
        print(f"######## {mode} ########")
        out = run_ranks(train, args, mode, timeout=600)[0]
        print("\n".join(out["lines"]))
        if out["report"]:
            print("\npartition of one layer (rank 0):")
            print(out["report"])
        print()


if __name__ == "__main__":
    main()
