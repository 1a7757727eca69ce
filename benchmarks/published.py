"""The device planner beside training runs others measured and published: predicted peak
memory and tokens/s per GPU against the published figures, with ratios.

Each run is planned as ``python -m sac_compile plan`` plans it (the model from its
``config.json`` on the meta device, one layer of each kind traced with the target's kernels),
then ``DevicePlan.configuration`` predicts the run's own activation checkpointing (no AC,
full AC, or torchtitan's per-op SAC: ``planning.op_sac``) on the run's layout. One
measurement per config and ``Target.measured`` (a GPU's kernels, dtype, traced shape,
``repeat_kv``, ``offload``) serves every run that shares them, eager or compiled, on any GPU.
Every run's trainer repeated grouped keys and values before attention (``Target.repeat_kv``:
torchtitan's Llama did until 2026-01), and each is planned so.

Published memory is the allocator's max *reserved* (torchtitan's tables) or what the source
names; float8 runs (``float8`` column) convert their linear layers and are planned as the bf16
model (``benchmarks/float8_layers.py`` shows what float8 changes): their memory is compared,
their tokens/s is not. A run marked ``calibrates``
set its device's ``efficiency`` or ``EAGER_SLOWDOWN`` (``planning.catalog``): its tokens/s
ratio is 1 by construction and checks nothing. A run published as out of memory (``oom``)
checks that the prediction exceeds the device's memory. A run marked ``validates`` was found
after the device model was built and tuned nothing: the claim is those runs' figures (the
summary line under the table); ``rank`` names the pipeline rank whose memory a source logs.

    python benchmarks/published.py [--match REGEX] [--json PATH] [--calibrate]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "examples", "configs")

TT_2412 = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TT_ASYNC = "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
TT_TRAINY = "torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md"
AO_MX = "torchao prototype/mx_formats README (torchtitan components/quantization/mxfp8.md), dense models"
# torchtitan's DeepSeek-V3 16B flavor (torchtitan/models/deepseek_v3/__init__.py, train config
# deepseek_v3_16b.toml at 8a2686c: SDPA, per-op SAC, the loss compiled), 8 H100 80GB HBM3,
# logged at step 20: "memory: 73.32GiB(92.70%) tps: 11,758"; the local batch lowered from 8 to
# an unstated value: 4 by the log's step time (1.394 s x 11,758 tps = 16,390 tokens = 4 x 4096),
# the default the fix of the issue set
# torchtitan's llama3_8b.toml at the PR (batch 1, seq 8192, per-op SAC, FSDP 8 on one node) run with
# --training.compile on 8 H100s of 95 GiB (47.65 GiB = 50.16%: the 96 GB HBM2e part), the loss
# eager; each logged at step 20-30: "memory: 47.65GiB(50.16%) tps: 5,760" (bf16), "47.77GiB ...
# 6,468" (float8 rowwise), "47.32GiB ... 7,186" (float8 tensorwise, float8 all-gather)
TT_808 = "github.com/pytorch/torchtitan/pull/808 (2025-01-27): Llama 3 8B, 8 H100s, FSDP 8, batch 1, per-op SAC, compiled"
# torchao's float8 TP fix, checked in torchtitan with llama3_8b.toml (batch 1, seq 8192, per-op SAC)
# on 8 H100s of 95 GiB with --training.tensor_parallel_degree 2 --training.compile (FSDP 4 x TP
# 2), the loss eager; logged at step 40: "memory: 35.56GiB(37.43%) tps: 1,669 mfu: 9.77%"
# (bf16), "35.57GiB ... tps: 2,141" (float8 tensorwise)
AO_1718 = "github.com/pytorch/ao/pull/1718 (2025-02-14): Llama 3 8B, 8 H100s, FSDP 4 x TP 2, batch 1, per-op SAC, compiled"
# the same torchao float8 maintainer's vanilla-TP report three months after AO_1718: torchtitan's
# llama3_8b.toml of the time (batch 1, seq 8192, per-op SAC) on 4 H100s with FSDP 2 x TP 2, torch
# 2.8.0a0 (compiled, as torchtitan's float8 docs of the time require; the loss compiled with the
# model since 2025-04): "bf16: 5378 TPS, 45.68 GiB peak memory", "float8 rowwise: 5189 TPS, 45.67 GiB"
TT_1207 = "github.com/pytorch/torchtitan/issues/1207 (2025-05-20): Llama 3 8B, 4 H100s, FSDP 2 x TP 2, batch 1, per-op SAC, compiled"
# torchtitan's llama3_8b.toml at the PR (batch 1, seq 8192; compile off: layers and loss eager) run on
# 4 H100s of 95 GiB (44.84 GiB = 47.19%) with --model.flavor 8B_flex_attn (FlexAttention, compiled
# on its own) --activation_checkpoint.mode full --parallelism.context_parallel_degree 2 (FSDP 2 x
# CP 2, parameters sharded 4 ways); logged at step 10: "memory: 44.84GiB(47.19%) tps: 5,615
# tflops: 325.20 mfu: 32.88%" (tps per GPU: 8,192 tokens / 2 CP ranks a step)
TT_1884 = "github.com/pytorch/torchtitan/pull/1884 (2025-10-15): Llama 3 8B, 4 H100s, FSDP 2 x CP 2, batch 1, full AC, eager, FlexAttention"
# torchtitan's docs/performance.md as of 2024-08-22 (#554, #556): Llama 3.1 405B on 128 H100s of 95
# GB (HBM2e, lower TDP), FSDP 16 x TP 8, llama3_405b.toml of the time (batch 2 x 8192, full AC,
# compile off, loss parallel on): "109 WPS, 29.0% MFU" (bf16; the float8 rows: tokens/s only);
# and (1ea476e, 2024-04-24) Llama 3 8B / 70B on 64 A100s of 80 GB, FSDP 64, batch 1 x 8192, compile
# off: 8B per-op SAC (the every-second-mm policy of 0.3.0) 2,973 WPS, 70B full AC 331 WPS; Llama 2
# (llama2_13b.toml / llama2_70b.toml of the time: seq 4096) 13B batch 2 no AC 2,162 WPS, per-op
# SAC 1,904; 70B batch 1 per-op SAC 355, batch 2 full AC 353
TT_PERF = "torchtitan docs/performance.md"
# torchtitan issue #773 (H-Huang, 2025-01-13, logs of 2025-01-10): Llama 3 8B on 8 H100s (79.1 GiB: 22.74 GiB =
# 28.73%), PP 8 alone, local batch 16 x seq 512, torchtitan's defaults of the time (two stages a rank, as many
# microbatches as stages: 16 of 1), compile off (zero bubble refused it): "interleaved 1f1b [rank0] memory:
# 22.74GiB(28.73%) tps: 304 / [rank7] memory: 17.97GiB(22.71%)", "interleaved zero bubble [rank0] 20.57GiB ...
# tps: 339 / [rank7] 22.23GiB", "With full AC ... interleaved 1f1b [rank0] memory: 15.86GiB(20.04%) tps: 243";
# the issue's description (tianyu-l, 2025-01-03): 405B at Table 5's layout, "Interleaved Zero Bubble: memory:
# 89.73GiB(94.45%) tps: 13" (no compile, async TP or float8; the tokens/s a bug of the time: not compared)
TT_773 = "github.com/pytorch/torchtitan/issues/773 (2025-01): pipeline schedules, Llama 3 8B PP 8 and 405B"
# torchtitan PR #1616 (2025-08-21 log): DeepSeek-V3 16B (vocab 102400) on 8 H100s of 95 GiB, mesh [pp 4, dp_shard
# 2], "Using pipeline schedule Interleaved1F1B with 8 microbatches and 8 stages", full AC, local batch 8 x 4096,
# FlexAttention; rank 6 (pipeline rank 3) "step: 20 ... memory: 67.11GiB(70.64%) tps: 5,165" (steps 10-100:
# 4,837-5,165, 5,048 at 100)
TT_1616 = "github.com/pytorch/torchtitan/pull/1616 (2025-08-21): DeepSeek-V3 16B, 8 H100s, FSDP 2 x PP 4 interleaved, full AC"
# torchtitan PR #1610 (2025-08-20 logs): DeepSeek-V3 16B, deepseek_v3_16b.toml of the time (batch 8 x 4096,
# per-op SAC, the loss compiled) with --parallelism.expert_parallel_degree=8 on 8 H100s of 95 GiB, FlexAttention:
# "step: 100 ... memory: 78.14GiB(82.25%) tps: 8,667"
TT_1610 = (
    "github.com/pytorch/torchtitan/pull/1610 (2025-08-20): DeepSeek-V3 16B, 8 H100s, FSDP 8, EP 8, per-op SAC"
)
# torchtitan PR #1513 (2025-07-31 log): DeepSeek-V3 16B of the time (vocab 129280), deepseek_v3_16b.toml (batch 8 x
# 4096, full AC, compile off, SDPA) with --parallelism.context-parallel-degree 2: mesh [dp_shard 4, cp 2] on 8
# H100s of 95 GiB, "step: 20 ... memory: 71.08GiB(74.82%) tps: 6,037"
TT_1513 = (
    "github.com/pytorch/torchtitan/pull/1513 (2025-07-31): DeepSeek-V3 16B, 8 H100s, FSDP 4 x CP 2, full AC"
)
# torchtitan PR #1690 (2025-09 logs): Qwen3 32B on H100s of 95 GiB, qwen3_32b.toml (seq 4096, full AC, compile off)
# at several layouts and local batches: "fsdp 4, tp 8 ... memory: 43.45GiB(45.73%) tps: 876" (batch 16), "70.79GiB
# ... tps: 883" (batch 32), "Fsdp8, tp 8 ... 63.27GiB(66.60%) tps: 873" (batch 32), "FSDP 8 ... 81.47GiB(85.76%)
# tps: 1,444" (batch 1), "89.33GiB(94.04%) tps: 1,614" (batch 2), compiled (model and loss) "81.85GiB(86.17%)
# tps: 1,874" (batch 2), "FSDP 16 ... 78.48GiB(82.54%) tps: 1,518" (batch 4)
TT_1690 = "github.com/pytorch/torchtitan/pull/1690 (2025-09): Qwen3 32B, H100s, FSDP / FSDP x TP 8, full AC"
# torchtitan PR #2107 (2025-12, "Integrate DeepEP"): DeepSeek-V3 671B on 512 H100 80GB (64 nodes), the full
# command line given: dp_shard 64, pp 8 Interleaved1F1B (two stages a rank), ep 32, full AC, compile (model
# and loss), local batch 16 x 4096, FlexAttention, forced balanced routing; "Before" (PyTorch's all-to-all):
# "memory: 60.18GiB(76.07%) tps: 346" (with DeepEP 56.75 GiB and 579 tps: another dispatcher, not compared)
TT_2107 = "github.com/pytorch/torchtitan/pull/2107 (2025-12): DeepSeek-V3 671B, 512 H100s, FSDP 64 x PP 8 interleaved x EP 32"
# torchtitan's branch autoresearch-parallelize/may19-qwen3-14b (an automated tuning sweep, commits 911fd8e and
# fd30b5c, 2026-05-19; outputs/autoresearch/may19-qwen3-14b/run{55,46}-*/run.log): Qwen3 14B ("14,768,307,200
# total parameters") on 8 B200s ("NVIDIA B200 with 178.35GiB memory"), compile per TransformerBlock and the
# loss (ChunkedCELoss), bf16, FlexAttention, seq 4096, no activation checkpointing (the config's mode="full"
# is never applied by the branch's parallelize_qwen3: no "Applied ... activation checkpointing" line);
# run 55, --parallelism.context_parallel_degree=2 (load balancer ptrr) at local batch 10, mesh "dp_shard=4,
# cp=2": "step: 10 ... memory: 170.21GiB(95.44%) tps: 4,531" (9 allocation retries; discarded for its loss,
# 12.3 -> 17.0: the compute and memory stand); run 46, "dp_shard=8, cp=1" at local batch 5: "step: 10 ...
# memory: 168.96GiB(94.73%) tps: 8,489". Keys and values not repeated (torchtitan stopped in 2026-01).
TT_QWEN14 = "github.com/pytorch/torchtitan branch autoresearch-parallelize/may19-qwen3-14b (2026-05-19): Qwen3 14B, 8 B200s, FSDP 8 / FSDP 4 x CP 2, no AC, compiled"
TT_DSV3_16B = "github.com/pytorch/torchtitan/issues/1789 (2025-10-02): DeepSeek-V3 16B, 8 H100s, FSDP 8, EP 8, per-op SAC"


@dataclass(frozen=True)
class Run:
    name: str
    config: str  # examples/configs/<config>.json
    device: str
    batch: int
    seq: int
    ac: str  # none, full, torchtitan-op
    published_gib: float | None  # max reserved, GiB
    published_tps: float | None  # tokens/s per GPU
    source: str
    fsdp: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    pp_schedule: str = "1f1b"
    microbatch_size: int = 1  # torchtitan's default until 2025 was pp microbatches: batch / pp
    compile: bool = True
    float8: bool = False
    calibrates: bool = False
    loss: str = "torchtitan"  # torchtitan compiles its loss with the model since 2025-04: "compiled"
    memory_unit: float = 2**30  # the published memory's unit
    oom: bool = False  # published as running out of memory: the prediction must exceed the device's
    # torchtitan's Llama repeated grouped keys and values to the query's heads before SDPA
    # until github.com/pytorch/torchtitan/pull/2259 (2026-01-27): every run here (Target.repeat_kv;
    # nothing to repeat in Llama 2 13B or DeepSeek-V3's MLA)
    repeat_kv: bool = True
    # the pipeline rank whose memory the source logs (None: the largest of them)
    rank: int | None = None
    pp_virtual_stages: int | None = None
    async_tp: bool = False  # torchtitan's --parallelism.enable_async_tensor_parallel
    # validating: found and added after the device model was built, never tuned to (the
    # claim); the rest were in view while it was built (and those marked calibrates set a
    # constant)
    validates: bool = False


RUNS = (
    Run(
        "8B FSDP 8, SAC, eager",
        "llama3_8b",
        "h100-96gb",
        2,
        8192,
        "torchtitan-op",
        82.4,
        5762,
        TT_2412 + " Table 1",
        fsdp=8,
        compile=False,
        calibrates=True,  # (EAGER_SLOWDOWN)
    ),
    Run(
        "8B FSDP 8, SAC",
        "llama3_8b",
        "h100-96gb",
        2,
        8192,
        "torchtitan-op",
        77.0,
        6667,
        TT_2412 + " Table 1",
        fsdp=8,
        calibrates=True,
    ),
    Run(
        "8B FSDP 128, SAC, eager",
        "llama3_8b",
        "h100-96gb",
        2,
        8192,
        "torchtitan-op",
        67.0,
        5605,
        TT_2412 + " Table 3",
        fsdp=128,
        compile=False,
    ),
    Run(
        "8B FSDP 128, SAC",
        "llama3_8b",
        "h100-96gb",
        2,
        8192,
        "torchtitan-op",
        62.0,
        6514,
        TT_2412 + " Table 3",
        fsdp=128,
    ),
    Run(
        "8B FSDP 8, batch 1, SAC",
        "llama3_8b",
        "h100-96gb",
        1,
        8192,
        "torchtitan-op",
        47.65,
        5760,
        TT_808 + " (bf16)",
        fsdp=8,
    ),
    Run(
        "8B FSDP 8, batch 1, SAC, float8 rowwise",
        "llama3_8b",
        "h100-96gb",
        1,
        8192,
        "torchtitan-op",
        47.77,
        6468,
        TT_808 + " (float8 rowwise)",
        fsdp=8,
        float8=True,
    ),
    Run(
        "8B FSDP 8, batch 1, SAC, float8 tensorwise",
        "llama3_8b",
        "h100-96gb",
        1,
        8192,
        "torchtitan-op",
        47.32,
        7186,
        TT_808 + " (float8 tensorwise, float8 all-gather)",
        fsdp=8,
        float8=True,
    ),
    Run(
        "8B FSDP 4 x TP 2, batch 1, SAC",
        "llama3_8b",
        "h100-96gb",
        1,
        8192,
        "torchtitan-op",
        35.56,
        1669,
        AO_1718 + " (bf16)",
        fsdp=4,
        tp=2,
    ),
    Run(
        "8B FSDP 4 x TP 2, batch 1, SAC, float8",
        "llama3_8b",
        "h100-96gb",
        1,
        8192,
        "torchtitan-op",
        35.57,
        2141,
        AO_1718 + " (float8 tensorwise)",
        fsdp=4,
        tp=2,
        float8=True,
    ),
    Run(
        "8B FSDP 2 x TP 2, batch 1, SAC",
        "llama3_8b",
        "h100-96gb",
        1,
        8192,
        "torchtitan-op",
        45.68,
        5378,
        TT_1207 + " (bf16)",
        fsdp=2,
        tp=2,
        loss="compiled",
    ),
    Run(
        "8B FSDP 2 x TP 2, batch 1, SAC, float8 rowwise",
        "llama3_8b",
        "h100-96gb",
        1,
        8192,
        "torchtitan-op",
        45.67,
        5189,
        TT_1207 + " (float8 rowwise)",
        fsdp=2,
        tp=2,
        loss="compiled",
        float8=True,
    ),
    Run(
        "8B FSDP 8 x TP 8, SAC",
        "llama3_8b",
        "h100-96gb",
        12,
        8192,
        "torchtitan-op",
        None,
        4378,
        TT_ASYNC + " (vanilla TP, bf16)",
        fsdp=8,
        tp=8,
        loss="compiled",
    ),
    Run(
        "70B FSDP 32 x TP 8, full AC",
        "llama3_70b",
        "h100-96gb",
        16,
        8192,
        "full",
        None,
        597.3,
        TT_ASYNC + " (vanilla TP, bf16)",
        fsdp=32,
        tp=8,
        loss="compiled",
    ),
    Run(
        "8B FSDP 8 x TP 8, SAC, async TP",
        "llama3_8b",
        "h100-96gb",
        12,
        8192,
        "torchtitan-op",
        None,
        4809.4,
        TT_ASYNC + " (async TP, bf16)",
        fsdp=8,
        tp=8,
        loss="compiled",
        async_tp=True,
    ),
    Run(
        "70B FSDP 32 x TP 8, full AC, async TP",
        "llama3_70b",
        "h100-96gb",
        16,
        8192,
        "full",
        None,
        652.4,
        TT_ASYNC + " (async TP, bf16)",
        fsdp=32,
        tp=8,
        loss="compiled",
        async_tp=True,
    ),
    Run(
        "70B FSDP 32 x TP 8, full AC, float8",
        "llama3_70b",
        "h100-96gb",
        16,
        8192,
        "full",
        71.9,
        829,
        TT_2412 + " Table 4",
        fsdp=32,
        tp=8,
        float8=True,
    ),
    Run(
        "8B FSDP 8, SAC (B200)",
        "llama3_8b",
        "b200",
        1,
        8192,
        "torchtitan-op",
        33.71,
        8307.5,
        AO_MX,
        fsdp=8,
        calibrates=True,
        loss="compiled",
    ),
    Run(
        "8B FSDP 2, CP 2, full AC, eager",
        "llama3_8b",
        "h100-96gb",
        1,
        8192,
        "full",
        44.84,
        5615,
        TT_1884,
        fsdp=2,
        cp=2,
        compile=False,
    ),
    Run(
        "405B FSDP 16 x TP 8, full AC, eager",
        "llama3_405b",
        "h100-96gb",
        2,
        8192,
        "full",
        None,
        109,
        TT_PERF + " (2024-08-22, bf16)",
        fsdp=16,
        tp=8,
        compile=False,
    ),
    Run(
        "405B FSDP 128, batch 1, full AC, eager",
        "llama3_405b",
        "h100-96gb",
        1,
        8192,
        "full",
        None,
        None,
        TT_PERF + " (2024-08-22: 1D runs out of memory at batch 1)",
        fsdp=128,
        compile=False,
        oom=True,
    ),
    Run(
        "8B FSDP 64, batch 1, SAC, eager (A100)",
        "llama3_8b",
        "a100-80gb",
        1,
        8192,
        "torchtitan-op",
        None,
        2973,
        TT_PERF + " (2024-04-24)",
        fsdp=64,
        compile=False,
        calibrates=True,
    ),
    Run(
        "70B FSDP 64, batch 1, full AC, eager (A100)",
        "llama3_70b",
        "a100-80gb",
        1,
        8192,
        "full",
        None,
        331,
        TT_PERF + " (2024-04-24)",
        fsdp=64,
        compile=False,
    ),
    Run(
        "Llama 2 13B FSDP 64, batch 2, no AC, eager (A100)",
        "llama2_13b",
        "a100-80gb",
        2,
        4096,
        "none",
        None,
        2162,
        TT_PERF + " (2024-04-24)",
        fsdp=64,
        compile=False,
    ),
    Run(
        "Llama 2 13B FSDP 64, batch 2, SAC, eager (A100)",
        "llama2_13b",
        "a100-80gb",
        2,
        4096,
        "torchtitan-op",
        None,
        1904,
        TT_PERF + " (2024-04-24)",
        fsdp=64,
        compile=False,
    ),
    Run(
        "Llama 2 70B FSDP 64, batch 1, SAC, eager (A100)",
        "llama2_70b",
        "a100-80gb",
        1,
        4096,
        "torchtitan-op",
        None,
        355,
        TT_PERF + " (2024-04-24)",
        fsdp=64,
        compile=False,
    ),
    Run(
        "Llama 2 70B FSDP 64, batch 2, SAC, eager (A100)",
        "llama2_70b",
        "a100-80gb",
        2,
        4096,
        "torchtitan-op",
        None,
        None,
        TT_PERF + " (2024-04-24: runs out of memory, footnote 3)",
        fsdp=64,
        compile=False,
        oom=True,
    ),
    Run(
        "Llama 2 70B FSDP 64, batch 2, full AC, eager (A100)",
        "llama2_70b",
        "a100-80gb",
        2,
        4096,
        "full",
        None,
        353,
        TT_PERF + " (2024-04-24)",
        fsdp=64,
        compile=False,
    ),
    Run(
        "8B FSDP 8, CP 1, full AC, float8",
        "llama3_8b",
        "h100-96gb",
        1,
        32768,
        "full",
        83.9,
        3890,
        TT_2412 + " Table 2",
        fsdp=8,
        float8=True,
    ),
    Run(
        "8B FSDP 4, CP 2, full AC, float8",
        "llama3_8b",
        "h100-96gb",
        1,
        65536,
        "full",
        84.2,
        2540,
        TT_2412 + " Table 2",
        fsdp=4,
        cp=2,
        float8=True,
    ),
    Run(
        "8B FSDP 2, CP 4, full AC, float8",
        "llama3_8b",
        "h100-96gb",
        1,
        131072,
        "full",
        84.0,
        1071,
        TT_2412 + " Table 2",
        fsdp=2,
        cp=4,
        float8=True,
    ),
    Run(
        "8B FSDP 1, CP 8, full AC, float8",
        "llama3_8b",
        "h100-96gb",
        1,
        262144,
        "full",
        84.5,
        548,
        TT_2412 + " Table 2",
        cp=8,
        float8=True,
    ),
    Run(
        "405B FSDP 8 x TP 8 x PP 8 1F1B, full AC, float8",
        "llama3_405b",
        "h100-96gb",
        32,
        8192,
        "full",
        82.5,
        100,
        TT_2412 + " Table 5",
        fsdp=8,
        tp=8,
        pp=8,
        microbatch_size=4,  # batch 32 in torchtitan's then-default 8 (= pp) microbatches
        float8=True,
    ),
    Run(
        "405B FSDP 8 x TP 8 x PP 8 interleaved, full AC, float8",
        "llama3_405b",
        "h100-96gb",
        32,
        8192,
        "full",
        72.7,
        128,
        TT_2412 + " Table 5",
        fsdp=8,
        tp=8,
        pp=8,
        pp_schedule="interleaved-1f1b",
        microbatch_size=4,  # batch 32 in torchtitan's then-default 8 (= pp) microbatches
        float8=True,
    ),
    Run(
        "405B FSDP 8 x TP 8 x PP 8, CP 1, full AC, float8",
        "llama3_405b",
        "h100-96gb",
        8,
        32768,
        "full",
        75.3,
        76,
        TT_2412 + " Table 6",
        fsdp=8,
        tp=8,
        pp=8,
        float8=True,
    ),
    Run(
        "405B FSDP 4 x TP 8 x PP 8, CP 2, full AC, float8",
        "llama3_405b",
        "h100-96gb",
        8,
        65536,
        "full",
        75.9,
        47,
        TT_2412 + " Table 6",
        fsdp=4,
        tp=8,
        pp=8,
        cp=2,
        float8=True,
    ),
    Run(
        "405B FSDP 2 x TP 8 x PP 8, CP 4, full AC, float8",
        "llama3_405b",
        "h100-96gb",
        8,
        131072,
        "full",
        77.1,
        31,
        TT_2412 + " Table 6",
        fsdp=2,
        tp=8,
        pp=8,
        cp=4,
        float8=True,
    ),
    Run(
        "405B FSDP 1 x TP 8 x PP 8, CP 8, full AC, float8",
        "llama3_405b",
        "h100-96gb",
        8,
        262144,
        "full",
        84.9,
        16,
        TT_2412 + " Table 6",
        tp=8,
        pp=8,
        cp=8,
        float8=True,
    ),
    Run(
        "8B FSDP 32, SAC, float8 (H200)",
        "llama3_8b",
        "h200",
        2,
        8192,
        "torchtitan-op",
        47.96,
        10938,
        TT_TRAINY,
        fsdp=32,
        float8=True,
        loss="compiled",
    ),
    Run(
        "8B FSDP 64, SAC, float8 (H200)",
        "llama3_8b",
        "h200",
        2,
        8192,
        "torchtitan-op",
        46.97,
        10753,
        TT_TRAINY,
        fsdp=64,
        float8=True,
        loss="compiled",
    ),
    Run(
        "DeepSeek-V3 16B (MoE) FSDP 8, EP 8, SAC, eager",
        "deepseek_v3_16b",
        "h100-80gb",
        4,
        4096,
        "torchtitan-op",
        73.32,
        11758,
        TT_DSV3_16B,
        fsdp=8,
        ep=8,
        compile=False,  # (the loss compiled, the layers eager)
        loss="compiled",
    ),
)


# ---- validating: found after the device model was built, none used to tune it ----
_PP8 = dict(pp=8, pp_schedule="interleaved-1f1b", compile=False, repeat_kv=True, validates=True)
_QWEN = dict(compile=False, validates=True)  # (torchtitan's Qwen3 repeated keys and values as its Llama did)
VALIDATING = (
    Run(
        "8B PP 8 interleaved, no AC (rank 0)",
        "llama3_8b",
        "h100-80gb",
        16,
        512,
        "none",
        22.74,
        304,
        TT_773,
        rank=0,
        **_PP8,
    ),
    Run(
        "8B PP 8 interleaved, no AC (rank 7)",
        "llama3_8b",
        "h100-80gb",
        16,
        512,
        "none",
        17.97,
        None,
        TT_773,
        rank=7,
        **_PP8,
    ),
    Run(
        "8B PP 8 interleaved, full AC (rank 0)",
        "llama3_8b",
        "h100-80gb",
        16,
        512,
        "full",
        15.86,
        243,
        TT_773,
        rank=0,
        **_PP8,
    ),
    Run(
        "8B PP 8 interleaved zero bubble, no AC (rank 0)",
        "llama3_8b",
        "h100-80gb",
        16,
        512,
        "none",
        20.57,
        339,
        TT_773,
        rank=0,
        **{**_PP8, "pp_schedule": "interleaved-zero-bubble"},
    ),
    Run(
        "8B PP 8 interleaved zero bubble, no AC (rank 7)",
        "llama3_8b",
        "h100-80gb",
        16,
        512,
        "none",
        22.23,
        None,
        TT_773,
        rank=7,
        **{**_PP8, "pp_schedule": "interleaved-zero-bubble"},
    ),
    Run(
        "405B FSDP 8 x TP 8 x PP 8 interleaved zero bubble, full AC",
        "llama3_405b",
        "h100-96gb",
        32,
        8192,
        "full",
        89.73,
        None,
        TT_773,
        fsdp=8,
        tp=8,
        pp=8,
        pp_schedule="interleaved-zero-bubble",
        microbatch_size=4,
        compile=False,
        validates=True,
    ),
    Run(
        "DeepSeek-V3 16B FSDP 2 x PP 4 interleaved, full AC (rank 3)",
        "deepseek_v3_16b",
        "h100-96gb",
        8,
        4096,
        "full",
        67.11,
        5048,
        TT_1616,
        fsdp=2,
        pp=4,
        pp_schedule="interleaved-1f1b",
        rank=3,
        compile=False,
        repeat_kv=False,
        validates=True,
    ),
    Run(
        "DeepSeek-V3 16B FSDP 8, EP 8, SAC (MoE)",
        "deepseek_v3_16b",
        "h100-96gb",
        8,
        4096,
        "torchtitan-op",
        78.14,
        8667,
        TT_1610,
        fsdp=8,
        ep=8,
        compile=False,
        loss="compiled",
        repeat_kv=False,
        validates=True,
    ),
    Run(
        "DeepSeek-V3 16B FSDP 4 x CP 2, full AC",
        "deepseek_v3_16b_vocab129k",
        "h100-96gb",
        8,
        4096,
        "full",
        71.08,
        6037,
        TT_1513,
        fsdp=4,
        cp=2,
        compile=False,
        repeat_kv=False,
        validates=True,
    ),
    Run(
        "Qwen3 14B FSDP 4 x CP 2, batch 10, no AC (B200)",
        "qwen3_14b",
        "b200",
        10,
        4096,
        "none",
        170.21,
        4531,
        TT_QWEN14,
        fsdp=4,
        cp=2,
        loss="chunked",
        repeat_kv=False,
        validates=True,
    ),
    Run(
        "Qwen3 14B FSDP 8, batch 5, no AC (B200)",
        "qwen3_14b",
        "b200",
        5,
        4096,
        "none",
        168.96,
        8489,
        TT_QWEN14,
        fsdp=8,
        loss="chunked",
        repeat_kv=False,
        validates=True,
    ),
    Run(
        "Qwen3 32B FSDP 4 x TP 8, batch 16, full AC",
        "qwen3_32b",
        "h100-96gb",
        16,
        4096,
        "full",
        43.45,
        876,
        TT_1690,
        fsdp=4,
        tp=8,
        **_QWEN,
    ),
    Run(
        "Qwen3 32B FSDP 4 x TP 8, batch 32, full AC",
        "qwen3_32b",
        "h100-96gb",
        32,
        4096,
        "full",
        70.79,
        883,
        TT_1690,
        fsdp=4,
        tp=8,
        **_QWEN,
    ),
    Run(
        "Qwen3 32B FSDP 8 x TP 8, batch 32, full AC",
        "qwen3_32b",
        "h100-96gb",
        32,
        4096,
        "full",
        63.27,
        873,
        TT_1690,
        fsdp=8,
        tp=8,
        **_QWEN,
    ),
    Run(
        "Qwen3 32B FSDP 8, batch 1, full AC",
        "qwen3_32b",
        "h100-96gb",
        1,
        4096,
        "full",
        81.47,
        1444,
        TT_1690,
        fsdp=8,
        **_QWEN,
    ),
    Run(
        "Qwen3 32B FSDP 8, batch 2, full AC",
        "qwen3_32b",
        "h100-96gb",
        2,
        4096,
        "full",
        89.33,
        1614,
        TT_1690,
        fsdp=8,
        **_QWEN,
    ),
    Run(
        "Qwen3 32B FSDP 8, batch 2, full AC, compiled",
        "qwen3_32b",
        "h100-96gb",
        2,
        4096,
        "full",
        81.85,
        1874,
        TT_1690,
        fsdp=8,
        loss="compiled",
        **{**_QWEN, "compile": True},
    ),
    Run(
        "Qwen3 32B FSDP 16, batch 4, full AC",
        "qwen3_32b",
        "h100-96gb",
        4,
        4096,
        "full",
        78.48,
        1518,
        TT_1690,
        fsdp=16,
        **_QWEN,
    ),
    Run(
        "DeepSeek-V3 671B FSDP 64 x PP 8 interleaved, EP 32, full AC (MoE)",
        "deepseek_v3",
        "h100-80gb",
        16,
        4096,
        "full",
        60.18,
        346,
        TT_2107,
        fsdp=64,
        ep=32,
        pp=8,
        pp_schedule="interleaved-1f1b",
        loss="compiled",
        repeat_kv=False,
        validates=True,
    ),
)
RUNS = RUNS + VALIDATING


def _target(run: Run, **changes: object) -> object:
    from sac_compile.planning.devices import Target

    layout = dict(
        fsdp=run.fsdp,
        tp=run.tp,
        ep=run.ep,
        cp=run.cp,
        pp=run.pp,
        pp_schedule=run.pp_schedule,
        pp_virtual_stages=run.pp_virtual_stages,
        microbatch_size=run.microbatch_size,
        loss=run.loss,
        repeat_kv=run.repeat_kv,
        async_tp=run.async_tp,
    )
    return Target(run.device, batch=run.batch, seq=run.seq, **{**layout, **changes})


def _measured(run: Run, cache: dict) -> object:
    from sac_compile import hf
    from sac_compile.__main__ import _model

    target = _target(run, memory=1 << 60)
    key = (run.config, target.measured)  # (measured compiled: eager's too)
    if key not in cache:
        model = _model(os.path.join(CONFIGS, run.config + ".json"))
        cache[key] = hf.plan_for(model, None, device=target, include=())
        del model
        gc.collect()
    return cache[key]


def _configured(run: Run, cache: dict, device: object = None) -> tuple:
    """The run's plan and its configuration's predicted ``(peak, step)``, on ``device`` (a
    ``Device``) where given: the peak of the pipeline rank the source logs (``Run.rank``), else
    the largest."""
    from sac_compile.planning.device_plan import predict as predicted

    target = _target(run) if device is None else _target(run).replace(device=device)
    plan = dataclasses.replace(_measured(run, cache), target=target, compile=run.compile)
    keep = None if run.ac == "none" else () if run.ac == "full" else run.ac
    if run.rank is None:
        return plan, plan.configuration(keep)
    peaks, step = predicted(plan.measured, plan.params, plan.sizes, target, keep, compile=run.compile)
    return plan, (peaks[run.rank], step)


def predict(run: Run, cache: dict) -> dict:
    plan, (peak, step) = _configured(run, cache)
    gib = peak.reserved / 2**30
    published = run.published_gib * run.memory_unit / 2**30 if run.published_gib else None
    capacity = run.oom and plan.target.device.memory / 2**30
    return {
        "run": run.name,
        "source": run.source,
        "float8": run.float8,
        "calibrates": run.calibrates,
        "validates": run.validates,
        "predicted_gib": gib,
        "allocated_gib": peak.bytes / 2**30,
        "published_gib": published,
        "memory_ratio": gib / published if published else None,
        "oom_predicted": gib > capacity if capacity else None,
        "phase": peak.phase,
        "breakdown_gib": {k: v / 2**30 for k, v in peak.breakdown.items() if v},
        "predicted_tps": step.tokens_per_second,
        "published_tps": run.published_tps,
        "tps_ratio": step.tokens_per_second / run.published_tps
        if run.published_tps and not run.float8
        else None,
        "step_terms": step.terms(),
        "mfu": step.mfu,
    }


def _seconds(run: Run, cache: dict, device: object = None) -> float:
    """The run's predicted step seconds, on ``device`` (a ``Device``) where given."""
    return _configured(run, cache, device)[1][1].seconds


def _solve(seconds, goal: float, lo: float, hi: float) -> float:
    """The value in ``[lo, hi]`` at which the monotone ``seconds(value)`` meets ``goal``."""
    rising = seconds(hi) > seconds(lo)
    for _ in range(60):
        mid = (lo + hi) / 2
        if (seconds(mid) < goal) == rising:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def calibrate(cache: dict) -> dict[str, float]:
    """The constants the calibrating runs set, in turn (each with the ones before it): a
    compiled run its device's ``efficiency``; an eager run on a device a compiled run set,
    ``EAGER_SLOWDOWN``; another eager run its device's ``efficiency``, over the slowdown.
    Devices whose efficiency names the same source take it too. ``planning.catalog`` is
    left as it was."""
    from sac_compile.planning import devices, step_time

    saved = dict(devices.DEVICES), step_time.EAGER_SLOWDOWN
    try:
        return _calibrate(cache, devices, step_time)
    finally:
        devices.DEVICES.update(saved[0])
        step_time.EAGER_SLOWDOWN = saved[1]


def _calibrate(cache: dict, devices, step_time) -> dict[str, float]:
    found: dict[str, float] = {}
    runs = sorted((r for r in RUNS if r.calibrates), key=lambda r: not r.compile)
    for run in runs:
        goal = run.batch * run.seq / run.published_tps / (run.tp * run.cp * run.pp)
        device = devices.DEVICES[run.device]
        if not run.compile and run.device in found:

            def slowed(s: float, r: Run = run) -> float:
                step_time.EAGER_SLOWDOWN = s
                return _seconds(r, cache)

            step_time.EAGER_SLOWDOWN = found["EAGER_SLOWDOWN"] = _solve(slowed, goal, 1.0, 3.0)
            continue

        def seconds(e: float, d=device, r: Run = run) -> float:
            return _seconds(r, cache, dataclasses.replace(d, efficiency=e))

        efficiency = found[run.device] = _solve(seconds, goal, 0.05, 2.0)
        for name, other in list(devices.DEVICES.items()):
            # the devices whose efficiency names this run's source borrow it (the H100's: the
            # H200's and MI300X's too)
            if other.efficiency_source == device.efficiency_source:
                devices.DEVICES[name] = dataclasses.replace(other, efficiency=efficiency)
    return found


def _cell(value: float | None, form: str) -> str:
    return "-" if value is None else format(value, form)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--match", default=None, help="a regular expression: the runs whose name it finds (default all)"
    )
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="first print the constants the runs marked calibrates set (planning.catalog's are the table's)",
    )
    args = parser.parse_args(argv)
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    runs = RUNS if args.match is None else tuple(r for r in RUNS if re.search(args.match, r.name))
    cache: dict = {}
    if args.calibrate:
        for name, value in calibrate(cache).items():
            print(f"  {name}: {value:.4f}", file=sys.stderr)
    rows = []
    start = time.perf_counter()
    for run in runs:
        rows.append(predict(run, cache))
        print(f"  {run.name}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    print(
        "| run | device | predicted GiB | published GiB | ratio | predicted tokens/s | published | ratio | MFU |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for run, row in zip(runs, rows):
        mark = " (float8)" if run.float8 else " (calibrates)" if run.calibrates else ""
        mark += " (validates)" if run.validates else ""
        published, ratio = _cell(row["published_gib"], ".1f"), _cell(row["memory_ratio"], ".2f")
        if run.oom:  # (an out-of-memory run: the prediction exceeds the device, or misses)
            published, ratio = "OOM", "over" if row["oom_predicted"] else "fits (miss)"
        print(
            f"| {run.name}{mark} | {run.device} | {row['predicted_gib']:.1f} | {published} | "
            f"{ratio} | {row['predicted_tps']:,.0f} | {_cell(run.published_tps, ',.0f')} | "
            f"{_cell(row['tps_ratio'], '.2f')} | {row['mfu']:.1%} |"
        )
    checked = [(run, row) for run, row in zip(runs, rows) if run.validates]
    if checked:
        memory = [r["memory_ratio"] for _, r in checked if r["memory_ratio"]]
        speed = [r["tps_ratio"] for _, r in checked if r["tps_ratio"]]
        print(
            f"\nvalidating runs ({len(checked)}, {len({run.source for run, _ in checked})} sources): memory within 12% "
            f"{sum(abs(m - 1) <= 0.12 for m in memory)} of {len(memory)} (ratios {min(memory):.2f}-{max(memory):.2f}), "
            f"tokens/s within 30% {sum(abs(t - 1) <= 0.30 for t in speed)} of {len(speed)}"
            + (f" (ratios {min(speed):.2f}-{max(speed):.2f})" if speed else "")
        )
    for run, row in zip(runs, rows):
        terms = ", ".join(f"{k} {v:.1f}" for k, v in row["breakdown_gib"].items())
        steps = ", ".join(f"{k} {v:.3f}" for k, v in row["step_terms"].items() if v)
        print(f"  {run.name}: peak in the {row['phase']}: {terms}; step s: {steps}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
