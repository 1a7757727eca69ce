"""What the tagging pass saw in each graph, kept for reports and diagnostics.

Every run of the tagging pass produces one :class:`GraphRecord`. Records are
published to a small bounded history (:func:`recent_records`) and to every
active :func:`collect_records` block, which is how :func:`sac_compile.inspection.capture_partition`
and the tests read them. On a warm FX-graph / AOTAutograd cache hit the pass
does not run, so no record is produced for that graph.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import threading
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .keep import KeepSet, format_keep

__all__ = ["GraphRecord", "RegionStats", "ScopeInfo", "collect_records", "recent_records"]


@dataclass
class RegionStats:
    """Per region name: how often it was entered and how its forward nodes were tagged."""

    name: str
    entered: int = 0
    kept: bool = False  # (kept on the device or offloaded: its costly values saved)
    offloaded: bool = False  # a scope offloads it (offload=)
    saved_nodes: int = 0  # forward nodes tagged MUST_SAVE while this region was open
    recompute_nodes: int = 0  # forward nodes tagged MUST_RECOMPUTE while it was open


@dataclass
class ScopeInfo:
    """One checkpoint scope: its ``ac_graph_id``, where it came from and its keep set."""

    ac_graph_id: int
    # "scope markers" | "layer split by a graph break" | "torch.utils.checkpoint" | "whole graph"
    source: str
    keep: KeepSet
    policy: str = "save_costly"  # sac_compile.policy.policy_key of the scope's region policy
    budget: float | None = None
    nodes: int = 0
    offload: frozenset[str] = frozenset()


@dataclass
class GraphRecord:
    """The tagging pass's account of one graph."""

    graph_index: int
    is_training: bool
    keep: KeepSet
    scopes: list[ScopeInfo] = field(default_factory=list)
    regions: dict[str, RegionStats] = field(default_factory=dict)
    # (name, "enter without exit" | "exit without enter") in program order
    unbalanced: list[tuple[str, str]] = field(default_factory=list)
    # regions the graph started inside of (decorated or declared; a graph break split them)
    starts_inside: tuple[str, ...] = ()
    # the graph holds no scope and the compiled callable contains wrapped layers: nothing
    # in it is checkpointed (code the user did not wrap, e.g. the loss after a graph break)
    outside_every_scope: bool = False
    # (region name, ac_graph_id, nodes) where markers overrode a checkpoint's policy
    policy_overrides: list[tuple[str, int, int]] = field(default_factory=list)
    # (higher-order op, region name) for markers found in a HOP body and erased there
    hop_markers: list[tuple[str, str]] = field(default_factory=list)
    # higher-order ops saved because their (separately partitioned) body kept a region
    hop_kept: list[str] = field(default_factory=list)
    # region names open over forward ops outside every scope (a no-op)
    outside_scope: list[str] = field(default_factory=list)
    markers_erased: int = 0
    # (marker kind, region, user location) for markers Dynamo compiled as
    # region.__enter__/__exit__'s own frame: the frame around that `with` block
    # fell back to eager (a graph break inside it), so its ops were not compiled.
    eager_fallbacks: list[tuple[str, str, str]] = field(default_factory=list)
    # regions whose enter marker came from the @region decorator's wrapper
    decorated_enters: set[str] = field(default_factory=set)
    # region name -> {(module path, class name)} where it was entered (from nn_module_stack)
    region_modules: dict[str, set[tuple[str, str]]] = field(default_factory=dict)
    # node name -> regions open when it ran, for the partition report
    node_regions: dict[str, tuple[str, ...]] = field(default_factory=dict)
    node_scope: dict[str, int] = field(default_factory=dict)
    # node name -> "MUST_SAVE" / "MUST_RECOMPUTE" / ... as tagged by the pass
    node_policy: dict[str, str] = field(default_factory=dict)
    # forward nodes a scope's offload= sends to host memory (PyTorch's offload pass reads
    # their ``should_offload``; it leaves views, getitems and non-contiguous values alone)
    node_offload: set[str] = field(default_factory=set)
    # the activation_memory_budget handed to the partitioner for this graph (scopes' budget=)
    budget: float | None = None
    # the distinct budgets of the graph's scopes when they disagree (the smallest is used)
    budget_conflict: list[float] = field(default_factory=list)
    # names of the joint graph's forward nodes (tagged or not)
    forward_nodes: set[str] = field(default_factory=set)
    # the pass had tagged this graph already (Inductor re-runs joint passes on HOP bodies):
    # nothing was done, and the record is not published
    repeat: bool = False

    @property
    def whole_graph_scope(self) -> bool:
        return any(s.source == "whole graph" for s in self.scopes)

    def summary(self) -> dict[str, Any]:
        """What the pass decided, per scope and region, as JSON-ready data (the structured
        trace artifact ``sac_compile_regions``)."""
        return {
            "graph_index": self.graph_index,
            "is_training": self.is_training,
            "scopes": [
                {
                    "ac_graph_id": s.ac_graph_id,
                    "source": s.source,
                    "keep": format_keep(s.keep),
                    "policy": s.policy,
                    "budget": s.budget,
                    "nodes": s.nodes,
                }
                for s in self.scopes
            ],
            "regions": {
                name: {
                    "entered": r.entered,
                    "kept": r.kept,
                    "saved_nodes": r.saved_nodes,
                    "recompute_nodes": r.recompute_nodes,
                }
                for name, r in sorted(self.regions.items())
            },
            "tags": dict(Counter(self.node_policy.values())),
            "starts_inside": list(self.starts_inside),
            "unbalanced": [list(u) for u in self.unbalanced],
            "outside_every_scope": self.outside_every_scope,
            "hop_markers": [list(h) for h in self.hop_markers],
            "budget": self.budget,
            "markers_erased": self.markers_erased,
        }


def clean_module_path(path: str) -> str:
    """``L['self'].layers.0.attn`` (Dynamo's source name) -> ``layers.0.attn``."""
    path = re.sub(r"^L\[['\"][^'\"]*['\"]\]\.?", "", str(path))
    path = re.sub(r"(^|\.)_modules\[['\"]([^'\"]*)['\"]\]", r"\1\2", path)
    return path


SEAM_PREFIX = "SelectiveCheckpointed"  # names the seam's generated subclasses (sac_compile.seam)


def user_class_name(cls: object) -> str:
    """The user's class name: the seam's generated ``SelectiveCheckpointedBlock`` reads ``Block``
    (and ``fully_shard``'s ``FSDPSelectiveCheckpointedBlock`` reads ``FSDPBlock``)."""
    return getattr(cls, "__name__", str(cls)).replace(SEAM_PREFIX, "", 1)


def generic_path(path: str) -> str:
    """``layers.3.attn`` -> ``layers.*.attn``: N identical layers read (and deduplicate) as one."""
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


def describe_stack_entry(path: str, cls: object) -> str:
    """An ``nn_module_stack`` entry as ``Block (layers.*)``."""
    return f"{user_class_name(cls)} ({generic_path(clean_module_path(path)) or '<root>'})"


def describe_modules(where: set[tuple[str, str]]) -> str:
    """``{("layers.0.attn", "Attention"), ("layers.1.attn", "Attention")}`` -> ``Attention (layers.*.attn)``."""
    if not where:
        return "<unknown module>"
    by_class: dict[str, list[str]] = {}
    for path, cls in sorted(where):
        by_class.setdefault(cls, []).append(path)
    parts = []
    for cls, paths in by_class.items():
        shown = sorted({_generalise(p, paths) for p in paths})
        parts.append(f"{cls} ({', '.join(p or '<root>' for p in shown)})")
    return "; ".join(parts)


def _generalise(path: str, paths: list[str]) -> str:
    """Replace an integer component by ``*`` where sibling paths differ only there."""
    parts = path.split(".")
    for i, comp in enumerate(parts):
        if comp.isdigit():
            others = [q.split(".") for q in paths]
            if any(
                len(o) == len(parts) and o[i] != comp and o[:i] == parts[:i] and o[i].isdigit()
                for o in others
            ):
                parts[i] = "*"
    return ".".join(parts)


_counter = itertools.count()
_lock = threading.Lock()
_history: deque[GraphRecord] = deque(maxlen=256)
_collectors: list[list[GraphRecord]] = []


def next_graph_index() -> int:
    return next(_counter)


def publish(record: GraphRecord) -> None:
    with _lock:
        _history.append(record)
        for sink in _collectors:
            sink.append(record)


def recent_records() -> list[GraphRecord]:
    """The last (up to 256) records, oldest first."""
    with _lock:
        return list(_history)


@contextlib.contextmanager
def collect_records() -> Iterator[list[GraphRecord]]:
    """Collect the records of every graph tagged inside the block."""
    sink: list[GraphRecord] = []
    with _lock:
        _collectors.append(sink)
    try:
        yield sink
    finally:
        with _lock:
            _collectors.remove(sink)
