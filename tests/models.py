"""Small models for the tests: an MLP, attention, a pre-norm transformer block, stacks."""

from __future__ import annotations

import gc

import torch
import torch.nn as nn

import sac_compile as sc
from sac_compile.testing.models import Attention, Block, ScopedStack, Stack

__all__ = [
    "MLP",
    "Attention",
    "Block",
    "ScopedStack",
    "Stack",
    "bit_identical",
    "grads",
    "lm_step",
    "meta_llama",
    "net_forward_bytes",
    "run_step",
]


class MLP(nn.Module):
    def __init__(self, d: int = 8, marked: bool = True, dropout: float = 0.0) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)
        self.marked = marked

    def body(self, h: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(torch.relu(h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.marked:
            with sc.region("mlp"):
                h = self.body(h)
        else:
            h = self.body(h)
        return h.sin()


def grads(module: nn.Module, *inputs: torch.Tensor) -> list[torch.Tensor]:
    return [p.grad for p in module.parameters()] + [t.grad for t in inputs if t.requires_grad]


def run_step(fn, module: nn.Module, *inputs: torch.Tensor):
    """Forward + backward of sum(fn(*inputs)); returns (output, grads) and clears grads."""
    module.zero_grad(set_to_none=True)
    for t in inputs:
        t.grad = None
    out = fn(*inputs)
    out.sum().backward()
    g = [None if t is None else t.clone() for t in grads(module, *inputs)]
    return out.detach(), g


def lm_step(model: nn.Module, ids: torch.Tensor):
    """One training step of a transformers causal LM on ``ids`` (as labels too): ``(loss,
    {parameter name: gradient})``, names as the unwrapped model has them."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    named = getattr(model, "_orig_mod", model).named_parameters()
    return loss.detach(), {n: p.grad.clone() for n, p in named if p.grad is not None}


def bit_identical(a, b) -> bool:
    """Whether two ``lm_step`` results (loss, {name: gradient}) are equal bit for bit."""
    (la, ga), (lb, gb) = a, b
    return torch.equal(la, lb) and ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga)


def net_forward_bytes(fn) -> int:
    """Net CPU bytes ``fn()`` allocates and still holds when it returns (profiler accounting):
    what the forward leaves for the backward, the same measure for eager and compiled code.

    The cyclic garbage collector is run before and held off during the measurement: a
    collection inside it frees earlier tests' tensors, which the profiler counts as negative
    allocations (seen in full-suite runs: a model measured at 40% of its real figure)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    gc.collect()
    gc.disable()
    try:
        with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
            out = fn()
        del out
    finally:
        gc.enable()
    return sum(e.self_cpu_memory_usage for e in prof.events())


def meta_llama(seq_heads: int = 8) -> nn.Module:
    """A 4-layer Llama (hidden 1024, 8 query heads by default) on the meta device, training mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=4096,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=seq_heads,
        num_key_value_heads=2,
        use_cache=False,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(cfg).train()
