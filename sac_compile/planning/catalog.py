"""The devices a plan is made for: each :class:`Device` carries its memory, peak dense bf16
tensor FLOP/s and memory bandwidth, with the source of each figure, and the step time's
constants calibrated on published runs (:mod:`.step_time`).

A device's memory is PyTorch's ``total_memory`` of it, read off published logs: the vendors'
HBM "GB" are binary (an "80 GB" H100 has 79.1 GiB, not 74.5); a process may allocate a little
less (CUDA's context), which :attr:`~sac_compile.planning.devices.Target.headroom` covers.
``cpu`` is this machine: its memory from the OS, its FLOP/s and bandwidth measured once on
first use (a float32 matmul and a copy), labelled so.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..memory import GiB

__all__ = ["DEVICES", "EAGER_SLOWDOWN", "Device", "device", "present"]


@dataclass(frozen=True)
class Device:
    """One kind of accelerator: what a plan needs to know of it."""

    name: str
    memory: int  # bytes
    bf16_flops: float  # peak dense bf16 tensor FLOP/s (no sparsity)
    bandwidth: float  # memory bytes/s
    source: str
    cuda: bool = True  # its attention kernels are CUDA's (flash / memory-efficient) — ROCm's too
    # the GPU-to-GPU link inside a node, bytes/s one way per GPU (NVLink; 0: none)
    link: float = 0.0
    # the fraction of its roofline (FLOPs at bf16_flops, memory-bound bytes at bandwidth) a
    # whole compiled training step reaches, from a published run (efficiency_source)
    efficiency: float = 1.0
    efficiency_source: str = "none: the roofline itself"
    host_link: str = "pcie5"  # its link to the host's memory (planning.host.HOST_LINKS)
    # FLOP/s its flash-attention kernel sustains as PyTorch's SDPA calls it, measured
    # (attention_source; 0: attention at the roofline's efficiency like every matmul)
    attention_flops: float = 0.0
    attention_source: str = ""


#: The fraction of the roofline a compiled training step of a published run reached, its
#: attention at the measured rate (H100_ATTENTION): ``python benchmarks/published.py
#: --calibrate`` solves it (and EAGER_SLOWDOWN, the B200's and the A100's) from the runs
#: marked ``calibrates``
H100_EFFICIENCY = 0.754
H100_SOURCE = (
    "torchtitan benchmarks/llama3_h100_202412_torchtitan.md Table 1: Llama-3.1-8B on 8 H100s (96 GB, 500 W), "
    "FSDP 8, batch 2 x 8192, per-op SAC, compiled: 6,667 tokens/s per GPU (benchmarks/published.py)"
)

#: How much longer a step's layers run eager than compiled: torchtitan's Table 1 ran one
#: configuration both ways (8B FSDP 8: 5,762 tokens/s per GPU eager, 6,667 compiled; the loss
#: eager in both). One factor for every device: no other pair found.
EAGER_SLOWDOWN = 1.164

#: PyTorch's SDPA measured on an H100: about 30% of the dense peak (a step's matmuls: twice that)
H100_ATTENTION = 293e12
H100_ATTENTION_SOURCE = (
    "github.com/pytorch/benchmark/pull/2296 (2024-06): the flash_attention operator on an H100, sdpa, batch 128 "
    "x 8 heads x head dim 128, seq 1,024-16,384: 287.5, 293.2, 298.4, 287.7, 304.2 TFLOP/s (the median taken; "
    "forward: the backward taken at the same rate)"
)

#: A device's memory as PyTorch reports it, from torchtitan's logs (``memory: X GiB (Y%)``:
#: the reserved peak over the capacity); where no log was found, the datasheet's figure read
#: as GiB, less what the H100 80GB loses (80 -> 79.1 GiB)
H100_80GB_MEMORY = int(79.1 * GiB)  # github.com/pytorch/torchtitan/issues/1789: 73.32 GiB = 92.70%
H100_96GB_MEMORY = int(95.0 * GiB)  # github.com/pytorch/torchtitan/pull/808: 47.65 GiB = 50.16%
A100_80GB_MEMORY = int(79.15 * GiB)  # github.com/pytorch/torchtitan/pull/887: 36.06 GiB = 45.56%
B200_MEMORY = int(178.4 * GiB)  # github.com/pytorch/torchtitan/pull/2389: 66.91 GiB = 37.51%
_UNLOGGED = 79.1 / 80  # (no log found: the H100's share)

# what the Hopper parts share: NVLink 4 (450 GB/s one way), the H100's published efficiency
# and its attention kernel's measured rate
_HOPPER: dict[str, Any] = dict(
    link=450e9,
    efficiency=H100_EFFICIENCY,
    efficiency_source=H100_SOURCE,
    attention_flops=H100_ATTENTION,
    attention_source=H100_ATTENTION_SOURCE,
)

#: Datasheet figures, dense (the sparse figures are twice these).
DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        Device(
            "h100-80gb",
            H100_80GB_MEMORY,
            989.4e12,
            3.35e12,
            "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 80 GB HBM3, 3.35 TB/s, BF16 1,979 TFLOPS with sparsity, "
            "NVLink 900 GB/s (both ways)",
            **_HOPPER,
            # (the published run's H100s ran at 500 W: an SXM5 at 700 W is faster)
        ),
        Device(
            "h100-96gb",
            H100_96GB_MEMORY,
            989.4e12,
            2.4e12,
            "H100 96 GB HBM2e at 500 W (Meta's Grand Teton, torchtitan's benchmark hosts: "
            "benchmarks/llama3_h100_202412_torchtitan.md): 96 GB, 2.4 TB/s; its peak rate lies between "
            "the SXM's and the NVL's, the SXM's taken (as torchtitan's MFU does)",
            **_HOPPER,  # (the attention rate measured on an H100 SXM: this part runs at 500 W)
        ),
        Device(
            "h200",
            int(141 * GiB * _UNLOGGED),
            989.4e12,
            4.8e12,
            "NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB HBM3e, 4.8 TB/s, BF16 1,979 TFLOPS with sparsity, "
            "NVLink 900 GB/s",
            **_HOPPER,
            # (no published bf16 run on an H200 found: the H100's, the same compute die)
        ),
        Device(
            "a100-80gb",
            A100_80GB_MEMORY,
            312e12,
            2.039e12,
            "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): 80 GB HBM2e, 2,039 GB/s, BF16 312 TFLOPS, NVLink 600 GB/s",
            link=300e9,
            host_link="pcie4",
            efficiency=0.814,
            efficiency_source="torchtitan docs/performance.md (2024-04-24): Llama 3 8B on 64 A100s (80 GB), FSDP 64, "
            "batch 1 x 8192, per-op SAC, eager: 2,973 tokens/s per GPU, over EAGER_SLOWDOWN "
            "(benchmarks/published.py; Megatron-LM's 52% of peak at 3,072 GPUs, the source before, predicts "
            "torchtitan's A100 runs at 0.65x their tokens/s)",
        ),
        Device(
            "b200",
            B200_MEMORY,
            2.25e15,
            7.7e12,
            "NVIDIA HGX B200 datasheet: 180 GB HBM3e and 7.7 TB/s per GPU, FP16/BF16 4.5 PFLOPS with sparsity, "
            "NVLink 1.8 TB/s",
            link=900e9,
            efficiency=0.322,
            efficiency_source="torchao's MX-formats README, dense models: Llama-3-8B bf16 on 8 power-limited "
            "B200s, FSDP 8, batch 1 x 8192, per-op SAC, compiled: 8,307.5 tokens/s per GPU "
            "(benchmarks/published.py)",
        ),
        Device(
            "mi300x",
            int(192 * GiB * _UNLOGGED),
            1307.4e12,
            5.3e12,
            "AMD Instinct MI300X datasheet: 192 GB HBM3, 5.3 TB/s, BF16 1,307.4 TFLOPS dense, Infinity Fabric "
            "896 GB/s peak aggregate",
            link=448e9,
            efficiency=H100_EFFICIENCY,
            efficiency_source=H100_SOURCE,
            # (no published bf16 MI300X run found here: the H100's assumed)
        ),
    )
}


@functools.lru_cache(maxsize=1)
def _cpu() -> Device:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    a = torch.randn(1024, 1024)
    b = torch.empty(64 << 20, dtype=torch.uint8)
    a @ a  # warm up the kernel
    start = time.perf_counter()
    for _ in range(8):
        a @ a
    flops = 8 * 2 * 1024**3 / (time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(4):
        b.clone()
    bandwidth = 4 * 2 * b.numel() / (time.perf_counter() - start)  # read + write
    return Device(
        "cpu",
        memory,
        flops,
        bandwidth,
        f"this machine: memory from the OS; float32 matmul and copy measured here with {torch.get_num_threads()} "
        "threads (no bf16 tensor units assumed)",
        cuda=False,
    )


def device(name: str | Device) -> Device:
    """The :class:`Device` called ``name`` (``"h100-80gb"``, ``"cpu"``, ...); an unknown
    name is a ``ValueError`` listing the known kinds."""
    if isinstance(name, Device):
        return name
    key = str(name).lower()
    if key == "cpu":
        return _cpu()
    if key not in DEVICES:
        raise ValueError(
            f"device={name!r} is not a known kind: {', '.join([*DEVICES, 'cpu'])} "
            "(or pass sac_compile.planning.devices.Device(name, memory, bf16_flops, bandwidth, source))"
        )
    return DEVICES[key]


# the kind a present GPU is, from the name its driver reports
_NAMES = (
    ("H200", "h200"),
    ("H100", "h100-80gb"),
    ("A100", "a100-80gb"),
    ("B200", "b200"),
    ("MI300X", "mi300x"),
)


def present(index: int | None = None) -> Device:
    """The :class:`Device` this process runs on: the CUDA (or ROCm) device ``index`` (default
    the current one) — its kind's datasheet rates, the memory the driver reports — or, without
    one, ``device("cpu")``. A GPU none of :data:`DEVICES` names is a ``ValueError`` naming it."""
    if not torch.cuda.is_available():
        return _cpu()
    index = torch.cuda.current_device() if index is None else index
    props = torch.cuda.get_device_properties(index)
    for part, kind in _NAMES:
        if part.lower() in props.name.lower():
            return dataclasses.replace(DEVICES[kind], memory=int(props.total_memory))
    raise ValueError(
        f"the GPU present is {props.name!r}, not one of the kinds known ({', '.join(DEVICES)}): pass "
        "sac_compile.planning.devices.Device(name, memory, bf16_flops, bandwidth, source) with its datasheet figures"
    )
