"""The devices a plan is made for, and a training step's shape on them (:class:`Target`).

Each :class:`Device` carries its memory, peak dense bf16 tensor FLOP/s and memory bandwidth,
with the source of each figure. Vendor figures are decimal (1 GB = 10**9 B) and are what
the datasheet states; the memory a process may allocate is a little less (CUDA's context,
the allocator's fragmentation), which :attr:`Target.headroom` covers. ``cpu`` is this
machine: its memory from the OS, its FLOP/s and bandwidth measured once on first use (a
float32 matmul and a copy), labelled so.

>>> t = Target("h100-80gb", memory="80GB", fsdp=8, batch=1, seq=8192)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import time
from dataclasses import dataclass
from typing import Any

import torch

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


GB = 10**9
GiB = 2**30

#: Datasheet figures, dense (the sparse figures are twice these).
DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        Device(
            "h100-80gb",
            80 * GB,
            989.4e12,
            3.35e12,
            "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 80 GB HBM3, 3.35 TB/s, BF16 1,979 TFLOPS with sparsity",
        ),
        Device(
            "h200",
            141 * GB,
            989.4e12,
            4.8e12,
            "NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB HBM3e, 4.8 TB/s, BF16 1,979 TFLOPS with sparsity",
        ),
        Device(
            "a100-80gb",
            80 * GB,
            312e12,
            2.039e12,
            "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): 80 GB HBM2e, 2,039 GB/s, BF16 312 TFLOPS",
        ),
        Device(
            "b200",
            180 * GB,
            2.25e15,
            7.7e12,
            "NVIDIA HGX B200 datasheet: 180 GB HBM3e and 7.7 TB/s per GPU, FP16/BF16 4.5 PFLOPS with sparsity",
        ),
        Device(
            "mi300x",
            192 * GB,
            1307.4e12,
            5.3e12,
            "AMD Instinct MI300X datasheet: 192 GB HBM3, 5.3 TB/s, BF16 1,307.4 TFLOPS dense",
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


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": GB, "tb": 10**12, "kib": 2**10, "mib": 2**20}
_UNITS |= {"gib": GiB, "tib": 2**40}


def parse_memory(memory: int | float | str) -> int:
    """Bytes from an ``int`` or a string with a unit (``"80GiB"``, ``"80 GB"``, ``"512MiB"``,
    ``"4096B"``; GB is 10**9, GiB 2**30). A string without a unit (``"80"``, as a command line
    or a config file writes it) is a ``ValueError``: bytes are said with ``B`` or passed as an
    int. Anything else is a ``ValueError`` naming it."""
    if isinstance(memory, bool):
        raise TypeError(f"memory={memory!r}: bytes (an int) or a string such as '80GiB'")
    if isinstance(memory, int):
        if memory <= 0:
            raise ValueError(f"memory={memory!r}: bytes must be > 0")
        return memory
    if isinstance(memory, float) and memory.is_integer() and memory > 1:
        return int(memory)
    if isinstance(memory, str):
        found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", memory)
        if found and not found.group(2):
            raise ValueError(
                f"memory={memory!r}: a number with no unit (is it bytes or GiB?): "
                f"'{found.group(1)}GiB' or '{found.group(1)}GB' ('{found.group(1)}B' for bytes)"
            )
        if found and found.group(2).lower() in _UNITS:
            value = int(float(found.group(1)) * _UNITS[found.group(2).lower()])
            if value > 0:
                return value
    raise ValueError(
        f"memory={memory!r}: bytes (an int > 0) or a number with a unit: "
        f"{', '.join(u for u in _UNITS if u)} (case-insensitive; '80GiB', '141GB')"
    )


#: loss -> how its head holds the logits (``Target.loss``; :func:`parse_loss`)
LOSSES = {
    "transformers": "transformers' causal-LM loss: the logits upcast to float32, their log-softmax held; the "
    "model's own logits stay alive in its output through the backward",
    "torchtitan": "torchtitan's: the float32 log-softmax held, the model's logits freed before the backward",
    "chunked": "a chunked / fused linear cross-entropy (chunked:N, default 8 chunks): no logits held, one "
    "chunk's float32 logits, log-softmax and gradient at a time, the chunk's logits recomputed in the backward",
}


def parse_loss(loss: str) -> tuple[str, int]:
    """``(kind, chunks)`` of a ``Target.loss`` (``"transformers"``, ``"torchtitan"``,
    ``"chunked"`` or ``"chunked:N"``); anything else is a ``ValueError`` listing them."""
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
        memory: the memory a step may use per device (bytes or ``"80GiB"``); default the
            device's.
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
    """

    device: Device | str = "h100-80gb"
    memory: int | str | None = None
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

    def __post_init__(self) -> None:
        dev = device(self.device)
        object.__setattr__(self, "device", dev)
        object.__setattr__(self, "memory", dev.memory if self.memory is None else parse_memory(self.memory))
        for name in ("fsdp", "tp", "ep", "batch", "seq"):
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
        if self.fsdp % self.ep:
            raise ValueError(
                f"Target(ep={self.ep}, fsdp={self.fsdp}): the expert-parallel degree divides the FSDP degree "
                "(experts are split ep ways and FSDP-sharded over the other fsdp / ep)"
            )
        for name in ("param_dtype", "master_dtype", "reduce_dtype"):
            object.__setattr__(self, name, _dtype(getattr(self, name), name))
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"Target(optimizer={self.optimizer!r}): one of {', '.join(OPTIMIZER_STATES)}")
        if not 0.0 <= self.headroom < 1.0:
            raise ValueError(f"Target(headroom={self.headroom!r}): a fraction in [0, 1)")

    @property
    def usable(self) -> int:
        """The bytes a plan may use: ``memory`` less the headroom."""
        return int(self.memory * (1.0 - self.headroom))  # type: ignore[operator]

    def replace(self, **changes: Any) -> Target:
        return dataclasses.replace(self, **changes)


#: optimizer -> states kept per parameter (in ``master_dtype``)
OPTIMIZER_STATES = {"adamw": 2, "sgd": 0, "sgd-momentum": 1}
