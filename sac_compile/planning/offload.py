"""Offload on a device: what crosses the host link (:mod:`.host`), what the layer's compute
hides, and what host memory holds.

A region's offloaded values cross the host link once in the forward (device to host) and once
in the backward (host to device); PCIe and NVLink-C2C carry both directions at once, so each
copy is counted at the link's one-way bandwidth, at :data:`HOST_EFFICIENCY` of it.

* **Compiled** (PyTorch's partitioner pass, on CUDA with its side stream), read off the
  partitioned graphs (:func:`graph_copies`): a value's copy to the host starts after its last
  use in the forward graph, the copies run one after another on the side stream, and the graph
  waits for them at its end (the pass's sunk waits): what of the copies outlasts the compute
  after each start is exposed. In the backward graph the copies back are prefetched to its start
  at the earliest (PyTorch's ``reorder_for_prefetch`` moves them no further), one after
  another, each awaited at the value's first use: a copy not done by the compute before that
  use stalls the graph. The pass works inside one graph, so a layer's copies hide behind its
  own compute only: the last region of a layer (its MLP) has little forward after it and little
  backward before it.
* **Eager** (on CUDA the engine copies its cache on a side stream at the end of the layer's
  forward, and the next layer's forward waits for those copies at its own end; it copies a
  layer's values back as the layer after it starts its backward:
  ``sac_compile/eager/host_copy.py``): the copies to the host hide behind the next layer's
  forward, a layer of the same kind (``forward_seconds``), the copies back behind the previous
  one's backward (``backward_seconds``). The first layer in the backward has no backward
  before it: its copies back, one layer's a step, are counted hidden like the others.

Host memory holds, per GPU, every offloaded layer's values of every microbatch in flight (the
first pipeline stage's, the most); a plan that offloads fits only when they fit
``Target.host_memory``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .candidates import Copies
from .host import HOST_EFFICIENCY
from .parallel import held, per_rank_bytes

if TYPE_CHECKING:
    from .candidates import Candidate
    from .devices import Target

__all__ = ["graph_copies", "host_bytes", "offloaded_per_rank", "transfer"]


def graph_copies(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule) -> Copies:
    """The copies PyTorch's offload pass put in a partitioned forward and backward graph
    (Note [offload through PyTorch's pass] in ``_compat/aot.py``), in graph order."""
    from .._compat.aot import offloaded_source
    from ..inspection.flops import node_cost, val_bytes

    def copies(gm: torch.fx.GraphModule, after: bool) -> list[tuple[int, int, int]]:
        nodes = list(gm.graph.nodes)
        index = {n: i for i, n in enumerate(nodes)}
        costs = [node_cost(n) for n in nodes]
        out, started = [], set()
        for i, n in enumerate(nodes):
            # (with CUDA inputs the copy starts at ``async_cpu_offload_<value>`` and is awaited
            # at ``cpu_offload_<value>``, sunk to the graph's end: the start counts)
            name = n.name.removeprefix("async_")
            if after and n.op == "call_function" and offloaded_source(name) != name:
                if name in started:
                    continue
                started.add(name)
                rest = costs[i + 1 :]
            elif not after and n.op == "placeholder" and offloaded_source(n.name) != n.name:
                users = [index[u] for r in n.users for u in r.users] or [len(nodes)]
                rest = costs[: min(users)]  # (the copy back's users: the value's first use)
            else:
                continue
            out.append((val_bytes(n.meta.get("val")), sum(f for f, _ in rest), sum(t for _, t in rest)))
        return out

    return Copies(tuple(copies(fw, True)), tuple(copies(bw, False)))


def offloaded_per_rank(c: Candidate | None, target: Target, compile: bool) -> float:
    """The bytes one layer with candidate ``c`` sends to the host per traced unit, per rank:
    compiled, its partition's offloaded values; eager, what the engine copies (as measured,
    else the partition's). Under tensor parallelism, compiled: the offloaded values split as
    the saved ones are (``Candidate.tp_offloaded_split``); eager: the difference of what a rank
    holds keeping the offloaded regions too and keeping its keep set alone
    (``Candidate.nested``, each as :func:`~sac_compile.planning.parallel.held` counts it); both
    checked on two gloo ranks, with and without sequence parallelism
    (tests/test_tensor_parallel.py); else ``1 / tp`` of it."""
    if c is None or not c.offload:
        return 0.0
    if target.layout.tp > 1 and compile and any(c.tp_offloaded_split):
        split = c.tp_offloaded_split[:3]
        return float(
            per_rank_bytes(c.offloaded_bytes, split, target.layout.tp, target.layout.sequence_parallel)
        )
    if target.layout.tp > 1 and c.nested is not None:
        inner, outer = c.nested  # (what a rank holds keeping the offloaded regions too, less without)
        return max(held(outer, target, compile) - held(inner, target, compile), 0.0)
    moved = c.offloaded_bytes if compile or c.eager_offloaded_bytes is None else c.eager_offloaded_bytes
    return moved / target.layout.tp


def transfer(
    c: Candidate | None,
    target: Target,
    compile: bool,
    forward_seconds: float = 0.0,
    backward_seconds: float = 0.0,
) -> tuple[float, float]:
    """``(copying, exposed)`` seconds of one layer's offload with candidate ``c`` per traced
    unit on a rank of ``target``: every copy to the host and back, and what compute does not
    hide (the module docstring). Eager, the copies to the host hide behind
    ``forward_seconds`` (a layer's forward), the copies back behind ``backward_seconds`` (a
    layer's backward, its recompute included)."""
    moved = offloaded_per_rank(c, target, compile)
    if not moved or c is None:
        return 0.0, 0.0
    link = target.machine.host.bandwidth * HOST_EFFICIENCY
    if not compile:
        one = moved / link
        return 2 * one, max(one - forward_seconds, 0.0) + max(one - backward_seconds, 0.0)

    def copy(nbytes: int) -> float:
        return nbytes / target.layout.tp / link

    seconds = target.compute_seconds

    exposed = 0.0
    for graph in c.copies:
        end = float("-inf")  # the side stream's, in seconds before the forward graph's end
        for nbytes, flops, traffic in graph.forward:
            end = max(end, -seconds(flops, traffic)) + copy(nbytes)
        exposed += max(end, 0.0)
        done, stall = 0.0, 0.0  # copies back, from the backward graph's start
        for nbytes, flops, traffic in sorted(graph.backward, key=lambda b: seconds(b[1], b[2])):
            done += copy(nbytes)
            stall = max(stall, done - seconds(flops, traffic))
        exposed += stall
    return 2 * moved / link, exposed


def host_bytes(layers: list[tuple[int, float]], target: Target) -> int:
    """Host memory per GPU for ``layers`` (count, bytes one layer offloads per traced unit
    per rank): with pipeline parallelism the first stage's ``1 / pp`` of them, times the
    microbatches it holds at once."""
    from .peak import in_flight

    return int(sum(count * moved for count, moved in layers) / target.layout.pp * in_flight(target, 0))
