"""``sac_compile.planning.plan``: measured candidates, the choice and its guarantees."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

import sac_compile as sc
from sac_compile.compiler.backend import baseline_backend
from sac_compile.eager import checkpoint_with_regions
from sac_compile.inspection.capture import capture_partition
from sac_compile.inspection.flops import saved_bytes_and_backward_flops
from sac_compile.planning import MAX_EXHAUSTIVE_REGIONS, plan, plan_model
from sac_compile.testing.models import Block

from .releases import default_torch_only

BUDGETS = (None, 0.2, 0.5)


@functools.lru_cache(maxsize=1)
def _block_plan():
    torch.manual_seed(0)
    block = Block(32, heads=4)
    x = torch.randn(2, 16, 32, requires_grad=True)
    return block, x, plan(block, x, memory=0.5, budgets=BUDGETS)


@pytest.mark.slow
def test_every_keep_set_and_budget_is_measured_and_the_choice_fits():
    block, x, p = _block_plan()
    assert p.regions == ("attn", "mlp") and p.search == "exhaustive"
    labels = {(c.keep, c.budget) for c in p.candidates}
    keeps = [frozenset(), frozenset({"attn"}), frozenset({"mlp"}), frozenset({"attn", "mlp"})]
    assert labels == {(k, b) for k in keeps for b in BUDGETS}
    assert p.memory == int(0.5 * p.no_checkpoint_bytes)
    assert p.saved_bytes <= p.memory
    fitting = [c for c in p.candidates if c.saved_bytes <= p.memory]
    assert p.recompute_flops == min(c.recompute_flops for c in fitting)
    assert p.chosen.pareto
    full = next(c for c in p.candidates if not c.keep and c.budget is None)
    both = next(c for c in p.candidates if c.keep == {"attn", "mlp"} and c.budget is None)
    assert full.saved_bytes < both.saved_bytes < p.no_checkpoint_bytes
    assert full.recompute_flops > both.recompute_flops
    assert "keep attn+mlp" in p.format() and ">*" in p.format()


def test_the_chosen_plan_saves_what_the_partition_report_says():
    """The planner's bytes against an independent count: the partition report of the same
    configuration compiled again (parameters excluded, the layer input included)."""
    block, x, p = _block_plan()
    backend = sc.make_sac_backend(p.keep, policy=p.policy, budget=p.budget, inner="aot_eager")
    report = capture_partition(block, x, backend=backend)
    assert report.saved_bytes == p.saved_bytes
    saved, _ = saved_bytes_and_backward_flops(
        torch.compile(block, backend=sc.make_sac_backend(p.keep, budget=p.budget, inner="aot_eager")),
        x,
        exclude=list(block.parameters()),
    )
    assert saved == p.saved_bytes


@pytest.mark.slow
def test_every_candidate_is_what_its_own_compile_saves_and_recomputes():
    """The planner partitions one trace per candidate and reads the figures off the graphs;
    each candidate compiled and run on its own (autograd's saved-tensor hooks, the backward
    under a FLOP-counting dispatch mode) gives the same bytes and recomputed FLOPs."""
    block, x, p = _block_plan()
    params = list(block.parameters())
    torch._dynamo.reset()
    _, base = saved_bytes_and_backward_flops(
        torch.compile(block, backend=baseline_backend("aot_eager")), x, exclude=params
    )
    for c in p.candidates:
        torch._dynamo.reset()
        backend = sc.make_sac_backend(c.keep, policy=c.policy, budget=c.budget, inner="aot_eager")
        saved, flops = saved_bytes_and_backward_flops(
            torch.compile(block, backend=backend), x, exclude=params
        )
        assert (c.saved_bytes, c.recompute_flops) == (saved, flops - base), c.label
        block.zero_grad(set_to_none=True)


def test_more_memory_never_gives_more_recompute_and_the_bytes_always_fit():
    _, _, p = _block_plan()
    smallest = min(c.saved_bytes for c in p.candidates)
    last = None
    for memory in range(smallest, p.no_checkpoint_bytes + 1, 512):
        chosen = p.select(memory)
        assert chosen.saved_bytes <= memory
        if last is not None:
            assert chosen.recompute_flops <= last
        last = chosen.recompute_flops
    assert p.select(1.0).recompute_flops == 0  # the whole no-checkpoint budget: no recompute
    assert p.select(float(p.memory) / p.no_checkpoint_bytes).memory <= p.memory


def test_nothing_fits_names_the_smallest_reachable_bytes():
    _, _, p = _block_plan()
    smallest = min(c.saved_bytes for c in p.candidates)
    with pytest.raises(ValueError, match=f"smallest reachable is {smallest:,} B"):
        p.select(smallest - 1)


def test_bad_arguments_are_refused_before_anything_is_compiled():
    block = Block(32, heads=4)
    x = torch.randn(2, 16, 32)
    with pytest.raises(TypeError, match="nn.Module"):
        plan(lambda t: t, x, memory=0.5)
    with pytest.raises(ValueError, match="budget"):
        plan(block, x, memory=0.5, budgets=(1.5,))
    with pytest.raises(ValueError, match="at least one budget"):
        plan(block, x, memory=0.5, budgets=())
    with pytest.raises(ValueError, match="fraction in \\[0, 1\\]"):
        plan(block, x, memory=2.0)
    _, _, p = _block_plan()
    with pytest.raises(TypeError, match=r"plan\(memory=True\): bytes \(an int\), a number with a unit"):
        p.select(True)
    with pytest.raises(ValueError, match="fraction in \\[0, 1\\]"):
        p.select(1.5)


def test_memory_has_one_meaning_per_type_at_every_entry_point():
    """An int is bytes, a str a number with a unit, a float a fraction of the context's whole
    (a plan's no-checkpoint bytes, a Target's device memory; none for host memory): one
    parser, sac_compile.memory.parse_memory (red before: a plan refused "2KiB", a Target took
    a float over 1 as bytes and refused a fraction)."""
    from sac_compile.memory import GiB, parse_memory
    from sac_compile.planning.devices import DEVICES, Target

    _, _, p = _block_plan()
    whole = p.no_checkpoint_bytes
    assert p.select("64KiB").memory == p.select(65536).memory == 65536
    assert p.select(0.5).memory == int(0.5 * whole) and p.select(1.0).memory == whole
    assert Target("h100-80gb", memory=0.9).machine.memory == int(0.9 * DEVICES["h100-80gb"].memory)
    assert (
        Target("h100-80gb", memory="70GiB").machine.memory
        == Target("h100-80gb", memory=70 * GiB).machine.memory
    )
    with pytest.raises(ValueError, match=r"memory=80000000000.0: a float is a fraction in \[0, 1\]"):
        Target("h100-80gb", memory=80e9)
    with pytest.raises(TypeError, match=r"host_memory=0.5: a float is a fraction, and there is no whole"):
        Target("h100-80gb", offload=True, host_memory=0.5)
    with pytest.raises(ValueError, match=r"Target\(memory=0\): more than 0 bytes"):
        Target("h100-80gb", memory=0)
    with pytest.raises(ValueError, match=r"memory=-1: bytes must be >= 0"):
        parse_memory(-1)
    with pytest.raises(TypeError, match=r"memory=\[1\]: bytes \(an int\)"):
        parse_memory([1])  # type: ignore[arg-type]


def test_config_applies_the_plan_and_compiles_when_it_has_a_budget():
    _, _, p = _block_plan()
    budgeted = next(c for c in p.candidates if c.budget is not None and c.saved_bytes < p.no_checkpoint_bytes)
    q = p.select(budgeted.saved_bytes)
    cfg = q.config(layers="layers.*")
    assert cfg.keep == q.keep and cfg.budget == q.budget and cfg.policy is q.policy
    assert bool(cfg.compile) is (q.budget is not None)
    if q.budget is not None:
        with pytest.raises(ValueError, match="only compiled code"):
            q.config(layers="layers.*", compile=False)


class _FiveRegions(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(d, d) for _ in range(5))

    def forward(self, x):
        for i, lin in enumerate(self.linears):
            with sc.region(f"r{i}"):
                x = torch.tanh(lin(x))
        return x


@pytest.mark.slow
def test_many_regions_are_searched_not_enumerated():
    torch.manual_seed(0)
    m = _FiveRegions()
    x = torch.randn(8, 16, requires_grad=True)
    p = plan(m, x, memory=1.0, budgets=(None,), eager=False)  # the search, not the eager bytes
    assert len(p.regions) == 5 > MAX_EXHAUSTIVE_REGIONS
    assert "none, each alone, all, all but each" in p.search
    assert len(p.candidates) == 2 + 2 * 5
    assert p.recompute_flops == 0


@pytest.mark.slow
def test_eager_bytes_are_what_the_eager_engine_holds_for_each_keep_set():
    block, x, p = _block_plan()
    for c in p.candidates:
        if c.budget is not None:
            assert c.eager_bytes is None
            continue
        held = sc.inspection.autograd_saved_bytes(
            lambda c=c: checkpoint_with_regions(block, x, keep=c.keep, policy=c.policy),
            exclude=[*block.parameters(), *block.buffers()],
        )
        assert c.eager_bytes == held, c.label
    full = next(c for c in p.candidates if not c.keep and c.budget is None)
    both = next(c for c in p.candidates if c.keep == {"attn", "mlp"} and c.budget is None)
    assert full.eager_bytes < both.eager_bytes


def _two_kinds():
    torch.manual_seed(0)
    model = nn.Sequential(Block(32, heads=4), Block(32, heads=4), _FiveRegions(32), Block(32, heads=4))
    return model, torch.randn(2, 16, 32, requires_grad=True)


@pytest.mark.slow
def test_a_model_is_planned_once_per_kind_of_layer_and_applied():
    model, x = _two_kinds()
    mp = plan_model(model, x, layers="*", memory=0.5, budgets=(None,), eager=False)
    assert [(g.kind, g.paths) for g in mp.groups] == [("Block", ("0", "1", "3")), ("_FiveRegions", ("2",))]
    block_plan, five_plan = (g.plan for g in mp.groups)
    assert block_plan.regions == ("attn", "mlp") and len(five_plan.regions) == 5
    # each group's plan is the single-layer plan of its first layer, on the input it received
    alone = plan(model[0], x, memory=0.5, budgets=(None,), eager=False)
    assert (block_plan.keep, block_plan.saved_bytes) == (alone.keep, alone.saved_bytes)
    assert mp.saved_bytes == 3 * block_plan.saved_bytes + five_plan.saved_bytes
    assert "Block x3 (0 ... 3)" in mp.format() and "_FiveRegions x1 (2)" in mp.format()
    ref = torch.autograd.grad(model(x).sum(), [x, *model.parameters()])
    mp.apply(model)
    assert all(type(m).__name__.startswith("SelectiveCheckpointed") for m in model)
    got = torch.autograd.grad(model(x).sum(), [x, *model.parameters()])
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


def test_plan_model_refuses_a_pattern_that_matches_nothing_and_a_budget_without_compile():
    model, x = _two_kinds()
    with pytest.raises(ValueError, match="matches no module of Sequential"):
        plan_model(model, x, layers="layers.*", memory=0.5)
    mp = plan_model(model[:2], x, layers="*", memory=1.0, budgets=(0.5,), eager=False)
    assert mp.groups[0].plan.budget == 0.5
    with pytest.raises(ValueError, match="only compiled code honours"):
        mp.apply(model[:2], compile=False)


@pytest.mark.slow
@default_torch_only
def test_hf_plan_for_plans_a_transformers_model_within_the_memory():
    from sac_compile import hf
    from sac_compile.testing import hf_families

    model = hf_families.tiny_qwen3_moe()
    mp = hf.plan_for(model, memory=0.5, seq=32, budgets=(None, 0.3), eager=False)
    (group,) = mp.groups
    assert group.kind == "Qwen3MoeDecoderLayer" and len(group.paths) == len(model.model.layers)
    assert set(group.plan.regions) >= {"attn", "experts"}
    assert group.plan.saved_bytes <= group.plan.memory == int(0.5 * group.plan.no_checkpoint_bytes)
    fitting = [c for c in group.plan.candidates if c.saved_bytes <= group.plan.memory]
    assert group.plan.recompute_flops == min(c.recompute_flops for c in fitting)


@pytest.mark.slow
@default_torch_only
def test_dense_and_moe_layers_of_one_model_are_planned_apart():
    from sac_compile import hf
    from sac_compile.testing import hf_families

    model = hf_families.build("deepseek-v3")  # layer 0 dense, layer 1 MoE
    mp = hf.plan_for(model, memory=0.5, seq=16, budgets=(None,), eager=False)
    kinds = {g.paths: g for g in mp.groups}
    dense, moe = kinds[("model.layers.0",)], kinds[("model.layers.1",)]
    assert dense.kind == "DeepseekV3DecoderLayer (mlp=DeepseekV3MLP)"
    assert moe.kind == "DeepseekV3DecoderLayer (mlp=DeepseekV3MoE)"
    assert "mlp" in dense.plan.regions and "experts" in moe.plan.regions
    for g in mp.groups:
        assert g.plan.saved_bytes <= g.plan.memory


@pytest.mark.slow
@default_torch_only
def test_the_time_estimator_times_each_pareto_point_and_chooses_the_fastest_that_fits():
    torch.manual_seed(0)
    block = Block(32, heads=4)
    x = torch.randn(2, 16, 32, requires_grad=True)
    p = plan(
        block, x, memory=0.6, budgets=(None, 0.5), estimator="time", inner="aot_eager", iters=3, eager=False
    )
    assert p.estimator == "time" and p.no_checkpoint_time > 0
    timed = [c for c in p.candidates if c.step_time is not None]
    assert all(c.pareto for c in timed)
    assert {(c.saved_bytes, c.recompute_flops) for c in timed} == {
        (c.saved_bytes, c.recompute_flops) for c in p.candidates if c.pareto
    }
    assert p.chosen.step_time == min(c.step_time for c in timed if c.saved_bytes <= p.memory)
    assert p.saved_bytes <= p.memory and "step" in p.format()
    smallest = min(c.saved_bytes for c in p.candidates)
    assert p.select(smallest).saved_bytes == smallest  # select() keeps the estimator
    with pytest.raises(ValueError, match="estimator='flop'"):
        plan(block, x, memory=0.5, estimator="flop")


def test_plot_draws_the_table(tmp_path):
    pytest.importorskip("matplotlib")
    _, _, p = _block_plan()
    p.plot(tmp_path / "plan.png")
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
