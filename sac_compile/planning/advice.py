"""Advice on a hand-picked keep set: one INFO line when a measured plan dominates it.

When the ``sac_compile`` logger is enabled for INFO, a sac backend about to compile a training
graph that is one checkpoint scope (a layer compiled with ``make_sac_backend``, the seam's
``compile=True``, ``SacConfig(compile=...)``) first hands it here (``compiler.session.advise``).
The graph is traced once more and partitioned under its own configuration and every candidate
:func:`~sac_compile.planning.plan` would measure (keep sets over its regions x the default
budgets, the backend's policy); when one holds no more bytes and recomputes fewer FLOPs, one
line names it, once per graph code and configuration (N identical layers: one line). Silent
otherwise, and free when INFO is off: nothing is traced.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from typing import Any

from ..actions import Actions
from ..keep import ALL_REGIONS
from .core import DEFAULT_BUDGETS, Candidate, flops_order, keep_sets

__all__ = ["advise"]

_log = logging.getLogger("sac_compile")
_seen: set[tuple[str, str]] = set()
_lock = threading.Lock()


def advise(backend: Any, gm: Any, example_inputs: list[Any], unit: Any) -> None:
    """The advisor the compile session consults (``compiler.session.set_advisor``)."""
    if not _log.isEnabledFor(logging.INFO):
        return
    key = (hashlib.sha256(gm.code.encode()).hexdigest(), repr(backend))
    with _lock:
        if key in _seen:
            return
        _seen.add(key)
    from .._compat import aot
    from ..compiler.backend import backend_for, baseline_backend
    from .measure import PartitionEach

    def measured(configs):
        measuring = PartitionEach(configs)
        measuring(aot.copy_joint(gm), example_inputs)  # traces and partitions; runs nothing
        return measuring

    mine = backend.actions
    own = backend_for(mine, "aot_eager", whole_graph=True)
    first = measured({"own": own})
    if first.scopes != [1] or not first.regions:
        return  # a graph holding several scopes (a whole model) has no one keep set to judge
    configs: dict[Any, Any] = {"own": own, "none": baseline_backend("aot_eager")}
    for keep in keep_sets(first.regions)[0]:
        for budget in DEFAULT_BUDGETS:
            actions = Actions(frozenset(keep), mine.policy, budget)
            configs.setdefault(actions, backend_for(actions, "aot_eager", whole_graph=True))
    figures = measured(configs).figures
    base_flops = figures.pop("none").backward_flops
    recomputed = {k: (f.saved_bytes, f.backward_flops - base_flops) for k, f in figures.items()}
    own_bytes, own_flops = recomputed.pop("own")
    better = [
        Candidate(actions, saved, flops)
        for actions, (saved, flops) in recomputed.items()
        if saved <= own_bytes and flops < own_flops
    ]
    if not better:
        return
    best = min(better, key=flops_order)
    kept = frozenset(first.regions) if mine.keep is ALL_REGIONS else mine.keep
    own_label = Candidate(Actions(kept, mine.policy, mine.budget), own_bytes, own_flops).label
    _log.info(
        "sac_compile [advice] %s: %s holds %s B for the backward and recomputes %s FLOP more than no "
        "checkpoint; %s holds %s B and recomputes %s (measured on this graph's partitions). "
        "sac_compile.plan(layer, *example_inputs, memory=%s) chooses among such plans",
        unit.module,
        own_label,
        f"{own_bytes:,}",
        f"{own_flops:,}",
        best.label,
        f"{best.saved_bytes:,}",
        f"{best.recompute_flops:,}",
        own_bytes,
    )
