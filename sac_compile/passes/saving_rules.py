"""Saving rules the tagging pass applies after the region policy (the mechanism, not a trade-off).

Reads and writes ``node.meta["recompute"]`` on forward nodes of a joint graph that
:mod:`sac_compile.passes.tag_regions` has tagged (``node.meta[TAGGED]``):

* :func:`save_what_collectives_feed`: a kept cheap op reading a recomputed collective's
  result is saved, so the backward does not communicate again to rebuild it;
* :func:`save_small_reads_of_kept_matmuls`: a saved matmul output whose reads are all
  recomputed cheap ops, together at most half its size, is replaced by those reads;
* :func:`scope_budget` / :func:`set_graph_budget`: a scope's budget (its ``budget=`` or
  PyTorch's region annotation) handed to the partitioner's knapsack.
"""

from __future__ import annotations

import operator
from typing import cast

import torch
import torch.fx as fx

from .. import records
from .._compat import aot
from .._compat import ops as op_types
from .._compat.checkpoint import CheckpointPolicy
from ..actions import Actions
from ..op_classes import MATMULS

__all__ = [
    "LEFT_TO_BUDGET",
    "TAGGED",
    "save_small_reads_of_kept_matmuls",
    "save_what_collectives_feed",
    "scope_budget",
    "set_graph_budget",
]

TAGGED = "sac_tagged"  # node.meta key: the tagging pass set the node's recompute tag
#: node.meta key: the tagging pass left the node untagged for the scope's ``budget=`` knapsack
LEFT_TO_BUDGET = "sac_left_to_budget"


def _is_collective(n: fx.Node) -> bool:
    target = n.target
    return isinstance(target, op_types.OpOverload) and target.namespace == "_c10d_functional"


def save_what_collectives_feed(nodes, forward, rec: records.GraphRecord) -> None:
    """A kept cheap op reading a recomputed collective's result is saved instead.

    Recomputing it would re-run the collective (communication) in the backward
    just to rebuild a cheap value: the experts' input reshaped from a dispatch
    all-to-all, with only the experts kept. Reads through views, ``getitem`` and
    ``wait_tensor`` count.
    """

    def fed_by_recomputed_collective(n: fx.Node, depth: int = 0) -> bool:
        for a in n.all_input_nodes:
            if _is_collective(a) and a.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE:
                return True
            passes_through = a.target is operator.getitem or (op_types.is_view_op(a.target))
            if passes_through and depth < 8 and fed_by_recomputed_collective(a, depth + 1):
                return True
        return False

    for n in nodes:
        if (
            n in forward
            and n.meta.get(TAGGED)
            and n.meta.get("recompute") == CheckpointPolicy.PREFER_RECOMPUTE
        ):
            if fed_by_recomputed_collective(n):
                n.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                rec.node_policy[n.name] = "MUST_SAVE"


def _nbytes(n: fx.Node) -> int | None:
    """Bytes of a node's tensor value; None if not a tensor or its size is symbolic (reading
    a symbolic size as an int would specialise it: a dynamic dimension would turn static)."""
    val = n.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    numel = val.numel()
    if not isinstance(numel, int):
        return None
    return numel * val.element_size()


def _is_view_like(n: fx.Node) -> bool:
    return n.target is operator.getitem or op_types.is_view_op(n.target)


def _shrinks(n: fx.Node, size: int) -> bool:
    """A recomputed cheap op of at most half ``size`` bytes (not random: those replay their RNG).

    An op left to a scope's budget counts as recomputed: the knapsack may choose either way.
    """
    if n.op != "call_function" or _is_view_like(n):
        return False
    recomputed = n.meta.get(TAGGED) and n.meta.get("recompute") in (
        CheckpointPolicy.MUST_RECOMPUTE,
        CheckpointPolicy.PREFER_RECOMPUTE,
    )
    if not recomputed and not n.meta.get(LEFT_TO_BUDGET):
        return False
    target = n.target
    if isinstance(target, op_types.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags:
        return False
    out = _nbytes(n)
    return out is not None and 2 * out <= size


# Note [small reads of a kept matmul]
# A kept matmul whose output the backward reads only through small cheap ops (a slice,
# a reduction: at most half its bytes in total, every reader one) is better held as
# those reads: the recompute never needs the big output, so it is dropped. Both engines
# apply the same rule: here on the joint graph, and in the eager engine's end-of-forward
# walk (eager/state.py, EngineState._settle_shrinking_reads).


def save_small_reads_of_kept_matmuls(nodes, forward, rec: records.GraphRecord) -> None:
    """Save the small reads of a kept matmul output instead of the output itself
    (Note [small reads of a kept matmul]).

    When every op reading a saved matmul output (through views) is a recomputed cheap
    op, and together they are at most half its size — the combine's gather out of a zero-padded expert
    buffer, a downcast, a reduction — those reads are tagged ``MUST_SAVE``: the
    backward then never needs the matmul output (a matmul's backward reads its
    inputs, not its output), so the partitioner drops it and stores the smaller
    values. ``MUST_SAVE`` only bans recomputing a read: it is stored only if the
    backward needs it. The eager engine applies the same rule (``eager.py``).
    """
    for src in nodes:
        if (
            src not in forward
            or not src.meta.get(TAGGED)
            or src.meta.get("recompute") != CheckpointPolicy.MUST_SAVE
        ):
            continue
        packet = getattr(src.target, "overloadpacket", None)
        size = _nbytes(src)
        if packet not in MATMULS or size is None:
            continue
        readers, frontier = [], list(src.users)
        while frontier:
            u = frontier.pop()
            if _is_view_like(u):
                frontier.extend(u.users)
            else:
                readers.append(u)
        # (a reader in the backward - var_mean's gradient reads its input - needs the value anyway)
        if (
            readers
            and all(u in forward and _shrinks(u, size) for u in readers)
            # all of them together: at most half (each one _shrinks, so its _nbytes is an int)
            and 2 * sum(cast(int, _nbytes(u)) for u in readers) <= size
        ):
            for u in readers:
                u.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                rec.node_policy[u.name] = "MUST_SAVE"


def scope_budget(n: fx.Node, actions: Actions, source: str) -> float | None:
    """The knapsack budget of a node's scope (``actions``, made from ``source``): its
    ``budget=``, else the ``torch.autograd.graph.region_activation_memory_budget`` the node
    was traced under (the kept regions are saved first either way); both, and different: an
    error naming both."""
    region = aot.budget_annotation(n)
    own = actions.budget
    if own is not None and region is not None and region != own:
        raise ValueError(
            f"{n.name} ({n.target}) is in a checkpoint scope with budget={own} (from {source}: "
            f"{actions.arguments()}) and was traced under "
            f"torch.autograd.graph.region_activation_memory_budget({region}); PyTorch's partitioner applies "
            "one budget per graph. Drop one of them, or make them equal."
        )
    return own if own is not None else (region or None)  # (0: no budget, as budget=0)


def set_graph_budget(graph: fx.Graph, budgets: set[float], rec: records.GraphRecord) -> None:
    """Hand the scopes' budget (none: see below) to the partitioner's knapsack for this graph, through PyTorch's
    region annotation (Note [a budget through PyTorch's region annotation] in
    ``_compat/aot.py``); the budget is per joint graph, so scopes with different budgets in
    one graph get the smallest (recorded).
    """
    if not budgets:
        # A graph holding our scopes under region_activation_memory_budget(0): the annotation
        # made 1, so that the partitioner keeps within our tags (0 means no budget in a scope,
        # scope_budget; PyTorch's own 0 saves only the graph's inputs, dropping the kept values).
        # Code outside every scope in such a graph is then partitioned as at 1.
        if rec.scopes:
            aot.rewrite_budget_annotation(graph, 0.0, 1.0)
        return
    budget = min(budgets)
    rec.budget = budget
    if len(budgets) > 1:
        rec.budget_conflict = sorted(budgets)
    aot.set_budget_annotation(graph, float(budget))
