"""The ways a transformers user switches checkpointing on, side by side, default configs.

Per model (a dense Llama and a Qwen3-MoE, tiny random configs with transformers' defaults,
``use_cache=True`` included; batch 2 x seq 64, CPU fp32):

* no checkpoint, and transformers' own activation checkpointing (full recompute);
* transformers' own switch carrying sac-compile's kwargs
  (``model.activation_checkpointing_enable(activation_checkpointing_kwargs=
  hf.checkpointing_kwargs(model, keep=...))``, what ``TrainingArguments(
  activation_checkpointing=True, activation_checkpointing_kwargs=...)`` calls);
* the seam (``hf.config_for(model, keep=...).apply(model)``).

Eager: bytes held for the backward after the forward (``autograd_saved_bytes``, parameters
excluded), whether loss and gradients are bit-identical to transformers' own checkpointing,
and the step time as a ratio to no checkpoint (interleaved medians). Compiled (the whole
model with the sac backend, ``aot_eager`` inner: no codegen; the regions kept are the same
with Inductor): bytes and the largest gradient difference to transformers' own checkpointing.

    python benchmarks/integrations.py [--iters 15] [--seq 64]
"""

from __future__ import annotations

import argparse
import logging
import warnings

import torch
from _timing import interleaved_medians

import sac_compile as sc
from sac_compile import hf


def _config(name: str):
    import transformers

    common = dict(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=256,
    )
    if name == "llama":
        return transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    cfg = transformers.Qwen3MoeConfig(
        **common, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2
    )
    return cfg, transformers.Qwen3MoeForCausalLM


def build(name: str, route: str, keep=None):
    cfg, cls = _config(name)
    assert cfg.use_cache is True  # the default config
    torch.manual_seed(0)
    model = cls._from_config(cfg, attn_implementation="sdpa").train()
    if route == "own":
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif route == "switch":
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=hf.checkpointing_kwargs(model, keep)
        )
    elif route == "seam":
        hf.config_for(model, keep=keep).apply(model)
    return model


def step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    root = getattr(model, "_orig_mod", model)
    return loss.detach(), {n: p.grad.clone() for n, p in root.named_parameters() if p.grad is not None}


def held(model, ids) -> int:
    return sc.inspection.autograd_saved_bytes(
        lambda: model(input_ids=ids, labels=ids).loss, exclude=model.parameters()
    )


ROUTES = [
    ("no checkpoint", "none", None),
    ("transformers' own checkpointing", "own", None),
    ("switch + kwargs, keep attn", "switch", {"attn"}),
    ("switch + kwargs, every region", "switch", sc.ALL_REGIONS),
    ("seam (config_for), keep attn", "seam", {"attn"}),
    ("seam (config_for), every region", "seam", sc.ALL_REGIONS),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("sac_compile").setLevel(logging.ERROR)  # the one-time cache notes
    import transformers

    transformers.logging.set_verbosity_error()
    ids = torch.randint(0, 128, (2, args.seq), generator=torch.Generator().manual_seed(1))
    for name in ("llama", "qwen3-moe"):
        models = {label: build(name, route, keep) for label, route, keep in ROUTES}
        own = step(models["transformers' own checkpointing"], ids)
        times = interleaved_medians({k: (lambda m=m: step(m, ids)) for k, m in models.items()}, args.iters)
        base = held(models["no checkpoint"], ids)
        print(f"\n{name}: eager (step: ratio to no checkpoint, median of {args.iters} interleaved)")
        print(f"  {'configuration':34s} {'held B':>10s} {'vs none':>8s} {'= own ckpt':>10s} {'step':>6s}")
        for label, model in models.items():
            loss, grads = step(model, ids)
            same = torch.equal(loss, own[0]) and all(torch.equal(grads[k], own[1][k]) for k in own[1])
            b = held(model, ids)
            ratio = times[label] / times["no checkpoint"]
            print(f"  {label:34s} {b:10,d} {b / base:8.2f} {str(same):>10s} {ratio:5.2f}x")
        print(f"{name}: compiled whole model (sac backend, aot_eager)")
        backend = sc.make_sac_backend(sc.ALL_REGIONS, inner="aot_eager")
        base = None  # the compiled no-checkpoint bytes
        for label, route, keep in ROUTES:
            torch._dynamo.reset()
            if route == "none":
                model = torch.compile(build(name, route), backend=sc.compiler.baseline_backend("aot_eager"))
            else:
                model = torch.compile(build(name, route, keep), backend=backend)
            step(model, ids)
            _, grads = step(model, ids)
            diff = max((grads[k] - own[1][k]).abs().max().item() for k in own[1])
            b = held(model, ids)
            base = base or b
            print(f"  {label:34s} {b:10,d} {b / base:8.2f}  max |grad - own| {diff:.1e}")


if __name__ == "__main__":
    main()
