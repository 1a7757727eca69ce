"""How a device plan reads: its layout beside the device, and its step's line."""

from __future__ import annotations

from .devices import Target
from .step_time import StepTime

__all__ = ["layout_text", "step_line"]


def layout_text(t: Target) -> str:
    """The layout beyond FSDP and TP's degrees: TP's sequence and loss parallelism, EP, the
    replicas (DDP, HSDP, ZeRO), CP, GQA's repeat, the pipeline."""
    return _tp_layout(t) + _more_layout(t)


def step_line(step: StepTime, measured: bool) -> str:
    how = "layers measured on the device, the head estimated" if measured else "estimated"
    comms = ", ".join(f"{k} {v:.3f}" for k, v in step.terms().items() if k != "compute" and v)
    moved = f"; offload copies {step.transfer:.3f} s, {step.offload:.3f} exposed" if step.transfer else ""
    return (
        f"  step: {step.seconds:.3f} s {how} (compute {step.compute:.3f}"
        + (f", exposed communication: {comms}" if comms else "")
        + moved
        + f"); {step.tokens_per_second:,.0f} tokens/s per GPU, MFU {step.mfu:.1%}"
    )


def _more_layout(t: Target) -> str:
    parts = [f"ep {t.layout.ep}"] if t.layout.ep > 1 else []
    parts += ["FSDP not resharding after the forward"] if not t.layout.fsdp_reshard_after_forward else []
    if t.layout.replicate > 1:
        parts.append(
            f"{'HSDP ' if t.layout.fsdp > 1 else 'DDP '}{t.layout.replicate} replicas"
            + (f", ZeRO-{t.layout.zero}" if t.layout.zero else "")
        )
    parts += [f"cp {t.layout.cp}"] if t.layout.cp > 1 else []
    parts += ["keys and values repeated"] if t.workload.repeat_kv else []
    if t.layout.pp > 1:
        parts.append(
            f"pp {t.layout.pp} {t.layout.pp_schedule}, {t.microbatches} microbatches of {t.layout.microbatch_size}"
            + (", weight pass recomputing once" if t.layout.pp_recompute_once else "")
            + (", outputs returned" if t.layout.pp_return_outputs else "")
        )
    return "".join(f", {p}" for p in parts)


def _tp_layout(t: Target) -> str:
    if t.layout.tp == 1:
        return ""
    parts = [
        name
        for name, on in (("sequence", t.layout.sequence_parallel), ("loss", t.layout.loss_parallel))
        if on
    ]
    return f" ({' and '.join(parts)} parallel)" if parts else " (no sequence or loss parallel)"
