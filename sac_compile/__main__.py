"""``python -m sac_compile plan CONFIG --seq S --batch B --device DEV --memory M``.

Plans a transformers model for a device from its ``config.json`` (a decoder, an MoE, a
vision-language model): the model is built on the meta device (nothing allocated), each kind
of layer traced with the device's attention kernel and measured, and the fastest predicted
step whose predicted peak fits the memory is printed per kind of layer, with the peak's
breakdown and a step-time estimate; ``--json`` writes the same as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
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
            if not isinstance(raw, dict):
                raise ValueError(
                    f"a config.json is a JSON object with a 'model_type'; this one is a {type(raw).__name__}"
                )
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


def _check_writable(path: str) -> None:
    """``--json PATH`` can be written: checked before minutes of measuring, not after."""
    import os

    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise SystemExit(f"sac_compile plan: --json {path}: a folder, not a file (name the file to write)")
    if not os.path.isdir(folder):
        raise SystemExit(
            f"sac_compile plan: --json {path}: the folder {folder} does not exist (create it first)"
        )
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise SystemExit(f"sac_compile plan: --json {path}: not writable here")


def _progress(done: int, total: int, what: str) -> None:
    width = 24
    bar = "#" * (width * done // max(total, 1))
    print(
        f"\r  measuring [{bar:<{width}}] {done}/{total} {what:<40}",
        end="" if done < total else "\n",
        file=sys.stderr,
    )
    sys.stderr.flush()


#: the layout's integer flags: (flag, default, help)
_LAYOUT = (
    ("--fsdp", 1, "FSDP degree (default 1)"),
    ("--dp", None, "DDP replicas (nothing sharded: --fsdp 1)"),
    ("--replicate", None, "HSDP: replicas of the --fsdp shards"),
    ("--zero", 0, "with --dp: ZeRO stage 1 (optimizer state sharded) or 2 (gradients too)"),
    ("--tp", 1, "tensor-parallel degree (default 1)"),
    ("--ep", 1, "expert-parallel degree, a divisor of --fsdp (or, without FSDP, of --dp)"),
    ("--cp", 1, "context-parallel degree: the sequence split cp ways (default 1)"),
    ("--pp", 1, "pipeline-parallel degree (default 1)"),
    ("--pp-virtual-stages", None, "with --pp: stages a rank runs (default the schedule's)"),
    (
        "--microbatch-size",
        1,
        "with --pp: sequences per microbatch, a divisor of --batch (default 1, as torchtitan)",
    ),
)


def _layout_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, default, text in _LAYOUT:
        parser.add_argument(flag, type=int, default=default, help=text)
    parser.add_argument(
        "--pp-schedule",
        default="1f1b",
        help="with --pp: one of PyTorch's schedules: 1f1b (default), gpipe, interleaved-1f1b, looped-bfs, "
        "interleaved-zero-bubble, zbv-zero-bubble, dualpipev (PyTorch's names too: Interleaved1F1B)",
    )


def _parser() -> argparse.ArgumentParser:
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
    _layout_arguments(parser)
    parser.add_argument(
        "--fsdp-no-reshard",
        action="store_true",
        help="with --fsdp: FSDP2's reshard_after_forward=False on every layer (torchtitan's "
        "--parallelism.fsdp_reshard_after_forward never): each layer's parameters stay unsharded from its "
        "forward to its backward",
    )
    parser.add_argument(
        "--no-sequence-parallel",
        action="store_true",
        help="with --tp: the residual stream whole on every rank (default: split on the sequence, as torchtitan)",
    )
    parser.add_argument(
        "--async-tp",
        action="store_true",
        help="with --tp: async TP, the collectives under the projections' matmuls (compiled layers only)",
    )
    parser.add_argument(
        "--pp-recompute-once",
        action="store_true",
        help="with a zero-bubble --pp-schedule: each weight pass recomputes a checkpointed layer once "
        "(stages wrapped by sac_compile.pipelining.recompute_once; default PyTorch's once per weight group)",
    )
    parser.add_argument(
        "--pp-return-outputs",
        action="store_true",
        help="the pipeline's step returns the last stage's outputs (PyTorch's default return_outputs=True, "
        "and always before 2025-10): every microbatch's logits kept to the next step; default torchtitan's "
        "return_outputs=False",
    )
    parser.add_argument(
        "--no-loss-parallel",
        action="store_true",
        help="with --tp: the logits whole on every rank (default: split on the vocabulary, as torchtitan)",
    )
    parser.add_argument(
        "--loss",
        default="transformers",
        help="how the trainer's loss holds the logits: transformers (default), torchtitan, chunked[:N]",
    )
    parser.add_argument(
        "--repeat-kv",
        action="store_true",
        help="the trainer repeats grouped-query keys and values to the query's heads before attention "
        "(torchtitan's Llama until 2026-01; transformers' SDPA given a mask)",
    )
    parser.add_argument(
        "--ac",
        default=None,
        help="predict one configuration instead of choosing: none, full, torchtitan-op (torchtitan's per-op "
        "SAC; torchtitan-op-2025-08: as before it saved the all-to-alls), keep=attn,mlp[@BUDGET], keep=all, "
        "budget=B (PyTorch's activation_memory_budget alone)",
    )
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs a node's link joins (default 8)")
    parser.add_argument(
        "--network-gbps",
        type=float,
        default=400.0,
        help="network bandwidth per GPU between nodes, Gb/s (default 400)",
    )
    _offload_arguments(parser)
    parser.add_argument("--eager", action="store_true", help="plan for the eager engine (keep sets only)")
    parser.add_argument("--json", default=None, help="write the plan as JSON to this path")
    return parser


def _offload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--offload",
        action="store_true",
        help="a region may also be offloaded to host memory (needs --host-memory)",
    )
    parser.add_argument(
        "--host-memory",
        default=None,
        help="with --offload: host memory per GPU, e.g. '256GB' (a DGX H100: 2TB / 8)",
    )
    parser.add_argument(
        "--link",
        default=None,
        help="with --offload: the GPU's link to host memory, pcie4, pcie5 or c2c (default: the device's)",
    )


def plan_command(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    import logging
    import warnings

    from . import hf, plan_report
    from .planning.devices import parse_memory

    if args.memory is not None:
        try:
            parse_memory(args.memory)
        except ValueError as e:
            raise SystemExit(f"sac_compile plan: --memory: {e}") from None
    if args.json:
        _check_writable(args.json)
    _check_offload(args)
    ac = None if args.ac is None else _parse_ac(args.ac)

    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    start = time.perf_counter()
    target = _target(args)
    model = _model(args.config)
    # What the imports and the meta model made lives until the process ends: frozen out of
    # the garbage collector's full collections, which planning (Dynamo, AOTAutograd, one
    # partition per candidate) otherwise spends a sixth of its time on
    gc.freeze()
    print(
        f"{type(model).__name__} from {args.config}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters",
        file=sys.stderr,
    )
    # measured once for any memory; then chosen for the target's, or the --ac configuration
    unbounded = target.replace(memory=1 << 60)
    try:
        measured = hf.plan_for(
            model, None, device=unbounded, compile=not args.eager, progress=_progress, include=()
        )
        # (--ac: the measurements on the real target; the plan's own choice is not reported)
        plan = (
            measured.select(target.machine.memory)
            if ac is None
            else dataclasses.replace(measured, target=target)
        )
    except ValueError as e:
        raise SystemExit(f"sac_compile plan: {e}") from None
    seconds = time.perf_counter() - start
    report = plan_report.report(plan, seconds)
    if ac is None:
        print(plan.format())
        report["peers"] = plan_report.peers(plan)
        print(
            "  beside it: " + "; ".join(plan_report.peer_line(name, p) for name, p in report["peers"].items())
        )
        report["faster_peers"] = plan_report.faster(report["step_seconds"], report["peers"])
        if report["faster_peers"]:
            print(plan_report.faster_line(report["step_seconds"], report["peers"], report["faster_peers"]))
        fits = plan.fits
    else:  # (the plan's own figures are not this configuration's)
        plan_keys: tuple[str, ...] = ("peak_bytes", "reserved_bytes", "fits", "phase", "breakdown", "groups")
        plan_keys += ("step_seconds", "step_terms", "tokens_per_second", "mfu")
        report = {k: v for k, v in report.items() if k not in plan_keys}
        report["ac"] = plan_report.configuration(plan, *ac, spec=args.ac)
        print(plan_report.peer_line(f"--ac {args.ac}", report["ac"], full=True))
        fits = report["ac"]["fits"]
    print(f"  planned in {seconds:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if fits else 1


def _target(args: argparse.Namespace) -> Any:
    """The command's :class:`~sac_compile.planning.devices.Target`; a bad value exits naming it."""
    from .planning.devices import Target

    try:
        return Target(
            args.device,
            memory=args.memory,
            fsdp=args.fsdp,
            fsdp_reshard_after_forward=not args.fsdp_no_reshard,
            tp=args.tp,
            ep=args.ep,
            sequence_parallel=not args.no_sequence_parallel,
            loss_parallel=not args.no_loss_parallel,
            async_tp=args.async_tp,
            loss=args.loss,
            repeat_kv=args.repeat_kv,
            batch=args.batch,
            seq=args.seq,
            cp=args.cp,
            pp=args.pp,
            pp_schedule=args.pp_schedule,
            pp_virtual_stages=args.pp_virtual_stages,
            pp_recompute_once=args.pp_recompute_once,
            pp_return_outputs=args.pp_return_outputs,
            replicate=_replicas(args),
            zero=args.zero,
            microbatch_size=args.microbatch_size,
            gpus_per_node=args.gpus_per_node,
            network=args.network_gbps * 1e9 / 8,
            offload=args.offload,
            host_memory=args.host_memory,
            host_link=args.link,
        )
    except ValueError as e:
        raise SystemExit(f"sac_compile plan: {e}") from None


def _replicas(args: argparse.Namespace) -> int:
    """``--dp`` (DDP: nothing sharded) or ``--replicate`` (HSDP, with ``--fsdp``): the replicas."""
    if args.dp is not None and args.replicate is not None:
        raise ValueError("--dp (DDP) and --replicate (HSDP) name the same replicas: give one")
    if args.dp is not None and args.fsdp > 1:
        raise ValueError(
            f"--dp {args.dp} with --fsdp {args.fsdp}: DDP shards nothing; HSDP is --replicate R --fsdp S"
        )
    if args.replicate is not None and args.fsdp == 1:
        raise ValueError(
            f"--replicate {args.replicate} without --fsdp: HSDP replicates FSDP shards; DDP is --dp N"
        )
    return args.dp or args.replicate or 1


def _check_offload(args: argparse.Namespace) -> None:
    """``--host-memory`` and ``--link`` act with ``--offload`` only, which needs the first."""
    for flag, value in (("--host-memory", args.host_memory), ("--link", args.link)):
        if value is not None and not args.offload:
            raise SystemExit(
                f"sac_compile plan: {flag} {value} does nothing without --offload (add --offload)"
            )
    if args.offload and args.host_memory is None:
        raise SystemExit(
            "sac_compile plan: --offload needs --host-memory, the host memory per GPU for offloaded values "
            "(e.g. --host-memory 256GB: a DGX H100's 2 TB over its 8 GPUs)"
        )


def _parse_ac(spec: str) -> tuple[Any, float | None]:
    """``--ac``: ``none`` (no checkpoint), ``full`` (every layer recomputed), ``torchtitan-op``,
    ``budget=B`` (PyTorch's budget alone: ``keep=@B``), or ``keep=attn,mlp`` / ``keep=all``
    with an optional ``@budget`` -> ``(keep, budget)``."""
    from .keep import ALL_REGIONS
    from .planning.op_sac import TORCHTITAN_OP, TORCHTITAN_OP_2025_08

    if spec == "none":
        return None, None
    if spec == "full":
        return (), None
    if spec in (TORCHTITAN_OP, TORCHTITAN_OP_2025_08):
        return spec, None
    if spec.startswith("budget="):  # PyTorch's budget alone: no region kept
        body, budget = "keep=", spec.removeprefix("budget=") or "none"
    else:
        body, _, budget = spec.partition("@")
    if body.startswith("keep="):
        names = [n for n in body.removeprefix("keep=").split(",") if n]
        try:
            value = float(budget) if budget else None
        except ValueError:
            value = -1.0
        if value is None or 0 < value <= 1:
            return (ALL_REGIONS if names == ["all"] else frozenset(names)), value
    raise SystemExit(
        f"sac_compile plan: --ac {spec}: none, full, torchtitan-op, torchtitan-op-2025-08, budget=B (B in (0, 1]), or "
        "keep=REGION[,REGION...] (keep=all: every region) with an optional @BUDGET in (0, 1], e.g. keep=attn,mlp "
        "or keep=attn@0.3"
    )


#: command -> what it does (``python -m sac_compile --help``)
COMMANDS = {
    "plan": "plan a transformers config.json for a device: the least recompute whose predicted step peak fits",
}

USAGE = "usage: python -m sac_compile COMMAND [options]\n\ncommands:\n" + "".join(
    f"  {name:<8}{what}\n    (python -m sac_compile {name} --help)\n" for name, what in COMMANDS.items()
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        raise SystemExit(0)
    if not argv or argv[0] not in COMMANDS:
        unknown = f"sac_compile: unknown command {argv[0]!r}\n" if argv else ""
        print(unknown + USAGE, end="", file=sys.stderr)
        return 2
    return plan_command(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
