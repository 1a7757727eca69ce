"""What a step's peak is composed from: each kind of layer's figures and the model's sizes
outside its layers (:mod:`.peak` composes them; :mod:`.figures` and ``hf.plan`` fill them)."""

from __future__ import annotations

from dataclasses import dataclass

from .devices import Target

__all__ = ["LayerFigures", "ModelSizes"]


@dataclass(frozen=True)
class LayerFigures:
    """One kind of layer: how many, and per layer (per device) its parameters, the bytes it
    holds for the backward and its backward's transient."""

    count: int
    params: int  # parameters (elements, whole, before any sharding)
    saved_bytes: int
    transient_bytes: int
    expert_params: int = 0  # of ``params``, the routed experts' (split by expert parallelism)
    # eager offload on a GPU: the layer's offloaded values, held on the device until the compute
    # stream has waited for their copies (the last layer's through the loss: eager/host_copy.py)
    offloaded_bytes: int = 0
    # the gradients its weights' gradients are computed from (graph_memory.weight_gradient_inputs),
    # per device: a zero-bubble schedule's split backward holds them from I to W
    weight_gradient_inputs: int = 0
    # what a split backward's W recomputes and leaves alive until the stage's W ends, and its
    # most alive (planning.split_backward), per device
    split_recompute: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class ModelSizes:
    """What the step's terms need of the model outside its layers."""

    params: int  # every parameter (elements)
    head_saved_bytes: int  # held for the backward outside the layers (embedding out, norm, logits / loss)
    head_transient_bytes: int  # the loss's and the head's backward temporaries
    head_flops: int = 0  # the output projection's forward and backward FLOPs
    # of head_saved_bytes, the residual stream's (the final norm's saves: the rest is logits)
    head_stream_bytes: int = 0
    # where set, the head's logits terms follow the target's loss (Target.loss) instead of
    # head_saved_bytes / head_transient_bytes: the float32 logits' bytes, and the model's own
    # logits' (in param_dtype; 0 when that is float32)
    logits_bytes: int = 0
    model_logits_bytes: int = 0
    head_traffic: int = 0  # bytes the loss's memory-bound ops move (forward and backward)
    # for the step's communication (planning.step_time): the tokens a data-parallel rank
    # runs a step, the residual stream's width, and the experts a token is routed to
    tokens: int = 0  # (of one microbatch, one rank's share of the sequence)
    hidden_size: int = 0
    top_k: int = 0
    embedding_params: int = 0  # the input embeddings' (on the first pipeline stage); 0: half the rest
    largest_tensor: int = 0  # the layers' largest parameter (elements); 0: a whole layer's
    kv_bytes: int = 0  # one layer's keys and values at the traced shape (what ring attention passes)

    def stage_stream_bytes(self, target: Target) -> int:
        """One microbatch's residual stream as a pipeline stage passes it to the next: a
        rank's share (split ``tp`` ways with sequence parallelism, as torchtitan's stages
        pass it), in the target's ``param_dtype``."""
        width = target.workload.param_dtype.itemsize
        return (
            self.tokens
            * self.hidden_size
            * width
            // (target.layout.tp if target.layout.sequence_parallel else 1)
        )
