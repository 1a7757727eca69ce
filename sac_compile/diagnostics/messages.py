"""Every diagnosis text, built in one place (compiled and eager rules share them)."""

from __future__ import annotations

from typing import cast

from ..keep import ALL_REGIONS, KeepSet
from ..marker_walk import ENTER_WITHOUT_EXIT
from .core import (
    COLLECTIVE_RECOMPUTED,
    COMPILE_FALLBACK,
    COMPILE_SWALLOWED,
    COMPILED_IN_EAGER,
    EAGER_FALLBACK,
    GRAPH_BREAK,
    GRAPH_REUSED,
    KEEP_UNUSED,
    KEPT_NOTHING,
    LEGACY_KEEP_IGNORED,
    NO_PASS,
    NO_SCOPE,
    UNBALANCED,
    UNMARKED,
    Diagnosis,
)

__all__ = [
    "collective_recomputed",
    "compile_fallback",
    "compile_swallowed",
    "compiled_in_eager",
    "eager_fallback",
    "graph_break",
    "graph_reused",
    "keep_unused",
    "kept_nothing",
    "legacy_keep_ignored",
    "marker_in_hop_body",
    "no_pass",
    "no_scope",
    "unbalanced",
    "unmarked",
]

# Why a kept region kept nothing (the first clause of a kept-nothing message).
NO_COSTLY_OP = (
    "it is kept, but the region policy saves none of the ops it ran: no costly op "
    "(matmul, convolution, attention, custom kernel, collective), only cheap ops, views "
    "or waits, which are recomputed from their inputs"
)
BACKWARD_READS_NONE = "it is kept, but the backward reads none of the values computed in it"
EAGER_HOLDS_NOTHING = (
    "it is kept, but after the forward nothing computed in it is held: the region "
    "policy saved none of its ops (no costly op - matmul, convolution, attention, "
    "custom kernel - ran in it; cheap ops, views, collectives and in-place targets "
    "are recomputed), or the backward reads none of its values"
)


def keep_unused(names: list[str], where: str) -> Diagnosis:
    plural = "s" if len(names) > 1 else ""
    return Diagnosis(
        KEEP_UNUSED,
        ",".join(names),
        where,
        f"keep names region{plural} {', '.join(map(repr, names))} but no marker with that name ever "
        "ran, so nothing is kept for it. Check the spelling against the region(...) markers and "
        "declare_regions names, or drop it from keep.",
    )


def kept_nothing(name: str, where: str, why: str) -> Diagnosis:
    """``why``: :data:`NO_COSTLY_OP`, :data:`BACKWARD_READS_NONE` or :data:`EAGER_HOLDS_NOTHING`."""
    return Diagnosis(
        KEPT_NOTHING,
        name,
        where,
        f"{why}, so keeping it saves nothing. Mark the op whose output the backward needs "
        "(e.g. the matmul or attention core), or drop the name from keep.",
    )


def marker_in_hop_body(hop: str, name: str, where: str) -> Diagnosis:
    return Diagnosis(
        KEPT_NOTHING,
        name,
        where,
        f"region markers inside a {hop} body are not honoured (the body is not partitioned "
        "by region); they were removed. Move the region(...) around the call instead.",
    )


def unbalanced(name: str, where: str, how: str, *, within: str) -> Diagnosis:
    """``how``: "enter without exit" | "exit without enter"; ``within``: "graph" (compiled)
    or "call" (the eager engine's checkpointed call)."""
    if within == "graph":
        effect = (
            "the region stays open to the graph's end"
            if how == ENTER_WITHOUT_EXIT
            else "the region was open from the graph's start"
        )
        text = (
            f"{how} within one graph: {effect}. Usually a graph break split the region (see "
            "TORCH_LOGS=graph_breaks) or an exception skipped the exit; use region(...) as a with-block "
            "or decorator."
        )
    else:
        effect = (
            "the region stayed open to the end of the layer"
            if how == ENTER_WITHOUT_EXIT
            else "the exit was ignored"
        )
        text = (
            f"{how} inside the checkpointed call: {effect}. Use region(...) as a with-block or decorator "
            "so that enter and exit pair up."
        )
    return Diagnosis(UNBALANCED, name, where, text)


def graph_break(name: str, where: str) -> Diagnosis:
    return Diagnosis(
        GRAPH_BREAK,
        name,
        where,
        "a graph break inside the region (a decorated function or a declared module) split it "
        "across graphs; each part is still "
        "kept in its own graph, but the boundaries between graphs are saved and the graphs "
        "are partitioned separately. Remove the graph break (TORCH_LOGS=graph_breaks) to get one graph.",
    )


def eager_fallback(name: str, where: str, site: str) -> Diagnosis:
    return Diagnosis(
        EAGER_FALLBACK,
        name,
        where,
        f"a graph break inside `with region({name!r})` at {site} made Dynamo run that whole frame "
        "eagerly: its ops are neither compiled nor checkpointed. Use @region(...) as a decorator on "
        "the code with the graph break (the caller then keeps compiling), or remove the break.",
    )


def no_scope(where: str, layer_paths: list[str]) -> Diagnosis:
    shown = (
        ", ".join(layer_paths)
        if len(layer_paths) <= 3
        else f"{layer_paths[0]}, {layer_paths[1]}, ... {layer_paths[-1]}"
    )
    return Diagnosis(
        NO_SCOPE,
        "-",
        where,
        f"one graph holds {len(layer_paths)} layers ({shown}) and no checkpoint "
        "scope, so the whole graph is one scope: the backward recomputes the entire forward at "
        "once. Wrap each layer with apply_selective_checkpointing (it emits one scope per layer "
        "under torch.compile), or compile each layer on its own.",
    )


def compile_swallowed(where: str, backend_name: str) -> Diagnosis:
    return Diagnosis(
        COMPILE_SWALLOWED,
        "-",
        where,
        "this layer was wrapped with apply_selective_checkpointing(..., compile=True), but an outer "
        f"torch.compile (backend {backend_name}) traced it as part of a larger graph: the layer's own "
        "compile and backend never run. Its keep set still applies as a checkpoint scope if the outer "
        "backend is a sac_compile backend. Drop compile=True, or do not compile the enclosing model.",
    )


def no_pass(region: str, where: str, backend_name: str, note: str = "") -> Diagnosis:
    return Diagnosis(
        NO_PASS,
        region,
        where,
        f"its markers were compiled by torch.compile with backend {backend_name}, which does not run "
        "sac_compile's tagging pass, so the region keeps nothing (a checkpoint in the graph recomputes "
        f"everything; a wrapped layer is not checkpointed at all){note}. Compile with "
        'backend="sac_compile" (sac_compile.sac_backend) or make_sac_backend(keep=...).',
    )


def no_pass_layer(keep: KeepSet, where: str, backend_name: str, note: str = "") -> Diagnosis:
    keep_repr = (
        "ALL_REGIONS"
        if keep is ALL_REGIONS
        else "{" + ", ".join(map(repr, sorted(cast("frozenset[str]", keep)))) + "}"
    )
    return Diagnosis(
        NO_PASS,
        "-",
        where,
        f"a layer wrapped for selective checkpointing (keep={keep_repr}) was compiled by torch.compile "
        f"with backend {backend_name}, which does not run sac_compile's tagging pass: the layer is not "
        "checkpointed at all, every activation it makes is saved (inside a torch.utils.checkpoint, such as "
        "checkpoint_wrapper's, it is recomputed whole: there only a keep set with neither budget nor "
        f"offload is kept, through PyTorch's selective checkpointing){note}. Compile with "
        "backend=sac_compile.sac_backend or make_sac_backend(keep=...).",
    )


def compiled_in_eager(where: str, compiled: list[str]) -> Diagnosis:
    return Diagnosis(
        COMPILED_IN_EAGER,
        "-",
        where,
        f"it is checkpointed eagerly but contains compiled code ({', '.join(compiled)}): the "
        "compiled graph's saved tensors are discarded and it is recomputed whole in the backward. "
        "Pass compile=True to apply_selective_checkpointing instead, or compile the whole model.",
    )


def compiled_function_in_eager(region: str, where: str, function: str, backend: str) -> Diagnosis:
    return Diagnosis(
        COMPILED_IN_EAGER,
        region,
        where,
        f"it is kept, but it runs in the compiled function {function} (backend {backend}) called inside "
        "this layer's eager checkpoint, which discards what the compiled graph saves and runs the whole "
        "call again in the backward, so the region keeps nothing. Compile the layer instead of its "
        "methods: apply_selective_checkpointing(layer, keep=..., compile=True) (SacConfig(compile=...), "
        "sac_compile.hf.config_for(..., compile=...)), or leave the layer's checkpoint to a torch.compile "
        "of the model with backend='sac_compile'.",
    )


def compile_fallback(where: str, compiled_call: bool = True) -> Diagnosis:
    if compiled_call:
        why = "Dynamo did not compile its call (recompile limit reached, the frame was skipped, or compiling is disabled)"
        hint = "See TORCH_LOGS=recompiles,graph_breaks."
    else:
        why = (
            "its compiled call is gone (module.compile()'s result was removed, e.g. by a copy made "
            "from its __dict__; copy.deepcopy, pickle and torch.save keep it)"
        )
        hint = "Wrap the copy again: apply_selective_checkpointing(..., compile=True)."
    return Diagnosis(
        COMPILE_FALLBACK,
        "-",
        where,
        f"it was wrapped with compile=True but runs eagerly: {why}, so the eager engine checkpoints "
        f"it instead (correct, slower). {hint}",
    )


def legacy_keep_ignored(keep_text: str, where: str, attr: str) -> Diagnosis:
    return Diagnosis(
        LEGACY_KEEP_IGNORED,
        keep_text,
        where,
        f"it sets {attr}=True, so it is checkpointed reentrantly and keep="
        f"{keep_text!r} is ignored (every op in it is recomputed)",
    )


def collective_recomputed(name: str, where: str, listed: str) -> Diagnosis:
    return Diagnosis(
        COLLECTIVE_RECOMPUTED,
        name,
        where,
        f"it is kept, but the eager engine recomputes the collectives in it ({listed} per call), "
        "so the backward communicates again: their output buffers may be written outside the "
        "region, so eager mode never serves them from a cache. A compiled layer "
        "(compile=True, or a sac backend) saves kept functional collectives instead.",
    )


def graph_reused(where: str, compiled_in: tuple[str, ...], runs_in: tuple[str, ...]) -> Diagnosis:
    def regions(names: tuple[str, ...]) -> str:
        return "regions " + ", ".join(map(repr, names)) if names else "no region"

    return Diagnosis(
        GRAPH_REUSED,
        ",".join(sorted(set(compiled_in) | set(runs_in))),
        where,
        f"this graph was compiled inside {regions(compiled_in)} but runs inside {regions(runs_in)}: a graph "
        "break made Dynamo compile this code as a frame of its own, and it reuses that compiled code "
        "for every module of the class, whatever regions enclose it, so its ops are kept or recomputed "
        "as in the first. Declare the same regions around every module of this class (or declare "
        "this module itself), remove the graph break (TORCH_LOGS=graph_breaks), or checkpoint the "
        "layer eagerly (compile=False).",
    )


def unmarked(where: str, backend_name: str, inner: str) -> Diagnosis:
    return Diagnosis(
        UNMARKED,
        "-",
        where,
        f"{backend_name} compiled a graph holding no region marker and no wrapped layer: it was "
        f"compiled exactly as {inner} compiles it, with nothing checkpointed (PyTorch's own "
        "activation_memory_budget and checkpoints apply as without sac_compile). Mark regions "
        "(sac_compile.region, declare_regions), wrap layers (apply_selective_checkpointing), or pass "
        "make_sac_backend(..., whole_graph=True) to checkpoint every graph the backend compiles.",
    )
