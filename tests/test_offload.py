"""offload=: a region's saved values sent to host memory in the forward and brought back for
the backward, compiled (through PyTorch's partitioner offload pass). On this CPU the copies
are host to host: the tests check the graphs (offload and reload on exactly the region's
saved values), the reports and the gradients; the eager engine copies its cache to the host."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

import sac_compile as sc
from sac_compile.testing.models import Block

from .models import meta_llama

X_SHAPE = (2, 8, 16)


def _block() -> Block:
    torch.manual_seed(0)
    return Block(d=16)


def _report(keep, offload=(), inner="aot_eager"):
    x = torch.randn(*X_SHAPE, generator=torch.Generator().manual_seed(1), requires_grad=True)
    block = _block()
    backend = sc.make_sac_backend(keep, offload=offload, inner=inner)
    report = sc.inspection.capture_partition(block, x, backend=backend)
    return report, block, x


def _mlp_values(report) -> dict[str, int]:
    return {v.name: v.nbytes for v in report.saved if v.region == "mlp"}


@pytest.mark.parametrize("inner", ["aot_eager", pytest.param("inductor", marks=pytest.mark.extended)])
def test_an_offloaded_regions_saved_values_go_to_the_host_and_none_stay_on_the_device(inner):
    """keep={"attn"}, offload={"mlp"}: the mlp's saved values are the ones keeping it would
    save, every one of them offloaded (a ``device_put`` to the CPU in the forward graph, named
    after the value), none held on the device; attention's stay on the device; gradients equal
    no checkpoint's."""
    kept, _, _ = _report({"attn", "mlp"}, inner=inner)
    offloaded, block, x = _report({"attn"}, offload={"mlp"}, inner=inner)
    wanted = _mlp_values(kept)
    assert wanted and sum(wanted.values()) > 0
    assert _mlp_values(offloaded) == wanted  # the same values, moved
    assert all(v.offloaded for v in offloaded.saved if v.region == "mlp")
    assert not any(v.offloaded for v in offloaded.saved if v.region != "mlp")
    assert offloaded.offloaded_bytes_by_region() == {"mlp": sum(wanted.values())}
    assert "mlp" not in offloaded.bytes_by_region()
    assert offloaded.bytes_by_region()["attn"] == kept.bytes_by_region()["attn"]
    assert offloaded.activation_bytes == kept.activation_bytes - sum(wanted.values())
    (graph,) = offloaded.graphs
    assert graph.record.node_offload >= set(wanted)
    assert (
        "mlp(offloaded)" in offloaded.format()
        and f"{sum(wanted.values())} B more on the host" in offloaded.format()
    )
    # gradients: the compiled, offloaded block against the plain block in eager
    plain = copy.deepcopy(_block())
    x2 = x.detach().clone().requires_grad_()
    plain(x2).sum().backward()
    for (name, p), q in zip(block.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    torch.testing.assert_close(x.grad, x2.grad)


def test_a_wrapped_layers_offload_reaches_an_outer_compile_through_its_scope_markers():
    """apply_selective_checkpointing(offload=) without compile=: the scope markers carry the
    offload set to the outer compile's pass (the Trainer's and transformers' layouts)."""
    block = sc.apply_selective_checkpointing(_block(), keep={"attn"}, offload={"mlp"})
    x = torch.randn(*X_SHAPE, requires_grad=True)
    report = sc.inspection.capture_partition(block, x, backend=sc.make_sac_backend(inner="aot_eager"))
    assert set(report.offloaded_bytes_by_region()) == {"mlp"}
    assert "mlp" not in report.bytes_by_region()
    assert "keep=attn offload=mlp" in report.format()


def test_offload_through_hf_config_for_on_a_transformers_model():
    """hf.config_for(model, keep={"attn"}, offload={"mlp"}) on a tiny Llama (default config,
    training mode) under an outer compile: every layer's mlp values offloaded, none held."""
    from sac_compile import hf
    from sac_compile.testing.hf_families import tiny_llama

    model = tiny_llama(layers=2).train()
    hf.config_for(model, keep={"attn"}, offload={"mlp"}).apply(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))

    def step(ids):
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    report = sc.inspection.capture_partition(step, ids, backend=sc.make_sac_backend(inner="aot_eager"))
    offloaded = report.offloaded_bytes_by_region()
    assert set(offloaded) == {"mlp"} and offloaded["mlp"] > 0
    assert "mlp" not in report.bytes_by_region() and report.bytes_by_region().get("attn", 0) > 0
    assert sum(1 for g in report.graphs for s in g.record.scopes if s.offload == {"mlp"}) == 2


def test_offload_is_checked_at_every_entry_point():
    """A region both kept and offloaded, and offload= as a string, are clear errors before any
    work (red before: offload= was an unknown argument)."""
    both = r"both name \['attn'\]: a region's values are kept on the device or offloaded"
    with pytest.raises(ValueError, match=both):
        sc.apply_selective_checkpointing(_block(), keep={"attn"}, offload={"attn"})
    with pytest.raises(ValueError, match=both):
        sc.make_sac_backend({"attn"}, offload={"attn"})
    with pytest.raises(ValueError, match=both):
        sc.region_context_fn({"attn"}, offload={"attn"})
    with pytest.raises(ValueError, match=both):
        sc.SacConfig(layers="layers.*", keep=(), stack_keep={"layers.*": {"attn"}}, offload={"attn"})
    with pytest.raises(ValueError, match=r"keep=ALL_REGIONS and offload=\['mlp'\]"):
        sc.make_sac_backend(sc.ALL_REGIONS, offload={"mlp"})
    with pytest.raises(TypeError, match=r"offload must be a collection of region names, got 'mlp'"):
        sc.make_sac_backend({"attn"}, offload="mlp")


def test_the_eager_engine_offloads_an_offloaded_regions_cached_values():
    """Eager, keep={"attn"}, offload={"mlp"}: the values the engine caches for the mlp (the
    ones keeping it caches) are held on the host, none on the device; gradients bit-identical
    to no checkpoint's; through the seam too (red before: the engine refused offload=)."""
    from sac_compile.eager import checkpoint_with_regions

    def run(**actions):
        block = _block()
        x = torch.randn(*X_SHAPE, generator=torch.Generator().manual_seed(1), requires_grad=True)
        stats: list = []
        checkpoint_with_regions(block, x, stats_out=stats, **actions).sum().backward()
        return stats[0], [p.grad for p in block.parameters()] + [x.grad]

    kept, _ = run(keep={"attn", "mlp"})
    offloaded, grads = run(keep={"attn"}, offload={"mlp"})
    assert kept.held_by_region["mlp"] > 0
    assert dict(offloaded.offloaded_by_region) == {"mlp": kept.held_by_region["mlp"]}
    assert "mlp" not in offloaded.held_by_region
    assert offloaded.held_by_region["attn"] == kept.held_by_region["attn"]
    block = _block()
    x = torch.randn(*X_SHAPE, generator=torch.Generator().manual_seed(1), requires_grad=True)
    block(x).sum().backward()
    for got, want in zip(grads, [p.grad for p in block.parameters()] + [x.grad], strict=True):
        assert torch.equal(got, want)
    seam = sc.apply_selective_checkpointing(_block(), keep={"attn"}, offload={"mlp"})
    x.grad = None
    seam(x).sum().backward()
    assert torch.equal(x.grad, grads[-1])


def test_autograd_saved_bytes_counts_one_device_when_asked():
    """``device=``: only the storages on that device (a CPU's host and device are one: all of
    them on "cpu", none on "cuda")."""
    from sac_compile.inspection import autograd_saved_bytes

    block = sc.apply_selective_checkpointing(_block(), keep={"attn"}, offload={"mlp"})
    x = torch.randn(*X_SHAPE, requires_grad=True)
    params = list(block.parameters())
    every = autograd_saved_bytes(block, x, exclude=params)
    assert every > 0
    assert autograd_saved_bytes(block, x, exclude=params, device="cpu", warmup=False) == every
    assert autograd_saved_bytes(block, x, exclude=params, device="cuda", warmup=False) == 0


# --- the planner: keep, offload or recompute, per region -------------------------------


def _offload_table():
    x = torch.randn(*X_SHAPE, generator=torch.Generator().manual_seed(1), requires_grad=True)
    return x, sc.plan(_block(), x, memory=1.0, budgets=(None,), offload=True)


def test_plan_measures_every_keep_and_offload_pair_as_a_real_compile_and_the_eager_engine_hold_it():
    """plan(offload=True) measures keep A, offload B - A for every two nested keep sets:
    every disjoint pair over the block's two regions. Each offloading candidate's figures are
    what that configuration's own compile saves on the device and sends to the host, and
    (eager) what the engine holds on the device and copies to the host; its copies, read off
    the partitioned graphs, move exactly what it offloads."""
    from sac_compile.eager import checkpoint_with_regions
    from sac_compile.inspection import autograd_saved_bytes

    x, table = _offload_table()
    pairs = {(c.keep, c.offload) for c in table.candidates if c.offload}
    f = frozenset
    want = {(f(), f({"attn"})), (f(), f({"mlp"})), (f(), f({"attn", "mlp"}))}
    want |= {(f({"attn"}), f({"mlp"})), (f({"mlp"}), f({"attn"}))}
    assert pairs == want
    plain = sc.plan(_block(), x, memory=1.0, budgets=(None,), eager=False)
    assert not any(c.offload for c in plain.candidates)  # offload=False: as before
    c = next(c for c in table.candidates if c.keep == {"attn"} and c.offload == {"mlp"})
    report, _, _ = _report({"attn"}, offload={"mlp"})
    assert c.saved_bytes == report.activation_bytes + report.input_bytes
    assert c.offloaded_bytes == report.offloaded_bytes > 0
    assert sum(b for g in c.copies for b, _, _ in g.forward) == c.offloaded_bytes
    assert sum(b for g in c.copies for b, _, _ in g.backward) == c.offloaded_bytes
    # the mlp's values are made mid-forward (down_proj runs after) and used first in the backward
    ((_, after, _),) = c.copies[0].forward
    assert after > 0
    # eager: what the engine holds on the device and what it copies to the host
    block = _block()
    stats: list = []

    def run(t):
        return checkpoint_with_regions(block, t, keep={"attn"}, offload={"mlp"}, stats_out=stats)

    held = autograd_saved_bytes(run, x, exclude=list(block.parameters()))
    assert c.eager_offloaded_bytes == stats[-1].offloaded_bytes > 0
    assert c.eager_bytes == held - stats[-1].offloaded_bytes  # (on a CPU the host is the device)


def test_a_plan_allowed_to_offload_never_recomputes_more_at_any_memory():
    """For every memory between the least reachable and the no-checkpoint bytes: the plan
    with offloading candidates recomputes no more than without them, offloads only where that
    saves recompute, and at some memory recomputes strictly less."""
    _, table = _offload_table()
    plain = dataclasses.replace(table, candidates=tuple(c for c in table.candidates if not c.offload))
    least = min(c.saved_bytes for c in plain.candidates)
    better = 0
    for memory in range(
        least, table.no_checkpoint_bytes + 1, max((table.no_checkpoint_bytes - least) // 40, 1)
    ):
        with_offload, without = table.select(memory), plain.select(memory)
        assert with_offload.recompute_flops <= without.recompute_flops, memory
        if with_offload.chosen.offload:
            assert with_offload.recompute_flops < without.recompute_flops, memory
        better += with_offload.recompute_flops < without.recompute_flops
    assert better > 0


def _offload_target(**more):
    from sac_compile.planning.devices import Target

    return Target("h100-80gb", batch=1, seq=4096, offload=True, host_memory="1TB", host_link="c2c", **more)


@pytest.fixture(scope="module")
def device_plan():
    """The meta Llama planned for an H100 that may offload to host memory over NVLink-C2C,
    measured once."""
    pytest.importorskip("transformers")
    from sac_compile import hf

    return hf.plan_for(meta_llama(), None, device=_offload_target(), budgets=(None,))


@pytest.mark.slow
def test_step_figures_predict_a_configuration_that_offloads():
    """``StepFigures.peak`` / ``.step`` with ``offload=``: keep attn, offload mlp holds less
    on the device than keeping both and copies what it offloads; unmeasured (a target that
    does not offload) is a clear error."""
    pytest.importorskip("transformers")
    from sac_compile import hf

    figures = hf.step_figures(meta_llama(), _offload_target())
    both = figures.peak({"attn", "mlp"}, compile=True)
    moved = figures.peak({"attn"}, compile=True, offload={"mlp"})
    assert moved.breakdown["activations"] < both.breakdown["activations"]
    step = figures.step({"attn"}, offload={"mlp"})
    assert step.transfer > 0 and figures.step({"attn", "mlp"}).transfer == 0
    with pytest.raises(ValueError, match=r"\['nope'\]: no layer has such a region"):
        figures.peak({"attn"}, offload={"nope"})
    plain = hf.step_figures(
        meta_llama(), _offload_target().replace(offload=False, host_memory=None, host_link=None)
    )
    with pytest.raises(ValueError, match=r"keep=\['attn'\], offload=\['mlp'\], budget=None was not measured"):
        plain.peak({"attn"}, offload={"mlp"})


def _choose(plan, compile=True, **target):
    from sac_compile.planning.device_plan import choose

    try:
        return choose(
            plan.measured,
            plan.params,
            plan.sizes,
            plan.target.replace(**target),
            compile=compile,
            layers=plan.layers,
        )
    except ValueError:
        return None


def _memories(plan):
    """Device memories from below full recompute's reserved peak to above no checkpoint's."""
    full = _choose(plan, memory=1 << 50, offload=False, host_memory=None, host_link=None)
    low, high = int(full.reserved_bytes * 0.8), int(full.reserved_bytes * 1.2)
    return [int(m / 0.95) for m in range(low, high, (high - low) // 60)]


@pytest.mark.slow
def test_a_device_plan_allowed_to_offload_recomputes_no_more_and_is_no_slower(device_plan):
    """At every device memory: the plan that may offload recomputes no more and predicts no
    slower a step than the plan that may not; where it offloads, it recomputes strictly less,
    its offloaded values fit host memory, and the copies are in the step (a term, and every
    copy's seconds)."""
    offloaded = 0
    for memory in _memories(device_plan):
        moved, plain = (
            _choose(device_plan, memory=memory),
            _choose(device_plan, memory=memory, offload=False, host_memory=None, host_link=None),
        )
        if plain is None:
            continue
        assert moved is not None and moved.fits, memory
        assert moved.recompute_flops <= plain.recompute_flops and moved.step_seconds <= plain.step_seconds
        if any(g.plan.chosen.offload for g in moved.groups):
            offloaded += 1
            assert moved.recompute_flops < plain.recompute_flops, memory
            assert 0 < moved.host_bytes <= moved.target.machine.host_memory
            assert moved.step.transfer > 0 and moved.transfer_seconds == moved.step.transfer
            assert "offload" in moved.step.terms() and "offloaded:" in moved.format()
            per_layer = sum(g.plan.chosen.offloaded_bytes * len(g.paths) for g in moved.groups)
            assert moved.host_bytes == per_layer  # (one microbatch, no tp: every layer's values)
        else:
            assert moved.host_bytes == 0
    assert offloaded > 0


@pytest.mark.slow
def test_more_device_memory_never_makes_the_offloading_plan_recompute_more(device_plan):
    """The walk's first fitting point comes no later on the frontier with more memory: on
    every link, compiled and eager, a plan allowed to offload recomputes no more at a larger
    device memory than at a smaller one (where both fit)."""
    for compile in (True, False):
        for link in ("c2c", "pcie5", "pcie4"):
            flops = [
                None if p is None else p.recompute_flops
                for p in (
                    _choose(device_plan, compile, memory=m, host_link=link) for m in _memories(device_plan)
                )
            ]
            fitting = [f for f in flops if f is not None]
            assert fitting == sorted(fitting, reverse=True), (compile, link, flops)


@pytest.mark.slow
def test_an_offloading_point_whose_step_is_slower_gives_way_to_one_that_is_not():
    """Red before: Llama-3-70B at real size (meta device), FSDP 32, batch 1 x 8192, eager,
    PCIe 4, 76 GiB: the offloading walk's first fitting point (keep {}, offload mlp) predicted
    a slower step than full recompute (the step is bound by FSDP's gathers, which hide the
    recompute it saves but not its copies), and the plan fell back to recomputing everything
    (902 TFLOP a step), though offloading attention recomputes 616 at a step no slower. Now
    the slower point's offloading candidates are left out and the walk runs again."""
    pytest.importorskip("transformers")
    from sac_compile import hf
    from sac_compile.__main__ import _model
    from sac_compile.planning.devices import Target

    target = Target(
        "h100-80gb",
        memory="76GiB",
        fsdp=32,
        batch=1,
        seq=8192,
        loss="chunked",
        offload=True,
        host_memory="1TB",
        host_link="pcie4",
    )
    config = Path(__file__).resolve().parents[1] / "examples" / "configs" / "llama3_70b.json"
    measured = hf.plan_for(_model(str(config)), None, device=target.replace(memory=1 << 60), budgets=(None,))
    moved = _choose(measured, False, memory=target.machine.memory)
    plain = _choose(
        measured, False, memory=target.machine.memory, offload=False, host_memory=None, host_link=None
    )
    assert moved.groups[0].plan.chosen.offload, moved.format()
    assert moved.recompute_flops < plain.recompute_flops and moved.step_seconds <= plain.step_seconds


@pytest.mark.slow
def test_the_host_link_and_host_memory_decide_what_is_offloaded(device_plan):
    """A slower link exposes more of the copies, so offloads no more than a faster one (it
    recomputes at least as much); host memory smaller than what a plan would offload rules it
    out; a plan never offloads beyond its host memory."""
    from sac_compile.planning.host import HOST_LINKS

    assert HOST_LINKS["pcie4"].bandwidth < HOST_LINKS["pcie5"].bandwidth < HOST_LINKS["c2c"].bandwidth
    slower_recomputes_more = 0
    for memory in _memories(device_plan):
        by_link = {
            link: _choose(device_plan, memory=memory, host_link=link) for link in ("c2c", "pcie5", "pcie4")
        }
        if None in by_link.values():
            continue
        flops = [p.recompute_flops for p in by_link.values()]
        assert flops == sorted(flops), (memory, flops)
        slower_recomputes_more += flops[0] < flops[-1]
        c2c = by_link["c2c"]
        if c2c.host_bytes:
            tight = _choose(device_plan, memory=memory, host_memory=c2c.host_bytes - 1)
            assert tight is None or tight.host_bytes < c2c.host_bytes
    assert slower_recomputes_more > 0


def test_the_copies_hide_behind_the_compute_around_them_in_their_own_graph():
    """``transfer``: a copy to the host starts after its value's last forward use and is
    hidden by the forward compute after it; a copy back is awaited at the value's first
    backward use; eager, a copy to the host hides behind the next layer's forward, a copy back
    behind the previous layer's backward."""
    from sac_compile.actions import Actions
    from sac_compile.planning.candidates import Candidate, Copies
    from sac_compile.planning.devices import Target
    from sac_compile.planning.host import HOST_EFFICIENCY
    from sac_compile.planning.offload import transfer

    target = Target("h100-80gb", offload=True, host_memory="1TB", host_link="pcie5")
    d = target.machine.device
    one = 63e9 * HOST_EFFICIENCY  # bytes/s one way
    nbytes = 10**8
    copy_s = nbytes / one
    second = int(d.bf16_flops * d.efficiency)  # a second of compute, in FLOPs

    def c(forward, backward):
        actions = Actions(frozenset(), offload=frozenset({"mlp"}))
        return Candidate(actions, 0, 0, offloaded_bytes=nbytes, copies=(Copies(forward, backward),))

    # nothing after it in the forward, its first use at the backward's start: all exposed
    assert transfer(c(((nbytes, 0, 0),), ((nbytes, 0, 0),)), target, True) == pytest.approx(
        (2 * copy_s, 2 * copy_s)
    )
    # a second of compute around each: hidden
    hidden = c(((nbytes, second, 0),), ((nbytes, second, 0),))
    assert transfer(hidden, target, True) == pytest.approx((2 * copy_s, 0.0))
    # half the copy's time after it in the forward: half of it exposed
    half = c(((nbytes, int(second * copy_s / 2), 0),), ((nbytes, second, 0),))
    assert transfer(half, target, True)[1] == pytest.approx(copy_s / 2, rel=1e-3)
    # two copies queue on one stream: the second waits for the first
    two = c(((nbytes // 2, second, 0), (nbytes // 2, 0, 0)), ())
    assert transfer(two, target, True)[1] == pytest.approx(copy_s / 2, rel=1e-3)
    # eager: the copies to the host hide behind the next layer's forward...
    assert transfer(hidden, target, False) == pytest.approx((2 * copy_s, 2 * copy_s))
    assert transfer(hidden, target, False, 1.0) == pytest.approx((2 * copy_s, copy_s))
    assert transfer(hidden, target, False, copy_s / 2) == pytest.approx((2 * copy_s, 1.5 * copy_s))
    # ... and behind the backward of the layer after it, the copies back
    assert transfer(hidden, target, False, 1.0, 1.0) == pytest.approx((2 * copy_s, 0.0))
    assert transfer(hidden, target, False, 1.0, copy_s / 4) == pytest.approx((2 * copy_s, 0.75 * copy_s))


@pytest.mark.slow
def test_the_plan_command_reports_what_it_offloads_and_refuses_offload_flags_alone(tmp_path, device_plan):
    """The command's JSON names each group's offloaded regions and bytes, the host bytes and
    the copies' seconds; ``--host-memory`` / ``--link`` without ``--offload``, ``--offload``
    without host memory and an unknown link are refused before any work."""
    import json

    from sac_compile.__main__ import main
    from sac_compile.plan_report import report as plan_report

    memory = next(m for m in _memories(device_plan) if (p := _choose(device_plan, memory=m)) and p.host_bytes)
    plan = _choose(device_plan, memory=memory)
    report = json.loads(json.dumps(plan_report(plan, 1.0)))
    (group,) = report["groups"]
    assert group["offload"] == sorted(plan.groups[0].plan.chosen.offload) != []
    assert group["offload_bytes"] == plan.groups[0].plan.chosen.offloaded_bytes > 0
    assert report["offload_bytes"] == plan.host_bytes == group["count"] * group["offload_bytes"]
    assert report["transfer_seconds"] == plan.step.transfer > 0 and "offload" in report["step_terms"]
    assert report["host_link"] == "c2c" and report["host_memory"] == 10**12
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}))
    base = ["plan", str(path), "--seq", "64", "--device", "h100-80gb"]
    with pytest.raises(SystemExit, match=r"--host-memory 1TB does nothing without --offload"):
        main([*base, "--host-memory", "1TB"])
    with pytest.raises(SystemExit, match=r"--link c2c does nothing without --offload"):
        main([*base, "--link", "c2c"])
    with pytest.raises(SystemExit, match=r"--offload needs --host-memory"):
        main([*base, "--offload"])
    with pytest.raises(SystemExit, match=r"host_link='nvlink'\): one of pcie4, pcie5, c2c"):
        main([*base, "--offload", "--host-memory", "1TB", "--link", "nvlink"])
    with pytest.raises(SystemExit, match=r"memory='lots'"):
        main([*base, "--offload", "--host-memory", "lots"])


def test_a_model_plan_that_offloads_applies_its_offload_set():
    """plan_model(offload=True) on a model whose forward takes no extra keyword (red before:
    ``offload`` went to the model's forward as an example keyword argument); the plan's
    offload set reaches every layer it applies to."""
    from sac_compile.planning import plan_model
    from sac_compile.testing.models import Stack

    torch.manual_seed(0)
    model = Stack(n=2)
    x = torch.randn(*X_SHAPE, requires_grad=True)
    mp = plan_model(model, x, layers="layers.*", memory=0.3, budgets=(None,), eager=False, offload=True)
    (group,) = mp.groups
    assert group.plan.chosen.offload and group.plan.chosen.offloaded_bytes > 0
    mp.apply(model)
    report = sc.inspection.capture_partition(model, x, backend=sc.make_sac_backend(inner="aot_eager"))
    assert set(report.offloaded_bytes_by_region()) == set(group.plan.chosen.offload)
    assert report.offloaded_bytes == 2 * group.plan.chosen.offloaded_bytes


def test_with_cuda_inputs_a_copy_starts_where_pytorchs_pass_issues_it():
    """PyTorch's pass with CUDA inputs issues the copy at ``async_cpu_offload_<value>`` and
    awaits it at ``cpu_offload_<value>``, sunk to the graph's end (its
    ``offload_activation_fw_async`` / ``activation_offload_sink_wait_async``): the compute
    after the issue hides it, not the nothing after the wait. (A graph written by hand: the
    pass needs CUDA to run.)"""
    import torch.fx as fx

    from sac_compile.planning.offload import graph_copies

    aten = torch.ops.aten
    a = torch.randn(64, 64)

    def graph(async_: bool) -> fx.GraphModule:
        g = fx.Graph()
        x = g.placeholder("x")
        x.meta["val"] = a
        first = g.call_function(aten.mm.default, (x, x))
        first.meta["val"] = a
        nodes = [g.call_function(aten.clone.default, (first,), name="async_cpu_offload_mm")] if async_ else []
        second = g.call_function(aten.mm.default, (first, x))
        second.meta["val"] = a
        nodes.append(g.call_function(aten.clone.default, (first,), name="cpu_offload_mm"))
        for n in nodes:
            n.meta["val"] = a
        g.output((second, nodes[-1]))
        return fx.GraphModule(torch.nn.Module(), g)

    bw = fx.GraphModule(torch.nn.Module(), fx.Graph())
    (issued,) = graph_copies(graph(True), bw).forward
    assert issued[:2] == (a.nbytes, 2 * 64**3)  # the second matmul runs after the copy is issued
    (waited,) = graph_copies(graph(False), bw).forward
    assert waited == (a.nbytes, 0, 0)  # (synchronous: the copy where the pass puts it)


class _StreamLike:
    """A device's copies as a side stream runs them (``host_copy.DeviceCopies``): each copy is
    queued and runs only when something waits for it, in issue order; until then its
    destination holds garbage (NaN). A value served before its copy is awaited is wrong."""

    def __init__(self) -> None:
        self.queue: list = []
        self.done = 0
        self.offloaded: int | None = None
        self.log: list[str] = []

    @staticmethod
    def _garbage(t: torch.Tensor) -> torch.Tensor:
        return torch.full_like(t, float("nan") if t.is_floating_point() else -1)

    def _run(self, upto: int) -> None:
        while self.done < upto:
            self.queue[self.done]()
            self.done += 1

    def begin_offload(self) -> None:
        if self.offloaded is not None:
            self._run(self.offloaded)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        host = self._garbage(t)
        self.queue.append(lambda: host.copy_(t))  # (holds t, as record_stream keeps its memory)
        return host

    def fence(self) -> None:
        self._run(len(self.queue))

    def end_offload(self) -> None:
        self.offloaded = len(self.queue)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        self.log.append("back")
        dev = self._garbage(host)
        self.queue.append(lambda: dev.copy_(host))
        return dev

    def mark(self) -> int:
        return len(self.queue)

    def wait(self, token: int) -> None:
        self.log.append("wait")
        self._run(token)


def _blocks():
    torch.manual_seed(0)
    return [Block(d=16) for _ in range(3)]


def _engine_forward(policy):
    """The eager engine's forward over one block, keep attn, offload mlp under ``policy``:
    ``(its state, the block, the output)``."""
    from torch.utils.checkpoint import checkpoint

    from sac_compile.actions import Actions
    from sac_compile.eager import engine_contexts

    block = _block()
    x = torch.randn(*X_SHAPE, generator=torch.Generator().manual_seed(1), requires_grad=True)
    state, forward, recompute = engine_contexts(Actions.of({"attn"}, policy, offload={"mlp"}))
    return state, block, checkpoint(block, x, use_reentrant=False, context_fn=lambda: (forward, recompute))


def _assert_plain_grads(block) -> None:
    """``block``'s gradients after :func:`_engine_forward`'s backward are bit-identical to the
    same block's without a checkpoint, on the same input."""
    want = _block()
    x = torch.randn(*X_SHAPE, generator=torch.Generator().manual_seed(1), requires_grad=True)
    want(x).sum().backward()
    for got, expected in zip(block.parameters(), want.parameters(), strict=True):
        assert torch.equal(got.grad, expected.grad)


def test_the_eager_engines_copies_run_as_a_side_stream_runs_them(monkeypatch):
    """The eager engine against a stream that runs each copy only when awaited (``_StreamLike``,
    what CUDA's side stream allows): a layer's copies to the host start at its forward's end and
    the next layer's waits for them (one layer's in flight); a layer's copies back all start
    as the layer after it starts its recompute and each is awaited where it is served:
    gradients bit-identical to no checkpoint's (NaN where a value is read before its copy is
    done)."""
    from sac_compile.eager import checkpoint_with_regions, host_copy

    stream = _StreamLike()
    monkeypatch.setattr(host_copy, "copies_for", lambda device: stream)

    x = torch.randn(*X_SHAPE, generator=torch.Generator().manual_seed(1), requires_grad=True)
    layers, h, stats = _blocks(), x, []
    for layer in layers:
        h = checkpoint_with_regions(layer, h, keep={"mlp"}, offload={"attn"}, stats_out=stats)
    per_layer = len(stream.queue) // 3
    assert per_layer > 1 and [s.offloaded_by_region["attn"] > 0 for s in stats] == [True] * 3
    assert len(stream.queue) - stream.done == per_layer  # the last layer's copies in flight only
    h.sum().backward()
    # each layer's copies back start as the layer after it starts its recompute (the last
    # layer's with its own), and are awaited where its recompute serves them
    k = per_layer
    assert stream.log == ["back"] * 2 * k + ["wait"] * k + ["back"] * k + ["wait"] * 2 * k
    grads = [p.grad for layer in layers for p in layer.parameters()] + [x.grad]
    plain, y = _blocks(), x.detach().clone().requires_grad_(True)
    h = y
    for layer in plain:
        h = layer(h)
    h.sum().backward()
    want = [p.grad for layer in plain for p in layer.parameters()] + [y.grad]
    for got, expected in zip(grads, want, strict=True):
        assert torch.equal(got, expected)


class _Tail(torch.nn.Module):
    """An offloaded region's output returned to the caller; the recompute reads it (to rebuild
    ``y + 1``, which ``sin`` saves) where autograd did not save it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        with sc.region("mlp"):
            y = self.lin(x)
        return y, (y + 1).sin()


def test_an_offloaded_value_the_caller_holds_is_copied_before_the_caller_runs_on(monkeypatch):
    """A value the caller still holds as the forward ends (the layer's output) may be written
    next: its copy to the host is awaited before the forward returns, so the recompute serves
    what the forward made, as the copy made at once does (a CPU's). Red without the fence: the
    deferred copy reads the written value."""
    from sac_compile.eager import checkpoint_with_regions, host_copy

    def grads():
        torch.manual_seed(0)
        tail = _Tail()
        x = torch.randn(*X_SHAPE, generator=torch.Generator().manual_seed(1), requires_grad=True)
        y, z = checkpoint_with_regions(tail, x, keep=(), offload={"mlp"})
        y.mul_(3)  # (autograd saved no y: no version error)
        (y.sum() + z.sum()).backward()
        return [tail.lin.weight.grad, tail.lin.bias.grad, x.grad]

    at_once = grads()
    stream = _StreamLike()
    monkeypatch.setattr(host_copy, "copies_for", lambda device: stream)
    deferred = grads()
    assert stream.queue  # (the copies went through the stream)
    for got, want in zip(deferred, at_once, strict=True):
        assert torch.equal(got, want)


def test_a_value_back_from_the_host_leaves_the_host_copy_as_it_was():
    """What the recompute serves gets the recompute's ``grad_fn``: on a CPU (no copy back) it
    must be a fresh alias of the host copy, or the host copy would hold the recompute's graph
    (its saved tensors) for as long as the checkpoint lives, and serve it again."""
    state, _, y = _engine_forward(sc.SAVE_COSTLY)
    y.sum().backward()
    assert state.offloaded.values
    for h in state.offloaded.values:
        assert h.val.grad_fn is None and not h.val.requires_grad


def test_a_view_of_a_parameter_stays_on_the_device():
    """Saving every op (``SAVE_ALL``) caches views of the parameters (``weight.t()``) in an
    offloaded region too: they stay on the device (they cost it nothing), served as the
    parameter's own bytes; the values the layer made go to the host."""
    from sac_compile.eager.host_copy import HostCopy

    state, block, y = _engine_forward(sc.SAVE_ALL)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    views = [e for e in state.order if e.cached and "mlp" in e.regions and e.func is torch.ops.aten.t.default]
    assert views and state.offloaded.values
    for e in views:
        assert not isinstance(e.value, HostCopy) and e.value.val.untyped_storage().data_ptr() in params
    y.sum().backward()
    _assert_plain_grads(block)


def test_views_of_one_storage_travel_to_the_host_once(monkeypatch):
    """Saving every op (``SAVE_ALL``) caches a linear's matmul output and the view of it the
    linear returns: one storage, copied to the host once (its span) and served back as the
    same views of one copy, where each view was copied and brought back on its own (twice the
    host bytes, and each its own device buffer in the recompute). Against the stream-like
    copies: gradients bit-identical to no checkpoint's."""
    from sac_compile._compat.checkpoint import tree_leaves
    from sac_compile.eager import host_copy

    stream = _StreamLike()
    monkeypatch.setattr(host_copy, "copies_for", lambda device: stream)
    state, block, y = _engine_forward(sc.SAVE_ALL)
    sent = [leaf for e in state.order for leaf in tree_leaves(e.value) if hasattr(leaf, "back")]
    views = [leaf for leaf in sent if isinstance(leaf, host_copy.HostView)]
    copies = state.offloaded.values
    assert views and len(sent) > len(copies)
    shared = [h for h in copies if h.shared]
    assert shared and all(v.copy in shared for v in views)
    # each storage once: the host holds the bytes the engine counts
    assert sum(h.val.numel() * h.val.element_size() for h in copies) == state.stats.offloaded_bytes
    y.sum().backward()
    _assert_plain_grads(block)


def test_two_forwards_then_their_backwards_leave_no_copy_back_waiting(monkeypatch):
    """Two microbatches' forwards, then their backwards in the other order (a pipeline's or
    gradient accumulation's), against the stream-like copies: the second's first layer in the
    backward brings the first's last layer back early (it is before it in forward order), and
    it is served there; gradients bit-identical to no checkpoint's, nothing left waiting."""
    from sac_compile.eager import checkpoint_with_regions, host_copy

    stream = _StreamLike()
    monkeypatch.setattr(host_copy, "copies_for", lambda device: stream)

    xs = [torch.randn(*X_SHAPE, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    layers, states = _blocks(), []
    losses = []
    for x in xs:
        h = x
        for layer in layers:
            h = checkpoint_with_regions(layer, h, keep={"mlp"}, offload={"attn"}, stats_out=states)
        losses.append(h.sum())
    losses[1].backward()
    waiting = [c for c in gc_objects(host_copy.HostCopy) if c.ready]
    assert len(waiting) == stream.log.count("back") - stream.log.count("wait") > 0  # (the early one)
    losses[0].backward()
    assert not [c for c in gc_objects(host_copy.HostCopy) if c.ready]
    plain = _blocks()
    for x in xs:
        h = x
        for layer in plain:
            h = layer(h)
        h.sum().backward()
    for got, want in zip(layers, plain, strict=True):
        for a, b in zip(got.parameters(), want.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)


def gc_objects(kind):
    import gc

    return [
        o for o in gc.get_objects() if type(o) is kind
    ]  # (every one alive; not isinstance: a dead proxy raises)


def test_a_copy_back_let_go_unserved_is_awaited_first(monkeypatch):
    """A copy back started and never served (its recompute failed to start, or its graph went
    first) is awaited before its memory goes back to the compute stream."""
    from sac_compile.eager import host_copy

    stream = _StreamLike()
    monkeypatch.setattr(host_copy, "copies_for", lambda device: stream)
    h = host_copy.HostCopy(torch.randn(4), host_copy.LayerOffload())
    h.prefetch()
    assert stream.log == ["back"]
    del h
    assert stream.log == ["back", "wait"]


def test_the_eager_engines_side_stream_protocol_on_a_transformers_model(monkeypatch):
    """A tiny Llama (default config, training mode, 4 layers) through ``hf.config_for(...,
    offload={"mlp"}, compile=False)``, its copies on the stream-like stand-in (each copy runs
    only when awaited): every layer offloads, and the loss's gradients are bit-identical to
    the model's without checkpointing."""
    pytest.importorskip("transformers")
    from sac_compile import hf
    from sac_compile.eager import host_copy
    from sac_compile.testing.hf_families import tiny_llama

    stream = _StreamLike()
    monkeypatch.setattr(host_copy, "copies_for", lambda device: stream)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))  # (its vocabulary)

    def grads(offload):
        torch.manual_seed(0)
        model = tiny_llama(layers=4).train()
        if offload:
            hf.config_for(model, keep={"attn"}, offload={"mlp"}, compile=False).apply(model)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return {n: p.grad for n, p in model.named_parameters()}

    plain, moved = grads(False), grads(True)
    assert stream.log.count("back") == stream.log.count("wait") >= 4  # (every layer's, each awaited)
    for name, g in plain.items():
        assert torch.equal(moved[name], g), name
