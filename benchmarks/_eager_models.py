"""The eager engine on the demo model and two transformers models: step time
against the eager alternatives a user would pick, and the ops the engine intercepts.

Four configurations per model, same weights, timed interleaved (median of ``iters``
forward+backward steps of the whole model, as a ratio to no checkpoint):

* ``no checkpoint``;
* ``full recompute``: ``torch.utils.checkpoint`` (non-reentrant) around every layer;
* ``engine keep=K``: ``sac_compile`` eager (``SacConfig`` / ``hf.config_for``);
* ``torch SAC keep=K``: PyTorch's ``create_selective_checkpoint_contexts`` around every
  layer with a policy function making the engine's decisions
  (``sac_compile.testing.baselines.Checkpointed``). Its overhead over no checkpoint is
  what the engine must beat.
"""

from __future__ import annotations

import copy
import functools
import statistics
from collections.abc import Callable

import torch
import torch.nn as nn
from _timing import interleaved_times, ratio_interval

import sac_compile as sc
from sac_compile import hf
from sac_compile.eager import checkpoint_with_regions
from sac_compile.testing import hf_families
from sac_compile.testing.baselines import Checkpointed
from sac_compile.testing.counting import CountOps
from sac_compile.testing.models import MoETransformer


class Subject:
    """A model, its layer list, regions, keep set, its loss and one layer's call."""

    def __init__(self, name: str, model: nn.Module, layers: str, regions: dict, keep: set, loss, layer_call):
        self.name, self.model, self.layers, self.regions, self.keep = name, model, layers, regions, keep
        self.loss: Callable[[nn.Module], torch.Tensor] = loss  # the model's loss on the batch
        self.layer_call = layer_call  # model -> (one-argument layer, its input)

    def step(self, model: nn.Module) -> None:
        self.loss(model).backward()

    def variant(self, how: str) -> nn.Module:
        model = copy.deepcopy(self.model)
        layers = model.get_submodule(self.layers)
        if how == "engine":
            sc.SacConfig(layers=self.layers + ".*", keep=self.keep, regions=self.regions).apply(model)
        elif how in ("full", "torch SAC"):
            if how == "torch SAC":
                sc.declare_regions(model, self.regions)
            for i, layer in enumerate(layers):
                layers[i] = Checkpointed(layer, None if how == "full" else self.keep)
        return model


def add_size_arguments(parser) -> None:
    """The models' sizes (``eager_vs_compiled.py``, ``eager_layer.py``)."""
    parser.add_argument("--demo-d", type=int, default=128)
    parser.add_argument("--demo-layers", type=int, default=4)
    parser.add_argument("--demo-seq", type=int, default=128)
    parser.add_argument("--demo-batch", type=int, default=8)
    parser.add_argument("--hf-layers", type=int, default=4)
    parser.add_argument("--hf-hidden", type=int, default=256)
    parser.add_argument("--hf-seq", type=int, default=256)
    parser.add_argument("--hf-batch", type=int, default=4)


def demo(args) -> Subject:
    torch.manual_seed(0)
    model = MoETransformer(vocab=256, d=args.demo_d, n_layers=args.demo_layers)
    ids = torch.randint(0, 256, (args.demo_batch, args.demo_seq), generator=torch.Generator().manual_seed(1))

    def loss(m):
        return m(ids).logsumexp(-1).mean()

    def layer_call(m):
        sc.declare_regions(m, MoETransformer.REGIONS)
        return m.layers[0], m.embed(ids).detach().requires_grad_()

    return Subject("demo MoE", model, "layers", MoETransformer.REGIONS, {"attn", "router"}, loss, layer_call)


def transformers_model(args, family: str) -> Subject:
    if family == "llama":
        model = hf_families.tiny_llama(layers=args.hf_layers, hidden=args.hf_hidden)
        keep = {"attn"}
    else:
        model = hf_families.tiny_qwen3_moe(layers=args.hf_layers, hidden=args.hf_hidden, experts=8)
        keep = {"attn", "router"}
    model.train()
    ids = hf.batch(model, batch=args.hf_batch, seq=args.hf_seq)

    def loss(m):
        return m(input_ids=ids, labels=ids).loss

    def layer_call(m):
        sc.declare_regions(m, hf.regions_for(m))
        return hf.layer_call(m, ids)

    path = hf.decoder_layers(model)[:-2]
    return Subject(f"transformers {family}", model, path, hf.regions_for(model), keep, loss, layer_call)


def engine_ratios(times: dict, engine: str, torch_sac: str) -> dict:
    """Two ratios from per-round step times (``_timing.interleaved_times``) of
    ``"no checkpoint"``, ``"full recompute"``, ``engine`` and ``torch_sac`` (PyTorch's SAC
    making the engine's decisions): engine / full recompute step, and the engine's step
    overhead over no checkpoint / PyTorch SAC's; each of medians, with its 95% interval."""

    def vs_full(m: dict) -> float:
        return m[engine] / m["full recompute"]

    def overhead(m: dict) -> float:
        return (m[engine] - m["no checkpoint"]) / (m[torch_sac] - m["no checkpoint"])

    medians = {k: statistics.median(v) for k, v in times.items()}
    return {
        "engine_vs_full": vs_full(medians),
        "engine_vs_full_95": ratio_interval(times, vs_full),
        "overhead_vs_torch_sac": overhead(medians),
        "overhead_vs_torch_sac_95": ratio_interval(times, overhead),
    }


def ratios_line(r: dict, digits: int) -> str:
    """:func:`engine_ratios`' result as printed (the step ratio to ``digits`` places)."""
    lo, hi = r["engine_vs_full_95"]
    olo, ohi = r["overhead_vs_torch_sac_95"]
    return (
        f"engine / full recompute: {r['engine_vs_full']:.{digits}f}x step (95%: {lo:.{digits}f}-{hi:.{digits}f}); "
        f"engine overhead / torch SAC overhead: {r['overhead_vs_torch_sac']:.2f}x ({olo:.2f}-{ohi:.2f})"
    )


def measure(subject: Subject, iters: int) -> dict:
    keep = "+".join(sorted(subject.keep))
    configs = {
        "no checkpoint": "none",
        "full recompute": "full",
        f"engine keep={keep}": "engine",
        f"torch SAC keep={keep}": "torch SAC",
    }
    models = {name: subject.variant(how) for name, how in configs.items()}

    def run(model):
        subject.step(model)
        model.zero_grad(set_to_none=True)

    for model in models.values():
        run(model)  # warm up
    times = interleaved_times({n: functools.partial(run, m) for n, m in models.items()}, iters)
    medians = {n: statistics.median(t) for n, t in times.items()}
    base = medians["no checkpoint"]
    rows = {n: {"step_ms": t * 1e3, "ratio": t / base} for n, t in medians.items()}
    summary = engine_ratios(times, f"engine keep={keep}", f"torch SAC keep={keep}")
    # what the engine intercepts in one layer's step, against the ops the layer runs
    layer, h = subject.layer_call(copy.deepcopy(subject.model))
    with torch.no_grad(), CountOps() as plain:
        layer(h)
    stats: list = []
    checkpoint_with_regions(layer, h, keep=subject.keep, stats_out=stats).sum().backward()
    summary["layer_ops"] = plain.n
    summary["intercepted"] = dict(stats[0].intercepted)
    return {"rows": rows, **summary}


def report(name: str, keep: set, result: dict, iters: int) -> None:
    print(f"\n{name}, keep={'+'.join(sorted(keep))}: median of {iters} interleaved steps")
    print(f"{'configuration':<28} {'step ms':>8} {'vs no ckpt':>10}")
    for n, r in result["rows"].items():
        print(f"{n:<28} {r['step_ms']:>8.1f} {r['ratio']:>10.2f}")
    n = result["intercepted"]
    print(ratios_line(result, 2))
    print(
        f"one layer's step: {result['layer_ops']} ops in its forward; the engine intercepted "
        f"{n.get(('forward', 'kept'), 0)} (forward, kept regions), {n.get(('forward', 'outside'), 0)} (forward, "
        f"outside), {n.get(('recompute', 'kept'), 0)} (recompute, kept), {n.get(('recompute', 'outside'), 0)} "
        "(recompute, outside)"
    )


def main(args) -> dict:
    subjects = {"demo": lambda: demo(args), "llama": lambda: transformers_model(args, "llama")}
    subjects["qwen3-moe"] = lambda: transformers_model(args, "qwen3-moe")
    found = {}
    for key in args.models.split(","):
        subject = subjects[key]()
        found[key] = measure(subject, args.iters)
        report(subject.name, subject.keep, found[key], args.iters)
    return found
