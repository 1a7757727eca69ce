"""``plan_model``: one :func:`~sac_compile.planning.plan` per distinct kind of layer.

A model's checkpointed layers are often not all alike: DeepSeek-style models put dense
layers before MoE ones, hybrid models interleave attention and recurrent layers. Each kind
trades memory for recompute differently, so each is planned on its own. ``plan_model`` runs
the model once with forward pre-hooks on the layers matching ``layers`` to record each
layer's first call (its arguments, detached, ``requires_grad`` as they were), groups the
layers by structure (their class and the classes of every submodule, by path), plans one
layer of each group with its recorded call, and returns a :class:`ModelPlan` that applies
each group's choice to its layers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from .._compat.checkpoint import tree_map
from .._compat.tensors import DataDependentOutputException, fake_mode
from .._compat.transformers import value_checks_off
from ..declare import declare_regions, match_path
from ..memory import Memory
from ..policy import SAVE_COSTLY, RegionPolicy
from .core import DEFAULT_BUDGETS, Plan, plan

if TYPE_CHECKING:
    from ..arguments import Compile

__all__ = ["LayerGroup", "ModelPlan", "plan_model"]


@dataclass(frozen=True)
class LayerGroup:
    """Layers of one structure, and the plan of the first of them."""

    kind: str  # the layer class, and what sets this group apart when classes repeat
    paths: tuple[str, ...]
    plan: Plan


@dataclass(frozen=True)
class ModelPlan:
    """One :class:`~sac_compile.planning.Plan` per kind of layer; ``apply(model)`` wraps
    every planned layer with its group's keep set, policy and budget."""

    layers: str | tuple[str, ...]
    groups: tuple[LayerGroup, ...]

    @property
    def saved_bytes(self) -> int:
        """Bytes every planned layer's backward keeps, summed over the layers."""
        return sum(g.plan.saved_bytes * len(g.paths) for g in self.groups)

    @property
    def recompute_flops(self) -> int:
        return sum(g.plan.recompute_flops * len(g.paths) for g in self.groups)

    def format(self) -> str:
        lines = [f"model plan for {self.layers!r}: {len(self.groups)} kind(s) of layer"]
        for g in self.groups:
            lines.append(
                f"  {g.kind} x{len(g.paths)} ({_span(g.paths)}): {g.plan.chosen.label}; "
                f"{g.plan.saved_bytes:,} B saved per layer, {g.plan.recompute_flops:,} FLOP recomputed"
            )
        lines.append(f"  total: {self.saved_bytes:,} B saved, {self.recompute_flops:,} FLOP recomputed")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()

    def apply(self, model: nn.Module, *, compile: Compile | None = None, **options: Any) -> nn.Module:
        """Wrap each planned layer with ``apply_selective_checkpointing`` and its group's
        plan. ``compile`` defaults to ``True`` for a group whose plan has a budget (budgets act
        in compiled code only) and ``False`` otherwise; ``compile=False`` with a budget is a
        ``ValueError``. ``options`` go to the seam (``preserve_rng_state``)."""
        from .._compat.dynamo import unwrap_compiled
        from ..seam import apply_selective_checkpointing

        modules = dict(unwrap_compiled(model).named_modules())
        for g in self.groups:
            compile_ = g.plan.budget is not None if compile is None else compile
            if g.plan.budget is not None and compile_ is False:
                raise ValueError(
                    f"the plan of {g.kind} has budget={g.plan.budget:g}, which only compiled code honours; "
                    "leave compile unset (True for such a group) or plan with budgets=(None,)"
                )
            for path in g.paths:
                apply_selective_checkpointing(
                    modules[path],
                    keep=g.plan.keep,
                    policy=g.plan.policy,
                    budget=g.plan.budget,
                    offload=g.plan.chosen.offload,
                    compile=compile_,
                    **options,
                )
        return model


def plan_model(
    model: nn.Module,
    *example_args: Any,
    layers: str | tuple[str, ...],
    memory: Memory,
    regions: dict[str, str] | None = None,
    budgets: Iterable[float | None] = DEFAULT_BUDGETS,
    policies: Sequence[RegionPolicy] = (SAVE_COSTLY,),
    eager: bool = True,
    progress: Callable[[int, int, str], object] | None = None,
    offload: bool = False,
    **example_kwargs: Any,
) -> ModelPlan:
    """Plan every kind of layer matching ``layers`` within ``memory`` per layer.

    Args:
        model: the model, run once as ``model(*example_args, **example_kwargs)`` to record
            each layer's inputs (with grad, so that they require grad as in training).
        layers: module path pattern of the checkpointed layers (``"model.layers.*"``), or a
            tuple of patterns (several stacks); each must match layers that run in the
            example forward.
        memory: per layer: bytes (``int``) or a fraction of that layer's no-checkpoint bytes.
        regions: ``{module path pattern: region name}`` declared on ``model`` first.
        budgets, policies, eager, offload: as in :func:`~sac_compile.planning.plan`.
        progress: called as ``progress(done, total, kind)`` before each kind of layer is
            measured and once at the end (``done == total``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"plan_model plans an nn.Module, got {type(model).__name__}")
    from .._compat.dynamo import unwrap_compiled

    root = unwrap_compiled(model)
    budgets = tuple(budgets)  # read once per kind of layer: a generator would serve only the first
    patterns = layers if isinstance(layers, tuple) else (layers,)
    by_pattern = {
        pattern: [(p, m) for p, m in root.named_modules() if match_path(pattern, p)] for pattern in patterns
    }
    for pattern, matched in by_pattern.items():
        if not matched:
            raise ValueError(
                f"plan_model(layers={pattern!r}) matches no module of {type(root).__name__}; "
                "give the dotted path pattern of the checkpointed layers, e.g. 'model.layers.*'"
            )
    matched = [item for found in by_pattern.values() for item in found]
    if regions:
        declare_regions(root, regions)
    calls = _record_calls(model, matched, example_args, example_kwargs)
    silent = [pattern for pattern, found in by_pattern.items() if not any(p in calls for p, _ in found)]
    if silent:
        raise ValueError(
            f"plan_model: no layer of {', '.join(map(repr, silent))} ran in the example forward, so it cannot be "
            "planned; give example inputs that run every stack (a vision tower needs an image: pixel_values)"
        )
    groups: dict[tuple[Any, ...], list[str]] = {}
    for path, module in matched:
        if path in calls:
            groups.setdefault(_structure(module), []).append(path)
    modules = dict(matched)
    kinds = _kinds(groups, modules)
    out = []
    for i, (key, paths) in enumerate(groups.items()):
        if progress is not None:
            progress(i, len(groups), f"{kinds[key]} x{len(paths)}")
        args, kwargs = calls[paths[0]]
        chosen = plan(
            modules[paths[0]],
            *args,
            memory=memory,
            budgets=budgets,
            policies=policies,
            eager=eager,
            offload=offload,
            **kwargs,
        )
        out.append(LayerGroup(kinds[key], tuple(paths), chosen))
    if progress is not None:
        progress(len(groups), len(groups), "done")
    return ModelPlan(layers, tuple(out))


def _record_calls(
    model: nn.Module, matched: list[tuple[str, nn.Module]], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, tuple[tuple[Any, ...], dict[str, Any]]]:
    calls: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def keep(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return t.detach().requires_grad_(t.requires_grad)
        return t

    def recorder(path: str) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
        def hook(_module: nn.Module, a: tuple[Any, ...], kw: dict[str, Any]) -> None:
            if path not in calls:
                calls[path] = (tree_map(keep, tuple(a)), tree_map(keep, dict(kw)))

        return hook

    handles = [m.register_forward_pre_hook(recorder(p), with_kwargs=True) for p, m in matched]
    # A model on the meta device runs its recording forward on fake tensors: code that asks
    # a value (transformers' mask checks call ``.all()``) sees a trace and skips the check;
    # transformers' checks on values (image tokens against image features) are switched off.
    meta = any(p.is_meta for p in model.parameters())
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.enable_grad())
            if meta:
                stack.enter_context(fake_mode())
                stack.enter_context(value_checks_off())
            try:
                model(*args, **kwargs)
            except (RuntimeError, DataDependentOutputException) as e:
                if not meta or not _reads_values(e):
                    raise
                raise ValueError(
                    f"{type(model).__name__} on the meta device: its forward reads the values of a tensor "
                    f"({str(e).splitlines()[0]}), which a meta model does not have (only shapes): plan it with "
                    "weights (on this machine: a smaller config with the same layers)"
                ) from e
    finally:
        for h in handles:
            h.remove()
    if meta:  # the recorded fake tensors become meta tensors of the same shapes, for Dynamo
        calls = {p: tree_map(_as_meta, call) for p, call in calls.items()}
    return calls


def _reads_values(e: BaseException) -> bool:
    message = str(e)
    return isinstance(e, DataDependentOutputException) or "unallocated storage" in message


def _as_meta(t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        return out.requires_grad_(t.requires_grad)
    return t


def _structure(module: nn.Module) -> tuple[Any, ...]:
    return tuple((path, type(m).__qualname__) for path, m in module.named_modules())


def _kinds(
    groups: dict[tuple[Any, ...], list[str]], modules: dict[str, nn.Module]
) -> dict[tuple[Any, ...], str]:
    """A readable name per group: the class, plus what differs when a class repeats."""
    names: dict[tuple[Any, ...], str] = {}
    by_class: dict[str, list[tuple[Any, ...]]] = {}
    for key, paths in groups.items():
        by_class.setdefault(type(modules[paths[0]]).__name__, []).append(key)
    for cls, keys in by_class.items():
        for key in keys:
            if len(keys) == 1:
                names[key] = cls
                continue
            common = set.intersection(*(set(k) for k in keys))
            own = [f"{p}={c}" for p, c in key if (p, c) not in common and p and "." not in p]
            names[key] = f"{cls} ({', '.join(own) or 'variant'})"
    return names


def _span(paths: tuple[str, ...]) -> str:
    return paths[0] if len(paths) == 1 else f"{paths[0]} ... {paths[-1]}"
