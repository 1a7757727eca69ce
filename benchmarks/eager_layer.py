"""One decoder layer under the eager engine, forward and backward timed apart.

A whole-model step on a shared CPU does not resolve a few percent; one layer, timed many
times, does. Per model (the demo, transformers Llama and Qwen3-MoE, at the sizes of
``eager_vs_compiled.py``, set by the same options, times ``--scale`` in width and
sequence), interleaved in one run: no checkpoint, full recompute (non-reentrant ``torch.utils.checkpoint``), the
engine with the model's keep set, PyTorch's SAC making the engine's decisions
(``sac_compile.testing.baselines.Checkpointed``), PyTorch's SAC saving nothing, and the
engine with *bare modes*: its spans, marker session and saved-tensor hooks as they are,
but dispatch modes that only pass each op through (nothing is cached, the recompute
recomputes everything). Bare modes less full recompute is what the engine's design costs
before any per-op bookkeeping: a Python dispatch mode's round trip for every op of a
kept span, both passes.
Printed: median forward, backward and step ms of each, and two ratios
for: engine / full recompute step, and the engine's step overhead over no checkpoint /
PyTorch SAC's. PyTorch's SAC saving nothing recomputes what full recompute does; what it
takes beyond full recompute is its own cost (a Python round trip and a policy call per
op, both passes). Subtracted from its overhead, that gives the ratio an engine making
the same decisions at no cost of its own would reach: the best any engine can do.

The same two rows say what making the decisions is worth at all: PyTorch's SAC saving
nothing, less PyTorch's SAC with the decisions, is what serving the kept ops in the
recompute saves net of holding them through the forward. An engine beats full recompute
only if its own cost (its step, less full recompute's less that gain) stays under that
gain; it reaches 0.85x of PyTorch SAC's overhead only if its own cost
stays under the budget printed. Each ratio comes with a 95% bootstrap interval over the
interleaved rounds (a round: one step of every configuration, in shuffled order).

``--threads 1 --cpu-time`` times the thread's CPU time on one thread: the least noisy
figure on a shared machine (what other processes do to the wall clock is not counted).

    python benchmarks/eager_layer.py [--models demo,llama,qwen3-moe] [--iters 150] [--scale 1]
        [--threads 1] [--cpu-time]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import random
import statistics
import time

import _eager_models
import torch
from torch.utils.checkpoint import checkpoint

from sac_compile.eager import checkpoint_with_regions
from sac_compile.eager.modes import CachedMode, CachingMode
from sac_compile.testing.baselines import Checkpointed


def _pass_through(self, func, types, args=(), kwargs=None):
    return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _bare_modes():
    """The engine's two dispatch modes pass every op through while this is open (a
    measurement only: nothing is cached, so the recompute recomputes everything)."""
    saved = CachingMode.__torch_dispatch__, CachedMode.__torch_dispatch__
    CachingMode.__torch_dispatch__ = CachedMode.__torch_dispatch__ = _pass_through
    try:
        yield
    finally:
        CachingMode.__torch_dispatch__, CachedMode.__torch_dispatch__ = saved


def measure(subject: _eager_models.Subject, iters: int, clock) -> dict:
    layer, h = subject.layer_call(copy.deepcopy(subject.model))
    keep = frozenset(subject.keep)
    torch_sac = Checkpointed(layer, keep)
    torch_sac_nothing = Checkpointed(layer, frozenset())
    steps = {
        "no checkpoint": lambda: layer(h),
        "full recompute": lambda: checkpoint(layer, h, use_reentrant=False),
        "engine": lambda: checkpoint_with_regions(layer, h, keep=keep),
        "torch SAC": lambda: torch_sac(h),
        "torch SAC, none": lambda: torch_sac_nothing(h),
        "bare modes": lambda: checkpoint_with_regions(layer, h, keep=keep),
    }
    around = {"bare modes": _bare_modes}
    times: dict = {k: ([], []) for k in steps}
    order = list(steps)
    rng = random.Random(0)
    for i in range(iters + 3):  # (three rounds of warm-up)
        rng.shuffle(order)
        for k in order:
            with around.get(k, contextlib.nullcontext)():
                t0 = clock()
                out = steps[k]()
                t1 = clock()
                out.sum().backward()
                t2 = clock()
            layer.zero_grad(set_to_none=True)
            h.grad = None
            if i >= 3:
                times[k][0].append(t1 - t0)
                times[k][1].append(t2 - t1)
    steps_of = {k: [x + y for x, y in zip(f, b, strict=True)] for k, (f, b) in times.items()}
    rows = {
        k: {
            "fwd_ms": statistics.median(f) * 1e3,
            "bwd_ms": statistics.median(b) * 1e3,
            "step_ms": statistics.median(steps_of[k]) * 1e3,
        }
        for k, (f, b) in times.items()
    }
    none, full, eng, sac, sac_nothing, bare = (rows[k]["step_ms"] for k in steps)
    gain = sac_nothing - sac  # what the decisions save a cost-free engine over full recompute
    free = full - gain  # that engine's step
    return {
        "rows": rows,
        **_eager_models.engine_ratios(steps_of, "engine", "torch SAC"),
        "decisions_gain_ms": gain,
        "engine_own_ms": eng - free,
        "budget_085_ms": 0.85 * (sac - none) - (free - none),
        "bare_modes_ms": bare - full,
        # PyTorch's SAC saving nothing recomputes what full recompute does: what it costs
        # beyond that is its own interception of every op. An engine that made the same
        # decisions at no cost of its own would pay PyTorch SAC's overhead less that.
        "torch_sac_own_ms": sac_nothing - full,
        "free_engine_vs_torch_sac": (free - none) / (sac - none),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="demo,llama,qwen3-moe")
    parser.add_argument("--iters", type=int, default=150)
    parser.add_argument("--scale", type=int, default=1, help="width and sequence times this")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    parser.add_argument("--cpu-time", action="store_true", help="time the thread's CPU time")
    _eager_models.add_size_arguments(parser)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    s = args.scale
    sizes = argparse.Namespace(**vars(args))
    for name in ("demo_d", "demo_seq", "hf_hidden", "hf_seq"):
        setattr(sizes, name, getattr(args, name) * s)
    subjects = {
        "demo": lambda: _eager_models.demo(sizes),
        "llama": lambda: _eager_models.transformers_model(sizes, "llama"),
        "qwen3-moe": lambda: _eager_models.transformers_model(sizes, "qwen3-moe"),
    }
    found = {}
    what = "thread CPU time" if args.cpu_time else "wall time"
    for key in args.models.split(","):
        subject = subjects[key]()
        r = found[key] = measure(subject, args.iters, clock)
        print(
            f"\n{subject.name} one layer, keep={'+'.join(sorted(subject.keep))}, scale {s}, "
            f"{torch.get_num_threads()} thread(s), {what}: median of {args.iters} interleaved steps"
        )
        print(f"{'configuration':<16} {'fwd ms':>8} {'bwd ms':>8} {'step ms':>8}")
        for name, row in r["rows"].items():
            print(f"{name:<16} {row['fwd_ms']:>8.2f} {row['bwd_ms']:>8.2f} {row['step_ms']:>8.2f}")
        print(_eager_models.ratios_line(r, 3))
        print(
            f"torch SAC's own cost (saving nothing, over full recompute): {r['torch_sac_own_ms']:.2f} ms; "
            f"an engine with no cost of its own: {r['free_engine_vs_torch_sac']:.2f}x torch SAC's overhead"
        )
        print(
            f"the decisions save (torch SAC saving nothing - torch SAC): {r['decisions_gain_ms']:.2f} ms "
            f"a step; the engine's own cost: {r['engine_own_ms']:.2f} ms (beats full recompute only "
            f"under {r['decisions_gain_ms']:.2f} ms, reaches 0.85x only under {r['budget_085_ms']:.2f} ms); "
            f"bare modes cost {r['bare_modes_ms']:.2f} ms"
        )
    return found


if __name__ == "__main__":
    main()
