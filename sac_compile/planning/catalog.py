"""The devices a plan is made for: each :class:`Device` carries its memory, peak dense bf16
tensor FLOP/s and memory bandwidth, with the source of each figure, and the step time's
figures fitted to published runs (:mod:`.step_time`) -- all read from the data file
``world.json`` beside this module (:data:`WORLD_FILE`): the code holds the model, the file the
world. A fitted figure names the run marked calibrating it was solved from.

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
from .host import WORLD, WORLD_FILE

__all__ = ["DEVICES", "EAGER_SLOWDOWN", "FITTED", "KERNELS", "WORLD_FILE", "Device", "device", "present"]


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


#: name -> the step-time figures fitted to the published runs marked calibrating, each with
#: its run and source (``benchmarks/published.py --calibrate`` solves them)
FITTED: dict[str, dict[str, Any]] = WORLD["fitted"]
#: How much longer a step's layers run eager than compiled (``FITTED["eager_slowdown"]``)
EAGER_SLOWDOWN: float = FITTED["eager_slowdown"]["value"]
#: name -> a kernel's measured rate (``flops``) and its source
KERNELS: dict[str, dict[str, Any]] = WORLD["kernels"]


def _device(entry: dict[str, Any]) -> Device:
    fitted = FITTED[entry["efficiency"]]
    kernel = KERNELS[entry["attention"]] if entry.get("attention") else None
    return Device(
        entry["name"],
        int(entry["memory_gib"] * GiB),
        entry["bf16_flops"],
        entry["bandwidth"],
        entry["source"],
        cuda=entry["cuda"],
        link=entry["link"],
        efficiency=fitted["value"],
        efficiency_source=fitted["source"],
        host_link=entry["host_link"],
        attention_flops=kernel["flops"] if kernel else 0.0,
        attention_source=kernel["source"] if kernel else "",
    )


#: The devices of the data file, by name: datasheet figures (dense; the sparse figures are
#: twice these), memory as PyTorch reports it (read off torchtitan's logs, ``memory_source``)
DEVICES: dict[str, Device] = {e["name"]: _device(e) for e in WORLD["devices"]}


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
