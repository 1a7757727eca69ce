"""PyTorch only (no sac_compile): torch 2.13's AOTAutograd fails a tensor-parallel block under
``torch.utils.checkpoint`` + ``torch.compile``; torch 2.14.1 and 2.15 run it.

A Llama-style block (RMSNorm, SDPA attention with separate q/k/v/o, SwiGLU), sharded as
torchtitan shards Llama (ColwiseParallel q/k/v and w1/w3, RowwiseParallel o and w2), on a
one-rank gloo mesh; the whole block checkpointed (full recompute, as torchtitan's full AC):

    torch 2.13.0: AssertionError: expected all tensors_saved_with_vc_check to be Tensors, got
                  types: [..., <class 'torch.distributed.device_mesh.DeviceMesh'>]
    torch 2.14.1, 2.15.0: ok

The partitioner saves the DeviceMesh (an opaque graph input) for the backward when the
recomputed attention needs it, and 2.13's runtime counts it among the saved tensors. Without
the checkpoint, or with the attention's values saved rather than recomputed, it runs.

    python examples/repros/tp_checkpoint_compile.py
"""

import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, d: int = 32, head_dim: int = 8) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.attention_norm, self.ffn_norm = nn.RMSNorm(d), nn.RMSNorm(d)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False)
        self.w2 = nn.Linear(2 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attention_norm(x)
        q, k, v = (w(h).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(o.transpose(1, 2).reshape(b, t, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def main() -> None:
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/pg", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    plan = {n: ColwiseParallel() for n in ("wq", "wk", "wv", "w1", "w3")}
    plan.update({n: RowwiseParallel() for n in ("wo", "w2")})
    block = parallelize_module(Block(), mesh, plan)
    x = torch.randn(2, 16, 32)
    step = torch.compile(lambda x: checkpoint(block, x, use_reentrant=False), backend="aot_eager")
    try:
        step(x).sum().backward()
        print(f"torch {torch.__version__}: ok")
    except AssertionError as e:
        print(f"torch {torch.__version__}: AssertionError: {str(e)[:200]}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
