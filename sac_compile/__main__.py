"""``python -m sac_compile plan CONFIG --seq S --batch B --device DEV --memory M``.

Plans a transformers model for a device from its ``config.json`` (a decoder, an MoE, a
vision-language model): the model is built on the meta device (nothing allocated), each kind
of layer traced with the device's attention kernel and measured, and the least recompute
whose predicted step peak fits the memory is printed per kind of layer, with the peak's
breakdown and a step-time estimate; ``--json`` writes the same as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from typing import Any

__all__ = ["main"]


def _model(path: str) -> Any:
    """The model of a transformers ``config.json`` (a file, or a folder holding one), on the
    meta device, in training mode."""
    import os

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        if os.path.isdir(path):
            config = AutoConfig.from_pretrained(path)
        else:
            with open(path) as f:
                raw = json.load(f)
            kind = raw.get("model_type")
            if kind not in CONFIG_MAPPING:
                raise ValueError(f"model_type {kind!r} is not one transformers knows")
            config = CONFIG_MAPPING[kind].from_dict(raw)
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise SystemExit(
            f"sac_compile plan: cannot read {path!r} as a transformers config.json: {e}"
        ) from None
    config.use_cache = False
    errors = []
    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        try:
            with torch.device("meta"):
                return auto.from_config(config).train()
        except (ValueError, KeyError, TypeError) as e:
            errors.append(f"{auto.__name__}: {str(e).splitlines()[0][:200]}")
    raise SystemExit(
        f"sac_compile plan: transformers cannot build {path!r} ({type(config).__name__}): {'; '.join(errors)}"
    )


def _progress(done: int, total: int, what: str) -> None:
    width = 24
    bar = "#" * (width * done // max(total, 1))
    print(
        f"\r  measuring [{bar:<{width}}] {done}/{total} {what:<40}",
        end="" if done < total else "\n",
        file=sys.stderr,
    )
    sys.stderr.flush()


def _report(plan: Any, seconds: float) -> dict[str, Any]:
    t = plan.target
    return {
        "device": t.device.name,
        "memory": t.memory,
        "usable": t.usable,
        "fsdp": t.fsdp,
        "tp": t.tp,
        "ep": t.ep,
        "batch": t.batch,
        "seq": t.seq,
        "param_dtype": str(t.param_dtype).removeprefix("torch."),
        "optimizer": t.optimizer,
        "compile": plan.compile,
        "peak_bytes": plan.peak_bytes,
        "fits": plan.fits,
        "phase": plan.peak.phase,
        "breakdown": plan.breakdown,
        "step_seconds": plan.step_seconds,
        "planning_seconds": round(seconds, 1),
        "groups": [
            {
                "kind": g.kind,
                "layers": list(g.paths),
                "count": len(g.paths),
                "keep": sorted(g.plan.keep),
                "budget": g.plan.budget,
                "saved_bytes": g.plan.saved_bytes,
                "recompute_flops": g.plan.recompute_flops,
            }
            for g in plan.groups
        ],
    }


def plan_command(argv: list[str]) -> int:
    from .planning.devices import DEVICES

    parser = argparse.ArgumentParser(
        prog="python -m sac_compile plan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", help="a transformers config.json (or a folder holding one)")
    parser.add_argument("--seq", type=int, required=True, help="sequence length per device")
    parser.add_argument("--batch", type=int, default=1, help="sequences per device (default 1)")
    parser.add_argument("--device", required=True, help=f"one of {', '.join([*DEVICES, 'cpu'])}")
    parser.add_argument(
        "--memory", default=None, help="memory per device, bytes or '80GiB' (default: the device's)"
    )
    parser.add_argument("--fsdp", type=int, default=1, help="FSDP degree (default 1)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    parser.add_argument(
        "--ep", type=int, default=1, help="expert-parallel degree, a divisor of --fsdp (default 1)"
    )
    parser.add_argument("--eager", action="store_true", help="plan for the eager engine (keep sets only)")
    parser.add_argument("--json", default=None, help="write the plan as JSON to this path")
    args = parser.parse_args(argv)
    import logging
    import warnings

    from . import hf
    from .planning.devices import Target

    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    start = time.perf_counter()
    try:
        target = Target(
            args.device,
            memory=args.memory,
            fsdp=args.fsdp,
            tp=args.tp,
            ep=args.ep,
            batch=args.batch,
            seq=args.seq,
        )
    except ValueError as e:
        raise SystemExit(f"sac_compile plan: {e}") from None
    model = _model(args.config)
    # What the imports and the meta model made lives until the process ends: frozen out of
    # the garbage collector's full collections, which planning (Dynamo, AOTAutograd, one
    # partition per candidate) otherwise spends a sixth of its time on
    gc.freeze()
    print(
        f"{type(model).__name__} from {args.config}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters",
        file=sys.stderr,
    )
    try:
        plan = hf.plan_for(model, None, device=target, compile=not args.eager, progress=_progress, include=())
    except ValueError as e:
        raise SystemExit(f"sac_compile plan: {e}") from None
    seconds = time.perf_counter() - start
    print(plan.format())
    print(f"  planned in {seconds:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_report(plan, seconds), f, indent=1)
    return 0 if plan.fits else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "plan":
        print(
            "usage: python -m sac_compile plan CONFIG --seq S --batch B --device DEV --memory M "
            "[--fsdp N] [--tp N] [--ep N] [--eager] [--json PATH]",
            file=sys.stderr,
        )
        return 2
    return plan_command(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
