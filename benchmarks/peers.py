"""sac_compile beside the region library a user would pick instead, ``torch_remat``, and
PyTorch's own options, in one run per model: held bytes, recomputed FLOPs, interleaved step
ratios with 95% intervals, gradients compared.

Models: ``blocks`` (4 pre-norm blocks, regions ``attn`` = the attention module and ``mlp``
= the MLP module, written three ways: unmarked and declared by module path, marked with
``with sac_compile.region``, and wrapped with ``torch_remat.region``), the demo MoE
transformer (``demo``), and transformers' Llama (``llama``) and Qwen3-MoE (``qwen3-moe``)
built from their default configs at a small size, regions read by ``sac_compile.hf``.

Eager, every decoder layer checkpointed (median of ``--iters`` interleaved whole-model steps,
ratio to no checkpoint):

* ``no checkpoint``; ``full recompute`` (``torch.utils.checkpoint``); ``op-list SAC``
  (PyTorch's ``create_selective_checkpoint_contexts`` saving every matmul and attention op,
  torchtitan's selective-op AC);
* per keep set: ``torch_remat`` through its documented API (``remat.checkpoint(region_name=)``
  around each layer, ``remat.region(fn, name, recompute=False)`` around each kept region and
  ``remat.recompute_needs_tensor`` on its outputs), and ours: ``SacConfig`` with the default
  policy (``SAVE_COSTLY``) and with ``SAVE_ALL``, regions declared by module path (and, on
  ``blocks``, marked with ``with region``).

Compiled (``--compiled``, default on): each layer compiled with Inductor, torch_remat's wrapper
and ours (``SacConfig(compile=True)``); bytes and recomputed FLOPs read over an
``aot_eager`` compile of the same configuration (a dispatch mode counts the backward's costly
FLOPs; Inductor's kernels are not dispatched ops), steps timed interleaved with Inductor.

The verdict lines: per model and keep set, our best eager configuration (the fastest one at
no more than torch_remat's bytes + 1%) against torch_remat's bytes and step ratio (+0.03 allowed
for noise), and ours compiled against torch_remat compiled. Exit 1 when one is not met.
torch_remat is a bench extra (``pip install -e '.[bench]'``); without it the run says so and
exits 0 having measured nothing.

    python benchmarks/peers.py [--models blocks,demo,llama,qwen3-moe] [--iters 15] [--no-compiled]
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from _baselines import OpListSAC
from _timing import interleaved_times, ratio_interval
from torch.utils._pytree import tree_leaves

import sac_compile as sc
from sac_compile import hf
from sac_compile.inspection.flops import CountFlops
from sac_compile.policy import SAVE_ALL, SAVE_COSTLY
from sac_compile.testing import hf_families
from sac_compile.testing.baselines import Checkpointed, LayerWrapper
from sac_compile.testing.models import MoETransformer

try:
    import torch_remat as remat
except ImportError:  # (a bench extra)
    remat = None

BYTES_SLACK = 1.01  # ours at most torch_remat's bytes + 1%
STEP_SLACK = 0.03  # ... and its step ratio + 0.03 (one run's noise on 2 cores)


# -- the models ---------------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class PeerBlock(nn.Module):
    """A pre-norm block whose regions are its ``attn`` and ``mlp`` modules; ``marked``: each
    call of one runs inside ``with sac_compile.region(name)`` (else unmarked: declare them)."""

    def __init__(self, d: int, heads: int, marked: bool = False) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn, self.mlp = Attention(d, heads), MLP(d)
        self.marked = marked

    def _call(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if self.marked:
            with sc.region(name):
                return getattr(self, name)(x)
        return getattr(self, name)(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._call("attn", self.ln1(x))
        return x + self._call("mlp", self.ln2(x))


class Blocks(nn.Module):
    REGIONS = {"layers.*.attn": "attn", "layers.*.mlp": "mlp"}

    def __init__(self, n: int, d: int, heads: int, marked: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PeerBlock(d, heads, marked) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@dataclass
class Model:
    """A model under test: how to build it (unmarked), its layers, regions, keep sets and loss."""

    name: str
    build: Callable[[], nn.Module]
    layers: str  # module path of the layer list
    regions: dict[str, str]
    keep_sets: list[frozenset]
    loss: Callable[[nn.Module], torch.Tensor]
    marked: Callable[[], nn.Module] | None = None  # the same model marked with `with region`
    configs: dict[str, Callable[[], nn.Module]] = field(default_factory=dict)


def blocks_model(args) -> Model:
    x = torch.randn(args.batch, args.seq, args.d, generator=torch.Generator().manual_seed(1))

    def build(marked: bool = False) -> nn.Module:
        torch.manual_seed(0)
        return Blocks(args.layers, args.d, args.heads, marked)

    keep = [frozenset(k) for k in ({"attn"}, {"mlp"}, {"attn", "mlp"})]
    return Model(
        "blocks",
        build,
        "layers",
        Blocks.REGIONS,
        keep,
        lambda m: m(x).float().pow(2).mean(),
        marked=functools.partial(build, True),
    )


def demo_model(args) -> Model:
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))

    def build() -> nn.Module:
        torch.manual_seed(0)
        return MoETransformer(vocab=256, d=args.demo_d, n_layers=args.layers)

    keep = [frozenset(k) for k in ({"attn"}, {"attn", "router"}, {"attn", "router", "experts"})]
    return Model(
        "demo MoE", build, "layers", MoETransformer.REGIONS, keep, lambda m: m(ids).logsumexp(-1).mean()
    )


def transformers_model(args, family: str) -> Model:
    def build() -> nn.Module:
        if family == "llama":
            return hf_families.tiny_llama(layers=args.layers, hidden=args.hf_hidden).train()
        return hf_families.tiny_qwen3_moe(layers=args.layers, hidden=args.hf_hidden, experts=8).train()

    probe = build()
    ids = hf.batch(probe, batch=args.hf_batch, seq=args.hf_seq)
    regions = hf.regions_for(probe)
    names = sorted(set(regions.values()))
    keep = [frozenset({"attn"}), frozenset(n for n in names if n != "experts"), frozenset(names)]
    keep = list(dict.fromkeys(keep))
    return Model(
        f"transformers {family}",
        build,
        hf.decoder_layers(probe)[:-2],
        regions,
        keep,
        lambda m: m(input_ids=ids, labels=ids, use_cache=False).loss,  # (training: no KV cache)
    )


# -- the configurations -------------------------------------------------------------------
class RematLayer(LayerWrapper):
    """``layer`` under ``remat.checkpoint(region_name=name)``."""

    def __init__(self, layer: nn.Module, name: str) -> None:
        super().__init__(layer)
        self.name = name

    def forward(self, *args, **kwargs):
        return remat.checkpoint(region_name=self.name)(self.layer)(*args, **kwargs)


def _remat_region(module: nn.Module, name: str) -> None:
    """Run ``module`` as torch_remat's save region ``name``, its outputs marked as the
    recompute's (``recompute_needs_tensor``: the layer goes on from them)."""
    run = remat.region(module.forward, name, recompute=False)

    def forward(*args, **kwargs):
        out = run(*args, **kwargs)
        remat.recompute_needs_tensor(*(t for t in tree_leaves(out) if isinstance(t, torch.Tensor)))
        return out

    module.forward = forward


def with_remat(model: Model, keep: frozenset) -> nn.Module:
    m = model.build()
    layers = m.get_submodule(model.layers)
    for path, name in model.regions.items():
        if name in keep:
            for p, module in m.named_modules():
                if sc.declare.match_path(path, p):
                    _remat_region(module, name)
    for i, layer in enumerate(layers):
        layers[i] = RematLayer(layer, f"{model.layers}.{i}")
    return m


def with_ours(model: Model, keep: frozenset, policy, marked: bool = False, compile=False) -> nn.Module:
    m = model.marked() if marked else model.build()
    regions = {} if marked else model.regions
    sc.SacConfig(
        layers=model.layers + ".*", keep=keep, regions=regions, policy=policy, compile=compile
    ).apply(m)
    return m


def wrapped(model: Model, wrap) -> nn.Module:
    m = model.build()
    layers = m.get_submodule(model.layers)
    for i, layer in enumerate(layers):
        layers[i] = wrap(layer)
    return m


def keep_text(keep: frozenset) -> str:
    return "+".join(sorted(keep))


def eager_configs(model: Model) -> dict[str, tuple[frozenset | None, str, Callable[[], nn.Module]]]:
    """name -> (keep set or None, kind, builder); kind: "torch", "remat" or "ours"."""
    found: dict = {
        "no checkpoint": (None, "torch", model.build),
        "full recompute": (None, "torch", lambda: wrapped(model, Checkpointed)),
        "op-list SAC": (None, "torch", lambda: wrapped(model, OpListSAC)),
    }
    for keep in model.keep_sets:
        k = keep_text(keep)
        found[f"torch_remat keep={k}"] = (keep, "remat", functools.partial(with_remat, model, keep))
        for label, policy in (("SAVE_COSTLY", SAVE_COSTLY), ("SAVE_ALL", SAVE_ALL)):
            found[f"ours {label} keep={k}"] = (
                keep,
                "ours",
                functools.partial(with_ours, model, keep, policy),
            )
            if model.marked is not None:
                found[f"ours {label} with-region keep={k}"] = (
                    keep,
                    "ours",
                    functools.partial(with_ours, model, keep, policy, True),
                )
    return found


def compiled_configs(model: Model, backend: str) -> dict:
    def plain() -> nn.Module:
        m = model.build()
        for layer in m.get_submodule(model.layers):
            layer.compile(backend=backend)
        return m

    def remat_compiled(keep) -> nn.Module:
        m = with_remat(model, keep)
        for layer in m.get_submodule(model.layers):
            layer.compile(backend=backend)
        return m

    found: dict = {"no checkpoint": (None, "torch", plain)}
    for keep in model.keep_sets:
        k = keep_text(keep)
        found[f"torch_remat keep={k}"] = (keep, "remat", functools.partial(remat_compiled, keep))
        found[f"ours keep={k}"] = (
            keep,
            "ours",
            functools.partial(with_ours, model, keep, SAVE_COSTLY, compile={"inner": backend}),
        )
    return found


# -- measuring ----------------------------------------------------------------------------
def grads_of(model: Model, m: nn.Module) -> list[torch.Tensor]:
    m.zero_grad(set_to_none=True)
    model.loss(m).backward()
    out = [p.grad.clone() for p in m.parameters() if p.grad is not None]
    m.zero_grad(set_to_none=True)
    return out


def backward_flops(model: Model, m: nn.Module) -> int:
    loss = model.loss(m)
    with CountFlops() as counter:
        loss.backward()
    m.zero_grad(set_to_none=True)
    return counter.flops


def held_bytes(model: Model, m: nn.Module) -> int:
    n = sc.inspection.autograd_saved_bytes(model.loss, m, exclude=list(m.parameters()))
    m.zero_grad(set_to_none=True)
    return n


def measure(model: Model, configs: dict, iters: int, flops_from: dict | None = None) -> dict:
    """name -> {bytes, flops (recomputed), step (ratio to no checkpoint), interval, dgrad}."""
    models = {name: build() for name, (_, _, build) in configs.items()}
    rows: dict = {}
    ref = grads_of(model, models["no checkpoint"])
    for name, m in list(models.items()):
        try:
            got = grads_of(model, m)  # (also the first, compiling step)
        except RuntimeError as e:  # (PyTorch's SAC refuses some transformers layers)
            rows[name] = {"failed": str(e).splitlines()[0]}
            del models[name]
            continue
        rows[name] = {"dgrad": max((a - b).abs().max().item() for a, b in zip(got, ref, strict=True))}
        rows[name]["bytes"] = held_bytes(model, m)
        if flops_from is None:
            rows[name]["flops"] = backward_flops(model, m)
    if flops_from is not None:  # compiled: the aot_eager compiles' backward FLOPs
        for name in models:
            rows[name]["flops"] = flops_from[name].get("flops", float("nan"))
    else:
        base = rows["no checkpoint"]["flops"]
        for name in models:
            rows[name]["flops"] -= base

    def run(m):
        model.loss(m).backward()
        m.zero_grad(set_to_none=True)

    times = interleaved_times({n: functools.partial(run, m) for n, m in models.items()}, iters)
    medians = {n: statistics.median(t) for n, t in times.items()}
    rows["no checkpoint"]["ms"] = medians["no checkpoint"] * 1e3
    for name in models:
        rows[name]["step"] = medians[name] / medians["no checkpoint"]
        rows[name]["interval"] = ratio_interval(
            times, lambda t, name=name: t[name] / t["no checkpoint"], draws=300
        )
    return rows


def print_rows(title: str, rows: dict, iters: int) -> None:
    base = rows["no checkpoint"]["ms"]
    print(
        f"\n{title}: median of {iters} interleaved steps; step = ratio to no checkpoint's {base:.1f} ms, 95% interval"
    )
    print(
        f"{'configuration':<44} {'held MiB':>9} {'recomp GFLOP':>12} {'step':>6} {'95%':>12} {'max|dgrad|':>10}"
    )
    for name, r in rows.items():
        if "failed" in r:
            print(f"{name:<44} fails: {r['failed'][:100]}")
            continue
        lo, hi = r["interval"]
        print(
            f"{name:<44} {r['bytes'] / 2**20:9.2f} {r['flops'] / 1e9:12.3f} {r['step']:6.2f} "
            f"{lo:5.2f}-{hi:5.2f} {r['dgrad']:10.1e}"
        )


def verdicts(model: Model, configs: dict, rows: dict, compiled: bool) -> list[str]:
    """Per keep set, ours against torch_remat's bytes and step; returns the failures."""
    failed = []
    for keep in model.keep_sets:
        k = keep_text(keep)
        theirs = rows[f"torch_remat keep={k}"]
        ours = {
            n: r
            for n, r in rows.items()
            if configs[n][1] == "ours" and configs[n][0] == keep and "failed" not in r
        }
        fits = {n: r for n, r in ours.items() if r["bytes"] <= theirs["bytes"] * BYTES_SLACK}
        best = min(fits, key=lambda n: fits[n]["step"]) if fits else min(ours, key=lambda n: ours[n]["bytes"])
        r = ours[best]
        ok = best in fits and r["step"] <= theirs["step"] + STEP_SLACK
        where = "compiled" if compiled else "eager"
        line = (
            f"{'ok  ' if ok else 'FAIL'} {model.name} {where} keep={k}: {best} {r['bytes'] / 2**20:.2f} MiB "
            f"({r['bytes'] / theirs['bytes']:.2f}x torch_remat's {theirs['bytes'] / 2**20:.2f}), step "
            f"{r['step']:.2f} vs {theirs['step']:.2f} ({r['step'] - theirs['step']:+.2f})"
        )
        print(line)
        if not ok:
            failed.append(line)
    return failed


def run_model(model: Model, args) -> tuple[list[str], dict]:
    """Measure and print ``model``'s eager (and compiled) tables; returns the verdicts not met
    and the rows, ``{"eager": rows, "compiled": rows}``."""
    configs = eager_configs(model)
    rows = measure(model, configs, args.iters)
    print_rows(f"{model.name}, eager", rows, args.iters)
    failed = verdicts(model, configs, rows, compiled=False)
    found = {"eager": rows}
    if args.compiled:
        # (each compile set starts from empty Dynamo caches: RematLayer.forward is one code
        # object for every model, guarded per layer, and past its recompile limit a layer
        # would run eagerly)
        with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=4096):
            torch._dynamo.reset()
            counted = measure(model, compiled_configs(model, "aot_eager"), 1)
            torch._dynamo.reset()
            configs = compiled_configs(model, args.inner)
            rows = measure(model, configs, args.iters, flops_from=counted)
        title = f"{model.name}, each layer compiled ({args.inner}; bytes from it, FLOPs over aot_eager)"
        print_rows(title, rows, args.iters)
        failed += verdicts(model, configs, rows, compiled=True)
        found["compiled"] = rows
    return failed, found


MODELS = {
    "blocks": blocks_model,
    "demo": demo_model,
    "llama": lambda a: transformers_model(a, "llama"),
    "qwen3-moe": lambda a: transformers_model(a, "qwen3-moe"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="blocks,demo,llama,qwen3-moe")
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--compiled", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--inner", default="inductor", help="the compiler of the timed compiled runs")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--d", type=int, default=256, help="hidden size of the blocks")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--demo-d", type=int, default=128)
    parser.add_argument("--hf-hidden", type=int, default=256)
    parser.add_argument("--hf-batch", type=int, default=4)
    parser.add_argument("--hf-seq", type=int, default=256)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if remat is None:
        print("torch_remat is not installed (pip install -e '.[bench]'): nothing to compare against")
        return 0
    torch.set_num_threads(2)
    print(f"torch {torch.__version__}, torch_remat {importlib.metadata.version('torch-remat')}")
    failed = []
    for key in args.models.split(","):
        failed += run_model(MODELS[key](args), args)[0]
    print(f"\n{len(failed)} verdict(s) not met" if failed else "\nevery verdict met")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
