"""Collectives the backward runs on forward values stay in the backward.

A backward can run a collective that reads no gradient: PyTorch's ring attention under context
parallelism all-gathers every rank's keys and values again in its backward
(``_templated_ring_attention_backward``). The partitioner marks every functional collective
``MUST_SAVE`` unless a checkpoint policy says to recompute it (``force_save_collectives``), so
such a collective moves to the forward and its output is saved: ``cp`` ranks' keys and values a
layer, held to its backward, under full recompute too (measured on two gloo ranks:
``tests/test_context_parallel.py``). :func:`keep_backward_collectives` tags each one (and
its wait) ``MUST_RECOMPUTE``: it runs in the backward where PyTorch's ring runs it, reading the
forward values the partition keeps or recomputes anyway.
"""

from __future__ import annotations

import torch.fx as fx

from .._compat import aot
from .._compat.checkpoint import CheckpointPolicy

__all__ = ["keep_backward_collectives"]


def keep_backward_collectives(nodes: list[fx.Node], forward: set[fx.Node]) -> list[str]:
    """Tag ``MUST_RECOMPUTE`` every functional collective of a joint graph's backward (outside
    ``forward``) that depends on no gradient, and the backward's nodes it reads (the keys and
    values concatenated to send); returns their names."""
    gradient: set[fx.Node] = set()
    tagged = []
    for n in nodes:
        if n.op == "placeholder":
            if aot.is_tangent(n):
                gradient.add(n)
            continue
        if any(a in gradient for a in n.all_input_nodes):
            gradient.add(n)
            continue
        if n in forward or getattr(n.target, "namespace", None) != "_c10d_functional":
            continue
        stack = [n]  # the collective and what the backward computes for it from forward values
        while stack:
            m = stack.pop()
            if m in forward or m.op != "call_function" or m.name in tagged:
                continue
            m.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            tagged.append(m.name)
            stack.extend(m.all_input_nodes)
    return tagged
