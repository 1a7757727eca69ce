"""Context parallelism: the planner's step peak beside each rank's, PyTorch's ring attention on
two gloo ranks (the harness of ``tests/test_context_parallel.py``: ``context_parallel`` with the
CPU's flash kernel standing in for CUDA's, a 4-layer Llama, hidden 128, vocabulary 512, batch 2
x 1024 tokens split over the ranks, FSDP2 over the same ranks, torchtitan's loss), eager (no
checkpoint, full recompute) and each layer compiled with ``aot_eager`` (no checkpoint), float32
and bfloat16; and each layer compiled by the seam (full recompute, attention kept, both kept;
FSDP2 on a module around each layer), float32.

    python benchmarks/context_parallel.py
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    sys.path.insert(0, ROOT)
    from sac_compile import hf
    from sac_compile.planning.devices import Target
    from sac_compile.testing.ranks import run_ranks
    from tests.test_context_parallel import CP_BATCH, CP_SEQ, _cp_llama, _cp_seam_peaks, _cp_step_peaks

    print("| dtype | layers | keep | predicted B | rank 0 B | rank 1 B | predicted / measured |")
    print("|---|---|---|---:|---:|---:|---|")
    for dtype in ("float32", "bfloat16"):
        target = Target(
            "cpu", cp=2, param_dtype=dtype, master_dtype=dtype, batch=CP_BATCH, seq=CP_SEQ, loss="torchtitan"
        )
        figures = hf.step_figures(_cp_llama(dtype), target)
        for compile in (False, True):
            measured = run_ranks(_cp_step_peaks, dtype, compile)
            for keep in (None,) if compile else (None, ()):
                predicted = figures.peak(keep, compile=compile).bytes
                peaks = [r[str(keep)]["peak"] for r in measured]
                ratios = " / ".join(f"{predicted / p:.3f}" for p in peaks)
                name = "none" if keep is None else "{} (full)"
                layers = "compiled" if compile else "eager"
                print(
                    f"| {dtype} | {layers} | {name} | {predicted:,} | {peaks[0]:,} | {peaks[1]:,} | {ratios} |"
                )
        if dtype != "float32":
            continue
        for keep in ((), ("attn",), ("attn", "mlp")):
            predicted = figures.peak(keep, compile=True).bytes
            peaks = [r["peak"] for r in run_ranks(_cp_seam_peaks, dtype, keep)]
            ratios = " / ".join(f"{predicted / p:.3f}" for p in peaks)
            name = "+".join(keep) or "{} (full)"
            print(
                f"| {dtype} | the seam, compiled | {name} | {predicted:,} | {peaks[0]:,} | {peaks[1]:,} | {ratios} |"
            )


if __name__ == "__main__":
    main()
