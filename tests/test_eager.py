"""The eager engine: bit-identical gradients, in-place writes, RNG, collectives, memory."""

import functools

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import sac_compile as sc
from sac_compile.eager import checkpoint_with_regions
from sac_compile.policy import SAVE_ALL, SAVE_COSTLY
from sac_compile.testing.counting import CountOps
from sac_compile.testing.models import Block, MoEBlock

# Mechanism tests (in-place writes, dropping, RNG) run under both built-in policies:
# SAVE_ALL caches every op of a kept region, the harder case for in-place safety.
POLICIES = pytest.mark.parametrize("policy", [SAVE_COSTLY, SAVE_ALL], ids=["save_costly", "save_all"])

KEEPS = [frozenset(), frozenset({"attn"}), frozenset({"mlp"}), frozenset({"experts"}), sc.ALL_REGIONS]


def step(module, x, mode, keep=frozenset(), seed=5, **kwargs):
    """(output, grads, stats) of sum(module(x)).backward() under a checkpointing mode."""
    module.zero_grad(set_to_none=True)
    x.grad = None
    torch.manual_seed(seed)
    stats = []
    if mode == "none":
        out = module(x)
    elif mode == "full":
        out = checkpoint(module, x, use_reentrant=False)
    else:
        out = checkpoint_with_regions(module, x, keep=keep, stats_out=stats, **kwargs)
    out.sum().backward()
    grads = [p.grad for p in module.parameters()] + [x.grad]
    return out.detach(), grads, (stats[0] if stats else None)


def assert_bit_identical(a, b):
    out_a, grads_a, _ = a
    out_b, grads_b, _ = b
    assert torch.equal(out_a, out_b)
    assert len(grads_a) == len(grads_b)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        assert ga is not None and gb is not None, "every parameter's gradient is live"
        assert torch.equal(ga, gb)


@pytest.mark.parametrize(
    "keep", KEEPS, ids=lambda k: "+".join(sorted(k)) if isinstance(k, frozenset) else "all"
)
@pytest.mark.parametrize("make", [lambda: Block(16, dropout=0.2), lambda: MoEBlock(16)], ids=["block", "moe"])
@POLICIES
def test_kept_equals_full_recompute_equals_no_checkpoint(make, keep, policy):
    torch.manual_seed(0)
    module = make()
    x = torch.randn(2, 6, 16, requires_grad=True)
    ref = step(module, x, "none")
    assert_bit_identical(step(module, x, "full"), ref)
    assert_bit_identical(step(module, x, "sac", keep, policy=policy), ref)


def test_kept_regions_are_what_is_cached():
    torch.manual_seed(0)
    block = Block(16)
    x = torch.randn(2, 6, 16, requires_grad=True)
    _, _, attn = step(block, x, "sac", frozenset({"attn"}))
    _, _, both = step(block, x, "sac", sc.ALL_REGIONS)
    _, _, none = step(block, x, "sac", frozenset())
    assert set(attn.held_by_region) == {"attn"} and attn.held_bytes > 0
    assert set(both.held_by_region) == {"attn", "mlp"}
    # nothing cached, nothing held: the recomputed SDPA kernel carries the seeded tag, but
    # without dropout it draws nothing, so no RNG state is stashed (red before: 5056 B "rng")
    assert none.cached_ops == 0 and set(none.held_by_region) == set() and none.held_bytes == 0
    assert attn.regions_entered == {"attn": 1, "mlp": 1}


class Marked(nn.Module):
    """Overlapping and unbalanced regions around in-place writes."""

    def __init__(self, d=8):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d**0.5)

    def forward(self, x):
        a = sc.region("a")
        b = sc.region("b")
        a.__enter__()
        h = torch.tanh(x @ self.w)  # a
        b.__enter__()
        h = h @ self.w  # a+b
        a.__exit__()
        h = torch.sigmoid(h)  # b
        b.__exit__()
        b.__exit__()  # exit without enter: harmless
        sc.region("late").__enter__()  # never exited: open to the end
        return (h @ self.w).cos()


@pytest.mark.parametrize("keep", [frozenset({"a"}), frozenset({"b"}), frozenset({"late"}), sc.ALL_REGIONS])
def test_overlapping_and_unbalanced_regions(keep):
    torch.manual_seed(0)
    m = Marked()
    x = torch.randn(4, 8, requires_grad=True)
    ref = step(m, x, "none")
    got = step(m, x, "sac", keep)
    assert_bit_identical(got, ref)
    held = set(got[2].held_by_region)
    if keep == frozenset({"b"}):
        assert held <= {"b", "a+b"} and held
    if keep == frozenset({"a"}):
        assert held <= {"a", "a+b"} and held


class InPlace(nn.Module):
    """zeros-then-index_add_, add_/relu_ on region-produced values, writes through views."""

    def __init__(self, d=8):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d**0.5)

    def forward(self, x):
        with sc.region("r"):
            out = torch.zeros_like(x)
            idx = torch.tensor([0, 2, 3])
            out.index_add_(0, idx, torch.tanh(x[idx] @ self.w))
            h = x @ self.w
            h.add_(1.0)
            h.relu_()
            buf = torch.zeros(x.shape[0], 2 * x.shape[1])
            view = buf[:, : x.shape[1]]
            view.copy_(h)
            view.mul_(2)
        return (out + buf[:, : x.shape[1]] + buf.sum()).sin()


@POLICIES
def test_in_place_writes_inside_a_kept_region_stay_bit_identical(policy):
    torch.manual_seed(0)
    m = InPlace()
    x = torch.randn(4, 8, requires_grad=True)
    ref = step(m, x, "none")
    got = step(m, x, "sac", frozenset({"r"}), policy=policy)
    assert_bit_identical(got, ref)
    if policy is SAVE_ALL:
        assert got[2].mutated_recomputes >= 3  # zeros_like, the x @ w product, the buffer
    else:
        assert got[2].mutated_recomputes >= 1  # the x @ w product (zeros_like is cheap: recomputed)


def test_out_variants_in_a_kept_region_are_rerun_into_their_buffer():
    """Red before: mm.out served from the cache left the recompute's new buffer unfilled."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            buf = torch.empty(x.shape[0], 8)  # outside the region: a new buffer in the recompute
            with sc.region("r"):
                torch.mm(x.detach().tanh(), self.w.detach(), out=buf)  # no autograd for out=
            return (x * buf).sum(dim=1) + (x @ self.w).sum(dim=1)

    torch.manual_seed(0)
    m = M()
    x = torch.randn(4, 8, requires_grad=True)
    assert_bit_identical(step(m, x, "sac", frozenset({"r"})), step(m, x, "none"))


def test_pytorch_sac_fails_where_the_engine_does_not():
    """The same in-place pattern under PyTorch's own SAC caching every op it sees."""
    torch.manual_seed(0)
    m = InPlace()
    x = torch.randn(4, 8, requires_grad=True)
    cache_all = functools.partial(create_selective_checkpoint_contexts, lambda ctx, op, *a, **k: True)
    out = checkpoint(m, x, use_reentrant=False, context_fn=cache_all)
    with pytest.raises(RuntimeError, match="mutated"):
        out.sum().backward()


def test_random_producer_written_in_place_without_rng_preservation_is_a_forward_error():
    class M(nn.Module):
        def forward(self, x):
            with sc.region("drop"):
                y = torch.nn.functional.dropout(x, 0.5)
                y.mul_(3)
            return y.sum()

    x = torch.randn(8, requires_grad=True)
    # red before the check existed: the forward passed and the gradients were silently wrong
    msg = r"aten\.mul_\.Tensor writes in place .*shape \(8,\).* made by aten\.mul\.Tensor in region\(s\) drop"
    with pytest.raises(RuntimeError, match=msg + r".*preserve_rng_state=True"):
        # SAVE_ALL caches dropout's product (SAVE_COSTLY recomputes it, no write hazard)
        checkpoint_with_regions(M(), x, keep=frozenset({"drop"}), preserve_rng_state=False, policy=SAVE_ALL)


def test_dropout_in_kept_and_recomputed_regions_matches_no_checkpoint():
    torch.manual_seed(0)
    block = Block(16, dropout=0.5)
    x = torch.randn(2, 6, 16, requires_grad=True)
    ref = step(block, x, "none", seed=11)
    for keep in (frozenset({"mlp"}), frozenset({"attn"})):  # dropout kept in one, recomputed in other
        assert_bit_identical(step(block, x, "sac", keep, seed=11), ref)
    other = step(block, x, "none", seed=12)
    assert not torch.equal(other[0], ref[0])  # the dropout is live


def test_only_replays_after_a_served_random_op_hold_an_rng_state():
    """Random draws a (recomputed), b (kept, SAVE_ALL: served from the cache), c (recomputed): the
    checkpoint restores the starting RNG state, so a replays in step by itself; c follows a
    draw the recompute does not make, so it needs its own state. One state held (red before:
    one per recomputed random op, 2 x 5,056 B on CPU), gradients bit-identical."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(16, 16))

        def forward(self, x):
            h = x @ self.w * torch.rand_like(x)
            with sc.region("r"):
                h = h @ self.w * torch.rand_like(h)
            return (h @ self.w * torch.rand_like(h)).tanh()

    torch.manual_seed(0)
    m = M()
    x = torch.randn(4, 16, requires_grad=True)
    got = step(m, x, "sac", frozenset({"r"}), policy=SAVE_ALL)
    assert_bit_identical(got, step(m, x, "none"))
    one_state = torch.get_rng_state().numel()
    assert got[2].held_by_region["rng"] == one_state, dict(got[2].held_by_region)
    # nothing served: the recompute is in step throughout and holds no state at all
    full = step(m, x, "sac", frozenset())
    assert_bit_identical(full, step(m, x, "none"))
    assert full[2].held_by_region.get("rng", 0) == 0, dict(full[2].held_by_region)


def test_the_rng_state_of_a_factory_draw_covers_the_device_it_names(monkeypatch):
    """``rand(n, device="cuda")`` has no tensor argument: its device is in its ``device``
    argument and on its output. Red when only tensor arguments named the devices: only the
    CPU generator was recorded, so a skipped CUDA draw left the CUDA generator behind.
    (No GPU here: the CUDA generator is stood in for.)"""
    from sac_compile.eager.op_facts import rng_state

    asked = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda dev: asked.append(dev) or torch.zeros(1))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    cuda = torch.device("cuda", 1)
    state = rng_state(((4,), {"device": cuda, "dtype": None}, torch.empty(4, device="meta")))
    assert asked == [cuda] and [dev for dev, _ in state] == ["cpu", cuda]
    # `device="cuda"` (no index) and the output's `cuda:1` are one generator, recorded once
    asked.clear()
    state = rng_state(((4,), {"device": torch.device("cuda")}, [torch.device("cuda", 1)]))
    assert asked == [cuda] and [dev for dev, _ in state] == ["cpu", cuda]


@POLICIES
def test_cached_values_nothing_reads_are_dropped(policy):
    """mm -> add -> mul kept: autograd saves none of their outputs, only the last is read."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            with sc.region("r"):
                c = ((x @ self.w) + 1) * 2
            return c.sin()

    torch.manual_seed(0)
    m = M()
    x = torch.randn(4, 8, requires_grad=True)
    got = step(m, x, "sac", frozenset({"r"}), policy=policy)
    assert_bit_identical(got, step(m, x, "none"))
    stats = got[2]
    if policy is SAVE_ALL:
        assert stats.cached_ops == 3 and stats.dropped_ops == 2
    else:  # the mm cached, add and mul recomputed from it (they rebuild c, which sin saved)
        assert stats.cached_ops == 1 and stats.dropped_ops == 0
    assert stats.held_bytes == 4 * 8 * 4  # c, or the mm output c is recomputed from


def test_collectives_are_always_recomputed_and_counted(world_of_one):
    import torch.distributed as dist

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            with sc.region("comm"):
                h = x @ self.w
                dist.all_reduce(h)  # in place, into a buffer made in the region
                h = torch.tanh(h)
            return h.cos()

    torch.manual_seed(0)
    m = M()
    x = torch.randn(4, 8, requires_grad=True)
    ref = step(m, x, "none")
    got = step(m, x, "sac", frozenset({"comm"}))
    assert_bit_identical(got, ref)
    assert got[2].forced_collectives == 1


def _net_forward_bytes(fn) -> int:
    """Net CPU bytes allocated by fn() and still held when it returns (profiler accounting)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        out = fn()
    del out
    return sum(e.self_cpu_memory_usage for e in prof.events())


@pytest.mark.parametrize("make", [lambda: Block(32), lambda: MoEBlock(32)], ids=["block", "moe"])
def test_no_keep_set_retains_more_than_no_checkpoint(make):
    torch.manual_seed(0)
    module = make()
    x = torch.randn(4, 16, 32, requires_grad=True)
    baseline = _net_forward_bytes(lambda: module(x))
    held = {}
    for keep in KEEPS:
        held[str(sorted(keep)) if isinstance(keep, frozenset) else "all"] = _net_forward_bytes(
            lambda keep=keep: checkpoint_with_regions(module, x, keep=keep)
        )
    assert baseline > 0
    assert all(v <= baseline for v in held.values()), (baseline, held)
    assert held["all"] > held["[]"]  # keeping holds something


# Cases found in review (each was wrong or crashed before its fix): functions of one
# input, compared bit for bit with a plain run.
class _Buffered(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.arange(4.0))

    def forward(self, x):
        with sc.region("r"):
            self.buf.add_(1.0)  # kept write into a buffer: happens once, served in the recompute
            self.buf.mul_(2.0)
        return (x * self.buf).sin()


def _out_write_into_cached(x):
    with sc.region("r"):
        a = x.exp()
    h = (x + a.detach()).sin()
    torch.mul(x.detach(), 3.0, out=a.detach())  # out= into a kept, scope-produced value
    return h + (x * a.detach()).cos()


def _literal_written(x):
    m = torch.tensor([1.0, 2.0, 3.0, 4.0])  # reaches the engine as lift_fresh
    with sc.region("r"):
        m.mul_(2)
    return (x + m).sin()


def _indices_read_by_python(x):
    with sc.region("r"):
        order = torch.argsort(x.detach())
    rows = order.tolist()  # no aten op reads it: it must not be dropped
    return x[rows[:3]].sin()


_GEN = torch.Generator()


def _own_generator(x):
    _GEN.manual_seed(7)
    with sc.region("r"):
        kept = torch.rand(4, generator=_GEN)  # cached: does not draw in the recompute
    n = torch.rand(4, generator=_GEN)  # recomputed: must replay its generator state
    return (x * n * kept).sin()


@pytest.mark.parametrize(
    "make_fn",
    [
        _Buffered,
        lambda: _out_write_into_cached,
        lambda: _literal_written,
        lambda: _indices_read_by_python,
        lambda: _own_generator,
    ],
    ids=["kept-buffer-writes", "out-into-cached", "literal-written", "indices-tolist", "own-generator"],
)
def test_review_cases_are_bit_identical(make_fn):
    outs = []
    for mode in ("none", "sac"):
        torch.manual_seed(1)
        fn = make_fn()
        x = torch.randn(4, requires_grad=True)
        out = fn(x) if mode == "none" else checkpoint_with_regions(fn, x, keep=frozenset({"r"}))
        out.sum().backward()
        outs.append((out.detach(), x.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def _read_before_a_kept_write(buffered, x):
    h = (x * buffered.buf).sin()  # recomputed: would read the written buffer
    with sc.region("r"):
        buffered.buf.add_(1.0)
    return h


def _read_between_two_kept_writes(buffered, x):
    with sc.region("r"):
        buffered.buf.mul_(0.5)
        h = (x * buffered.buf).sin()  # recomputed (cheap): would read what the second write left
        buffered.buf.add_(1.0)
    return h


@pytest.mark.parametrize("forward", [_read_before_a_kept_write, _read_between_two_kept_writes])
def test_a_read_of_an_outside_tensor_before_its_last_kept_write_is_an_error(forward):
    """The buffer's kept writes happen once, in the forward (served, skipped, in the
    recompute), so a recomputed read before the last of them sees the written value.
    Red without the recompute's watch (silently wrong gradients, as under PyTorch's SAC),
    and, for the read between two writes, when only the first write kept the buffer
    watched."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("buf", torch.arange(4.0))

        def forward(self, x):
            return forward(self, x)

    out = checkpoint_with_regions(M(), torch.randn(4, requires_grad=True), keep=frozenset({"r"}))
    msg = r"aten\.add_\.Tensor writes in place, in kept region\(s\) r, .* that aten\.mul\.Tensor read earlier"
    with pytest.raises(RuntimeError, match=msg):
        out.sum().backward()


def test_a_read_between_kept_writes_into_other_bytes_of_an_outside_tensor_is_fine():
    """Kept writes into two rows of one outside buffer (several layers filling slices of a
    shared cache, say), and a read of the first row between them: the second write does not
    touch what the read reads, so the recompute reads what the forward read. Red when the
    whole storage stayed watched until its last served write (a false error)."""
    buf = torch.zeros(2, 4)

    def fn(x):
        with sc.region("r"):
            buf[0].copy_(x.detach() * 2)
            h = (x + buf[0]).sin()
            buf[1].copy_(x.detach())
        return h

    x = torch.randn(4, requires_grad=True)
    ref = torch.autograd.grad(fn(x).sum(), x)[0]
    buf.zero_()
    out = checkpoint_with_regions(fn, x, keep=frozenset({"r"}))
    assert torch.equal(torch.autograd.grad(out.sum(), x)[0], ref)
    assert torch.equal(buf, torch.stack([x.detach() * 2, x.detach()]))  # each write happened once


def test_backward_twice_with_retain_graph():
    def fn(x):
        with sc.region("r"):
            b = (x * 3).view(16)
        return b.sin()

    x = torch.randn(4, 4, requires_grad=True)
    out = checkpoint_with_regions(fn, x, keep=frozenset({"r"}))
    out.sum().backward(retain_graph=True)
    out.sum().backward()
    torch.testing.assert_close(x.grad, 2 * 3 * torch.cos(3 * x))


def test_unread_outputs_of_a_multi_output_op_are_dropped():
    """var_mean kept (SAVE_ALL): only the mean is read later, so the variance is not held."""

    def fn(x):
        with sc.region("r"):
            mean = torch.var_mean(x @ x.T, dim=1)[1]  # var: no tensor holds it after the region
        return (x * mean[:, None]).sin()

    torch.manual_seed(0)
    x = torch.randn(64, 8, requires_grad=True)
    ref = fn(x)
    ref_grad = torch.autograd.grad(ref.sum(), x)[0]
    stats = []
    out = checkpoint_with_regions(fn, x, keep=frozenset({"r"}), stats_out=stats, policy=SAVE_ALL)
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert torch.equal(out, ref) and torch.equal(grad, ref_grad)
    # held: x @ x.T (var_mean saves its input) and mean; red before per-output
    # dropping, when var (64 floats) was held too
    assert stats[0].held_by_region["r"] == (64 * 64 + 64) * 4
    # the default policy holds x @ x.T only: var_mean (cheap) is recomputed from it
    stats = []
    out = checkpoint_with_regions(fn, x, keep=frozenset({"r"}), stats_out=stats)
    assert torch.equal(torch.autograd.grad(out.sum(), x)[0], ref_grad)
    assert stats[0].held_by_region["r"] == 64 * 64 * 4


def test_the_engine_intercepts_ops_in_kept_regions_only():
    """Issue #17: no Python dispatch mode outside kept regions, in the forward and in the
    recompute (red before: every op of the layer was intercepted twice)."""
    torch.manual_seed(0)
    block = Block(16)
    x = torch.randn(2, 8, 16, requires_grad=True)
    with torch.no_grad(), CountOps() as plain:
        block(x)
    for keep in (frozenset({"attn"}), sc.ALL_REGIONS, frozenset()):
        stats = []
        out = checkpoint_with_regions(block, x, keep=keep, stats_out=stats)
        forward = dict(stats[0].intercepted)
        assert not any(p == "recompute" for p, _ in forward)  # nothing recomputed yet
        out.sum().backward()
        seen = stats[0].intercepted
        assert seen["forward", "outside"] == 0 and seen["recompute", "outside"] == 0, dict(seen)
        assert seen["recompute", "watch"] == 0
        if keep:
            assert 0 < seen["forward", "kept"] < plain.n, (dict(seen), plain.n)
            assert seen["recompute", "kept"] > 0
        else:
            assert sum(seen.values()) == 0 and stats[0].spans == 0
    attn_only = checkpoint_with_regions(block, x, keep=frozenset({"attn"}), stats_out=(got := []))
    attn_only.sum().backward()
    assert got[0].spans == 1


def test_the_recompute_intercepts_no_more_ops_than_the_forward():
    """The checkpoint's recompute detaches each tensor autograd saves: an op our mode would
    only pass through, and it ran in kept spans (red before: this block keeping attn, 5 ops
    intercepted in the recompute against 1 in the forward; a Qwen3-MoE layer 91 vs 62)."""
    torch.manual_seed(0)
    block = Block(16)
    x = torch.randn(2, 8, 16, requires_grad=True)
    for keep in (frozenset({"attn"}), sc.ALL_REGIONS):
        stats = []
        checkpoint_with_regions(block, x, keep=keep, stats_out=stats).sum().backward()
        seen = stats[0].intercepted
        assert 0 < seen["recompute", "kept"] <= seen["forward", "kept"], dict(seen)


# --- Interception scoped to kept regions (issue #17): what the engine no longer sees -----


@POLICIES
def test_a_cached_value_written_outside_kept_regions_is_recomputed(policy):
    """The write happens where no mode watches; the cached matmul's version counter tells.
    Red without the end-of-forward version check: the recompute served the written value
    (PyTorch's "Tensor cached during selective activation checkpoint has been mutated")."""

    def fn(x, w):
        with sc.region("r"):
            y = x @ w
        y.mul_(2)  # outside kept regions
        return (y.sin() * x).sum(-1)

    torch.manual_seed(0)
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    ref = torch.autograd.grad(fn(x, w).sum(), [x, w])
    stats = []
    out = checkpoint_with_regions(fn, x, w, keep=frozenset({"r"}), stats_out=stats, policy=policy)
    got = torch.autograd.grad(out.sum(), [x, w])
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    assert stats[0].mutated_recomputes >= 1


def test_a_kept_write_into_a_tensor_made_outside_kept_regions_is_redone_on_the_new_one():
    """The buffer is made outside kept regions, so the recompute makes a new one: the kept
    write (served once when its target is the forward's very tensor) is done again on it."""

    def fn(x):
        buf = torch.zeros(x.shape[0])
        with sc.region("r"):
            buf.add_(x.detach().exp())
        return (x * buf).sin()

    x = torch.randn(6, requires_grad=True)
    ref = torch.autograd.grad(fn(x).sum(), x)[0]
    out = checkpoint_with_regions(fn, x, keep=frozenset({"r"}))
    assert torch.equal(torch.autograd.grad(out.sum(), x)[0], ref)


@pytest.mark.parametrize("early_stop_by", ["context", "argument"])
def test_a_kept_regions_output_is_held_only_if_the_recompute_may_read_it(early_stop_by):
    """The region's output is read outside it by ops the engine does not see. With a save
    after the region the recompute runs those ops, so the output is held; with none (and
    the checkpoint's early stop) it never does, and the output is not held. Red without
    the early-stop rule: the second case held it too. Early stop is turned off either by
    ``set_checkpoint_early_stop`` or by the checkpoint's ``early_stop=`` argument (red
    when the engine read only the former: it dropped the output the recompute reads)."""

    def fn(x, w, save_after):
        with sc.region("r"):
            y = x @ w
        y = y + 1
        return y.sin() if save_after else y * 2

    torch.manual_seed(0)
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    held = {}
    for save_after in (True, False):
        for early_stop in (True, False):
            ref = torch.autograd.grad(fn(x, w, save_after).sum(), [x, w])
            stats = []
            kwargs = {"keep": frozenset({"r"}), "stats_out": stats}
            if early_stop_by == "context":
                with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
                    out = checkpoint_with_regions(fn, x, w, save_after, **kwargs)
                    got = torch.autograd.grad(out.sum(), [x, w])
            else:
                out = checkpoint_with_regions(fn, x, w, save_after, early_stop=early_stop, **kwargs)
                got = torch.autograd.grad(out.sum(), [x, w])
            assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
            held[save_after, early_stop] = stats[0].held_bytes
    assert held[True, True] == held[True, False] == held[False, False] == 4 * 8 * 4
    assert held[False, True] == 0


def test_a_dispatch_mode_left_open_across_a_kept_regions_end_is_an_error():
    class Noop(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def fn(x):
        region = sc.region("r")
        region.__enter__()
        mode = Noop()
        mode.__enter__()
        y = x.exp()
        try:
            region.__exit__()
        finally:
            mode.__exit__(None, None, None)
        return y

    with pytest.raises(RuntimeError, match="still active where the last kept region closes"):
        checkpoint_with_regions(fn, torch.randn(3, requires_grad=True), keep=frozenset({"r"}))
    from sac_compile._compat.checkpoint import _current_dispatch_mode

    assert _current_dispatch_mode() is None  # nothing left pushed


def test_your_region_policy_is_asked_again_on_every_call():
    """The built-in policies' answers are kept across calls (they depend on the op, the
    regions and the keep set only); a policy of yours may change between calls and is
    asked again on each."""
    from torch.utils.checkpoint import CheckpointPolicy

    w = torch.randn(8, 8, requires_grad=True)
    wanted = {"save": True}

    def policy(op, regions, keep):
        return CheckpointPolicy.MUST_SAVE if wanted["save"] else CheckpointPolicy.PREFER_RECOMPUTE

    def fn(x):
        with sc.region("r"):
            return (x @ w).sin()

    x = torch.randn(8, 8, requires_grad=True)
    cached = []
    for save in (True, False, True):
        wanted["save"] = save
        stats = []
        checkpoint_with_regions(fn, x, keep=frozenset({"r"}), policy=policy, stats_out=stats).sum().backward()
        cached.append(stats[0].cached_ops)
    assert cached[0] == cached[2] > 0 and cached[1] == 0, cached


def test_the_forward_lets_go_of_its_weak_references_to_storages(monkeypatch):
    """A weak reference to a storage keeps its C++ object alive: held to the end of the
    backward, one per saved tensor and per storage a kept span made, they fragmented glibc's
    heap and slowed the backward by 8% on a Qwen3-MoE layer (Note [weak references to
    storages]). After the forward the engine holds none; the recompute needs none."""
    from sac_compile.eager import state as state_module

    states = []
    init = state_module.EngineState.__init__

    def capture(self, *args, **kwargs):
        init(self, *args, **kwargs)
        states.append(self)

    monkeypatch.setattr(state_module.EngineState, "__init__", capture)
    torch.manual_seed(0)
    block = Block(16, dropout=0.2)
    x = torch.randn(2, 8, 16, requires_grad=True)
    ref = step(block, x, "none")
    out = checkpoint_with_regions(block, x, keep=frozenset({"attn", "mlp"}))
    (st,) = states
    assert st.stats.cached_ops > 0 and st.order
    held = [st.produced, st.saved_storages, st.random_derived]
    assert not any(s.ever() for s in held), [len(s.ever()) for s in held]
    del out
    assert_bit_identical(step(block, x, "engine", keep=frozenset({"attn", "mlp"})), ref)


def test_a_freed_saved_tensors_address_does_not_keep_a_later_value():
    """Autograd saves ``sin``'s output for ``cos`` and the checkpoint frees it at once; its
    storage's address is free for the next storage, here the kept matmul's output that
    nothing reads later (dropped). The engine names what autograd saved by a weak reference,
    which keeps the address from being reused; by address alone (5c2b311, reverted) the
    matmul's output took it, counted as saved and was held: 2,048 B instead of 1,024 with
    one ``sin().cos()`` before the region, and held bytes varied from run to run on a
    transformers model."""
    torch.manual_seed(0)
    w = torch.randn(32, 32, requires_grad=True)
    w2 = torch.randn(32, 32)  # (no grad: the second matmul does not save its input)

    def make(pre):
        def fn(x):
            for _ in range(pre):
                x = x.sin().cos()
            with sc.region("r"):
                y = (x @ w) @ w2
            return y.tanh()

        return fn

    x = torch.randn(8, 32, requires_grad=True)
    for pre in (0, 1, 3):
        stats = []
        checkpoint_with_regions(make(pre), x, keep=frozenset({"r"}), stats_out=stats).sum().backward()
        assert (stats[0].held_bytes, stats[0].dropped_ops) == (8 * 32 * 4, 1), (pre, stats[0])
