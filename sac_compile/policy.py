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
import threading
from collections.abc import Callable
from typing import Any

from ._compat.checkpoint import CheckpointPolicy
from .keep import KeepSet
from .op_classes import is_costly

__all__ = [
    "SAVE_ALL",
    "SAVE_COSTLY",
    "Op",
    "RegionPolicy",
    "is_costly",
    "policy_key",
    "resolve_policy",
]

#: The op a policy decides for: an operator overload (``torch.ops.aten.mm.default``), a
#: higher-order op, or in a compiled graph any other call target of an FX node.
Op = Callable[..., Any]
#: ``policy(op, regions, keep)``: a ``CheckpointPolicy``; a bool (True = MUST_SAVE, False =
#: PREFER_RECOMPUTE, as in ``torch.utils.checkpoint``) or None (the node left untagged, to the
#: partitioner; eagerly recomputed) is accepted too (:func:`checked_decision`).
RegionPolicy = Callable[[Op, tuple[str, ...], KeepSet], CheckpointPolicy | bool | None]


def _is_kept(regions: tuple[str, ...], keep: KeepSet) -> bool:
    return any(name in keep for name in regions)


def save_costly(op: Op, regions: tuple[str, ...], keep: KeepSet) -> CheckpointPolicy:
    """The default: a kept region's costly values are saved, its cheap ops recomputed."""
    if not _is_kept(regions, keep):
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if is_costly(op) else CheckpointPolicy.PREFER_RECOMPUTE


def save_all(op: Op, regions: tuple[str, ...], keep: KeepSet) -> CheckpointPolicy:
    """Every op of a kept region is saved (cheap pointwise outputs too). Eagerly, a kept
    declared module or decorated function then runs once per step (its body skipped in the
    recompute, :mod:`sac_compile.eager.kept_bodies`)."""
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
        _REGISTRY[policy_key(policy)] = policy
    return policy


def resolve_policy(key: str) -> RegionPolicy:
    """The policy registered under ``key`` (by :func:`validate_policy`)."""
    with _REGISTRY_LOCK:
        found = _REGISTRY.get(key)
    if found is None:
        raise KeyError(f"sac_compile: no region policy registered as {key!r} in this process")
    return found


def checked_decision(
    policy: RegionPolicy, op: Any, regions: tuple[str, ...], keep: KeepSet
) -> CheckpointPolicy | None:
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
