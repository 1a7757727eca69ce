"""Saved activation bytes per layer and step time: compiled SAC vs the alternatives.

One run, side by side, on a small pre-norm transformer stack on CPU, every layer
compiled on its own (one Dynamo graph shared by all layers):

* compiled, no checkpoint (the baseline);
* compiled, full recompute (``make_sac_backend(keep=())``);
* compiled SAC keeping attention, the MLP, both;
* PyTorch's ``activation_memory_budget`` at a few budgets (the frontier to beat).

Saved bytes per layer (parameters excluded) come from two independent sources
that must agree: the partition report and ``saved_tensors_hooks`` on the compiled
layer. Step time is forward + backward over the stack, configurations
interleaved, median over iterations, as a ratio to the baseline (CPU times are
noisy: read the ratios).

    python benchmarks/saved_memory.py [--layers 4 --d-model 256 --seq 256 --batch 4 --iters 21]
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import torch._functorch.config as functorch_config
from _baselines import BudgetBackend
from _timing import interleaved_medians

import sac_compile as sc
from sac_compile.compiler.backend import baseline_backend
from sac_compile.testing.models import Stack


def configurations(inner: str, budgets: list[float]) -> list[tuple[str, object]]:
    configs: list[tuple[str, object]] = [
        ("no checkpoint", baseline_backend(inner)),
        ("full recompute", sc.make_sac_backend((), inner=inner)),
        ("sac keep=attn", sc.make_sac_backend({"attn"}, inner=inner)),
        ("sac keep=mlp", sc.make_sac_backend({"mlp"}, inner=inner)),
        ("sac keep=attn+mlp", sc.make_sac_backend({"attn", "mlp"}, inner=inner)),
    ]
    configs += [(f"budget {b:g}", BudgetBackend(b, inner)) for b in budgets]
    return configs


def report_bytes(layer, x: torch.Tensor, backend) -> int:
    if isinstance(backend, BudgetBackend):
        with functorch_config.patch(activation_memory_budget=backend.budget):
            report = sc.inspection.capture_partition(layer, x, backend=backend.inner)
    else:
        report = sc.inspection.capture_partition(layer, x, backend=backend)
    (graph,) = [g for g in report.graphs if g.backward_compiled]
    return graph.activation_bytes + graph.input_bytes


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--iters", type=int, default=21)
    parser.add_argument("--inner", choices=["inductor", "aot_eager"], default="inductor")
    parser.add_argument("--budgets", default="0.5,0.3,0.1")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = Stack(args.layers, args.d_model, args.heads)
    x = torch.randn(args.batch, args.seq, args.d_model, requires_grad=True)
    budgets = [float(b) for b in args.budgets.split(",") if b]
    configs = configurations(args.inner, budgets)

    rows = {}
    # Every configuration compiles Block.forward with its own backend: room for all.
    with torch._dynamo.config.patch(recompile_limit=2 * len(configs)):
        compiled = {}
        for name, backend in configs:
            layer0 = model.layers[0]
            from_report = report_bytes(layer0, x, backend)
            fns = [torch.compile(layer, backend=backend) for layer in model.layers]
            compiled[name] = fns
            from_hooks = sc.inspection.autograd_saved_bytes(fns[0], x, exclude=model.parameters())
            rows[name] = {"report_bytes": from_report, "hook_bytes": from_hooks}

        def step(fns):
            h = x
            for fn in fns:
                h = fn(h)
            h.sum().backward()

        for fns in compiled.values():  # warm up (backward compiles lazily)
            step(fns)
        steps = {name: functools.partial(step, fns) for name, fns in compiled.items()}
        medians = interleaved_medians(steps, args.iters)

    base_bytes = rows["no checkpoint"]["report_bytes"]
    base_time = medians["no checkpoint"]
    print(
        f"saved activations per layer and step time, {args.layers} layers, d={args.d_model}, "
        f"seq={args.seq}, batch={args.batch}, inner={args.inner}, torch {torch.__version__}, "
        f"median of {args.iters} interleaved steps"
    )
    header = f"{'configuration':<20} {'report KiB':>11} {'hooks KiB':>10} {'vs no-ckpt':>10} {'step ms':>9} {'time ratio':>10}"
    print(header)
    print("-" * len(header))
    for name in compiled:
        row = rows[name]
        median = medians[name]
        row.update(
            step_ms=median * 1e3, time_ratio=median / base_time, bytes_ratio=row["report_bytes"] / base_bytes
        )
        agree = "" if row["report_bytes"] == row["hook_bytes"] else "  (sources disagree)"
        print(
            f"{name:<20} {row['report_bytes'] / 1024:>11.1f} {row['hook_bytes'] / 1024:>10.1f} "
            f"{row['bytes_ratio']:>10.2f} {row['step_ms']:>9.1f} {row['time_ratio']:>10.2f}{agree}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
