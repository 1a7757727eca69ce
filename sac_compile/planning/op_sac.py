"""torchtitan's per-op selective activation checkpointing, measured as the planner measures
its own candidates: what a user of torchtitan runs instead of a region plan.

torchtitan's ``SelectiveAC`` (``torchtitan/distributed/activation_checkpoint.py``, 0.3.0)
wraps each block with ``create_selective_checkpoint_contexts`` and a policy that, in the
forward's op order, saves the outputs of the partitioner's compute-intensive ops (matmuls,
SDPA kernels), ``aten.max``, ``topk``, flex attention, ``reduce_scatter`` and
``all_to_all``, **except every second** ``aten.mm`` (the first, third, ... are saved), and
recomputes everything else; a matmul with a router's weight shape (``moe.router.gate``) is
recomputed and not counted. :class:`TorchtitanOpSac` tags a layer's joint graph so
(the router's matmuls: those inside the ``router`` region) and partitions it with the same
min-cut partitioner as every candidate (``DevicePlan.configuration("torchtitan-op")``).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from .._compat import aot
from .._compat.checkpoint import CheckpointPolicy
from .._compat.ops import is_view_op

__all__ = ["TORCHTITAN_OP", "TORCHTITAN_OP_2025_08", "TorchtitanOpSac", "tag_torchtitan_op"]

#: the name of torchtitan's per-op SAC among configurations (``--ac torchtitan-op``)
TORCHTITAN_OP = "torchtitan-op"

#: the same policy as torchtitan ran it before it saved the expert-parallel all-to-alls
#: (github.com/pytorch/torchtitan/pull/1672, 2025-09-06: until then its dispatch and combine
#: were recomputed, outside the save list); the runs of that time are planned so
TORCHTITAN_OP_2025_08 = "torchtitan-op-2025-08"

_MM = torch.ops.aten.mm.default


def _save_ops() -> frozenset:
    aten = torch.ops.aten
    extra = {aten.max.default, aten.topk.default, aten._scaled_dot_product_cudnn_attention.default}
    extra |= {aten._scaled_dot_product_attention_math.default}
    for name in ("reduce_scatter_tensor", "all_to_all_single"):
        op = getattr(torch.ops._c10d_functional, name, None)
        if op is not None:
            extra.add(op.default)
    return aot.compute_intensive_ops() | extra


def tag_torchtitan_op(graph: fx.Graph, node_regions: dict[str, tuple[str, ...]]) -> int:
    """Re-tag the forward nodes of a joint graph that :func:`~sac_compile.passes.tag_regions.tag_regions`
    tagged (one scope, nothing kept) with torchtitan's per-op policy; ``node_regions``: each
    node's open regions (a router's matmuls are recomputed). Returns the matmuls counted."""
    from .._compat.inductor import seed_ops
    from ..passes.saving_rules import TAGGED

    save, seeds = _save_ops(), seed_ops()
    count = 0
    for n in graph.nodes:
        if not n.meta.get(TAGGED) or n.meta.get("recompute") is None:
            continue
        target = n.target
        if target is operator.getitem or target is torch.ops._c10d_functional.wait_tensor.default:
            producer = n.args[0]
            if isinstance(producer, fx.Node) and "recompute" in producer.meta:
                n.meta["recompute"] = producer.meta["recompute"]
            continue
        if target in seeds or is_view_op(target):
            continue  # random seeds saved, views recomputed: the mechanism's tags stand
        if target is _MM:
            if "router" in node_regions.get(n.name, ()):
                decision = CheckpointPolicy.PREFER_RECOMPUTE
            else:
                count += 1
                decision = CheckpointPolicy.MUST_SAVE if count % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        elif target in save or getattr(target, "namespace", None) == "sac_compile_plan":
            decision = CheckpointPolicy.MUST_SAVE  # (the planner's stand-in for flash attention)
        else:
            decision = CheckpointPolicy.PREFER_RECOMPUTE
        n.meta["recompute"] = decision
    return count


class TorchtitanOpSac:
    """A planner configuration (as :class:`~sac_compile.compiler.backend.SacBackend` is to
    :class:`~sac_compile.planning.measure.PartitionEach`): the layer one checkpoint scope,
    tagged by :func:`tag_torchtitan_op`, partitioned by the min-cut partitioner."""

    checkpoint = True

    def new_pass(self, context: Any, publish: Any) -> Any:
        from ..actions import Actions
        from ..passes.tag_regions import tag_regions

        def run(graph: fx.Graph) -> None:
            rec = tag_regions(graph, Actions(), context=context)
            tag_torchtitan_op(graph, dict(rec.node_regions))
            publish(rec)

        return run

    def held_eagerly(self, joint: fx.GraphModule, is_param: Any) -> int:
        """What the eager run of this configuration holds for the backward, read off the
        tagged joint graph: a selective checkpoint keeps the outputs its policy saves
        (``MUST_SAVE``) and its inputs, whatever the min-cut partitioner would choose, and
        the CPU RNG state (torchtitan's ``preserve_rng_state=True``)."""
        from ..inspection.flops import val_bytes
        from ..passes.saving_rules import TAGGED

        held = torch.get_rng_state().numel()
        for n in joint.graph.nodes:
            if n.op == "placeholder":
                if not aot.is_tangent(n) and not is_param(n.name):
                    held += val_bytes(n.meta.get("val"))
            elif n.meta.get(TAGGED) and n.meta.get("recompute") is CheckpointPolicy.MUST_SAVE:
                if n.target is not operator.getitem:  # (a multi-output op counts its outputs once)
                    held += val_bytes(n.meta.get("val"))
        return held

    def partition(self, joint: fx.GraphModule, joint_inputs: Any, pass_: Any = None, **kwargs: Any) -> Any:
        kwargs.pop("untagged", None)
        if pass_ is not None:
            pass_(joint.graph)
        return aot.min_cut_rematerialization_partition(joint, joint_inputs, compiler="inductor", **kwargs)
