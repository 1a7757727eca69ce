"""``plan``: the least recompute that fits a memory target, chosen from measured candidates.

A keep set is a user's guess, and PyTorch's ``activation_memory_budget`` is a fraction of an
unknown quantity. :func:`plan` measures instead. It traces the module once (Dynamo and
AOTAutograd, one checkpoint scope, both compile caches off) and partitions each joint graph
once per candidate — every keep set over the module's regions (all subsets up to
:data:`MAX_EXHAUSTIVE_REGIONS` regions; beyond, the empty set, each region alone, every
region, and each region left out) crossed with knapsack budgets and region policies — with
the tagging pass and min-cut partitioner an ``aot_eager`` compile uses, without codegen.
From each partition it reads the bytes the backward keeps (distinct storages, parameters and
buffers excluded, the module's inputs included: the partition report's ``saved_bytes``) and
the matmul / attention / grouped-matmul FLOPs its backward recomputes
(:func:`~sac_compile.inspection.flops.graph_costly_flops` beyond the no-checkpoint
backward's). It returns the candidate with the least recompute whose bytes fit ``memory``
(ties: fewer bytes), with the whole table.

Guarantees (``tests/test_planning.py``): every candidate's figures equal what autograd saves
and what the backward runs when that configuration is compiled and run on its own; the chosen
plan's bytes never exceed ``memory``; for one module and candidate set, a larger ``memory``
never gives more recompute (the choice is a minimum over a feasible set that only grows);
when nothing fits, a ``ValueError`` names the smallest reachable bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn as nn

from ..actions import Actions, validate_budget
from ..memory import Memory, parse_memory
from ..policy import SAVE_COSTLY, RegionPolicy, validate_policy
from .candidates import MAX_EXHAUSTIVE_REGIONS, Candidate, configurations, flops_order, keep_sets, mark_pareto
from .measure import LayerMeasure, eager_bytes, measure, plain_bytes, timed
from .op_sac import TORCHTITAN_OP

if TYPE_CHECKING:
    from ..config import SacConfig

__all__ = [
    "DEFAULT_BUDGETS",
    "LEAST",
    "MAX_EXHAUSTIVE_REGIONS",
    "Candidate",
    "Plan",
    "flops_order",
    "keep_sets",
    "plan",
]

#: The smallest budget: the knapsack saves nothing it may recompute, so a keep set with it
#: holds the least a plan keeping those regions can (PyTorch's budget 0 ignores the tags).
LEAST = 1e-6
#: Knapsack budgets tried beside each keep set (``None``: the keep set alone). Above 0.5 the
#: knapsack's choices were dominated by keeping every region on every model measured.
DEFAULT_BUDGETS: tuple[float | None, ...] = (None, LEAST, 0.1, 0.2, 0.3, 0.5)


@dataclass(frozen=True)
class Plan:
    """The chosen candidate (``keep``, ``budget``, ``policy`` and its figures) and the table."""

    memory: int  # the target, in bytes
    chosen: Candidate
    candidates: tuple[Candidate, ...]
    no_checkpoint_bytes: int
    regions: tuple[str, ...]
    search: str  # "exhaustive" or how keep sets were picked
    estimator: str = "flops"  # what the choice minimises: "flops", or "time" (measured steps)
    no_checkpoint_time: float | None = None  # median step seconds without checkpointing ("time")
    no_checkpoint_transient: int = 0  # the no-checkpoint backward graph's transient bytes
    no_checkpoint_eager_bytes: int | None = None  # what autograd holds without a checkpoint (eager=True)
    forward_flops: int = 0  # costly FLOPs of the forward
    no_checkpoint_flops: int = 0  # costly FLOPs of the no-checkpoint backward
    forward_traffic: int = 0  # bytes the forward's memory-bound ops move (inspection.flops.graph_traffic)
    forward_attention_flops: int = 0  # of forward_flops, its attention kernels' (graph_attention_flops)
    # the gradients its weights' gradients are computed from (graph_memory.weight_gradient_inputs)
    weight_gradient_inputs: int = 0
    no_checkpoint_traffic: int = 0  # the same for the no-checkpoint backward
    no_checkpoint_tp: tuple[int, int, int] = (0, 0, 0)  # its saved bytes' tp_split (Candidate)
    no_checkpoint_ring: tuple[int, int] = (0, 0)  # its backward's ring attention (Candidate.ring_transient)
    no_checkpoint_routed: tuple[
        tuple[int, int], ...
    ] = ()  # its routed experts' part (Candidate.routed_transient)
    # the layer's first input (its residual stream), which sequence parallelism splits of what
    # a checkpointed layer holds eagerly (planning.parallel.sequence_split_input)
    stream_input_bytes: int = 0
    # torchtitan's per-op selective AC measured on the same trace (planning.op_sac): a peer,
    # never chosen
    op_sac: Candidate | None = None

    @property
    def keep(self) -> frozenset[str]:
        return self.chosen.keep

    @property
    def budget(self) -> float | None:
        return self.chosen.budget

    @property
    def policy(self) -> RegionPolicy:
        return self.chosen.policy

    @property
    def saved_bytes(self) -> int:
        return self.chosen.saved_bytes

    @property
    def recompute_flops(self) -> int:
        return self.chosen.recompute_flops

    def format(self) -> str:
        """The candidate table, sorted by bytes: ``*`` Pareto, ``>`` the choice."""
        lines = [
            f"plan: memory {self.memory:,} B ({self.memory / max(self.no_checkpoint_bytes, 1):.2f} of the "
            f"no-checkpoint {self.no_checkpoint_bytes:,} B); regions {', '.join(self.regions) or '(none)'}; "
            f"{len(self.candidates)} candidates ({self.search})",
            f"  {'':2}{'configuration':<44}{'saved B':>14}{'vs none':>9}{'recomputed FLOP':>18}"
            f"{'eager B':>14}" + (f"{'step':>8}" if self.no_checkpoint_time else ""),
        ]
        for c in sorted(self.candidates, key=lambda c: (c.saved_bytes, c.recompute_flops)):
            mark = (">" if c is self.chosen else " ") + ("*" if c.pareto else " ")
            ratio = c.saved_bytes / max(self.no_checkpoint_bytes, 1)
            eager = "-" if c.eager_bytes is None else f"{c.eager_bytes:,}"
            step = ""
            if self.no_checkpoint_time:
                step = (
                    f"{'-':>8}" if c.step_time is None else f"{c.step_time / self.no_checkpoint_time:>7.2f}x"
                )
            lines.append(
                f"  {mark}{c.label:<44}{c.saved_bytes:>14,}{ratio:>9.2f}{c.recompute_flops:>18,}{eager:>14}{step}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()

    def plot(self, path: str, *, title: str | None = None) -> None:
        """Draw the table to ``path`` (needs matplotlib): PyTorch's knapsack alone (``keep={}``
        with each budget) as a line, every candidate as a point, the Pareto frontier, the
        memory target and the choice."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        mib = 2.0**20
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        points = [(c.saved_bytes / mib, c.recompute_flops / 1e9) for c in self.candidates]
        ax.scatter(
            *cast("tuple[Any, Any]", zip(*points)), s=12, color="tab:blue", alpha=0.5, label="candidates"
        )
        knapsack = sorted(
            (c.saved_bytes / mib, c.recompute_flops / 1e9)
            for c in self.candidates
            if not c.keep and c.budget is not None
        )
        if knapsack:
            ax.plot(*zip(*knapsack), "o-", color="tab:gray", ms=3, label="PyTorch's knapsack alone (keep {})")
        front = sorted((c.saved_bytes / mib, c.recompute_flops / 1e9) for c in self.candidates if c.pareto)
        ax.step(*zip(*front), where="post", color="tab:red", ls="--", lw=1.2, label="planner's frontier")
        ax.axvline(self.memory / mib, color="tab:green", lw=1, label=f"memory {self.memory / mib:.3g} MiB")
        c = self.chosen
        ax.plot(c.saved_bytes / mib, c.recompute_flops / 1e9, "*", color="tab:red", ms=14, label=c.label)
        ax.set_xlabel("saved for the backward (MiB)")
        ax.set_ylabel("recomputed GFLOP")
        ax.set_title(title or f"plan: {', '.join(self.regions)}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    def select(self, memory: Memory) -> Plan:
        """The same candidates, chosen for another ``memory`` (nothing measured again)."""
        return _choose(_target(memory, self.no_checkpoint_bytes), self)

    def config(self, layers: str, regions: dict[str, str] | None = None, **options: Any) -> SacConfig:
        """A :class:`~sac_compile.SacConfig` applying the plan to every layer matching ``layers``
        (compiled per layer when the plan has a budget: budgets act in compiled code only)."""
        from ..config import SacConfig

        compile_ = options.pop("compile", self.budget is not None)
        if self.budget is not None and compile_ is False:
            raise ValueError(
                f"the plan has budget={self.budget:g}, which only compiled code honours; "
                "leave compile at its default (True for such a plan) or plan with budgets=(None,)"
            )
        return SacConfig(
            layers=layers,
            keep=self.keep,
            regions=regions or {},
            compile=compile_,
            policy=self.policy,
            budget=self.budget,
            offload=self.chosen.offload,
            **options,
        )


def _checked(
    module: nn.Module,
    memory: Memory,
    budgets: Iterable[float | None],
    policies: Sequence[RegionPolicy],
    estimator: str,
    inner: str,
) -> tuple[tuple[float | None, ...], tuple[RegionPolicy, ...]]:
    """``plan``'s arguments checked before anything is compiled: the budgets (0 is no
    budget) and policies, validated."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"plan measures an nn.Module (one layer), got {type(module).__name__}")
    budgets = tuple(dict.fromkeys(validate_budget(b) for b in budgets))
    if not budgets:
        raise ValueError("plan needs at least one budget (None for the keep set alone)")
    if not policies:
        raise ValueError("plan needs at least one region policy (sac_compile.SAVE_COSTLY)")
    _target(memory, 0)  # its type and range
    if estimator not in ("flops", "time"):
        raise ValueError(
            f"plan(estimator={estimator!r}): 'flops' (recomputed FLOPs) or 'time' (measured steps)"
        )
    if inner not in ("inductor", "aot_eager"):
        raise ValueError(
            f"plan(inner={inner!r}): the backend timed steps compile with, 'inductor' or 'aot_eager'"
        )
    return budgets, tuple(validate_policy(p) for p in policies)


def plan(
    module: nn.Module,
    *example_args: Any,
    memory: Memory,
    budgets: Iterable[float | None] = DEFAULT_BUDGETS,
    policies: Sequence[RegionPolicy] = (SAVE_COSTLY,),
    eager: bool = True,
    estimator: str = "flops",
    inner: str = "inductor",
    iters: int = 9,
    offload: bool = False,
    **example_kwargs: Any,
) -> Plan:
    """Measure candidates on ``module(*example_args, **example_kwargs)`` and choose one.

    Args:
        module: one checkpoint scope's worth of model (a decoder layer), its regions marked
            or declared.
        memory: what the backward may hold for the scope (:mod:`sac_compile.memory`): bytes
            (``int``), a number with a unit (``"2GiB"``), or a fraction of the no-checkpoint
            bytes (``float`` in [0, 1]).
        budgets: knapsack budgets tried with each keep set (``None``: none).
        policies: region policies tried (``SAVE_COSTLY``, ``SAVE_ALL``, your own).
        eager: also measure what the eager engine holds for each candidate without a budget
            (``Candidate.eager_bytes``; budgets act in compiled code only).
        estimator: ``"flops"`` (default) minimises the recomputed FLOPs; ``"time"`` compiles
            one configuration per distinct Pareto point (bytes, FLOPs) and the no-checkpoint
            baseline with ``inner`` (``"inductor"``, or ``"aot_eager"``) and minimises their
            median forward+backward time over ``iters`` interleaved rounds (on the module's
            device: CUDA too).
        offload: also measure offloading regions to host memory: for every two measured keep
            sets ``A`` inside ``B``, keep ``A`` and offload ``B - A`` (no budget, the first
            policy; :mod:`~sac_compile.planning.candidates`). ``saved_bytes`` counts the
            device, ``offloaded_bytes`` the host. The choice counts no transfer (the least
            recompute, then the fewest bytes offloaded): the device planner
            (``hf.plan_for(device=Target(offload=True, ...))``) prices it on a host link.
    """
    budgets, policies = _checked(module, memory, budgets, policies, estimator, inner)
    if not isinstance(offload, bool):
        raise TypeError(f"plan(offload={offload!r}): True (also measure offloading regions) or False")
    from ..compiler.backend import backend_for

    first = _first(module, example_args, example_kwargs)
    none = "none"
    base = first.figures[none]
    regions = first.regions
    target = _target(memory, base.saved_bytes)
    actions, search = configurations(regions, budgets, policies, offload)
    configs = {a: backend_for(a, "aot_eager", whole_graph=True) for a in actions}
    found = _candidates(module, example_args, example_kwargs, configs, base, eager)
    found = mark_pareto(found)
    base_time = None
    if estimator == "time":
        found, base_time = timed(
            module, example_args, example_kwargs, found, order=flops_order, inner=inner, iters=iters
        )
    plain = plain_bytes(module, example_args, example_kwargs) if eager else None
    table = Plan(
        target, found[0], tuple(found), base.saved_bytes, tuple(regions), search, estimator, base_time
    )
    table = dataclasses.replace(
        table,
        no_checkpoint_transient=base.backward_transient,
        no_checkpoint_eager_bytes=plain,
        forward_flops=base.forward_flops,
        no_checkpoint_flops=base.backward_flops,
        forward_traffic=base.forward_traffic,
        forward_attention_flops=base.forward_attention_flops,
        weight_gradient_inputs=base.weight_gradient_inputs,
        no_checkpoint_traffic=base.backward_traffic,
        no_checkpoint_tp=base.tp_split,
        no_checkpoint_ring=base.ring,
        no_checkpoint_routed=base.routed_transient,
        stream_input_bytes=_stream_input_bytes(example_args, example_kwargs),
        op_sac=dataclasses.replace(
            _candidate(first.figures[TORCHTITAN_OP], base, Actions(), first.eager.get(TORCHTITAN_OP)),
            all_to_all="saved",
        ),
    )
    return _choose(target, table)


def _first(module: nn.Module, example_args: tuple[Any, ...], example_kwargs: dict[str, Any]) -> Any:
    """The first trace's partitions: no checkpoint (``"none"``), every region kept (which
    reads the regions) and torchtitan's per-op SAC (``TORCHTITAN_OP``)."""
    from ..compiler.backend import backend_for, baseline_backend
    from ..keep import ALL_REGIONS
    from .op_sac import TorchtitanOpSac

    configs = {
        "none": baseline_backend("aot_eager"),
        frozenset({"every region"}): backend_for(Actions(ALL_REGIONS), "aot_eager", whole_graph=True),
        TORCHTITAN_OP: TorchtitanOpSac(),
    }
    return measure(module, example_args, example_kwargs, configs)


def _candidates(
    module: nn.Module,
    example_args: tuple[Any, ...],
    example_kwargs: dict[str, Any],
    configs: dict[Actions, Any],
    base: LayerMeasure,
    eager: bool,
) -> list[Candidate]:
    """One ``Candidate`` per ``configs`` entry, its recompute counted over the no-checkpoint
    figures ``base``; ``eager`` also measures what the eager engine holds without a budget."""
    measured = measure(module, example_args, example_kwargs, configs)
    figures = measured.figures
    held: dict[Actions, int | None] = {}
    for actions in configs:
        if eager and actions.budget is None and not actions.offload:
            held[actions] = eager_bytes(module, example_args, example_kwargs, actions)
    found = []
    plain: dict[Actions, Candidate] = {}
    for actions in configs:
        if not actions.offload:
            plain[actions] = _candidate(figures[actions], base, actions, held.get(actions))
            found.append(plain[actions])
    for actions in configs:
        if not actions.offload:
            continue
        # the eager engine holds on the device what keeping the same regions holds (inner), and
        # sends the host what keeping the offloaded ones too (outer) adds
        inner = plain.get(Actions(actions.keep, actions.policy))
        outer = plain.get(Actions(actions.saving, actions.policy))
        on_device = None if inner is None else inner.eager_bytes
        every = None if outer is None else outer.eager_bytes
        c = _candidate(figures[actions], base, actions, on_device)
        host = None if on_device is None or every is None else max(every - on_device, 0)
        nested = None if inner is None or outer is None else (inner, outer)
        copies = tuple(measured.copies.get(actions, ()))
        found.append(dataclasses.replace(c, eager_offloaded_bytes=host, copies=copies, nested=nested))
    return found


def _stream_input_bytes(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """The bytes of a layer's first floating tensor input (``hidden_states`` by keyword)."""
    found = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    first = found[0] if found else kwargs.get("hidden_states")
    return int(first.untyped_storage().nbytes()) if isinstance(first, torch.Tensor) else 0


def _candidate(
    figures: LayerMeasure,
    base: LayerMeasure,
    actions: Actions,
    held: int | None = None,
) -> Candidate:
    """A candidate from its :class:`~sac_compile.planning.measure.PartitionEach` figures,
    recompute counted over the no-checkpoint figures ``base``."""
    return Candidate(
        actions,
        figures.saved_bytes,
        max(figures.backward_flops - base.backward_flops, 0),
        eager_bytes=held,
        transient_bytes=figures.backward_transient,
        recompute_traffic=max(figures.backward_traffic - base.backward_traffic, 0),
        tp_split=figures.tp_split,
        tp_row_outputs=figures.tp_row_outputs,
        offloaded_bytes=figures.offloaded_bytes,
        ring_transient=figures.ring,
        tp_offloaded_split=figures.tp_offloaded_split,
        split_recompute=figures.split_recompute,
        routed_transient=figures.routed_transient,
    )


def _choose(target: int, table: Plan) -> Plan:
    """``table``'s candidate with the least recompute within ``target`` bytes (ties: fewer
    bytes, no budget, fewer regions), or with ``estimator="time"`` the fastest measured step."""
    candidates = table.candidates
    fitting = [c for c in candidates if c.saved_bytes <= target]
    if not fitting:
        smallest = min(c.saved_bytes for c in candidates)
        base = table.no_checkpoint_bytes
        raise ValueError(
            f"no candidate fits memory={target:,} B: the smallest reachable is {smallest:,} B "
            f"({smallest / max(base, 1):.2f} of the no-checkpoint {base:,} B); "
            "raise memory, or checkpoint smaller scopes"
        )
    if table.estimator == "time":  # the least-FLOP fitting point is on the Pareto set, so timed
        fitting = [c for c in fitting if c.step_time is not None]
        chosen = min(fitting, key=lambda c: (c.step_time, c.saved_bytes))
    else:
        chosen = min(fitting, key=flops_order)
    return dataclasses.replace(table, memory=target, chosen=chosen)


def _target(memory: Memory, base_bytes: int) -> int:
    return parse_memory(memory, base_bytes, of="the no-checkpoint bytes", call="plan")
