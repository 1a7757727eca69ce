"""Shared by hf_llama.py and hf_moe.py: declare, wrap, train, compare, report."""

from __future__ import annotations

import argparse

import torch

import sac_compile as sc
from sac_compile import hf


def options(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--inner",
        default="inductor",
        choices=["inductor", "aot_eager"],
        help="compiler behind the sac backend",
    )
    return parser.parse_args()


def train(model, ids, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        losses.append(loss.item())
    return losses, grads


def walkthrough(build, keep: set[str], *, steps: int, inner: str, compiled: bool = True) -> None:
    reference = build()
    regions = hf.regions_for(reference)
    ids = hf.batch(reference)
    print(f"model: {type(reference).__name__}, {len(reference.model.layers)} decoder layers")
    print("declared regions:", ", ".join(f"{p} -> {n!r}" for p, n in regions.items()))
    ref_losses, ref_grads = train(reference, ids, steps)
    print(f"  no checkpoint       losses: {' '.join(f'{v:.5f}' for v in ref_losses)}")

    modes = [("eager", False)] + ([(f"compiled ({inner})", {"inner": inner})] if compiled else [])
    for label, compile_opt in modes:
        model = build()
        cfg = hf.config_for(model, keep=keep, compile=compile_opt)
        cfg.apply(model)
        losses, grads = train(model, ids, steps)
        worst = max((grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads)
        same = all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads) and losses == ref_losses
        verdict = "bit-identical" if same else f"max |grad diff| {worst:.1e}"
        print(
            f"  SAC keep={sorted(keep)} {label:<20} losses: {' '.join(f'{v:.5f}' for v in losses)}  ({verdict})"
        )

    print(
        f"\n== partition report: decoder layer 0 compiled with make_sac_backend({sorted(keep)}, inner={inner!r}) =="
    )
    probe = build()
    sc.declare_regions(probe, regions)
    layer, h = hf.layer_call(probe, ids)
    torch._dynamo.reset()
    report = sc.inspection.capture_partition(layer, h, backend=sc.make_sac_backend(keep, inner=inner))
    print(report.format())
    print("\n== saved bytes of decoder layer 0 by keep set (parameters excluded) ==")
    torch._dynamo.reset()
    none = sc.inspection.capture_partition(layer, h, backend=inner).saved_bytes
    print(f"  {'no checkpoint':<28} {none:>10,} B  1.00")
    names = sorted(set(regions.values()))
    keep_sets = [(), *[(n,) for n in names], tuple(sorted(keep))]
    for ks in dict.fromkeys(keep_sets):  # in order, without repeats
        torch._dynamo.reset()
        r = sc.inspection.capture_partition(layer, h, backend=sc.make_sac_backend(set(ks), inner=inner))
        by_region = {k: v for k, v in sorted(r.bytes_by_region().items()) if k != "param" and v}
        print(
            f"  keep={'+'.join(ks) or '()':<23} {r.saved_bytes:>10,} B  {r.saved_bytes / none:.2f}  {by_region}"
        )
