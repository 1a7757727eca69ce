"""Partition reports: what a compiled graph saves for backward, and what it recomputes.

Built from a :class:`~sac_compile.compiler.session.CompileUnit` (snapshots of the
partitioned graphs and the tagging pass's records). A *saved* value is a placeholder
of the backward graph other than a tangent; a *recomputed* node is a forward node
that the backward graph computes again.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from .._compat import aot
from .._compat.tensors import storage_id
from ..compiler.session import CompileUnit
from ..keep import ALL_REGIONS, INPUT, NO_REGION, PARAM, RNG, KeepSet
from ..records import GraphRecord

__all__ = ["INPUT", "GraphPartition", "PartitionReport", "SavedValue", "build_partition"]


@dataclass(frozen=True)
class SavedValue:
    """One value the forward saves for the backward."""

    name: str  # the node's name in the joint graph
    op: str  # producing op, or "input" for a graph input
    region: str  # "+"-joined regions open when it ran, "-" for none, "input"/"param" for inputs
    scope: int | None  # ac_graph_id of its checkpoint scope
    shape: tuple[int, ...] | None
    dtype: str
    nbytes: int  # bytes of its storage, counted once per storage (0 for a repeat)
    # saved to host memory (a scope's offload=): ``name`` is the forward node it copies
    offloaded: bool = False

    @property
    def is_input(self) -> bool:
        """A graph input (or a view of one): parameters, buffers and data inputs."""
        return self.region in (INPUT, PARAM)

    @property
    def is_param(self) -> bool:
        return self.region == PARAM


@dataclass
class GraphPartition:
    """The partition of one compiled graph."""

    index: int
    saved: list[SavedValue]
    recomputed: dict[str, list[tuple[str, str]]]  # region -> [(node name, op)] recomputed
    record: GraphRecord | None
    backward_compiled: bool
    #: a sac backend compiled it exactly as its inner backend does: no marker, no wrapped layer
    untouched: bool = False

    @property
    def activation_bytes(self) -> int:
        """Saved non-input values held on the device (not offloaded)."""
        return sum(v.nbytes for v in self.saved if not v.is_input and not v.offloaded)

    @property
    def offloaded_bytes(self) -> int:
        """Saved values offloaded to host memory."""
        return sum(v.nbytes for v in self.saved if v.offloaded)

    @property
    def input_bytes(self) -> int:
        """Saved graph inputs other than parameters (e.g. a layer's input)."""
        return sum(v.nbytes for v in self.saved if v.region == INPUT)

    @property
    def param_bytes(self) -> int:
        return sum(v.nbytes for v in self.saved if v.is_param)


@dataclass
class PartitionReport:
    """Saved values and recomputed nodes of every graph ``fn`` compiled to."""

    graphs: list[GraphPartition] = field(default_factory=list)
    output: Any = None

    @property
    def saved(self) -> list[SavedValue]:
        return [v for g in self.graphs for v in g.saved]

    @property
    def activation_bytes(self) -> int:
        """Bytes of saved non-input values held on the device (each storage once per graph)."""
        return sum(g.activation_bytes for g in self.graphs)

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of saved values offloaded to host memory (a scope's ``offload=``)."""
        return sum(g.offloaded_bytes for g in self.graphs)

    @property
    def input_bytes(self) -> int:
        """Bytes of saved non-parameter graph inputs."""
        return sum(g.input_bytes for g in self.graphs)

    @property
    def param_bytes(self) -> int:
        return sum(g.param_bytes for g in self.graphs)

    @property
    def saved_bytes(self) -> int:
        """Everything saved for backward except parameters and buffers."""
        return self.activation_bytes + self.input_bytes

    def saved_regions(self) -> set[str]:
        """Region names that own at least one saved activation."""
        names: set[str] = set()
        for v in self.saved:
            if not v.is_input and v.region not in (NO_REGION, RNG):
                names.update(v.region.split("+"))
        return names

    def bytes_by_region(self) -> dict[str, int]:
        """Saved bytes held on the device, by region (offloaded values not among them)."""
        out: dict[str, int] = defaultdict(int)
        for v in self.saved:
            if not v.offloaded:
                out[v.region] += v.nbytes
        return dict(out)

    def offloaded_bytes_by_region(self) -> dict[str, int]:
        """Saved bytes offloaded to host memory, by region."""
        out: dict[str, int] = defaultdict(int)
        for v in self.saved:
            if v.offloaded:
                out[v.region] += v.nbytes
        return dict(out)

    def format(self, *, inputs: bool = False) -> str:
        """A stable plain-text table (for ``assertExpectedInline``).

        Per graph: a header (scopes, numbered in program order, and regions), the
        saved activations (``inputs=True`` lists saved graph inputs too, else they
        are one summary line), and the recomputed forward ops grouped by region.
        """
        lines: list[str] = []
        for g in self.graphs:
            ordinal = _scope_ordinals(g.record)
            lines.append(_graph_header(g, ordinal))
            rows = [("saved", "op", "region", "scope", "shape", "dtype", "bytes")]
            for v in g.saved:
                if v.is_input and not inputs:
                    continue
                shape = "?" if v.shape is None else "[" + ", ".join(map(str, v.shape)) + "]"
                scope = "-" if v.scope is None else f"#{ordinal.get(v.scope, v.scope)}"
                nbytes = f"{v.nbytes} (host)" if v.offloaded else str(v.nbytes)
                rows.append((v.name, v.op, v.region, scope, shape, v.dtype, nbytes))
            if len(rows) > 1:
                lines.extend(_table(rows))
            else:
                lines.append("saved: no activations")
            n_in = sum(1 for v in g.saved if v.region == INPUT)
            n_par = sum(1 for v in g.saved if v.is_param)
            lines.append(
                f"inputs saved: {n_in} ({g.input_bytes} B); parameters saved: {n_par} ({g.param_bytes} B)"
            )
            if g.recomputed:
                lines.append("recomputed:")
                for region in sorted(g.recomputed):
                    lines.append(f"  {region}: {_op_histogram(g.recomputed[region])}")
            else:
                lines.append("recomputed: nothing")
            n_act = sum(1 for v in g.saved if not v.is_input)
            n_rec = sum(len(v) for v in g.recomputed.values())
            host = f" ({g.offloaded_bytes} B more on the host)" if g.offloaded_bytes else ""
            lines.append(f"total: {n_act} activations, {g.activation_bytes} B{host}; {n_rec} ops recomputed")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _scope_ordinals(rec: GraphRecord | None) -> dict[int, int]:
    """ac_graph_id -> 1-based position in program order (raw ids depend on process history)."""
    if rec is None:
        return {}
    return {s.ac_graph_id: i + 1 for i, s in enumerate(rec.scopes)}


def _op_histogram(nodes: list[tuple[str, str]]) -> str:
    counts: dict[str, int] = defaultdict(int)
    for _, op in nodes:
        counts[op.removeprefix("aten.")] += 1
    parts = [op if c == 1 else f"{op} x{c}" for op, c in sorted(counts.items())]
    return f"{len(nodes)} ops: " + ", ".join(parts)


def _graph_header(g: GraphPartition, ordinal: dict[int, int]) -> str:
    head = f"graph {g.index}"
    rec = g.record
    if g.untouched:
        return head + ": no marker and no wrapped layer: compiled untouched, not checkpointed"
    if rec is None:
        return head + ": no tagging pass"
    if not rec.is_training:
        return head + ": inference (markers stripped)"
    scopes = ", ".join(
        f"#{ordinal[s.ac_graph_id]} {s.source} keep={_keep_text(s.keep)}"
        + (f" offload={_keep_text(s.offload)}" if s.offload else "")
        for s in rec.scopes
    )
    if rec.outside_every_scope:
        scopes = "none: outside every wrapped layer, not checkpointed"
    regions = ", ".join(
        f"{r.name}({'offloaded' if r.offloaded else 'kept' if r.kept else 'recomputed'})"
        for r in sorted(rec.regions.values(), key=lambda r: r.name)
    )
    extra = ""
    if rec.unbalanced:
        extra += "; unbalanced: " + ", ".join(f"{n} {why}" for n, why in rec.unbalanced)
    if rec.starts_inside:
        extra += "; starts inside: " + ", ".join(rec.starts_inside)
    if rec.policy_overrides:
        extra += "; overrides checkpoint policy: " + ", ".join(
            f"{n} in #{ordinal.get(ac, ac)}" for n, ac, _ in rec.policy_overrides
        )
    if rec.hop_kept:
        extra += f"; saved {len(rec.hop_kept)} invoke_subgraph call(s) whose body kept a region"
    if rec.hop_markers:
        extra += "; markers in HOP bodies (not honoured): " + ", ".join(
            f"{n} in {h}" for h, n in rec.hop_markers
        )
    return f"{head}: scopes [{scopes or 'none'}] regions [{regions or 'none'}]{extra}"


def _keep_text(keep: KeepSet) -> str:
    return "*" if keep is ALL_REGIONS else ("+".join(sorted(cast("frozenset[str]", keep))) or "()")


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def build_partition(index: int, unit: CompileUnit) -> GraphPartition | None:
    record = unit.records[-1] if unit.records else None
    fw = unit.graphs.get("forward")
    bw = unit.graphs.get("backward")
    if fw is None and "inference" in unit.graphs:
        return GraphPartition(index, [], {}, record, backward_compiled=False, untouched=unit.untouched)
    if fw is None:
        return None
    fw_ops = {name: op for name, op, _ in fw["calls"]}
    view_base = {name: base for name, _, base in fw["calls"] if base is not None}
    fw_inputs = {name for name, _ in fw["placeholders"]}

    def root(name: str) -> str:
        # a saved view shares its base's storage (and is attributed to its region)
        while name in view_base:
            name = view_base[name]
        return name

    derived: dict[str, tuple[str, ...]] = {}

    def regions_of(name: str) -> tuple[str, ...] | None:
        if record is None:
            return None
        found = record.node_regions.get(name) or record.node_regions.get(root(name))
        if found is not None or name in record.forward_nodes or name not in fw_ops:
            return found
        # Not a forward node of the joint graph: a backward op that reads only forward
        # values (cos(x) for sin's gradient), which the partitioner may compute in the
        # forward and save instead of its inputs. It belongs to its inputs' regions.
        if name not in derived:
            derived[name] = ()
            union = {r for i in fw["inputs"].get(name, ()) for r in (regions_of(i) or ())}
            derived[name] = tuple(sorted(union))
        return derived[name] or None

    saved: list[SavedValue] = []
    recomputed: dict[str, list[tuple[str, str]]] = defaultdict(list)
    if bw is not None:
        # a storage counts once: saved values that alias one (views of it, the pieces of a
        # split, an _unsafe_view of a matmul's output) share it, whatever op made them
        seen: set[Any] = set()
        for name, val in bw["placeholders"]:
            if aot.is_tangent(name):
                continue
            source = aot.offloaded_source(name)  # (a value offloaded: the node it copies)
            base = root(source)
            regions = regions_of(source)
            if base in fw_inputs:
                region = PARAM if param_input(base, unit.input_is_param) else INPUT
            elif aot.is_rng_state_output(name):
                region = RNG  # AOTAutograd's saved RNG state for a recomputed random op
            else:
                region = "+".join(regions) if regions else NO_REGION
            scope = None
            if record is not None:
                scope = record.node_scope.get(source, record.node_scope.get(base))
            op = INPUT if source in fw_inputs else fw_ops.get(source, "?")
            key = _storage_key(val, base)
            value = _saved_value(source, op, region, scope, val, count=key not in seen)
            saved.append(dataclasses.replace(value, offloaded=source != name))
            seen.add(key)
        for name, op, _ in bw["calls"]:
            if name in fw_ops:
                regions = regions_of(name)
                recomputed["+".join(regions) if regions else NO_REGION].append((name, op))
    return GraphPartition(
        index, saved, dict(recomputed), record, backward_compiled=bw is not None, untouched=unit.untouched
    )


def _storage_key(val: Any, base: str) -> Any:
    """What identifies a saved value's memory: its (fake) storage, else its view chain's base."""
    if isinstance(val, torch.Tensor):
        try:
            return storage_id(val.untyped_storage())
        except (NotImplementedError, RuntimeError):
            pass
    return base


def param_input(primal: str, input_is_param: list[bool]) -> bool:
    """Whether the partitioned graph input ``primal`` (``primals_N``) is a parameter."""
    index = aot.primal_index(primal)
    return index is not None and 0 <= index < len(input_is_param) and input_is_param[index]


def _saved_value(name: str, op: str, region: str, scope: int | None, val: Any, *, count: bool) -> SavedValue:
    if isinstance(val, torch.Tensor):
        nbytes = int(val.untyped_storage().nbytes()) if count else 0
        shape = tuple(int(s) if not isinstance(s, torch.SymInt) else -1 for s in val.shape)
        return SavedValue(name, op, region, scope, shape, str(val.dtype).replace("torch.", ""), nbytes)
    return SavedValue(name, op, region, scope, None, type(val).__name__, 0)
