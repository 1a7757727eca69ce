"""The device planner beside training runs others measured and published: predicted peak
memory and tokens/s per GPU against the published figures, with ratios.

The runs and their sources are data, ``benchmarks/published_runs.json``: each source its
citation and notes (the log lines quoted, the layout read off them), each run its fields
(:class:`Run`) and its source's key; those marked ``calibrates`` apart from those marked
``validates`` (the rest were in view while the device model was built).

Each run is planned as ``python -m sac_compile plan`` plans it (the model from its
``config.json`` on the meta device, one layer of each kind traced with the target's kernels),
then ``DevicePlan.configuration`` predicts the run's own activation checkpointing (no AC,
full AC, or torchtitan's per-op SAC: ``planning.op_sac``) on the run's layout. One
measurement per config and ``Target.measured`` (a GPU's kernels, dtype, traced shape,
``repeat_kv``, ``offload``) serves every run that shares them, eager or compiled, on any GPU.
Every run's trainer repeated grouped keys and values before attention (``Target.repeat_kv``:
torchtitan's Llama did until 2026-01), and each is planned so.

Published memory is the allocator's max *reserved* (torchtitan's tables) or what the source
names; float8 runs (``float8`` column) convert their linear layers and are planned as the bf16
model (``benchmarks/float8_layers.py`` shows what float8 changes): their memory is compared,
their tokens/s is not. A run marked ``calibrates``
set its device's ``efficiency`` or ``EAGER_SLOWDOWN`` (``planning/world.json``): its tokens/s
ratio is 1 by construction and checks nothing. A run published as out of memory (``oom``)
checks that the prediction exceeds the device's memory. A run marked ``validates`` was found
after the device model was built and tuned nothing: the claim is those runs' figures (the
summary line under the table); ``rank`` names the pipeline rank whose memory a source logs.

    python benchmarks/published.py [--match REGEX] [--json PATH] [--calibrate]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "examples", "configs")

DATA = os.path.join(ROOT, "benchmarks", "published_runs.json")


@dataclass(frozen=True)
class Run:
    name: str
    config: str  # examples/configs/<config>.json
    device: str
    batch: int
    seq: int
    ac: str  # none, full, torchtitan-op, torchtitan-op-2025-08 (the policy before it saved the all-to-alls)
    published_gib: float | None  # max reserved, GiB
    published_tps: float | None  # tokens/s per GPU
    source: str
    fsdp: int = 1
    fsdp_reshard_after_forward: bool = True  # False: torchtitan's fsdp_reshard_after_forward never
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    pp_schedule: str = "1f1b"
    microbatch_size: int = 1  # torchtitan's default until 2025 was pp microbatches: batch / pp
    compile: bool = True
    float8: bool = False
    calibrates: bool = False
    loss: str = "torchtitan"  # torchtitan compiles its loss with the model since 2025-04: "compiled"
    memory_unit: float = 2**30  # the published memory's unit
    oom: bool = False  # published as running out of memory: the prediction must exceed the device's
    # torchtitan's Llama repeated grouped keys and values to the query's heads before SDPA
    # until github.com/pytorch/torchtitan/pull/2259 (2026-01-27): every run here (Target.repeat_kv;
    # nothing to repeat in Llama 2 13B or DeepSeek-V3's MLA)
    repeat_kv: bool = True
    # the pipeline rank whose memory the source logs (None: the largest of them)
    rank: int | None = None
    pp_virtual_stages: int | None = None
    async_tp: bool = False  # torchtitan's --parallelism.enable_async_tensor_parallel
    # the pipeline's step returned the last stage's outputs, keeping every microbatch's to the
    # next step: torchtitan before github.com/pytorch/torchtitan/pull/1922 (2025-10-22), on a
    # PyTorch without step(return_outputs=False) (github.com/pytorch/pytorch/pull/165822)
    pp_return_outputs: bool = False
    # validating: found and added after the device model was built, never tuned to (the
    # claim); the rest were in view while it was built (and those marked calibrates set a
    # constant)
    validates: bool = False
    note: str = ""  # what the row's figures need said


def _load() -> tuple[dict[str, dict[str, str]], tuple[Run, ...]]:
    """The sources and the runs of ``published_runs.json``: each run names its source's key
    (``where``: the table or the line in it), its fields are :class:`Run`'s."""
    with open(DATA) as f:
        data = json.load(f)
    sources = data["sources"]
    runs = []
    for row in data["runs"]:
        fields = {k: v for k, v in row.items() if k not in ("source", "where")}
        runs.append(Run(**fields, source=sources[row["source"]]["cite"] + row.get("where", "")))
    return sources, tuple(runs)


#: each source: ``cite`` (where it is) and ``notes`` (the log lines quoted, the layout read)
SOURCES, RUNS = _load()


def _target(run: Run, **changes: object) -> object:
    from sac_compile.planning.devices import Target

    layout = dict(
        fsdp=run.fsdp,
        fsdp_reshard_after_forward=run.fsdp_reshard_after_forward,
        tp=run.tp,
        ep=run.ep,
        cp=run.cp,
        pp=run.pp,
        pp_schedule=run.pp_schedule,
        pp_virtual_stages=run.pp_virtual_stages,
        microbatch_size=run.microbatch_size,
        loss=run.loss,
        repeat_kv=run.repeat_kv,
        async_tp=run.async_tp,
        pp_return_outputs=run.pp_return_outputs,
    )
    return Target(run.device, batch=run.batch, seq=run.seq, **{**layout, **changes})


def _measured(run: Run, cache: dict) -> object:
    from sac_compile import hf
    from sac_compile.__main__ import _model

    target = _target(run, memory=1 << 60)
    key = (run.config, target.measured)  # (measured compiled: eager's too)
    if key not in cache:
        model = _model(os.path.join(CONFIGS, run.config + ".json"))
        cache[key] = hf.plan_for(model, None, device=target, include=())
        del model
        gc.collect()
    return cache[key]


def _configured(run: Run, cache: dict, device: object = None) -> tuple:
    """The run's plan and its configuration's predicted ``(peak, step)``, on ``device`` (a
    ``Device``) where given: the peak of the pipeline rank the source logs (``Run.rank``), else
    the largest."""
    from sac_compile.planning.device_plan import predict as predicted

    target = _target(run) if device is None else _target(run).replace(device=device)
    plan = dataclasses.replace(_measured(run, cache), target=target, compile=run.compile)
    keep = None if run.ac == "none" else () if run.ac == "full" else run.ac
    if run.rank is None:
        return plan, plan.configuration(keep)
    peaks, step = predicted(plan.measured, plan.params, plan.sizes, target, keep, compile=run.compile)
    return plan, (peaks[run.rank], step)


def predict(run: Run, cache: dict) -> dict:
    plan, (peak, step) = _configured(run, cache)
    gib = peak.reserved / 2**30
    published = run.published_gib * run.memory_unit / 2**30 if run.published_gib else None
    capacity = run.oom and plan.target.machine.device.memory / 2**30
    return {
        "run": run.name,
        "source": run.source,
        "float8": run.float8,
        "calibrates": run.calibrates,
        "validates": run.validates,
        "predicted_gib": gib,
        "allocated_gib": peak.bytes / 2**30,
        "published_gib": published,
        "memory_ratio": gib / published if published else None,
        "oom_predicted": gib > capacity if capacity else None,
        "phase": peak.phase,
        "breakdown_gib": {k: v / 2**30 for k, v in peak.breakdown.items() if v},
        "predicted_tps": step.tokens_per_second,
        "published_tps": run.published_tps,
        "tps_ratio": step.tokens_per_second / run.published_tps
        if run.published_tps and not run.float8
        else None,
        "step_terms": step.terms(),
        "mfu": step.mfu,
    }


def _seconds(run: Run, cache: dict, device: object = None) -> float:
    """The run's predicted step seconds, on ``device`` (a ``Device``) where given."""
    return _configured(run, cache, device)[1][1].seconds


def _solve(seconds, goal: float, lo: float, hi: float) -> float:
    """The value in ``[lo, hi]`` at which the monotone ``seconds(value)`` meets ``goal``."""
    rising = seconds(hi) > seconds(lo)
    for _ in range(60):
        mid = (lo + hi) / 2
        if (seconds(mid) < goal) == rising:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def calibrate(cache: dict) -> dict[str, float]:
    """The constants the calibrating runs set, in turn (each with the ones before it): a
    compiled run its device's ``efficiency``; an eager run on a device a compiled run set,
    ``EAGER_SLOWDOWN``; another eager run its device's ``efficiency``, over the slowdown.
    Devices whose efficiency names the same source take it too. ``planning.catalog`` is
    left as it was."""
    from sac_compile.planning import devices, step_time

    saved = dict(devices.DEVICES), step_time.EAGER_SLOWDOWN
    try:
        return _calibrate(cache, devices, step_time)
    finally:
        devices.DEVICES.update(saved[0])
        step_time.EAGER_SLOWDOWN = saved[1]


def _calibrate(cache: dict, devices, step_time) -> dict[str, float]:
    found: dict[str, float] = {}
    runs = sorted((r for r in RUNS if r.calibrates), key=lambda r: not r.compile)
    for run in runs:
        goal = run.batch * run.seq / run.published_tps / (run.tp * run.cp * run.pp)
        device = devices.DEVICES[run.device]
        if not run.compile and run.device in found:

            def slowed(s: float, r: Run = run) -> float:
                step_time.EAGER_SLOWDOWN = s
                return _seconds(r, cache)

            step_time.EAGER_SLOWDOWN = found["EAGER_SLOWDOWN"] = _solve(slowed, goal, 1.0, 3.0)
            continue

        def seconds(e: float, d=device, r: Run = run) -> float:
            return _seconds(r, cache, dataclasses.replace(d, efficiency=e))

        efficiency = found[run.device] = _solve(seconds, goal, 0.05, 2.0)
        for name, other in list(devices.DEVICES.items()):
            # the devices whose efficiency names this run's source borrow it (the H100's: the
            # H200's and MI300X's too)
            if other.efficiency_source == device.efficiency_source:
                devices.DEVICES[name] = dataclasses.replace(other, efficiency=efficiency)
    return found


def _cell(value: float | None, form: str) -> str:
    return "-" if value is None else format(value, form)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--match", default=None, help="a regular expression: the runs whose name it finds (default all)"
    )
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="first print the constants the runs marked calibrates set (planning.catalog's are the table's)",
    )
    args = parser.parse_args(argv)
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    runs = RUNS if args.match is None else tuple(r for r in RUNS if re.search(args.match, r.name))
    cache: dict = {}
    if args.calibrate:
        for name, value in calibrate(cache).items():
            print(f"  {name}: {value:.4f}", file=sys.stderr)
    rows = []
    start = time.perf_counter()
    for run in runs:
        rows.append(predict(run, cache))
        print(f"  {run.name}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    print(
        "| run | device | predicted GiB | published GiB | ratio | predicted tokens/s | published | ratio | MFU |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for run, row in zip(runs, rows):
        mark = " (float8)" if run.float8 else " (calibrates)" if run.calibrates else ""
        mark += " (validates)" if run.validates else ""
        published, ratio = _cell(row["published_gib"], ".1f"), _cell(row["memory_ratio"], ".2f")
        if run.oom:  # (an out-of-memory run: the prediction exceeds the device, or misses)
            published, ratio = "OOM", "over" if row["oom_predicted"] else "fits (miss)"
        print(
            f"| {run.name}{mark} | {run.device} | {row['predicted_gib']:.1f} | {published} | "
            f"{ratio} | {row['predicted_tps']:,.0f} | {_cell(run.published_tps, ',.0f')} | "
            f"{_cell(row['tps_ratio'], '.2f')} | {row['mfu']:.1%} |"
        )
    checked = [(run, row) for run, row in zip(runs, rows) if run.validates]
    if checked:
        memory = [r["memory_ratio"] for _, r in checked if r["memory_ratio"]]
        speed = [r["tps_ratio"] for _, r in checked if r["tps_ratio"]]
        print(
            f"\nvalidating runs ({len(checked)}, {len({run.source for run, _ in checked})} sources): memory within 12% "
            f"{sum(abs(m - 1) <= 0.12 for m in memory)} of {len(memory)} (ratios {min(memory):.2f}-{max(memory):.2f}), "
            f"tokens/s within 30% {sum(abs(t - 1) <= 0.30 for t in speed)} of {len(speed)}"
            + (f" (ratios {min(speed):.2f}-{max(speed):.2f})" if speed else "")
        )
    for run, row in zip(runs, rows):
        terms = ", ".join(f"{k} {v:.1f}" for k, v in row["breakdown_gib"].items())
        steps = ", ".join(f"{k} {v:.3f}" for k, v in row["step_terms"].items() if v)
        print(f"  {run.name}: peak in the {row['phase']}: {terms}; step s: {steps}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
