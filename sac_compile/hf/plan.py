"""Planning a transformers model for a device: :func:`plan_for_device` (``hf.plan_for(...,
device=...)``), :func:`step_figures` and :func:`predict_peak` (re-exported by
:mod:`sac_compile.hf`). Method: ``docs/planning.md`` (planning for a device)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn as nn

from .._compat.aot import meta_rng_states
from .._compat.dynamo import unwrap_compiled
from .._compat.transformers import grouped_query_sdpa
from ..keep import Keep, Regions
from ..memory import Memory
from ..planning import ModelPlan, plan_model
from ..planning.devices import Target
from ..planning.peak import ModelSizes, Peak
from .layers import layer_regions, merged, read_stacks, report_unchecked, vocab_size

if TYPE_CHECKING:
    from ..planning.device_plan import DevicePlan
    from ..planning.step_time import StepTime

__all__ = ["StepFigures", "plan_for_device", "predict_peak", "step_figures"]


def plan_for_device(
    model: nn.Module,
    memory: Memory | None,
    read: list[tuple[str, dict[str, str]]],
    batch: int,
    seq: int,
    inputs: dict[str, Any] | None,
    device: Any,
    parallel: dict[str, Any],
    compile: bool,
    options: dict[str, Any],
) -> DevicePlan:
    """``hf.plan_for`` with ``device``: see its docstring. ``parallel``: its ``fsdp``, ``tp``,
    ``ep`` and ``loss``."""
    from ..planning.device_plan import choose

    root = unwrap_compiled(model)
    meta = any(p.is_meta for p in root.parameters())
    loss = parallel.pop("loss") or "transformers"
    if isinstance(device, Target):
        target = device if memory is None else device.replace(memory=memory)
        target = target if loss == "transformers" else target.replace(loss=loss)
    else:
        dtype = torch.bfloat16 if meta else next(root.parameters()).dtype
        target = Target(device, memory=memory, batch=batch, seq=seq, param_dtype=dtype, loss=loss, **parallel)
    if options.get("estimator") == "time":
        where = next(root.parameters()).device
        here = "cuda" if target.machine.device.cuda else "cpu"
        if not compile or where.type != here or (here == "cuda" and not torch.cuda.is_available()):
            raise ValueError(
                f"estimator='time' measures compiled steps on the device itself: a model on {here} planned with "
                f"compile=True (this one is on {where.type}, compile={compile}); for {target.machine.device.name} from "
                "another machine the step is estimated (planning.step_time; estimator='flops', the default)"
            )
    if target.layout.async_tp and not compile:
        raise ValueError(
            f"plan_for(compile=False) with Target(async_tp=True, tp={target.layout.tp}): async TP is an Inductor pass, "
            "eager layers run their collectives as they are (compile=True, or drop async_tp)"
        )
    if options.get("offload") and not target.machine.offload:
        raise ValueError(
            "plan_for(offload=True, device=...): a device plan offloads within the host memory of its target: "
            "pass device=Target(..., offload=True, host_memory='256GB') instead"
        )
    if not compile:
        options.setdefault("budgets", (None,))
    options.setdefault("eager", not compile and not meta)
    options["offload"] = target.machine.offload
    planned, params, sizes, inputs = _measure(model, read, target, inputs, options)
    return choose(planned.groups, params, sizes, target, compile=compile, layers=planned.layers)


def _measure(
    model: nn.Module,
    read: list[tuple[str, dict[str, str]]],
    target: Target,
    inputs: dict[str, Any] | None,
    options: dict[str, Any],
) -> tuple[ModelPlan, tuple[Any, ...], Any, dict[str, Any]]:
    """One plan table per kind of layer of ``model``'s stacks ``read``, traced with the
    target's kernels (a model on the meta device, cast to ``param_dtype`` first; a model on
    a CUDA device runs its own), and the step's sizes."""
    from ..planning.kernels import target_kernels

    root = unwrap_compiled(model)
    where = next(root.parameters()).device
    if target.workload.repeat_kv and where.type == "cuda":
        raise ValueError(
            "Target(repeat_kv=True) traces the target's attention on the meta device or the CPU; a model on a "
            "CUDA device is measured running its own (transformers repeats keys and values when handed a "
            "mask): drop repeat_kv"
        )
    if where.type == "meta":
        root.to(target.workload.param_dtype)
    if inputs is None:
        inputs = _tokens(model, target, where)
    patterns = tuple(f"{path}.*" for path, _ in read)
    # (on the meta device, a recomputed dropout's RNG state is saved as on the CPU)
    rng = meta_rng_states() if where.type == "meta" else contextlib.nullcontext()
    gpu_kernels = target.machine.device.cuda and where.type != "cuda"
    with target_kernels(gpu_kernels, target.workload.repeat_kv), grouped_query_sdpa(gpu_kernels), rng:
        planned = plan_model(
            model, layers=patterns, memory=1.0, regions=merged(read), use_cache=False, **inputs, **options
        )
    params, sizes = _step_sizes(root, planned, target, inputs)
    return planned, params, sizes, inputs


def _tokens(model: nn.Module, target: Target, device: Any) -> dict[str, Any]:
    """A batch of random tokens the shape of ``target.traced`` (one microbatch, one rank's
    share of the sequence); for a vision-language model
    of a family :func:`_images` knows, one image a row taking about a quarter of the
    sequence (placeholders from position 1), so that its vision stack runs too."""
    g = torch.Generator().manual_seed(1)
    batch, seq = target.traced
    ids = torch.randint(0, vocab_size(model), (batch, seq), generator=g)
    inputs = {"input_ids": ids}
    images = _images(unwrap_compiled(model).config, batch, seq)
    if images is not None:
        tokens, extra = images
        token = cast(int, _image_token(unwrap_compiled(model).config))  # (not None: _images made images)
        ids[ids == token] = 0
        ids[:, 1 : 1 + tokens] = token
        inputs.update(extra)
        if "token_type_ids" in inputs:
            inputs["token_type_ids"] = (ids == token).long()
    return {k: v.to(device) for k, v in inputs.items()}


def _image_token(config: Any) -> int | None:
    token = getattr(config, "image_token_id", None)
    return getattr(config, "image_token_index", None) if token is None else token


#: vision-language families whose image inputs _images makes from the config alone
IMAGE_FAMILIES = ("llava", "gemma3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


def _images(config: Any, batch: int, seq: int) -> tuple[int, dict[str, Any]] | None:
    """``(image tokens a row, model inputs)`` for one image a row, or None for a model
    without a vision tower. A vision-language family not in :data:`IMAGE_FAMILIES` is a
    ``ValueError``: its image inputs are the caller's (``inputs=``)."""
    vision = getattr(config, "vision_config", None)
    if vision is None or _image_token(config) is None:
        return None
    kind = config.model_type
    g = torch.Generator().manual_seed(2)
    channels = getattr(vision, "in_channels", None) or getattr(vision, "in_chans", None) or 3
    if kind in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"):
        merge, patch = vision.spatial_merge_size, vision.patch_size
        side = max(int((seq // 4) ** 0.5), 1)  # merged patches a side
        grid = torch.tensor([[1, side * merge, side * merge]] * batch)
        flat = channels * vision.temporal_patch_size * patch * patch
        pixels = torch.randn(int(grid.prod(-1).sum()), flat, generator=g)
        return side * side, {"pixel_values": pixels, "image_grid_thw": grid}
    size: Any = getattr(vision, "image_size", None)  # (an int for gemma3 and llava, which read it)
    if kind == "gemma3":
        pixels = torch.randn(batch, channels, size, size, generator=g)
        return config.mm_tokens_per_image, {"pixel_values": pixels, "token_type_ids": None}
    if kind == "llava":
        tokens = (size // vision.patch_size) ** 2 + (config.vision_feature_select_strategy == "full")
        return tokens, {"pixel_values": torch.randn(batch, channels, size, size, generator=g)}
    raise ValueError(
        f"{type(config).__name__} ({kind!r}) has a vision tower, and sac_compile makes image inputs for "
        f"{', '.join(IMAGE_FAMILIES)} only: pass the model's inputs (inputs={{'input_ids': ..., 'pixel_values': "
        "..., ...}}) to hf.plan_for / hf.step_figures"
    )


def _text_config(root: nn.Module) -> Any:
    return (
        cast(Any, root.config).get_text_config() if hasattr(root.config, "get_text_config") else root.config
    )


def _step_sizes(
    root: nn.Module, planned: ModelPlan, target: Target, inputs: dict[str, Any]
) -> tuple[tuple[Any, ...], Any]:
    """Per kind of layer, one layer's parameters; the model's sizes for the step's peak: its
    parameters and the head's terms, by ``target.workload.loss`` (:data:`~sac_compile.planning.devices.LOSSES`:
    transformers' causal-LM loss upcasts the logits to float32, its ``log_softmax`` output is
    held, two gradients of that size live in its backward, and the model's own logits stay
    alive in its output; torchtitan frees those before the backward; a chunked loss holds one
    chunk); the final norm saves three hidden-sized values; the output projection's FLOPs,
    forward and backward (a chunked loss recomputes its forward); the loss's six passes over
    the float32 logits, forward and backward, for its traffic)."""
    from ..planning.peak import ModelSizes

    modules = dict(root.named_modules())

    def counted(layer: nn.Module) -> tuple[int, int]:
        experts = [r for r, name in layer_regions(layer).items() if name == "experts"]
        routed = sum(p.numel() for r in experts for p in layer.get_submodule(r).parameters())
        return sum(p.numel() for p in layer.parameters()), routed

    params = tuple(counted(modules[g.paths[0]]) for g in planned.groups)
    text = _text_config(root)
    tokens = (
        int(inputs["input_ids"].numel()) if "input_ids" in inputs else target.traced[0] * target.traced[1]
    )
    width = torch.empty((), dtype=target.workload.param_dtype).element_size()
    logits = tokens * text.vocab_size * 4
    norm = 3 * tokens * text.hidden_size * width
    model_logits = tokens * text.vocab_size * width if width != 4 else 0
    sizes = ModelSizes(
        params=sum(p.numel() for p in root.parameters()),
        head_saved_bytes=logits + norm,  # (transformers' loss; the target's loss: peak._head)
        head_stream_bytes=norm,
        head_transient_bytes=2 * logits + model_logits,
        head_flops=6 * tokens * text.hidden_size * text.vocab_size,
        head_traffic=6 * logits,
        logits_bytes=logits,
        model_logits_bytes=model_logits,
        tokens=tokens,
        hidden_size=text.hidden_size,
        top_k=int(getattr(text, "num_experts_per_tok", 0) or 0),
        embedding_params=_embedding_params(root),
        largest_tensor=max(
            (p.numel() for g in planned.groups for p in modules[g.paths[0]].parameters()), default=0
        ),
        **_attention_sizes(text, target, width),
    )
    return params, sizes


def _embedding_params(root: nn.Module) -> int:
    embeddings = cast(Any, root).get_input_embeddings() if hasattr(root, "get_input_embeddings") else None
    return sum(p.numel() for p in embeddings.parameters()) if isinstance(embeddings, nn.Module) else 0


def _attention_sizes(text: Any, target: Target, width: int) -> dict[str, int]:
    """One layer's keys and values at the traced shape, from the config (what context
    parallelism passes around the ring: ``planning.step_time``)."""
    heads = getattr(text, "num_attention_heads", 0) or 0
    if not heads:
        return {}
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    batch, seq = target.traced
    return {"kv_bytes": 2 * batch * seq * kv_heads * head_dim * width}


def predict_peak(
    model: nn.Module,
    target: Target,
    keep: Keep | str | None = None,
    *,
    inputs: dict[str, Any] | None = None,
    include: Iterable[str] | None = None,
) -> Peak:
    """The predicted peak of one training step of ``model`` on ``target`` (a
    :class:`~sac_compile.planning.devices.Target`), every stack's layers wrapped with the eager
    engine keeping ``keep`` (None: no checkpoint): ``step_figures(model, target).peak(keep)``."""
    return step_figures(model, target, inputs=inputs, include=include).peak(keep)


@dataclass(frozen=True)
class StepFigures:
    """What a step's peak is made of, measured once: one plan table per kind of layer, the
    model's sizes and the target. ``peak(keep)`` composes the step for a keep set."""

    target: Target
    plan: ModelPlan
    layer_params: tuple[
        tuple[int, int], ...
    ]  # per group: one layer's parameters, of them the routed experts'
    sizes: ModelSizes

    def peak(self, keep: Keep | str | None = None, *, compile: bool = False, offload: Regions = ()) -> Peak:
        """The predicted peak with every layer keeping ``keep`` (None: no checkpoint;
        ``"torchtitan-op"``: torchtitan's per-op SAC) and offloading ``offload`` (measured
        with ``Target(offload=True)``), under the eager engine or (``compile``) compiled."""
        return max(self.stages(keep, compile=compile, offload=offload), key=lambda p: p.reserved)

    def stages(
        self, keep: Keep | str | None = None, *, compile: bool = False, offload: Regions = ()
    ) -> list[Peak]:
        """:meth:`peak` per rank (with pipeline parallelism each stage's, in pipeline order:
        :func:`sac_compile.planning.peak.stage_peaks`)."""
        return self._predict(keep, compile, offload)[0]

    def _predict(
        self, keep: Keep | str | None, compile: bool, offload: Regions
    ) -> tuple[list[Peak], StepTime]:
        from ..planning.device_plan import predict

        groups, params = self.plan.groups, self.layer_params
        return predict(groups, params, self.sizes, self.target, keep, offload=offload, compile=compile)

    def seconds(
        self, keep: Keep | str | None = None, *, compile: bool = True, offload: Regions = ()
    ) -> float:
        """The step's time on the target, estimated (:func:`sac_compile.planning.step_time.step_time`),
        every layer keeping ``keep`` and offloading ``offload``."""
        return self.step(keep, compile=compile, offload=offload).seconds

    def step(
        self, keep: Keep | str | None = None, *, compile: bool = True, offload: Regions = ()
    ) -> StepTime:
        """The step's predicted time by term, tokens/s and MFU, every layer keeping ``keep``
        and offloading ``offload`` (compiled or eager)."""
        return self._predict(keep, compile, offload)[1]


def step_figures(
    model: nn.Module,
    target: Target,
    *,
    inputs: dict[str, Any] | None = None,
    include: Iterable[str] | None = None,
) -> StepFigures:
    """Measure what a training step of ``model`` on ``target`` (a
    :class:`~sac_compile.planning.devices.Target`) is made of: a causal-LM loss on
    ``target.workload.batch`` x ``target.workload.seq`` tokens (or ``inputs``), optimizer ``target.workload.optimizer``.

    One layer of each kind of every stack is measured on this machine (what it holds for the
    backward without a checkpoint and with each keep set; the backward graph's transient:
    :func:`sac_compile.planning.plan`), and the model's terms are read from its sizes: its
    parameters, and the head's — the loss's ``log_softmax`` output and its two gradients
    (float32, batch x seq x vocab) and the final norm's saves.
    :func:`sac_compile.planning.peak.step_peak` composes the step. For a CUDA target, a model
    that is not on a CUDA device is traced with the target's attention kernel
    (:mod:`sac_compile.planning.kernels`); a model on the meta device is cast in place to
    ``target.workload.param_dtype``. What the eager engine holds is measured by running it; on the
    meta device nothing runs, and a meta model's eager figures are its compiled partition's
    (``peak(keep)`` equals ``peak(keep, compile=True)`` there)."""

    if not isinstance(target, Target):
        raise TypeError(f"step_figures(target={target!r}): a sac_compile.planning.devices.Target")
    read = read_stacks(model, include or ())
    report_unchecked(model, include, "nor does this prediction: include={include!r} counts them too")
    meta = any(p.is_meta for p in unwrap_compiled(model).parameters())
    options = {"budgets": (None,), "eager": not meta, "offload": target.machine.offload}
    planned, params, sizes, _ = _measure(model, read, target, inputs, options)
    return StepFigures(target, planned, params, sizes)
