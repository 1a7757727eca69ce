"""What PyTorch releases 2.13-2.15 changed under us, checked on whichever one runs.

* Effectful ops (``torch.library._register_effectful_op``) are threaded with a token
  (``with_effects``) under compile. The partitioner saves their outputs unless they are
  tagged ``MUST_RECOMPUTE``: before 2.15 that tag made the forward crash (a token-less
  saved list), since 2.15 the partitioner raises. A region never tags them; in the eager
  engine they run once in a kept region (elsewhere the engine sees no op: they run again).
* Random ops in a recomputed region are replayed: SDPA with dropout (2.15's ``is_rng_op``
  stops wrapping SDPA with ``dropout_p=0`` in ``run_and_save_rng_state``).
* Inductor's seed nodes (2.14's ``fuse_seed_creation_pass`` copies a random op's ``meta``,
  our tags included, onto ``inductor_seeds``) are untagged by a ``joint_custom_post_pass``
  that runs after any of the user's.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch._library.effects import EffectType

import sac_compile as sc
from sac_compile.compiler.backend import baseline_backend
from sac_compile.eager import checkpoint_with_regions

CALLS: list[int] = []


@torch.library.custom_op("sac_compile_tests::logged", mutates_args=())
def logged(x: torch.Tensor) -> torch.Tensor:
    """Doubles x and logs a call (its side effect)."""
    CALLS.append(1)
    return x * 2


@logged.register_fake
def _(x):
    return torch.empty_like(x)


logged.register_autograd(lambda ctx, g: g * 2, setup_context=lambda ctx, inputs, output: None)
torch.library._register_effectful_op("sac_compile_tests::logged", EffectType.ORDERED)


class Logged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        with sc.region("a"):
            h = logged(torch.tanh(self.l1(x)))
            return torch.tanh(self.l2(h))


def _grads(run, module, x):
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    CALLS.clear()
    run(module, x).sum().backward()
    return len(CALLS), [x.grad] + [p.grad for p in module.parameters()]


@pytest.mark.parametrize("keep", [(), ("a",)], ids=["recomputed", "kept"])
def test_an_effectful_op_in_a_region_runs_once_compiled(keep):
    torch.manual_seed(0)
    module, x = Logged(), torch.randn(4, 8)
    _, ref = _grads(lambda m, x: m(x), module, x)
    compiled = torch.compile(module, backend=sc.make_sac_backend(keep, inner="aot_eager"))
    calls, got = _grads(lambda m, x: compiled(x), module, x)
    assert calls == 1  # red before: the forward crashed ("tensors_saved_with_vc_check")
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r)
    torch._dynamo.reset()
    report = sc.inspection.capture_partition(
        module, x.requires_grad_(), backend=sc.make_sac_backend(keep, inner="aot_eager")
    )
    # its output is saved (the partitioner's rule for effectful ops), also where nothing is kept
    assert any(v.op == "getitem" and v.region == "a" for v in report.saved), report.format()


@pytest.mark.parametrize("keep", [(), ("a",)], ids=["recomputed", "kept"])
def test_an_effectful_op_in_a_region_runs_once_eager(keep):
    torch.manual_seed(0)
    module, x = Logged(), torch.randn(4, 8)
    _, ref = _grads(lambda m, x: m(x), module, x)
    calls, got = _grads(lambda m, x: checkpoint_with_regions(m, x, keep=keep), module, x)
    # Kept: served from the cache, it runs once. Outside kept regions the engine sees no op
    # (issue #17): like any op there it runs again in the recompute, as under
    # torch.utils.checkpoint (docs/limitations.md); the compiled path runs it once either way.
    assert calls == (1 if keep else 2)
    for g, r in zip(got, ref, strict=True):
        assert torch.equal(g, r)


class Attention(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.qkv, self.out, self.p = nn.Linear(16, 48), nn.Linear(16, 16), p

    def forward(self, x):
        with sc.region("attn"):
            q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p)
            return self.out(o.transpose(1, 2).flatten(2))


@pytest.mark.parametrize("p", [0.0, 0.5])
def test_sdpa_with_dropout_in_a_recomputed_region_replays_its_mask(p):
    """Recomputed attention (nothing kept) has the gradients of the same compile without
    checkpointing under the same seed: the recompute draws the forward's dropout mask."""
    torch.manual_seed(0)
    module, x = Attention(p), torch.randn(2, 6, 16)
    plain = torch.compile(module, backend=baseline_backend("aot_eager"))
    sac = torch.compile(module, backend=sc.make_sac_backend((), inner="aot_eager"))
    torch.manual_seed(1)
    _, ref = _grads(lambda m, x: plain(x), module, x)
    torch.manual_seed(1)
    _, got = _grads(lambda m, x: sac(x), module, x)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r)
    torch.manual_seed(2)
    _, other = _grads(lambda m, x: sac(x), module, x)
    assert torch.equal(other[1], got[1]) == (p == 0.0)  # the dropout is live when p > 0
    # and the attention really is recomputed: nothing of it saved but the RNG state it replays
    torch._dynamo.reset()
    report = sc.inspection.capture_partition(
        module, x.requires_grad_(), backend=sc.make_sac_backend((), inner="aot_eager")
    )
    assert not [v for v in report.saved if v.region == "attn"], report.format()
    assert p == 0.0 or any(v.region == "rng" for v in report.saved), report.format()


def test_the_seed_post_pass_untags_seed_draws_only():
    from torch._inductor import inductor_prims as prims  # a submodule: not loaded by `import torch`

    from sac_compile._compat.inductor import seed_creation_ops
    from sac_compile.passes.untag_seeds import UNTAG_SEEDS

    graph = fx.Graph()
    seeds = graph.call_function(prims.seeds, (2, torch.device("cpu")))
    lookup = graph.call_function(prims.lookup_seed, (seeds, 0))
    graph.output(lookup)
    for node in (seeds, lookup):
        node.meta.update(recompute=torch.utils.checkpoint.CheckpointPolicy.MUST_RECOMPUTE, ac_graph_id=1)
    UNTAG_SEEDS(graph)
    assert "recompute" not in seeds.meta and "ac_graph_id" not in seeds.meta
    assert lookup.meta["recompute"] is torch.utils.checkpoint.CheckpointPolicy.MUST_RECOMPUTE
    assert prims.seed in seed_creation_ops()


class _CountingPost(torch._inductor.custom_graph_pass.CustomGraphPass):
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, graph: fx.Graph) -> None:
        self.calls += 1

    def uuid(self) -> bytes:
        return b"counting-post"


@pytest.mark.slow
def test_a_users_joint_post_pass_still_runs_before_ours():
    from sac_compile.passes.untag_seeds import UNTAG_SEEDS

    user = _CountingPost()
    seen = []
    real = type(UNTAG_SEEDS).__call__

    def spy(self, graph):
        seen.append(user.calls)  # ours runs after the user's
        return real(self, graph)

    torch.manual_seed(0)
    module = Attention(0.0)
    backend = sc.make_sac_backend(("attn",), inductor_config={"joint_custom_post_pass": user})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(UNTAG_SEEDS), "__call__", spy)
        torch.compile(module, backend=backend)(torch.randn(2, 6, 16, requires_grad=True)).sum().backward()
    assert user.calls >= 1 and seen and seen[0] == 1


def test_a_nested_selective_checkpoint_does_not_take_the_engines_hook_for_the_users():
    """torch 2.15's SAC warns (FutureWarning) when a user's saved-tensors hooks are active
    around it; the eager engine's own pack hook is the checkpoint's, not the user's (red
    before on 2.15: the warning fired for every nested SAC)."""
    import functools
    import warnings

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def save_mm(ctx, op, *args, **kwargs):
        return (
            CheckpointPolicy.MUST_SAVE
            if op is torch.ops.aten.mm.default
            else CheckpointPolicy.PREFER_RECOMPUTE
        )

    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    contexts = functools.partial(create_selective_checkpoint_contexts, save_mm)

    def fn(x):
        with sc.region("a"):
            h = checkpoint(lambda x: torch.tanh(x @ w), x, use_reentrant=False, context_fn=contexts)
        return torch.sigmoid(h @ w)

    x = torch.randn(4, 8, requires_grad=True)
    want = torch.autograd.grad(fn(x).sum(), [x, w])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = torch.autograd.grad(checkpoint_with_regions(fn, x, keep={"a"}).sum(), [x, w])
    for g, r in zip(got, want, strict=True):
        assert torch.equal(g, r)
