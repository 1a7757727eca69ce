"""Measuring candidates: one trace, one partition per configuration; eager bytes.

:class:`PartitionEach` is a Dynamo backend that hands AOTAutograd a partition function which,
for every joint graph, copies it once per configuration, tags the copy with that
configuration's pass and partitions it exactly as the configuration's ``aot_eager`` compile
would (``SacBackend.partition``), reading the bytes the backward keeps and the costly FLOPs
it runs off the partitioned graphs. No code is generated and only the forward runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Hashable
from typing import Any, cast

import torch
import torch.nn as nn

from ..actions import Actions
from .candidates import SplitCopies

__all__ = ["LayerMeasure", "PartitionEach", "eager_bytes", "measure", "plain_bytes", "timed"]


@dataclasses.dataclass
class LayerMeasure:
    """What one configuration's partitions of a traced unit hold and run, summed over its
    graphs (the transient and the ring's: the largest, the graphs run in turn)."""

    saved_bytes: int = 0  # held for the backward, the unit's inputs included
    backward_flops: int = 0  # costly FLOPs of the backward (recompute included)
    backward_transient: int = 0  # the backward graph's transient (graph_memory.backward_figures)
    forward_flops: int = 0
    backward_traffic: int = 0  # bytes the memory-bound ops move
    forward_traffic: int = 0
    # the saved bytes' tensor-parallel split (planning.parallel.tensor_parallel_split): split
    # tp ways, whole, whole with sequence parallelism only, the row-parallel outputs
    tp_split: tuple[int, int, int] = (0, 0, 0)
    tp_row_outputs: int = 0
    offloaded_bytes: int = 0  # saved to host memory (the configuration's offloaded regions)
    ring: tuple[int, int] = (0, 0)  # the backward's attention as ring attention: base, per rank
    tp_offloaded_split: tuple[int, int, int, int] = (0, 0, 0, 0)  # the offloaded bytes' split
    forward_attention_flops: int = 0
    # the gradients its weights' gradients are computed from (graph_memory.weight_gradient_inputs)
    weight_gradient_inputs: int = 0
    # under a split backward's W, the recomputed copies it leaves and its most alive
    # (split_backward.split_recompute), then the same recomputed once
    split_recompute: SplitCopies = SplitCopies()
    # the backward's transient split, its routed experts' apart (graph_memory.routed_transient;
    # the graphs run in turn: one frontier of their pairs)
    routed_transient: tuple[tuple[int, int], ...] = ()

    def add_split(self, held: tuple[int, ...], moved: tuple[int, ...] | None) -> None:
        """Add a graph's tensor-parallel splits (:func:`_splits`) to the sums."""
        self.tp_split = cast("tuple[int, int, int]", _plus(self.tp_split, held[:3]))
        self.tp_row_outputs += held[3]
        if moved is not None:
            self.tp_offloaded_split = cast("tuple[int, int, int, int]", _plus(self.tp_offloaded_split, moved))


def _plus(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(x + y for x, y in zip(a, b, strict=True))


class PartitionEach:
    """A Dynamo backend partitioning each graph once per configuration: one Dynamo trace and
    one joint graph, a copy of it tagged and partitioned per configuration exactly as that
    configuration's ``aot_eager`` compile would (``SacBackend.partition``), and the figures
    read off the partitioned graphs (:func:`~sac_compile.inspection.report.build_partition`,
    :func:`~sac_compile.inspection.flops.graph_costly_flops`). The compiled code is the
    first configuration's."""

    def __init__(self, configs: dict[Any, Any], params: tuple[torch.Tensor, ...] = ()) -> None:
        self.configs = configs
        # the traced module's parameters in their order (a split backward's weight groups')
        self.params = params
        self.figures: dict[Any, LayerMeasure] = {key: LayerMeasure() for key in configs}
        self.eager: dict[Any, int] = {}  # configurations that know what their eager run holds
        self.copies: dict[Any, list[Any]] = {}  # per offloading configuration: each graph's Copies
        self.regions: list[str] = []
        self.scopes: list[int] = []  # per graph: the checkpoint scopes of the first configuration

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]):
        from .._compat import aot
        from ..compiler import backend as backends
        from ..compiler.inner import snapshot
        from ..diagnostics import trace_watch
        from ..inspection.report import build_partition, param_input
        from ..passes.saving_rules import TAGGED
        from .graph_memory import weight_gradient_inputs
        from .offload import graph_copies
        from .split_backward import split_recompute

        unit = backends.new_unit(gm, example_inputs)
        trace_watch.claim_trace()  # the markers are read here (not a no-pass graph)

        is_param = functools.partial(param_input, input_is_param=unit.input_is_param)
        order = self._order(example_inputs)

        def partition(joint, joint_inputs, **kwargs):
            chosen = None
            backwards = []  # (configuration, its backward graph): their routed experts' part, once known
            routed: frozenset[str] | None = None
            recorded = None  # (the weights' gradients' inputs: alike in every configuration's backward)
            for key, backend in self.configs.items():
                one = dataclasses.replace(unit, records=[], graphs={}, saved_names=None)
                # the records stay here: not in the compile session, the history or the trace
                pass_ = backend.new_pass(unit.context, one.records.append) if backend.checkpoint else None
                tagged = aot.copy_joint(joint)
                actions = getattr(backend, "actions", None)
                with aot.offloading(example_inputs, bool(actions and actions.offload)):
                    fw, bw = backend.partition(
                        tagged,
                        joint_inputs,
                        pass_=pass_,
                        untagged=lambda: aot.copy_joint(joint),
                        **kwargs,
                    )
                one.graphs = {"forward": snapshot(fw), "backward": snapshot(bw)}
                part = build_partition(0, one)
                assert part is not None  # (it has a forward graph)
                found = self.figures[key]
                found.saved_bytes += part.activation_bytes + part.input_bytes
                found.offloaded_bytes += part.offloaded_bytes
                if part.offloaded_bytes:
                    self.copies.setdefault(key, []).append(graph_copies(fw, bw))
                _add_graphs(found, fw, bw)
                backwards.append((found, bw))
                if recorded is None:
                    recorded = weight_gradient_inputs(bw, is_param)
                found.weight_gradient_inputs += recorded
                if backend.checkpoint:
                    found.split_recompute += split_recompute(tagged, is_param, TAGGED, order)
                node_regions = dict(one.records[-1].node_regions) if one.records else {}
                if routed is None and one.records:
                    routed = _routed_primals(tagged, node_regions, is_param)
                found.add_split(*_splits(fw, bw, is_param, node_regions, actions, part.offloaded_bytes))
                if hasattr(backend, "held_eagerly"):  # (what its eager run holds, from the tags)
                    self.eager[key] = self.eager.get(key, 0) + backend.held_eagerly(tagged, is_param)
                for rec in one.records[-1:]:
                    self.regions.extend(r for r in rec.regions if r not in self.regions)
                    if chosen is None:
                        self.scopes.append(len(rec.scopes))
                chosen = chosen or (fw, bw)
            for found, bw in backwards if routed else ():
                _add_routed(found, bw, cast("frozenset[str]", routed))
            return chosen

        def compile_graph(g, _inputs):
            return aot.make_boxed_func(g.forward)

        return aot.aot_autograd(
            fw_compiler=compile_graph,
            bw_compiler=compile_graph,
            inference_compiler=compile_graph,
            partition_fn=partition,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)

    def _order(self, example_inputs: list[Any]) -> Callable[[int], int]:
        """A primal's place among the traced module's parameters (those not found: after them,
        in their order)."""
        place = {id(p): k for k, p in enumerate(self.params)}

        def order(i: int) -> int:
            found = place.get(id(example_inputs[i])) if i < len(example_inputs) else None
            return len(place) + i if found is None else found

        return order


def _splits(
    fw: torch.fx.GraphModule,
    bw: torch.fx.GraphModule,
    is_param: Callable[[str], bool],
    node_regions: dict[str, tuple[str, ...]],
    actions: Any,
    offloaded: int,
) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """The saved values' tensor-parallel split (four figures) and, where the partition
    offloads, the offloaded values' (else ``None``)."""
    from .parallel import tensor_parallel_split, tensor_parallel_splits

    regions = functools.partial(_regions, node_regions)
    saving = functools.partial(_saves, actions.saving if actions is not None else frozenset())
    if not offloaded:
        return tuple(tensor_parallel_split(fw, bw, is_param, regions, saving)), None
    moving = functools.partial(_saves, actions.offload if actions is not None else frozenset())
    held, moved = tensor_parallel_splits(fw, bw, is_param, regions, saving, moving)
    return tuple(held), tuple(moved)


def _add_graphs(found: LayerMeasure, fw: torch.fx.GraphModule, bw: torch.fx.GraphModule) -> None:
    """Add one graph's partition (``fw``, ``bw``) to a configuration's FLOPs, traffic and
    transients (the transient and the ring's: the largest, the graphs run in turn)."""
    from ..inspection.flops import graph_attention_flops, graph_costly_flops, graph_traffic
    from .graph_memory import backward_figures, larger_ring

    found.backward_flops += graph_costly_flops(bw)
    transient, ring = backward_figures(bw)
    found.backward_transient = max(found.backward_transient, transient)
    found.ring = larger_ring(found.ring, ring)
    found.forward_flops += graph_costly_flops(fw)
    found.backward_traffic += graph_traffic(bw)
    found.forward_traffic += graph_traffic(fw)
    found.forward_attention_flops += graph_attention_flops(fw)


def _add_routed(found: LayerMeasure, bw: torch.fx.GraphModule, routed: frozenset[str]) -> None:
    """Add a backward graph's transient split on its ``routed`` experts
    (:func:`~.graph_memory.routed_transient`): one frontier, the graphs run in turn."""
    from .graph_memory import frontier, routed_transient

    found.routed_transient = frontier([*found.routed_transient, *routed_transient(bw, routed)])


def _routed_primals(
    joint: torch.fx.GraphModule, node_regions: dict[str, tuple[str, ...]], is_param: Callable[[str], bool]
) -> frozenset[str]:
    """The parameters (``primals_N``) only a region named ``experts`` reads in the forward
    (every forward op reading them, through views, runs in it), and those views (a backward
    graph's inputs where saved): the routed experts, which expert parallelism splits ``ep``
    ways (:data:`~.parallel.WHOLE_REGIONS`)."""
    from .._compat.aot import gradient_nodes
    from .._compat.ops import is_view_op

    backward = gradient_nodes(joint.graph.nodes)
    found = set()
    for p in joint.graph.nodes:
        if p.op != "placeholder" or not is_param(p.name):
            continue
        readers, views, todo = [], [p.name], list(p.users)
        while todo:
            n = todo.pop()
            if n in backward or n.op == "output":
                continue
            if n.op == "call_function" and is_view_op(n.target):
                views.append(n.name)
                todo.extend(n.users)
            else:
                readers.append(n)
        if readers and all("experts" in node_regions.get(n.name, ()) for n in readers):
            found.update(views)
    return frozenset(found)


def _regions(node_regions: dict[str, tuple[str, ...]], name: str) -> tuple[str, ...]:
    return node_regions.get(name, ())


def measure(module: nn.Module, args, kwargs, configs: dict[Any, Any]) -> PartitionEach:
    """Compile ``module`` afresh, partitioning every graph once per configuration; the
    forward runs once (each graph compiles, and so partitions, when it is first reached).
    Static shapes: a layer's code compiled before at other shapes (another model's, in the
    same process) would otherwise be traced dynamic, its figures symbolic."""
    from ..inspection.capture import fresh_compile

    measuring = PartitionEach(configs, tuple(module.parameters()))
    with fresh_compile(module, measuring, dynamic=False) as compiled:
        compiled(*args, **kwargs)
    return measuring


def plain_bytes(module: nn.Module, args, kwargs) -> int:
    """Bytes autograd holds for the backward once ``module``'s forward returned, without any
    checkpoint (as :func:`eager_bytes` measures)."""
    return _held(module, module, args, kwargs)


def eager_bytes(module: nn.Module, args, kwargs, actions: Actions) -> int:
    """Bytes held for the backward once the eager engine's forward of ``module`` returned
    (:func:`~sac_compile.inspection.measure.autograd_saved_bytes`: autograd's saves, the
    checkpoint's inputs and the engine's cache; parameters and buffers excluded)."""
    from ..eager import checkpoint_with_regions

    def checkpointed(*a, **kw):
        return checkpoint_with_regions(module, *a, keep=actions.keep, policy=actions.policy, **kw)

    return _held(module, checkpointed, args, kwargs)


def _held(module: nn.Module, call, args, kwargs) -> int:
    """``autograd_saved_bytes`` of ``call(*args, **kwargs)`` (its first output when it returns
    several), ``module``'s parameters and buffers excluded; gradients cleared after."""
    from ..inspection.measure import autograd_saved_bytes

    def run():
        out = call(*args, **kwargs)
        return out[0] if isinstance(out, (tuple, list)) else out

    held = autograd_saved_bytes(run, exclude=[*module.parameters(), *module.buffers()])
    module.zero_grad(set_to_none=True)
    for a in [*args, *kwargs.values()]:
        if isinstance(a, torch.Tensor) and a.grad is not None:
            a.grad = None
    return held


def timed(
    module: nn.Module, args, kwargs, found: list, *, order, inner: str, iters: int
) -> tuple[list, float]:
    """``found`` with ``step_time`` set on one candidate per distinct Pareto point (bytes,
    FLOPs; the first of each in ``order``, a sort key), and the no-checkpoint step time: each
    compiled afresh with ``inner``, run once, then timed over ``iters`` interleaved rounds."""
    from ..compiler.backend import backend_for, baseline_backend
    from ..inspection.capture import fresh_compile
    from ..inspection.flops import scalar_loss
    from ..inspection.timing import interleaved_medians

    points: dict[tuple[int, int], Any] = {}
    for c in sorted((c for c in found if c.pareto), key=order):
        points.setdefault((c.saved_bytes, c.recompute_flops), c)
    params = [*module.parameters()]

    def step(fn):
        def run():
            for p in params:
                p.grad = None
            out = fn(*args, **kwargs)
            scalar_loss(out).backward()

        return run

    with contextlib.ExitStack() as stack:
        steps: dict[Hashable, Callable[[], object]] = {
            "none": step(stack.enter_context(fresh_compile(module, baseline_backend(inner))))
        }
        for key, c in points.items():
            backend = backend_for(c.actions, inner, whole_graph=True)
            steps[key] = step(stack.enter_context(fresh_compile(module, backend)))
        for run in steps.values():
            run()  # compile, outside the timed rounds
        medians = interleaved_medians(steps, iters)
    chosen = {id(c): medians[key] for key, c in points.items()}
    return [dataclasses.replace(c, step_time=chosen.get(id(c))) for c in found], medians["none"]


def _saves(saving: Any, regions: tuple[str, ...]) -> bool:
    return any(r in saving for r in regions)
