"""The Dynamo backends: ``sac_backend`` and the memoised ``make_sac_backend``.

A backend compiles each Dynamo graph it owns with the tagging pass installed before
the inner backend's partitioner (:mod:`.inner`: each kind of inner backend and where the
pass runs in it), and hands every other graph to the inner backend untouched.

Note [a backend changes only what it owns]: a graph holding no marker of ours (region or
scope markers, also inside HOP bodies) and not starting inside a wrapped layer or a region
(a graph break) is compiled exactly as the inner backend compiles it: PyTorch's
``activation_memory_budget``, ``region_activation_memory_budget`` and checkpoints keep their
meaning there. Reported once (``unmarked``) unless the compiled callable holds wrapped layers.
``whole_graph=True`` (the seam's ``compile=True`` and adopted forwards, the planner) makes
every graph one checkpoint scope, marked or not.

Dynamo guards on backend identity, so ``make_sac_backend`` returns the same
object for the same configuration: one new backend per layer would exhaust
``torch._dynamo.config.recompile_limit`` (8) and leave later layers uncompiled.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

import torch

from .. import records
from .._compat import aot, dynamo, frames, inductor
from ..actions import Actions
from ..diagnostics import compiled as diagnosed
from ..diagnostics import describe_module, messages, report, side_file, trace_watch
from ..keep import ALL_REGIONS, Keep, Regions
from ..marker_walk import MarkerKind
from ..markers import marker_kind
from ..markers.context import NO_CONTEXT, Enclosing, enclosing_context, running_regions, with_block_fallbacks
from ..policy import SAVE_COSTLY, RegionPolicy
from . import session
from .inner import Inner, inner_key, resolve_inner
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
]


def _holds_ours(gm: torch.fx.GraphModule, context: Enclosing) -> bool:
    """Whether a graph is ours to tag: it holds a marker (region or scope, here or in a HOP
    body) or starts inside a wrapped layer's scope or a region (a graph break split them)."""
    if context.scopes or context.regions:
        return True
    for _, module in gm.named_modules():
        if isinstance(module, torch.fx.GraphModule):
            if any(marker_kind(n) is not None for n in module.graph.nodes):
                return True
    return False


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
        inner: Any,
        inductor_config: tuple[tuple[str, Any], ...],
        *,
        checkpoint: bool = True,
        whole_graph: bool = False,
    ) -> None:
        # checkpoint=False: the same compile without the tagging pass (the
        # "compiled, no checkpoint" baseline of capture_partition and benchmarks).
        self.checkpoint = checkpoint
        self.whole_graph = whole_graph
        self.actions = actions
        self.inner = inner  # as the user gave it (a name or a backend object)
        self._inner = resolve_inner(inner)
        self.inductor_config = inductor_config
        self._options_key = (
            f"inner={self._inner.label}|inductor_config={inductor_config!r}|whole_graph={whole_graph}"
        )
        self._passes: dict[Enclosing, TagRegionsPass] = {}

    def __repr__(self) -> str:
        inner = self.inner if isinstance(self.inner, str) else self._inner.label
        if not self.checkpoint:
            return f"<{inner} without checkpointing>"
        whole = ", whole_graph=True" if self.whole_graph else ""
        return f"make_sac_backend({self.actions.arguments()}, inner={inner!r}{whole})"

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
        ``mode`` / ``options``: its ``inductor_config``, then theirs (they win). With an inner
        backend that is not Inductor there is nothing to configure: a ``ValueError`` (a plain
        callable gets them as ``torch.compile`` gives them, see :meth:`__call__`)."""
        if not mode and not options:
            return dict(self.inductor_config)
        if not self._inner.is_inductor:
            raise ValueError(
                f"torch.compile(mode={mode!r}, options={options!r}) configures Inductor, but {self!r} compiles "
                f"with inner={self._inner.label!r}, where they would do nothing; drop them, or use "
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
        if self._inner.kind == "callable":
            patches: dict[str, Any] = {}  # mode / options go to the callable as torch.compile passes them
        else:
            patches = self.compile_patches(
                compile_kwargs.pop("mode", None), compile_kwargs.pop("options", None)
            )
        unit = new_unit(gm, example_inputs)
        capturing = session.capturing()
        owned = self.checkpoint and (self.whole_graph or _holds_ours(gm, unit.context))
        pass_ = self.tagging_pass(unit.context) if owned else None
        if pass_ is not None:
            session.advise(self, gm, example_inputs, unit)  # the planner's, at log level INFO
        elif self.checkpoint:
            unit.untouched = True
            if not unit.context.wrapped_inside:
                report(messages.unmarked(unit.module, repr(self), self._inner.label))
        trace_watch.claim_trace()  # this graph is ours: its markers are not "no-pass"
        # (offload= from the backend or scope markers: the pass marks, the partitioner moves)
        with session.compiling(unit), aot.offloading(example_inputs, pass_ is not None):
            compiled = self._inner.compile(
                gm,
                example_inputs,
                pass_,
                unit,
                capturing=capturing,
                patches=patches,
                compile_kwargs=compile_kwargs,
                partition=self.partition,
            )
        if pass_ is None:
            return compiled
        return diagnosed.with_reporter(compiled, _graph_reporter(self, unit, gm, example_inputs, pass_))

    def partition(
        self,
        joint: GraphModule,
        joint_inputs: Any,
        pass_: TagRegionsPass | None = None,
        untagged: Callable[[], GraphModule] | None = None,
        partition_fn: Callable[..., Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Tag ``joint`` with ``pass_`` (this backend's tagging pass for the graph's context;
        none for the baseline) and partition it with ``partition_fn`` (default: the min-cut
        partitioner, as ``inner="aot_eager"`` compiles do). ``untagged()``: a fresh copy of the
        joint graph before tagging, should a min-cut partition need redoing (default: ``joint``
        is copied before it is tagged)."""
        if partition_fn is not None and not aot.is_min_cut_partition(partition_fn):
            if pass_ is not None:
                pass_(joint.graph)
            return partition_fn(joint, joint_inputs, **kwargs)
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
        if partition_fn is None:
            kwargs.setdefault("compiler", "inductor")
        return aot.min_cut_rematerialization_partition(
            joint, joint_inputs, fallback=fallback, partition=partition_fn, **kwargs
        )


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


_BACKENDS: dict[tuple[Any, ...], SacBackend] = {}
_BACKENDS_LOCK = threading.Lock()


def make_sac_backend(
    keep: Keep = ALL_REGIONS,
    *,
    policy: RegionPolicy = SAVE_COSTLY,
    budget: float | None = None,
    inner: str | Callable[..., Any] = "inductor",
    inductor_config: Mapping[str, Any] | None = None,
    offload: Regions = (),
    whole_graph: bool = False,
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
        inner: the backend that compiles: ``"inductor"`` (default), ``"aot_eager"`` (no
            codegen), an ``aot_autograd(fw_compiler=..., bw_compiler=..., partition_fn=...)``
            object (the pass runs right before its ``partition_fn``), a ``compile_fx`` partial,
            or another registered name or backend callable (it must compile through Inductor's
            ``compile_fx`` for regions to be kept).
        inductor_config: extra ``torch._inductor.config`` entries, scoped to this
            backend's compiles (only with an Inductor ``inner``).
        offload: region names whose saved values go to host memory in the forward and
            come back for the backward (disjoint from ``keep``).
        whole_graph: every graph compiled is one checkpoint scope, marked or not (full
            recompute outside kept regions). Default: a graph holding no region marker and
            no wrapped layer is compiled exactly as ``inner`` compiles it (reported once).

    The same arguments return the same object, so every layer compiled with it
    shares Dynamo's cache entries instead of recompiling per backend object.
    """
    return backend_for(
        Actions.of(keep, policy, budget, offload), inner, inductor_config, whole_graph=whole_graph
    )


def backend_for(
    actions: Actions,
    inner: Any = "inductor",
    inductor_config: Mapping[str, Any] | None = None,
    *,
    whole_graph: bool = False,
) -> SacBackend:
    """:func:`make_sac_backend` for actions made already (the seam's, the planner's)."""
    resolved = _resolved(inner)
    config_items: tuple[tuple[str, Any], ...] = ()
    if inductor_config:
        if not resolved.is_inductor:
            raise ValueError(
                f"inductor_config={dict(inductor_config)!r} does nothing with inner={resolved.label!r}; "
                "drop it or use inner='inductor'"
            )
        if not isinstance(inductor_config, Mapping):
            raise TypeError(f"inductor_config must be a mapping, got {type(inductor_config).__name__}")
        _check_inductor_keys(inductor_config, "inductor_config")
        config_items = tuple(sorted((str(k), v) for k, v in inductor_config.items()))
    if not isinstance(whole_graph, bool):
        raise TypeError(f"whole_graph must be True or False, got {whole_graph!r}")
    key = (actions.text, inner_key(inner), repr(config_items), whole_graph)
    return _memoised(key, lambda: SacBackend(actions, inner, config_items, whole_graph=whole_graph))


def _resolved(inner: Any) -> Inner:
    if isinstance(inner, SacBackend):
        raise ValueError(
            f"inner={inner!r} is a sac backend already; pass the backend it compiles with "
            f"(make_sac_backend(..., inner={inner.inner!r}))"
        )
    return resolve_inner(inner)


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


def baseline_backend(inner: Any = "inductor") -> SacBackend:
    """The same compile without the tagging pass: the "compiled, no checkpoint" baseline.

    For comparisons (benchmarks, ``capture_partition(..., backend="inductor")``):
    the partitioner saves whatever it likes and markers are dropped unread.
    """
    _resolved(inner)  # (its errors)
    return _memoised(
        ("<baseline>", inner_key(inner), "()"), lambda: SacBackend(Actions(), inner, (), checkpoint=False)
    )


#: Inductor backend keeping every marked region.
sac_backend = make_sac_backend(ALL_REGIONS)
