"""Region policies: what a kept region saves (its costly values), in both engines, plus budget=."""

import copy
import functools
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy

import sac_compile as sc
from sac_compile.actions import Actions, format_scope, parse_scope
from sac_compile.compiler.backend import baseline_backend
from sac_compile.eager import checkpoint_with_regions
from sac_compile.markers import ops
from sac_compile.passes.tag_regions import _SOURCE_FILES, tag_regions
from sac_compile.policy import SAVE_ALL, SAVE_COSTLY, is_costly, policy_key

aten = torch.ops.aten
SAVE, PREFER, RECOMPUTE = (
    CheckpointPolicy.MUST_SAVE,
    CheckpointPolicy.PREFER_RECOMPUTE,
    CheckpointPolicy.MUST_RECOMPUTE,
)


# --- a kernel the engines cannot see into: a custom op, counted --------------------------

CALLS = {"kernel": 0}


@torch.library.custom_op("sac_compile_test::kernel", mutates_args=())
def kernel(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    CALLS["kernel"] += 1
    return torch.tanh(x @ w)


@kernel.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[1])


def _kernel_backward(ctx, grad):
    x, w, y = ctx.saved_tensors
    g = grad * (1 - y * y)
    return g @ w.T, x.T @ g


def _kernel_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs, output)


kernel.register_autograd(_kernel_backward, setup_context=_kernel_setup)


class KernelFunction(torch.autograd.Function):
    """An autograd.Function whose forward calls an opaque kernel (no autograd of its own)."""

    @staticmethod
    def forward(ctx, x, w):
        y = torch.ops.sac_compile_test.kernel(x, w)
        ctx.save_for_backward(x, w, y)
        return y

    @staticmethod
    def backward(ctx, grad):
        return _kernel_backward(ctx, grad)


class Swiglu(nn.Module):
    """RMSNorm -> SwiGLU with the MLP body marked: the issue's frontier probe."""

    def __init__(self, d=32):
        super().__init__()
        self.g = nn.Linear(d, 4 * d, bias=False)
        self.u = nn.Linear(d, 4 * d, bias=False)
        self.d = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        with sc.region("mlp"):
            m = self.d(F.silu(self.g(h)) * self.u(h))
        return x + m


# --- the classification -----------------------------------------------------------------


def test_costly_ops_are_the_expensive_kernels():
    costly = [
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten.convolution.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_efficient_attention.default,
        torch.ops.sac_compile_test.kernel.default,  # an opaque custom op
        torch.ops._c10d_functional.all_to_all_single.default,
    ]
    cheap = [
        aten.add.Tensor,
        aten.mul.Tensor,
        aten.var_mean.correction,
        aten.native_layer_norm.default,
        aten._to_copy.default,
        aten.view.default,
        aten.gelu.default,
        aten.native_dropout.default,
        torch.ops._c10d_functional.wait_tensor.default,  # follows its collective instead
        operator.getitem,
        ops.REGION_ENTER,
    ]
    assert [op for op in costly if not is_costly(op)] == []
    assert [op for op in cheap if is_costly(op)] == []
    if hasattr(torch.ops.higher_order, "flex_attention"):
        assert is_costly(torch.ops.higher_order.flex_attention)
    assert not is_costly(torch.ops.higher_order.cond)


def test_builtin_policies():
    keep = frozenset({"a"})
    assert SAVE_COSTLY(aten.mm.default, ("a",), keep) == SAVE
    assert SAVE_COSTLY(aten.tanh.default, ("a",), keep) == PREFER
    assert SAVE_COSTLY(aten.mm.default, ("b",), keep) == RECOMPUTE
    assert SAVE_ALL(aten.tanh.default, ("a", "b"), keep) == SAVE
    assert SAVE_ALL(aten.mm.default, (), keep) == RECOMPUTE


# --- the pass -----------------------------------------------------------------------------


def _joint(body):
    """A hand-built joint graph: body(graph, x) adds forward ops, then a backward reads a tangent."""
    g = fx.Graph()
    x = g.placeholder("primals_1")
    tangent = g.placeholder("tangents_1")
    nodes = body(g, x)
    g.output((nodes[-1], g.call_function(aten.mul.Tensor, (tangent, nodes[-1]))))
    return g, nodes


def _kept_mm_tanh(g, x):
    g.call_function(ops.REGION_ENTER, ("r",))
    mm = g.call_function(aten.mm.default, (x, x))
    th = g.call_function(aten.tanh.default, (mm,))
    g.call_function(ops.REGION_EXIT, ("r",))
    out = g.call_function(aten.mm.default, (th, x))
    return [mm, th, out]


@pytest.mark.parametrize(
    "policy, expected",
    [(SAVE_COSTLY, [SAVE, PREFER, RECOMPUTE]), (SAVE_ALL, [SAVE, SAVE, RECOMPUTE])],
    ids=["save_costly", "save_all"],
)
def test_the_pass_applies_the_policy(policy, expected):
    g, nodes = _joint(_kept_mm_tanh)
    rec = tag_regions(g, Actions(frozenset({"r"}), policy))
    assert [n.meta["recompute"] for n in nodes] == expected
    assert rec.scopes[0].policy == policy_key(policy)


def test_a_user_policy_decides_and_a_bad_return_is_a_clear_error():
    def save_tanh_only(op, regions, keep):
        return SAVE if op is aten.tanh.default else RECOMPUTE

    g, nodes = _joint(_kept_mm_tanh)
    tag_regions(g, Actions(frozenset({"r"}), save_tanh_only))
    assert [n.meta["recompute"] for n in nodes] == [RECOMPUTE, SAVE, RECOMPUTE]

    def broken(op, regions, keep):
        return "save"

    g, _ = _joint(_kept_mm_tanh)
    with pytest.raises(TypeError, match=r"broken.*returned 'save'.*CheckpointPolicy"):
        tag_regions(g, Actions(frozenset({"r"}), broken))


def test_budget_leaves_what_is_outside_kept_regions_to_the_knapsack():
    g, nodes = _joint(_kept_mm_tanh)
    rec = tag_regions(g, Actions(frozenset({"r"}), budget=0.25))
    mm, th, out = nodes
    # inside the kept region the policy's tags stand; outside it the knapsack chooses
    assert mm.meta["recompute"] == SAVE and th.meta["recompute"] == PREFER and "recompute" not in out.meta
    assert rec.budget == 0.25
    # through PyTorch's region annotation, on every op (the partitioner requires it)
    from sac_compile._compat import aot

    ops = [n for n in g.nodes if n.op == "call_function"]
    assert ops and {aot.budget_annotation(n) for n in ops} == {0.25}
    assert not any("memory_budget" in n.meta for n in g.nodes)  # not the legacy field


def test_scope_text_carries_policy_and_budget():
    assert format_scope("attn", SAVE_COSTLY, None) == "attn"  # the default stays plain
    text = format_scope("attn,mlp", SAVE_ALL, 0.5)
    assert text == "attn,mlp;policy=save_all;budget=0.5"
    assert parse_scope(text) == ("attn,mlp", SAVE_ALL, 0.5)


# --- validation and identity ------------------------------------------------------------------


def test_bad_policy_and_budget_are_clear_errors():
    with pytest.raises(TypeError, match=r"policy must be a function .* got int 3"):
        sc.make_sac_backend({"a"}, policy=3)
    with pytest.raises(ValueError, match=r"'everything' is not a built-in region policy.*save_all"):
        sc.make_sac_backend({"a"}, policy="everything")
    with pytest.raises(ValueError, match=r"budget=1.5 is outside \[0, 1\]"):
        sc.make_sac_backend({"a"}, budget=1.5)
    with pytest.raises(TypeError, match=r"budget must be a float .* got bool True"):
        sc.apply_selective_checkpointing(nn.Linear(2, 2), {"a"}, budget=True)
    with pytest.raises(TypeError, match=r"budget must be a float .* got str"):
        sc.SacConfig(layers="layers.*", keep={"a"}, budget="0.5")


def test_backends_and_cache_keys_differ_per_policy_and_budget():
    def mine(op, regions, keep):
        return SAVE

    backends = [
        sc.make_sac_backend({"a"}),
        sc.make_sac_backend({"a"}, policy=SAVE_ALL),
        sc.make_sac_backend({"a"}, policy=mine),
        sc.make_sac_backend({"a"}, budget=0.5),
        sc.make_sac_backend({"a"}, budget=0.25),
    ]
    assert len({id(b) for b in backends}) == 5
    assert len({b.tagging_pass().uuid() for b in backends}) == 5
    assert sc.make_sac_backend({"a"}, policy="save_all") is backends[1]
    assert sc.make_sac_backend({"a"}, budget=0.5) is backends[3]
    assert sc.make_sac_backend({"a"}, budget=0) is backends[0]  # budget 0 = no budget
    # every source file the decision depends on enters the key
    names = {f.rsplit("/", 1)[-1] for f in _SOURCE_FILES}
    assert {"keep.py", "policy.py", "inductor.py", "ops.py", "tag_regions.py", "saving_rules.py"} <= names


# --- compiled: what is saved ------------------------------------------------------------------


def _saved_bytes(fn, x, params):
    return sc.inspection.autograd_saved_bytes(fn, x, exclude=params)


@pytest.mark.slow
@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_kept_swiglu_saves_exactly_its_two_up_projections(inner):
    torch.manual_seed(0)
    m = Swiglu()
    x = torch.randn(4, 8, 32, requires_grad=True)
    report = sc.inspection.capture_partition(m, x, backend=sc.make_sac_backend({"mlp"}, inner=inner))
    (graph,) = [g for g in report.graphs if g.backward_compiled]
    kept = [v for v in graph.saved if not v.is_input and v.region == "mlp"]
    # the frontier point: g(h) and u(h), recomputing silu and the product from them
    assert sorted(v.op for v in kept) == ["aten.mm", "aten.mm"]
    assert all(tuple(v.shape) == (32, 128) for v in kept)
    if inner == "inductor":
        return  # Inductor smoke: the same two values; the rest below is Inductor-independent
    old = sc.inspection.capture_partition(
        m, x, backend=sc.make_sac_backend({"mlp"}, inner=inner, policy=SAVE_ALL)
    )
    (old_graph,) = [g for g in old.graphs if g.backward_compiled]
    assert graph.activation_bytes < old_graph.activation_bytes
    ref = torch.autograd.grad(m(x).sum(), [x, *m.parameters()])
    got = torch.autograd.grad(
        torch.compile(m, backend=sc.make_sac_backend({"mlp"}, inner=inner))(x).sum(), [x, *m.parameters()]
    )
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_keeping_everything_never_saves_more_than_no_checkpoint():
    from sac_compile.testing.models import Block

    torch.manual_seed(0)
    block = Block(32, heads=4)
    x = torch.randn(2, 16, 32, requires_grad=True)
    params = list(block.parameters())
    none = _saved_bytes(torch.compile(block, backend=baseline_backend("aot_eager")), x, params)
    torch._dynamo.reset()
    every = _saved_bytes(torch.compile(block, backend=sc.make_sac_backend(inner="aot_eager")), x, params)
    torch._dynamo.reset()
    save_all = _saved_bytes(
        torch.compile(block, backend=sc.make_sac_backend(inner="aot_eager", policy=SAVE_ALL)), x, params
    )
    assert every <= none and every < save_all  # SAVE_ALL also stores the cheap pointwise outputs


@pytest.mark.slow
def test_budget_saves_the_kept_values_then_fills_up_to_the_budget():
    from sac_compile.testing.models import Block

    torch.manual_seed(0)
    block = Block(32, heads=4)
    x = torch.randn(2, 16, 32, requires_grad=True)

    def report(**kw):
        torch._dynamo.reset()
        r = sc.inspection.capture_partition(
            block, x, backend=sc.make_sac_backend({"attn"}, inner="aot_eager", **kw)
        )
        (g,) = [g for g in r.graphs if g.backward_compiled]
        return g

    plain, half, full = report(), report(budget=0.5), report(budget=1.0)
    assert plain.record.budget is None and half.record.budget == 0.5
    for g in (plain, half, full):  # the kept attention core is saved whatever the budget
        assert any(v.region == "attn" and not v.is_input for v in g.saved)
    assert plain.activation_bytes < half.activation_bytes < full.activation_bytes
    torch._dynamo.reset()
    ref = torch.autograd.grad(block(x).sum(), [x, *block.parameters()])
    out = torch.compile(block, backend=sc.make_sac_backend({"attn"}, inner="aot_eager", budget=0.5))(x)
    for a, b in zip(torch.autograd.grad(out.sum(), [x, *block.parameters()]), ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_every_region_kept_with_a_budget_saves_what_the_keep_set_alone_saves():
    """Every costly op kept (the demo's MoE layer): PyTorch's knapsack has nothing to choose,
    and its short-circuit saved the CPU SDPA kernel's output tuple (pytorch/pytorch#188014:
    the forward failed with "expected all tensors_saved_with_vc_check to be Tensors"). The
    partition is redone without the budget, which then changes nothing."""
    from sac_compile.testing.models import MoETransformer

    torch.manual_seed(0)
    model = MoETransformer(vocab=64, d=32, n_layers=1, heads=4, n_experts=4, top_k=2)
    sc.declare_regions(model, MoETransformer.REGIONS)
    x = model.embed(torch.randint(0, 64, (2, 16))).detach().requires_grad_()
    layer = model.layers[0]

    def saved(**kw):
        torch._dynamo.reset()
        backend = sc.make_sac_backend(sc.ALL_REGIONS, inner="aot_eager", **kw)
        return sc.inspection.capture_partition(layer, x, backend=backend).saved_bytes

    assert saved(budget=0.3) == saved()
    torch._dynamo.reset()
    params = [x, *layer.parameters()]
    ref = torch.autograd.grad(layer(x).sum(), params)
    out = torch.compile(layer, backend=sc.make_sac_backend(sc.ALL_REGIONS, inner="aot_eager", budget=0.3))(x)
    for a, b in zip(torch.autograd.grad(out.sum(), params), ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", [SAVE_COSTLY, SAVE_ALL], ids=["save_costly", "save_all"])
@pytest.mark.parametrize("keep", [(), {"attn"}, {"mlp"}, sc.ALL_REGIONS], ids=["none", "attn", "mlp", "all"])
def test_compiled_gradients_match_eager_for_every_policy(policy, keep):
    from sac_compile.testing.models import Block

    torch.manual_seed(0)
    block = Block(16, heads=2).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64, requires_grad=True)
    ref = torch.autograd.grad(block(x).sum(), [x, *block.parameters()])
    compiled = torch.compile(block, backend=sc.make_sac_backend(keep, inner="aot_eager", policy=policy))
    got = torch.autograd.grad(compiled(x).sum(), [x, *block.parameters()])
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def save_nothing_but_silu(op, regions, keep):
    return SAVE if op is aten.silu.default and any(r in keep for r in regions) else RECOMPUTE


def test_a_seam_policy_and_budget_travel_to_the_pass_under_an_outer_compile():
    """The seam's scope markers carry its policy and budget into a whole-model compile."""
    torch.manual_seed(0)
    model = nn.Sequential(Swiglu(), Swiglu())
    plain = copy.deepcopy(model)
    sc.apply_selective_checkpointing(model[0], {"mlp"}, policy=save_nothing_but_silu)
    sc.apply_selective_checkpointing(model[1], {"mlp"}, budget=0.5)
    x = torch.randn(2, 8, 32, requires_grad=True)
    with sc.inspection.collect_records() as recs:
        out = torch.compile(model, backend=sc.make_sac_backend((), inner="aot_eager"))(x)
    training = [r for r in recs if r.is_training]  # (the two seam classes may split the graph)
    scopes = [(s.policy, s.budget) for r in training for s in r.scopes]
    assert scopes == [(policy_key(save_nothing_but_silu), None), ("save_costly", 0.5)]
    assert [r.budget for r in training if r.budget is not None] == [0.5]
    silus = [
        n for r in training for n, p in r.node_policy.items() if n.startswith("silu") and p == "MUST_SAVE"
    ]
    assert len(silus) == 1  # the first layer's, by its own policy
    ref = torch.autograd.grad(plain(x).sum(), [x, *plain.parameters()])
    for a, b in zip(torch.autograd.grad(out.sum(), [x, *model.parameters()]), ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_budget_in_the_eager_engine_is_a_clear_error():
    layer = sc.apply_selective_checkpointing(Swiglu(), {"mlp"}, budget=0.5)
    with pytest.raises(ValueError, match=r"budget=0.5.*eager engine.*compile=True"):
        layer(torch.randn(2, 32, requires_grad=True))


# --- eager: the same policy ---------------------------------------------------------------


class KernelModel(nn.Module):
    def __init__(self, use_function: bool):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16) / 4)
        self.use_function = use_function

    def forward(self, x):
        with sc.region("k"):
            y = KernelFunction.apply(x, self.w) if self.use_function else kernel(x, self.w)
        return (y * x).sin()


@pytest.mark.parametrize("use_function", [False, True], ids=["custom_op", "autograd_function"])
def test_a_kept_kernel_runs_once_per_step_in_eager(use_function):
    # Red before: the engine cached only under grad mode, and a kernel runs below autograd.
    torch.manual_seed(0)
    m = KernelModel(use_function)
    x = torch.randn(8, 16, requires_grad=True)
    ref = torch.autograd.grad(m(x).sum(), [x, m.w])
    counts = {}
    for keep in ((), ("k",)):
        CALLS["kernel"] = 0
        out = checkpoint_with_regions(m, x, keep=frozenset(keep))
        got = torch.autograd.grad(out.sum(), [x, m.w])
        counts[keep] = CALLS["kernel"]
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    assert counts == {(): 2, ("k",): 1}


def test_eager_caches_costly_ops_and_recomputes_cheap_ones_of_a_kept_region():
    torch.manual_seed(0)
    m = Swiglu()
    x = torch.randn(4, 8, 32, requires_grad=True)
    ref = torch.autograd.grad(m(x).sum(), [x, *m.parameters()])
    held = {}
    for policy in (SAVE_COSTLY, SAVE_ALL):
        stats = []
        out = checkpoint_with_regions(m, x, keep=frozenset({"mlp"}), policy=policy, stats_out=stats)
        got = torch.autograd.grad(out.sum(), [x, *m.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
        held[policy_key(policy)] = stats[0].held_bytes
    # SAVE_COSTLY holds the two up-projections (2 x 32x128 floats), like the compiled partition
    # (the down projection, read outside the region by the residual add only, is not held:
    # nothing after the region saves a tensor, so the recompute never runs that add)
    assert held["save_costly"] == 2 * 32 * 128 * 4 < held["save_all"]


def test_dead_recomputed_ops_are_skipped_bit_identically():
    @sc.region("r")
    def body(x):
        a = x.exp()  # recomputed (cheap): sin's backward needs it
        unused = (a * 3).cos()  # no tensor holds it once the region closes, nothing saved reads it
        assert unused.shape == a.shape
        return a.sin()

    x = torch.randn(16, requires_grad=True)
    ref = torch.autograd.grad(body(x).sum(), x)[0]
    stats = []
    out = checkpoint_with_regions(body, x, keep=frozenset({"r"}), stats_out=stats)
    assert torch.equal(torch.autograd.grad(out.sum(), x)[0], ref)
    # red before the liveness walk: every recomputed op of the region ran again
    # cos, and sin (its output, the function's, is read by nothing the recompute runs); mul's
    # output is what cos's autograd node saved: rebuilt, as anything autograd saved
    assert stats[0].skipped_ops == 2


def test_kept_region_of_cheap_ops_only_is_reported(caplog):
    # Red without the kept-nothing check (diagnostics.eager._first_call / diagnostics.compiled.graph_diagnoses).
    import logging

    class Cheap(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            with sc.region("act"):
                h = torch.tanh(h) * 2
            return h.sin()

    for compile in (False, {"inner": "aot_eager"}):
        caplog.clear()
        m = sc.apply_selective_checkpointing(Cheap(), {"act"}, compile=compile)
        with caplog.at_level(logging.WARNING, logger="sac_compile"):
            for _ in range(2):
                m(torch.randn(4, 8, requires_grad=True)).sum().backward()
        msgs = [r.getMessage() for r in caplog.records if "[kept-nothing] region 'act'" in r.getMessage()]
        assert len(msgs) == 1 and "costly" in msgs[0], (compile, [r.getMessage() for r in caplog.records])


class PaddedExperts(nn.Module):
    """A zero-padded expert buffer (4 slots per token) read back by a small gather."""

    def __init__(self, d=16, slots=4):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, d, d) / d**0.5)
        self.slots = slots

    def forward(self, x, idx):
        buf = x.new_zeros(2, x.shape[0] * self.slots, x.shape[1])
        buf = buf.index_copy(1, idx, x.expand(2, -1, -1))
        with sc.region("experts"):
            y = torch.bmm(buf, self.w)  # [2, 4 * tokens, d], mostly padding
        return (y.reshape(-1, x.shape[1])[idx] * 2.0).tanh()  # the tokens' rows: 1/8 of y


def test_a_small_read_of_a_kept_matmul_is_saved_instead_of_the_matmul():
    """Red without the shrinking-read rule: the padded bmm output (8x the gather) is saved."""
    torch.manual_seed(0)
    m = PaddedExperts()
    x = torch.randn(8, 16, requires_grad=True)
    idx = torch.arange(8) * 4
    report = sc.inspection.capture_partition(
        m, x, idx, backend=sc.make_sac_backend({"experts"}, inner="aot_eager")
    )
    (graph,) = [g for g in report.graphs if g.backward_compiled]
    saved = sorted((v.op, tuple(v.shape)) for v in graph.saved if not v.is_input)
    assert saved == [("aten.index", (8, 16))], saved
    stats = []
    out = checkpoint_with_regions(m, x, idx, keep=frozenset({"experts"}), stats_out=stats)
    got = torch.autograd.grad(out.sum(), [x, m.w])
    ref = torch.autograd.grad(m(x, idx).sum(), [x, m.w])
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    # Eagerly the gather runs outside the kept region, where the engine sees no op: the bmm
    # output, still held by `y` when the region closes, is kept whole (as PyTorch's SAC keeps it)
    assert stats[0].held_bytes == 2 * 32 * 16 * 4
    # ... and with the gather inside the kept region the eager engine saves it instead, as compiled
    stats = []
    m.forward = functools.partial(_gather_inside, m)
    out = checkpoint_with_regions(m, x, idx, keep=frozenset({"experts"}), stats_out=stats)
    got = torch.autograd.grad(out.sum(), [x, m.w])
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    assert stats[0].held_bytes == 8 * 16 * 4  # the gather


def _gather_inside(self, x, idx):
    buf = x.new_zeros(2, x.shape[0] * self.slots, x.shape[1])
    buf = buf.index_copy(1, idx, x.expand(2, -1, -1))
    with sc.region("experts"):
        rows = torch.bmm(buf, self.w).reshape(-1, x.shape[1])[idx]
    return (rows * 2.0).tanh()


@pytest.mark.parametrize("budget", [0.3, 0.6])
def test_with_a_budget_the_small_read_is_still_saved_instead_of_the_matmul(budget):
    """Red when the rule skips reads left to the knapsack: with ``budget=`` the combine's gather
    (outside the kept region) is untagged, and the knapsack saved the padded expert buffer's down
    projection (capacity x experts rows) instead of the gathered rows (measured on the demo
    layer: +1.5 MiB, dominated by a plain ``activation_memory_budget`` point)."""
    from sac_compile.testing.models import MoETransformer

    torch.manual_seed(0)
    model = MoETransformer(vocab=64, d=32, n_layers=1, heads=4, n_experts=8, top_k=2)
    sc.declare_regions(model, MoETransformer.REGIONS)
    x = model.embed(torch.randint(0, 64, (2, 16))).detach().requires_grad_()
    backend = sc.make_sac_backend({"experts"}, inner="aot_eager", budget=budget)
    report = sc.inspection.capture_partition(model.layers[0], x, backend=backend)
    (graph,) = [g for g in report.graphs if g.backward_compiled]
    saved = {v.op for v in graph.saved if not v.is_input and v.region == "experts"}
    assert saved == {"aten.bmm"}, graph  # the up projection only (silu's input)
    assert any(v.op == "aten.index" and v.shape[0] == 2 * 16 * 2 for v in graph.saved), graph
