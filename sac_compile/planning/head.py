"""The head's terms of a step's peak: the final norm's saves, the logits and the loss's, by
the target's loss (:data:`~sac_compile.planning.devices.LOSSES`) and layout."""

from __future__ import annotations

from .devices import Target, parse_loss
from .sizes import ModelSizes

__all__ = [
    "head_logits_bytes",
    "head_terms",
    "held_heads",
    "logits_split",
    "pipeline_head",
    "returned_output",
]


def logits_split(target: Target) -> int:
    return target.layout.tp if target.layout.loss_parallel else 1


def head_logits_bytes(model: ModelSizes, target: Target) -> int:
    """The logits' share of the head's peak (before any loss parallelism), by ``target.workload.loss``
    (:data:`~sac_compile.planning.devices.LOSSES`): the float32 log-softmax held and two
    gradients of it in its backward, and for transformers' loss the model's own logits alive
    in its output; a compiled loss the model's logits and their gradient; a chunked loss one
    chunk's logits, log-softmax and gradient. With loss parallelism the backward is DTensor's
    (``torch.distributed.tensor.parallel.loss``: log-softmax's backward folded into
    nll_loss's, ``(zeros + exp(x)) * grad``): beside the held log-softmax, three at once."""
    kind, chunks = parse_loss(target.workload.loss)
    if kind == "compiled":  # the logits saved and their gradient, in the model's dtype
        return 2 * _output(model)
    held = 4 if logits_split(target) > 1 else 3
    if kind == "chunked":
        return held * model.logits_bytes // chunks
    return held * model.logits_bytes + (model.model_logits_bytes if kind == "transformers" else 0)


def head_terms(model: ModelSizes, target: Target) -> int:
    """The head's saved values and its backward's temporaries per device: the logits' and
    loss's split ``tp`` ways with loss parallelism, the final norm's with sequence parallelism."""
    tp = target.layout.tp
    logits = model.head_saved_bytes - model.head_stream_bytes + model.head_transient_bytes
    if model.logits_bytes:
        logits = head_logits_bytes(model, target)
    logits = logits // logits_split(target)
    stream = model.head_stream_bytes
    if target.layout.sequence_parallel and tp > 1:  # the final norm's saves split; of its three hidden-sized
        # values the output, all-gathered for the column-parallel output projection, is whole
        stream = stream // 3 + 2 * stream // 3 // tp
    return logits + stream


def pipeline_head(model: ModelSizes, target: Target, in_flight: float, split: int = 0) -> int:
    """The last stage's head terms: PyTorch's pipelining keeps each microbatch's stage output
    (the logits) until that microbatch's backward, beside what its loss saves, for every
    microbatch in flight; of those, the ``split`` whose split backward's ``I`` ran hold only
    the gradient it recorded at the output projection (logits-sized: the loss's graph died
    with the detached loss, the output left the stage's cache)."""
    kind, _ = parse_loss(target.workload.loss)
    output = _output(model)
    now = head_terms(model, target) + (output if kind != "transformers" else 0) // logits_split(target)
    return now + held_heads(model, target, int(in_flight - 1), split)


def held_heads(model: ModelSizes, target: Target, held: int, split: int = 0) -> int:
    """What the last stage's ``held`` microbatches in flight beside a running one keep of the
    head per device: each its output (the logits, in the stage's cache) and what its loss
    saved (a log-softmax), but the ``split`` whose ``I`` ran, which keep the logits-sized
    gradient it recorded at the output projection."""
    kind, _ = parse_loss(target.workload.loss)
    output = _output(model)
    saved = model.logits_bytes if kind in ("transformers", "torchtitan") else 0  # (the log-softmax)
    return int(((held - split) * (output + saved) + split * output) / logits_split(target))


def returned_output(model: ModelSizes, target: Target) -> int:
    """One microbatch's output of the last pipeline stage per device (the model's logits,
    split on the vocabulary with loss parallelism): what a schedule that returns its outputs
    keeps of each microbatch to the next step (``Target.pp_return_outputs``)."""
    return _output(model) // logits_split(target)


def _output(model: ModelSizes) -> int:
    """The last stage's output per microbatch, whole: the model's logits (in its dtype)."""
    return model.model_logits_bytes or model.logits_bytes
