"""Region policies: which forward ops of a checkpoint scope are saved, which recomputed.

A *region policy* is a function of the op, the regions open when it ran and the
scope's keep set, returning a ``CheckpointPolicy``::

    def policy(op, regions: tuple[str, ...], keep: KeepSet) -> CheckpointPolicy

``op`` is what the op is in both engines: an ``OpOverload`` (``aten.mm.default``),
a custom op's overload, or a higher-order op (``flex_attention``,
``triton_kernel_wrapper_functional``...). The compiled pass calls it per forward
node of a scope, the eager engine per dispatched op, so both modes apply the
same decision. The mechanism keeps its own rules around any policy (they are
about correctness, not trade-offs): ``getitem`` / ``wait_tensor`` follow their
producer, views are recomputed, random-seed nodes are never forced to recompute,
eager in-place writes and collectives are recomputed (see ``eager.py``).

Note [What a kept region saves]
    A kept region's *costly* values (:func:`is_costly`: matmuls, convolutions,
    attention kernels, grouped / scaled matmuls, opaque custom ops and
    higher-order kernels, collectives) are ``MUST_SAVE``; its cheap ops
    (pointwise, reductions, normalisations, casts) are ``PREFER_RECOMPUTE``: the
    partitioner (or the eager engine) recomputes them from the saved costly
    values and the scope's inputs. Leaving the cheap ops untagged instead lets
    the min-cut keep a pointwise product next to the matmul outputs it is
    computed from (the issue's probe, one SwiGLU block kept: 12.6 MB instead of
    8.4 MB; measured here on the demo MoE layer, keep experts: 0.645 MiB instead
    of 0.395), and ``MUST_SAVE`` on everything (``SAVE_ALL``, the behaviour
    before) stores the pointwise outputs too (tests/test_policy.py compares).
    Outside kept regions every op is ``MUST_RECOMPUTE``.

Policies are identified by :func:`policy_key` (the name of a built-in, or a
user function's module, qualified name and source hash), which enters the
compile caches' keys and the seam's scope markers.
"""

from __future__ import annotations

import hashlib
import inspect
import operator
import threading
from collections.abc import Callable
from typing import Any

import torch

from ._compat import ops as op_types
from ._compat.checkpoint import CheckpointPolicy
from ._compat.ops import packet_namespace, schema
from .keep import KeepSet

__all__ = [
    "SAVE_ALL",
    "SAVE_COSTLY",
    "RegionPolicy",
    "communicates",
    "is_collective",
    "is_costly",
    "policy_key",
    "resolve_policy",
]

RegionPolicy = Callable[[Any, tuple[str, ...], KeepSet], CheckpointPolicy]

_aten = torch.ops.aten

# The matmul family, convolutions and attention kernels (forward ops as they appear
# in joint graphs and under a dispatch mode: composite ops like linear/matmul
# decompose into these before either engine sees them).
_COSTLY_PACKETS = tuple(
    getattr(_aten, name)
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "addbmm",
        "_addmm_activation",
        "matmul",
        "linear",
        "_int_mm",
        "_grouped_mm",
        "_scaled_mm",
        "_scaled_mm_v2",
        "_scaled_grouped_mm",
        "_weight_int4pack_mm",
        "_weight_int4pack_mm_for_cpu",
        "_weight_int8pack_mm",
        "convolution",
        "_convolution",
        "conv1d",
        "conv2d",
        "conv3d",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
        "_flash_attention_forward",
        "_efficient_attention_forward",
        "scaled_dot_product_attention",
        "_native_multi_head_attention",
    )
    if hasattr(_aten, name)
)
_COSTLY = frozenset(_COSTLY_PACKETS)
#: Matmul outputs: costly values whose own backward reads only their inputs (an attention
#: kernel's output, by contrast, is read by its backward). A small read of one may be saved
#: instead of it (the "shrinking read" rule of the pass and the eager engine).
MATMULS = frozenset(
    getattr(_aten, name) for name in ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm") if hasattr(_aten, name)
)
# Namespaces whose ops are PyTorch's own decomposed / primitive ops, not opaque kernels.
_TRANSPARENT_NAMESPACES = frozenset({"aten", "prims", "prim", "quantized_decomposed", "sac_compile"})
_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d", "c10d_functional"})
# Higher-order ops that are control flow or bookkeeping, not kernels.
_STRUCTURAL_HOPS = frozenset(
    {
        "cond",
        "while_loop",
        "map",
        "scan",
        "associative_scan",
        "with_effects",
        "auto_functionalized_v2",
        "run_and_save_rng_state",
        "run_with_rng_state",
        "graphsafe_run_with_rng_state",
        "tag_activation_checkpoint",
        "wrap",
        "wrap_with_set_grad_enabled",
        "wrap_with_autocast",
    }
)


def is_costly(op: Any) -> bool:
    """Whether ``op``'s output is *costly* to recompute (see Note [What a kept region saves]).

    True for the matmul family, convolutions and attention kernels (every SDPA
    variant, ``flex_attention``), grouped and scaled matmuls, collectives, opaque
    custom ops (any namespace but PyTorch's own) and kernel-like higher-order ops
    (``flex_attention``, user Triton kernels, ``auto_functionalized`` custom ops,
    ``invoke_subgraph``).
    """
    if op is operator.getitem:
        return False
    if isinstance(op, op_types.OpOverload):
        if op.overloadpacket in _COSTLY:
            return True
        ns = op.namespace
        if ns in _COLLECTIVE_NAMESPACES:
            return schema(op).name != "_c10d_functional::wait_tensor"  # waits follow their producer
        return ns not in _TRANSPARENT_NAMESPACES
    if isinstance(op, op_types.OpOverloadPacket):
        return op in _COSTLY or packet_namespace(op) not in _TRANSPARENT_NAMESPACES
    if isinstance(op, op_types.HigherOrderOperator):
        return op.name() not in _STRUCTURAL_HOPS
    return False


# recomputed with their collective, but not communication themselves
_COLLECTIVE_COMPANIONS = frozenset(
    {
        "_c10d_functional::wait_tensor",
        "_c10d_functional::_wrap_tensor_autograd",
        "c10d_functional::wait_tensor",  # the legacy namespace's wait
    }
)


def is_collective(op: Any) -> bool:
    """A ``c10d`` / ``_c10d_functional`` op, communication or companion (wait, wrapper)."""
    return getattr(op, "namespace", None) in _COLLECTIVE_NAMESPACES


def communicates(op: Any) -> bool:
    """A collective proper (counted), as opposed to its wait / wrapper companions."""
    return is_collective(op) and schema(op).name not in _COLLECTIVE_COMPANIONS


def _is_kept(regions: tuple[str, ...], keep: KeepSet) -> bool:
    return any(name in keep for name in regions)


def save_costly(op: Any, regions: tuple[str, ...], keep: KeepSet) -> CheckpointPolicy:
    """The default: a kept region's costly values are saved, its cheap ops recomputed."""
    if not _is_kept(regions, keep):
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if is_costly(op) else CheckpointPolicy.PREFER_RECOMPUTE


def save_all(op: Any, regions: tuple[str, ...], keep: KeepSet) -> CheckpointPolicy:
    """Every op of a kept region is saved (cheap pointwise outputs too). Eagerly, a kept
    declared module or decorated function then runs once per step (its body skipped in the
    recompute, :mod:`sac_compile.eager.bodies`)."""
    return CheckpointPolicy.MUST_SAVE if _is_kept(regions, keep) else CheckpointPolicy.MUST_RECOMPUTE


#: Default region policy: keep a kept region's costly values, recompute its cheap ops.
SAVE_COSTLY: RegionPolicy = save_costly
#: Save every op of a kept region (what sac-compile did before); more memory, no pointwise recompute.
SAVE_ALL: RegionPolicy = save_all

_BUILTIN = {"save_costly": save_costly, "save_all": save_all}
_REGISTRY: dict[str, RegionPolicy] = dict(_BUILTIN)
_REGISTRY_LOCK = threading.Lock()


def policy_key(policy: RegionPolicy) -> str:
    """A stable text naming ``policy``: a built-in's name, else module.qualname@source-hash.

    Enters the compile caches' keys (a changed policy body changes the key) and
    travels in scope markers (:func:`resolve_policy` turns it back into the function).
    """
    for name, fn in _BUILTIN.items():
        if policy is fn:
            return name
    module = getattr(policy, "__module__", None) or type(policy).__module__
    qualname = getattr(policy, "__qualname__", None) or type(policy).__qualname__
    try:
        source = inspect.getsource(policy if inspect.isroutine(policy) else type(policy))
    except (OSError, TypeError):
        source = f"id={id(policy)}"  # no source (REPL, C): keyed per object in this process
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    key = f"{module}.{qualname}@{digest}"
    return key.replace(",", "_").replace(";", "_")


def validate_policy(policy: object) -> RegionPolicy:
    """Return ``policy`` if it can be a region policy and register it for scope markers."""
    if isinstance(policy, str):
        if policy in _BUILTIN:
            return _BUILTIN[policy]
        raise ValueError(
            f"policy={policy!r} is not a built-in region policy; use one of {sorted(_BUILTIN)}, "
            "sac_compile.SAVE_COSTLY / SAVE_ALL, or a function (op, regions, keep) -> CheckpointPolicy"
        )
    if not callable(policy):
        raise TypeError(
            f"policy must be a function (op, regions, keep) -> CheckpointPolicy, got "
            f"{type(policy).__name__} {policy!r}; e.g. policy=sac_compile.SAVE_ALL"
        )
    with _REGISTRY_LOCK:
        _REGISTRY[policy_key(policy)] = policy  # type: ignore[assignment]
    return policy  # type: ignore[return-value]


def resolve_policy(key: str) -> RegionPolicy:
    """The policy registered under ``key`` (by :func:`validate_policy`)."""
    with _REGISTRY_LOCK:
        found = _REGISTRY.get(key)
    if found is None:
        raise KeyError(f"sac_compile: no region policy registered as {key!r} in this process")
    return found


def checked_decision(policy: RegionPolicy, op: Any, regions: tuple[str, ...], keep: KeepSet):
    """Call ``policy`` and check that it returned a ``CheckpointPolicy`` (a bool is accepted:
    True = MUST_SAVE, False = PREFER_RECOMPUTE, as in ``torch.utils.checkpoint``)."""
    got = policy(op, regions, keep)
    if got is None:
        return None  # no tag: the partitioner decides (eager: recomputed)
    if isinstance(got, bool):
        return CheckpointPolicy.MUST_SAVE if got else CheckpointPolicy.PREFER_RECOMPUTE
    if not isinstance(got, CheckpointPolicy):
        raise TypeError(
            f"region policy {policy_key(policy)} returned {got!r} for {op}; it must return a "
            "torch.utils.checkpoint.CheckpointPolicy (or a bool)"
        )
    return got


def saves(decision: CheckpointPolicy | None) -> bool:
    return decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


# --- Scope specs: a scope's keep set, policy and budget, as marker text ---------------


def validate_budget(budget: object) -> float | None:
    """``budget`` as a float in (0, 1], or None for no budget.

    ``0`` means the same as no budget (save the kept regions' costly values and
    recompute everything else): PyTorch's own budget 0 saves only the graph's
    inputs, which would drop the kept values.
    """
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"budget must be a float in [0, 1] or None, got {type(budget).__name__} {budget!r}")
    if not 0.0 <= float(budget) <= 1.0:
        raise ValueError(
            f"budget={budget!r} is outside [0, 1]; it is the fraction of a scope's activation bytes "
            "the partitioner may save (PyTorch's activation_memory_budget), e.g. budget=0.5"
        )
    return float(budget) or None


def format_scope(keep_text: str, policy: RegionPolicy, budget: float | None) -> str:
    """Scope-marker text: the keep set, then ``;policy=...`` / ``;budget=...`` when not default."""
    parts = [keep_text]
    key = policy_key(policy)
    if key != "save_costly":
        parts.append(f"policy={key}")
    if budget is not None:
        parts.append(f"budget={budget!r}")
    return ";".join(parts)


def parse_scope(text: str) -> tuple[str, RegionPolicy, float | None]:
    """Inverse of :func:`format_scope`: (keep text, policy, budget)."""
    keep_text, *extra = text.split(";")
    policy: RegionPolicy = save_costly
    budget = None
    for item in extra:
        name, _, value = item.partition("=")
        if name == "policy":
            policy = resolve_policy(value)
        elif name == "budget":
            budget = float(value)
    return keep_text, policy, budget
