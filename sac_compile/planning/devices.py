"""A training step's shape on a device (:class:`Target`), and the devices a plan is made for
(:class:`Device`, :data:`DEVICES`: their figures and sources are in :mod:`.catalog`).

>>> t = Target("h100-80gb", memory="80GB", fsdp=8, batch=1, seq=8192)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from .._compat.pipelining import SCHEDULES
from ..memory import Memory, parse_memory
from .catalog import DEVICES, EAGER_SLOWDOWN, Device, device, present
from .host import HOST_LINKS, HostLink, check_target

__all__ = [
    "DEVICES",
    "EAGER_SLOWDOWN",
    "LOSSES",
    "Device",
    "Target",
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
        pp_recompute_once: a split-backward schedule's weight pass recomputes each
            checkpointed layer once, not once per weight group (the stages wrapped by
            :func:`sac_compile.pipelining.recompute_once`; :mod:`.split_backward`).
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

    device: Device | str = "h100-80gb"
    memory: Memory | None = None
    fsdp: int = 1
    tp: int = 1
    ep: int = 1
    replicate: int = 1
    zero: int = 0
    sequence_parallel: bool = True
    loss_parallel: bool = True
    async_tp: bool = False
    loss: str = "transformers"
    repeat_kv: bool = False
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
    pp_virtual_stages: int | None = None
    microbatch_size: int = 1
    pp_recompute_once: bool = False
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
        for name in (
            "fsdp",
            "tp",
            "ep",
            "cp",
            "pp",
            "replicate",
            "batch",
            "seq",
            "microbatch_size",
            "gpus_per_node",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Target({name}={value!r}): a positive int")
        try:
            parse_loss(self.loss)
        except ValueError as e:
            raise ValueError(f"Target({e}") from None
        if self.repeat_kv and not dev.cuda:
            raise ValueError(
                f"Target(repeat_kv=True) on {dev.name}: it traces a GPU's attention layout; a {dev.name} target "
                "runs the attention transformers calls there (drop repeat_kv, or name a GPU device)"
            )
        for name in ("sequence_parallel", "loss_parallel", "repeat_kv", "async_tp"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Target({name}={getattr(self, name)!r}): True or False")
        if self.async_tp and (self.tp == 1 or not self.sequence_parallel):
            raise ValueError(
                f"Target(async_tp=True, tp={self.tp}, sequence_parallel={self.sequence_parallel}): async TP "
                "overlaps sequence parallelism's all-gathers and reduce-scatters with the projections: it needs "
                "tp above 1 with sequence_parallel (drop async_tp, or raise tp)"
            )
        object.__setattr__(self, "pp_schedule", _schedule(self.pp_schedule))
        if self.pp > 1 and self.batch % self.microbatch_size:
            raise ValueError(
                f"Target(batch={self.batch}, microbatch_size={self.microbatch_size}): with pp the batch is split "
                "into microbatches: microbatch_size divides batch"
            )
        self._check_stages()
        if self.seq % self.cp:
            raise ValueError(
                f"Target(seq={self.seq}, cp={self.cp}): the sequence is split cp ways: cp divides seq"
            )
        self._check_data_parallel()
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

    def _check_data_parallel(self) -> None:
        if self.fsdp > 1 and self.fsdp % self.ep:
            raise ValueError(
                f"Target(ep={self.ep}, fsdp={self.fsdp}): the expert-parallel degree divides the FSDP degree "
                "(experts are split ep ways and FSDP-sharded over the other fsdp / ep)"
            )
        if self.fsdp == 1 and self.ep > 1 and self.replicate % self.ep:
            raise ValueError(
                f"Target(ep={self.ep}, replicate={self.replicate}): without FSDP the experts are split over the "
                "data-parallel replicas: ep divides replicate"
            )
        if self.zero not in (0, 1, 2) or isinstance(self.zero, bool):
            raise ValueError(
                f"Target(zero={self.zero!r}): 0 (none), 1 (optimizer state sharded) or 2 (gradients too)"
            )
        if self.zero and (self.replicate == 1 or self.fsdp > 1):
            raise ValueError(
                f"Target(zero={self.zero}, replicate={self.replicate}, fsdp={self.fsdp}): ZeRO shards over DDP's "
                "replicas: replicate above 1 and fsdp 1 (FSDP already shards all of it)"
            )

    def _check_stages(self) -> None:
        fixed, v = PP_SCHEDULES[self.pp_schedule], self.pp_virtual_stages
        runs_it = isinstance(v, int) and not isinstance(v, bool) and (v == fixed if fixed else v >= 2)
        if v is not None and not runs_it:
            runs = f"exactly {fixed}" if fixed else "2 or more"
            raise ValueError(
                f"Target(pp_virtual_stages={v!r}): {self.pp_schedule} runs {runs} stage(s) a rank "
                "(leave it unset for the schedule's default)"
            )
        if not isinstance(self.pp_recompute_once, bool):
            raise ValueError(f"Target(pp_recompute_once={self.pp_recompute_once!r}): True or False")
        if self.pp > 1:
            from .pipeline import rank_schedules

            try:
                rank_schedules(self)
            except ValueError as e:
                raise ValueError(f"Target(pp={self.pp}, pp_schedule={self.pp_schedule!r}): {e}") from None
        if self.pp_recompute_once and not self.weight_pass:
            raise ValueError(
                f"Target(pp_recompute_once=True, pp={self.pp}, pp_schedule={self.pp_schedule!r}): it plans a split "
                "backward's weight pass recomputing each checkpointed layer once "
                "(sac_compile.pipelining.recompute_once); this layout runs no weight pass (a zero-bubble schedule "
                "or DualPipeV with pp above 1, or drop pp_recompute_once)"
            )

    @property
    def weight_pass(self) -> bool:
        """Whether the pipeline's schedule splits a stage's backward into its input's gradient
        (``I``) and its weights' (``W``): the zero-bubble schedules, DualPipeV."""
        if self.pp == 1:
            return False
        from .pipeline import rank_schedules

        return any(m.kind == "W" for r in rank_schedules(self) for m in r.moments)

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages a rank runs: ``pp_virtual_stages``, else its schedule's default."""
        return self.pp_virtual_stages or PP_SCHEDULES[self.pp_schedule] or 2

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
    def measured(self) -> tuple[Any, ...]:
        """What measuring one layer depends on: targets equal here trace a model alike (the
        rest, the layout, memory and links, is priced after): whether the target runs a GPU's
        kernels, the parameters' dtype, the traced shape, ``repeat_kv`` and ``offload``."""
        return (self.device.cuda, self.param_dtype, self.traced, self.repeat_kv, self.offload)  # type: ignore[union-attr]

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


#: pipeline schedule -> the stages a rank runs (0: any from 2, default 2), PyTorch's
#: ``torch.distributed.pipelining`` schedules (:data:`~sac_compile._compat.pipelining.SCHEDULES`)
PP_SCHEDULES = {name: v or 0 for name, (_, v) in SCHEDULES.items()}
_SCHEDULE_NAMES = {
    key.replace("-", "").replace("_", "").lower(): name
    for name, (torch_name, _) in SCHEDULES.items()
    for key in (name, torch_name)
}


def _schedule(name: str) -> str:
    """A schedule's name here from ours or PyTorch's (any case, ``-`` / ``_`` ignored)."""
    found = _SCHEDULE_NAMES.get(str(name).replace("-", "").replace("_", "").lower())
    if found is None:
        raise ValueError(
            f"Target(pp_schedule={name!r}): one of {', '.join(PP_SCHEDULES)} (or PyTorch's names)"
        )
    return found


#: optimizer -> states kept per parameter (in ``master_dtype``)
OPTIMIZER_STATES = {"adamw": 2, "sgd": 0, "sgd-momentum": 1}
