"""The devices a plan is made for, and a training step's shape on them (:class:`Target`).

Each :class:`Device` carries its memory, peak dense bf16 tensor FLOP/s and memory bandwidth,
with the source of each figure. Its memory is PyTorch's ``total_memory`` of it, read off
published logs: the vendors' HBM "GB" are binary (an "80 GB" H100 has 79.1 GiB, not 74.5); a
process may allocate a little less (CUDA's context), which :attr:`Target.headroom` covers. ``cpu`` is this
machine: its memory from the OS, its FLOP/s and bandwidth measured once on first use (a
float32 matmul and a copy), labelled so.

>>> t = Target("h100-80gb", memory="80GB", fsdp=8, batch=1, seq=8192)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..memory import GiB, Memory, parse_memory
from .host import HOST_LINKS, HostLink, check_target

__all__ = ["DEVICES", "LOSSES", "Device", "Target", "device", "parse_loss", "parse_memory", "present"]


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
H100_EFFICIENCY = 0.738
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
            link=450e9,
            efficiency=H100_EFFICIENCY,
            efficiency_source=H100_SOURCE,
            attention_flops=H100_ATTENTION,
            attention_source=H100_ATTENTION_SOURCE,
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
            link=450e9,
            efficiency=H100_EFFICIENCY,
            efficiency_source=H100_SOURCE,
            attention_flops=H100_ATTENTION,  # (measured on an H100 SXM: this part runs at 500 W)
            attention_source=H100_ATTENTION_SOURCE,
        ),
        Device(
            "h200",
            int(141 * GiB * _UNLOGGED),
            989.4e12,
            4.8e12,
            "NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB HBM3e, 4.8 TB/s, BF16 1,979 TFLOPS with sparsity, "
            "NVLink 900 GB/s",
            link=450e9,
            efficiency=H100_EFFICIENCY,
            efficiency_source=H100_SOURCE,
            attention_flops=H100_ATTENTION,
            attention_source=H100_ATTENTION_SOURCE,
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
            efficiency=0.806,
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
            efficiency=0.317,
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


#: loss -> how its head holds the logits (``Target.loss``; :func:`parse_loss`)
LOSSES = {
    "transformers": "transformers' causal-LM loss: the logits upcast to float32, their log-softmax held; the "
    "model's own logits stay alive in its output through the backward",
    "torchtitan": "torchtitan's: the float32 log-softmax held, the model's logits freed before the backward",
    "compiled": "a torch.compile'd cross-entropy (torchtitan's with compile since 2025-04): the model's logits "
    "saved by the compiled loss and their gradient made in the same dtype, no float32 logits-sized tensor",
    "chunked": "a chunked / fused linear cross-entropy (chunked:N, default 8 chunks): no logits held, one "
    "chunk's float32 logits, log-softmax and gradient at a time, the chunk's logits recomputed in the backward",
}


def parse_loss(loss: str) -> tuple[str, int]:
    """``(kind, chunks)`` of a ``Target.loss`` (``"transformers"``, ``"torchtitan"``,
    ``"compiled"``, ``"chunked"`` or ``"chunked:N"``); anything else is a ``ValueError``
    listing them."""
    kind, _, chunks = str(loss).partition(":")
    if kind in LOSSES and (not chunks or kind == "chunked" and chunks.isdigit() and int(chunks) > 0):
        return kind, int(chunks) if chunks else (8 if kind == "chunked" else 1)
    raise ValueError(
        f"loss={loss!r}: one of {', '.join(LOSSES)} ('chunked:N' for N chunks): "
        + "; ".join(f"{k}: {v}" for k, v in LOSSES.items())
    )


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype(value: str | torch.dtype, what: str) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in _DTYPES.values():
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.removeprefix("torch.")]
    raise ValueError(f"{what}={value!r}: one of {', '.join(_DTYPES)}")


@dataclass(frozen=True)
class Target:
    """A training step on a device: what a plan must fit.

    Args:
        device: a kind from :data:`DEVICES`, ``"cpu"``, or a :class:`Device`.
        memory: the memory a step may use per device (:mod:`sac_compile.memory`: bytes,
            ``"80GiB"``, or a float: that fraction of the device's memory); default the device's.
        fsdp: FSDP degree: parameters, gradients and optimizer state sharded this many ways;
            a layer's parameters (and in the backward its gradients) unsharded while it runs.
        tp: tensor-parallel degree, laid out as torchtitan lays out Llama: each layer's
            projections split column- / row-wise, so its weights and the activations between
            them are split ``tp`` ways (:mod:`sac_compile.planning.parallel`).
        sequence_parallel: with ``tp``, the residual stream between the projections split on
            the sequence too (torchtitan's default; a kept region saves the input it gathers).
        loss_parallel: with ``tp``, the logits split on the vocabulary and the loss computed
            on the shards (torchtitan's default): the head's logits and loss terms ``1 / tp``.
        loss: how the trainer's loss holds the logits, one of :data:`LOSSES` (default
            ``"transformers"``; ``"chunked:N"``).
        ep: expert-parallel degree (torchtitan's layout: a divisor of ``fsdp``): an MoE
            layer's routed experts split this many ways and FSDP-sharded over the other
            ``fsdp / ep``, so only ``1 / ep`` of them is all-gathered while the layer runs.
        param_dtype: the dtype layers compute in (FSDP's ``MixedPrecisionPolicy.param_dtype``).
        master_dtype: the dtype parameters, gradients after reduction and optimizer state
            are kept in.
        reduce_dtype: the dtype gradients are reduced in.
        optimizer: ``"adamw"`` (two states per parameter), ``"sgd"`` (none), or
            ``"sgd-momentum"`` (one).
        batch, seq: per device.
        headroom: the fraction of ``memory`` kept free for the allocator and the CUDA
            context (a plan fits when its predicted peak is at most ``(1 - headroom) * memory``).
        cp: context-parallel degree (torchtitan's layout: ring attention over the sequence,
            parameters sharded over ``fsdp x cp``): each rank runs ``seq / cp`` tokens of
            every sequence and attends to all of them.
        pp: pipeline-parallel degree: the layers split evenly into ``pp`` stages, embeddings
            on the first, the head on the last; ``batch`` is split into microbatches of
            ``microbatch_size`` (torchtitan's default 1).
        pp_schedule: ``"1f1b"`` (default), ``"interleaved-1f1b"`` (two stages a rank) or
            ``"gpipe"``: how many microbatches a stage holds at once (:mod:`.peak`).
        microbatch_size: sequences per microbatch with ``pp`` (a divisor of ``batch``).
        gpus_per_node: GPUs joined by the device's link (:attr:`Device.link`); a collective
            whose group spans nodes runs over ``network``.
        network: bytes/s per GPU between nodes (default 400 Gb/s: one ConnectX-7 port a GPU).
        offload: the plan may offload regions to host memory (:mod:`.offload`); needs
            ``host_memory``.
        host_memory: host memory per GPU for offloaded values (bytes or ``"256GB"``: a DGX
            H100's 2 TB over its 8 GPUs).
        host_link: the GPU's link to host memory, one of
            :data:`~sac_compile.planning.host.HOST_LINKS` (default the device's:
            ``"pcie5"``, the A100's ``"pcie4"``; ``"c2c"`` for GH200 / GB200).
    """

    device: Device | str = "h100-80gb"
    memory: Memory | None = None
    fsdp: int = 1
    tp: int = 1
    ep: int = 1
    sequence_parallel: bool = True
    loss_parallel: bool = True
    loss: str = "transformers"
    param_dtype: torch.dtype | str = torch.bfloat16
    master_dtype: torch.dtype | str = torch.float32
    reduce_dtype: torch.dtype | str = torch.float32
    optimizer: str = "adamw"
    batch: int = 1
    seq: int = 4096
    headroom: float = 0.05
    cp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    microbatch_size: int = 1
    gpus_per_node: int = 8
    network: float = 400e9 / 8
    offload: bool = False
    host_memory: int | str | None = None
    host_link: str | None = None

    def __post_init__(self) -> None:
        dev = device(self.device)
        object.__setattr__(self, "device", dev)
        memory = (
            dev.memory
            if self.memory is None
            else parse_memory(self.memory, dev.memory, of="the device's memory")
        )
        if memory <= 0:
            raise ValueError(f"Target(memory={self.memory!r}): more than 0 bytes")
        object.__setattr__(self, "memory", memory)
        check_target(self, dev.cuda, dev.name)
        if self.host_memory is not None:
            object.__setattr__(self, "host_memory", parse_memory(self.host_memory, name="host_memory"))
        for name in ("fsdp", "tp", "ep", "cp", "pp", "batch", "seq", "microbatch_size", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Target({name}={value!r}): a positive int")
        try:
            parse_loss(self.loss)
        except ValueError as e:
            raise ValueError(f"Target({e}") from None
        for name in ("sequence_parallel", "loss_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Target({name}={getattr(self, name)!r}): True or False")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"Target(pp_schedule={self.pp_schedule!r}): one of {', '.join(PP_SCHEDULES)}")
        if self.pp > 1 and self.batch % self.microbatch_size:
            raise ValueError(
                f"Target(batch={self.batch}, microbatch_size={self.microbatch_size}): with pp the batch is split "
                "into microbatches: microbatch_size divides batch"
            )
        if self.seq % self.cp:
            raise ValueError(
                f"Target(seq={self.seq}, cp={self.cp}): the sequence is split cp ways: cp divides seq"
            )
        if self.fsdp % self.ep:
            raise ValueError(
                f"Target(ep={self.ep}, fsdp={self.fsdp}): the expert-parallel degree divides the FSDP degree "
                "(experts are split ep ways and FSDP-sharded over the other fsdp / ep)"
            )
        for name in ("param_dtype", "master_dtype", "reduce_dtype"):
            object.__setattr__(self, name, _dtype(getattr(self, name), name))
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"Target(optimizer={self.optimizer!r}): one of {', '.join(OPTIMIZER_STATES)}")
        if isinstance(self.network, bool) or not isinstance(self.network, (int, float)) or self.network <= 0:
            raise ValueError(
                f"Target(network={self.network!r}): bytes/s per GPU between nodes, > 0 (400 Gb/s: 50e9)"
            )
        if not 0.0 <= self.headroom < 1.0:
            raise ValueError(f"Target(headroom={self.headroom!r}): a fraction in [0, 1)")

    @property
    def microbatches(self) -> int:
        """Microbatches a step runs (1 without pipeline parallelism)."""
        return self.batch // self.microbatch_size if self.pp > 1 else 1

    @property
    def traced(self) -> tuple[int, int]:
        """``(batch, seq)`` one layer is measured at: one microbatch of one rank's share of the
        sequence."""
        return (self.microbatch_size if self.pp > 1 else self.batch), self.seq // self.cp

    @property
    def host(self) -> HostLink:
        """The :class:`~sac_compile.planning.host.HostLink` offloaded values cross."""
        return HOST_LINKS[self.host_link or self.device.host_link]  # type: ignore[union-attr]

    def compute_seconds(self, flops: float, traffic: float = 0.0) -> float:
        """Seconds one rank computes ``flops`` costly FLOPs and moves ``traffic`` memory-bound
        bytes (a whole step's worth, split ``tp`` ways): the device's roofline over the
        efficiency a published run reached (:mod:`.step_time`)."""
        d = self.device
        return (flops / d.bf16_flops + traffic / d.bandwidth) / d.efficiency / self.tp  # type: ignore[union-attr]

    def attention_seconds(self, flops: float) -> float:
        """Seconds one rank runs ``flops`` attention FLOPs (split ``tp`` ways): at the rate
        the device's attention kernel was measured at, else as :meth:`compute_seconds`."""
        rate = self.device.attention_flops  # type: ignore[union-attr]
        return flops / rate / self.tp if rate else self.compute_seconds(flops)

    @property
    def usable(self) -> int:
        """The bytes a plan may use: ``memory`` less the headroom."""
        return int(self.memory * (1.0 - self.headroom))  # type: ignore[operator]

    def replace(self, **changes: Any) -> Target:
        return dataclasses.replace(self, **changes)


#: pipeline schedule -> model stages a rank holds (torchtitan's interleaved default: 2)
PP_SCHEDULES = {"1f1b": 1, "interleaved-1f1b": 2, "gpipe": 1}

#: optimizer -> states kept per parameter (in ``master_dtype``)
OPTIMIZER_STATES = {"adamw": 2, "sgd": 0, "sgd-momentum": 1}
