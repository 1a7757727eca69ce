"""Planning a transformers model for a device: :func:`plan_for_device` (``hf.plan_for(...,
device=...)``), :func:`step_figures` and :func:`predict_peak` (re-exported by
:mod:`sac_compile.hf`). Method: ``docs/planning.md`` (planning for a device)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ._compat.dynamo import unwrap_compiled
from .hf_layers import layer_regions, merged, read_stacks, report_unchecked, vocab_size
from .keep import ALL_REGIONS, normalize_keep
from .planning import ModelPlan, plan_model
from .planning.peak import Peak

__all__ = ["StepFigures", "plan_for_device", "predict_peak", "step_figures"]


def plan_for_device(
    model: nn.Module,
    memory: Any,
    read: list[tuple[str, dict[str, str]]],
    batch: int,
    seq: int,
    inputs: dict[str, Any] | None,
    device: Any,
    fsdp: int,
    tp: int,
    ep: int,
    compile: bool,
    options: dict[str, Any],
) -> Any:
    """``hf.plan_for`` with ``device``: see its docstring."""
    patterns = tuple(f"{path}.*" for path, _ in read)
    from .planning.device_plan import choose
    from .planning.devices import Target
    from .planning.kernels import target_kernels

    root = unwrap_compiled(model)
    meta = any(p.is_meta for p in root.parameters())
    if isinstance(device, Target):
        target = device if memory is None else device.replace(memory=memory)
    else:
        dtype = torch.bfloat16 if meta else next(root.parameters()).dtype
        target = Target(
            device, memory=memory, fsdp=fsdp, tp=tp, ep=ep, batch=batch, seq=seq, param_dtype=dtype
        )
    if meta:
        root.to(target.param_dtype)
    inputs = inputs if inputs is not None else _tokens(model, target, "meta" if meta else "cpu")
    if not compile:
        options.setdefault("budgets", (None,))
    options.setdefault("eager", not compile and not meta)
    with target_kernels(target.device.cuda):  # type: ignore[union-attr]
        planned = plan_model(
            model, layers=patterns, memory=1.0, regions=merged(read), use_cache=False, **inputs, **options
        )
    params, sizes = _step_sizes(root, planned, target, inputs)
    text = _text_config(root)
    tokens = target.batch * target.seq
    head_flops = 6 * tokens * text.hidden_size * text.vocab_size
    return choose(
        planned.groups, params, sizes, target, compile=compile, layers=planned.layers, head_flops=head_flops
    )


def _tokens(model: nn.Module, target: Any, device: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab_size(model), (target.batch, target.seq), generator=g)
    return {"input_ids": ids.to(device)}


def _text_config(root: nn.Module) -> Any:
    return root.config.get_text_config() if hasattr(root.config, "get_text_config") else root.config


def _step_sizes(
    root: nn.Module, planned: ModelPlan, target: Any, inputs: dict[str, Any]
) -> tuple[tuple, Any]:
    """Per kind of layer, one layer's parameters; the model's sizes for the step's peak: its
    parameters and the head's terms (transformers' causal-LM loss upcasts the logits to
    float32: its ``log_softmax`` output is held, two gradients of that size live in its
    backward; the final norm saves three hidden-sized values)."""
    from .planning.peak import ModelSizes

    modules = dict(root.named_modules())

    def counted(layer: nn.Module) -> tuple[int, int]:
        experts = [r for r, name in layer_regions(layer).items() if name == "experts"]
        routed = sum(p.numel() for r in experts for p in layer.get_submodule(r).parameters())
        return sum(p.numel() for p in layer.parameters()), routed

    params = tuple(counted(modules[g.paths[0]]) for g in planned.groups)
    text = _text_config(root)
    tokens = int(inputs["input_ids"].numel()) if "input_ids" in inputs else target.batch * target.seq
    width = torch.empty((), dtype=target.param_dtype).element_size()
    logits = tokens * text.vocab_size * 4
    sizes = ModelSizes(
        params=sum(p.numel() for p in root.parameters()),
        head_saved_bytes=logits + 3 * tokens * text.hidden_size * width,
        head_transient_bytes=2 * logits + (tokens * text.vocab_size * width if width != 4 else 0),
    )
    return params, sizes


def predict_peak(
    model: nn.Module,
    target: Any,
    keep: Any = None,
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

    target: Any
    plan: ModelPlan
    layer_params: tuple[
        tuple[int, int], ...
    ]  # per group: one layer's parameters, of them the routed experts'
    sizes: Any  # planning.peak.ModelSizes

    def peak(self, keep: Any = None, *, compile: bool = False) -> Peak:
        """The predicted peak with every layer keeping ``keep`` under the eager engine (None:
        no checkpoint)."""
        from .planning.device_plan import figures_of
        from .planning.peak import LayerFigures, step_peak

        keep_set = None if keep is None else normalize_keep(keep)
        layers = []
        for group, params in zip(self.plan.groups, self.layer_params):
            table = group.plan
            if keep_set is None:
                plain = table.no_checkpoint_eager_bytes or table.no_checkpoint_bytes
                layers.append(
                    LayerFigures(len(group.paths), params[0], plain, table.no_checkpoint_transient, params[1])
                )
                continue
            kept = (
                frozenset(table.regions)
                if keep_set is ALL_REGIONS
                else frozenset(keep_set) & set(table.regions)
            )
            found = [c for c in table.candidates if c.keep == kept and c.budget is None]
            layers.append(figures_of(found[0], table, params, len(group.paths), compile=compile))
        return step_peak(self.sizes, layers, self.target)


def step_figures(
    model: nn.Module,
    target: Any,
    *,
    inputs: dict[str, Any] | None = None,
    include: Iterable[str] | None = None,
) -> StepFigures:
    """Measure what a training step of ``model`` on ``target`` (a
    :class:`~sac_compile.planning.devices.Target`) is made of: a causal-LM loss on
    ``target.batch`` x ``target.seq`` tokens (or ``inputs``), optimizer ``target.optimizer``.

    One layer of each kind of every stack is measured on this machine (what it holds for the
    backward without a checkpoint and with each keep set; the backward graph's transient:
    :func:`sac_compile.planning.plan`), and the model's terms are read from its sizes: its
    parameters, and the head's — the loss's ``log_softmax`` output and its two gradients
    (float32, batch x seq x vocab) and the final norm's saves.
    :func:`sac_compile.planning.peak.step_peak` composes the step. ``target.device`` must be one
    this machine runs as (``"cpu"``): a CUDA device's attention kernels save other values, which
    this does not trace yet."""
    from .planning.devices import Target

    if not isinstance(target, Target):
        raise TypeError(f"step_figures(target={target!r}): a sac_compile.planning.devices.Target")
    if target.device.cuda:  # type: ignore[union-attr]
        raise NotImplementedError(
            f"a step on {target.device.name}: layers are measured with this machine's kernels "  # type: ignore[union-attr]
            "(CPU attention saves the score matrix; CUDA's flash / efficient kernels do not); use device='cpu'"
        )
    read = read_stacks(model, include or ())
    report_unchecked(model, include, "nor does this prediction: include={include!r} counts them too")
    if inputs is None:
        inputs = _tokens(model, target, "cpu")
    patterns = tuple(f"{path}.*" for path, _ in read)
    planned = plan_model(
        model, layers=patterns, memory=1.0, regions=merged(read), use_cache=False, budgets=(None,), **inputs
    )
    params, sizes = _step_sizes(unwrap_compiled(model), planned, target, inputs)
    return StepFigures(target, planned, params, sizes)
