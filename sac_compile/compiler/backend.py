"""The Dynamo backends: ``sac_backend`` and the memoised ``make_sac_backend``.

A backend compiles each Dynamo graph with the tagging pass installed before the
min-cut partitioner:

* ``inner="inductor"``: Inductor with ``joint_custom_pre_pass`` set through
  ``compile_fx(config_patches=...)``, which scopes the config to this compile and
  re-applies it for the lazily compiled backward (nothing is set globally).
* ``inner="aot_eager"``: AOTAutograd with no codegen; the pass runs in our
  partition function right before ``min_cut_rematerialization_partition``.
  Inductor decomposes before partitioning, so node-level partitions differ
  between the two, while the regions kept are the same.

Dynamo guards on backend identity, so ``make_sac_backend`` returns the same
object for the same configuration: one new backend per layer would exhaust
``torch._dynamo.config.recompile_limit`` (8) and leave later layers uncompiled.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, cast

import torch

from .. import records
from .._compat import aot, dynamo, frames, inductor
from .._compat.ops import is_view_op, op_name
from ..actions import Actions
from ..diagnostics import compiled as diagnosed
from ..diagnostics import describe_module, side_file, trace_watch
from ..keep import ALL_REGIONS, Keep, Regions
from ..marker_walk import MarkerKind
from ..markers import marker_kind
from ..markers.context import NO_CONTEXT, Enclosing, enclosing_context, running_regions, with_block_fallbacks
from ..policy import SAVE_COSTLY, RegionPolicy
from . import session
from .session import CompileUnit

if TYPE_CHECKING:
    from torch.fx import GraphModule

    from ..passes.tag_regions import TagRegionsPass

__all__ = [
    "SacBackend",
    "backend_for",
    "baseline_backend",
    "make_sac_backend",
    "new_unit",
    "sac_backend",
    "snapshot",
]

_INNER = ("inductor", "aot_eager")


def new_unit(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> CompileUnit:
    """The :class:`CompileUnit` of a Dynamo graph a backend is called with."""
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    compiled_self = dynamo.compiled_self()
    return CompileUnit(
        module=_compiled_module_name(compiled_self),
        context=enclosing_context(compiled_self),
        with_fallbacks=with_block_fallbacks(gm),
        layer_paths=_layer_paths(gm),
        swallowed=_swallowed_layers(gm),
        grad_enabled=torch.is_grad_enabled(),
        input_is_param=[
            isinstance(ex, torch.nn.Parameter) or aot.is_buffer_input(name)
            for name, ex in zip(names, example_inputs)
        ],
    )


def _compiled_module_name(obj: object) -> str:
    """The module whose frame Dynamo is compiling (for diagnostics); ``obj``: that frame's
    ``self``, if any."""
    if isinstance(obj, torch.nn.Module):
        return describe_module(dynamo.unwrap_compiled(obj))
    # a resume function, a region's __enter__ run on its own, a plain function:
    # the module whose method is running below it
    module = frames.innermost_module()
    if module is not None:
        return describe_module(module)
    name = dynamo.compiled_code_name()
    return f"{name}()" if name is not None else "<unknown>"


def _swallowed_layers(gm: torch.fx.GraphModule) -> list[str]:
    """Layers wrapped with compile=True traced by this (outer) compile: scope markers with id 1.

    A compile of the layer itself traces them at its root (no module around them).
    """
    found = []
    for node in gm.graph.nodes:
        if marker_kind(node) is MarkerKind.SCOPE_ENTER and node.args[0] == 1:
            stack = dynamo.node_module_stack(node)
            if stack:
                found.append(records.describe_stack_entry(*stack[-1]))
    return found


def _layer_paths(gm: torch.fx.GraphModule) -> list[str]:
    """Sibling layers a graph spans: module paths ``...<int>`` sharing a parent and class."""
    groups: dict[tuple[str, str], set[str]] = {}
    for node in gm.graph.nodes:
        for path, cls in dynamo.node_module_stack(node):
            clean = records.clean_module_path(path)
            parent, _, last = clean.rpartition(".")
            if last.isdigit():
                groups.setdefault((parent, getattr(cls, "__name__", str(cls))), set()).add(clean)
    best: list[str] = []
    for paths in groups.values():
        if len(paths) > len(best):
            best = sorted(paths, key=lambda p: int(p.rpartition(".")[2]))
    return best


class SacBackend:
    """A ``torch.compile`` backend that keeps the marked regions in ``keep``.

    Build it with :func:`make_sac_backend` (memoised), not directly.
    """

    def __init__(
        self,
        actions: Actions,
        inner: str,
        inductor_config: tuple[tuple[str, Any], ...],
        *,
        checkpoint: bool = True,
    ) -> None:
        # checkpoint=False: the same compile without the tagging pass (the
        # "compiled, no checkpoint" baseline of capture_partition and benchmarks).
        self.checkpoint = checkpoint
        self.actions = actions
        self.inner = inner
        self.inductor_config = inductor_config
        self._options_key = f"inner={inner}|inductor_config={inductor_config!r}"
        self._passes: dict[Enclosing, TagRegionsPass] = {}

    def __repr__(self) -> str:
        if not self.checkpoint:
            return f"<{self.inner} without checkpointing>"
        return f"make_sac_backend({self.actions.arguments()}, inner={self.inner!r})"

    def tagging_pass(self, context: Enclosing = NO_CONTEXT) -> TagRegionsPass:
        """The (cached) :class:`~sac_compile.passes.tag_regions.TagRegionsPass` for graphs
        compiled in ``context`` (the scopes and regions they start inside of, from the
        Python stack). Its records go to the compile session."""
        if context not in self._passes:
            self._passes[context] = self.new_pass(context, session.publish)
        return self._passes[context]

    def new_pass(self, context: Enclosing, publish: Callable[[records.GraphRecord], None]) -> TagRegionsPass:
        """A new tagging pass of this configuration whose records go to ``publish`` (the
        planner keeps its trial partitions' records to itself)."""
        # Imported here, not at the top: the pass subclasses Inductor's CustomGraphPass,
        # and importing Inductor is what `import sac_compile` must not do.
        from ..passes.tag_regions import TagRegionsPass

        return TagRegionsPass(self.actions, options_key=self._options_key, context=context, publish=publish)

    def compile_patches(
        self, mode: str | None = None, options: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """The Inductor config this backend compiles with when ``torch.compile`` passes it
        ``mode`` / ``options``: its ``inductor_config``, then theirs (they win). With
        ``inner="aot_eager"`` there is no Inductor to configure: a ``ValueError``."""
        if not mode and not options:
            return dict(self.inductor_config)
        if self.inner != "inductor":
            raise ValueError(
                f"torch.compile(mode={mode!r}, options={options!r}) configures Inductor, but {self!r} compiles "
                f"with inner={self.inner!r}, where they would do nothing; drop them, or use "
                "make_sac_backend(..., inner='inductor') (mode and options are then forwarded to Inductor, "
                "as is make_sac_backend(inductor_config={...}))"
            )
        extra = inductor.compile_mode_config(mode, dict(options) if options else None)
        _check_inductor_keys(extra, "torch.compile options")
        return {**dict(self.inductor_config), **extra}

    def __call__(
        self, gm: torch.fx.GraphModule, example_inputs: list[Any], **compile_kwargs: Any
    ) -> Callable[..., Any]:
        # torch.compile(backend=..., mode=..., options=...) passes these two on to a custom backend
        unknown = set(compile_kwargs) - {"mode", "options"}
        if unknown:
            raise TypeError(f"{self!r} got unexpected keyword arguments {sorted(unknown)}")
        patches = self.compile_patches(compile_kwargs.get("mode"), compile_kwargs.get("options"))
        unit = new_unit(gm, example_inputs)
        capturing = session.capturing()
        pass_ = self.tagging_pass(unit.context) if self.checkpoint else None
        if pass_ is not None:
            session.advise(self, gm, example_inputs, unit)  # the planner's, at log level INFO
        trace_watch.claim_trace()  # this graph is ours: its markers are not "no-pass"
        # (offload= from the backend or scope markers: the pass marks, the partitioner moves)
        with session.compiling(unit), aot.offloading(example_inputs, pass_ is not None):
            if self.inner == "inductor":
                compiled = self._compile_inductor(gm, example_inputs, pass_, unit, capturing, patches)
            else:
                compiled = self._compile_aot_eager(gm, example_inputs, pass_, unit)
        if pass_ is None:
            return compiled
        return diagnosed.with_reporter(compiled, _graph_reporter(self, unit, gm, example_inputs, pass_))

    def _compile_inductor(
        self,
        gm: GraphModule,
        example_inputs: list[Any],
        pass_: TagRegionsPass | None,
        unit: CompileUnit,
        capturing: bool,
        patches: dict[str, Any],
    ) -> Callable[..., Any]:
        if pass_ is not None:
            from ..passes.untag_seeds import UNTAG_SEEDS  # loads Inductor, as the pass does

            patches["joint_custom_pre_pass"] = pass_
            # after any post pass of the user's (scoped or global): seeds drawn once
            user_post = patches.get(
                "joint_custom_post_pass", inductor.inductor_config().joint_custom_post_pass
            )
            patches["joint_custom_post_pass"] = (*inductor.custom_graph_passes(user_post), UNTAG_SEEDS)
        inner = functools.partial(_capturing_inner_compile, unit, capturing)
        return inductor.compile_fx(gm, example_inputs, config_patches=patches, inner_compile=inner)

    def partition(
        self,
        joint: GraphModule,
        joint_inputs: Any,
        pass_: TagRegionsPass | None = None,
        untagged: Callable[[], GraphModule] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Tag ``joint`` with ``pass_`` (this backend's tagging pass for the graph's context;
        none for the baseline) and partition it, as ``inner="aot_eager"`` compiles do.
        ``untagged()``: a fresh copy of the joint graph before tagging, should the partition
        need redoing (default: ``joint`` is copied before it is tagged)."""
        fallback = None
        if pass_ is not None:  # a budget may come from the backend or a seam's scope
            if untagged is None:
                copy = aot.copy_joint(joint)
                untagged = lambda: copy  # noqa: E731

            def fallback() -> GraphModule:  # Note [budget short-circuit] in _compat/aot.py
                graph = untagged()
                pass_.without_budget()(graph.graph)
                return graph

            pass_(joint.graph)
        return aot.min_cut_rematerialization_partition(
            joint, joint_inputs, compiler="inductor", fallback=fallback, **kwargs
        )

    def _compile_aot_eager(
        self, gm: GraphModule, example_inputs: list[Any], pass_: TagRegionsPass | None, unit: CompileUnit
    ) -> Callable[..., Any]:
        def compiler(kind: str) -> Callable[[GraphModule, Any], Callable[..., Any]]:
            def compile_graph(g: GraphModule, _inputs: Any) -> Callable[..., Any]:
                if kind == "inference" and pass_ is not None:
                    # Inductor runs joint passes on inference graphs too; here we do it.
                    pass_(g.graph)
                unit.graphs[kind] = snapshot(g)
                if kind == "forward":
                    unit.saved_names = aot.forward_saved_outputs(g)
                return aot.make_boxed_func(g.forward)

            return compile_graph

        return aot.aot_autograd(
            fw_compiler=compiler("forward"),
            bw_compiler=compiler("backward"),
            inference_compiler=compiler("inference"),
            partition_fn=functools.partial(self.partition, pass_=pass_),
            keep_inference_input_mutations=True,
        )(gm, example_inputs)


def _capturing_inner_compile(
    unit: CompileUnit, capturing: bool, gm: GraphModule, example_inputs: list[Any], **kwargs: Any
) -> Any:
    if kwargs.get("is_backward"):
        kind = "backward"
    elif kwargs.get("is_inference"):
        kind = "inference"
    else:
        kind = "forward"
        unit.saved_names = aot.forward_saved_outputs(gm)
    if capturing:
        unit.graphs[kind] = snapshot(gm)  # before Inductor's post-grad passes mutate gm
    return inductor.compile_fx_inner(gm, example_inputs, **kwargs)


# --- Diagnostics for one compiled graph ---------------------------------------------


def _graph_reporter(
    backend: SacBackend, unit: CompileUnit, gm: GraphModule, example_inputs: list[Any], pass_: TagRegionsPass
) -> diagnosed.GraphReporter:
    """The graph's diagnoses: from the pass's records, or (warm cache hit) from the side file."""
    key = side_file.side_key(gm.code, example_inputs, pass_.uuid())
    if unit.records:
        found = diagnosed.graph_diagnoses(
            unit.records,
            saved_names=unit.saved_names,
            with_fallbacks=unit.with_fallbacks,
            layer_paths=unit.layer_paths,
            module=unit.module,
            swallowed=unit.swallowed,
            grad_enabled=unit.grad_enabled,
            backend_name=repr(backend),
        )
        regions = sorted({name for rec in unit.records for name in rec.regions})
        kept_scopes = [s for rec in unit.records for s in rec.scopes if s.keep is not ALL_REGIONS]
        keep_names = sorted({n for s in kept_scopes for n in cast("frozenset[str]", s.keep)})
        if inductor.compile_caches_enabled():
            side_file.write(key, found, regions, keep_names)
    else:
        side = side_file.read(key)
        if side is None:
            if any(marker_kind(n) is not None for n in gm.graph.nodes):
                logging.getLogger("sac_compile").info(
                    "sac_compile: graph of %s was served from the compile cache and its diagnostics were not "
                    "found (%s); it was not checked. Set torch.compiler.config.force_disable_caches=True once "
                    "to re-check.",
                    unit.module,
                    side_file.side_path(key),
                )
            return diagnosed.GraphReporter([], set(), unit.module, **_context_check(unit))
        found, regions, keep_names = side
    return diagnosed.GraphReporter(found, set(keep_names), unit.module, set(regions), **_context_check(unit))


def _context_check(unit: CompileUnit) -> dict[str, Any]:
    """The regions the graph was compiled in, and how to read them when it runs (a graph
    compiled for one module can run for another: the ``graph-reused`` diagnosis)."""
    return {"context": unit.context.regions, "read_context": running_regions}


def snapshot(gm: torch.fx.GraphModule) -> dict[str, Any]:
    """What the partition report needs of a partitioned graph, taken before codegen."""
    placeholders = []
    calls = []
    inputs = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            placeholders.append((n.name, n.meta.get("val")))
        elif n.op == "call_function":
            base = None
            if is_view_op(n.target) and n.args and isinstance(n.args[0], torch.fx.Node):
                base = n.args[0].name
            calls.append((n.name, op_name(n.target), base))
            inputs[n.name] = tuple(a.name for a in n.all_input_nodes)
    return {"placeholders": placeholders, "calls": calls, "inputs": inputs}


_BACKENDS: dict[tuple[Any, ...], SacBackend] = {}
_BACKENDS_LOCK = threading.Lock()


def make_sac_backend(
    keep: Keep = ALL_REGIONS,
    *,
    policy: RegionPolicy = SAVE_COSTLY,
    budget: float | None = None,
    inner: Literal["inductor", "aot_eager"] = "inductor",
    inductor_config: Mapping[str, Any] | None = None,
    offload: Regions = (),
) -> SacBackend:
    """Return the (memoised) backend keeping the regions named in ``keep``.

    Args:
        keep: region names to save, or ``sac_compile.ALL_REGIONS``; ``()`` keeps
            nothing (full recompute inside every scope).
        policy: the region policy, ``(op, regions, keep) -> CheckpointPolicy``
            (:mod:`sac_compile.policy`); default :data:`SAVE_COSTLY` saves a kept
            region's costly values and recomputes its cheap ops, :data:`SAVE_ALL`
            saves every op of a kept region.
        budget: a fraction in [0, 1] of a scope's activation bytes: the policy's
            saved values first, then PyTorch's knapsack
            (``activation_memory_budget``) chooses the rest of the scope. ``None``
            (or 0): everything the policy does not save is recomputed.
        inner: ``"inductor"`` (default) or ``"aot_eager"`` (no codegen).
        inductor_config: extra ``torch._inductor.config`` entries, scoped to this
            backend's compiles (only with ``inner="inductor"``).
        offload: region names whose saved values go to host memory in the forward and
            come back for the backward (disjoint from ``keep``).

    The same arguments return the same object, so every layer compiled with it
    shares Dynamo's cache entries instead of recompiling per backend object.
    """
    return backend_for(Actions.of(keep, policy, budget, offload), inner, inductor_config)


def backend_for(
    actions: Actions, inner: str = "inductor", inductor_config: Mapping[str, Any] | None = None
) -> SacBackend:
    """:func:`make_sac_backend` for actions made already (the seam's, the planner's)."""
    if inner not in _INNER:
        raise ValueError(f"inner must be one of {_INNER}, got {inner!r}")
    config_items: tuple[tuple[str, Any], ...] = ()
    if inductor_config:
        if inner != "inductor":
            raise ValueError(
                f"inductor_config={dict(inductor_config)!r} does nothing with inner={inner!r}; "
                "drop it or use inner='inductor'"
            )
        if not isinstance(inductor_config, Mapping):
            raise TypeError(f"inductor_config must be a mapping, got {type(inductor_config).__name__}")
        _check_inductor_keys(inductor_config, "inductor_config")
        config_items = tuple(sorted((str(k), v) for k, v in inductor_config.items()))
    key = (actions.text, inner, repr(config_items))
    return _memoised(key, lambda: SacBackend(actions, inner, config_items))


def _check_inductor_keys(config: Mapping[str, Any], what: str) -> None:
    known = inductor.inductor_config()
    for key in config:
        if key == "joint_custom_pre_pass":
            raise ValueError(f"{what} may not set joint_custom_pre_pass: the backend installs its own")
        if not hasattr(known, key):
            raise ValueError(f"{what} key {key!r} is not a torch._inductor.config option")


def _memoised(key: tuple[Any, ...], make: Callable[[], SacBackend]) -> SacBackend:
    with _BACKENDS_LOCK:
        backend = _BACKENDS.get(key)
        if backend is None:
            backend = _BACKENDS[key] = make()
    return backend


def baseline_backend(inner: str = "inductor") -> SacBackend:
    """The same compile without the tagging pass: the "compiled, no checkpoint" baseline.

    For comparisons (benchmarks, ``capture_partition(..., backend="inductor")``):
    the partitioner saves whatever it likes and markers are dropped unread.
    """
    if inner not in _INNER:
        raise ValueError(f"inner must be one of {_INNER}, got {inner!r}")
    return _memoised(("<baseline>", inner, "()"), lambda: SacBackend(Actions(), inner, (), checkpoint=False))


#: Inductor backend keeping every marked region.
sac_backend = make_sac_backend(ALL_REGIONS)
