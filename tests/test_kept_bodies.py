"""Kept declared modules under SAVE_ALL skip their body in the eager recompute (eager/kept_bodies.py)."""

import copy
import gc

import pytest
import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

import sac_compile as sc
from sac_compile._compat.checkpoint import top_saved_tensors_hooks
from sac_compile.eager import checkpoint_with_regions
from sac_compile.policy import SAVE_ALL, SAVE_COSTLY
from sac_compile.testing.models import Block


def _block(dropout=0.2):
    torch.manual_seed(0)
    block = Block(16, dropout=dropout, marked=False)
    sc.declare_regions(block, {"attn": "attn"})
    runs = []
    block.attn.qkv.register_forward_pre_hook(lambda m, a: runs.append(torch.is_grad_enabled()))
    return block, runs


def _step(block, mode, **kwargs):
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(5)
    stats = []
    if mode == "none":
        out = block(x)
    elif mode == "full":
        out = checkpoint(block, x, use_reentrant=False)
    else:
        out = checkpoint_with_regions(block, x, stats_out=stats, **kwargs)
    out.sum().backward()
    grads = [p.grad.clone() for p in block.parameters()] + [x.grad]
    block.zero_grad(set_to_none=True)
    return out.detach(), grads, (stats[0] if stats else None)


def _assert_bit_identical(a, b):
    assert torch.equal(a[0], b[0])
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


def test_a_kept_declared_module_under_save_all_runs_once_per_step():
    """The attention module (dropout inside it and after it) runs in the forward only: the
    recompute hands back its outputs, and the generator is where the forward left it, so the
    dropout after it draws the same mask. Red before: the recompute ran the body again
    (under a dispatch mode that served each op), two runs of its qkv projection per step."""
    block, runs = _block()
    ref = _step(block, "none")
    runs.clear()
    got = _step(block, "engine", keep=frozenset({"attn"}), policy=SAVE_ALL)
    _assert_bit_identical(got, ref)
    stats = got[2]
    assert len(runs) == 1
    assert stats.bodies == {"skipped": 1}
    assert not stats.intercepted  # no dispatch mode at all
    assert stats.held_by_region["attn"] > 0  # (what autograd saved inside it, and its output)

    runs.clear()  # the default policy recomputes the module's cheap ops: it runs twice
    _assert_bit_identical(_step(block, "engine", keep=frozenset({"attn"}), policy=SAVE_COSTLY), ref)
    assert len(runs) == 2


def test_a_skipped_body_holds_what_caching_its_every_op_held():
    """SAVE_ALL's op cache held 235,456 B for this block (measured before the bodies were
    skipped); the skipped body holds that less its input, the norm's output its projection
    saves (4 x 32 x 64 floats), which the recompute remakes: torch_remat holds no more."""
    torch.manual_seed(0)
    block = Block(64, marked=False)
    sc.declare_regions(block, {"attn": "attn"})
    x = torch.randn(4, 32, 64, requires_grad=True)
    params = list(block.parameters())
    none = sc.inspection.autograd_saved_bytes(block, x, exclude=params)
    kept = sc.inspection.autograd_saved_bytes(
        lambda x: checkpoint_with_regions(block, x, keep=frozenset({"attn"}), policy=SAVE_ALL),
        x,
        exclude=params,
    )
    assert kept == 235_456 - 4 * 32 * 64 * 4 < none


def _engine_matches_no_checkpoint(model, keep):
    """Gradients of ``model`` under the engine (SAVE_ALL) equal no checkpoint's, bit for
    bit; the engine's statistics."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2), requires_grad=True)
    torch.manual_seed(7)  # (the same dropout masks in both runs)
    ref = torch.autograd.grad(model(x).sum(), [x, *model.parameters()])
    stats = []
    torch.manual_seed(7)
    out = checkpoint_with_regions(model, x, keep=frozenset(keep), policy=SAVE_ALL, stats_out=stats)
    got = torch.autograd.grad(out.sum(), [x, *model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    return stats[0]


class _Writes(nn.Module):
    """A linear layer that scales its input in place first (when ``into_input``)."""

    def __init__(self, into_input: bool):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.into_input = into_input

    def forward(self, x):
        if self.into_input:
            x.mul_(2)
        return self.lin(x).sin()


class _Outer(nn.Module):
    def __init__(self, into_input: bool, into_output: bool):
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.body = _Writes(into_input)
        self.into_output = into_output

    def forward(self, x):
        h = self.body(self.pre(x) + 1)  # (nothing saves the sum: the body may write it)
        if self.into_output:
            h.add_(1)  # outside the region, after the forward returned it
        return (h * x).cos()


@pytest.mark.parametrize("into_input,into_output", [(True, False), (False, True)], ids=["input", "output"])
def test_a_body_that_writes_its_input_or_whose_output_is_written_runs_again(into_input, into_output):
    """The kept output cannot stand for the body: the recompute makes the input anew (and
    must write it), or the output was written after it was kept. Red without the version
    checks: the recompute served an unwritten input's reader / the written output."""
    torch.manual_seed(0)
    model = _Outer(into_input, into_output)
    sc.declare_regions(model, {"body": "body"})
    assert _engine_matches_no_checkpoint(model, {"body"}).bodies == {"rerun": 1}


def test_a_body_the_recompute_never_reaches_keeps_no_output():
    """Nothing is saved after the body (the checkpoint's early stop ends the recompute
    before it): its output is not kept; what autograd saved inside it still counts."""
    torch.manual_seed(0)
    model = _Outer(False, False)
    model.forward = lambda x: model.body(model.pre(x) + 1)  # the body last, its output returned
    sc.declare_regions(model, {"body": "body"})
    x = torch.randn(4, 8, requires_grad=True)
    stats = []
    out = checkpoint_with_regions(model, x, keep=frozenset({"body"}), policy=SAVE_ALL, stats_out=stats)
    ref = torch.autograd.grad(model(x).sum(), [x])
    assert torch.equal(torch.autograd.grad(out.sum(), [x])[0], ref[0])
    assert stats[0].bodies == {"unreached": 1}
    assert stats[0].held_by_region["body"] > 0


def test_kept_bodies_under_every_wrapping_of_a_stack():
    """Through the seam (SacConfig, every block wrapped): output and gradients equal plain
    full recompute, and each block's attention body is skipped."""
    torch.manual_seed(0)
    stack = nn.Sequential(*(Block(16, dropout=0.1, marked=False) for _ in range(3)))
    x = torch.randn(2, 6, 16, requires_grad=True)
    full = copy.deepcopy(stack)
    sc.SacConfig(layers="*", keep={"attn"}, regions={"*.attn": "attn"}, policy=SAVE_ALL).apply(stack)
    runs = []
    for block in stack:
        block.attn.qkv.register_forward_pre_hook(lambda m, a: runs.append(1))
    torch.manual_seed(3)
    out = stack(x)
    got = torch.autograd.grad(out.sum(), [x, *stack.parameters()])
    torch.manual_seed(3)
    ref_out = x
    for block in full:
        ref_out = checkpoint(block, ref_out, use_reentrant=False)
    ref = torch.autograd.grad(ref_out.sum(), [x, *full.parameters()])
    assert torch.equal(out, ref_out)
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    assert len(runs) == 3  # one per block, in the forward


def test_your_saved_tensors_hooks_see_what_a_skipped_body_saves():
    """Outside the checkpoint, your hooks (offloading, say) get the tensors autograd saves
    inside a skipped body, as without checkpointing. Red when the body's hook kept them
    for itself."""
    block, _ = _block(dropout=0.0)
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t

    x = torch.randn(2, 6, 16, requires_grad=True)
    h = block.ln1(x).detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block.attn(h)
    inside = len(packed)  # what the body saves, without checkpointing
    packed.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = checkpoint_with_regions(block, x, keep=frozenset({"attn"}), policy=SAVE_ALL)
    out.sum().backward()
    assert len(packed) >= inside > 0


def test_a_module_called_in_and_out_of_a_kept_span_is_skipped_only_where_it_was():
    """The kept module runs twice: first inside a kept ``with region`` block (the dispatch
    mode's business, not skipped), then on its own (skipped). Red when the recompute's
    forward handed the second call's outputs to the first."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(8, 8)

        def forward(self, x):
            with sc.region("outer"):
                a = self.body(x).sin()
            return (self.body(a * 2) * a).cos()

    torch.manual_seed(0)
    model = Twice()
    sc.declare_regions(model, {"body": "body"})
    assert _engine_matches_no_checkpoint(model, {"body", "outer"}).bodies == {"skipped": 1}


def test_a_kept_module_compiled_on_its_own_is_not_skipped():
    """``module.compile()``: Dynamo traces the module's hooks, which emit marker ops instead
    of calling the engine, so the body is not skipped; it goes through the dispatch mode
    (re-run whole, as any compiled code inside the eager engine), gradients right."""
    block, _ = _block(dropout=0.0)
    ref = _step(block, "none")
    block.attn.compile(backend="eager")
    got = _step(block, "engine", keep=frozenset({"attn"}), policy=SAVE_ALL)
    torch.testing.assert_close(got[0], ref[0])
    for a, b in zip(got[1], ref[1], strict=True):
        torch.testing.assert_close(a, b)
    assert got[2].bodies == {}


def test_a_kept_module_under_hooks_pushed_inside_the_checkpointed_function_is_not_skipped():
    """Saved-tensor hooks of yours around the module call, inside the checkpointed function,
    sit on top of the engine's: the body then goes through the dispatch mode (and your
    hooks), in the forward and in the recompute alike. Red without the check: the body's
    tensors went to the checkpoint, which the skipped recompute never refilled."""
    packed = []

    class Hooked(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(8, 8)

        def forward(self, x):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t, lambda t: t):
                h = self.body(x).sin()
            return (self.body(h) * x).cos()  # (a second call, outside your hooks: skipped)

    torch.manual_seed(0)
    model = Hooked()
    sc.declare_regions(model, {"body": "body"})
    assert _engine_matches_no_checkpoint(model, {"body"}).bodies == {"skipped": 1} and packed


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_transformers_decoders_keeping_every_region_under_save_all(family):
    """Every decoder layer wrapped by ``hf.config_for`` (regions declared by module path),
    every region kept, SAVE_ALL: loss and gradients equal no checkpoint bit for bit, and
    every linear layer inside the decoder layers runs as often as without checkpointing
    (once per step: no kept module body runs in the recompute; red before, when the
    recompute ran them again, serving their ops from the cache)."""
    import copy

    from sac_compile import hf
    from sac_compile.testing import hf_families

    make = hf_families.tiny_llama if family == "llama" else hf_families.tiny_qwen3_moe
    model = make(layers=2)
    model.train()
    ids = hf.batch(model)
    wrapped = copy.deepcopy(model)
    hf.config_for(wrapped, keep=sc.ALL_REGIONS, policy=SAVE_ALL).apply(wrapped)
    losses, grads, runs = [], [], []
    for m in (model, wrapped):
        calls = []
        for layer in m.model.layers:
            for sub in layer.modules():
                if isinstance(sub, nn.Linear):
                    sub.register_forward_pre_hook(lambda mod, a, calls=calls: calls.append(1))
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad for p in m.parameters()])
        runs.append(len(calls))
    assert torch.equal(losses[0], losses[1])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    assert runs[1] == runs[0] > 0, runs


class _Decorated(nn.Module):
    """Kept regions as decorated functions: a method (dropout inside) called twice, the
    second time inside a kept ``with region`` block, and a plain function writing its
    input in place."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3)

    @sc.region("body")
    def body(self, x):
        return self.drop(self.lin(x).sin())

    def forward(self, x):
        h = self.body(x) * 2
        with sc.region("outer"):
            h = self.body(h)  # (inside a kept span: the dispatch mode's, not skipped)
        g = _scaled(h + 1)  # writes its argument: runs again in the recompute
        return (self.drop(g) * x).cos()


@sc.region("body")
def _scaled(h):
    h.mul_(3)
    return h.tanh()


def test_kept_decorated_functions_skip_their_body_like_declared_modules():
    """Red before: the decorator's wrapper emitted markers only, so under SAVE_ALL the
    recompute ran every call again under the dispatch mode (the linear ran 4 times)."""
    torch.manual_seed(0)
    model = _Decorated()
    runs = []
    model.lin.register_forward_pre_hook(lambda m, a: runs.append(1))
    stats = _engine_matches_no_checkpoint(model, {"body", "outer"})
    assert stats.bodies == {"skipped": 1, "rerun": 1}
    assert len(runs) == 2 + 3  # two calls in the reference run; the engine's: 2 + 1 in the recompute


# --- Cases a second reader found (each wrong or crashing before its fix) ------------------


def test_a_forward_hook_registered_before_the_declaration_applies_once():
    """A hook that changes the module's output runs again on the handed-back output in the
    recompute: what is kept is the module's own output (red: it kept the hook's, doubled)."""
    torch.manual_seed(0)
    model = _Outer(False, False)
    model.body.register_forward_hook(lambda mod, args, out: out * 2)
    sc.declare_regions(model, {"body": "body"})
    assert _engine_matches_no_checkpoint(model, {"body"}).bodies == {"skipped": 1}


def test_a_kept_output_written_after_the_checkpointed_function_returned_is_an_error():
    lin = nn.Linear(4, 4)
    sc.declare_regions(lin, {"": "lin"})

    def fn(x):
        h = lin(x)
        return h, (h + 1).sin()  # nothing saves h itself: autograd lets it be written

    h, v = checkpoint_with_regions(
        fn, torch.randn(3, 4, requires_grad=True), keep=frozenset({"lin"}), policy=SAVE_ALL
    )
    h.mul_(2)
    with pytest.raises(
        RuntimeError, match=r"output of kept region 'lin' \(Linear\) was written in place after"
    ):
        (h.sum() + v.sum()).backward()


def test_a_decorated_function_defined_inside_the_checkpointed_function():
    """A new function object in each pass (red: the recompute's sanity check took it for
    another function and raised an internal error)."""
    lin = nn.Linear(4, 4)

    def fn(x):
        @sc.region("r")
        def body(h):
            return lin(h)

        return body(x).sin()

    x = torch.randn(3, 4, requires_grad=True)
    ref = torch.autograd.grad(fn(x).sum(), x)[0]
    stats = []
    out = checkpoint_with_regions(fn, x, keep=frozenset({"r"}), policy=SAVE_ALL, stats_out=stats)
    assert torch.equal(torch.autograd.grad(out.sum(), x)[0], ref)
    assert stats[0].bodies == {"skipped": 1}


def test_without_rng_preservation_a_skipped_body_leaves_the_generator_alone():
    """Red: the recompute set the generator back to where the forward left it, so a draw
    made between forward and backward was drawn again after the backward."""
    drop = nn.Dropout(0.5)
    sc.declare_regions(drop, {"": "d"})
    lin = nn.Linear(4, 4)
    x = torch.randn(64, 4, requires_grad=True)
    torch.manual_seed(1)
    out = checkpoint_with_regions(
        lambda x: lin(drop(x)).sin(), x, keep=frozenset({"d"}), policy=SAVE_ALL, preserve_rng_state=False
    )
    first = torch.rand(3)
    out.sum().backward()
    assert not torch.equal(torch.rand(3), first)


def test_the_call_is_freed_without_the_cyclic_collector():
    """Red: our pack hook, kept on the call's state, held the checkpoint's frame, which holds
    the checkpointed function and so the state: the kept outputs lived until a collection."""
    import gc
    import weakref

    from sac_compile.eager import kept_bodies as bodies

    made = []
    real = bodies.Bodies.__init__

    def spy(self, state):
        real(self, state)
        made.append(weakref.ref(self))

    lin = nn.Linear(16, 16)
    sc.declare_regions(lin, {"": "lin"})
    x = torch.randn(8, 16, requires_grad=True)
    gc.collect()
    gc.disable()
    try:
        bodies.Bodies.__init__ = spy
        out = checkpoint_with_regions(lambda x: lin(x).sin(), x, keep=frozenset({"lin"}), policy=SAVE_ALL)
        out.sum().backward()
        del out
        assert made[0]() is None
    finally:
        bodies.Bodies.__init__ = real
        gc.enable()


def test_an_interrupt_inside_a_kept_body_leaves_no_saved_tensor_hook_behind():
    """KeyboardInterrupt skips a module's hooks (they run on Exception only); red: the
    popped hooks were never pushed back and the enclosing contexts popped the wrong ones."""

    class Stop(nn.Module):
        def forward(self, x):
            raise KeyboardInterrupt

    stop = Stop()
    sc.declare_regions(stop, {"": "r"})
    with pytest.raises(KeyboardInterrupt):
        checkpoint_with_regions(
            stop, torch.randn(2, requires_grad=True), keep=frozenset({"r"}), policy=SAVE_ALL
        )
    assert top_saved_tensors_hooks() is None


def test_an_output_pytree_cannot_open_makes_the_body_run_again():
    """An object pytree does not know is not kept (it could not be detached or checked)."""

    class Box:
        def __init__(self, t):
            self.t = t

    class Boxed(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return Box(self.lin(x))

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = Boxed()

        def forward(self, x):
            return (self.body(x).t.sin() * x).cos()

    torch.manual_seed(0)
    model = Outer()
    sc.declare_regions(model, {"body": "body"})
    assert _engine_matches_no_checkpoint(model, {"body"}).bodies == {"rerun": 1}


class _Inner(nn.Module):
    """Saves its argument (``a``) and a slice of it (``b``: a view on the argument's storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.a(x)) + self.b(x[..., 2:6])


class _Around(nn.Module):
    """``pre`` -> the kept ``inner`` -> ``post`` (``post=False``: the body ends the layer)."""

    def __init__(self, post: bool) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.inner = _Inner()
        self.post = nn.Linear(8, 8) if post else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.inner(torch.relu(self.pre(x))))


@pytest.mark.parametrize("post", [True, False], ids=["body-mid-layer", "body-ends-layer"])
@pytest.mark.parametrize("early_stop", [True, False])
def test_a_skipped_body_does_not_hold_the_arguments_it_saves(post, early_stop):
    """What autograd saves inside a skipped body that is its argument, or a view of it, is
    not held: it goes to a checkpoint holder, which the recompute fills with the argument it
    remakes (as torch_remat does). Red before: the body held the argument (``pre``'s output,
    made inside the checkpoint) to the backward. Gradients stay bit-identical, where the body
    ends the layer too (the recompute must reach it), with and without early stop, and
    through a second backward of the same graph."""
    torch.manual_seed(0)
    layer = _Around(post)
    sc.declare_regions(layer, {"inner": "inner"})
    arguments = []
    layer.inner.register_forward_pre_hook(
        lambda m, a: arguments.append(StorageWeakRef(a[0].untyped_storage()))
    )
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ref_out = layer(x)
    ref = torch.autograd.grad(ref_out.sum(), [x, *layer.parameters()])
    arguments.clear()
    stats = []
    out = checkpoint_with_regions(
        layer, x, keep=frozenset({"inner"}), policy=SAVE_ALL, early_stop=early_stop, stats_out=stats
    )
    gc.collect()
    assert len(arguments) == 1 and arguments[0].expired()
    # (ending the layer under early stop, its outputs are not kept: the recompute stops as it
    # fills the body's holders)
    assert stats[0].bodies == {"unreached" if early_stop and not post else "skipped": 1}
    for _ in range(2):
        got = torch.autograd.grad(out.sum(), [x, *layer.parameters()], retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
