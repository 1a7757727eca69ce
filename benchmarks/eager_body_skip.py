"""Experiment (issue #17, item 1): kept regions that are whole modules skip their body in
the recompute. Measures what that approach would buy before it is built into the engine.

Not a library feature: a stand-alone wrapper, ``SkipBody``, around each decoder layer.
It is ``torch.utils.checkpoint`` (non-reentrant) whose checkpointed function runs the layer
with the kept modules' ``forward`` replaced for the call:

* forward: the module's body runs with the checkpoint's saved-tensor hooks popped, so
  autograd saves what it needs inside the module natively (as without checkpointing:
  every value the body's backward reads, cheap ones included), and its outputs are kept;
* recompute: the body does not run; the kept outputs are handed back (requiring grad as
  in the forward, so that the ops after it save the same tensors).

It skips the checks the engine would need (random ops in the body, in-place writes into
the body's inputs or outputs): the models here have none. Side by side, one run, median of
interleaved whole-model steps as ratios to no checkpoint, plus the bytes the whole model
holds for its backward (``sac_compile.inspection.autograd_saved_bytes``, parameters excluded):

* no checkpoint, full recompute;
* the engine (``SacConfig``) with the default policy (SAVE_COSTLY: a kept region's costly
  ops cached, its cheap ops recomputed) and PyTorch's SAC making those decisions;
* the engine and PyTorch's SAC with ``SAVE_ALL`` (every op of a kept region saved: no
  recompute inside kept regions, the decisions body skipping makes);
* ``skip body``.

    python benchmarks/eager_body_skip.py [--models demo,qwen3-moe] [--iters 30]
"""

from __future__ import annotations

import argparse
import copy
import functools

import _eager_models
import torch
import torch.nn as nn
from _timing import interleaved_medians
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint

import sac_compile as sc
from sac_compile.policy import SAVE_ALL
from sac_compile.testing.baselines import Checkpointed

_HOOKS = torch._C._autograd  # saved-tensor hook stack (what saved_tensors_hooks pushes and pops)


class SkipBody(nn.Module):
    """``layer`` under a non-reentrant checkpoint whose modules ``names`` skip their body in
    the recompute (see the module docstring)."""

    def __init__(self, layer: nn.Module, names: list[str]) -> None:
        super().__init__()
        self.layer = layer
        self.names = names

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # transformers reads attributes of its layers
            return getattr(self._modules["layer"], name)

    def forward(self, *args, **kwargs):
        modules = [self.layer.get_submodule(n) for n in self.names]
        kept: dict[int, list] = {id(m): [] for m in modules}
        passes = []

        def body(module, forward: bool):
            run = type(module).forward.__get__(module)

            def call(*a, **k):
                if not forward:  # recompute: hand back the forward's outputs
                    return tree_map(_serve, kept[id(module)].pop(0), is_leaf=_is_kept)
                top = _HOOKS._top_saved_tensors_default_hooks(False)
                _HOOKS._pop_saved_tensors_default_hooks()  # the checkpoint's own
                try:
                    out = run(*a, **k)
                finally:
                    _HOOKS._push_saved_tensors_default_hooks(*top)
                kept[id(module)].append(tree_map(_keep, out))
                return out

            return call

        def checkpointed(*a):
            forward = not passes
            passes.append(forward)
            for m in modules:
                m.forward = body(m, forward)
            try:
                return self.layer(*a, **kwargs)
            finally:
                for m in modules:
                    del m.forward

        return checkpoint(checkpointed, *args, use_reentrant=False)


class _Kept:
    __slots__ = ("requires_grad", "value")

    def __init__(self, t: torch.Tensor) -> None:
        self.value, self.requires_grad = t.detach(), t.requires_grad


def _keep(x):
    return _Kept(x) if isinstance(x, torch.Tensor) else x


def _is_kept(x) -> bool:
    return isinstance(x, _Kept)


def _serve(x):
    return x.value.detach().requires_grad_(x.requires_grad) if isinstance(x, _Kept) else x


def kept_modules(subject) -> list[str]:
    """The kept regions' module paths inside one layer (``layers.*.attn`` -> ``attn``)."""
    prefix = subject.layers + ".*."
    return [
        p[len(prefix) :]
        for p, name in subject.regions.items()
        if name in subject.keep and p.startswith(prefix)
    ]


def variants(subject) -> dict[str, nn.Module]:
    keep = "+".join(sorted(subject.keep))
    found = {
        "no checkpoint": subject.variant("none"),
        "full recompute": subject.variant("full"),
        f"engine keep={keep}": subject.variant("engine"),
        f"torch SAC keep={keep}": subject.variant("torch SAC"),
    }
    model = copy.deepcopy(subject.model)
    sc.SacConfig(
        layers=subject.layers + ".*", keep=subject.keep, regions=subject.regions, policy=SAVE_ALL
    ).apply(model)
    found[f"engine SAVE_ALL keep={keep}"] = model
    for how in ("torch SAC SAVE_ALL", "skip body"):
        model = copy.deepcopy(subject.model)
        layers = model.get_submodule(subject.layers)
        if how == "skip body":
            names = kept_modules(subject)
            for i, layer in enumerate(layers):
                layers[i] = SkipBody(layer, names)
        else:
            sc.declare_regions(model, subject.regions)
            for i, layer in enumerate(layers):
                layers[i] = Checkpointed(layer, subject.keep, policy=SAVE_ALL)
        found[f"{how} keep={keep}"] = model
    return found


def measure(subject, iters: int) -> None:
    models = variants(subject)
    grads, failed = {}, {}
    for name, model in list(models.items()):
        try:
            subject.step(model)
        except RuntimeError as e:  # PyTorch's SAC refuses in-place writes into what it cached
            failed[name] = str(e).splitlines()[0]
            del models[name]
            continue
        grads[name] = [p.grad for p in model.parameters()]
        model.zero_grad(set_to_none=True)
    ref = grads["no checkpoint"]
    held = {}
    for name, model in models.items():
        held[name] = sc.inspection.autograd_saved_bytes(subject.loss, model, exclude=list(model.parameters()))
        model.zero_grad(set_to_none=True)

    def run(model):
        subject.step(model)
        model.zero_grad(set_to_none=True)

    medians = interleaved_medians({n: functools.partial(run, m) for n, m in models.items()}, iters)
    base = medians["no checkpoint"]
    ratio = {n: t / base for n, t in medians.items()}
    print(f"\n{subject.name}, keep={'+'.join(sorted(subject.keep))}: median of {iters} interleaved steps")
    print(f"{'configuration':<34} {'step ms':>8} {'vs none':>8} {'held MiB':>10} {'max |dgrad|':>12}")
    for name in models:
        diff = max((a - b).abs().max().item() for a, b in zip(grads[name], ref, strict=True) if a is not None)
        print(
            f"{name:<34} {medians[name] * 1e3:8.1f} {ratio[name]:7.3f}x {held[name] / 2**20:10.3f} {diff:12.2e}"
        )
    for name, why in failed.items():
        print(f"{name:<34} fails: {why}")
    r = {name.split(" keep=")[0]: v for name, v in ratio.items()}
    full, skip = r["full recompute"], r["skip body"]
    print(f"skip body / full recompute {skip / full:.3f}; engine / full recompute {r['engine'] / full:.3f}")
    overheads = [("skip body", "torch SAC"), ("engine", "torch SAC")]
    overheads += [("skip body", "torch SAC SAVE_ALL"), ("engine SAVE_ALL", "torch SAC SAVE_ALL")]
    print(
        "overhead over no checkpoint: "
        + ", ".join(f"{a} / {b} {(r[a] - 1) / (r[b] - 1):.3f}" for a, b in overheads if a in r and b in r)
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="demo,qwen3-moe")
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args(argv)
    sizes = argparse.Namespace(
        demo_d=128,
        demo_layers=4,
        demo_seq=128,
        demo_batch=8,
        hf_layers=4,
        hf_hidden=256,
        hf_seq=256,
        hf_batch=4,
    )
    subjects = {
        "demo": lambda: _eager_models.demo(sizes),
        "llama": lambda: _eager_models.transformers_model(sizes, "llama"),
        "qwen3-moe": lambda: _eager_models.transformers_model(sizes, "qwen3-moe"),
    }
    torch.set_num_threads(2)
    for key in args.models.split(","):
        measure(subjects[key](), args.iters)


if __name__ == "__main__":
    main()
