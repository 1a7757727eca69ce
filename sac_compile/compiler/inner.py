"""The backend a sac backend compiles with (``make_sac_backend(inner=...)``), resolved, and
where the tagging pass runs in each kind:

* ``"inductor"`` (or ``compile_fx`` / a ``functools.partial`` of it, with its own
  ``inner_compile``, ``config_patches``, ...): Inductor with ``joint_custom_pre_pass`` set
  through ``compile_fx(config_patches=...)``, which scopes the config to this compile and
  re-applies it for the lazily compiled backward (nothing is set globally).
* ``"aot_eager"``: AOTAutograd with no codegen; the pass runs in the backend's partition
  function right before ``min_cut_rematerialization_partition``. Inductor decomposes before
  partitioning, so node-level partitions differ between the two, while the regions kept
  are the same.
* an ``aot_autograd(...)`` object (its own compilers, ``partition_fn``, decompositions):
  the same object's arguments with the pass run right before its ``partition_fn``.
* any other registered name or callable: called as ``torch.compile`` calls it, with the pass
  before the partitioner of every ``aot_autograd(...)`` it builds inside
  (``_compat.aot.partition_hook``) and as Inductor's ``joint_custom_pre_pass``; one whose
  compile never runs the pass is refused for a graph it should checkpoint.

With no pass (a graph the backend does not own, or the baseline) each kind compiles as it
does without sac_compile; graph snapshots for ``capture_partition`` are taken on the way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

import torch

from .._compat import aot, dynamo, inductor
from .._compat.ops import is_view_op, op_name
from .session import CompileUnit

if TYPE_CHECKING:
    from torch.fx import GraphModule

    from ..passes.tag_regions import TagRegionsPass

__all__ = ["Inner", "inner_key", "resolve_inner", "snapshot"]

_NAMED = ("inductor", "aot_eager")  # compiled here without a backend object
_NO_JOINT_GRAPH = ("eager", "eager_noexcept", "eager_debug")  # PyTorch's backends without AOTAutograd

#: ``partition(joint, joint_inputs, pass_=..., partition_fn=..., **kwargs)``: the backend's
#: tag-then-partition (``SacBackend.partition``)
Partition = Callable[..., Any]


@dataclass(frozen=True)
class Inner:
    """The inner backend, resolved: ``kind`` is ``"inductor"`` / ``"aot_eager"`` (the names),
    ``"compile_fx"`` (a partial of it), ``"aot_autograd"`` (an ``aot_autograd(...)`` object) or
    ``"callable"`` (anything else); ``label`` names it in messages."""

    kind: str
    backend: Any = None
    label: str = ""

    @property
    def is_inductor(self) -> bool:
        """Whether ``mode`` / ``options`` / ``inductor_config`` reach an Inductor compile."""
        return self.kind in ("inductor", "compile_fx")

    def compile(
        self,
        gm: GraphModule,
        example_inputs: list[Any],
        pass_: TagRegionsPass | None,
        unit: CompileUnit,
        *,
        capturing: bool,
        patches: dict[str, Any],
        compile_kwargs: dict[str, Any],
        partition: Partition,
    ) -> Callable[..., Any]:
        """Compile ``gm`` with the pass (none: as this backend compiles it on its own)."""
        if self.is_inductor:
            return _compile_inductor(self, gm, example_inputs, pass_, unit, capturing, patches)
        if self.kind == "aot_eager":
            return _compile_aot_eager(gm, example_inputs, pass_, unit, partition)
        if self.kind == "aot_autograd":
            return _compile_aot_autograd(self, gm, example_inputs, pass_, unit, capturing, partition)
        return _compile_callable(self, gm, example_inputs, pass_, unit, compile_kwargs, partition)


def resolve_inner(inner: Any) -> Inner:
    """What ``make_sac_backend(inner=...)`` was given, resolved; clear errors for the rest (a
    sac backend as ``inner`` is refused by the caller)."""
    if isinstance(inner, str):
        if inner in _NAMED:
            return Inner(inner, None, inner)
        if inner in _NO_JOINT_GRAPH:
            raise ValueError(
                f"inner={inner!r} runs the graph without AOTAutograd: there is no joint graph for the "
                "tagging pass, so nothing would be kept; use 'inductor', 'aot_eager' or an aot_autograd(...) "
                "backend of your own"
            )
        if inner == "sac_compile":
            raise ValueError(
                "inner='sac_compile' is this backend itself; pass the backend it should compile with "
                "('inductor', 'aot_eager', an aot_autograd(...) object, ...)"
            )
        return replace(resolve_inner(dynamo.lookup_backend(inner)), label=inner)
    if not callable(inner):
        raise TypeError(
            f"inner must be a backend name ('inductor', 'aot_eager', a registered name) or a backend "
            f"callable (an aot_autograd(...) object, a compile_fx partial, a function), got {inner!r}"
        )
    label = getattr(inner, "__name__", None) or type(inner).__name__
    if aot.aot_autograd_kwargs(inner) is not None:
        return Inner("aot_autograd", inner, f"aot_autograd({label})")
    if inductor.is_compile_fx(inner):
        return Inner("compile_fx", inner, "compile_fx")
    return Inner("callable", inner, label)


def inner_key(inner: Any) -> Any:
    """The memo key of an inner backend: its name, or the object's identity (the backend holds
    the object, so the id is not reused while the memo lives)."""
    return inner if isinstance(inner, str) else ("<callable>", id(inner))


def _compile_inductor(
    inner: Inner,
    gm: GraphModule,
    example_inputs: list[Any],
    pass_: TagRegionsPass | None,
    unit: CompileUnit,
    capturing: bool,
    patches: dict[str, Any],
) -> Callable[..., Any]:
    compile_fx, keywords = inductor.compile_fx_parts(inner.backend)
    user_patches = dict(keywords.pop("config_patches", None) or {})
    patches = {**user_patches, **patches}
    if pass_ is not None:
        if "joint_custom_pre_pass" in user_patches:
            raise ValueError(
                f"inner={inner.label!r} sets joint_custom_pre_pass in its config_patches: the sac "
                "backend installs its tagging pass there; run your pass in joint_custom_post_pass"
            )
        patches["joint_custom_pre_pass"] = pass_
        # after any post pass of the user's (scoped or global): seeds drawn once
        user_post = patches.get("joint_custom_post_pass", inductor.inductor_config().joint_custom_post_pass)
        patches["joint_custom_post_pass"] = _post_passes(user_post)
    if pass_ is not None or capturing:  # (a graph we do not touch compiles as Inductor compiles it)
        inner_compile = keywords.pop("inner_compile", inductor.compile_fx_inner)
        keywords["inner_compile"] = functools.partial(
            _capturing_inner_compile, unit, capturing, inner_compile
        )
    if patches:
        keywords["config_patches"] = patches
    return cast("Callable[..., Any]", compile_fx(gm, example_inputs, **keywords))


def _compile_aot_eager(
    gm: GraphModule,
    example_inputs: list[Any],
    pass_: TagRegionsPass | None,
    unit: CompileUnit,
    partition: Partition,
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
        partition_fn=functools.partial(partition, pass_=pass_),
        keep_inference_input_mutations=True,
    )(gm, example_inputs)


def _compile_aot_autograd(
    inner: Inner,
    gm: GraphModule,
    example_inputs: list[Any],
    pass_: TagRegionsPass | None,
    unit: CompileUnit,
    capturing: bool,
    partition: Partition,
) -> Callable[..., Any]:
    """The user's ``aot_autograd(...)`` with the pass run before its ``partition_fn`` (and on
    inference graphs before its inference compiler, which erases the markers); its compilers
    see the graphs they would see, partitioned within our tags."""
    kwargs = cast("dict[str, Any]", aot.aot_autograd_kwargs(inner.backend))
    if pass_ is None and not capturing:
        return cast("Callable[..., Any]", inner.backend(gm, example_inputs))
    fw = kwargs["fw_compiler"]
    bw = kwargs.get("bw_compiler") or fw
    inference = kwargs.get("inference_compiler") or fw

    def forward(g: GraphModule, inputs: Any) -> Any:
        unit.saved_names = aot.forward_saved_outputs(g)
        if capturing:
            unit.graphs["forward"] = snapshot(g)
        return fw(g, inputs)

    def backward(g: GraphModule, inputs: Any) -> Any:
        if capturing:
            unit.graphs["backward"] = snapshot(g)
        return bw(g, inputs)

    def infer(g: GraphModule, inputs: Any) -> Any:
        if pass_ is not None:
            pass_(g.graph)
        if capturing:
            unit.graphs["inference"] = snapshot(g)
        return inference(g, inputs)

    kwargs.update(
        fw_compiler=forward,
        bw_compiler=backward,
        inference_compiler=infer,
        partition_fn=_partition_with(partition, pass_, kwargs),
    )
    return aot.aot_autograd(**kwargs)(gm, example_inputs)


def _compile_callable(
    inner: Inner,
    gm: GraphModule,
    example_inputs: list[Any],
    pass_: TagRegionsPass | None,
    unit: CompileUnit,
    compile_kwargs: dict[str, Any],
    partition: Partition,
) -> Callable[..., Any]:
    """A backend we cannot look into, called as ``torch.compile`` calls it, with the pass before
    the partitioner of any ``aot_autograd(...)`` it builds and as Inductor's pre pass (the pass
    runs once per graph). One whose compile never ran the pass is refused."""
    if pass_ is None:
        return cast("Callable[..., Any]", inner.backend(gm, example_inputs, **compile_kwargs))

    def with_pass(kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs["partition_fn"] = _partition_with(partition, pass_, kwargs)
        return kwargs

    user_post = inductor.inductor_config().joint_custom_post_pass
    with (
        inductor.inductor_config().patch(
            joint_custom_pre_pass=pass_, joint_custom_post_pass=_post_passes(user_post)
        ),
        aot.partition_hook(with_pass),
    ):
        compiled = inner.backend(gm, example_inputs, **compile_kwargs)
    if not unit.records:
        raise ValueError(
            f"inner={inner.label!r} compiled a graph of {unit.module} that the sac backend checkpoints "
            "without a joint graph the tagging pass could reach (no aot_autograd(...) and no Inductor "
            "compile inside it), so nothing it asks for would be kept. Pass a backend built on "
            "aot_autograd(...) or Inductor's compile_fx as inner=."
        )
    return cast("Callable[..., Any]", compiled)


def _partition_with(partition: Partition, pass_: TagRegionsPass | None, kwargs: dict[str, Any]) -> Any:
    """The partition function: the tagging pass, then the backend's own (``kwargs``'s
    ``partition_fn``, default AOTAutograd's)."""
    return functools.partial(
        partition, pass_=pass_, partition_fn=kwargs.get("partition_fn") or aot.default_partition
    )


def _post_passes(user_post: Any) -> tuple[Any, ...]:
    """Inductor's joint post passes: the user's, then the seeds' untagging (drawn once)."""
    from ..passes.untag_seeds import UNTAG_SEEDS  # loads Inductor, as the pass does

    return (*inductor.custom_graph_passes(user_post), UNTAG_SEEDS)


def _capturing_inner_compile(
    unit: CompileUnit,
    capturing: bool,
    inner_compile: Callable[..., Any],
    gm: GraphModule,
    example_inputs: list[Any],
    **kwargs: Any,
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
    return inner_compile(gm, example_inputs, **kwargs)


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
