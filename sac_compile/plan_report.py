"""The plan command's report (``python -m sac_compile plan``): a plan's JSON (:func:`report`),
one configuration's figures (:func:`configuration`: ``--ac``), the peers a user would run
instead of the plan on the same target (:func:`peers`), and their lines (:func:`peer_line`)."""

from __future__ import annotations

from typing import Any

from .planning.fastest import bound

__all__ = ["configuration", "faster", "faster_line", "peer_line", "peers", "report", "step_json"]


def report(plan: Any, seconds: float) -> dict[str, Any]:
    t = plan.target
    return {
        "device": t.machine.device.name,
        "memory": t.machine.memory,
        "usable": t.machine.usable,
        "fsdp": t.layout.fsdp,
        "fsdp_reshard_after_forward": t.layout.fsdp_reshard_after_forward,
        "tp": t.layout.tp,
        "ep": t.layout.ep,
        "replicate": t.layout.replicate,
        "zero": t.layout.zero,
        "cp": t.layout.cp,
        "pp": t.layout.pp,
        "pp_schedule": t.layout.pp_schedule,
        "pp_virtual_stages": t.layout.stages_per_rank,
        "microbatch_size": t.layout.microbatch_size,
        "pp_recompute_once": t.layout.pp_recompute_once,
        "pp_return_outputs": t.layout.pp_return_outputs,
        "sequence_parallel": t.layout.sequence_parallel,
        "loss_parallel": t.layout.loss_parallel,
        "async_tp": t.layout.async_tp,
        "loss": t.workload.loss,
        "repeat_kv": t.workload.repeat_kv,
        "batch": t.workload.batch,
        "seq": t.workload.seq,
        "param_dtype": str(t.workload.param_dtype).removeprefix("torch."),
        "optimizer": t.workload.optimizer,
        "compile": plan.compile,
        "peer": plan.peer,
        "why": plan.why,
        "bound": bound(plan.step),
        "peak_bytes": plan.peak_bytes,
        "fits": plan.fits,
        "reserved_bytes": plan.reserved_bytes,
        "phase": plan.peak.phase,
        "breakdown": plan.breakdown,
        "stages": [
            {
                "rank": i,
                "peak_bytes": p.bytes,
                "reserved_bytes": p.reserved,
                "phase": p.phase,
                "fits": p.reserved <= t.machine.usable,
            }
            for i, p in enumerate(plan.stages())
        ],
        **step_json(plan.step),
        "gpus_per_node": t.machine.gpus_per_node,
        "network": t.machine.network,
        "offload": t.machine.offload,
        "host_memory": t.machine.host_memory,
        "host_link": t.machine.host.name if t.machine.offload else None,
        "offload_bytes": plan.host_bytes,
        "transfer_seconds": plan.transfer_seconds,
        "planning_seconds": round(seconds, 1),
        "groups": [
            {
                "kind": g.kind,
                "layers": list(g.paths),
                "count": len(g.paths),
                "keep": None if plan.peer == "no AC" else sorted(g.plan.keep),
                "budget": g.plan.budget,
                "offload": sorted(g.plan.chosen.offload),
                "offload_bytes": g.plan.chosen.offloaded_bytes,
                "saved_bytes": g.plan.saved_bytes,
                "recompute_flops": g.plan.recompute_flops,
            }
            for g in plan.groups
        ],
    }


def configuration(plan: Any, keep: Any, budget: float | None, *, spec: str) -> dict[str, Any]:
    try:
        peak, step = plan.configuration(keep, budget)
    except ValueError as e:
        raise SystemExit(f"sac_compile plan: --ac {spec}: {e}") from None
    return {
        "spec": spec,
        "peak_bytes": peak.bytes,
        "fits": peak.reserved <= plan.target.machine.usable,
        "reserved_bytes": peak.reserved,
        "phase": peak.phase,
        "breakdown": peak.breakdown,
        **step_json(step),
    }


def step_json(step: Any) -> dict[str, Any]:
    """The JSON of a :class:`~sac_compile.planning.step_time.StepTime`."""
    return {
        "step_seconds": step.seconds,
        "step_terms": step.terms(),
        "tokens_per_second": step.tokens_per_second,
        "mfu": step.mfu,
    }


def peers(plan: Any) -> dict[str, dict[str, Any]]:
    """What a user would run instead of the plan, on the same target: no AC, full AC,
    torchtitan's per-op SAC, and compiled, PyTorch's ``activation_memory_budget`` alone at
    each budget measured."""
    from .planning.op_sac import TORCHTITAN_OP

    peers: list[tuple[str, Any, float | None, str]] = [
        ("no AC", None, None, "none"),
        ("full AC", (), None, "full"),
    ]
    peers.append(("torchtitan op SAC", TORCHTITAN_OP, None, TORCHTITAN_OP))
    if plan.compile:
        budgets = sorted(
            {c.budget for g in plan.measured for c in g.plan.candidates if c.budget and not c.keep}
        )
        peers += [(f"budget {b:g}", (), b, f"budget={b:g}") for b in budgets if b >= 0.01]
    return {name: configuration(plan, keep, budget, spec=spec) for name, keep, budget, spec in peers}


def peer_line(name: str, found: dict[str, Any], *, full: bool = False) -> str:
    scale, unit = (2**30, "GiB") if found["peak_bytes"] >= 2**30 else (2**20, "MiB")
    line = (
        f"{name}: peak {found['peak_bytes'] / scale:.2f} {unit} in the {found['phase']} "
        f"({found['reserved_bytes'] / scale:.2f} reserved, {'fits' if found['fits'] else 'does not fit'}), step {found['step_seconds']:.3f} s (est.), "
        f"{found['tokens_per_second']:,.0f} tokens/s per GPU"
    )
    if full:
        terms = (f"    {t:<20}{v / scale:>10.2f} {unit}" for t, v in found["breakdown"].items() if v)
        line = "\n".join([line, *terms])
    return line


def faster(step_seconds: float, peers: dict[str, dict[str, Any]]) -> list[str]:
    """The peers that fit and are predicted a shorter step than the plan's. The plan takes the
    least recomputed FLOPs that fit, and the step estimate also counts the memory traffic of
    what is recomputed (the cheap ops a kept region's layer still recomputes): with memory to
    spare no AC, or a peer that recomputes other ops, can step faster."""
    return [name for name, p in peers.items() if p["fits"] and p["step_seconds"] < step_seconds]


def faster_line(step_seconds: float, peers: dict[str, dict[str, Any]], names: list[str]) -> str:
    """One line naming :func:`faster`'s peers with their shorter steps."""

    def one(name: str) -> str:
        found = peers[name]
        scale, unit = (2**30, "GiB") if found["reserved_bytes"] >= 2**30 else (2**20, "MiB")
        shorter = 1 - found["step_seconds"] / step_seconds
        return f"{name} ({shorter:.1%} shorter step, {found['reserved_bytes'] / scale:.2f} {unit} reserved)"

    return "  fits and steps faster than the plan: " + "; ".join(one(name) for name in names)
