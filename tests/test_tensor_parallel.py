"""DTensor tensor parallelism on two gloo ranks: a Llama-style stack sharded as torchtitan
shards Llama (``sac_compile.testing.tp``), every block wrapped by the seam.

Each keep set against the same sharded model without checkpointing: gradients equal (the
full gradients, all-gathered), and the bytes each rank holds for the backward ordered full
recompute < each keep set < no checkpoint.
"""

from __future__ import annotations

import pytest
import torch

from sac_compile.testing.ranks import run_ranks

pytestmark = pytest.mark.distributed

KEEPS: list[tuple[str, ...] | None] = [None, (), ("attn",), ("mlp",), ("attn", "mlp")]


def _configurations(rank: int, world_size: int, compile: bool) -> dict:
    """Per keep set (None: no checkpoint): ``(loss difference, largest gradient difference,
    bytes held)``, the differences to no checkpoint (plain numbers: tensors do not outlive a
    rank's exit on their way back)."""
    from torch.distributed.device_mesh import init_device_mesh

    import sac_compile as sc
    from sac_compile.testing.tp import REGIONS, LlamaStack, parallelize

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(1)
    x = torch.randn(2, 16, 32)
    runs = {}
    for keep in KEEPS:
        torch.manual_seed(0)
        stack = parallelize(LlamaStack(n=2, d=32), mesh)
        sc.declare_regions(stack, REGIONS)
        if keep is not None:
            for layer in stack.layers:
                sc.apply_selective_checkpointing(
                    layer, keep=set(keep), compile={"inner": "aot_eager"} if compile else False
                )
        held = sc.autograd_saved_bytes(stack, x, exclude=list(stack.parameters()))
        stack.zero_grad()
        loss = stack(x).sum()
        loss.backward()
        # (the norms are not sharded: plain tensors)
        grads = {n: getattr(p.grad, "full_tensor", p.grad.clone)() for n, p in stack.named_parameters()}
        runs[keep] = (loss.detach(), grads, held)
    loss_ref, g_ref, _ = runs[None]
    return {
        keep: (
            abs(loss - loss_ref).item(),
            max((g[n] - g_ref[n]).abs().max().item() for n in g_ref),
            held,
        )
        for keep, (loss, g, held) in runs.items()
    }


def _check(results: list[dict]) -> None:
    for per_rank in results:
        none, full = per_rank[None][2], per_rank[()][2]
        for keep in KEEPS[1:]:
            loss_diff, grad_diff, held = per_rank[keep]
            assert loss_diff < 1e-4 and grad_diff < 1e-5, (keep, loss_diff, grad_diff)
            if keep:
                assert full < held < none, (keep, full, held, none)
        both = per_rank[("attn", "mlp")][2]
        assert max(per_rank[("attn",)][2], per_rank[("mlp",)][2]) < both


def test_tensor_parallel_eager_every_keep_set():
    """Red before: ``AttributeError: 'Tensor' object has no attribute 'placements'`` in
    ColwiseParallel's output hook (the engine tracked storages of plain tensors only, so it
    took a DTensor kept value for dead and handed a plain stand-in to the recompute)."""
    _check(run_ranks(_configurations, False, timeout=600))
