"""Peak memory and tokens/s of a whole model per checkpointing configuration, on one GPU.

The demo's MoE transformer (or a transformers Llama / Qwen3-MoE), every layer compiled with
Inductor, trained side by side from the same weights:

* PyTorch: no checkpoint, full recompute, ``activation_memory_budget`` 0.3 / 0.5;
* sac-compile: every region kept, attention kept and the feed-forward offloaded (compiled,
  and with the eager engine, whose gradients are checked against eager no checkpoint's: its
  copies run on a side stream on CUDA), and ``sac_compile.plan`` at 0.3 / 0.5 of a layer's
  no-checkpoint bytes (planned on one layer first; the planning time is printed).

Per configuration: the peak memory of one training step above the memory held before it
(``torch.cuda.max_memory_allocated``; on a CPU, which has no allocator statistics, the bytes
held for the backward once the forward returned, ``autograd_saved_bytes``), tokens/s as the
median of ``--iters`` interleaved steps, and the loss.

Then, for the transformers models, the prediction checked: whole AdamW steps (causal-LM loss,
parameters, gradients and optimizer state included) with no checkpoint, full recompute, every
region kept and ``hf.plan_for(model, memory, device=...)`` for a memory between full
recompute's and no checkpoint's predicted peaks (on a GPU also attention kept and the
feed-forward offloaded to this host's memory, compiled and with the eager engine); per configuration the predicted peak
(:class:`sac_compile.hf.StepFigures`, for the device present: ``planning.devices.present()``)
beside the measured one (``torch.cuda.max_memory_allocated`` from zero; on a CPU the
allocator's timeline, ``sac_compile._compat.profiler.allocation_peak``, plus what was live),
and the step estimate (``planning.step_time``) beside the measured median step; on a GPU also the
predicted reserved peak beside ``torch.cuda.max_memory_reserved`` (the caching allocator: its
streams' pools and an eager loss's slack modelled, other fragmentation not: printed, not
checked), and torchtitan's eager loss alone, its reserved slack beside ``planning.allocator``'s
replay. Exit 1 when a loss differs or
a predicted peak is more than ``--peak-tolerance`` off the measured one.

Sized to finish in under 5 minutes on one GPU at the defaults; ``tests/test_gpu_benchmark.py``
runs it on a CPU at a tiny size.

    python benchmarks/gpu.py [--model llama|qwen3moe|demo] [--device cuda] [--layers 8 --d 1024 --seq 2048]
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import sys
import time

import torch
from _baselines import BudgetBackend

import sac_compile as sc
from sac_compile.declare import match_path
from sac_compile.inspection.timing import interleaved_times
from sac_compile.planning import plan_model


def build(args):
    torch.manual_seed(0)
    if args.model == "demo":
        from sac_compile.testing.models import MoETransformer

        model = MoETransformer(vocab=args.vocab, d=args.d, n_layers=args.layers, heads=args.heads)
        regions, layers = MoETransformer.REGIONS, "layers.*"
    else:
        from sac_compile import hf
        from sac_compile.testing import hf_families

        builder = hf_families.tiny_llama if args.model == "llama" else hf_families.tiny_qwen3_moe
        model = builder(layers=args.layers, hidden=args.d)
        regions, layers = hf.regions_for(model), f"{hf.decoder_layers(model)}.*"
    sc.declare_regions(model, regions)
    return model.to(args.device, args.dtype).train(), layers


def logits(out):
    return getattr(out, "logits", out)


FEED_FORWARD = {"llama": "mlp", "qwen3moe": "experts", "demo": "experts"}  # (each model's region)


def configurations(args, planned):
    """name -> function wrapping a fresh model's layers (each layer compiled on its own)."""

    def compiled(backend):
        def apply(model, layers):
            for p, m in list(model.named_modules()):
                if match_path(layers, p):
                    m.compile(backend=backend)
            return model

        return apply

    def seam(keep, budget=None, policy=sc.SAVE_COSTLY, offload=(), eager=False):
        def apply(model, layers):
            options = False if eager else {"inner": args.inner}
            cfg = sc.SacConfig(
                layers=layers, keep=keep, compile=options, budget=budget, policy=policy, offload=offload
            )
            return cfg.apply(model)

        return apply

    out = {
        "no checkpoint": compiled(sc.compiler.baseline_backend(args.inner)),
        "full recompute": seam(()),
        "budget 0.3": compiled(BudgetBackend(0.3, args.inner)),
        "budget 0.5": compiled(BudgetBackend(0.5, args.inner)),
        "keep every region": seam(sc.ALL_REGIONS),
        # the feed-forward's values to the host instead of recomputed (measured; not yet planned)
        f"keep attn, offload {FEED_FORWARD[args.model]}": seam({"attn"}, offload={FEED_FORWARD[args.model]}),
        # the eager engine's copies (a side stream on CUDA: sac_compile/eager/host_copy.py)
        f"eager: keep attn, offload {FEED_FORWARD[args.model]}": seam(
            {"attn"}, offload={FEED_FORWARD[args.model]}, eager=True
        ),
    }
    for fraction, p in planned.items():
        out[f"plan {fraction:g}: {p.chosen.label}"] = seam(p.keep, p.budget, p.policy)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("llama", "qwen3moe", "demo"), default="llama")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--inner", choices=("inductor", "aot_eager"), default="inductor")
    parser.add_argument("--fractions", default="0.3,0.5", help="plan memory targets, of a layer's bytes")
    parser.add_argument("--plan-budgets", default="", help="budgets the planner tries (default: its own)")
    parser.add_argument("--peak-tolerance", type=float, default=0.10, help="predicted vs measured step peak")
    args = parser.parse_args(argv)
    gc.freeze()  # the imports, out of the collector's full collections (saved bytes are measured unfrozen)
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    cuda = args.device.startswith("cuda")
    print(
        f"gpu benchmark: {args.model}, {args.layers} layers, d {args.d}, batch {args.batch} x seq {args.seq}, "
        f"{args.dtype}, {args.device} ({torch.cuda.get_device_name() if cuda else 'no GPU'}), "
        f"torch {torch.__version__}, every layer compiled ({args.inner})"
    )
    # plan on one layer (its inputs recorded from one forward of the uncompiled model)
    model, layers = build(args)
    vocab = model.config.vocab_size if args.model != "demo" else args.vocab
    ids = torch.randint(0, vocab, (args.batch, args.seq), device=args.device)
    start = time.perf_counter()
    fractions = [float(f) for f in args.fractions.split(",") if f]
    planned = {}
    kwargs = {"use_cache": False} if args.model != "demo" else {}  # transformers: no KV cache in training
    if fractions:
        options = {}
        if args.plan_budgets:
            options["budgets"] = [None if b == "none" else float(b) for b in args.plan_budgets.split(",")]
        table = (
            plan_model(model, ids, layers=layers, memory=1.0, eager=False, **options, **kwargs).groups[0].plan
        )
        for f in fractions:
            try:
                planned[f] = table.select(f)
            except ValueError as e:  # below the least a plan can hold at this size
                print(f"plan {f:g}: {e}")
    print(f"planned {len(fractions)} target(s) in {time.perf_counter() - start:.1f} s")
    del model

    results, steps = {}, {}
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=4096):
        for name, apply in configurations(args, planned).items():
            model, layers = build(args)  # each configuration's layers compile with its own backend
            apply(model, layers)

            def step(model=model):
                model.zero_grad(set_to_none=True)
                loss = logits(model(ids, **kwargs)).float().logsumexp(-1).mean()
                loss.backward()
                if cuda:
                    torch.cuda.synchronize()
                return loss.detach()

            loss = step()  # compiles
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                step()
                peak = torch.cuda.max_memory_allocated() - before
            else:
                forward = functools.partial(
                    lambda m: logits(m(ids, **kwargs)).float().logsumexp(-1).mean(), model
                )
                peak = sc.inspection.autograd_saved_bytes(
                    forward, exclude=list(model.parameters()), warmup=False
                )
            results[name] = {"peak": peak, "loss": float(loss)}
            steps[name] = step
        times = interleaved_times(steps, args.iters)
    tokens = args.batch * args.seq
    base = results["no checkpoint"]
    head = f"{'configuration':<48} {'peak MiB' if cuda else 'held MiB':>9} {'vs none':>8} {'tokens/s':>10} {'vs none':>8} {'loss':>9}"
    print(head)
    print("-" * len(head))
    base_tps = tokens / statistics.median(times["no checkpoint"])
    problems = []
    for name, r in results.items():
        tps = tokens / statistics.median(times[name])
        print(
            f"{name:<48} {r['peak'] / 2**20:>9.1f} {r['peak'] / base['peak']:>8.2f} {tps:>10.0f} "
            f"{tps / base_tps:>8.2f} {r['loss']:>9.4f}"
        )
        if abs(r["loss"] - base["loss"]) > 1e-2 * max(1.0, abs(base["loss"])):
            problems.append(f"{name}: loss {r['loss']} differs from no checkpoint's {base['loss']}")
    problems += eager_offload_gradients(args, ids, kwargs)
    if args.model != "demo":
        problems += predicted_beside_measured(args, ids)
    if cuda:
        loss_slack_beside_measured(args)
    if problems:
        print("\n".join(problems))
        return 1
    return 0


def eager_offload_gradients(args, ids, kwargs) -> list[str]:
    """The eager engine offloading the feed-forward (its copies on a side stream on CUDA): every
    parameter's gradient beside eager no checkpoint's, from the same weights and tokens. A copy
    read before it is done would show here (garbage, not rounding)."""
    grads = []
    for offload in ((), {FEED_FORWARD[args.model]}):
        model, layers = build(args)
        if offload:
            sc.SacConfig(layers=layers, keep={"attn"}, offload=offload).apply(model)
        logits(model(ids, **kwargs)).float().logsumexp(-1).mean().backward()
        grads.append([p.grad for p in model.parameters() if p.grad is not None])
    plain, offloaded = grads
    same = sum(torch.equal(a, b) for a, b in zip(plain, offloaded, strict=True))
    worst = max(float((a.float() - b.float()).abs().max()) for a, b in zip(plain, offloaded, strict=True))
    scale = max(float(a.float().abs().max()) for a in plain)
    print(
        f"eager offload gradients: {same}/{len(plain)} bit-identical to eager no checkpoint's, "
        f"max |diff| {worst:.3g} (largest gradient {scale:.3g})"
    )
    if not worst <= 1e-2 * scale:  # (NaN fails too)
        return [f"eager offload: gradients differ from no checkpoint's by {worst:.3g} (largest {scale:.3g})"]
    return []


def predicted_beside_measured(args, ids) -> list[str]:
    """Whole AdamW steps: the predicted peak and step time beside the measured ones."""
    from sac_compile import hf
    from sac_compile._compat.profiler import allocation_peak
    from sac_compile.planning.devices import Target, present

    cuda = args.device.startswith("cuda")
    dtype = args.dtype
    # on a GPU the plan may offload to this host's memory (its share a GPU; a CPU's host is
    # the device: no offload there)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(torch.cuda.device_count(), 1)
    target = Target(
        present() if cuda else "cpu",
        batch=args.batch,
        seq=args.seq,
        param_dtype=dtype,
        master_dtype=dtype,  # the model is trained in its dtype: no float32 master copy
        reduce_dtype=dtype,
        offload=cuda,
        host_memory=host if cuda else None,
    )
    start = time.perf_counter()
    figures = hf.step_figures(build(args)[0], target, inputs={"input_ids": ids})
    none, full = figures.peak(None, compile=True).reserved, figures.peak((), compile=True).reserved
    # halfway between the two, plus the headroom a plan keeps free (a plan fits on reserved)
    memory = int((none + full) / 2 / (1 - target.machine.headroom))
    plan = hf.plan_for(build(args)[0], memory, device=target, inputs={"input_ids": ids})
    print(
        f"\nwhole AdamW steps on {target.machine.device.name}: predicted (measured {time.perf_counter() - start:.1f} s, "
        f"one layer of each kind) beside measured; plan for {memory / 2**20:.1f} MiB: {'; '.join(g.plan.chosen.label for g in plan.groups)}"
    )
    rows = {
        "no checkpoint": (None, figures.peak(None, compile=True), figures.seconds(None)),
        "full recompute": ((), figures.peak((), compile=True), figures.seconds(())),
        "keep every region": (
            sc.ALL_REGIONS,
            figures.peak(sc.ALL_REGIONS, compile=True),
            figures.seconds(sc.ALL_REGIONS),
        ),
        "plan_for(memory)": (plan, plan.peak, plan.step_seconds),
    }
    if cuda:  # offloading the feed-forward, kept attention: the copies on PyTorch's side stream
        ff = {FEED_FORWARD[args.model]}
        offloaded = figures.peak({"attn"}, compile=True, offload=ff)
        rows[f"keep attn, offload {FEED_FORWARD[args.model]}"] = (
            ("offload", ff),
            offloaded,
            figures.seconds({"attn"}, offload=ff),
        )
        # the eager engine's copies on its side stream (sac_compile/eager/host_copy.py)
        rows[f"eager: keep attn, offload {FEED_FORWARD[args.model]}"] = (
            ("offload eagerly", ff),
            figures.peak({"attn"}, compile=False, offload=ff),
            figures.seconds({"attn"}, compile=False, offload=ff),
        )
    steps, measured = {}, {}
    reserved: dict[str, int] = {}  # the allocator's reserved peak (a GPU only)
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=4096):
        for name, (keep, _, _) in rows.items():
            model, layers = build(args)
            options = {"inner": args.inner}
            if keep is None:
                configurations(args, {})["no checkpoint"](model, layers)
            elif hasattr(keep, "apply"):
                keep.apply(model, compile=options)
            elif isinstance(keep, tuple) and keep[:1] in (("offload",), ("offload eagerly",)):
                eager = keep[0] == "offload eagerly"
                sc.SacConfig(
                    layers=layers, keep={"attn"}, offload=keep[1], compile=False if eager else options
                ).apply(model)
            else:
                sc.SacConfig(layers=layers, keep=keep, compile=options).apply(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=cuda)

            def step(model=model, opt=opt):
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if cuda:
                    torch.cuda.synchronize()

            step()  # compiles, makes the optimizer state
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                step()
                measured[name] = torch.cuda.max_memory_allocated() - ids.untyped_storage().nbytes()
                reserved[name] = torch.cuda.max_memory_reserved()
            else:
                state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
                before = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *state])
                measured[name] = before + allocation_peak(step)
            steps[name] = step
            del model, opt
            gc.collect()
        times = interleaved_times(steps, args.iters)
    head = f"{'configuration':<32} {'predicted MiB':>14} {'measured MiB':>13} {'ratio':>6}  {'peak in':<22} {'est. s':>8} {'step s':>8}"
    head += f" {'pred. reserved':>15} {'reserved MiB':>13}"  # (the caching allocator's, a GPU's only)
    print(head)
    print("-" * len(head))
    problems = []
    for name, (_, peak, seconds) in rows.items():
        ratio = peak.bytes / measured[name]
        print(
            f"{name:<32} {peak.bytes / 2**20:>14.1f} {measured[name] / 2**20:>13.1f} {ratio:>6.3f}  {peak.phase:<22} "
            f"{seconds:>8.4f} {statistics.median(times[name]):>8.4f} {peak.reserved / 2**20:>15.1f} "
            f"{f'{reserved[name] / 2**20:.1f}' if name in reserved else '-':>13}"
        )
        if abs(ratio - 1) > args.peak_tolerance:
            problems.append(
                f"{name}: predicted peak {peak.bytes} B is {ratio:.3f}x the measured {measured[name]} B"
            )
    print(
        "est. s: sac_compile.planning.step_time (the roofline at the device's efficiency from a published run; "
        "the CPU's is its own measured rates, efficiency 1)"
    )
    return problems


def loss_slack_beside_measured(args) -> None:
    """torchtitan's eager loss alone (``cross_entropy(pred.flatten(0, 1).float(), ...)``,
    ``del pred``, backward) at ``--batch`` x ``--seq`` x ``--vocab``: what the allocator
    reserved beyond the allocated peak beside ``planning.allocator``'s replay of that loss
    (printed, not checked). The replay leaves the same hole with expandable segments
    (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, as torchtitan runs) and without
    (the freed logits' segment too small for a float32 gradient)."""
    from sac_compile.planning.allocator import loss_slack

    b, s, v, h = args.batch, args.seq, args.vocab, args.d
    hidden = torch.randn(b, s, h, device=args.device, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(v, h, device=args.device, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, v, (b, s), device=args.device)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    pred = hidden @ weight.t()
    loss = torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
    del pred
    loss.backward()
    torch.cuda.synchronize()
    measured = (torch.cuda.max_memory_reserved() - reserved) - (torch.cuda.max_memory_allocated() - allocated)
    predicted = loss_slack("torchtitan", b * s * v * 4, b * s * v * 2, 1)
    print(
        f"torchtitan's eager loss, {b} x {s} x {v}: reserved beyond the allocated peak {measured / 2**20:.1f} MiB "
        f"measured (with a few MiB of small blocks' segments), {predicted / 2**20:.1f} MiB predicted "
        f"(planning.allocator); PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r}"
    )


if __name__ == "__main__":
    sys.exit(main())
