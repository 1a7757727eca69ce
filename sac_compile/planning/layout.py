"""How a training step is laid out over devices (:class:`Layout`): the data-parallel,
tensor-parallel, expert-parallel, context-parallel and pipeline degrees and the settings that
go with them. One of a :class:`~sac_compile.planning.devices.Target`'s three parts (with its
:class:`~sac_compile.planning.devices.Machine` and :class:`~sac_compile.planning.devices.Workload`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .._compat.pipelining import SCHEDULES

__all__ = ["LAYOUT_FIELDS", "PP_SCHEDULES", "Layout", "check_flags", "check_positive"]

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


def check_positive(part: object, names: tuple[str, ...]) -> None:
    """Refuse a field of ``part`` (a part of a ``Target``) that is not a positive int."""
    for name in names:
        value = getattr(part, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"Target({name}={value!r}): a positive int")


def check_flags(part: object, names: tuple[str, ...]) -> None:
    """Refuse a field of ``part`` (a part of a ``Target``) that is not True or False."""
    for name in names:
        if not isinstance(getattr(part, name), bool):
            raise ValueError(f"Target({name}={getattr(part, name)!r}): True or False")


@dataclass(frozen=True)
class Layout:
    """The parallel layout of a step (the fields are :class:`~sac_compile.planning.devices.Target`'s
    of the same names, documented there). Each field is checked on its own here; what
    depends on the workload too (microbatches dividing the batch, ``cp`` dividing the
    sequence, the schedule's actions) is checked by the ``Target``."""

    fsdp: int = 1
    fsdp_reshard_after_forward: bool = True
    tp: int = 1
    ep: int = 1
    replicate: int = 1
    zero: int = 0
    sequence_parallel: bool = True
    loss_parallel: bool = True
    async_tp: bool = False
    cp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int | None = None
    microbatch_size: int = 1
    pp_recompute_once: bool = False
    pp_return_outputs: bool = False

    def __post_init__(self) -> None:
        check_positive(self, ("fsdp", "tp", "ep", "cp", "pp", "replicate", "microbatch_size"))
        check_flags(
            self,
            (
                "fsdp_reshard_after_forward",
                "sequence_parallel",
                "loss_parallel",
                "async_tp",
                "pp_recompute_once",
                "pp_return_outputs",
            ),
        )
        if self.async_tp and (self.tp == 1 or not self.sequence_parallel):
            raise ValueError(
                f"Target(async_tp=True, tp={self.tp}, sequence_parallel={self.sequence_parallel}): async TP "
                "overlaps sequence parallelism's all-gathers and reduce-scatters with the projections: it needs "
                "tp above 1 with sequence_parallel (drop async_tp, or raise tp)"
            )
        object.__setattr__(self, "pp_schedule", _schedule(self.pp_schedule))
        fixed, v = PP_SCHEDULES[self.pp_schedule], self.pp_virtual_stages
        runs_it = isinstance(v, int) and not isinstance(v, bool) and (v == fixed if fixed else v >= 2)
        if v is not None and not runs_it:
            runs = f"exactly {fixed}" if fixed else "2 or more"
            raise ValueError(
                f"Target(pp_virtual_stages={v!r}): {self.pp_schedule} runs {runs} stage(s) a rank "
                "(leave it unset for the schedule's default)"
            )
        if self.pp_return_outputs and self.pp == 1:
            raise ValueError(
                "Target(pp_return_outputs=True, pp=1): it plans a pipeline schedule's step keeping the last "
                "stage's outputs to return them; there is no pipeline (raise pp, or drop pp_return_outputs)"
            )
        self._check_data_parallel()

    def _check_data_parallel(self) -> None:
        if not self.fsdp_reshard_after_forward and self.fsdp * self.cp == 1:
            raise ValueError(
                f"Target(fsdp_reshard_after_forward=False, fsdp={self.fsdp}, cp={self.cp}): it plans FSDP2 keeping "
                "each layer's parameters unsharded from its forward to its backward; nothing is sharded here "
                "(raise fsdp, or drop fsdp_reshard_after_forward)"
            )
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

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages a rank runs: ``pp_virtual_stages``, else its schedule's default."""
        return self.pp_virtual_stages or PP_SCHEDULES[self.pp_schedule] or 2

    @property
    def stages(self) -> int:
        """The pipeline's stages, every rank's: ``pp * stages_per_rank`` (the last is ``stages - 1``)."""
        return self.pp * self.stages_per_rank


#: the names of :class:`Layout`'s fields (a ``Target`` keyword of these names sets its layout)
LAYOUT_FIELDS = frozenset(f.name for f in fields(Layout))
