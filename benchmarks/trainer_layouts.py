"""Every way xtuner v1 compiles a layer it checkpoints, side by side (``keep={"attn"}``).

Layers from ``sac_compile.testing._dev.xtuner_layouts`` (a Qwen3-VL vision block, a dense
decoder layer; ``--layers`` of them over one packed row of variable-length sequences) and
``method_compiled`` (MoE layers with an MTP layer). For each layout, compiled by ``--backend``
(``aot_eager``, ``inductor``: plain ``torch.compile``; ``sac``: ``make_sac_backend(ALL_REGIONS)``):

* rows: no checkpoint; xtuner's own full recompute (``checkpoint_wrapper`` with the wrapper's
  forward compiled); the seam eagerly without compile (``keep=()``, ``keep={"attn"}``); and the
  layouts with the seam keeping ``attn``: ``compile=`` (the seam's own), the class's ``forward``
  compiled (``_compile_overwrite``), the instance's ``forward`` compiled before / after wrapping,
  the seam inside ``checkpoint_wrapper`` with the wrapper's forward compiled, a submodule's
  ``forward`` compiled on its class (the attention module's), and for the MoE model its methods
  compiled on the layer's class, the MTP layer wrapped whole;
* held: bytes held for the backward (``autograd_saved_bytes``, parameters excluded) and as a
  ratio to no checkpoint; attn: attention kernels the backward reruns; mm: matmuls the backward
  runs (each linear's two gradients plus what it recomputes), counted by the profiler on compiled
  rows (eagerly it also records the ops the engine serves from its cache: not counted).

Exits 1 when a layout keeping ``attn`` holds no less than no checkpoint or reruns attention.

    python benchmarks/trainer_layouts.py [--backend inductor] [--layers 8] [--tokens 512]
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from typing import Any

import torch

import sac_compile as sc
from sac_compile.inspection import autograd_saved_bytes
from sac_compile.testing._dev import method_compiled as mc
from sac_compile.testing._dev import xtuner_layouts as xt

MM = ("aten::mm", "aten::addmm", "aten::bmm")


def _measure(model: torch.nn.Module, call: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> dict:
    held = autograd_saved_bytes(call, x.clone().requires_grad_(), exclude=list(model.parameters()))
    loss = call(x.clone().requires_grad_()).square().mean()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss.backward()
    names = [e.name for e in prof.events()]
    attn = sum("scaled_dot_product" in n and "backward" not in n for n in names)
    return {"held": held, "attn": attn, "mm": sum(n in MM for n in names)}


def _tower_layouts(backend: Any) -> dict[str, Callable[[torch.nn.Module, type], Callable[[], None] | None]]:
    keep = {"attn"}

    def seam(keep_: Any, **kw: Any) -> Callable[..., None]:
        def apply(model: torch.nn.Module, cls: type) -> None:
            for layer in model.layers:
                sc.apply_selective_checkpointing(layer, keep=keep_, **kw)

        return apply

    def xtuner_full(model: torch.nn.Module, cls: type) -> None:
        for i, layer in enumerate(model.layers):
            model.layers[i] = xt.compile_instance_forward(
                xt.checkpoint_wrapped(layer), backend=backend, fullgraph=True
            )

    def class_forward(model: torch.nn.Module, cls: type) -> Callable[[], None]:
        restore = xt.compile_class_forward(cls, backend=backend, fullgraph=True)
        seam(keep)(model, cls)
        return restore

    def instance(first: bool) -> Callable[..., None]:
        def apply(model: torch.nn.Module, cls: type) -> None:
            for layer in model.layers:
                if first:
                    xt.compile_instance_forward(layer, backend=backend, fullgraph=True)
                sc.apply_selective_checkpointing(layer, keep=keep)
                if not first:
                    xt.compile_instance_forward(layer, backend=backend, fullgraph=True)

        return apply

    def class_then_instance(model: torch.nn.Module, cls: type) -> Callable[[], None]:
        restore = xt.compile_class_forward(cls, backend=backend, fullgraph=True)
        instance(False)(model, cls)
        return restore

    def in_wrapper(model: torch.nn.Module, cls: type) -> None:
        for i, layer in enumerate(model.layers):
            sc.apply_selective_checkpointing(layer, keep=keep)
            model.layers[i] = xt.compile_instance_forward(
                xt.checkpoint_wrapped(layer), backend=backend, fullgraph=True
            )

    def submodule(model: torch.nn.Module, cls: type) -> Callable[[], None] | None:
        if cls is not xt.VisionLayer:
            return None
        restore = xt.compile_class_forward(xt.VisionAttention, backend=backend, fullgraph=True)
        seam(keep)(model, cls)
        return restore

    inner = "aot_eager" if backend == "aot_eager" else "inductor"
    return {
        "no checkpoint": lambda model, cls: None,
        "xtuner full recompute (compiled wrapper)": xtuner_full,
        "seam eager, keep=()": seam(()),
        "seam eager, keep attn": seam(keep),
        "seam compile=": seam(keep, compile={"inner": inner, "fullgraph": True}),
        "class forward compiled": class_forward,
        "instance forward compiled, then seam": instance(True),
        "seam, then instance forward compiled": instance(False),
        "class forward, seam, instance forward (xtuner dense)": class_then_instance,
        "seam inside compiled checkpoint_wrapper": in_wrapper,
        "submodule forward compiled (attention)": submodule,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="aot_eager", choices=("aot_eager", "inductor", "sac"))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=512, help="packed row: sequences of 64..192 tokens")
    args = parser.parse_args(argv)
    backend: Any = (
        sc.make_sac_backend(sc.ALL_REGIONS, inner="aot_eager") if args.backend == "sac" else args.backend
    )
    lengths, left = [], args.tokens
    while left > 0:
        lengths.append(min(left, 64 + 32 * (len(lengths) % 5)))
        left -= lengths[-1]
    results: dict[str, dict[str, dict]] = {}
    flagged = []
    for cls in (xt.VisionLayer, xt.DenseLayer):
        torch.manual_seed(0)
        base = xt.Tower(cls, n=args.layers, d=args.d)
        x, cu = xt.packed_rows(tuple(lengths), args.d)
        rows = results[cls.__name__] = {}
        for name, apply in _tower_layouts(backend).items():
            torch._dynamo.reset()
            model = copy.deepcopy(base)
            restore = apply(model, cls)
            if name == "submodule forward compiled (attention)" and restore is None:
                continue
            try:
                rows[name] = _measure(model, lambda a, m=model, c=cu: m(a, c), x)
            finally:
                if restore is not None:
                    restore()
    # MoE layers with an MTP layer, methods compiled on the layer's class (xtuner's EP layout)
    torch.manual_seed(0)
    base = mc.MethodCompiledMoE(n=args.layers, d=args.d)
    x, cu = mc.packed(tuple(lengths), args.d, generator=torch.Generator().manual_seed(0))
    rows = results["MoE + MTP"] = {}
    torch._dynamo.reset()
    restore = mc.compile_methods(backend)
    try:
        for name, layers, keep in (
            ("no checkpoint", None, None),
            ("methods compiled, seam keep=()", ("layers.*", "mtp"), ()),
            ("methods compiled, seam keep attn (MTP wrapped whole)", ("layers.*", "mtp"), {"attn"}),
        ):
            model = copy.deepcopy(base)
            if layers is not None:
                sc.SacConfig(layers=layers, keep=keep).apply(model)
            rows[name] = _measure(model, lambda a, m=model: m(a, cu).reshape(1), x)
    finally:
        restore()
    print(f"backend {args.backend}, {args.layers} layers, d {args.d}, {args.tokens} packed tokens {lengths}")
    for model_name, rows in results.items():
        none = rows["no checkpoint"]["held"]
        print(f"\n{model_name}")
        print(f"  {'layout':54s} {'held B':>10s} {'x none':>7s} {'attn':>5s} {'mm':>5s}")
        for name, r in rows.items():
            # (eagerly, the profiler records the ops the engine serves from its cache: no count)
            eager = name.startswith("seam eager")
            counts = f"{'-':>5s} {'-':>5s}" if eager else f"{r['attn']:5d} {r['mm']:5d}"
            print(f"  {name:54s} {r['held']:10d} {r['held'] / none:7.2f} {counts}")
            kept = "keep attn" in name or (
                "compiled" in name and "xtuner" not in name and "keep=()" not in name
            )
            if kept and not (r["held"] < none and (eager or r["attn"] == 0)):
                flagged.append(f"{model_name}: {name}")
    if flagged:
        print("\nflagged (held no less than no checkpoint, or attention rerun):", *flagged, sep="\n  ")
    return {"results": results, "flagged": flagged}


if __name__ == "__main__":
    sys.exit(1 if main()["flagged"] else 0)
