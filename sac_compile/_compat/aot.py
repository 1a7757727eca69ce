"""AOTAutograd and the min-cut partitioner: entry points and the naming conventions of the
graphs they produce. Imported on first use.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import types
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from . import private

__all__ = [
    "OFFLOADED_PREFIX",
    "SHOULD_OFFLOAD",
    "aot_autograd",
    "aot_autograd_kwargs",
    "budget_annotation",
    "default_partition",
    "drop_budget_annotation",
    "rewrite_budget_annotation",
    "is_min_cut_partition",
    "partition_hook",
    "set_budget_annotation",
    "compute_intensive_ops",
    "copy_joint",
    "forward_saved_outputs",
    "is_buffer_input",
    "is_rng_state_output",
    "gradient_nodes",
    "is_tangent",
    "primal_name",
    "is_with_effects",
    "make_boxed_func",
    "meta_rng_states",
    "min_cut_rematerialization_partition",
    "offloaded_source",
    "offloading",
    "partitioner_tag",
    "primal_index",
    "running_compiled_code",
]


def aot_autograd(**kwargs: Any) -> Callable[..., Callable[..., Any]]:
    """A Dynamo backend running AOTAutograd with these compilers (``torch._dynamo.backends.common``)."""
    backend: Callable[..., Callable[..., Any]] = private("torch._dynamo.backends.common", "aot_autograd")(
        **kwargs
    )
    return backend


def aot_autograd_kwargs(backend: Any) -> dict[str, Any] | None:
    """The keyword arguments of an ``aot_autograd(...)`` backend object (``AotAutograd.kwargs``:
    its compilers, ``partition_fn``, ``decompositions``, ...), a copy; ``None`` for anything
    else (a function that calls ``aot_autograd`` inside is not one)."""
    cls = private("torch._dynamo.backends.common", "AotAutograd")
    if not isinstance(backend, cls):
        return None
    return dict(backend.kwargs)


_HOOKED = "_sac_partition_hooked"


@contextlib.contextmanager
def partition_hook(rewrite: Callable[[dict[str, Any]], dict[str, Any]]) -> Iterator[None]:
    """While open, every ``aot_autograd(...)`` backend called compiles with
    ``rewrite(its keyword arguments)`` instead (a copy: the backend object is left as it is).

    For a backend we cannot look into (a function that builds ``aot_autograd(...)`` inside, as
    ``aot_eager_decomp_partition`` and Inductor's ``compile_fx`` do): relies on every such
    compile going through ``torch._dynamo.backends.common.AotAutograd.__call__``, which is
    swapped for the block (Dynamo compiles one frame at a time, under its compile lock)."""
    cls = private("torch._dynamo.backends.common", "AotAutograd")
    original = cls.__call__

    def call(self: Any, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        if getattr(self, _HOOKED, False):  # (AotAutograd calls itself again for nested inputs)
            return original(self, gm, example_inputs, **kwargs)
        hooked = cls(**rewrite(dict(self.kwargs)))
        setattr(hooked, _HOOKED, True)
        return original(hooked, gm, example_inputs, **kwargs)

    cls.__call__ = call
    try:
        yield
    finally:
        cls.__call__ = original


def default_partition(joint: torch.fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """AOTAutograd's partitioner when a backend names none (``aot_autograd(...)`` without
    ``partition_fn``): ``torch._functorch.partitioners.default_partition``."""
    return private("torch._functorch.partitioners", "default_partition")(joint, joint_inputs, **kwargs)


def is_min_cut_partition(fn: Any) -> bool:
    """``fn`` is the min-cut partitioner (or a ``functools.partial`` of it)."""
    target = private("torch._functorch.partitioners", "min_cut_rematerialization_partition")
    while hasattr(fn, "func") and hasattr(fn, "keywords"):
        fn = fn.func
    return fn is target


# Note [a budget through PyTorch's region annotation]: since 2.13 the min-cut partitioner reads
# a joint graph's activation memory budget, in increasing precedence, from
# ``functorch.config.activation_memory_budget``, the legacy ``node.meta["memory_budget"]`` (first
# node wins) and ``torch.autograd.graph.region_activation_memory_budget``'s annotation
# (``node.meta["custom"][torch.fx.traceback.MEMORY_BUDGET_ANNOTATION_KEY]``), which must cover
# every forward op of the graph and of its HOP bodies and agree everywhere
# (``min_cut_rematerialization_partition``). A scope's ``budget=`` is written as that
# annotation on every op of the graph; the legacy field only where a release lacks it.
_BUDGET_SET = "sac_budget_annotated"  # node.meta: the annotation is ours (to undo it)


def _annotation_key() -> str | None:
    key = getattr(private("torch.fx", "traceback"), "MEMORY_BUDGET_ANNOTATION_KEY", None)
    return None if key is None else str(key)


def budget_annotation(node: torch.fx.Node) -> float | None:
    """The ``region_activation_memory_budget`` a node was traced under, if any."""
    key = _annotation_key()
    custom = node.meta.get("custom")
    if key is None or not isinstance(custom, dict):
        return None
    value = custom.get(key)
    return None if value is None else float(value)


def _annotated_graphs(graph: torch.fx.Graph) -> Iterator[torch.fx.Graph]:
    """A joint graph and its HOP bodies (the submodules of its owning module)."""
    yield graph
    owner = graph.owning_module
    if owner is not None:
        for _, sub in owner.named_modules():
            if isinstance(sub, torch.fx.GraphModule) and sub.graph is not graph:
                yield sub.graph


def set_budget_annotation(graph: torch.fx.Graph, budget: float) -> None:
    """Hand ``budget`` to the partitioner's knapsack for the joint ``graph`` (Note [a budget
    through PyTorch's region annotation])."""
    key = _annotation_key()
    if key is None:  # a release without the annotation: the legacy field
        first = next((n for n in graph.nodes if n.op == "call_function"), None)
        if first is not None:
            first.meta["memory_budget"] = float(budget)
            first.meta[_BUDGET_SET] = True
        return
    for g in _annotated_graphs(graph):
        for n in g.nodes:
            if n.op != "call_function" or key in (n.meta.get("custom") or {}):
                continue
            n.meta["custom"] = {**(n.meta.get("custom") or {}), key: float(budget)}
            n.meta[_BUDGET_SET] = True


def rewrite_budget_annotation(graph: torch.fx.Graph, old: float, new: float) -> bool:
    """Every ``region_activation_memory_budget(old)`` annotation of the joint ``graph`` (and its
    HOP bodies) made ``new``; whether there was one."""
    key = _annotation_key()
    found = False
    for g in _annotated_graphs(graph):
        for n in g.nodes:
            custom = n.meta.get("custom")
            if key is not None and isinstance(custom, dict) and custom.get(key) == old:
                n.meta["custom"] = {**custom, key: new}
                found = True
    return found


def drop_budget_annotation(graph: torch.fx.Graph) -> None:
    """Undo :func:`set_budget_annotation` (what the user annotated stays)."""
    key = _annotation_key()
    for g in _annotated_graphs(graph):
        for n in g.nodes:
            if not n.meta.pop(_BUDGET_SET, False):
                continue
            n.meta.pop("memory_budget", None)
            custom = dict(n.meta.get("custom") or {})
            custom.pop(key, None)
            if custom:
                n.meta["custom"] = custom
            else:
                n.meta.pop("custom", None)


def make_boxed_func(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` taking its inputs as one list (what AOTAutograd calls a compiled graph with)."""
    boxed: Callable[..., Any] = private("functorch.compile", "make_boxed_func")(fn)
    return boxed


def min_cut_rematerialization_partition(
    joint: torch.fx.GraphModule,
    joint_inputs: Sequence[Any],
    *,
    fallback: Any = None,
    partition: Callable[..., Any] | None = None,
    **kwargs: Any,
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """The min-cut partitioner (``torch/_functorch/partitioners.py``): reads ``node.meta``
    ``"recompute"`` (a ``CheckpointPolicy``) and ``"ac_graph_id"`` on forward nodes.

    Note [budget short-circuit]: with ``node.meta["memory_budget"]`` below 1, when every node
    the min-cut bans from recompute is an input or tagged ``MUST_SAVE`` (nothing is left for
    the knapsack to trade), ``choose_saved_values_set`` returns ``inputs + must_save_nodes``
    itself, and a ``MUST_SAVE`` multi-output op (the CPU SDPA kernel) is then saved as a
    tuple: the forward fails with "expected all tensors_saved_with_vc_check to be Tensors"
    (pytorch/pytorch#188014). Keeping every region of an attention layer with ``budget=``
    hits it under ``aot_eager``. When the partition saves a tuple, ``fallback()`` (the joint
    graph tagged without the budget: the knapsack had no choice to make) is partitioned
    instead. ``partition``: a user's ``functools.partial`` of the partitioner, else PyTorch's.
    """
    if partition is None:
        partition = private("torch._functorch.partitioners", "min_cut_rematerialization_partition")
    fw, bw = partition(joint, joint_inputs, **kwargs)
    if fallback is None or not _saves_a_tuple(fw):
        return fw, bw
    fw, bw = partition(fallback(), joint_inputs, **kwargs)
    return fw, bw


def _saves_a_tuple(fw: torch.fx.GraphModule) -> bool:
    out = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    values = out.args[0] if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    return any(isinstance(v, torch.fx.Node) and isinstance(v.meta.get("val"), (tuple, list)) for v in values)


# Note [offload through PyTorch's pass]: AOTAutograd's partitioners end with an activation
# offloading pass (torch/_functorch/_activation_offloading), run when
# ``torch._functorch.config.enable_activation_offloading`` is set: a forward node whose
# ``meta["should_offload"]`` is set and that the forward saves is copied to the CPU after its
# last forward use (``prims.device_put``, named ``cpu_offload_<node>``) and brought back
# before its first backward use. It leaves alone what it cannot move safely: views,
# ``getitem``s (a multi-output op's pieces: the attention kernels' outputs), non-contiguous
# values, model outputs and static inputs; those stay on the device. With
# ``activation_offload_separate_stream`` (set on CUDA) the copies run on a side stream, the
# forward's waits sunk and the backward's reloads prefetched.
SHOULD_OFFLOAD = "should_offload"
OFFLOADED_PREFIX = "cpu_offload_"


def offloading(example_inputs: Any, on: bool = True) -> Any:
    """The functorch config, scoped to one compile, under which the partitioner offloads the
    forward nodes marked ``SHOULD_OFFLOAD`` (Note [offload through PyTorch's pass]); with CUDA
    inputs with the side stream, the sunk waits and the prefetch."""
    if not on:
        return contextlib.nullcontext()
    config = private("torch._functorch", "config")
    if any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs):
        return config.patch(
            enable_activation_offloading=True,
            activation_offload_separate_stream=True,
            activation_offload_sink_wait=True,
            activation_reload_prefetch=True,
        )
    return config.patch(enable_activation_offloading=True)


def copy_joint(joint: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of a joint graph module that a pass and the partitioner may mutate: new nodes,
    each ``node.meta`` copied shallowly (its fake tensors shared), the same submodules."""
    with warnings.catch_warnings():
        # deep-copying the graph's pytree codegen trips pytree's LeafSpec deprecation warning
        warnings.simplefilter("ignore", FutureWarning)
        graph = copy.deepcopy(joint.graph)
    # a lazy graph module generates its Python code only when run: the planner partitions
    # dozens of copies and runs one (torch/fx/_lazy_graph_module.py)
    module: torch.fx.GraphModule = private("torch.fx._lazy_graph_module", "_LazyGraphModule")(joint, graph)
    return module


def forward_saved_outputs(gm: torch.fx.GraphModule) -> list[str] | None:
    """Names of the values a partitioned forward graph saves for the backward.

    AOTAutograd's forward returns (mutated inputs, user outputs, intermediate
    bases, rng offsets, *saved values*); ``fw_metadata.num_forward`` counts the
    part before the saved values (torch/_functorch/_aot_autograd/schemas.py).
    Read from the ``TracingContext`` while the forward compiler runs. A value offloaded to
    the host is named as the forward node it copies (Note [offload through PyTorch's pass]).
    """
    ctx = private("torch._guards", "TracingContext").try_get()
    meta = getattr(ctx, "fw_metadata", None)
    num_forward = getattr(meta, "num_forward", None)
    if num_forward is None:
        return None
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = out.args[0] if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    return [offloaded_source(v.name) for v in values[num_forward:] if isinstance(v, torch.fx.Node)]


def offloaded_source(name: str) -> str:
    """The forward node a saved value's ``name`` copies to the host, else ``name`` itself."""
    return name[len(OFFLOADED_PREFIX) :] if name.startswith(OFFLOADED_PREFIX) else name


# --- Naming conventions of AOTAutograd's graphs ----------------------------------------
# The joint graph's inputs are primals_1, primals_2, ... (the Dynamo graph's inputs, in
# order) and tangents_1, ... (the backward's incoming gradients); a partitioned
# backward's inputs are the saved values plus the tangents, and a saved RNG state of a
# recomputed random op is named rng_state_output*.


def partitioner_tag(node: Any) -> str | None:
    """AOTAutograd's placement tag on a joint-graph node (``node.meta["partitioner_tag"]``):
    ``"is_forward"`` for nodes traced by the forward, ``"must_be_in_forward"`` /
    ``"must_be_in_backward"`` for nodes pinned to one side."""
    tag = node.meta.get("partitioner_tag")
    return None if tag is None else str(tag)


def is_with_effects(node: Any) -> bool:
    """A ``with_effects`` call: an effectful op (``torch.library._register_effectful_op``:
    ``aten._print``, torchbind calls, ...) threaded with an effect token. The partitioner
    saves its outputs (``force_save_effectful_ops``, ``torch/_functorch/partitioners.py``)
    unless it is tagged ``MUST_RECOMPUTE``; since 2.15 that tag raises, and before it the op
    ran again in the backward and the token-free saved list crashed the forward."""
    return node.op == "call_function" and node.target is torch.ops.higher_order.with_effects


def is_tangent(node_or_name: Any) -> bool:
    """A joint or backward graph input carrying an incoming gradient."""
    name = node_or_name if isinstance(node_or_name, str) else str(node_or_name.target)
    return name.startswith("tangents")


def gradient_nodes(nodes: Iterable[torch.fx.Node]) -> set[torch.fx.Node]:
    """The nodes of a joint or backward graph (``nodes`` in graph order) computed from an
    incoming gradient: its tangent inputs and every op reading one of them, transitively."""
    found: set[torch.fx.Node] = set()
    for n in nodes:
        if (n.op == "placeholder" and is_tangent(n)) or (
            n.op == "call_function" and any(a in found for a in n.all_input_nodes)
        ):
            found.add(n)
    return found


def primal_name(index: int) -> str:
    """The name of the Dynamo graph input ``index`` in a joint graph (``2`` -> ``primals_3``):
    a partitioned backward returns their gradients in this order."""
    return f"primals_{index + 1}"


def primal_index(name: str) -> int | None:
    """``primals_3`` -> 2 (the Dynamo graph input it is); None for other names."""
    if not name.startswith("primals_"):
        return None
    try:
        return int(name.removeprefix("primals_")) - 1
    except ValueError:
        return None


def is_rng_state_output(name: str) -> bool:
    """A saved RNG state that the partitioner added for a recomputed random op."""
    return name.startswith("rng_state_output")


@contextlib.contextmanager
def meta_rng_states() -> Iterator[None]:
    """While open, the partitioner's RNG wrappers (``run_and_save_rng_state`` for a recomputed
    random op in the forward, ``run_with_rng_state`` replaying it in the backward) run on meta
    tensors as on CPU ones: they pick their kernel by the device of the op's tensors
    (``torch._prims.rng_prims.get_device``), and have none for ``meta`` ("Backend not supported
    for meta": a compiled layer with dropout on the meta device). The state they save is this
    process's CPU generator's (5,056 B: a CUDA generator's is 16 B); the random op itself runs
    on meta, unseeded, which on the meta device has no values to differ."""
    prims = private("torch._prims", "rng_prims")
    original = prims.get_device

    def get_device(args: Any, kwargs: Any) -> Any:
        found = original(args, kwargs)
        return "cpu" if found == "meta" else found

    prims.get_device = get_device
    try:
        yield
    finally:
        prims.get_device = original


def is_buffer_input(placeholder_name: str) -> bool:
    """A Dynamo graph input that is a module buffer (Dynamo names it ``..._buffers_...``)."""
    return "_buffers_" in placeholder_name


_AOT_RUNTIME = os.path.join("_functorch", "_aot_autograd") + os.sep


def running_compiled_code(max_depth: int = 64) -> bool:
    """Whether an AOTAutograd-compiled graph (aot_eager or Inductor) is running on this thread.

    Relies on compiled graphs running under AOTAutograd's runtime wrappers
    (``torch/_functorch/_aot_autograd/runtime_wrappers.py``: ``CompiledFunction.forward``
    and friends) being on the Python stack below the ops they dispatch. Only called
    for costly ops run with grad disabled inside a kept region, so the walk is rare.
    """
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return False
        if _AOT_RUNTIME in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def compute_intensive_ops() -> frozenset[Any]:
    """The partitioner's compute-intensive ops (``torch._functorch.partitioners.get_default_op_list``:
    mm, addmm, bmm, convolutions, the flash / efficient SDPA kernels, ``_scaled_mm``), as
    overloads: the ops torchtitan's per-op selective AC saves first."""
    ops = private("torch._functorch.partitioners", "get_default_op_list")().compute_intensive_ops
    return frozenset(getattr(op, "default", op) for op in ops)
