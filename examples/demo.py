"""sac-compile demo: keep exactly the activations you ask for, inside torch.compile.

Trains a small built-in mixture-of-experts transformer
(``sac_compile.testing.models.MoETransformer``: attention, a router and
static-capacity experts per layer; no markers in its code) on CPU. Regions are
*declared* by module path -- ``layers.*.attn`` -> "attn", ``layers.*.moe.router``
-> "router", ``layers.*.moe.experts`` -> "experts" -- and every layer is wrapped
by one ``SacConfig`` keeping ``--keep``. Six configurations train the same steps
from the same weights, interleaved:

* no checkpoint, full recompute (keep=()), selective (keep=--keep, policy ``SAVE_ALL``: a
  kept region that is a whole module runs once, skipped in the recompute), eagerly;
* PyTorch's own selective checkpointing making the default policy's decisions, eagerly
  (``sac_compile.testing.baselines.Checkpointed``; with ``SAVE_ALL``'s it raises on this
  model: the router writes into a tensor it cached);
* no checkpoint, full recompute and selective with
  ``torch.compile(model, backend=sac_compile.sac_backend)`` (no checkpoint: the same
  Inductor compile without the tagging pass), with the default policy ``SAVE_COSTLY``.

Then it prints what one compiled layer saves and recomputes per region, a
comparison table (bytes held after the forward, step time, loss agreement), the ops
the eager engine intercepts in one layer's step, and writes a PNG plot of held bytes
against step time.

    python examples/demo.py [--layers 4 --d 128 --seq 128 --batch 8 --steps 12 --keep attn,router]
                            [--plot sac_demo.png] [--inner inductor|aot_eager] [--tiny]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import sac_compile as sc
from sac_compile.eager import checkpoint_with_regions
from sac_compile.policy import SAVE_ALL, SAVE_COSTLY
from sac_compile.testing.baselines import Checkpointed
from sac_compile.testing.counting import CountOps
from sac_compile.testing.models import MoETransformer


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--d", type=int, default=128, help="model width (default 128)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=8, help="experts per layer, top-2 routing (default 8)")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=12, help="training steps per configuration (default 12)")
    p.add_argument(
        "--keep",
        default="attn,router",
        help="comma-separated regions to keep, of: attn, router, experts (default attn,router)",
    )
    p.add_argument("--plot", default="sac_demo.png", help="PNG to write ('' to skip)")
    p.add_argument("--inner", default="inductor", choices=["inductor", "aot_eager"], help="compiler")
    p.add_argument("--tiny", action="store_true", help="smoke-test sizes (a few seconds per config)")
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.d, args.heads, args.experts, args.seq, args.batch = 2, 16, 2, 4, 16, 2
        args.steps, args.vocab = min(args.steps, 3), 32
    keep = {k.strip() for k in args.keep.split(",") if k.strip()}
    unknown = keep - set(MoETransformer.REGIONS.values())
    if unknown:
        p.error(f"--keep names {sorted(unknown)} are not regions of the model: use attn, router, experts")
    args.keep = keep
    for name in ("layers", "d", "heads", "experts", "vocab", "seq", "batch", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    return args


class Progress:
    """A one-line progress bar on stderr (a line per 10% when stderr is not a terminal)."""

    def __init__(self, total: int, width: int = 28) -> None:
        self.total, self.width, self.done = total, width, 0
        self.tty = sys.stderr.isatty()
        self.last_tenth = -1

    def update(self, note: str) -> None:
        self.done += 1
        frac = self.done / self.total
        bar = "#" * round(frac * self.width) + "." * (self.width - round(frac * self.width))
        line = f"[{bar}] {self.done}/{self.total} {note}"
        if self.tty:
            sys.stderr.write("\r" + line[:110].ljust(110))
            if self.done == self.total:
                sys.stderr.write("\n")
        elif int(frac * 10) != self.last_tenth or self.done == self.total:
            self.last_tenth = int(frac * 10)
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def build(args, mode: str, keep: set[str] | tuple | None):
    """The model, its optimizer and the callable a step runs, for one configuration."""
    torch.manual_seed(0)
    model = MoETransformer(args.vocab, args.d, args.layers, args.heads, args.experts)
    # Eagerly, SAVE_ALL: a kept region that is a whole module runs once, its body skipped in
    # the recompute with no dispatch mode (the default policy recomputes its cheap ops, which
    # costs a Python dispatch round trip per op eagerly). Compiled, the default policy: the
    # partitioner recomputes the cheap ops inside fused kernels.
    policy = SAVE_ALL if mode == "eager" else SAVE_COSTLY
    if mode == "torch":
        # PyTorch's SAC making the default policy's decisions, read from the same regions
        # (with SAVE_ALL's it raises on this model: the router writes into a tensor it cached)
        sc.declare_regions(model, MoETransformer.REGIONS)
        for i, layer in enumerate(model.layers):
            model.layers[i] = Checkpointed(layer, keep, policy=policy)
    elif keep is not None:
        sc.SacConfig(layers="layers.*", keep=set(keep), regions=MoETransformer.REGIONS, policy=policy).apply(
            model
        )
    run = model
    if mode == "compiled":
        if keep is None:
            backend = sc.compiler.baseline_backend(args.inner)  # the same compile without the tagging pass
        elif args.inner == "inductor":
            backend = sc.sac_backend  # each layer's checkpoint scope carries its own keep set
        else:
            backend = sc.make_sac_backend(sc.ALL_REGIONS, inner=args.inner)
        run = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return model, run, opt


def batch(args, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable synthetic task: each sequence counts up from a random start (mod vocab)."""
    start = torch.randint(0, args.vocab, (args.batch, 1), generator=g)
    ids = (start + torch.arange(args.seq + 1)) % args.vocab
    return ids[:, :-1], ids[:, 1:]


def loss_of(run, ids, targets) -> torch.Tensor:
    logits = run(ids)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@contextlib.contextmanager
def _quiet_fds():
    """The profiler's C++ side prints start/stop lines on the process's stdout and stderr:
    silence them."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)
        os.close(devnull)


def held_after_forward(run, ids, targets) -> int:
    """Bytes the forward allocates and still holds when it returns (what the backward will read),
    from the profiler's allocator accounting: the same measure for eager and compiled code."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with _quiet_fds(), torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        loss = loss_of(run, ids, targets)
    held = sum(e.self_cpu_memory_usage for e in prof.events())
    loss.backward()
    return held


def first_layer_input(args) -> tuple[MoETransformer, torch.Tensor]:
    """The demo model with its regions declared, and its first layer's input."""
    torch.manual_seed(0)
    model = MoETransformer(args.vocab, args.d, args.layers, args.heads, args.experts)
    sc.declare_regions(model, MoETransformer.REGIONS)
    ids, _ = batch(args, torch.Generator().manual_seed(0))
    return model, model.embed(ids).detach().requires_grad_()


def region_table(args) -> str:
    """Per region: what one compiled layer saves and recomputes (capture_partition)."""
    model, h = first_layer_input(args)
    report = sc.inspection.capture_partition(
        model.layers[0], h, backend=sc.make_sac_backend(args.keep, inner=args.inner)
    )
    values, nbytes, recomputed = {}, {}, {}
    for v in report.saved:
        if not v.is_param:
            values[v.region] = values.get(v.region, 0) + 1
            nbytes[v.region] = nbytes.get(v.region, 0) + v.nbytes
    for g in report.graphs:
        for region, nodes in g.recomputed.items():
            recomputed[region] = recomputed.get(region, 0) + len(nodes)
    names = sorted(set(values) | set(recomputed), key=lambda r: (r in ("-", "input", "rng"), r))
    lines = [f"{'region':<10} {'kept':>5} {'saved values':>13} {'saved KiB':>10} {'recomputed ops':>15}"]
    for r in names:
        kept = "yes" if r in args.keep else ("" if r in ("-", "input", "rng") else "no")
        lines.append(
            f"{r:<10} {kept:>5} {values.get(r, 0):>13} {nbytes.get(r, 0) / 1024:>10.1f} {recomputed.get(r, 0):>15}"
        )
    lines.append(
        f"{'total':<10} {'':>5} {sum(values.values()):>13} {sum(nbytes.values()) / 1024:>10.1f} "
        f"{sum(recomputed.values()):>15}"
    )
    lines.append("('-' = outside every region, 'input' = the layer's input, 'rng' = saved RNG state)")
    return "\n".join(lines)


def intercepted_line(args) -> str:
    """Ops the eager engine's dispatch modes see in one layer's step, against the ops it runs."""
    model, h = first_layer_input(args)
    with torch.no_grad(), CountOps() as plain:
        model.layers[0](h)
    stats: list = []
    for policy in (SAVE_ALL, SAVE_COSTLY):
        run = checkpoint_with_regions(model.layers[0], h, keep=args.keep, policy=policy, stats_out=stats)
        run.sum().backward()
    body, n = stats[0], stats[1].intercepted
    return (
        f"the layer's forward runs {plain.n} ops; the eager row's engine (SAVE_ALL) intercepted "
        f"{sum(body.intercepted.values())} of them: its {body.bodies['skipped']} kept module calls ran with no "
        f"dispatch mode and were skipped in the recompute. The default policy intercepts {n['forward', 'kept']} "
        f"in the forward and {n['recompute', 'kept']} in the recompute, all inside kept regions "
        f"({n['forward', 'outside']} + {n['recompute', 'outside']} outside); PyTorch's SAC intercepts every op, "
        "in both passes"
    )


def plot(path: str, rows: list[dict]) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[demo]'): no plot written"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, marker, label in (
        ("eager", "o", "eager"),
        ("torch", "^", "PyTorch SAC, eager"),
        ("compiled", "s", "compiled"),
    ):
        pts = [r for r in rows if r["mode"] == mode]
        ax.plot(
            [r["time_ratio"] for r in pts],
            [r["held"] / 2**20 for r in pts],
            marker=marker,
            ls="none",
            label=label,
        )
        for r in pts:
            ax.annotate(
                r["short"], (r["time_ratio"], r["held"] / 2**20), textcoords="offset points", xytext=(6, 4)
            )
    ax.set_xlabel("step time / eager no-checkpoint step")
    ax.set_ylabel("MiB held after the forward")
    ax.set_title("sac-compile: activation memory vs step time")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot written to {path}"


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    keep = sorted(args.keep)
    configs = [
        ("no checkpoint", "eager", None, "none"),
        ("full recompute", "eager", (), "full"),
        (f"eager SAC keep={'+'.join(keep) or '()'}", "eager", args.keep, "SAC"),
        (f"PyTorch SAC keep={'+'.join(keep) or '()'}", "torch", args.keep, "torch SAC"),
        ("compiled, no checkpoint", "compiled", None, "none"),
        ("compiled, full recompute", "compiled", (), "full"),
        (f"compiled SAC keep={'+'.join(keep) or '()'}", "compiled", args.keep, "SAC"),
    ]
    print(
        f"MoE transformer: {args.layers} layers, d {args.d}, {args.heads} heads, {args.experts} experts top-2, "
        f"vocab {args.vocab}, batch {args.batch} x seq {args.seq}, CPU float32; compiler {args.inner}"
    )
    print(f"regions declared by module path: {MoETransformer.REGIONS}; keep = {keep}\n")
    t_start = time.perf_counter()
    runs = [build(args, mode, k) for _, mode, k, _ in configs]
    data = [batch(args, torch.Generator().manual_seed(step)) for step in range(args.steps)]
    losses = [[] for _ in configs]
    times = [[] for _ in configs]
    bar = Progress(args.steps * len(configs))
    for step, (ids, targets) in enumerate(data):
        for i in range(len(configs)):
            j = (i + step) % len(configs)  # rotate the order: no configuration always runs first
            model, run, opt = runs[j]
            t0 = time.perf_counter()
            loss = loss_of(run, ids, targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times[j].append(time.perf_counter() - t0)
            losses[j].append(loss.item())
            bar.update(f"step {step + 1}/{args.steps} {configs[j][0]:<28} loss {loss.item():.4f}")
    ids, targets = data[0]
    held = []
    for _, run, opt in runs:
        held.append(held_after_forward(run, ids, targets))
        opt.zero_grad(set_to_none=True)

    print("\n== what one compiled layer saves, per region (capture_partition of layer 0) ==")
    print(region_table(args))

    # step 0 includes compilation: medians over the rest
    med = [statistics.median(t[1:] if len(t) > 1 else t) for t in times]
    ref_losses = losses[0]
    rows = []
    print("\n== comparison (same weights, same batches; medians exclude step 1, which compiles) ==")
    print(
        f"{'configuration':<36} {'held MiB':>9} {'vs none':>8} {'step ms':>8} {'vs none':>8} {'max |dloss|':>12}"
    )
    for (name, mode, _, short), h, m, ls in zip(configs, held, med, losses):
        dloss = max(abs(a - b) for a, b in zip(ls, ref_losses))
        row = {"name": name, "mode": mode, "short": short, "held": h, "time_ratio": m / med[0]}
        rows.append(row)
        print(
            f"{name:<36} {h / 2**20:>9.2f} {h / held[0]:>8.2f} {m * 1e3:>8.1f} {m / med[0]:>7.2f}x {dloss:>12.2e}"
        )
    print(
        f"losses: step 1 {ref_losses[0]:.4f} -> step {args.steps} {ref_losses[-1]:.4f} (no checkpoint); "
        "max |dloss| is against it"
    )
    print("\n== the eager engine's interception, one layer's step ==")
    print(intercepted_line(args))
    if args.plot:
        print(plot(args.plot, rows))
    print(f"total time {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
