"""Compile time: the first forward + backward of a compiled model, plain ``torch.compile``
against sac-compile's, each in fresh processes with every compile cache off.

The model: ``--layers`` pre-norm blocks (``sac_compile.testing.models.Block``; attention,
MLP), batch 4 × seq 64. *plain*: the unmarked blocks under ``torch.compile`` (Inductor).
*ours*: the same blocks with their ``attn`` / ``mlp`` regions marked, under
``torch.compile(backend=make_sac_backend({"attn"}))``. With ``--anatomy`` also *marked*
(the marked blocks under plain ``torch.compile``: the markers' own cost), *baseline* (the
marked blocks under ``sac_compile.compiler.baseline_backend``: our backend without the
tagging pass, PyTorch's own partition) and *ours-all* (``make_sac_backend(ALL_REGIONS)``).
*ours* against *baseline* is Inductor compiling the recompute the keep set asks for (the
backward of ``keep={"attn"}`` recomputes the projections and the MLP); *baseline* against
*plain* is the machinery's cost. Each run is a fresh Python process
(torch imported before the clock starts), with Inductor's and AOTAutograd's caches off
(``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``), timed from the first call to the end of its
backward; runs alternate plain / ours. Then one more process per configuration under
``cProfile``: the time spent in sac-compile's own functions (the pass, the marker reading,
the backend's wrapping), the overhead's anatomy.

    python benchmarks/compile_time.py [--runs 4] [--layers 4]

Exit 1 when ours' median is more than 3% over plain's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

LIMIT = 1.03


def _model(layers: int, marked: bool):
    import torch
    import torch.nn as nn

    from sac_compile.testing.models import Block

    torch.manual_seed(0)
    return nn.Sequential(*(Block(64, heads=4, marked=marked) for _ in range(layers)))


def worker(how: str, layers: int, profile: bool) -> dict:
    import torch

    import sac_compile as sc

    torch.set_num_threads(2)
    model = _model(layers, marked=how not in ("plain",))
    x = torch.randn(4, 64, 64, requires_grad=True)
    backend = {
        "plain": "inductor",
        "marked": "inductor",
        "baseline": sc.compiler.baseline_backend("inductor"),
        "ours": sc.make_sac_backend({"attn"}),
        "ours-all": sc.make_sac_backend(sc.ALL_REGIONS),
    }[how]
    compiled = torch.compile(model, backend=backend)
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    start = time.perf_counter()
    compiled(x).sum().backward()
    seconds = time.perf_counter() - start
    out: dict = {"seconds": seconds}
    if profiler is not None:
        import pstats

        profiler.disable()
        stats = pstats.Stats(profiler).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
        ours = [(v[2], k) for k, v in stats.items() if f"{os.sep}sac_compile{os.sep}" in k[0]]
        out["own_seconds"] = sum(t for t, _ in ours)
        top = sorted(ours, reverse=True)[:8]
        out["top"] = [(f"{os.path.basename(k[0])}:{k[2]}", t) for t, k in top]
    return out


def _run(how: str, layers: int, profile: bool = False) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1", "PYTHONHASHSEED": "0"}
    cmd = [sys.executable, __file__, "--worker", how, "--layers", str(layers)] + (
        ["--profile"] if profile else []
    )
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=4, help="fresh processes per configuration")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--worker", choices=["plain", "marked", "baseline", "ours", "ours-all"], help=argparse.SUPPRESS
    )
    parser.add_argument("--anatomy", action="store_true", help="also time baseline and ours-all (below)")
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.layers, args.profile)))
        return 0
    names = ["plain", "ours"] + (["marked", "baseline", "ours-all"] if args.anatomy else [])
    times: dict[str, list[float]] = {how: [] for how in names}
    for i in range(args.runs):
        for how in names[i % len(names) :] + names[: i % len(names)]:  # (rotated each round)
            times[how].append(_run(how, args.layers)["seconds"])
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"first forward + backward, {args.layers} blocks, Inductor, caches off, {args.runs} fresh processes each"
    )
    for how, ts in times.items():
        print(f"  {how:<8} median {med[how]:6.2f} s  ({', '.join(f'{t:.2f}' for t in ts)})")
    for how in names[2:]:
        print(f"  {how} / plain: {med[how] / med['plain']:.3f}")
    if "baseline" in med:
        print(f"  ours / baseline: {med['ours'] / med['baseline']:.3f} (the recompute's compile)")
    ratio = med["ours"] / med["plain"]
    print(f"  ours / plain: {ratio:.3f} ({(ratio - 1) * 100:+.1f}%; limit {(LIMIT - 1) * 100:.0f}%)")
    profiled = _run("ours", args.layers, profile=True)
    print(
        f"sac-compile's own functions, one profiled run of ours: {profiled['own_seconds']:.2f} s "
        f"of {profiled['seconds']:.2f} s (cProfile inflates both)"
    )
    for name, t in profiled["top"]:
        print(f"  {t:6.3f} s  {name}")
    return 0 if ratio <= LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
