"""What float8 training changes in a layer's memory, traced at real size as it would run.

A transformers config (default Llama-3-8B) on the meta device, planned twice for the same
device and layout: as built (bfloat16) and with torchao's float8 training conversion
(``convert_to_float8_training``, tensorwise dynamic scaling, every linear but the output
projection, as torchtitan converts). On the meta device the float8 layer traces
``aten._scaled_mm`` with its real operands (1-byte casts of inputs, weights and output
gradients), so the planner's own figures show what float8 keeps. Side by side per
configuration (no AC, full AC, torchtitan's per-op SAC): one layer's saved bytes and its
backward's transient, and the predicted step peak.

Needs torchao (``pip install --no-deps torchao==0.18.0``: pure Python, no dependencies).
Not modelled either way: FSDP's float8 all-gather (weights gathered in one byte), which
halves the all-gathered weights a step holds.

    python benchmarks/float8_layers.py [--config examples/configs/llama3_8b.json --seq 8192
                                        --batch 2 --fsdp 8 --device h100-96gb]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGURATIONS = (("none", None), ("full", ()), ("torchtitan-op", "torchtitan-op"))


def measure(args: argparse.Namespace, float8: bool) -> dict:
    from sac_compile import hf
    from sac_compile.__main__ import _model
    from sac_compile.planning.devices import Target

    model = _model(args.config)
    if float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(
            model, config=Float8LinearConfig(), module_filter_fn=lambda _, fqn: fqn != "lm_head"
        )
    target = Target(args.device, batch=args.batch, seq=args.seq, fsdp=args.fsdp, loss=args.loss)
    start = time.perf_counter()
    plan = hf.plan_for(model, None, device=target, include=())
    seconds = time.perf_counter() - start
    if len(plan.groups) != 1:
        raise SystemExit(
            f"{args.config}: {len(plan.groups)} kinds of layer; this benchmark compares one (a dense model)"
        )
    table = plan.groups[0].plan
    layer = {
        "none": (table.no_checkpoint_bytes, table.no_checkpoint_transient),
        "full": next(
            (c.saved_bytes, c.transient_bytes) for c in table.candidates if not c.keep and c.budget is None
        ),
        "torchtitan-op": (table.op_sac.saved_bytes, table.op_sac.transient_bytes),
    }
    peaks = {name: plan.configuration(ac)[0].reserved for name, ac in CONFIGURATIONS}
    return {"layer": layer, "peak": peaks, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(ROOT / "examples" / "configs" / "llama3_8b.json"))
    parser.add_argument("--device", default="h100-96gb")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--fsdp", type=int, default=8)
    parser.add_argument("--loss", default="torchtitan")
    args = parser.parse_args(argv)
    try:
        import torchao  # noqa: F401
    except ImportError:
        print("needs torchao: pip install --no-deps torchao==0.18.0", file=sys.stderr)
        return 2
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    bf16, f8 = measure(args, False), measure(args, True)
    gib, mib = 2**30, 2**20
    print(f"{Path(args.config).stem} on {args.device}: fsdp {args.fsdp}, batch {args.batch} x seq {args.seq}")
    print(
        "| AC | layer saves MiB (bf16 / float8) | backward transient MiB (bf16 / float8) | step peak GiB reserved (bf16 / float8) |"
    )
    print("|---|---:|---:|---:|")
    for name, _ in CONFIGURATIONS:
        (s0, t0), (s1, t1) = bf16["layer"][name], f8["layer"][name]
        p0, p1 = bf16["peak"][name], f8["peak"][name]
        print(
            f"| {name} | {s0 / mib:,.0f} / {s1 / mib:,.0f} ({s1 / s0:.2f}x) | {t0 / mib:,.0f} / {t1 / mib:,.0f} "
            f"({t1 / t0:.2f}x) | {p0 / gib:.1f} / {p1 / gib:.1f} |"
        )
    print(f"(planned in {bf16['seconds']:.0f} s and {f8['seconds']:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
