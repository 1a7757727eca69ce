"""Tag the joint graph's forward nodes saved or recomputed from the region markers.

Reads: the marker nodes (``sac_compile::region_*`` / ``scope_*``), the
``partitioner_tag`` that AOTAutograd puts on forward nodes, and any
``recompute`` / ``ac_graph_id`` tags a ``torch.utils.checkpoint`` already left.

Writes: ``node.meta["recompute"]`` (a ``CheckpointPolicy``) and
``node.meta["ac_graph_id"]`` on the forward nodes of every checkpoint scope, and
``node.meta["sac_regions"]`` (the regions open when the node ran) for reports.

Erases: every marker node, here and in higher-order-op bodies, so the compiled
code carries no trace of them.

Rules (the product spec's Semantics):

* Scopes come from the seam's scope markers; failing those, from the
  ``torch.utils.checkpoint`` regions already tagged in the graph; failing
  those, the scopes of wrapped layers the graph starts inside of (a graph break
  split the layer: ``context.scopes``, read from the Python stack by
  :func:`sac_compile.markers.context.enclosing_context`); failing those, the whole graph is
  one scope - unless the compiled callable contains wrapped layers
  (``context.wrapped_inside``): then code outside every scope is not the user's
  checkpoint unit and stays untagged (saved as without checkpointing). Each scope has its own ``ac_graph_id``, increasing
  in program order, so the partitioner saves the boundaries between scopes.
* Inside a scope each forward node gets what the scope's region policy
  (:mod:`sac_compile.policy`) decides from its op, the regions open when it ran
  (entries are counted, so a name opened twice stays open until closed twice) and
  the scope's keep set; by default a kept region's costly values are
  ``MUST_SAVE``, its cheap ops ``PREFER_RECOMPUTE``, everything else
  ``MUST_RECOMPUTE``. With a ``budget`` the ops outside kept regions are left
  untagged, for PyTorch's knapsack (``activation_memory_budget``, set on the graph
  through ``node.meta["memory_budget"]``) to choose among. In a checkpoint's own scope the
  markers decide only inside marked regions (the override is recorded);
  elsewhere the checkpoint's policy stands.
* ``getitem`` and ``wait_tensor`` follow their producer. Views are recomputed
  (their bases are what get saved). Seed ops are never forced to recompute.
  After the policy, :mod:`sac_compile.passes.saving_rules` saves what recomputed
  collectives feed and the small reads of kept matmul outputs, and sets the budget.
* An enter without an exit keeps the region open to the graph's end; an exit
  without an enter means the region was open since the graph's start. Both are
  recorded. Regions around a decorated function or a declared module call split by a
  graph break arrive as ``context.regions`` (open from the graph's start).
* Graphs without a backward (inference) only lose their markers.
"""

from __future__ import annotations

import operator
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.fx as fx

from .. import actions as scope_actions
from .. import keep, op_classes, policy, records
from .._compat import aot, dynamo, frames
from .._compat import inductor as inductor_compat
from .._compat import ops as op_types
from .._compat.checkpoint import CheckpointPolicy
from .._compat.inductor import custom_graph_pass_base, get_hash_for_files, seed_ops
from ..actions import Actions
from ..marker_walk import MarkerKind, OpenRegions, balance, close_innermost
from ..markers import ops
from ..markers.context import NO_CONTEXT, Enclosing
from ..markers.regions import WRAPPER_NAME
from ..policy import checked_decision, policy_key, saves
from . import backward_collectives, hop_bodies, saving_rules
from .hop_bodies import ERASED as _ERASED
from .hop_bodies import INVOKE_SUBGRAPH as _INVOKE_SUBGRAPH
from .saving_rules import TAGGED as _TAGGED

__all__ = ["TagRegionsPass", "tag_regions"]

# Every source file whose code decides a tag (the seed-op list and the op types live in _compat).
_SOURCE_FILES = (
    __file__,
    backward_collectives.__file__,
    ops.__file__,
    records.__file__,
    keep.__file__,
    policy.__file__,
    op_classes.__file__,
    scope_actions.__file__,
    saving_rules.__file__,
    hop_bodies.__file__,
    aot.__file__,
    op_types.__file__,
    frames.__file__,
    inductor_compat.__file__,
)
_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default

# Inductor's CustomGraphPass: a class that only exists at run time (importing it loads Inductor)
_PASS_BASE: Any = custom_graph_pass_base()


class TagRegionsPass(_PASS_BASE):
    """Inductor ``joint_custom_pre_pass`` running :func:`tag_regions`.

    ``uuid()`` covers the keep set, the region policy (its key includes a hash of a
    user policy's source), the budget, the backend options, the regions the graph
    starts inside of and a hash of every source file the pass reads, so neither
    the FX graph cache nor the AOTAutograd cache can serve a partition made for
    another configuration.

    Each run's :class:`~sac_compile.records.GraphRecord` goes to ``publish`` (the
    backend passes its compile session's; default: the record history only).
    """

    def __init__(
        self,
        actions: Actions,
        *,
        options_key: str = "",
        context: Enclosing = NO_CONTEXT,
        publish: Callable[[records.GraphRecord], None] = records.publish,
    ) -> None:
        self.publish = publish
        self.actions = actions
        self.options_key = options_key
        self.context = context
        self._done: weakref.WeakSet[fx.Graph] = weakref.WeakSet()  # graphs this pass tagged

    def __call__(self, graph: fx.Graph) -> None:
        if graph in self._done:
            return  # (run before a backend's partitioner and again as Inductor's pre pass)
        self._done.add(graph)
        rec = tag_regions(graph, self.actions, context=self.context)
        if not rec.repeat:
            self.publish(rec)

    def without_budget(self) -> Callable[[fx.Graph], None]:
        """The same pass with no knapsack: ``budget=None``, and a scope's own ``budget=`` (from
        the seam) dropped too (Note [budget short-circuit] in ``_compat/aot.py``)."""

        plain = TagRegionsPass(
            self.actions.without_budget(), options_key=self.options_key, context=self.context
        )
        plain.publish = self.publish

        def run(graph: fx.Graph) -> None:
            plain(graph)
            aot.drop_budget_annotation(graph)

        return run

    def uuid(self) -> bytes:
        extra = f"actions={self.actions.text}|options={self.options_key}|context={self.context!r}"
        return get_hash_for_files(_SOURCE_FILES, extra=extra)

    def __repr__(self) -> str:
        return f"TagRegionsPass({self.actions.text!r}, context={self.context})"


@dataclass
class _Scope:
    ac_graph_id: int
    actions: Actions
    info: records.ScopeInfo
    marker_id: int | None = None  # the seam's scope id, for scope markers


def tag_regions(
    graph: fx.Graph,
    actions: Actions,
    *,
    context: Enclosing = NO_CONTEXT,
) -> records.GraphRecord:
    """Tag ``graph`` in place (see the module docstring) and return what was seen."""
    nodes = list(graph.nodes)
    is_training = any(_is_tangent(n) for n in nodes)
    rec = records.GraphRecord(
        graph_index=records.next_graph_index(),
        is_training=is_training,
        keep=actions.keep,
        starts_inside=context.regions,
    )
    for name, path, cls in context.region_owners:  # declared regions entered in a caller's frame
        rec.region_modules.setdefault(name, set()).add((path, cls))
    markers = [n for n in nodes if ops.marker_kind(n) is not None]
    if not markers and any(n.meta.get(_TAGGED) for n in nodes):
        # Inductor may run the joint passes on a graph twice (HOP partitioning);
        # the first run tagged it and erased the markers: nothing left to do.
        rec.repeat = True
        return rec
    if is_training:
        forward = _forward_nodes(nodes)
        rec.forward_nodes = {n.name for n in forward}
        _tag_forward(graph, nodes, forward, actions, context, rec)
        backward_collectives.keep_backward_collectives(nodes, forward)
    else:
        _scan_markers(markers, context, rec)
        for n in markers:
            if ops.marker_kind(n) is MarkerKind.REGION_ENTER:
                name = str(n.args[0])
                rec.regions.setdefault(name, records.RegionStats(name)).entered += 1
                _note_module(rec, n)
        if graph.owning_module is not None and rec.regions:
            # Inductor runs joint passes on HOP bodies (cond branches, ...) before
            # the graph holding them; leave a note for the outer graph's record.
            graph.owning_module.meta.setdefault(_ERASED, []).extend(sorted(rec.regions))
    hop_bodies.erase_markers(graph, rec)
    for n in markers:
        graph.erase_node(n)
    rec.markers_erased += len(markers)
    graph.lint()
    if graph.owning_module is not None:
        graph.owning_module.recompile()
    return rec


def _is_tangent(node: fx.Node) -> bool:
    return node.op == "placeholder" and aot.is_tangent(node)


def _forward_nodes(nodes: list[fx.Node]) -> set[fx.Node]:
    """Forward nodes of a joint graph, in the partitioner's sense.

    AOTAutograd tags every node traced by the forward with
    ``partitioner_tag == "is_forward"``; a graph without those tags (built by hand)
    falls back to "everything before the first node that reads a tangent".
    """
    tagged = {n for n in nodes if aot.partitioner_tag(n) == "is_forward"}
    if tagged:
        return tagged
    backward = aot.gradient_nodes(nodes)
    forward: set[fx.Node] = set()
    for n in nodes:
        if n.op == "placeholder":
            continue
        if n in backward:
            break
        forward.add(n)
    return forward


def _scan_markers(markers: list[fx.Node], context: Enclosing, rec: records.GraphRecord):
    """Balance the markers (:func:`~sac_compile.marker_walk.balance`): the unbalanced ones go
    to ``rec.unbalanced``; returns the regions and scopes open since the graph's start that
    the context does not name."""
    kinds = [(cast(MarkerKind, ops.marker_kind(n)), n.args) for n in markers]  # (markers only)
    pre_regions, pre_scopes, unbalanced = balance(kinds, context.regions, [sid for sid, _ in context.scopes])
    rec.unbalanced.extend(unbalanced)
    return pre_regions, pre_scopes


class _Scopes:
    """The checkpoint scopes of one joint graph: made as the walk meets them, numbered in
    program order after the ``ac_graph_id`` of any checkpoint already tagged in it."""

    def __init__(self, rec: records.GraphRecord, actions: Actions, first_id: int) -> None:
        self.rec, self.actions, self.next_id = rec, actions, first_id
        self.of_checkpoint: dict[int, _Scope] = {}

    def new(self, source: str, actions: Actions, marker_id: int | None) -> _Scope:
        a = actions
        info = records.ScopeInfo(
            self.next_id, source, a.keep, policy_key(a.policy), a.budget, offload=a.offload
        )
        self.rec.scopes.append(info)
        self.next_id += 1
        return _Scope(info.ac_graph_id, actions, info, marker_id)

    def from_marker(self, marker_id: int, text: str, source: str = "scope markers") -> _Scope:
        return self.new(source, Actions.from_text(text), marker_id)

    def of(self, ac_id: int) -> _Scope:
        """The scope of a ``torch.utils.checkpoint`` already tagged (no budget inside)."""
        if ac_id not in self.of_checkpoint:
            actions = self.actions.without_budget()
            info = records.ScopeInfo(
                ac_id, "torch.utils.checkpoint", actions.keep, policy_key(actions.policy)
            )
            self.rec.scopes.append(info)
            self.of_checkpoint[ac_id] = _Scope(ac_id, actions, info, None)
        return self.of_checkpoint[ac_id]


@dataclass
class _Tally:
    """What tagging a graph's nodes adds up to, beyond the per-node records."""

    outside: set = field(default_factory=set)  # regions open on nodes outside every scope
    overrides: Counter = field(default_factory=Counter)  # (region, checkpoint id) -> nodes
    budgets: set = field(default_factory=set)


def _tag_forward(
    graph: fx.Graph,
    nodes: list[fx.Node],
    forward: set[fx.Node],
    actions: Actions,
    context: Enclosing,
    rec: records.GraphRecord,
) -> None:
    fw_markers = [n for n in nodes if n in forward and ops.marker_kind(n) is not None]
    ckpt_ids = {n.meta["ac_graph_id"] for n in forward if "recompute" in n.meta and "ac_graph_id" in n.meta}
    scopes = _Scopes(rec, actions, (max(ckpt_ids) + 1) if ckpt_ids else 1)
    pre_regions, pre_scopes = _scan_markers(fw_markers, context, rec)
    regions = OpenRegions([*context.regions, *pre_regions.elements()])
    stack = [scopes.from_marker(sid, k, "layer split by a graph break") for sid, k in context.scopes]
    stack += [scopes.from_marker(sid, k) for sid, k in pre_scopes]
    whole = None
    scoped = any(cast(MarkerKind, ops.marker_kind(n)).is_scope for n in fw_markers)
    if not scoped and not ckpt_ids and not stack:
        if context.wrapped_inside:
            rec.outside_every_scope = True  # not the user's checkpoint unit: left untagged
        else:
            whole = scopes.new("whole graph", actions, None)
    for name in regions.known():
        rec.regions.setdefault(name, records.RegionStats(name))
    tally = _Tally()
    for n in nodes:
        if n not in forward or n.op != "call_function":
            continue
        kind = ops.marker_kind(n)
        if kind is not None:
            _follow(n, kind, regions, stack, scopes, rec)
        elif aot.partitioner_tag(n) not in ("must_be_in_forward", "must_be_in_backward"):
            _tag_node(n, regions.names(), stack, whole, scopes, rec, tally)
    saving_rules.save_what_collectives_feed(nodes, forward, rec)
    saving_rules.save_small_reads_of_kept_matmuls(nodes, forward, rec)
    rec.outside_scope = sorted(tally.outside)
    rec.policy_overrides = [(name, ac, cnt) for (name, ac), cnt in sorted(tally.overrides.items())]
    saving_rules.set_graph_budget(graph, tally.budgets, rec)


def _follow(
    n: fx.Node,
    kind: MarkerKind,
    regions: OpenRegions,
    stack: list[_Scope],
    scopes: _Scopes,
    rec: records.GraphRecord,
) -> None:
    """The walk past one marker node (already balanced by :func:`_scan_markers`)."""
    if kind is MarkerKind.REGION_ENTER:
        name = str(n.args[0])
        regions.enter(name)
        rec.regions.setdefault(name, records.RegionStats(name)).entered += 1
        _note_module(rec, n)
    elif kind is MarkerKind.REGION_EXIT:
        regions.exit(str(n.args[0]))
    elif kind is MarkerKind.SCOPE_ENTER:
        stack.append(scopes.from_marker(int(cast(int, n.args[0])), str(n.args[1])))
    else:
        close_innermost(stack, lambda scope: scope.marker_id == int(cast(int, n.args[0])))


def _tag_node(
    n: fx.Node,
    open_names: tuple[str, ...],
    stack: list[_Scope],
    whole: _Scope | None,
    scopes: _Scopes,
    rec: records.GraphRecord,
    tally: _Tally,
) -> None:
    """Decide one forward node: its scope, then the scope's region policy."""
    if open_names:
        n.meta["sac_regions"] = open_names
        rec.node_regions[n.name] = open_names
    from_checkpoint = False
    if stack:
        scope = stack[-1]
    elif whole is not None:
        scope = whole
    elif "recompute" in n.meta and "ac_graph_id" in n.meta:
        scope = scopes.of(n.meta["ac_graph_id"])
        from_checkpoint = True
    else:
        tally.outside.update(open_names)
        return
    scope.info.nodes += 1
    rec.node_scope[n.name] = scope.ac_graph_id
    if from_checkpoint and not open_names:
        return  # outside marked regions the checkpoint's own policy stands
    decision = _decide(n, open_names, scope)
    if n.target is _INVOKE_SUBGRAPH and hop_bodies.body_keeps(n):
        # The body was partitioned (and tagged) on its own; recomputing the
        # call in the outer backward would recompute what it kept.
        decision = CheckpointPolicy.MUST_SAVE
        rec.hop_kept.append("invoke_subgraph")
    if decision is None:
        return
    budget = saving_rules.scope_budget(n, scope.actions, scope.info.source)
    if budget is not None:
        tally.budgets.add(budget)
        if not saves(decision) and not any(r in scope.actions.saving for r in open_names):
            # PyTorch's knapsack chooses among everything outside the kept regions (inside
            # them the policy's decisions stand: a cheap kept op is still recomputed)
            rec.node_policy[n.name] = "BUDGET"
            n.meta[saving_rules.LEFT_TO_BUDGET] = True
            return
    if from_checkpoint and n.meta.get("recompute") != decision:
        for name in open_names:
            tally.overrides[(name, scope.ac_graph_id)] += 1
    n.meta["recompute"] = decision
    n.meta["ac_graph_id"] = scope.ac_graph_id
    n.meta[_TAGGED] = True
    rec.node_policy[n.name] = decision.name
    if saves(decision) and scope.actions.offloads(open_names):
        n.meta[aot.SHOULD_OFFLOAD] = True
        rec.node_offload.add(n.name)
    for name in open_names:
        stats = rec.regions[name]
        stats.kept = stats.kept or name in scope.actions.saving
        stats.offloaded = stats.offloaded or name in scope.actions.offload
        if saves(decision):
            stats.saved_nodes += 1
        else:
            stats.recompute_nodes += 1


def _note_module(rec: records.GraphRecord, marker: fx.Node) -> None:
    """Where a region was entered: the innermost module Dynamo saw around the marker."""
    if frames.stack_trace_mentions(marker, WRAPPER_NAME):
        rec.decorated_enters.add(str(marker.args[0]))  # the @region wrapper emitted it
    stack = dynamo.node_module_stack(marker)
    if not stack:
        return
    path, cls = stack[-1]
    where = (records.clean_module_path(path), records.user_class_name(cls))
    rec.region_modules.setdefault(str(marker.args[0]), set()).add(where)


def _decide(n: fx.Node, open_names: tuple[str, ...], scope: _Scope) -> CheckpointPolicy | None:
    """The mechanism's rules first (they are about correctness), then the scope's policy."""
    target = n.target
    if target is operator.getitem or target is _WAIT_TENSOR:
        producer = n.args[0]
        if isinstance(producer, fx.Node) and "recompute" in producer.meta:
            return producer.meta["recompute"]
        return None
    if target in seed_ops():
        return CheckpointPolicy.MUST_SAVE
    if aot.is_with_effects(n):
        return None  # the partitioner saves an effectful op's outputs: it must run once
    if op_types.is_view_op(target):
        return CheckpointPolicy.MUST_RECOMPUTE
    return checked_decision(scope.actions.policy, target, open_names, scope.actions.saving)
