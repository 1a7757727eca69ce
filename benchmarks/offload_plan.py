"""Keep, offload or recompute at real size: one measurement, the plan per host link.

A transformers config (default Llama-3-70B) on the meta device, planned for a device (default
h100-80gb, FSDP 32, batch 2 x seq 8192, a chunked loss) once, with every keep and offload
pair measured; then chosen at the same device memory without offload and with offload over
each host link (pcie4, pcie5, c2c: ``sac_compile.planning.host.HOST_LINKS``). Side by side:
the plan per kind of layer, the step's recomputed FLOPs, the predicted peak (reserved), the
host memory a GPU's offloaded values take, the copies' seconds (every copy, and what compute
does not hide) and the predicted step. Predictions, not measurements: no GPU here.

    python benchmarks/offload_plan.py [--config examples/configs/llama3_70b.json --seq 8192 --batch 2
                                       --fsdp 32 --device h100-80gb --memory 80GB --host-memory 1TB]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def rows(args: argparse.Namespace) -> list[dict]:
    from sac_compile import hf
    from sac_compile.__main__ import _model  # (the plan command's: a config.json on the meta device)
    from sac_compile.planning.devices import Target

    target = Target(
        args.device,
        memory=args.memory,
        fsdp=args.fsdp,
        batch=args.batch,
        seq=args.seq,
        loss=args.loss,
        offload=True,
        host_memory=args.host_memory,
    )
    measured = hf.plan_for(_model(args.config), None, device=target.replace(memory=1 << 60))
    out = []
    for compile in (True, False):
        for link in (None, "pcie4", "pcie5", "c2c"):
            out.append(_row(measured, target, link, compile))
    return out


def _row(measured, target, link: str | None, compile: bool) -> dict:
    from sac_compile.planning.device_plan import choose

    at = target if link else target.replace(offload=False, host_memory=None)
    at = at.replace(host_link=link) if link else at
    plan = choose(
        measured.measured, measured.params, measured.sizes, at, compile=compile, layers=measured.layers
    )
    step = plan.step
    return {
        "layers": "compiled" if compile else "eager",
        "offload": link or "not allowed",
        "plan": "; ".join(f"{len(g.paths)}x {g.plan.chosen.label}" for g in plan.groups),
        "recompute_tflop": plan.recompute_flops / 1e12,
        "reserved_gib": plan.reserved_bytes / 2**30,
        "host_gib": plan.host_bytes / 2**30,
        "copies_s": step.transfer,
        "exposed_s": step.offload,
        "step_s": step.seconds,
        "tokens_per_second": step.tokens_per_second,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "examples/configs/llama3_70b.json"))
    parser.add_argument("--device", default="h100-80gb")
    parser.add_argument("--memory", default=None)
    parser.add_argument("--fsdp", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--loss", default="chunked")
    parser.add_argument("--host-memory", default="1TB")
    args = parser.parse_args(argv)
    found = rows(args)
    print(
        f"{Path(args.config).name}, {args.device}, fsdp {args.fsdp}, batch {args.batch} x seq {args.seq}, "
        f"loss {args.loss}, host memory {args.host_memory} a GPU (predicted)"
    )
    print(
        "| layers | offload | plan per kind of layer | recomputed TFLOP a step | reserved GiB | host GiB | "
        "copies s | exposed s | step s | tokens/s per GPU |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in found:
        print(
            f"| {r['layers']} | {r['offload']} | {r['plan']} | {r['recompute_tflop']:,.0f} | {r['reserved_gib']:.1f} | "
            f"{r['host_gib']:.0f} | {r['copies_s']:.3f} | {r['exposed_s']:.3f} | {r['step_s']:.2f} | "
            f"{r['tokens_per_second']:,.0f} |"
        )
    for layers in ("compiled", "eager"):  # at the same memory offloading never recomputes more
        rows_ = [r for r in found if r["layers"] == layers]
        assert all(r["recompute_tflop"] <= rows_[0]["recompute_tflop"] + 1e-9 for r in rows_), rows_
    return 0


if __name__ == "__main__":
    sys.exit(main())
