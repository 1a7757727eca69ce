"""Kernel rates by shape on one GPU: what the step-time model prices at one rate and the
validating runs say it should not (docs/planning.md, *Validating runs*).

* **Grouped expert GEMMs** (``torch._grouped_mm``, bf16, the experts' weights column-major as
  torchtitan stores them): each MoE model's projections (gate/up ``hidden -> expert width``,
  down back) at a range of tokens per expert, the three GEMMs a training step runs per
  projection (forward, input gradient, weight gradient), beside one dense ``mm`` of the same
  FLOPs. The runs that miss feed 384 and 1,536 tokens an expert (DeepSeek-V3 16B without
  expert parallelism), the ones that hold 12,288-24,576 (EP 8).
* **Attention by SDPA backend** (flash, memory-efficient, cuDNN; causal, bf16): a Llama-like
  head (query, key and value 128 wide) and DeepSeek-V3's MLA (queries and keys 192 wide,
  values 128: flash refuses it), forward and forward + backward.

Each figure is the median of ``--iters`` timed calls (CUDA events) after two warm-up calls, in
TFLOP/s of the useful FLOPs (``2 m k n`` a GEMM; causal attention half of ``2 s^2 (d_qk +
d_v)`` a head, forward, 2.5 times that backward). ``--json PATH`` writes the rows with the
device's name: the data a rate by shape in ``sac_compile/planning/world.json`` would be read
from. Sized to finish in about 3 minutes on one H100; ``tests/test_gpu_kernels_benchmark.py`` runs it
on a CPU at ``--scale 64`` (every size but the heads' widths divided by 64).

    python benchmarks/gpu_kernels.py [--device cuda] [--tokens 128,384,...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "examples", "configs")

#: (model config, experts a GEMM runs: all, or a rank's under the expert parallelism its
#: published runs used)
MOE_MODELS = (("deepseek_v3_16b", 64), ("qwen3_30b_a3b", 128), ("deepseek_v3", 8))


def _config(name: str) -> dict:
    with open(os.path.join(CONFIGS, f"{name}.json")) as f:
        return json.load(f)


def _scaled(size: int, scale: int) -> int:
    """``size / scale``, a multiple of 8 (a grouped GEMM's strides: multiples of 16 bytes)."""
    return size if scale == 1 else max(8, size // scale // 8 * 8)


def _expert_shapes(name: str, experts: int, scale: int) -> list[tuple[str, int, int, int]]:
    """``(projection, experts, k, n)`` of one MoE layer's routed experts."""
    c = _config(name)
    hidden, width = _scaled(c["hidden_size"], scale), _scaled(c["moe_intermediate_size"], scale)
    return [("gate/up", experts, hidden, width), ("down", experts, width, hidden)]


def _timer(device: torch.device, iters: int) -> Callable[[Callable[[], object]], float]:
    """Median seconds of ``fn()`` over ``iters`` calls after two warm-up calls."""

    def timed(fn: Callable[[], object]) -> float:
        for _ in range(2):
            fn()
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                begin = time.perf_counter()
                fn()
                times.append(time.perf_counter() - begin)
        return statistics.median(times)

    return timed


def _grouped_passes(
    timed: Callable, x: torch.Tensor, dy: torch.Tensor, w: torch.Tensor, offs: torch.Tensor
) -> dict:
    """Seconds of the three grouped GEMMs of one projection's training step, and of one dense
    ``mm`` of the same FLOPs."""
    dense = torch.randn(w.shape[1], w.shape[2], device=x.device, dtype=x.dtype)
    return {
        "forward": timed(lambda: torch._grouped_mm(x, w, offs=offs)),
        "input gradient": timed(lambda: torch._grouped_mm(dy, w.transpose(-2, -1), offs=offs)),
        "weight gradient": timed(lambda: torch._grouped_mm(x.t(), dy, offs=offs)),
        "dense mm": timed(lambda: torch.mm(x, dense)),
    }


def grouped_rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    timed, dtype, rows = _timer(device, args.iters), torch.bfloat16, []
    for name, experts in MOE_MODELS:
        for proj, e, k, n in _expert_shapes(name, experts, args.scale):
            for m in args.tokens:
                m = _scaled(m, args.scale)
                x = torch.randn(e * m, k, device=device, dtype=dtype)
                dy = torch.randn(e * m, n, device=device, dtype=dtype)
                w = torch.randn(e, n, k, device=device, dtype=dtype).transpose(-2, -1)  # (column-major)
                offs = torch.arange(m, e * m + 1, m, device=device, dtype=torch.int32)
                shape = {
                    "kind": "grouped_mm",
                    "model": name,
                    "projection": proj,
                    "experts": e,
                    "k": k,
                    "n": n,
                }
                for what, seconds in _grouped_passes(timed, x, dy, w, offs).items():
                    tflops = 2 * e * m * k * n / seconds / 1e12
                    rows.append(
                        shape | {"tokens_per_expert": m, "pass": what, "seconds": seconds, "tflops": tflops}
                    )
                del x, dy, w  # (before the next shape's: the largest take about 13 GB each)
    return rows


def _attention(timed: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: object) -> tuple:
    """Seconds of one causal SDPA call on ``backend``, forward and forward + backward."""
    from torch.nn.attention import sdpa_kernel

    def forward():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return timed(forward), timed(lambda: forward().sum().backward())


def attention_rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    from torch.nn.attention import SDPBackend

    timed, dtype, rows = _timer(device, args.iters), torch.bfloat16, []
    mla = _config("deepseek_v3_16b")
    heads = mla["num_attention_heads"]
    shapes = {
        "llama (q, k, v 128)": (32, 128, 128),
        "mla (q, k 192, v 128)": (
            heads,
            mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"],
            mla["v_head_dim"],
        ),
    }
    backends = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }
    seq = _scaled(args.seq, args.scale)
    for shape, (h, d_qk, d_v) in shapes.items():
        h = max(h // min(args.scale, h), 1)
        q, key = (
            torch.randn(1, h, seq, d_qk, device=device, dtype=dtype, requires_grad=True) for _ in range(2)
        )
        v = torch.randn(1, h, seq, d_v, device=device, dtype=dtype, requires_grad=True)
        forward_flops = h * seq * seq * (d_qk + d_v)  # (causal: half of 2 s^2 (d_qk + d_v) a head)
        for backend, which in backends.items():
            if which is SDPBackend.MATH and device.type == "cuda":
                continue  # (the reference, not a kernel a trainer runs on a GPU)
            row = {
                "kind": "sdpa",
                "shape": shape,
                "heads": h,
                "seq": seq,
                "d_qk": d_qk,
                "d_v": d_v,
                "backend": backend,
            }
            try:
                ahead, whole = _attention(timed, q, key, v, which)
            except RuntimeError as e:  # (a backend that refuses the shape: "No available kernel")
                rows.append(row | {"refused": str(e).splitlines()[0][:120]})
                continue
            rows.append(
                row
                | {"forward_tflops": forward_flops / ahead / 1e12}
                | {"forward_backward_tflops": 3.5 * forward_flops / whole / 1e12}
            )
    return rows


def _print(rows: list[dict], device_name: str) -> None:
    print(f"kernel rates on {device_name} (TFLOP/s, median)")
    print(
        f"{'model':<16}{'projection':<10}{'experts':>8}{'k x n':>12}{'tokens/expert':>15}  pass             TFLOP/s"
    )
    for r in rows:
        if r["kind"] == "grouped_mm":
            kn = f"{r['k']}x{r['n']}"
            print(
                f"{r['model']:<16}{r['projection']:<10}{r['experts']:>8}{kn:>12}"
                f"{r['tokens_per_expert']:>15}  {r['pass']:<16}{r['tflops']:>8.1f}"
            )
    print(f"\n{'attention':<24}{'backend':<11}{'forward':>9}{'fwd + bwd':>11}")
    for r in rows:
        if r["kind"] == "sdpa":
            if "refused" in r:
                print(f"{r['shape']:<24}{r['backend']:<11}  refused: {r['refused']}")
            else:
                print(
                    f"{r['shape']:<24}{r['backend']:<11}{r['forward_tflops']:>9.1f}{r['forward_backward_tflops']:>11.1f}"
                )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", default="128,384,1536,6144,24576", help="tokens per expert")
    parser.add_argument("--seq", type=int, default=4096, help="attention's sequence")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument(
        "--scale", type=int, default=1, help="divide every dimension by this (a CPU smoke run)"
    )
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    try:
        args.tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        parser.error(f"--tokens {args.tokens!r}: comma-separated positive integers, e.g. 384,1536")
    if min(args.tokens) < 1 or args.iters < 1 or args.scale < 1 or args.seq < 1:
        parser.error("--tokens, --iters, --scale and --seq take positive integers")
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = grouped_rows(args, device) + attention_rows(args, device)
    _print(rows, name)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
