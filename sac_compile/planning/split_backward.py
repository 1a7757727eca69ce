"""What PyTorch's split backward recomputes and holds where it meets a checkpoint.

A zero-bubble schedule runs a stage's backward as ``I`` (``stage_backward_input``: the
gradient of its input, the autograd graph retained) and, later, ``W``
(``stage_backward_weight``): one ``torch.autograd.grad`` call per weight group, in the
stage's parameter order. A non-reentrant checkpoint recomputes its function once per
backward call (per graph task), so every weight group recomputes its whole layer, and a
recomputed value stays alive as long as any of the autograd nodes saving it does: the nodes
the group runs (its weight's gradient op) release theirs as they run; the nodes only ``I``
runs (attention, activations, the input's side of a norm) keep theirs, one copy per group,
until the stage's ``W`` has run every group and the graph dies. Read off the tagged joint
graph of one layer by :func:`split_recompute`; checked against PyTorch's pipelining on gloo
ranks (``tests/test_distributed.py``) and one stage's ``W`` measured group by group
(``tests/test_peak.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._compat.aot import gradient_nodes, is_tangent, primal_name
from .._compat.checkpoint import CheckpointPolicy
from .._compat.ops import is_view_op
from ..inspection.flops import val_bytes
from .candidates import SplitCopies

__all__ = ["split_recompute"]

_CACHED = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


def split_recompute(
    joint: torch.fx.GraphModule,
    is_param: Callable[[str], bool],
    tagged: str,
    order: Callable[[int], int] | None = None,
) -> SplitCopies:
    """:class:`SplitCopies` of one checkpointed layer under a split backward's ``W``: the bytes of recomputed copies it leaves alive once its weight groups
    ran (held while a later layer's groups run) and the most alive while they run when it is
    the stage's last layer; then the same when the groups share one recompute
    (:func:`sac_compile.pipelining.recompute_once`: copies made at the first group only).
    ``joint``: the layer's joint graph, its forward nodes tagged by a checkpointing pass
    (``tagged``: the meta key marking a tagged node; a value tagged to be saved is cached,
    not recomputed); ``order``: a weight's place in the stage's parameters, from its primal
    index (default: the primals' order).

    Each group whose weight's gradient reads a recomputed value recomputes the layer: a copy
    of every recomputed value whose saving node is alive. A value only weight-gradient ops
    read dies with the last group reading it; one the input's gradient path reads lives on.
    In the stage's last layer the graph dies from the top as the groups run: once a forward
    op is no ancestor of the ops the remaining groups start from (PyTorch's
    ``param_group["intermediates"]``), the values it saves die. Zeros for a layer nothing of
    which is recomputed."""
    g = _Graph(joint, is_param, order)
    recomputed = {
        v: readers
        for v, readers in g.readers.items()
        if v.op == "call_function" and v.meta.get(tagged) and v.meta.get("recompute") not in _CACHED
    }  # (an input, a value outside the checkpoint or one it saves: held, never copied)
    # the groups that recompute the layer: those whose weight's gradient reads any value it
    # saved (a cached one too: unpacking any of the checkpoint's saved values recomputes)
    saved = [r for v, r in g.readers.items() if v.meta.get(tagged) or g.is_input(v)]
    groups = sorted({k for readers in saved for r in readers for k in g.runs.get(r, ())})
    if not groups:
        return SplitCopies()
    released: dict[torch.fx.Node, int] = {}  # a value only weight-gradient ops read: its last group
    for v, readers in recomputed.items():
        reached = set().union(*(g.feeds.get(r, set()) for r in readers))
        if reached and not readers & g.input_path:
            released[v] = max(reached)
    sizes = {v: val_bytes(v.meta.get("val")) for v in recomputed}
    out: list[int] = []
    for once in (False, True):
        for as_last in (False, True):
            copies = dict.fromkeys(recomputed, 0)
            most = 0
            for k in groups:
                if not once or k == groups[0]:
                    for v in copies:
                        copies[v] += v not in released or released[v] >= k
                most = max(most, sum(n * sizes[v] for v, n in copies.items()))
                for v in copies:
                    if released.get(v, k + 1) <= k or (as_last and not g.kept_after(v, k)):
                        copies[v] = 0
            out.append(most if as_last else sum(n * sizes[v] for v, n in copies.items()))
    return SplitCopies(out[0], out[1], out[2], out[3], len(groups))


class _Graph:
    """A joint graph's structure as a split backward sees it: per saved forward value the
    backward ops reading it (``readers``), per backward op off the input's gradient path the
    weight groups it feeds (``feeds``), per backward op the groups whose ``W`` runs it
    (``runs``), and which forward ops stay referenced while later
    groups remain (:meth:`kept_after`)."""

    def __init__(self, joint: torch.fx.GraphModule, is_param: Callable[[str], bool], order: Any) -> None:
        nodes = list(joint.graph.nodes)
        backward = gradient_nodes(nodes)
        output = next(n for n in nodes if n.op == "output")
        primals = [n for n in nodes if n.op == "placeholder" and not is_tangent(n)]
        grads = list(output.args[0])[-len(primals) :]
        found = [i for i, d in enumerate(grads) if isinstance(d, torch.fx.Node) and is_param(primal_name(i))]
        weights = sorted(found, key=order or (lambda i: i))
        inputs = [d for i, d in enumerate(grads) if isinstance(d, torch.fx.Node) and i not in found]
        self.input_path = _ancestors(inputs, backward)
        self.feeds: dict[torch.fx.Node, set[int]] = {}
        for k, i in enumerate(weights):
            for n in _ancestors([grads[i]], backward) - self.input_path:
                self.feeds.setdefault(n, set()).add(k)
        # per backward op, the groups whose W runs it: its weight-side ops and the op on the
        # input's path each starts from (PyTorch's intermediate, run again: a fused backward
        # making the input's and the weight's gradients at once)
        self.runs: dict[torch.fx.Node, set[int]] = {n: set(ks) for n, ks in self.feeds.items()}
        for n, ks in self.feeds.items():
            for a in n.all_input_nodes:
                if a in self.input_path:
                    self.runs.setdefault(a, set()).update(ks)
        forward = [n for n in nodes if n.op == "call_function" and n not in backward]
        base: dict[torch.fx.Node, torch.fx.Node] = {}
        for n in forward:
            if is_view_op(n.target) and n.args and isinstance(n.args[0], torch.fx.Node):
                base[n] = base.get(n.args[0], n.args[0])
        self.readers: dict[torch.fx.Node, set[torch.fx.Node]] = {}
        for n in forward:
            readers = {u for u in n.users if u in backward}
            if readers:
                self.readers.setdefault(base.get(n, n), set()).update(readers)
        # the forward ops on the input's path (its autograd nodes), and each group's first
        # such op meeting its weight (where PyTorch's split backward starts the group)
        flowing = {p for i, p in enumerate(primals) if i not in found}
        self._inputs = set(flowing)
        params = {primals[i]: k for k, i in enumerate(weights)}
        weighted: dict[torch.fx.Node, set[int]] = {p: {k} for p, k in params.items()}
        starts: dict[int, list[torch.fx.Node]] = {}
        for n in forward:
            ins = n.all_input_nodes
            if any(a in flowing for a in ins):
                flowing.add(n)
                for a in ins:
                    if a not in flowing:
                        for k in weighted.get(a, ()):
                            starts.setdefault(k, []).append(n)
            else:
                ks = set().union(*(weighted.get(a, set()) for a in ins))
                if ks:
                    weighted[n] = ks
        self._owners = {v: {v, *(u for u in v.users if u in flowing)} for v in self.readers}
        self._kept: dict[int, set[torch.fx.Node]] = {}
        later: set[torch.fx.Node] = set()
        for k in range(len(weights) - 1, -1, -1):
            self._kept[k] = set(later)
            later |= _ancestors(starts.get(k, []), flowing)

    def is_input(self, value: torch.fx.Node) -> bool:
        """Whether ``value`` is one of the layer's inputs (not a weight)."""
        return value in self._inputs

    def kept_after(self, value: torch.fx.Node, group: int) -> bool:
        """Whether a forward op saving ``value`` is still referenced once ``group`` ran."""
        return bool(self._owners.get(value, {value}) & self._kept.get(group, set()))


def _ancestors(roots: list[torch.fx.Node], within: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """The nodes of ``within`` that ``roots`` are computed from, the roots included."""
    seen: set[torch.fx.Node] = set()
    stack = [r for r in roots if r in within]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(a for a in n.all_input_nodes if a in within)
    return seen
