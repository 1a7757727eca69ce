"""Bad input and hostile use: each case gives a clear error, or a reported diagnosis and
correct gradients (issue #6's list, one test or class per item)."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
import torch.nn as nn
from torch._dynamo.testing import CompileCounterWithBackend

import sac_compile as sc
from sac_compile.eager.session import SESSION
from sac_compile.markers import ops

from .models import Block, Stack, run_step

D = 16


def _pair(keep, *, compile=False, n=2, seed=0):
    """(plain, wrapped) stacks with the same weights; every layer of the second wrapped by the seam."""
    torch.manual_seed(seed)
    plain = Stack(n, D)
    wrapped = Stack(n, D)
    wrapped.load_state_dict(plain.state_dict())
    for layer in wrapped.layers:
        sc.apply_selective_checkpointing(
            layer, keep=keep, compile={"inner": "aot_eager"} if compile else False
        )
    return plain, wrapped


def _x(*shape):
    return torch.randn(*(shape or (2, 8, D)), requires_grad=True)


def _assert_same_step(plain, wrapped, x, *, exact=True):
    ref_out, ref = run_step(plain, plain, x)
    out, got = run_step(wrapped, wrapped, x)
    check = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    assert check(out, ref_out)
    for g, r in zip(got, ref, strict=True):
        assert (g is None and r is None) or check(g, r)


def _kinds(caplog) -> set[tuple[str, str]]:
    import re

    found = set()
    for rec in caplog.records:
        m = re.search(r"\[([a-z-]+)\] region '([^']*)'", rec.getMessage())
        if m:
            found.add(m.groups())
    return found


# -- 1. region names ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, error, words",
    [
        (None, TypeError, "must be a str, got NoneType"),
        (1, TypeError, "must be a str, got int"),
        (b"attn", TypeError, "must be a str, got bytes"),
        ("", ValueError, "non-empty string"),
        (" attn", ValueError, "without leading or trailing whitespace"),
        ("a,b", ValueError, "may not contain"),
        ("*", ValueError, "reserved"),
        # reports join overlapping regions with "+" and use these keys for values no region
        # owns: such a name was split (a false kept-nothing) or merged with them
        ("a+b", ValueError, "may not contain"),
        ("a;b", ValueError, "may not contain"),  # separates a scope marker's fields
        ("-", ValueError, "reserved"),
        ("input", ValueError, "reserved"),
        ("param", ValueError, "reserved"),
        ("rng", ValueError, "reserved"),
    ],
)
def test_bad_region_names_are_rejected_everywhere_they_can_be_given(bad, error, words):
    with pytest.raises(error, match=words):
        sc.region(bad)
    with pytest.raises(error, match=words):
        sc.make_sac_backend({bad})
    with pytest.raises(error, match=words):
        sc.apply_selective_checkpointing(Block(D), keep={bad})
    with pytest.raises(error, match=words):
        sc.declare_regions(Stack(1, D), {"layers.*.attn": bad})
    with pytest.raises(error, match=words):
        sc.SacConfig(layers="layers.*", keep={bad})


def test_a_bare_string_keep_is_rejected_not_split_into_letters():
    with pytest.raises(TypeError, match="keep"):
        sc.make_sac_backend("attn")


# -- 2. keep names that never appear ------------------------------------------------------------


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_keep_name_no_marker_records_is_reported_and_training_is_unharmed(compile, caplog):
    plain, wrapped = _pair({"atn"}, compile=compile)  # a typo of "attn"
    x = _x()
    with caplog.at_level(logging.WARNING, logger="sac_compile"):
        for _ in range(2):  # judged when the carrying layer runs again
            _assert_same_step(plain, wrapped, x, exact=not compile)
    assert ("keep-unused", "atn") in _kinds(caplog)


# -- 3. regions under no_grad / inference_mode ----------------------------------------------------


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_regions_entered_without_grad_run_plainly_and_leave_training_intact(mode, compile, caplog):
    plain, wrapped = _pair({"attn"}, compile=compile)
    with mode():
        x = torch.randn(2, 8, D)
        assert torch.allclose(wrapped(x), plain(x), rtol=1e-5, atol=1e-6)
    assert SESSION.get() is None and ops.current_sink() is None
    _assert_same_step(plain, wrapped, _x(), exact=not compile)  # then training works as before
    assert not {k for k, _ in _kinds(caplog)} & {"unbalanced", "kept-nothing", "no-pass"}


def test_a_region_opened_under_no_grad_inside_a_training_forward():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

        def forward(self, x):
            with torch.no_grad(), sc.region("stats"):
                scale = self.a(x).abs().mean()  # no graph: nothing to keep
            with sc.region("body"):
                return self.b(x).tanh() * scale

    torch.manual_seed(0)
    plain = M()
    wrapped = M()
    wrapped.load_state_dict(plain.state_dict())
    sc.apply_selective_checkpointing(wrapped, keep={"stats", "body"})
    _assert_same_step(plain, wrapped, _x())


# -- 4. a graph break inside a region -------------------------------------------------------------


class _Breaking(nn.Module):
    def __init__(self, decorated: bool):
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.decorated = decorated

    @sc.region("mlp")
    def _decorated(self, h):
        h = torch.relu(h)
        torch._dynamo.graph_break()
        return self.down(h)

    def forward(self, x):
        h = self.up(x)
        if self.decorated:
            h = self._decorated(h)
        else:
            with sc.region("mlp"):
                h = torch.relu(h)
                torch._dynamo.graph_break()
                h = self.down(h)
        return h.sin()


@pytest.mark.parametrize(
    "decorated, graphs, kind",
    # decorator: the break splits every frame on the stack: the caller (up | sin), the @region
    # wrapper (enter | exit) and the decorated function (relu | down): 6 graphs, all tagged.
    # with-block: Dynamo cannot resume inside a user `with`, so forward runs eagerly; only
    # region.__enter__ / __exit__'s own frames compile (2 graphs), and it is reported.
    [(True, 6, "graph-break"), (False, 2, "eager-fallback")],
    ids=["decorator", "with-block"],
)
def test_a_graph_break_inside_a_region(decorated, graphs, kind, caplog):
    torch.manual_seed(0)
    m = _Breaking(decorated)
    counter = CompileCounterWithBackend(sc.make_sac_backend({"mlp"}, inner="aot_eager"))
    x = _x()
    with caplog.at_level(logging.WARNING, logger="sac_compile"):
        ref_out, ref = run_step(m, m, x)
        out, got = run_step(torch.compile(m, backend=counter), m, x)
    assert counter.frame_count == graphs
    assert (kind, "mlp") in _kinds(caplog)
    assert torch.allclose(out, ref_out, rtol=1e-5, atol=1e-6)
    for g, r in zip(got, ref, strict=True):
        assert torch.allclose(g, r, rtol=1e-5, atol=1e-6)


# -- 5. a whole model compiled over per-layer compile=True layers ------------------------------------


def test_whole_model_compile_over_compile_true_layers_is_reported_and_correct(caplog):
    plain, wrapped = _pair({"attn"}, compile=True)
    outer = torch.compile(wrapped, backend="aot_eager")
    x = _x()
    with caplog.at_level(logging.WARNING, logger="sac_compile"):
        ref_out, ref = run_step(plain, plain, x)
        out, got = run_step(outer, wrapped, x)
    assert any(k == "compile-swallowed" for k, _ in _kinds(caplog)), caplog.text
    assert torch.allclose(out, ref_out, rtol=1e-5, atol=1e-6)
    for g, r in zip(got, ref, strict=True):
        assert torch.allclose(g, r, rtol=1e-5, atol=1e-6)


# -- 6. dynamic shapes and recompilation ---------------------------------------------------------


def test_dynamic_sequence_length_compiles_once_and_keeps_the_region():
    torch.manual_seed(0)
    block = Block(D)
    counter = CompileCounterWithBackend(sc.make_sac_backend({"attn"}, inner="aot_eager"))
    compiled = torch.compile(block, backend=counter)
    with sc.inspection.collect_records() as records:
        for seq in (8, 12, 5):
            x = torch.randn(2, seq, D, requires_grad=True)
            torch._dynamo.mark_dynamic(x, 1)
            ref_out, ref = run_step(block, block, x)
            out, got = run_step(compiled, block, x)
            assert torch.allclose(out, ref_out, rtol=1e-5, atol=1e-6)
            for g, r in zip(got, ref, strict=True):
                assert torch.allclose(g, r, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1  # one dynamic graph serves every length
    training = [r for r in records if r.is_training]
    assert len(training) == 1 and training[0].regions["attn"].saved_nodes > 0


def test_a_recompile_is_tagged_again():
    torch.manual_seed(0)
    block = Block(D)
    counter = CompileCounterWithBackend(sc.make_sac_backend({"attn"}, inner="aot_eager"))
    compiled = torch.compile(block, backend=counter, dynamic=False)
    with sc.inspection.collect_records() as records:
        for shape in ((2, 8, D), (3, 8, D)):  # a new static shape: a recompile
            x = torch.randn(*shape, requires_grad=True)
            ref_out, ref = run_step(block, block, x)
            out, got = run_step(compiled, block, x)
            for g, r in zip(got, ref, strict=True):
                assert torch.allclose(g, r, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 2
    training = [r for r in records if r.is_training]
    assert len(training) == 2 and all(r.regions["attn"].saved_nodes > 0 for r in training)


# -- 7. autocast (bfloat16 on CPU) ---------------------------------------------------------------


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_autocast_bfloat16(compile):
    plain, wrapped = _pair({"attn", "mlp"}, compile=compile)
    x = _x()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_out, ref = run_step(plain, plain, x)
        out, got = run_step(wrapped, wrapped, x)
    assert out.dtype == ref_out.dtype  # float32: the residual adds bf16 to the fp32 stream
    if compile:  # the same bf16 ops, compiled: bf16 rounding
        assert torch.allclose(out.float(), ref_out.float(), rtol=2e-2, atol=2e-2)
        for g, r in zip(got, ref, strict=True):
            assert torch.allclose(g, r, rtol=5e-2, atol=5e-2)
    else:  # the eager engine replays autocast's casts: bit-identical
        assert torch.equal(out, ref_out)
        for g, r in zip(got, ref, strict=True):
            assert torch.equal(g, r)


def test_autocast_kept_values_are_saved_in_bfloat16():
    torch.manual_seed(0)
    block = Block(D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = sc.inspection.capture_partition(
            block, _x(), backend=sc.make_sac_backend({"mlp"}, inner="aot_eager")
        )
    kept = [v for v in report.saved if v.region == "mlp"]
    assert kept and any(v.dtype == "bfloat16" for v in kept)


# -- 8. a module called twice in one step ------------------------------------------------------------


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block(D)

    def forward(self, x):
        return self.block(self.block(x))  # weight sharing: the same wrapped layer twice


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_layer_called_twice_in_one_step(compile):
    torch.manual_seed(0)
    plain = _Twice()
    wrapped = _Twice()
    wrapped.load_state_dict(plain.state_dict())
    sc.apply_selective_checkpointing(
        wrapped.block, keep={"attn"}, compile={"inner": "aot_eager"} if compile else False
    )
    _assert_same_step(plain, wrapped, _x(), exact=not compile)


# -- 9. an exception inside a region -----------------------------------------------------------


class _Fails(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.fail = False

    def forward(self, x):
        with sc.region("body"):
            h = self.lin(x).tanh()
            if self.fail:
                raise RuntimeError("boom inside the region")
        return h * 2


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_an_exception_inside_a_region_restores_the_session(compile):
    torch.manual_seed(0)
    plain, wrapped = _Fails(), _Fails()
    wrapped.load_state_dict(plain.state_dict())
    sc.apply_selective_checkpointing(
        wrapped, keep={"body"}, compile={"inner": "aot_eager"} if compile else False
    )
    wrapped.fail = True
    with pytest.raises(RuntimeError, match="boom inside the region"):
        wrapped(_x())
    assert SESSION.get() is None and ops.current_sink() is None
    wrapped.fail = False
    _assert_same_step(plain, wrapped, _x(), exact=not compile)
    assert SESSION.get() is None


# -- 10. threads running two models ----------------------------------------------------------------


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_two_models_in_two_threads(compile):
    """Two differently configured models train at once in two threads: each matches its own
    single-threaded reference (the marker session is per thread / per context)."""
    pairs = [_pair({"attn"}, compile=compile, seed=1), _pair({"mlp"}, compile=compile, seed=2)]
    inputs = [_x(), _x()]
    refs = [run_step(plain, plain, x) for (plain, _), x in zip(pairs, inputs)]
    results: list = [None, None]
    errors: list = []
    start = threading.Barrier(2)

    def train(i):
        try:
            start.wait()
            for _ in range(3):
                results[i] = run_step(pairs[i][1], pairs[i][1], inputs[i])
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    check = (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)) if compile else torch.equal
    for (ref_out, ref), (out, got) in zip(refs, results, strict=True):
        assert check(out, ref_out)
        for g, r in zip(got, ref, strict=True):
            assert check(g, r)
