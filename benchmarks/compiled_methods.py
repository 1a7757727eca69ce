"""A trainer that compiles methods inside an eager checkpoint (xtuner's MoE layout), per keep set.

The model is ``sac_compile.testing._dev.method_compiled.MethodCompiledMoE``: ``--layers`` MoE layers
and an MTP layer over one packed row (``cu_seqlens``), the layers' four methods (attention,
experts, shared experts, residual) compiled on the class with ``fullgraph=True`` by
``--backend`` (``inductor``: plain ``torch.compile``, what xtuner uses; ``sac``: our backend
with every region; ``aot_eager``), every layer checkpointed eagerly by ``SacConfig``. One run:

* no checkpoint, full recompute (``keep=()``), ``keep={"attn"}``, ``keep={"attn", "experts"}``;
* held: bytes held for the backward (``autograd_saved_bytes``, parameters excluded);
* attn in bwd: attention kernels the backward runs forward (the recompute), counted by the
  profiler;
* step: median forward+backward time over ``--iters`` interleaved rounds, as a ratio to full
  recompute, with its 95% bootstrap interval.

    python benchmarks/compiled_methods.py [--backend inductor --layers 8 --tokens 512 --iters 15]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys

import torch
from _timing import interleaved_times, ratio_interval

import sac_compile as sc
from sac_compile.inspection import autograd_saved_bytes
from sac_compile.testing._dev import method_compiled as mc

CONFIGS = {
    "no checkpoint": None,
    "full recompute": (),
    "keep attn": {"attn"},
    "keep attn+experts": {"attn", "experts"},
}


def _attention_in_backward(model, x, cu) -> int:
    loss = model(x.detach().requires_grad_(), cu)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss.backward()
    return sum(1 for e in prof.events() if "scaled_dot_product" in e.name and "backward" not in e.name)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="inductor", choices=("inductor", "sac", "aot_eager"))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=512, help="packed row: sequences of 64..192 tokens")
    parser.add_argument("--iters", type=int, default=15)
    args = parser.parse_args(argv)
    backend = sc.make_sac_backend(sc.ALL_REGIONS) if args.backend == "sac" else args.backend
    mc.compile_methods(backend)
    torch.manual_seed(0)
    base = mc.MethodCompiledMoE(args.layers, args.d)
    lengths, left = [], args.tokens
    while left > 0:
        lengths.append(min(left, 64 + 64 * (len(lengths) % 3)))
        left -= lengths[-1]
    x, cu = mc.packed(tuple(lengths), args.d, generator=torch.Generator().manual_seed(0))
    models = {}
    for name, keep in CONFIGS.items():
        models[name] = copy.deepcopy(base)
        if keep is not None:
            sc.SacConfig(layers=("layers.*", "mtp.layer"), keep=keep).apply(models[name])
    rows = {}
    for name, model in models.items():
        held = autograd_saved_bytes(
            lambda a, m=model: m(a, cu), x.clone().requires_grad_(), exclude=list(model.parameters())
        )
        rows[name] = {"held": held, "attn_in_bwd": _attention_in_backward(model, x, cu)}

    def step(model) -> None:
        model(x.detach().requires_grad_(), cu).backward()

    times = interleaved_times({n: (lambda m=m: step(m)) for n, m in models.items()}, args.iters)
    base_name = "full recompute"
    print(
        f"\nmethods compiled by {args.backend!r}, {args.layers} MoE layers + MTP, d {args.d}, {args.tokens} packed "
        f"tokens ({len(lengths)} sequences), torch {torch.__version__}; step = median of {args.iters} interleaved "
        f"rounds / '{base_name}'\n"
    )
    print("| configuration | held KiB | vs none | attn in bwd | step (95%) |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        ratio = statistics.median(times[name]) / statistics.median(times[base_name])
        lo, hi = ratio_interval(times, lambda m, k=name: m[k] / m[base_name])
        r["step_ratio"] = ratio
        print(
            f"| {name} | {r['held'] / 1024:.1f} | {r['held'] / rows['no checkpoint']['held']:.2f} | "
            f"{r['attn_in_bwd']} | {ratio:.2f}x ({lo:.2f}-{hi:.2f}) |"
        )
    return rows


if __name__ == "__main__":
    rows = main()
    # the verdict the issue asks for: keeping attention is no slower than full recompute
    sys.exit(0 if rows["keep attn"]["step_ratio"] <= 1.0 else 1)
