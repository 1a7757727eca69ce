"""The memory-recompute frontier: sac-compile's keep sets against PyTorch's own options.

One decoder layer of each model, compiled on its own, every configuration side by side in one run:

* PyTorch: no checkpoint, full recompute, op-list SAC (``create_selective_checkpoint_contexts``
  saving the matmul / attention / grouped-matmul ops, the rest ``PREFER_RECOMPUTE``), and an
  ``activation_memory_budget`` sweep (the partitioner's knapsack, 0.0 ... 1.0);
* sac-compile: every keep set over the model's regions, and each single region kept plus ``budget=``;
* ``sac_compile.plan`` at every budget point's bytes (one measured table per layer, its time
  printed), with the Inductor step ratio of each point and each plan.

Figures are noise-free: *saved bytes* are the distinct storages autograd saves for the layer's
backward (``saved_tensors_hooks``, parameters excluded, the layer input included), and
*recomputed FLOPs* are the matmul / attention / grouped-matmul FLOPs the backward runs beyond the
no-checkpoint backward's, counted with a dispatch mode over an ``aot_eager`` backward (inside the
``run_with_rng_state`` wrapper the partitioner puts around recomputed seeded ops such as the CPU
SDPA kernel). The eager engine's figures (bytes the checkpoint and the engine hold after the
forward, FLOPs its backward recomputes) sit beside the compiled ones; Inductor saved bytes and
interleaved median step-time ratios (Inductor, forward + backward) for the main configurations.

It prints, per model, the table, which configuration dominates which of ours (<= bytes and <=
FLOPs, strictly better on one), and writes a PNG: PyTorch's budget sweep as a line, the other
PyTorch points and our keep sets as markers.

    python benchmarks/frontier.py [--models demo,llama,qwen3moe --batch 4 --seq 128 --hidden 128]
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import math
import sys
import time

import torch
from _baselines import BudgetBackend, OpListSAC
from _timing import interleaved_medians

import sac_compile as sc
from sac_compile.compiler.backend import baseline_backend
from sac_compile.eager import checkpoint_with_regions
from sac_compile.inspection.flops import CountFlops, saved_bytes_and_backward_flops, scalar_loss

aten = torch.ops.aten


# --- counting recomputed FLOPs (sac_compile.inspection.flops) ----------------------------------


def measure(fn, x: torch.Tensor, params) -> tuple[int, int]:
    """(saved bytes, backward FLOPs) of one forward + backward of ``fn(x)``."""
    return saved_bytes_and_backward_flops(fn, x, exclude=params)


def measure_eager(unit, x: torch.Tensor, keep) -> tuple[int, int]:
    """The eager engine: bytes held after the forward (engine cache + the checkpoint's input), FLOPs."""
    stats: list = []
    loss = scalar_loss(checkpoint_with_regions(unit, x, keep=keep, stats_out=stats))
    counter = CountFlops()
    with counter:
        loss.backward()
    held = stats[0].held_bytes - stats[0].held_by_region.get("rng", 0)
    return held + x.untyped_storage().nbytes(), counter.flops


# --- the models (one decoder layer each) ------------------------------------------------------


def demo_unit(args):
    from sac_compile.testing.models import MoETransformer

    torch.manual_seed(0)
    model = MoETransformer(vocab=256, d=args.hidden, n_layers=1, heads=4, n_experts=8, top_k=2)
    sc.declare_regions(model, MoETransformer.REGIONS)
    ids = torch.randint(0, 256, (args.batch, args.seq))
    x = model.embed(ids).detach().requires_grad_()
    return model.layers[0], x, ("attn", "router", "experts")


def _hf_unit(build, args):
    from sac_compile import hf

    model = build().train()
    regions = hf.regions_for(model)
    sc.declare_regions(model, regions)
    unit, x = hf.layer_call(model, hf.batch(model, batch=args.batch, seq=args.seq))
    return unit, x.detach().requires_grad_(), tuple(dict.fromkeys(regions.values()))


def llama_unit(args):
    from sac_compile.testing import hf_families

    return _hf_unit(functools.partial(hf_families.tiny_llama, layers=1, hidden=args.hidden), args)


def qwen3moe_unit(args):
    from sac_compile.testing import hf_families

    return _hf_unit(
        functools.partial(hf_families.tiny_qwen3_moe, layers=1, hidden=args.hidden, experts=8), args
    )


def qwen2moe_unit(args):
    """Qwen2-MoE: four regions (attn, router, experts, shared_experts), the planner's 60 s case."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    def build():
        h = args.hidden
        cfg = Qwen2MoeConfig(
            vocab_size=128,
            hidden_size=h,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=2 * h,
            moe_intermediate_size=h // 2,
            shared_expert_intermediate_size=h,
            num_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=max(args.seq, 64),
            pad_token_id=0,
            attn_implementation="sdpa",
        )
        torch.manual_seed(0)
        return Qwen2MoeForCausalLM(cfg)

    return _hf_unit(build, args)


UNITS = {"demo": demo_unit, "llama": llama_unit, "qwen3moe": qwen3moe_unit, "qwen2moe": qwen2moe_unit}

# --- the configurations -------------------------------------------------------------------------


def configurations(regions, budgets, keep_budgets, inner):
    """(name, kind, callable making the compiled fn from the unit, eager keep or None)."""
    out = [
        ("no checkpoint", "torch", lambda u: torch.compile(u, backend=baseline_backend(inner)), None),
        (
            "full recompute",
            "torch",
            lambda u: torch.compile(u, backend=sc.make_sac_backend((), inner=inner)),
            (),
        ),
        (
            "op-list SAC",
            "torch",
            lambda u: torch.compile(OpListSAC(u), backend=baseline_backend(inner)),
            None,
        ),
    ]
    for b in budgets:
        out.append(
            (
                f"budget {b:.1f}",
                "budget",
                lambda u, b=b: torch.compile(u, backend=BudgetBackend(b, inner)),
                None,
            )
        )
    for n in range(1, len(regions) + 1):
        for keep in itertools.combinations(regions, n):
            backend = sc.make_sac_backend(set(keep), inner=inner)
            out.append(
                (f"keep {'+'.join(keep)}", "ours", lambda u, be=backend: torch.compile(u, backend=be), keep)
            )
    for region in regions:  # one kept region, PyTorch's knapsack for the rest of the layer
        for b in keep_budgets:
            backend = sc.make_sac_backend({region}, inner=inner, budget=b)
            name = f"keep {region}, budget {b:g}"
            out.append((name, "ours+budget", lambda u, be=backend: torch.compile(u, backend=be), None))
    return out


def dominates(a: dict, b: dict) -> bool:
    return (
        a["bytes"] <= b["bytes"]
        and a["flops"] <= b["flops"]
        and (a["bytes"] < b["bytes"] or a["flops"] < b["flops"])
    )


def run_unit(name: str, args) -> dict:
    unit, x, regions = UNITS[name](args)
    params = list(unit.parameters())
    budgets = [round(0.1 * i, 1) for i in range(11)]
    keep_budgets = [float(b) for b in args.keep_budgets.split(",") if b]
    configs = configurations(regions, budgets, keep_budgets, "aot_eager")
    rows: dict[str, dict] = {}
    with torch._dynamo.config.patch(
        recompile_limit=4 * len(configs) + 16, cache_size_limit=4 * len(configs) + 16
    ):
        for cname, kind, make, _ in configs:
            torch._dynamo.reset()
            saved, flops = measure(make(unit), x, params)
            rows[cname] = {"kind": kind, "bytes": saved, "bw_flops": flops}
        base = rows["no checkpoint"]["bw_flops"]
        for row in rows.values():
            row["flops"] = row["bw_flops"] - base
        torch._dynamo.reset()
        start = time.perf_counter()
        table = sc.plan(unit, x, memory=1.0, eager=False)
        plan_seconds = time.perf_counter() - start
        planned = planner_rows(table, rows)
        # eager: PyTorch without checkpointing, full recompute, and the engine per keep set
        torch._dynamo.reset()
        eager_none_bytes, eager_base = measure(unit, x, params)
        rows["no checkpoint"]["eager_bytes"], rows["no checkpoint"]["eager_flops"] = eager_none_bytes, 0
        for cname, _kind, _, keep in configs:
            if keep is None:
                continue
            b, f = measure_eager(unit, x, frozenset(keep))
            rows[cname]["eager_bytes"], rows[cname]["eager_flops"] = b, f - eager_base
        if args.inductor:
            main = [c for c in configs if c[1] in ("torch", "ours")]
            fns = {}
            for cname, _, _, _ in main:
                torch._dynamo.reset()
                fn = dict((c[0], c) for c in configurations(regions, [], [], "inductor"))[cname][2](unit)
                rows[cname]["inductor_bytes"] = measure(fn, x, params)[0]
                fns[cname] = fn
            # one compile per distinct budget partition (bytes, FLOPs) and per distinct plan
            timed_budget = {}
            for r in planned:
                timed_budget.setdefault((r["bytes"], r["flops"]), f"budget {r['budget']:.1f}")
                r["budget_key"] = timed_budget[(r["bytes"], r["flops"])]
            for key in timed_budget.values():
                fns[key] = torch.compile(unit, backend=BudgetBackend(float(key.split()[1]), "inductor"))
            for c in {r["candidate"].label: r["candidate"] for r in planned if r["plan"]}.values():
                backend = sc.make_sac_backend(c.keep, policy=c.policy, budget=c.budget, inner="inductor")
                fns[f"plan: {c.label}"] = torch.compile(unit, backend=backend)

            def step(fn):
                unit.zero_grad(set_to_none=True)
                scalar_loss(fn(x)).backward()

            for f in fns.values():
                step(f)  # compile (again, after the resets above) outside the timed rounds
            medians = interleaved_medians({c: functools.partial(step, f) for c, f in fns.items()}, args.iters)
            steps = {c: m / medians["no checkpoint"] for c, m in medians.items()}
            for cname, ratio in steps.items():
                if cname in rows:
                    rows[cname]["step_ratio"] = ratio
            for r in planned:
                r["budget_step"] = steps.get(r.pop("budget_key"))
                r["plan_step"] = steps.get(f"plan: {r['candidate'].label}") if r["plan"] else None
    for r in planned:
        r.pop("candidate")
    return {
        "regions": regions,
        "rows": rows,
        "x_bytes": x.untyped_storage().nbytes(),
        "planned": planned,
        "plan_seconds": plan_seconds,
        "plan_candidates": len(table.candidates),
        "plan_search": table.search,
        "plan_front": sorted((c.saved_bytes, c.recompute_flops) for c in table.candidates if c.pareto),
    }


def planner_rows(table, rows: dict) -> list[dict]:
    """For every PyTorch budget point: ``plan(memory=<its bytes>)`` chosen from one measured table."""
    out = []
    for cname, r in rows.items():
        if r["kind"] != "budget":
            continue
        c, over = _select(table, r["bytes"]), False
        if c is None:  # below every candidate (budget 0: the inputs alone): within 1% over them
            c, over = _select(table, int(1.01 * r["bytes"])), True
        out.append(
            {
                "budget": float(cname.split()[1]),
                "bytes": r["bytes"],
                "flops": r["flops"],
                "plan": (c.label + (" (+1%)" if over else "")) if c else None,
                "plan_bytes": c.saved_bytes if c else None,
                "plan_flops": c.recompute_flops if c else None,
                "candidate": c,
            }
        )
    return out


def _select(table, memory: int):
    try:
        return table.select(memory).chosen
    except ValueError:
        return None


def report_planner(name: str, result: dict) -> list[str]:
    """The planner beside each PyTorch budget point; problems where it does worse."""
    mib, problems, better = 2.0**20, [], 0
    print(
        f"\nplanner ({name}): plan(memory=<the budget point's bytes>), {result['plan_candidates']} candidates "
        f"({result['plan_search']}) measured in {result['plan_seconds']:.1f} s"
    )
    print(
        f"{'PyTorch':<12} {'MiB':>7} {'GFLOP':>7} {'step':>6} | {'plan':<42} {'MiB':>7} {'GFLOP':>7} {'step':>6}"
    )
    for r in result["planned"]:
        bs = f"{r['budget_step']:>5.2f}x" if r.get("budget_step") else f"{'':>6}"
        head = f"budget {r['budget']:<5.1f} {r['bytes'] / mib:>7.3f} {r['flops'] / 1e9:>7.3f} {bs} | "
        if r["plan"] is None:
            print(head + "(nothing measured fits within 1% of these bytes)")
            problems.append(f"{name}: no plan within 1% of budget {r['budget']:.1f}'s bytes")
            continue
        ps = f"{r['plan_step']:>5.2f}x" if r.get("plan_step") else f"{'':>6}"
        print(head + f"{r['plan']:<42} {r['plan_bytes'] / mib:>7.3f} {r['plan_flops'] / 1e9:>7.3f} {ps}")
        if r["plan_flops"] > r["flops"] or r["plan_bytes"] > 1.01 * r["bytes"]:
            problems.append(
                f"{name}: the plan at budget {r['budget']:.1f}'s bytes does worse than that point"
            )
        better += r["plan_flops"] < r["flops"] or r["plan_bytes"] < r["bytes"]
    print(f"strictly better than {better} of {len(result['planned'])} budget points")
    if not better:
        problems.append(f"{name}: the planner is nowhere strictly better than PyTorch's budget points")
    return problems


def report(name: str, result: dict) -> list[str]:
    rows = result["rows"]
    problems = []
    none = rows["no checkpoint"]
    print(f"\n== {name}: one decoder layer, regions {', '.join(result['regions'])} ==")
    head = (
        f"{'configuration':<26} {'saved MiB':>9} {'vs none':>7} {'recomp GFLOP':>12} "
        f"{'eager MiB':>9} {'eager GFLOP':>11} {'inductor MiB':>12} {'step':>6}"
    )
    print(head)
    print("-" * len(head))
    mib = 2.0**20
    for cname, r in rows.items():
        eb = f"{r['eager_bytes'] / mib:>9.3f}" if "eager_bytes" in r else f"{'':>9}"
        ef = f"{r['eager_flops'] / 1e9:>11.4f}" if "eager_flops" in r else f"{'':>11}"
        ib = f"{r['inductor_bytes'] / mib:>12.3f}" if "inductor_bytes" in r else f"{'':>12}"
        st = f"{r['step_ratio']:>5.2f}x" if "step_ratio" in r else f"{'':>6}"
        print(
            f"{cname:<26} {r['bytes'] / mib:>9.3f} {r['bytes'] / none['bytes']:>7.2f} "
            f"{r['flops'] / 1e9:>12.4f} {eb} {ef} {ib} {st}"
        )
    theirs = {c: r for c, r in rows.items() if r["kind"] in ("torch", "budget")}
    ours = {c: r for c, r in rows.items() if r["kind"] in ("ours", "ours+budget")}
    print("dominance (a PyTorch point with <= bytes and <= FLOPs, better on one):")
    for cname, r in ours.items():
        beaten = [t for t, tr in theirs.items() if dominates(tr, r)]
        beats = [t for t, tr in theirs.items() if dominates(r, tr)]
        verdict = f"DOMINATED by {', '.join(beaten)}" if beaten else "on the frontier"
        print(f"  {cname:<26} {verdict}; dominates {len(beats)} PyTorch point(s)")
        if beaten and r["kind"] == "ours":  # a keep+budget point is PyTorch's knapsack's choice
            problems.append(f"{name}: {cname} dominated by {', '.join(beaten)}")
    everything = rows[f"keep {'+'.join(result['regions'])}"]
    zero = min((tr["bytes"] for tr in theirs.values() if tr["flops"] <= 0), default=none["bytes"])
    print(
        f"keep-everything: {everything['bytes'] / zero:.3f}x the zero-recompute point's bytes, "
        f"{everything['bytes'] / none['bytes']:.3f}x no checkpoint (compiled), "
        f"{everything['eager_bytes'] / none['eager_bytes']:.3f}x (eager)"
    )
    if everything["bytes"] > 1.01 * zero or everything["bytes"] > none["bytes"]:
        problems.append(f"{name}: keep-everything saves more than the zero-recompute point or no checkpoint")
    for cname, r in ours.items():
        if "eager_bytes" in r and r["eager_bytes"] > none["eager_bytes"]:
            problems.append(f"{name}: eager {cname} holds more than eager no checkpoint")
    return problems


def _pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The lower-left staircase of (bytes, flops) points: what no other point dominates."""
    front, best = [], math.inf
    for b, f in sorted(points):
        if f < best:
            if front:
                front.append((b, front[-1][1]))  # horizontal step to the next point
            front.append((b, f))
            best = f
    return front


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.5), squeeze=False)
    for ax, (name, result) in zip(axes[0], results.items()):
        rows = result["rows"]
        sweep = [(r["bytes"] / 2**20, r["flops"] / 1e9) for r in rows.values() if r["kind"] == "budget"]
        ax.plot(*zip(*sweep), "o", color="tab:gray", ms=3, label="activation_memory_budget 0.0-1.0")
        theirs = [
            (r["bytes"] / 2**20, r["flops"] / 1e9) for r in rows.values() if r["kind"] in ("torch", "budget")
        ]
        ax.plot(*zip(*_pareto(theirs)), "-", color="tab:gray", lw=1, label="PyTorch's frontier")
        for cname, marker in (("no checkpoint", "s"), ("full recompute", "v"), ("op-list SAC", "D")):
            r = rows[cname]
            ax.plot(r["bytes"] / 2**20, r["flops"] / 1e9, marker, color="tab:gray", ms=7, label=cname)
        ours = [(c, r) for c, r in rows.items() if r["kind"] == "ours"]
        ax.scatter(
            [r["bytes"] / 2**20 for _, r in ours],
            [r["flops"] / 1e9 for _, r in ours],
            color="tab:red",
            zorder=3,
            label="sac-compile keep sets",
        )
        for c, r in ours:
            ax.annotate(
                c.removeprefix("keep "),
                (r["bytes"] / 2**20, r["flops"] / 1e9),
                fontsize=7,
                xytext=(4, 3),
                textcoords="offset points",
            )
        kb = [r for r in rows.values() if r["kind"] == "ours+budget"]
        if kb:
            ax.scatter(
                [r["bytes"] / 2**20 for r in kb],
                [r["flops"] / 1e9 for r in kb],
                color="tab:orange",
                marker="^",
                zorder=3,
                label="one region kept + budget",
            )
        front = [(b / 2**20, f / 1e9) for b, f in result["plan_front"]]
        ax.plot(*zip(*_pareto(front)), "--", color="tab:red", lw=1.2, label="sac_compile.plan's frontier")
        ax.set_title(name)
        ax.set_xlabel("saved activations per layer (MiB)")
        ax.set_ylabel("recomputed GFLOP per step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="demo,llama,qwen3moe,qwen2moe")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--keep-budgets", default="0.3,0.6", help="budgets after each single kept region")
    parser.add_argument("--no-inductor", dest="inductor", action="store_false", help="skip Inductor figures")
    parser.add_argument("--iters", type=int, default=11)
    parser.add_argument("--plot", default="frontier.png")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    gc.freeze()  # the imports, out of the collector's full collections (saved bytes are measured unfrozen)
    names = [m for m in args.models.split(",") if m]
    unknown = set(names) - set(UNITS)
    if unknown:
        parser.error(f"unknown model(s) {sorted(unknown)}; choose from {sorted(UNITS)}")
    print(
        f"frontier: batch {args.batch} x seq {args.seq}, hidden {args.hidden}, torch {torch.__version__}; "
        "bytes and FLOPs per layer (aot_eager partitions), step = Inductor median ratio vs no checkpoint"
    )
    results = {name: run_unit(name, args) for name in names}
    problems = [p for name, result in results.items() for p in report(name, result)]
    problems += [p for name, result in results.items() for p in report_planner(name, result)]
    if args.plot:
        plot(results, args.plot)
        print(f"\nwrote {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2, default=str)
    if problems:
        print("\nNOT on the frontier:\n  " + "\n  ".join(problems))
        return 1
    print("\nevery keep set is on the frontier (no PyTorch point dominates it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
