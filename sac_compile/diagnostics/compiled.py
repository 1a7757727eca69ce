"""Diagnoses of compiled graphs: computed from the tagging pass's records when a sac
backend compiles a graph, reported when the graph runs (once per root model)."""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set

import torch.nn as nn

from .._compat.frames import innermost_module
from ..marker_walk import ENTER_WITHOUT_EXIT
from ..records import GraphRecord, describe_modules
from . import messages
from .core import PROCESS, Diagnosis, describe_module, note_regions, owner
from .unused_keep import RepeatJudge

__all__ = ["GraphReporter", "graph_diagnoses", "with_reporter"]


def graph_diagnoses(
    graph_records: list[GraphRecord],
    *,
    saved_names: list[str] | None,
    with_fallbacks: list[tuple[str, str, str]],
    layer_paths: list[str],
    module: str,
    swallowed: Sequence[str] = (),
    backend_name: str = "",
    grad_enabled: bool = True,
) -> list[Diagnosis]:
    """What one compiled graph's tagging records say is wrong (kinds 2, 4 and 5)."""
    found: list[Diagnosis] = []

    def add(d: Diagnosis) -> None:
        if d not in found:
            found.append(d)

    for rec in graph_records:

        def where(name: str, rec=rec) -> str:
            return describe_modules(rec.region_modules[name]) if name in rec.region_modules else module

        for hop, name in rec.hop_markers:
            if hop != "invoke_subgraph":
                add(messages.marker_in_hop_body(hop, name, where(name)))
        # a region split across graphs is judged by its graph-break/unbalanced report instead
        split = set(rec.starts_inside) | {name for name, _ in rec.unbalanced}
        if rec.is_training:
            for name, stats in sorted(rec.regions.items()):
                if not stats.kept or name in split or any(name == n for _, n in rec.hop_markers):
                    continue
                if stats.saved_nodes == 0:
                    add(messages.kept_nothing(name, where(name), messages.NO_COSTLY_OP))
                elif saved_names is not None and not any(
                    name in rec.node_regions.get(v, ()) for v in saved_names
                ):
                    add(messages.kept_nothing(name, where(name), messages.BACKWARD_READS_NONE))
        # A graph without a backward compiled while gradients were on (a graph break
        # left it only a marker, or nothing in it needs grad) still splits the region;
        # under no_grad / inference mode markers mean nothing and are not reported.
        unbalanced = rec.unbalanced if (rec.is_training or grad_enabled) else []
        split_decorated = sorted(
            set(rec.starts_inside)
            | {n for n, how in unbalanced if how == ENTER_WITHOUT_EXIT and n in rec.decorated_enters}
        )
        # a decorated or declared region split by a graph break: one graph-break report, not unbalanced
        unbalanced = [(n, how) for n, how in unbalanced if n not in split_decorated]
        for name, how in sorted(set(unbalanced)):
            add(messages.unbalanced(name, where(name), how, within="graph"))
        for name in split_decorated:
            add(messages.graph_break(name, where(name)))
        if rec.whole_graph_scope and len(layer_paths) >= 2:
            add(messages.no_scope(module, layer_paths))
    for site in sorted(set(swallowed)):
        add(messages.compile_swallowed(site, backend_name))
    for _kind, name, site in sorted(set(with_fallbacks)):
        add(messages.eager_fallback(name, module, site))
    return found


class GraphReporter:
    """Reports a compiled graph's diagnoses when the graph runs, once per root module,
    and records the graph's regions for the model it runs in.

    Called at the start of every call of a compiled graph; once the module it runs in
    has been judged (Note [judged on a repeat]) it costs one WeakSet lookup.
    """

    def __init__(
        self,
        diagnoses: list[Diagnosis],
        keep_names: set[str],
        where: str,
        regions: Set[str] = frozenset(),
        context: tuple[str, ...] = (),
        read_context: Callable[[], tuple[str, ...]] | None = None,
    ) -> None:
        self.diagnoses = tuple(diagnoses)
        self.regions = tuple(sorted(regions))  # what the graph records when it runs
        self.where = where
        self.judge = RepeatJudge(keep_names)
        # the regions open at the graph's start when it was compiled (from the stack), and
        # how to read them again while it runs (markers.context.running_regions)
        self.context = context
        self.read_context = read_context

    @property
    def keep_names(self) -> tuple[str, ...]:
        return self.judge.keep_names

    def needed(self) -> bool:
        return bool(self.diagnoses or self.keep_names or self.regions or self.context)

    def on_call(self) -> None:
        inner = innermost_module() or PROCESS
        if self.judge.done(inner):
            return
        root = owner()
        # regions are recorded per root model: a graph records them for each model it runs in
        note_regions(self.regions, root, inner if isinstance(inner, nn.Module) else None)
        self.judge.on_call(inner, root, self.where, lambda: (*self.diagnoses, *self._reused(inner)))

    def _reused(self, inner: object) -> list[Diagnosis]:
        """``graph-reused`` when the regions open above the graph now differ from those it
        was compiled in (checked on the first call under each module)."""
        now = self.context if self.read_context is None else self.read_context()
        if now == self.context:
            return []
        where = describe_module(inner) if isinstance(inner, nn.Module) else self.where
        return [messages.graph_reused(where, self.context, now)]


def with_reporter(compiled: Callable, reporter: GraphReporter) -> Callable:
    """Wrap a compiled graph so that it reports when it runs (only if there is anything)."""
    if not reporter.needed():
        return compiled

    def run(*args, **kwargs):
        reporter.on_call()
        return compiled(*args, **kwargs)

    if getattr(compiled, "_boxed_call", False):
        run._boxed_call = True  # type: ignore[attr-defined]
    run.sac_reporter = reporter  # type: ignore[attr-defined]
    return run
