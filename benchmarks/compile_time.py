"""Compile time: the first forward + backward of a compiled model, sac-compile's against
plain ``torch.compile``'s, each in fresh processes with every compile cache off.

The model: ``--layers`` pre-norm blocks (``sac_compile.testing.models.Block``: attention,
MLP; batch 4 × seq 64), each layer one checkpoint, compiled whole under Inductor:

* *plain*: the unmarked blocks, ``torch.compile(model)``, no checkpoint (no recompute).
* *torch-attn* / *torch-all*: the unmarked blocks, each layer in ``torch.utils.checkpoint``
  with PyTorch's selective policy (``create_selective_checkpoint_contexts``) making the
  decisions our keep set makes on this block: save the attention kernel (and, for *all*,
  the MLP's two matmuls), recompute the rest. Plain ``torch.compile(model)``.
* *ours-attn* / *ours-all*: the marked blocks, each layer wrapped with
  ``apply_selective_checkpointing(layer, keep={"attn"})`` (or ``ALL_REGIONS``),
  ``torch.compile(model, backend=sac_backend)`` (the README's whole-model recipe).

A keep set asks for a program that recomputes: its compile is longer than the
no-recompute program's whatever compiles it (*torch-X* / *plain*). What sac-compile itself
costs is *ours-X* against *torch-X*: the same program (the benchmark checks that both
generated the same C++ kernels, by content) reached through our markers, backend and
tagging pass instead of PyTorch's checkpoint. Each run is a fresh Python process with its
own Inductor cache directory and every cache off (``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``),
timed from the first call to the end of its backward (wall) and by the CPU time of the
process and its compiler children; rounds run every configuration once, rotated. Then one
process of *ours-attn* under ``cProfile``: the time spent in sac-compile's own functions.

Imports happen inside the clock, as in a user's first step: each configuration pays for what
it loads (Inductor, which every configuration compiles with and our markers never import
themselves; the modules Dynamo imports on first use: ``_pytest``'s context managers, checked
for any user-defined context manager such as ``with region(...)``; DTensor's ``local_map``,
checked for any global function a traced frame calls). ``--imports-before-clock`` imports
them first, the same in every configuration, to time the compile alone.

    python benchmarks/compile_time.py [--runs 4] [--layers 4] [--imports-before-clock]

Exit 1 when an *ours-X* median is more than 3% over its *torch-X* median, or the two
did not generate the same kernels.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LIMIT = 1.03
CONFIGS = ("plain", "torch-attn", "ours-attn", "torch-all", "ours-all")
PAIRS = (("attn", "torch-attn", "ours-attn"), ("all", "torch-all", "ours-all"))


def _torch_policy(keep: str):
    """PyTorch's selective policy making the decisions ``keep`` makes on ``Block`` under
    ``SAVE_COSTLY``: the attention kernel is the "attn" region's costly op; the MLP's
    projections (``addmm``: the only biased linears) are the "mlp" region's; everything
    else is recomputed (the partitioner treats ``PREFER_RECOMPUTE`` as ``MUST_RECOMPUTE``)."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    saved = {
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
    }
    if keep == "all":
        saved.add(aten.addmm.default)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.MUST_RECOMPUTE

    return policy


def _model(how: str, layers: int, inner: str = "inductor"):
    """(the model of configuration ``how``, the backend compiling it with ``inner``)."""
    import torch
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    import sac_compile as sc
    from sac_compile.testing.baselines import LayerWrapper
    from sac_compile.testing.models import Block

    class TorchSAC(LayerWrapper):
        def __init__(self, layer: nn.Module, policy) -> None:
            super().__init__(layer)
            self.context_fn = functools.partial(create_selective_checkpoint_contexts, policy)

        def forward(self, x):
            return checkpoint(self.layer, x, use_reentrant=False, context_fn=self.context_fn)

    torch.manual_seed(0)
    blocks = [Block(64, heads=4, marked=how.startswith("ours")) for _ in range(layers)]
    kind, _, keep = how.partition("-")
    if kind == "torch":
        blocks = [TorchSAC(b, _torch_policy(keep)) for b in blocks]
    if kind != "ours":
        return nn.Sequential(*blocks), inner
    for b in blocks:
        sc.apply_selective_checkpointing(b, keep=sc.ALL_REGIONS if keep == "all" else {"attn"})
    return nn.Sequential(*blocks), (
        sc.sac_backend if inner == "inductor" else sc.make_sac_backend(inner=inner)
    )


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _kernel_digests(cache_dir: str) -> list[str]:
    """Digests of the C++ kernels Inductor generated into this run's cache directory."""
    return sorted(hashlib.sha256(p.read_bytes()).hexdigest()[:12] for p in Path(cache_dir).rglob("*.cpp"))


#: imported before the clock with --imports-before-clock (see the module docstring); the last
#: three are Dynamo's lazy imports
PRE_IMPORTS = (
    "torch._inductor.compile_fx",
    "torch.distributed.tensor.experimental._func_map",
    "_pytest.raises",
    "_pytest.recwarn",
)


def _record_lowered_graphs() -> list[dict[str, int]]:
    """Per graph Inductor lowers (forward, then backward), its op counts: filled as it runs."""
    import collections

    from torch._inductor.graph import GraphLowering

    seen: list[dict[str, int]] = []
    run = GraphLowering.run

    def counting(self, *args, **kwargs):
        ops = collections.Counter(str(n.target) for n in self.module.graph.nodes if n.op == "call_function")
        seen.append(dict(sorted(ops.items())))
        return run(self, *args, **kwargs)

    GraphLowering.run = counting
    return seen


def worker(how: str, layers: int, profile: bool, imports_in_clock: bool, inner: str = "inductor") -> dict:
    import importlib

    import torch

    if not imports_in_clock:
        for name in PRE_IMPORTS:
            try:
                importlib.import_module(name)
            except ImportError:  # no pytest, no distributed build: Dynamo skips them too
                pass
    torch.set_num_threads(2)
    model, backend = _model(how, layers, inner)
    lowered = _record_lowered_graphs() if inner == "inductor" and not imports_in_clock else []
    x = torch.randn(4, 64, 64, requires_grad=True)
    compiled = torch.compile(model, backend=backend)
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    cpu, start = _cpu_seconds(), time.perf_counter()
    compiled(x).sum().backward()
    out: dict = {"seconds": time.perf_counter() - start, "cpu": _cpu_seconds() - cpu}
    out["kernels"] = _kernel_digests(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    out["lowered"] = lowered  # (recorded only with imports before the clock: it imports Inductor)
    if profiler is not None:
        import pstats

        profiler.disable()
        stats = pstats.Stats(profiler).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
        ours = [(v[2], k) for k, v in stats.items() if f"{os.sep}sac_compile{os.sep}" in k[0]]
        out["own_seconds"] = sum(t for t, _ in ours)
        top = sorted(ours, reverse=True)[:8]
        out["top"] = [(f"{os.path.basename(k[0])}:{k[2]}", t) for t, k in top]
    return out


def _run(
    how: str, layers: int, profile: bool = False, imports_in_clock: bool = False, inner: str = "inductor"
) -> dict:
    with tempfile.TemporaryDirectory(prefix="sac-compile-time-") as cache_dir:
        env = {
            **os.environ,
            "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1",
            "TORCHINDUCTOR_CACHE_DIR": cache_dir,
            "PYTHONHASHSEED": "0",
        }
        cmd = (
            [sys.executable, __file__, "--worker", how, "--layers", str(layers)]
            + (["--profile"] if profile else [])
            + (["--imports-in-clock"] if imports_in_clock else [])
            + ["--inner", inner]
        )
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{how} failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=4, help="fresh processes per configuration")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--imports-before-clock",
        action="store_true",
        help="import Inductor and Dynamo's lazy imports before the clock (default: inside it)",
    )
    parser.add_argument(
        "--inner",
        choices=("inductor", "aot_eager"),
        default="inductor",
        help="aot_eager: no codegen, to time the frontend (Dynamo, AOTAutograd, our pass) alone",
    )
    parser.add_argument("--imports-in-clock", action="store_true", help=argparse.SUPPRESS)  # the worker's
    args = parser.parse_args(argv)
    if not args.worker:
        args.imports_in_clock = not args.imports_before_clock
    if args.worker:
        print(json.dumps(worker(args.worker, args.layers, args.profile, args.imports_in_clock, args.inner)))
        return 0
    runs: dict[str, list[dict]] = {how: [] for how in CONFIGS}
    for i in range(args.runs):
        for how in CONFIGS[i % len(CONFIGS) :] + CONFIGS[: i % len(CONFIGS)]:  # rotated each round
            runs[how].append(_run(how, args.layers, imports_in_clock=args.imports_in_clock, inner=args.inner))
    wall = {how: statistics.median(r["seconds"] for r in rs) for how, rs in runs.items()}
    cpu = {how: statistics.median(r["cpu"] for r in rs) for how, rs in runs.items()}
    kernels = {how: rs[0]["kernels"] for how, rs in runs.items()}
    print(
        f"first forward + backward, {args.layers} blocks (one checkpoint each), {args.inner}, caches off, "
        f"{args.runs} fresh processes each; imports {'in' if args.imports_in_clock else 'before'} the clock; medians"
    )
    print(
        f"  {'configuration':<12} {'wall s':>7} {'cpu s':>7} {'kernels':>8} {'wall/plain':>11}  (wall of each run)"
    )
    for how, rs in runs.items():
        each = ", ".join(f"{r['seconds']:.2f}" for r in rs)
        print(
            f"  {how:<12} {wall[how]:7.2f} {cpu[how]:7.2f} {len(kernels[how]):8d} "
            f"{wall[how] / wall['plain']:11.3f}  ({each})"
        )
    met = True
    for keep, theirs, ours in PAIRS:
        same = kernels[theirs] == kernels[ours] and all(
            r["kernels"] == kernels[how] for how in (theirs, ours) for r in runs[how]
        )
        ratio, cpu_ratio = wall[ours] / wall[theirs], cpu[ours] / cpu[theirs]
        lowered = runs[theirs][0]["lowered"]
        same_graphs = (
            "not recorded" if not lowered else "yes" if runs[ours][0]["lowered"] == lowered else "NO"
        )
        ok = same and same_graphs != "NO" and ratio <= LIMIT
        met &= ok
        print(
            f"  keep {keep}: {ours} / {theirs} {ratio:.3f} wall, {cpu_ratio:.3f} cpu "
            f"(same kernels: {'yes' if same else 'NO'}; the graphs Inductor lowers, op for op: {same_graphs}; "
            f"limit {LIMIT:.2f}): {'met' if ok else 'NOT MET'}"
        )
        vs_plain = wall[ours] / wall["plain"]
        print(
            f"    beside plain torch.compile (no recompute, a different program): {theirs} / plain "
            f"{wall[theirs] / wall['plain']:.3f}, {ours} / plain {vs_plain:.3f} "
            f"({'within' if vs_plain <= LIMIT else 'over'} {LIMIT:.2f}; not a verdict)"
        )
    profiled = _run(
        "ours-attn", args.layers, profile=True, imports_in_clock=args.imports_in_clock, inner=args.inner
    )
    print(
        f"sac-compile's own functions, one profiled run of ours-attn: {profiled['own_seconds']:.2f} s "
        f"of {profiled['seconds']:.2f} s (cProfile inflates both)"
    )
    for name, t in profiled["top"]:
        print(f"  {t:6.3f} s  {name}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
