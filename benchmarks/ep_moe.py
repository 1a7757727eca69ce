"""Expert-parallel MoE on 2 gloo ranks, per keep set: saved bytes, backward collectives, ops, step time.

One run, eager and compiled side by side. The model is ``EPStack`` (attention +
``ExpertParallelMoE`` per layer, experts split over the 2 ranks, dispatch and
combine all-to-alls) from ``sac_compile.testing.models``; every layer is wrapped by
``apply_selective_checkpointing`` (compiled: ``compile=True``, Inductor unless
``--inner aot_eager``). Keep sets: none (no checkpoint), () (full recompute),
moe.experts ("expert GEMMs only"), moe.dispatch, and
moe.dispatch+moe.experts+moe.combine ("spanning the all-to-alls").

Per configuration, on rank 0 (the ranks are symmetric):

* bytes/layer: what one layer holds for the backward, parameters excluded, its
  input included (eager no checkpoint and compiled: ``saved_tensors_hooks``;
  eager SAC: the engine's held values + the checkpointed input);
* bwd a2a: all-to-alls the backward runs per step (measured with
  ``collectives_run``); ``recomp`` = those beyond the backward's own
  (one per forward all-to-all), i.e. forward all-to-alls run again;
* save/recompute: ops of kept regions the engine served from its cache / re-ran
  (eager, all layers; it intercepts no other op), or forward nodes the tagging pass marked MUST_SAVE / MUST_RECOMPUTE
  (compiled, all layers) -- the figures the published 18 / 235 and 247 / 6
  counts describe;
* step: median forward+backward time over interleaved iterations, as a ratio
  to the same mode's no-checkpoint step.

    python benchmarks/ep_moe.py [--layers 2 --d 128 --experts 8 --batch 8 --seq 64 --micro-batches 1 --iters 9]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections import Counter

import torch
from _timing import interleaved_medians

import sac_compile as sc
from sac_compile.testing.ranks import run_ranks

A2A = "_c10d_functional.all_to_all_single"
KEEP_SETS: list[tuple[str, tuple[str, ...] | None]] = [
    ("no checkpoint", None),
    ("keep=() full recompute", ()),
    ("keep=moe.experts", ("moe.experts",)),
    ("keep=moe.dispatch", ("moe.dispatch",)),
    ("keep=dispatch+experts+combine", ("moe.dispatch", "moe.experts", "moe.combine")),
]


def _build(args, group):
    from sac_compile.testing.models import EPStack

    torch.manual_seed(0)
    full = EPStack(n=args.layers, d=args.d, heads=args.heads, n_experts=args.experts, micro_batches=args.mb)
    return EPStack(
        n=args.layers, d=args.d, heads=args.heads, n_experts=args.experts, group=group, micro_batches=args.mb
    ).shard_from(full)


def _wrap(model, mode: str, keep, inner: str):
    from sac_compile.compiler.backend import baseline_backend

    for layer in model.layers:
        if keep is None:
            if mode == "compiled":
                layer.compile(backend=baseline_backend(inner))
        else:
            sc.apply_selective_checkpointing(
                layer, keep=set(keep), compile={"inner": inner} if mode == "compiled" else False
            )
    return model


def _step(model, x) -> None:
    model(x).pow(2).mean().backward()
    model.zero_grad(set_to_none=True)


def _eager_engine(model, x, keep) -> tuple[int, int, int]:
    """(bytes per layer, ops served from the cache, ops re-run) of the eager engine, all layers."""
    from sac_compile.eager import checkpoint_with_regions

    held = cached = recomputed = 0
    h = x
    for layer in model.layers:
        stats: list = []
        held += h.untyped_storage().nbytes()
        h = checkpoint_with_regions(layer, h, keep=frozenset(keep), stats_out=stats)
        s = stats[0]
        held += sum(v for k, v in s.held_by_region.items() if k != "rng")
        cached += s.cached_ops
        recomputed += s.recomputed_ops
    h.pow(2).mean().backward()
    model.zero_grad(set_to_none=True)
    return held // len(model.layers), cached, recomputed


def _rank(rank: int, world_size: int, args) -> dict:
    import torch.distributed as dist

    group = dist.group.WORLD
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.seq, args.d, generator=g).chunk(world_size)[rank].contiguous()
    inherent = args.layers * 2 * args.mb  # the backward's own all-to-all per forward one
    configs = [(mode, name, keep) for mode in ("eager", "compiled") for name, keep in KEEP_SETS]
    models, figures = {}, {}
    for mode, name, keep in configs:
        model = _wrap(_build(args, group), mode, keep, args.inner)
        with sc.inspection.collect_records() as records:
            loss = float(model(x).pow(2).mean().detach())  # compiles
        model.zero_grad(set_to_none=True)
        params = list(model.parameters())
        nbytes = sc.inspection.autograd_saved_bytes(model, x, exclude=params) // args.layers
        model.zero_grad(set_to_none=True)
        # the backward only: Dynamo does not compile a frame under a dispatch mode
        _, counts = sc.inspection.collectives_run(model(x).pow(2).mean().backward)
        model.zero_grad(set_to_none=True)
        save = recompute = None
        if mode == "eager" and keep is not None:
            nbytes, save, recompute = _eager_engine(_build(args, group), x, keep)
        elif mode == "compiled" and keep is not None:
            tags = Counter()
            for rec in records:
                if rec.is_training:
                    tags.update(rec.node_policy.values())
            # the layers share one compiled graph when Dynamo reuses it
            per_graph = len([r for r in records if r.is_training])
            scale = args.layers // per_graph if per_graph else 0
            save, recompute = tags["MUST_SAVE"] * scale, tags["MUST_RECOMPUTE"] * scale
        figures[(mode, name)] = {
            "bytes_per_layer": nbytes,
            "backward_a2a": counts[A2A],
            "recomputed_a2a": counts[A2A] - inherent,
            "save_ops": save,
            "recompute_ops": recompute,
            "loss": loss,
        }
        for _ in range(2):
            _step(model, x)
        models[(mode, name)] = model
    # (the seeded order is the same on both ranks, whose steps wait on each other)
    medians = interleaved_medians({k: functools.partial(_step, m, x) for k, m in models.items()}, args.iters)
    for k, median in medians.items():
        figures[k]["step_s"] = median
    return {f"{m}|{n}": f for (m, n), f in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="global batch, split over the 2 ranks")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batches", dest="mb", type=int, default=1, choices=[1, 2])
    parser.add_argument("--iters", type=int, default=9)
    parser.add_argument("--inner", default="inductor", choices=["inductor", "aot_eager"])
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args()

    fig = run_ranks(_rank, args, world_size=2, timeout=args.timeout)[0]
    print(
        f"Expert-parallel MoE, 2 gloo ranks (CPU, float32): {args.layers} layers, d {args.d}, "
        f"{args.experts} experts top-2 ({args.experts // 2} per rank), global batch {args.batch} x seq "
        f"{args.seq}, {args.mb} micro-batch(es), compiled = {args.inner}; rank 0, median of {args.iters} steps"
    )
    head = (
        f"{'bytes/layer':>12} {'vs none':>7} {'bwd a2a':>7} {'recomp':>6} {'save/recompute':>15} {'step':>6}"
    )
    print(f"{'':<30} {'eager':^59} | {'compiled':^59}")
    print(f"{'configuration':<30} {head} | {head}")
    for name, _ in KEEP_SETS:
        cells = []
        for mode in ("eager", "compiled"):
            f = fig[f"{mode}|{name}"]
            base = fig[f"{mode}|no checkpoint"]
            ops = "-" if f["save_ops"] is None else f"{f['save_ops']} / {f['recompute_ops']}"
            cells.append(
                f"{f['bytes_per_layer']:>12,} {f['bytes_per_layer'] / base['bytes_per_layer']:>7.2f} "
                f"{f['backward_a2a']:>7} {f['recomputed_a2a']:>6} {ops:>15} "
                f"{f['step_s'] / base['step_s']:>5.2f}x"
            )
        print(f"{name:<30} {cells[0]} | {cells[1]}")
    base = fig["eager|no checkpoint"]["loss"]
    worst = max(abs(f["loss"] - base) for f in fig.values())
    print(f"loss agreement: max |loss - eager no-checkpoint loss| = {worst:.2e} over all configurations")
    print(
        "step ratios are to the same mode's no-checkpoint step; a compiled no-checkpoint step takes "
        f"{fig['compiled|no checkpoint']['step_s'] / fig['eager|no checkpoint']['step_s']:.2f}x an eager one"
    )
    if args.json:
        json.dump(fig, sys.stdout)
        print()


if __name__ == "__main__":
    main()
