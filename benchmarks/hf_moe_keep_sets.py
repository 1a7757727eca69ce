"""Hugging Face Qwen3-MoE, per keep set: saved bytes per layer and step time, eager and compiled.

One run, side by side, on a small random ``Qwen3MoeForCausalLM`` (CPU, float32,
transformers' default ``grouped_mm`` experts unless ``--experts eager``). Regions
are declared by module path (``sac_compile.hf.regions_for``: attn, router,
experts); every decoder layer is wrapped by one ``SacConfig``:

* no checkpoint (eager; compiled per layer without the tagging pass);
* keep=() -- full recompute;
* keep=attn, keep=experts, keep=attn+experts.

Saved bytes per layer (parameters excluded, the layer's input included):
eager no checkpoint from ``saved_tensors_hooks``; eager SAC from the engine
(held activations + the checkpointed input); compiled from the partition report
of decoder layer 0. Step time: forward + backward of the LM loss, configurations
interleaved, median over iterations, as a ratio to the same mode's no-checkpoint
run (CPU times are noisy: read the ratios).

    python benchmarks/hf_moe_keep_sets.py [--layers 4 --hidden 256 --experts-n 8 --seq 256 --batch 4 --iters 11]
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
from _timing import interleaved_medians

import sac_compile as sc
from sac_compile import hf
from sac_compile.compiler.backend import baseline_backend
from sac_compile.eager import checkpoint_with_regions
from sac_compile.testing import hf_families

KEEP_SETS: list[tuple[str, tuple[str, ...]]] = [
    ("keep=() full recompute", ()),
    ("keep=attn", ("attn",)),
    ("keep=experts", ("experts",)),
    ("keep=attn+experts", ("attn", "experts")),
]


def build(args, seed: int = 0):
    model = hf_families.tiny_qwen3_moe(
        experts_implementation=args.experts,
        layers=args.layers,
        hidden=args.hidden,
        experts=args.experts_n,
        seed=seed,
    )
    return model.train()


def step(model, ids) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)


def eager_bytes(model, ids, keep) -> int:
    """Bytes one decoder layer holds for backward in eager mode."""
    layer, h = hf.layer_call(model, ids)
    if keep is None:
        return sc.inspection.autograd_saved_bytes(layer, h, exclude=model.parameters())
    stats: list = []
    checkpoint_with_regions(layer, h, keep=set(keep), stats_out=stats).sum().backward()
    activations = sum(v for k, v in stats[0].held_by_region.items() if k != "rng")
    return activations + h.untyped_storage().nbytes()


def compiled_bytes(model, ids, keep) -> int:
    layer, h = hf.layer_call(model, ids)
    backend = baseline_backend("inductor") if keep is None else sc.make_sac_backend(set(keep))
    torch._dynamo.reset()
    return sc.inspection.capture_partition(layer, h, backend=backend).saved_bytes


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts-n", type=int, default=8)
    parser.add_argument("--experts", default="grouped_mm", choices=["grouped_mm", "eager"])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--iters", type=int, default=11)
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args()
    torch.manual_seed(0)

    reference = build(args)
    ids = hf.batch(reference, batch=args.batch, seq=args.seq)
    configs: list[tuple[str, str, tuple[str, ...] | None]] = []
    for mode in ("eager", "compiled"):
        configs.append((mode, "no checkpoint", None))
        configs += [(mode, name, keep) for name, keep in KEEP_SETS]

    # Bytes per layer, from one probe model with the regions declared.
    probe = build(args)
    sc.declare_regions(probe, hf.regions_for(probe))
    nbytes = {}
    for mode, name, keep in configs:
        fn = eager_bytes if mode == "eager" else compiled_bytes
        nbytes[(mode, name)] = fn(probe, ids, keep)
    torch._dynamo.reset()

    # One model per configuration, same weights; compile and warm up, then time interleaved.
    models = {}
    losses = {}
    for mode, name, keep in configs:
        model = build(args)
        model.load_state_dict(reference.state_dict())
        if keep is None:
            if mode == "compiled":
                for layer in model.model.layers:
                    layer.compile(backend=baseline_backend("inductor"))
        else:
            hf.config_for(model, keep=set(keep), compile=(mode == "compiled")).apply(model)
        losses[(mode, name)] = float(model(input_ids=ids, labels=ids).loss.detach())
        for _ in range(2):
            step(model, ids)
        models[(mode, name)] = model
    med = interleaved_medians({k: functools.partial(step, m, ids) for k, m in models.items()}, args.iters)
    print(
        f"Qwen3-MoE ({args.experts} experts): {args.layers} layers, hidden {args.hidden}, "
        f"{args.experts_n} experts top-2, seq {args.seq}, batch {args.batch}, CPU float32, "
        f"median of {args.iters} steps"
    )
    print(
        f"{'configuration':<24} {'eager B/layer':>14} {'vs none':>8} {'step':>7}   "
        f"{'compiled B/layer':>16} {'vs none':>8} {'step':>7}"
    )
    rows = []
    for name in ["no checkpoint"] + [n for n, _ in KEEP_SETS]:
        row = {"configuration": name}
        cells = []
        for mode in ("eager", "compiled"):
            b = nbytes[(mode, name)]
            base_b = nbytes[(mode, "no checkpoint")]
            ratio_t = med[(mode, name)] / med[(mode, "no checkpoint")]
            row[mode] = {"bytes_per_layer": b, "bytes_ratio": b / base_b, "step_time_ratio": ratio_t}
            cells.append((b, b / base_b, ratio_t))
        (eb, er, et), (cb, cr, ct) = cells
        print(f"{name:<24} {eb:>14,} {er:>8.2f} {et:>6.2f}x   {cb:>16,} {cr:>8.2f} {ct:>6.2f}x")
        rows.append(row)
    base = losses[("eager", "no checkpoint")]
    worst = max(abs(v - base) for v in losses.values())
    print(f"loss agreement: max |loss - eager no-checkpoint loss| = {worst:.2e} over all configurations")
    print(
        "step ratios are to the same mode's no-checkpoint step; a compiled no-checkpoint step takes "
        f"{med[('compiled', 'no checkpoint')] / med[('eager', 'no checkpoint')]:.2f}x an eager one"
    )
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
