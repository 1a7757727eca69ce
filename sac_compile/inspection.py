"""``capture_partition``: what a compiled function saves for backward, and what it recomputes.

In the spirit of JAX's ``print_saved_residuals``: compile ``fn`` with a sac
backend (both compile caches disabled, so the tagging pass really runs), run
forward and backward once, and read the partitioned forward/backward graphs.
A *saved* value is a placeholder of the backward graph other than a tangent;
a *recomputed* node is a forward node that the backward graph computes again.
"""

from __future__ import annotations

import contextlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from . import backend as _backend
from .keep import ALL_REGIONS
from .records import GraphRecord

__all__ = [
    "GraphPartition",
    "PartitionReport",
    "SavedValue",
    "autograd_saved_bytes",
    "capture_partition",
    "collectives_run",
]

INPUT = "input"
PARAM = "param"
RNG = "rng"
NO_REGION = "-"


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

    @property
    def activation_bytes(self) -> int:
        return sum(v.nbytes for v in self.saved if not v.is_input)

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
        """Bytes of saved non-input values (each storage once per graph)."""
        return sum(g.activation_bytes for g in self.graphs)

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
        out: dict[str, int] = defaultdict(int)
        for v in self.saved:
            out[v.region] += v.nbytes
        return dict(out)

    def recomputed_count(self) -> int:
        return sum(len(v) for g in self.graphs for v in g.recomputed.values())

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
                rows.append((v.name, v.op, v.region, scope, shape, v.dtype, str(v.nbytes)))
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
            lines.append(f"total: {n_act} activations, {g.activation_bytes} B; {n_rec} ops recomputed")
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
    if rec is None:
        return head + ": no tagging pass"
    if not rec.is_training:
        return head + ": inference (markers stripped)"
    scopes = ", ".join(f"#{ordinal[s.ac_graph_id]} {s.source} keep={_keep_text(s.keep)}" for s in rec.scopes)
    if rec.outside_every_scope:
        scopes = "none: outside every wrapped layer, not checkpointed"
    regions = ", ".join(
        f"{r.name}({'kept' if r.kept else 'recomputed'})"
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


def _keep_text(keep) -> str:
    return "*" if keep is ALL_REGIONS else ("+".join(sorted(keep)) or "()")


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _build_partition(index: int, unit: _backend.CompileUnit) -> GraphPartition | None:
    record = unit.records[-1] if unit.records else None
    fw = unit.graphs.get("forward")
    bw = unit.graphs.get("backward")
    if fw is None and "inference" in unit.graphs:
        return GraphPartition(index, [], {}, record, backward_compiled=False)
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
        seen: set[str] = set()
        for name, val in bw["placeholders"]:
            if name.startswith("tangents"):
                continue
            base = root(name)
            regions = regions_of(name)
            if base in fw_inputs:
                region = PARAM if _is_param(base, unit.input_is_param) else INPUT
            elif name.startswith("rng_state_output"):
                region = RNG  # AOTAutograd's saved RNG state for a recomputed random op
            else:
                region = "+".join(regions) if regions else NO_REGION
            scope = None
            if record is not None:
                scope = record.node_scope.get(name, record.node_scope.get(base))
            op = INPUT if name in fw_inputs else fw_ops.get(name, "?")
            saved.append(_saved_value(name, op, region, scope, val, count=base not in seen))
            seen.add(base)
        for name, op, _ in bw["calls"]:
            if name in fw_ops:
                regions = regions_of(name)
                recomputed["+".join(regions) if regions else NO_REGION].append((name, op))
    return GraphPartition(index, saved, dict(recomputed), record, backward_compiled=bw is not None)


def _is_param(primal: str, input_is_param: list[bool]) -> bool:
    """AOTAutograd names graph inputs primals_1, primals_2, ... in Dynamo's input order."""
    if not primal.startswith("primals_"):
        return False
    try:
        index = int(primal.removeprefix("primals_")) - 1
    except ValueError:
        return False
    return 0 <= index < len(input_is_param) and input_is_param[index]


def _saved_value(name, op, region, scope, val, *, count: bool) -> SavedValue:
    if isinstance(val, torch.Tensor):
        nbytes = int(val.untyped_storage().nbytes()) if count else 0
        shape = tuple(int(s) if not isinstance(s, torch.SymInt) else -1 for s in val.shape)
        return SavedValue(name, op, region, scope, shape, str(val.dtype).replace("torch.", ""), nbytes)
    return SavedValue(name, op, region, scope, None, type(val).__name__, 0)


class _FreshBackend:
    """A new backend object per capture, so Dynamo cannot reuse an earlier compile."""

    def __init__(self, inner: _backend.SacBackend) -> None:
        self.inner = inner

    def __call__(self, gm, example_inputs):
        return self.inner(gm, example_inputs)


def _resolve_backend(backend: Any) -> _backend.SacBackend:
    if isinstance(backend, _backend.SacBackend):
        return backend
    if backend in ("inductor", "aot_eager"):
        return _backend.baseline_backend(backend)
    raise TypeError(
        f"capture_partition needs a sac backend (sac_compile.sac_backend or "
        f"sac_compile.make_sac_backend(...)), or 'inductor' / 'aot_eager' for the same "
        f"compile without checkpointing; got {backend!r}"
    )


def capture_partition(fn, *args: Any, backend: Any = None, **kwargs: Any) -> PartitionReport:
    """Compile ``fn`` with ``backend``, run forward and backward once, report the partition.

    ``backend`` defaults to :data:`sac_compile.sac_backend`. Both compile caches
    are disabled for the capture (a cache hit would skip the tagging pass). The
    capture compiles ``fn`` afresh with its own backend object, in its own
    ``isolate_recompiles`` bucket: its cache entries do not count against the
    ``recompile_limit`` of your own ``torch.compile`` calls (they stay in memory). ``fn``'s output must be a tensor or a
    structure of tensors; backward runs on the sum of its floating-point parts.
    """
    sac = _resolve_backend(_backend.sac_backend if backend is None else backend)
    units: list[_backend.CompileUnit] = []
    dynamo_config = torch._dynamo.config
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.compiler.config.patch(force_disable_caches=True))
        stack.enter_context(dynamo_config.patch(accumulated_recompile_limit=1 << 20))
        with _backend._capture_lock:
            _backend._capture_sinks.append(units)
        try:
            # isolate_recompiles: the capture's entries do not count against the
            # recompile_limit of the user's own torch.compile calls on fn's code.
            compiled = torch.compile(fn, backend=_FreshBackend(sac), isolate_recompiles=True)
            out = compiled(*args, **kwargs)
            loss = _scalar_loss(out)
            if loss is not None and loss.requires_grad:
                loss.backward()
        finally:
            with _backend._capture_lock:
                _backend._capture_sinks.remove(units)
    report = PartitionReport(output=out)
    for unit in units:
        part = _build_partition(len(report.graphs), unit)
        if part is not None:
            report.graphs.append(part)
    return report


def _scalar_loss(out: Any) -> torch.Tensor | None:
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    leaves = [t for t in leaves if t.is_floating_point() and t.requires_grad]
    if not leaves:
        return None
    return sum(t.sum() for t in leaves)


def autograd_saved_bytes(fn, *args: Any, exclude: Any = ()) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn(*args)`` runs.

    An independent check of a partition report (and the eager no-checkpoint
    baseline): ``saved_tensors_hooks`` see what the compiled graph or the eager
    ops hand to autograd. Storages of the tensors in ``exclude`` (pass the
    parameters) are left out. Runs ``fn(*args).sum().backward()``.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    out.sum().backward()
    return sum(storages.values())


def collectives_run(fn, *args: Any, **kwargs: Any) -> tuple[Any, Counter]:
    """Run ``fn(*args, **kwargs)`` and count the collectives it runs, by op.

    Counts ``c10d`` / ``_c10d_functional`` communication ops (not ``wait_tensor``
    and the async wrapper) seen by a ``TorchDispatchMode``, including those a
    backward run inside ``fn`` executes (autograd carries the mode into the
    backward) and those that compiled code calls (Inductor and ``aot_eager``
    call collectives as ops). Returns ``(fn's result, Counter)``.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    from .eager import _communicates

    counts: Counter = Counter()

    class _Count(TorchDispatchMode):
        supports_higher_order_operators = True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if _communicates(func):
                counts[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        out = fn(*args, **kwargs)
    return out, counts
