"""What a layer's backward graph allocates while it runs, read off the graph itself: its
transient (:func:`graph_transient`) and, for context parallelism, what its attention adds run
as PyTorch's ring attention (:func:`graph_ring`). The step's peak (:mod:`.peak`) adds these
per layer to what the layers hold."""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch

from .._compat.aot import gradient_nodes, offloaded_source, primal_name
from .._compat.ops import is_view_op
from ..inspection.flops import val_bytes

__all__ = [
    "RING_BACKWARDS",
    "backward_figures",
    "graph_ring",
    "graph_transient",
    "larger_ring",
    "routed_transient",
    "weight_gradient_inputs",
]


def graph_transient(gm: torch.fx.GraphModule) -> int:
    """The most bytes a backward graph allocates beyond its inputs while it runs: each op's
    outputs (views and aliases allocate nothing; a view keeps its base alive) live from the op
    to their last use (a multi-output op's each to its own ``getitem``'s last use, counted
    once; a multi-output view's ``getitem`` a view), inputs (saved values, incoming gradients) freed after theirs, outputs
    (the gradients it returns) live to the end. A saved value offloaded to the host takes
    no device memory until it is brought back, which allocates it. Returns
    ``max(live) - inputs``: what the backward of a layer adds on top of what the layer held
    on the device, at its peak."""
    return _transient(*_timeline(gm))


def backward_figures(gm: torch.fx.GraphModule) -> tuple[int, tuple[int, int]]:
    """:func:`graph_transient` and :func:`graph_ring` of one backward graph, from one walk."""
    inputs, timeline = _timeline(gm)
    return _transient(inputs, timeline), _ring(inputs, timeline)


def _transient(inputs: int, timeline: list[tuple[torch.fx.Node, int]]) -> int:
    return max([live for _, live in timeline] + [inputs]) - inputs


#: The attention kernels' backward ops context parallelism runs as a ring (PyTorch's
#: ``context_parallel`` routes the CUDA kernels; the planner's flash stand-in and the CPU's
#: flash kernel are those a trace has): ``(grad, query, key, value, ...)``.
RING_BACKWARDS = (
    "aten._scaled_dot_product_flash_attention_backward.default",
    "aten._scaled_dot_product_efficient_attention_backward.default",
    "aten._scaled_dot_product_cudnn_attention_backward.default",
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
    "sac_compile_plan.flash_attention_backward.default",
)


def graph_ring(gm: torch.fx.GraphModule) -> tuple[int, int]:
    """What a backward graph's attention adds run as PyTorch's ring attention
    (``_templated_ring_attention_backward``, all-gather rotation, ``convert_to_f32``) on ``cp``
    ranks: its transient becomes at least ``base + cp * per_rank``; returns ``(base,
    per_rank)`` (``(0, 0)`` without such an op; ``base`` below 0 where the kernel runs after
    much of the graph's inputs are freed, as a no-checkpoint layer's attention does). Beside
    the one kernel's outputs, the ring holds float32 gradient accumulators for the query,
    keys and values, the keys and values concatenated to send (``p kv``) and every rank's
    all-gathered (``cp p kv``), the previous step's kernel gradients while the next runs
    (``p (q + kv)``), and the float32 key and value gradients concatenated and received around
    the ring (``2 x 4 kv``): ``q`` and ``kv`` the query's and the keys' and values' elements,
    ``p`` their width. For one attention that is
    16 (float32) and 23 (bfloat16) query sizes at two ranks against 14.5-15 and 20-22
    measured on gloo ranks, 20 and 27 at four against 21-23 and 24-29; a whole step:
    ``tests/test_context_parallel.py``. Gloo's all-gather allocates temporaries of its own
    (in the forward, gone before the kernel runs) that NCCL's does not."""
    return _ring(*_timeline(gm))


def larger_ring(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    """Of two :func:`graph_ring` figures, the one whose ring holds more at two ranks; one
    without an attention op (``per_rank`` 0) gives way to one with, whose ``base`` may be
    below 0 (its attention's backward runs after much of the graph's inputs are freed)."""
    if not a[1] or not b[1]:
        return a if a[1] else b
    return max(a, b, key=lambda r: r[0] + 2 * r[1])


def _ring(inputs: int, timeline: list[tuple[torch.fx.Node, int]]) -> tuple[int, int]:
    best = (0, 0)
    for node, live in timeline:
        if str(node.target) not in RING_BACKWARDS:
            continue
        query, key, value = (val_bytes(a.meta.get("val")) for a in node.args[1:4])  # type: ignore[union-attr]
        width = node.args[1].meta["val"].dtype.itemsize  # type: ignore[union-attr]
        kv = key + value
        accumulators = (query + kv) * 4 // width
        base = live - inputs + accumulators + kv + (query + kv) + 2 * kv * 4 // width
        best = larger_ring(best, (base, kv))
    return best


def weight_gradient_inputs(gm: torch.fx.GraphModule, is_param: Callable[[str], bool]) -> int:
    """The bytes of the gradients a backward graph computes its weights' gradients from: for
    each parameter's gradient it returns (``primals_N``'s, in order), walking back through
    the ops that read the incoming gradient alone (views, casts, sums) to the one that meets
    a forward value (a linear's ``mm``, a norm's ``mul``), the gradient operand there. What
    PyTorch's split backward (``stage_backward_input``, zero-bubble schedules) records at
    those ops and holds from a microbatch's ``I`` to its ``W``."""
    tangent = gradient_nodes(gm.graph.nodes)
    found: dict[torch.fx.Node, int] = {}
    for primal, node in _returned_gradients(gm):
        if not is_param(primal):
            continue
        while node in tangent and node.op == "call_function":
            side = [a for a in node.all_input_nodes if a in tangent]
            if len(side) < len(node.all_input_nodes):  # (meets a forward value here)
                found.update((a, val_bytes(a.meta.get("val"))) for a in side)
                break
            if len(side) != 1:
                break
            node = side[0]
    return sum(found.values())


def _returned_gradients(gm: torch.fx.GraphModule) -> list[tuple[str, torch.fx.Node]]:
    """The gradients a backward graph returns, each with the primal (``primals_N``) it is of."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    grads = output.args[0] if isinstance(output.args[0], (tuple, list)) else ()
    return [(primal_name(i), g) for i, g in enumerate(grads) if isinstance(g, torch.fx.Node)]


def _timeline(gm: torch.fx.GraphModule) -> tuple[int, list[tuple[torch.fx.Node, int]]]:
    """A backward graph's input bytes, and per op the bytes live once its outputs are
    allocated (before what it last reads is freed): :func:`graph_transient`'s accounting."""
    inputs, _, timeline = _split_timeline(gm, frozenset())
    return inputs, [(n, live) for n, live, _ in timeline]


def _split_timeline(
    gm: torch.fx.GraphModule, part: frozenset[torch.fx.Node]
) -> tuple[int, int, list[tuple[torch.fx.Node, int, int]]]:
    """:func:`_timeline`, with the bytes of the nodes in ``part`` (placeholders, or ops'
    outputs) counted apart too: ``(inputs, of them part's, [(op, live, of it part's)])``."""
    nodes = list(gm.graph.nodes)
    base: dict[torch.fx.Node, torch.fx.Node] = {}
    size: dict[torch.fx.Node, int] = {}
    owner: dict[torch.fx.Node, torch.fx.Node] = {}  # (an output of a multi-output op: its op)
    for n in nodes:
        if (
            n.op == "call_function"
            and is_view_op(n.target)
            and n.args
            and isinstance(n.args[0], torch.fx.Node)
        ):
            base[n] = base.get(n.args[0], n.args[0])
        elif n.target is operator.getitem and n.args and n.args[0] in base:  # (of a multi-output view op)
            base[n] = base[n.args[0]]
        elif n.op == "placeholder" and offloaded_source(n.name) != n.name:
            size[n] = 0  # (on the host)
        elif n.op in ("placeholder", "call_function"):
            size[n] = val_bytes(n.meta.get("val"))
            if n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node):
                owner[n] = n.args[0]
    last: dict[torch.fx.Node, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            root = base.get(a, a)
            last[root] = i if n.op != "output" else len(nodes)
    part = frozenset(base.get(n, n) for n in part)  # (a view's bytes are its base's)
    inputs = sum(size[n] for n in nodes if n.op == "placeholder")
    inputs_part = sum(size[n] for n in nodes if n.op == "placeholder" and n in part)
    live, live_part = inputs, inputs_part
    timeline = []
    for i, n in enumerate(nodes):
        if n in owner and owner[n] in size:  # (allocated with its op: its bytes move out of the op's)
            moved = min(size[n], size[owner[n]])
            size[owner[n]] -= moved
            live += size[n] - moved
            live_part += (size[n] if n in part else 0) - (moved if owner[n] in part else 0)
            timeline.append((n, live, live_part))
        elif n in size and n.op == "call_function":
            live += size[n]
            live_part += size[n] if n in part else 0
            timeline.append((n, live, live_part))
        for a in n.all_input_nodes:
            root = base.get(a, a)
            if last.get(root) == i and root in size:
                live -= size[root]
                live_part -= size[root] if root in part else 0
                last.pop(root)
    return inputs, inputs_part, timeline


def routed_transient(gm: torch.fx.GraphModule, routed: frozenset[str]) -> tuple[tuple[int, int], ...]:
    """A backward graph's transient (:func:`graph_transient`'s accounting) split in two at
    each op: the bytes beyond its inputs not of the routed experts, and the routed experts'
    (their weights, ``routed`` primals and their saved views, what it computes from them
    alone, and the gradients it returns for them) beyond theirs;
    the pairs no other exceeds in both. A one-process trace runs every expert; a rank of
    expert parallelism holds ``1 / ep`` of them and their gradients, so its transient is
    ``max(a + b // ep)`` over the pairs (:func:`~.figures.rank_transient`; ``max(a + b)`` is
    :func:`graph_transient`'s). Empty where nothing is routed."""
    if not routed:
        return ()
    part = {n for n in gm.graph.nodes if n.op == "placeholder" and n.name in routed}
    part |= {g for primal, g in _returned_gradients(gm) if primal in routed}
    for n in gm.graph.nodes:  # (what it computes from routed weights alone: copies, casts of them)
        if n.op == "call_function" and n.all_input_nodes and all(a in part for a in n.all_input_nodes):
            part.add(n)
    if not part:
        return ()
    inputs, inputs_part, timeline = _split_timeline(gm, frozenset(part))
    points = [(0, 0)] + [(live - p - (inputs - inputs_part), p - inputs_part) for _, live, p in timeline]
    return frontier(points)


def frontier(points: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Of ``(a, b)`` pairs, those no other is at least as large as in both (one of equals)."""
    kept: list[tuple[int, int]] = []
    for a, b in sorted(set(points), key=lambda p: (-p[0], -p[1])):
        if not kept or b > kept[-1][1]:
            kept.append((a, b))
    return tuple(kept)
