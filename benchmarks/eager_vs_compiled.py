"""Eager SAC vs compiled SAC on the same stack and keep set, and the eager engine's
overhead against PyTorch's own selective checkpointing making the same decisions.

Side by side in one run: retained bytes after the forward (net CPU bytes the
forward allocated and still holds, from the profiler's memory accounting) and the
median step time of interleaved forward+backward steps, as ratios to eager
no-checkpoint. ``torch SAC attn`` is ``create_selective_checkpoint_contexts`` with
an op list (SDPA) that makes exactly the decisions of ``keep={"attn"}`` on this
model, so its row against ``eager SAC attn`` is the engine's overhead.

Then the ops the eager engine's dispatch modes intercept in one layer's step
(forward and recompute, inside kept regions and outside them) against the ops the
layer runs in a plain forward: none outside kept regions.

Then (``--models``) the eager engine on the demo model and transformers Llama and
Qwen3-MoE against no checkpoint, full recompute and PyTorch's SAC making the same
decisions (see ``_eager_models.py``).

    python benchmarks/eager_vs_compiled.py [--layers 4 --d-model 128 --seq 256 --batch 4 --iters 15]
        [--models demo,llama,qwen3-moe] [--no-stack]
"""

from __future__ import annotations

import argparse
import copy
import functools

import _eager_models
import torch
from _timing import interleaved_medians
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import sac_compile as sc
from sac_compile.eager import checkpoint_with_regions
from sac_compile.testing.counting import CountOps
from sac_compile.testing.models import Stack

SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


class TorchSAC(torch.nn.Module):
    """A layer under PyTorch's SAC with an op-list policy."""

    def __init__(self, layer: torch.nn.Module, ops: list) -> None:
        super().__init__()
        self.layer = layer
        self.context_fn = functools.partial(create_selective_checkpoint_contexts, ops)

    def forward(self, x):
        return checkpoint(self.layer, x, use_reentrant=False, context_fn=self.context_fn)


def build(base: Stack, how: str) -> Stack:
    model = copy.deepcopy(base)
    kind, _, keep = how.partition(":")
    keep_set = {"none": None, "full": (), "attn": {"attn"}, "all": sc.ALL_REGIONS}[keep]
    for i, layer in enumerate(model.layers):
        if kind == "torch":
            model.layers[i] = TorchSAC(layer, [SDPA])
        elif keep_set is None:
            if kind == "compiled":
                layer.compile(backend=sc.compiler.baseline_backend())
        else:
            sc.apply_selective_checkpointing(layer, keep_set, compile=(kind == "compiled"))
    return model


def retained_bytes(model, x) -> int:
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        out = model(x)
    retained = sum(e.self_cpu_memory_usage for e in prof.events())
    out.sum().backward()
    return retained


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument(
        "--models",
        default="demo,llama,qwen3-moe",
        help="the eager engine's models, of: demo, llama, qwen3-moe; '' for none",
    )
    parser.add_argument("--no-stack", action="store_true", help="skip the eager vs compiled stack")
    _eager_models.add_size_arguments(parser)
    args = parser.parse_args(argv)
    found = {} if args.no_stack else stack(args)
    if args.models:
        found["models"] = _eager_models.main(args)
    return found


def stack(args) -> dict:

    torch.manual_seed(0)
    base = Stack(args.layers, args.d_model, args.heads)
    x = torch.randn(args.batch, args.seq, args.d_model, requires_grad=True)
    configs = {
        "eager no checkpoint": "eager:none",
        "eager full recompute": "eager:full",
        "eager SAC attn": "eager:attn",
        "torch SAC attn": "torch:attn",
        "eager SAC all": "eager:all",
        "compiled no checkpoint": "compiled:none",
        "compiled full recompute": "compiled:full",
        "compiled SAC attn": "compiled:attn",
        "compiled SAC all": "compiled:all",
    }
    models = {name: build(base, how) for name, how in configs.items()}
    rows: dict[str, dict] = {}
    with torch._dynamo.config.patch(recompile_limit=32):
        for name, model in models.items():  # warm up (compiles), then measure memory
            model(x).sum().backward()
            rows[name] = {"retained": retained_bytes(model, x)}

        def fwd_bwd(model):
            model(x).sum().backward()

        steps = {name: functools.partial(fwd_bwd, model) for name, model in models.items()}
        medians = interleaved_medians(steps, args.iters)
    base_mem = rows["eager no checkpoint"]["retained"]
    base_t = medians["eager no checkpoint"]
    print(
        f"eager vs compiled SAC, {args.layers} layers, d={args.d_model}, seq={args.seq}, batch={args.batch}, "
        f"torch {torch.__version__}, median of {args.iters} interleaved steps"
    )
    header = f"{'configuration':<25} {'retained KiB':>12} {'mem ratio':>9} {'step ms':>8} {'time ratio':>10}"
    print(header)
    print("-" * len(header))
    for name in models:
        med = medians[name]
        rows[name].update(
            step_ms=med * 1e3, mem_ratio=rows[name]["retained"] / base_mem, time_ratio=med / base_t
        )
        r = rows[name]
        print(
            f"{name:<25} {r['retained'] / 1024:>12.1f} {r['mem_ratio']:>9.2f} {r['step_ms']:>8.1f} {r['time_ratio']:>10.2f}"
        )
    overhead = rows["eager SAC attn"]["step_ms"] / rows["torch SAC attn"]["step_ms"]
    print(f"eager engine overhead vs torch SAC (same decisions): {overhead:.2f}x step time")
    rows["intercepted"] = intercepted_ops(base.layers[0], x)
    return rows


def intercepted_ops(layer: torch.nn.Module, x: torch.Tensor) -> dict:
    """Ops the eager engine intercepts in one forward+backward of ``layer``, by pass and region."""
    with torch.no_grad(), CountOps() as plain:
        layer(x)
    print(f"\nops intercepted by the eager engine in one layer step (the layer's forward runs {plain.n} ops)")
    print(f"{'keep':<8} {'fwd kept':>9} {'fwd outside':>12} {'rec kept':>9} {'rec outside':>12}")
    found = {}
    for name, keep in (("attn", {"attn"}), ("all", sc.ALL_REGIONS)):
        stats: list = []
        checkpoint_with_regions(layer, x, keep=keep, stats_out=stats).sum().backward()
        n = stats[0].intercepted
        found[name] = dict(n)
        print(
            f"{name:<8} {n['forward', 'kept']:>9} {n['forward', 'outside']:>12} "
            f"{n['recompute', 'kept']:>9} {n['recompute', 'outside']:>12}"
        )
    print("(PyTorch's SAC intercepts every op of the layer in both passes)")
    return {"plain_forward_ops": plain.n, **found}


if __name__ == "__main__":
    main()
