"""A training step's shape on a device (:class:`Target`), and the devices a plan is made for
(:class:`Device`, :data:`DEVICES`: their figures and sources are in :mod:`.catalog`).

>>> t = Target("h100-80gb", memory="80GB", fsdp=8, batch=1, seq=8192)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..memory import Memory, parse_memory
from . import catalog
from .catalog import DEVICES, EAGER_SLOWDOWN, Device, device, present
from .host import HOST_LINKS, HostLink, check_target
from .layout import LAYOUT_FIELDS, Layout, check_flags, check_positive

__all__ = [
    "DEVICES",
    "EAGER_SLOWDOWN",
    "LOSSES",
    "Device",
    "Layout",
    "Machine",
    "Target",
    "Workload",
    "device",
    "parse_loss",
    "parse_memory",
    "present",
]


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
class Machine:
    """Where a step runs: the device, the memory a step may use on it, its links and host
    (the fields are :class:`Target`'s of the same names, documented there; ``device`` a
    :class:`Device`, ``memory`` and ``host_memory`` bytes once built)."""

    device: Device
    memory: int
    headroom: float = 0.05
    gpus_per_node: int = 8
    network: float = 400e9 / 8
    offload: bool = False
    host_memory: int | None = None
    host_link: str | None = None

    @classmethod
    def of(cls, device: Device | str = "h100-80gb", memory: Memory | None = None, **fields: Any) -> Machine:
        """A machine from a device kind (or :class:`Device`), ``memory`` as :mod:`sac_compile.memory`
        reads it (bytes, ``"80GiB"``, a fraction of the device's) and ``host_memory`` as bytes
        or ``"256GB"``."""
        dev = catalog.device(device)
        used = dev.memory if memory is None else parse_memory(memory, dev.memory, of="the device's memory")
        if used <= 0:
            raise ValueError(f"Target(memory={memory!r}): more than 0 bytes")
        host = fields.pop("host_memory", None)
        if host is not None:
            host = parse_memory(host, name="host_memory")
        return cls(dev, used, host_memory=host, **fields)

    def __post_init__(self) -> None:
        check_target(self, self.device.cuda, self.device.name)
        check_positive(self, ("gpus_per_node",))
        if isinstance(self.network, bool) or not isinstance(self.network, (int, float)) or self.network <= 0:
            raise ValueError(
                f"Target(network={self.network!r}): bytes/s per GPU between nodes, > 0 (400 Gb/s: 50e9)"
            )
        if not 0.0 <= self.headroom < 1.0:
            raise ValueError(f"Target(headroom={self.headroom!r}): a fraction in [0, 1)")

    @property
    def usable(self) -> int:
        """The bytes a plan may use: ``memory`` less the headroom."""
        return int(self.memory * (1.0 - self.headroom))

    @property
    def host(self) -> HostLink:
        """The :class:`~sac_compile.planning.host.HostLink` offloaded values cross."""
        return HOST_LINKS[self.host_link or self.device.host_link]


@dataclass(frozen=True)
class Workload:
    """What a step trains: per-device batch and sequence, the loss, the dtypes and the
    optimizer (the fields are :class:`Target`'s of the same names, documented there; the
    dtypes :class:`torch.dtype` once built)."""

    batch: int = 1
    seq: int = 4096
    loss: str = "transformers"
    repeat_kv: bool = False
    param_dtype: torch.dtype = torch.bfloat16
    master_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        check_positive(self, ("batch", "seq"))
        try:
            parse_loss(self.loss)
        except ValueError as e:
            raise ValueError(f"Target({e}") from None
        check_flags(self, ("repeat_kv",))
        for name in ("param_dtype", "master_dtype", "reduce_dtype"):
            object.__setattr__(self, name, _dtype(getattr(self, name), name))
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"Target(optimizer={self.optimizer!r}): one of {', '.join(OPTIMIZER_STATES)}")


_PARTS = {
    "machine": frozenset(f.name for f in dataclasses.fields(Machine)),
    "layout": LAYOUT_FIELDS,
    "workload": frozenset(f.name for f in dataclasses.fields(Workload)),
}


def _only(fields: dict[str, Any], part: str) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if k in _PARTS[part]}


@dataclass(frozen=True, init=False)
class Target:
    """A training step on a device: what a plan must fit. It is three parts: the
    :class:`Machine` it runs on (``target.machine``: the device, its memory, links and host),
    the :class:`~sac_compile.planning.layout.Layout` over devices (``target.layout``: the
    parallel degrees, the pipeline) and the :class:`Workload` (``target.workload``: batch,
    sequence, loss, dtypes, optimizer). It is built from their fields as keywords
    (``Target("h100-80gb", fsdp=8, batch=2)``) or from the parts (``layout=``, ``workload=``;
    a keyword of one of their fields then changes that field).

    Args:
        device: a kind from :data:`DEVICES`, ``"cpu"``, or a :class:`Device`.
        memory: the memory a step may use per device (:mod:`sac_compile.memory`: bytes,
            ``"80GiB"``, or a float: that fraction of the device's memory); default the device's.
        fsdp: FSDP degree: parameters, gradients and optimizer state sharded this many ways;
            a layer's parameters (and in the backward its gradients) unsharded while it runs.
        fsdp_reshard_after_forward: FSDP2's ``reshard_after_forward`` on every layer (default
            ``True``); ``False`` (torchtitan's ``--parallelism.fsdp_reshard_after_forward
            never``) keeps each layer's parameters unsharded from its forward to its backward:
            the backward gathers none again, and every layer's unsharded parameters are held at
            the backward's start. Under ``pp`` a stage's parameters stay unsharded either way
            (torchtitan's setting under PP).
        tp: tensor-parallel degree, laid out as torchtitan lays out Llama: each layer's
            projections split column- / row-wise, so its weights and the activations between
            them are split ``tp`` ways (:mod:`sac_compile.planning.parallel`).
        sequence_parallel: with ``tp``, the residual stream between the projections split on
            the sequence too (torchtitan's default; a kept region saves the input it gathers).
        loss_parallel: with ``tp``, the logits split on the vocabulary and the loss computed
            on the shards (torchtitan's default): the head's logits and loss terms ``1 / tp``.
        pp_recompute_once: a split-backward schedule's weight pass recomputes each
            checkpointed layer once, not once per weight group (the stages wrapped by
            :func:`sac_compile.pipelining.recompute_once`; :mod:`.split_backward`).
        pp_return_outputs: the pipeline schedule's ``step`` returns the last stage's outputs
            (PyTorch's default, ``return_outputs=True``; before that flag, 2025-10, always):
            the last stage keeps every microbatch's output (the logits) from its forward to
            the next step, and concatenates them at the step's end. Default ``False``, as
            torchtitan steps since 2025-10-22 (:mod:`.pipeline`).
        async_tp: with ``tp`` and compiled layers, Inductor's micro-pipelined TP (torchtitan's
            ``enable_async_tensor_parallel``): each all-gather / reduce-scatter split into
            ``tp`` chunks run under the projection matmuls beside it (:mod:`.step_time`).
        loss: how the trainer's loss holds the logits, one of :data:`LOSSES` (default
            ``"transformers"``; ``"chunked:N"``).
        repeat_kv: the trainer repeats grouped-query attention's keys and values to the
            query's heads before the kernel (torchtitan's Llama until 2026-01, transformers'
            SDPA path when handed a mask): the layer is traced so (:mod:`.kernels`), its keys
            and values, their gradients and the ring's buffers the query's heads wide. Default
            ``False``: the kernel takes them grouped (FlashAttention-2, cuDNN; torchtitan's
            ``enable_gqa``). A GPU target's; nothing for a model without grouped queries.
        ep: expert-parallel degree (torchtitan's layout: a divisor of ``fsdp``): an MoE
            layer's routed experts split this many ways and FSDP-sharded over the other
            ``fsdp / ep``, so only ``1 / ep`` of them is all-gathered while the layer runs.
            Without FSDP, a divisor of ``replicate``: the experts split ``ep`` ways over the
            data-parallel replicas, the rest replicated.
        replicate: data-parallel replicas: with ``fsdp`` 1, DDP (every parameter, gradient
            and optimizer state whole on every rank; PyTorch's DDP keeps its gradient buckets,
            a second gradient-sized copy, ``gradient_as_bucket_view=False``); with ``fsdp``
            above 1, HSDP (``replicate`` x ``fsdp``: sharded ``fsdp`` ways, the sharded
            gradients all-reduced over the replicas).
        zero: with DDP (``replicate`` above 1, ``fsdp`` 1), ZeRO stage 1 (the optimizer
            state sharded over the replicas) or 2 (the gradients too); 0 none.
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
        pp_schedule: one of PyTorch's schedules (:data:`PP_SCHEDULES`: ``"1f1b"``, the
            default, ``"gpipe"``, ``"interleaved-1f1b"``, ``"looped-bfs"``,
            ``"interleaved-zero-bubble"``, ``"zbv-zero-bubble"``, ``"dualpipev"``; PyTorch's
            names, ``"Interleaved1F1B"``, too): the microbatches each stage holds at every
            backward are read off its actions (:mod:`.pipeline`).
        pp_virtual_stages: stages a rank runs (the interleave degree): 1 for GPipe and
            1F1B, 2 for the V-shaped ZBV and DualPipeV, any from 2 (default 2) for the
            looped ones.
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

    machine: Machine
    layout: Layout
    workload: Workload

    def __init__(
        self,
        device: Device | str | None = None,
        memory: Memory | None = None,
        *,
        machine: Machine | None = None,
        layout: Layout | None = None,
        workload: Workload | None = None,
        **fields: Any,
    ) -> None:
        unknown = sorted(set(fields) - _PARTS["machine"] - _PARTS["layout"] - _PARTS["workload"])
        if unknown:
            names = ", ".join(sorted(_PARTS["machine"] | _PARTS["layout"] | _PARTS["workload"]))
            raise TypeError(
                f"Target() got unexpected keyword(s) {', '.join(unknown)}: the fields are {names}"
            )
        own = {k: fields.pop(k) for k in list(fields) if k in _PARTS["machine"]}
        if machine is not None:  # its fields, those given changed
            own = {f: getattr(machine, f) for f in _PARTS["machine"] - {"device", "memory"}} | own
            device, memory = device or machine.device, machine.memory if memory is None else memory
        machine = Machine.of("h100-80gb" if device is None else device, memory, **own)
        layout = dataclasses.replace(layout or Layout(), **_only(fields, "layout"))
        workload = dataclasses.replace(workload or Workload(), **_only(fields, "workload"))
        object.__setattr__(self, "machine", machine)
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "workload", workload)
        self._check()

    def _check(self) -> None:
        """What one part's fields cannot check alone."""
        layout, work, dev = self.layout, self.workload, self.machine.device
        if work.repeat_kv and not dev.cuda:
            raise ValueError(
                f"Target(repeat_kv=True) on {dev.name}: it traces a GPU's attention layout; a {dev.name} target "
                "runs the attention transformers calls there (drop repeat_kv, or name a GPU device)"
            )
        if layout.pp > 1 and work.batch % layout.microbatch_size:
            raise ValueError(
                f"Target(batch={work.batch}, microbatch_size={layout.microbatch_size}): with pp the batch is split "
                "into microbatches: microbatch_size divides batch"
            )
        if layout.pp > 1:
            from .pipeline import rank_schedules

            try:
                rank_schedules(self)
            except ValueError as e:
                raise ValueError(f"Target(pp={layout.pp}, pp_schedule={layout.pp_schedule!r}): {e}") from None
        if layout.pp_recompute_once and not self.weight_pass:
            raise ValueError(
                f"Target(pp_recompute_once=True, pp={layout.pp}, pp_schedule={layout.pp_schedule!r}): it plans a "
                "split backward's weight pass recomputing each checkpointed layer once "
                "(sac_compile.pipelining.recompute_once); this layout runs no weight pass (a zero-bubble schedule "
                "or DualPipeV with pp above 1, or drop pp_recompute_once)"
            )
        if work.seq % layout.cp:
            raise ValueError(
                f"Target(seq={work.seq}, cp={layout.cp}): the sequence is split cp ways: cp divides seq"
            )

    @property
    def weight_pass(self) -> bool:
        """Whether the pipeline's schedule splits a stage's backward into its input's gradient
        (``I``) and its weights' (``W``): the zero-bubble schedules, DualPipeV."""
        if self.layout.pp == 1:
            return False
        from .pipeline import rank_schedules

        return any(m.kind == "W" for r in rank_schedules(self) for m in r.moments)

    @property
    def microbatches(self) -> int:
        """Microbatches a step runs (1 without pipeline parallelism)."""
        layout = self.layout
        return self.workload.batch // layout.microbatch_size if layout.pp > 1 else 1

    @property
    def traced(self) -> tuple[int, int]:
        """``(batch, seq)`` one layer is measured at: one microbatch of one rank's share of the
        sequence."""
        layout, work = self.layout, self.workload
        return (layout.microbatch_size if layout.pp > 1 else work.batch), work.seq // layout.cp

    @property
    def measured(self) -> tuple[Any, ...]:
        """What measuring one layer depends on: targets equal here trace a model alike (the
        rest, the layout, memory and links, is priced after): whether the target runs a GPU's
        kernels, the parameters' dtype, the traced shape, ``repeat_kv`` and ``offload``."""
        work = self.workload
        return (self.machine.device.cuda, work.param_dtype, self.traced, work.repeat_kv, self.machine.offload)

    def compute_seconds(self, flops: float, traffic: float = 0.0) -> float:
        """Seconds one rank computes ``flops`` costly FLOPs and moves ``traffic`` memory-bound
        bytes (a whole step's worth, split ``tp`` ways): the device's roofline over the
        efficiency a published run reached (:mod:`.step_time`)."""
        d = self.machine.device
        return (flops / d.bf16_flops + traffic / d.bandwidth) / d.efficiency / self.layout.tp

    def attention_seconds(self, flops: float) -> float:
        """Seconds one rank runs ``flops`` attention FLOPs (split ``tp`` ways): at the rate
        the device's attention kernel was measured at, else as :meth:`compute_seconds`."""
        rate = self.machine.device.attention_flops
        return flops / rate / self.layout.tp if rate else self.compute_seconds(flops)

    def replace(self, **changes: Any) -> Target:
        """This target with ``changes``: any part's field by name, or a whole part."""
        return Target(machine=self.machine, layout=self.layout, workload=self.workload, **changes)


#: optimizer -> states kept per parameter (in ``master_dtype``)
OPTIMIZER_STATES = {"adamw": 2, "sgd": 0, "sgd-momentum": 1}
