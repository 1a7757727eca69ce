"""The configurations a plan measures (:func:`configurations`), one measured configuration
(:class:`Candidate`), and the orders and frontier the choosers read.

Keep sets: every subset of a layer's regions up to ``MAX_EXHAUSTIVE_REGIONS`` regions; beyond,
the empty set, each region alone, every region and each region left out. Each crossed with
the knapsack budgets and the region policies. With ``offload``, for every two measured keep
sets ``A`` strictly inside ``B``: keep ``A`` and offload ``B - A`` (with the first policy and
no budget) -- every disjoint (keep, offload) pair up to the exhaustive limit. An offloading
candidate carries its copies (:class:`Copies`, :func:`~sac_compile.planning.offload.graph_copies`). Keeping ``B`` and
keeping ``A`` are both measured, so what the eager engine holds on the device (``A``'s) and
sends to the host (``B``'s less ``A``'s) is read off them.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

from ..actions import Actions
from ..policy import SAVE_ALL, SAVE_COSTLY, RegionPolicy

__all__ = [
    "MAX_EXHAUSTIVE_REGIONS",
    "Candidate",
    "Copies",
    "SplitCopies",
    "configurations",
    "flops_order",
    "keep_sets",
    "mark_pareto",
]

#: Up to this many regions every keep set is a candidate (2**n of them).
MAX_EXHAUSTIVE_REGIONS = 4


@dataclass(frozen=True)
class Copies:
    """One partitioned graph pair's offload copies in the order they run, with the compute
    around them (:func:`graph_copies`): what :func:`transfer` needs to tell hidden from
    exposed on a device."""

    # per copy to the host: (bytes, costly FLOPs after it in the forward graph, memory-bound
    # bytes after it)
    forward: tuple[tuple[int, int, int], ...] = ()
    # per copy back: (bytes, costly FLOPs before the value's first use in the backward graph,
    # memory-bound bytes before it)
    backward: tuple[tuple[int, int, int], ...] = ()


class SplitCopies(NamedTuple):
    """What a checkpointed layer's recompute under a split backward's ``W`` holds
    (:func:`~.split_backward.split_recompute`), per device of the trace."""

    left: int = 0  # alive once its groups ran, while a later layer's run
    last: int = 0  # the most alive while they run, the stage's last layer
    left_once: int = 0  # the same when the groups share one recompute (recompute_once)
    last_once: int = 0
    groups: int = 0  # the weight groups that recompute it (each a whole recompute)

    def __add__(self, later: object) -> SplitCopies:
        """Two graphs of one unit, run in turn: the later after what the earlier left."""
        assert isinstance(later, SplitCopies)
        return SplitCopies(
            self.left + later.left,
            self.left + later.last,
            self.left_once + later.left_once,
            self.left_once + later.last_once,
            self.groups + later.groups,
        )


@dataclass(frozen=True)
class Candidate:
    """One measured configuration: its actions (keep set, offload set, budget, policy) and
    figures. ``saved_bytes`` is what the backward holds on the device; what an offloaded
    region sends to host memory is ``offloaded_bytes``."""

    actions: Actions
    saved_bytes: int
    recompute_flops: int
    pareto: bool = False  # no other candidate has <= bytes, FLOPs and host bytes, one of them strictly
    eager_bytes: int | None = None  # what the eager engine holds for the backward (no budget only)
    step_time: float | None = None  # median forward+backward seconds (estimator="time", Pareto points)
    transient_bytes: int = 0  # what its backward graph allocates beyond its inputs, at its peak
    recompute_traffic: int = 0  # bytes its backward's memory-bound ops move beyond no checkpoint's
    # saved_bytes split for tensor parallelism: (split tp ways, the stream's values that
    # column-parallel projections read, gathered in a region under sequence parallelism);
    # planning.parallel
    tp_split: tuple[int, int, int] = (0, 0, 0)
    # row-parallel projections' outputs in its saved regions it does not save (what the eager
    # engine holds of them under TP, whole on every rank: planning.parallel.tensor_parallel_split)
    tp_row_outputs: int = 0
    offloaded_bytes: int = 0  # saved to host memory by the compiled partition (offloaded regions)
    # its backward graph's attention run as ring attention on cp ranks: the transient is at
    # least ring_transient[0] + cp * ring_transient[1] (graph_memory.graph_ring)
    ring_transient: tuple[int, int] = (0, 0)
    # offloaded_bytes split as tp_split and tp_row_outputs split what it saves (compiled: what a
    # tensor-parallel rank sends to the host; planning.offload.offloaded_per_rank)
    tp_offloaded_split: tuple[int, int, int, int] = (0, 0, 0, 0)
    eager_offloaded_bytes: int | None = None  # what the eager engine copies to the host
    # under a split backward's W (zero bubble, eager): the recomputed copies the layer leaves
    # alive and its most, then the same recomputed once (planning.split_backward.split_recompute)
    split_recompute: SplitCopies = SplitCopies()
    # what it does with expert parallelism's all-to-all outputs, which a one-process trace
    # lacks: "saved" (held for the backward, not redone), "recomputed" (redone with the rest),
    # "" (redone as much as its recompute redoes of the forward)
    all_to_all: str = ""
    # its backward's transient split, the routed experts' part apart: split ep ways on a rank
    # of expert parallelism (graph_memory.routed_transient)
    routed_transient: tuple[tuple[int, int], ...] = ()
    copies: tuple[Copies, ...] = ()  # per graph, its offload copies and the compute around them
    # (an offloading candidate) the candidates keeping its keep set and keeping its offloaded
    # regions too: what a tensor-parallel rank sends to the host is the difference they hold
    nested: tuple[Candidate, Candidate] | None = field(default=None, repr=False, compare=False)

    @property
    def keep(self) -> frozenset[str]:
        return cast("frozenset[str]", self.actions.keep)  # (a measured set: never ALL_REGIONS)

    @property
    def offload(self) -> frozenset[str]:
        return self.actions.offload

    @property
    def budget(self) -> float | None:
        return self.actions.budget

    @property
    def policy(self) -> RegionPolicy:
        return self.actions.policy

    @property
    def label(self) -> str:
        keep = "+".join(sorted(self.keep)) or ("{}" if self.offload else "{} (full)")
        parts = [f"keep {keep}"]
        if self.offload:
            parts.append(f"offload {'+'.join(sorted(self.offload))}")
        if self.budget is not None:
            parts.append(f"budget {self.budget:g}")
        if self.policy is not SAVE_COSTLY:
            parts.append(policy_name(self.policy))
        return ", ".join(parts)


def keep_sets(regions: Sequence[str]) -> tuple[list[tuple[str, ...]], str]:
    """The keep sets measured over ``regions``, and how they were picked."""
    if len(regions) <= MAX_EXHAUSTIVE_REGIONS:
        sets = [c for n in range(len(regions) + 1) for c in itertools.combinations(regions, n)]
        return sets, "exhaustive"
    every = tuple(regions)
    sets = [(), every, *((r,) for r in regions), *(tuple(x for x in regions if x != r) for r in regions)]
    return sets, f"{len(regions)} regions: none, each alone, all, all but each"


def configurations(
    regions: Sequence[str],
    budgets: Sequence[float | None],
    policies: Sequence[RegionPolicy],
    offload: bool,
) -> tuple[list[Actions], str]:
    """Every configuration a plan measures over ``regions`` (the module docstring), and how
    the keep sets were picked."""
    sets, search = keep_sets(regions)
    out: dict[Actions, None] = {}
    for policy, keep, budget in itertools.product(policies, sets, budgets):
        if policy is not policies[0] and not keep:
            continue  # a policy only decides inside kept regions: keep={} is the same for all
        out[Actions(frozenset(keep), policy, budget)] = None
    if offload:
        for inner, outer in itertools.permutations(map(frozenset, sets), 2):
            if inner < outer:
                out[Actions(inner, policies[0], None, outer - inner)] = None
        search += "; offloading the difference of every two nested keep sets"
    return list(out), search


def flops_order(c: Candidate) -> tuple[Any, ...]:
    """The least recompute first; then the fewest bytes to the host and on the device, no
    budget, fewer regions offloaded (one whose values PyTorch's pass cannot move offloads
    nothing), fewer kept."""
    return (
        c.recompute_flops,
        c.offloaded_bytes,
        c.saved_bytes,
        c.budget is not None,
        len(c.offload),
        len(c.keep),
    )


def mark_pareto(found: list[Candidate]) -> list[Candidate]:
    """``found``, each marked ``pareto`` when no other has as few device bytes, FLOPs and
    host bytes, one strictly fewer."""

    def key(c: Candidate) -> tuple[int, int, int]:
        return (c.saved_bytes, c.recompute_flops, c.offloaded_bytes)

    out = []
    for c in found:
        mine = key(c)
        dominated = any(all(a <= b for a, b in zip(key(o), mine)) and key(o) != mine for o in found)
        out.append(dataclasses.replace(c, pareto=not dominated))
    return out


def policy_name(policy: RegionPolicy) -> str:
    if policy is SAVE_ALL:
        return "SAVE_ALL"
    return getattr(policy, "__name__", repr(policy))
