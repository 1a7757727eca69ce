"""Two gloo ranks on CPU: FSDP2 around the seam, and the rank harness itself.

Select with ``pytest -m distributed``; ``make test`` runs them.
"""

from __future__ import annotations

import time

import pytest
import torch

from .distributed import RankFailed, run_ranks

pytestmark = pytest.mark.distributed

STEPS = 2


def _fsdp2_vs_single_process(rank: int, world_size: int, keep: tuple[str, ...], compile: bool) -> dict:
    """``fully_shard`` on every layer (wrapped by the seam) and the root; SGD steps on a
    per-rank slice of the batch; compared with one process running the whole batch."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import sac_compile as sc
    from sac_compile.demo_models import Stack

    torch.manual_seed(0)
    ref = Stack(n=2, d=16, dropout=0.0)
    model = Stack(n=2, d=16, dropout=0.0)
    model.load_state_dict(ref.state_dict())
    for layer in model.layers:
        sc.apply_selective_checkpointing(
            layer, keep=set(keep), compile={"inner": "aot_eager"} if compile else False
        )
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    worst_loss = worst_grad = 0.0
    for _ in range(STEPS):
        x = torch.randn(4, 8, 16, generator=g)
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = model(x.chunk(world_size)[rank]).pow(2).mean()
        loss.backward()
        ref_loss = ref(x).pow(2).mean()
        ref_loss.backward()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        worst_loss = max(worst_loss, abs(mean_loss.item() / world_size - ref_loss.item()))
        for (name, p), (ref_name, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert name == ref_name, (name, ref_name)  # the seam and FSDP keep the paths
            worst_grad = max(worst_grad, (p.grad.full_tensor() - q.grad).abs().max().item())
        opt.step()
        ref_opt.step()
    layer_type = type(model.layers[0])
    return {
        "loss": worst_loss,
        "grad": worst_grad,
        "mro": [c.__name__ for c in layer_type.__mro__[:3]],
    }


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("keep", [(), ("attn",), ("attn", "mlp")], ids=["full", "attn", "attn+mlp"])
def test_fsdp2_outside_the_seam_matches_a_single_process(keep, compile):
    results = run_ranks(_fsdp2_vs_single_process, keep, compile)
    for r in results:
        assert r["loss"] < 1e-6 and r["grad"] < 1e-5, r
        # fully_shard's generated class wraps the seam's: FSDP is outermost
        assert r["mro"] == ["FSDPSelectiveCheckpointedBlock", "FSDPModule", "SelectiveCheckpointedBlock"]


def _raise_on_rank_one(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 would wait here forever


def _hang(rank: int, world_size: int) -> None:
    time.sleep(3600)


def test_a_rank_that_raises_fails_fast_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"(?s)rank 1 of 2 raised:.*ValueError: boom on rank one"):
        run_ranks(_raise_on_rank_one, timeout=120)
    assert time.monotonic() - start < 60  # not the timeout


def test_a_hanging_rank_ends_in_a_timeout():
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 did not finish within 15 s"):
        run_ranks(_hang, timeout=15)
