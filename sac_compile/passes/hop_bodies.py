"""Higher-order-op bodies (``invoke_subgraph``, ``cond``, flex attention's score functions)
seen from the tagging pass: whether a separately partitioned body kept something, and
the markers left in bodies, erased and recorded."""

from __future__ import annotations

import torch
import torch.fx as fx

from .. import records
from .._compat.checkpoint import CheckpointPolicy
from ..marker_walk import MarkerKind
from ..markers import ops
from .saving_rules import TAGGED as _TAGGED

__all__ = ["ERASED", "INVOKE_SUBGRAPH", "body_keeps", "erase_markers"]

ERASED = "sac_erased_regions"  # GraphModule.meta key: regions whose markers were erased
INVOKE_SUBGRAPH = getattr(torch.ops.higher_order, "invoke_subgraph", None)


def body_keeps(call: fx.Node) -> bool:
    """Whether an invoke_subgraph body holds a node this pass tagged MUST_SAVE."""
    owner = call.graph.owning_module
    body_ref = call.args[0] if call.args else None
    if owner is None or not isinstance(body_ref, fx.Node) or body_ref.op != "get_attr":
        return False
    body = getattr(owner, str(body_ref.target), None)
    if not isinstance(body, fx.GraphModule):
        return False
    return any(
        m.meta.get(_TAGGED) and m.meta.get("recompute") == CheckpointPolicy.MUST_SAVE
        for m in body.graph.nodes
    )


def erase_markers(graph: fx.Graph, rec: records.GraphRecord) -> None:
    """Erase markers left in higher-order-op bodies, recording each one.

    ``invoke_subgraph`` bodies are partitioned (and so tagged) on their own before
    the outer graph, so markers seldom remain there; ``cond`` / ``while_loop`` /
    flex-attention bodies are not partitioned by region, so their markers are
    recorded as not honoured and removed.
    """
    owner = graph.owning_module
    if owner is None:
        return
    for n in graph.nodes:
        if n.op != "get_attr":
            continue
        sub = getattr(owner, str(n.target), None)
        if not isinstance(sub, fx.GraphModule):
            continue
        hop = ",".join(sorted({str(getattr(u.target, "__name__", u.target)) for u in n.users})) or "?"
        inner = [m for m in sub.graph.nodes if ops.marker_kind(m) is not None]
        names = [str(m.args[0]) for m in inner if ops.marker_kind(m) is MarkerKind.REGION_ENTER]
        names += sub.meta.get(ERASED, [])
        for name in names:
            if (hop, name) not in rec.hop_markers:
                rec.hop_markers.append((hop, name))
        for m in inner:
            sub.graph.erase_node(m)
        rec.markers_erased += len(inner)
        erase_markers(sub.graph, rec)
        if inner:
            sub.recompile()
