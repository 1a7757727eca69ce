"""Diagnoses of layers checkpointed eagerly by the seam (the eager engine, legacy
checkpointing, compiled code inside an eager checkpoint, a ``compile=True`` layer that
runs eagerly)."""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any, cast

import torch.nn as nn

from .._compat.dynamo import has_compiled_call
from ..keep import ALL_REGIONS, KeepSet, format_keep
from ..records import generic_path
from . import messages
from .core import Diagnosis, describe_module, note_regions, owner, report
from .unused_keep import RepeatJudge

__all__ = [
    "check_engine_call",
    "engine_done",
    "report_compile_fallback",
    "report_compiled_inside",
    "report_legacy",
]

# Modules already checked (weakly held: ids are reused once a module dies); the
# diagnoses themselves are deduplicated per root module by the core.
_legacy_checked: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_compiled_checked: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_fallback_checked: weakref.WeakSet[nn.Module] = weakref.WeakSet()
# one judge per keep set (Note [judged on a repeat]), keyed by the wrapped module
_judges: dict[KeepSet, RepeatJudge] = {}


def where_in(module: nn.Module, root: object) -> str:
    """``Block (layers.*)``: the module's class and its path in the root, indices generalised."""
    path = None
    if isinstance(root, nn.Module):
        path = next((name for name, sub in root.named_modules() if sub is module), None)
    if path is not None:
        path = generic_path(path) or "<root>"
    return describe_module(module, path)


def _kept(keep: KeepSet, name: str) -> bool:
    return keep is ALL_REGIONS or name in keep


def engine_done(module: nn.Module, keep: KeepSet) -> bool:
    """Whether ``module``'s eager-engine calls need no more checking."""
    judge = _judges.get(keep)
    return judge is not None and judge.done(module)


def check_engine_call(module: nn.Module, keep: KeepSet, stats: Any) -> None:
    """Diagnoses of one eager engine call (``stats``: its ``EngineStats``)."""
    root = owner()
    where = where_in(module, root)
    note_regions(stats.regions_entered, root, module)
    explicit = () if keep is ALL_REGIONS else tuple(cast("frozenset[str]", keep))
    judge = _judges.setdefault(keep, RepeatJudge(explicit))
    judge.on_call(module, root, where, lambda: _first_call(keep, stats, where))


def _first_call(keep: KeepSet, stats: Any, where: str) -> list[Diagnosis]:
    found = []
    held = {
        name
        for by in (stats.held_by_region, stats.offloaded_by_region)
        for key in by
        for name in key.split("+")
    }
    for name in sorted(stats.regions_entered):
        if _kept(keep, name) and name not in held:
            found.append(messages.kept_nothing(name, where, messages.EAGER_HOLDS_NOTHING))
    forced: dict[str, Counter] = {}
    for regions, op, was_forced in stats.collectives:
        for name in regions:
            if was_forced and _kept(keep, name):
                forced.setdefault(name, Counter())[op] += 1
    for name, ops_run in sorted(forced.items()):
        listed = ", ".join(f"{n} x {op}" for op, n in sorted(ops_run.items()))
        found.append(messages.collective_recomputed(name, where, listed))
    for name, how in sorted(set(stats.unbalanced)):
        found.append(messages.unbalanced(name, where, how, within="call"))
    return found


def report_compiled_inside(module: nn.Module) -> None:
    """A compiled submodule inside this eager checkpoint: its saved tensors are discarded."""
    if module in _compiled_checked:
        return
    _compiled_checked.add(module)
    compiled = [name for name, sub in module.named_modules() if name and has_compiled_call(sub)]
    if compiled:
        root = owner()
        report(messages.compiled_in_eager(where_in(module, root), compiled), root)


def report_compile_fallback(module: nn.Module) -> None:
    """A layer wrapped with compile=True is running eagerly: Dynamo did not compile it."""
    if module in _fallback_checked:
        return
    _fallback_checked.add(module)
    root = owner()
    report(messages.compile_fallback(where_in(module, root), has_compiled_call(module)), root)


def report_legacy(module: nn.Module, keep: KeepSet, attr: str) -> None:
    """A layer opted into reentrant checkpointing although its keep set is not empty."""
    if module in _legacy_checked:
        return
    _legacy_checked.add(module)
    if keep is ALL_REGIONS or keep:
        root = owner()
        report(messages.legacy_keep_ignored(format_keep(keep), where_in(module, root), attr), root)
