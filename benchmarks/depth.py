"""Every transformers family at real depth, compiled per layer: graphs beside plain compile.

Dynamo keys its cache and its recompile limit (8) on code objects: identical layers compiled
per layer share one entry list, so whatever is guarded per layer makes a graph per layer and,
from the 9th layer on, an eager layer (``[compile-fallback]``). Two-layer models never show it.
Each family of ``sac_compile.testing.hf_families`` is built at ``--layers`` (default 32; its
per-layer pattern repeated: Jamba's, RecurrentGemma's, OLMo-hybrid's, NemotronH's layer
types) and trained four steps (sequence lengths 16, 24, 40, then a packed row of 12 + 20 tokens
with positions restarting where the model takes ``position_ids``), three ways:

* no checkpoint, eager (the reference losses and gradients);
* plain per-layer ``layer.compile(backend="aot_eager")``;
* ``hf.config_for(model, keep=ALL_REGIONS, compile={"inner": "aot_eager"})``.

Figures per family: Dynamo's graphs for each compiled way (``counters["stats"]["unique_graphs"]``),
whether ours fell back to eager, the largest gradient difference to the reference (relative to
the gradient's largest entry), and what one forward holds for the backward, ours against full
recompute and no checkpoint (eager). A row is flagged ``!`` and the script exits 1 when ours
makes more graphs than plain compile, falls back, differs from the reference beyond float32
reordering, or holds outside full recompute < ours <= no checkpoint.

    python benchmarks/depth.py [--families llama,jamba] [--layers 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import logging
import sys
import time
import warnings

import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import sac_compile as sc
from sac_compile import hf
from sac_compile.testing.hf_families import FAMILIES, build

INNER = {"inner": "aot_eager"}


def _batches(model: nn.Module) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = [{"input_ids": torch.randint(1, 128, (2, s), generator=g)} for s in (16, 24, 40)]
    if "position_ids" in inspect.signature(model.forward).parameters:
        packed = torch.cat([torch.arange(12), torch.arange(20)])[None]
        out.append({"input_ids": torch.randint(1, 128, (1, 32), generator=g), "position_ids": packed})
    return out


def _extra(model: nn.Module) -> dict[str, object]:
    return {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}


def _train(model: nn.Module) -> tuple[int, list[float], dict[str, torch.Tensor]]:
    """Four steps: (graphs Dynamo compiled, losses, the last step's gradients)."""
    torch._dynamo.reset()
    counters.clear()
    losses = []
    for batch in _batches(model):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)  # the same dropout masks in every configuration
        loss = model(**batch, labels=batch["input_ids"], **_extra(model)).loss
        loss.backward()
        losses.append(loss.item())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return int(counters["stats"]["unique_graphs"]), losses, grads


def _held(model: nn.Module) -> int:
    ids = _batches(model)[0]["input_ids"]

    def loss(i: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(0)
        return model(input_ids=i, labels=i, **_extra(model)).loss

    return sc.inspection.autograd_saved_bytes(loss, ids, exclude=list(model.parameters()), warmup=False)


def _layers(model: nn.Module) -> nn.ModuleList:
    path = hf.decoder_layers(model)
    return model.get_submodule(path[:-2])  # "model.layers.*" -> the list


class _Fallbacks(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen = False

    def emit(self, record: logging.LogRecord) -> None:
        self.seen |= "compile-fallback" in record.getMessage()


def measure(family: str, layers: int) -> dict[str, object]:
    base = build(family, layers=layers)
    start = time.perf_counter()
    _, ref_losses, ref_grads = _train(copy.deepcopy(base))
    plain = copy.deepcopy(base)
    for layer in _layers(plain):
        layer.compile(backend="aot_eager")
    plain_graphs, _, _ = _train(plain)
    ours = copy.deepcopy(base)
    watch = _Fallbacks()
    log = logging.getLogger("sac_compile")
    log.addHandler(watch)
    try:
        hf.config_for(ours, keep=sc.ALL_REGIONS, compile=INNER).apply(ours)
        graphs, losses, grads = _train(ours)
    finally:
        log.removeHandler(watch)
    worst = max(
        ((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item() for n, g in ref_grads.items()
    )
    full = copy.deepcopy(base)
    hf.config_for(full, keep=()).apply(full)
    return {
        "family": family,
        "layers": len(_layers(base)),
        "plain_graphs": plain_graphs,
        "graphs": graphs,
        "fallback": watch.seen,
        "max_dloss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "max_rel_dgrad": worst,
        "held": _held(ours),
        "held_full": _held(full),
        "held_none": _held(base),
        "seconds": time.perf_counter() - start,
    }


def _broken(row: dict) -> list[str]:
    why = []
    if row["graphs"] > row["plain_graphs"]:
        why.append("more graphs than plain compile")
    if row["fallback"]:
        why.append("compile-fallback")
    if row["max_rel_dgrad"] > 1e-3 or row["max_dloss"] > 1e-4:
        why.append("gradients differ")
    if not row["held_full"] < row["held"] <= row["held_none"]:
        why.append("held outside full < ours <= none")
    return why


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (default: all)")
    parser.add_argument("--layers", type=int, default=32, help="decoder layers per model (default 32)")
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    args = parser.parse_args()
    if args.layers < 2:
        parser.error(f"--layers {args.layers}: at least 2")
    unknown = [f for f in args.families.split(",") if f not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    print(
        f"transformers families at {args.layers} layers (hidden 32, float32, CPU), compiled per layer with "
        "aot_eager over 4 steps (seq 16, 24, 40, packed 12+20); every region kept; held = one forward's "
        "saved bytes, ratio to no checkpoint (eager)"
    )
    print(
        f"{'family':<19} {'layers':>6} {'plain':>5} {'ours':>5} {'fallback':>8} {'rel dgrad':>9} "
        f"{'full':>6} {'ours':>6} {'s':>5}"
    )
    rows, flagged = [], []
    for family in args.families.split(","):
        try:
            row = measure(family, args.layers)
        except Exception as e:  # a family PyTorch itself cannot compile: a row, not the end of the run
            message = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append({"family": family, "error": message})
            flagged.append(f"{family}: {message}")
            print(f"{family:<19} failed: {message}  !", flush=True)
            continue
        rows.append(row)
        why = _broken(row)
        if why:
            flagged.append(f"{family}: {', '.join(why)}")
        none = row["held_none"]
        print(
            f"{family:<19} {row['layers']:>6} {row['plain_graphs']:>5} {row['graphs']:>5} "
            f"{'yes' if row['fallback'] else 'no':>8} {row['max_rel_dgrad']:>9.1e} "
            f"{row['held_full'] / none:>6.2f} {row['held'] / none:>6.2f} {row['seconds']:>5.0f}"
            + ("  !" if why else ""),
            flush=True,
        )
    ok = sum(1 for r in rows if "error" not in r and not _broken(r))
    print(
        f"{ok} of {len(rows)} families: graphs <= plain per-layer compile, no fallback, gradients equal, "
        "held between full recompute and no checkpoint"
    )
    for line in flagged:
        print("  ! " + line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())
