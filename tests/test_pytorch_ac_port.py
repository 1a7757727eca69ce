"""PyTorch's own activation-checkpointing tests, run through our backend.

Ported from PyTorch's ``test/dynamo/test_activation_checkpointing.py`` (pytorch/pytorch at
0069a4184a83906c61f844b32e90e3a87705344a, the copy with the
``torch.autograd.graph.region_activation_memory_budget`` tests that torch 2.13.0 ships; the
2.13.0 wheel is the ground truth for the APIs used). Each test asserts what PyTorch's asserts,
on the CPU, with our backend in place of PyTorch's:

* ``backend="inductor"`` -> ``sc.sac_backend``;
* ``backend="aot_eager"`` -> ``sc.make_sac_backend(inner="aot_eager")``;
* a backend the test builds (``aot_autograd(fw_compiler=..., bw_compiler=..., partition_fn=...)``,
  ``aot_eager_decomp_partition``) -> ``sc.make_sac_backend(inner=<that backend>)``. The counting
  compilers must still be called (asserted: a wrapper that dropped them would pass vacuously).

The models have no ``sac_compile`` marker, so the contract is that our backend changes nothing:
a ``torch.utils.checkpoint`` policy, ``activation_memory_budget`` and
``region_activation_memory_budget`` decide what is saved exactly as under PyTorch's backend.
The last tests state that contract directly (saved bytes equal to PyTorch's), and that a marked
region is kept through a custom ``aot_autograd`` backend.

CUDA-gated upstream tests that measure activation memory with ``torch.cuda.memory_stats`` run
on the CPU here and measure the bytes autograd holds for the backward
(``saved_tensors_hooks``, distinct storages, the inputs' and parameters' left out): the same
quantity as upstream's ``requested_bytes`` delta. Sizes are small; the upstream
``_compare_orig_and_checkpointed_fns`` compiles with ``aot_eager`` (ours) instead of Inductor.

``SAC_AC_PORT_REFERENCE=1`` runs every ported test with PyTorch's backend in place of ours
(to check the tests themselves; the contract tests then compare PyTorch with itself).
"""

from __future__ import annotations

import copy
import functools
import os
from importlib import import_module

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint
from functorch.compile import default_partition, min_cut_rematerialization_partition, nop
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend
from torch._higher_order_ops.wrap import tag_activation_checkpoint
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import sac_compile as sc

from .releases import extended

REFERENCE = os.environ.get("SAC_AC_PORT_REFERENCE") == "1"

PARTITIONERS = pytest.mark.parametrize(
    "partition_fn",
    [min_cut_rematerialization_partition, default_partition],
    ids=["min_cut", "default_partition"],
)


# --- The substitution --------------------------------------------------------------------


_MODE = {"whole_graph": False}


def sac(inner):
    """Our backend in place of PyTorch's ``inner`` ("inductor", "aot_eager", or a backend object)."""
    if REFERENCE:
        return inner
    whole = _MODE["whole_graph"]
    if inner == "inductor":
        return sc.make_sac_backend(whole_graph=True) if whole else sc.sac_backend
    return sc.make_sac_backend(inner=inner, whole_graph=whole)


# extended: the untouched variant (its graphs are PyTorch's own backend's, tests/test_drop_in.py)
@pytest.fixture(params=[pytest.param(False, marks=extended), True], ids=["untouched", "tagging_pass"])
def both_ways(request, monkeypatch):
    """Each checkpoint test twice: with the graph handed to PyTorch's backend untouched (no
    marker: the default), and with ``whole_graph=True``, where our tagging pass runs on every
    joint graph: in a graph holding ``torch.utils.checkpoint`` regions those are the scopes and,
    with no marker inside, PyTorch's own policy decides every node (the pass adds no tag)."""
    monkeypatch.setitem(_MODE, "whole_graph", request.param)


BOTH_WAYS = pytest.mark.usefixtures("both_ways")


def decomp_partition():
    return torch._dynamo.lookup_backend("aot_eager_decomp_partition")


# --- Upstream's helpers ------------------------------------------------------------------


def count_ops(gm, args, freq=None, freq_ge=None, op=None, freqs=None, freqs_ge=None, ops=None):
    """Upstream's ``count_ops`` (rng wrappers counted as their op)."""

    def match_rng_op(node, op):
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            if node.name == "run_and_save_rng_state":
                return node.args[0] == op
            elif node.name == "run_with_rng_state":
                return node.args[1] == op
            elif node.name == "graphsafe_run_with_rng_state":
                return node.args[0] == op
        return False

    if op is not None:
        ops = [op]
    if freq is not None:
        freqs = [freq]
    if freq_ge is not None:
        freqs_ge = [freq_ge]
    counts = [sum(1 for n in gm.graph.nodes if match_rng_op(n, o) or n.target == o) for o in ops]
    if freqs:
        for o, f, c in zip(ops, freqs, counts):
            assert c == f, f"In graph {gm}, expected {o} to have occurred {f} times, but got {c}."
    else:
        for o, f, c in zip(ops, freqs_ge, counts):
            assert c >= f, f"In graph {gm}, expected {o} to have occurred at least {f} times, but got {c}."
    return gm


class Counting:
    """``functools.partial(count_ops, ...)`` as a compiler that records that it ran."""

    def __init__(self, **expected):
        self.expected = expected
        self.calls = 0

    def __call__(self, gm, example_inputs):
        self.calls += 1
        return count_ops(gm, example_inputs, **self.expected)


def counting_backend(fw, bw, partition_fn, **kwargs):
    fw_compiler, bw_compiler = Counting(**fw), Counting(**bw)
    backend = aot_autograd(
        fw_compiler=fw_compiler, bw_compiler=bw_compiler, partition_fn=partition_fn, **kwargs
    )
    return backend, fw_compiler, bw_compiler


def assert_ran(*compilers):
    for c in compilers:
        assert c.calls >= 1, "the test's own compiler was never called"


def _grad_close(a, b):
    if a is None or b is None:
        assert a is None and b is None
    else:
        torch.testing.assert_close(a, b)


def validate(fn, backend, *args, skip_check=False, fullgraph=True):
    """Upstream's ``_validate``: compiled outputs and gradients equal eager's."""
    cloned_args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    cloned_fn = copy.deepcopy(fn)
    torch.manual_seed(0)
    expected = fn(*args)
    expected.sum().backward()
    torch.manual_seed(0)
    result = torch.compile(cloned_fn, fullgraph=fullgraph, backend=backend)(*cloned_args)
    result.sum().backward()
    if not skip_check:
        torch.testing.assert_close(result, expected)
        for a, c in zip(args, cloned_args):
            _grad_close(a.grad, c.grad)


def compare_orig_and_checkpointed_fns(orig_fn, checkpointed_fn, *args):
    """Upstream's ``_compare_orig_and_checkpointed_fns``: the function with and without its
    checkpoint, compiled (our aot_eager backend) and exported, give the same outputs and
    gradients."""

    def clone_args(args):
        return [a.detach().clone().requires_grad_(a.requires_grad) for a in args]

    def run(compiler):
        orig_args = clone_args(args)
        torch.manual_seed(0)
        result_orig = compiler(orig_fn)(*orig_args)
        result_orig.sum().backward()
        ckpt_args = clone_args(args)
        torch.manual_seed(0)
        result_ckpt = compiler(copy.deepcopy(checkpointed_fn))(*ckpt_args)
        result_ckpt.sum().backward()
        torch.testing.assert_close(result_orig, result_ckpt)
        for a, b in zip(orig_args, ckpt_args):
            _grad_close(a.grad, b.grad)

    run(functools.partial(torch.compile, fullgraph=True, backend=sac("aot_eager")))

    def export_compiler(fn):
        class WrapAsModule(nn.Module):
            def forward(self, *args, **kwargs):
                return fn(*args, **kwargs)

        mod = WrapAsModule()

        def runtime_wrapper(*runtime_args):
            from torch.export import _trace

            gm = _trace._export_to_torch_ir(
                f=mod,
                args=tuple(clone_args(args)),
                kwargs={},
                dynamic_shapes=None,
                preserve_module_call_signature=(),
                restore_fqn=False,
                prefer_deferred_runtime_asserts_over_guards=False,
                _log_export_usage=False,
            )
            return torch.compile(gm, fullgraph=False, backend=sac(decomp_partition()))(*runtime_args)

        return runtime_wrapper

    run(export_compiler)


def _get_custom_policy(no_recompute_list=None, must_recompute_list=None):
    def _custom_policy(ctx, func, *args, **kwargs):
        if no_recompute_list is not None and func in no_recompute_list:
            return CheckpointPolicy.MUST_SAVE
        if must_recompute_list is not None and func in must_recompute_list:
            return CheckpointPolicy.MUST_RECOMPUTE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return _custom_policy


def _no_recompute_mm():
    return create_selective_checkpoint_contexts(
        _get_custom_policy(no_recompute_list=[torch.ops.aten.mm.default])
    )


def _storage_key(t):
    return t.untyped_storage().data_ptr()


def held_bytes(f, exclude=()):
    """Bytes autograd holds for the backward after ``out = f()``: the distinct storages packed
    by ``saved_tensors_hooks``, those of ``exclude`` (inputs, parameters) and of the output
    left out. Upstream measures the same with ``torch.cuda.memory_stats`` around ``f()``.
    Runs ``f().backward()`` once first (warm-up), as upstream's ``get_act_mem`` does."""
    f().sum().backward()
    skip = {_storage_key(t) for t in exclude}
    packed = {}

    def pack(t):
        packed[_storage_key(t)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = f()
    skip.add(_storage_key(out))
    held = sum(n for k, n in packed.items() if k not in skip)
    out.sum().backward()
    return held


def _inputs_of(model, *xs):
    return [*model.parameters(), *xs]


# --- ActivationCheckpointingViaTagsTests: tags from torch.utils.checkpoint ----------------


@BOTH_WAYS
@PARTITIONERS
def test_tags_function(partition_fn):
    def gn(x, y):
        return torch.sigmoid(torch.matmul(x, y))

    def fn(x, y):
        return torch.utils.checkpoint.checkpoint(gn, torch.sin(x), y, use_reentrant=True)

    x = torch.randn(4, 4, requires_grad=True)
    y = torch.randn(4, 4, requires_grad=True)
    mm = torch.ops.aten.mm.default
    backend, fw, bw = counting_backend({"freq": 1, "op": mm}, {"freq": 3, "op": mm}, partition_fn)
    validate(fn, sac(backend), x, y)  # mm recomputed in the bwd
    assert_ran(fw, bw)


@BOTH_WAYS
def test_tags_sequential_layers():
    def gn(x):
        x = x.cos()
        for _ in range(3):
            x = torch.mm(x, x)
        return x.cos()

    def fn(x):
        x = torch.utils.checkpoint.checkpoint(gn, x, use_reentrant=False)
        return torch.utils.checkpoint.checkpoint(gn, x, use_reentrant=False)

    x = torch.randn(4, 4, requires_grad=True)
    backend, fw, bw = counting_backend(
        {"freq": 6, "op": torch.ops.aten.mm.default},
        {"freqs": [2, 18], "ops": [torch.ops.aten.cos.default, torch.ops.aten.mm.default]},
        min_cut_rematerialization_partition,
    )
    validate(fn, sac(backend), x)
    assert_ran(fw, bw)


@BOTH_WAYS
def test_tags_multiple_checkpoints():
    def gn(x, y):
        return torch.sigmoid(torch.matmul(x, y))

    def fn(x, y):
        x = torch.sin(x)
        z = torch.utils.checkpoint.checkpoint(gn, x, y, use_reentrant=True)
        x = torch.sin(z)
        return torch.utils.checkpoint.checkpoint(gn, x, y, use_reentrant=True)

    x = torch.randn(4, 4, requires_grad=True)
    y = torch.randn(4, 4, requires_grad=True)
    mm = torch.ops.aten.mm.default
    backend, fw, bw = counting_backend(
        {"freq": 2, "op": mm}, {"freq": 6, "op": mm}, min_cut_rematerialization_partition
    )
    validate(fn, sac(backend), x, y)
    assert_ran(fw, bw)


@BOTH_WAYS
def test_tags_module():
    mod = nn.Sequential(nn.Linear(10, 10), nn.Sigmoid())

    def fn(x):
        return torch.utils.checkpoint.checkpoint(mod, torch.sin(x), use_reentrant=True)

    x = torch.randn(10, 10, requires_grad=True)
    sigmoid = {"freq": 1, "op": torch.ops.aten.sigmoid.default}
    backend, fw, bw = counting_backend(sigmoid, sigmoid, min_cut_rematerialization_partition)
    validate(fn, sac(backend), x)
    assert_ran(fw, bw)


@BOTH_WAYS
def test_tags_decomps():
    """Tags pass through decompositions (gelu -> erf)."""
    mod = nn.Sequential(nn.Linear(10, 10), nn.GELU())

    def fn(x):
        return torch.utils.checkpoint.checkpoint(mod, torch.sin(x), use_reentrant=True)

    x = torch.randn(10, 10, requires_grad=True)
    erf = {"freq": 1, "op": torch.ops.aten.erf.default}
    backend, fw, bw = counting_backend(
        erf,
        erf,
        min_cut_rematerialization_partition,
        decompositions=lambda: import_module("torch._inductor.compile_fx").select_decomp_table(),
    )
    validate(fn, sac(backend), x)
    assert_ran(fw, bw)


@BOTH_WAYS
@pytest.mark.slow
@torch._inductor.config.patch(fallback_random=True)
def test_tags_recomputed_rand():
    """backend="inductor": rand_like in two checkpoints, recomputed with the same values."""

    def gn(x, y):
        return torch.sigmoid(torch.rand_like(x) * y) * x

    def fn(x, y):
        x = torch.sin(x)
        x = torch.utils.checkpoint.checkpoint(gn, x, y, use_reentrant=True)
        x = torch.sin(x)
        return torch.utils.checkpoint.checkpoint(gn, x, y, use_reentrant=True)

    x = torch.randn(4, 4, requires_grad=True)
    y = torch.randn(4, 4, requires_grad=True)
    validate(fn, sac("inductor"), x, y)


@BOTH_WAYS
def test_tags_dropout():
    """Upstream compiles with Inductor (skip_check: rand decomps differ from eager); here aot_eager."""
    mod = nn.Sequential(nn.Linear(10, 10), nn.Dropout(0.2))

    def fn(x):
        return torch.utils.checkpoint.checkpoint(mod, x, use_reentrant=True)

    x = torch.randn(10, 10, requires_grad=True)
    validate(fn, sac("aot_eager"), x, skip_check=True)


@BOTH_WAYS
def test_symints_location():
    """Dynamic shapes (the second call recompiles) with dropout inside a checkpoint."""

    def gn(x, y):
        return torch.matmul(x, torch.nn.functional.dropout(y, 0.5))

    def fn(x, y):
        return torch.utils.checkpoint.checkpoint(gn, x, y, use_reentrant=True)

    cnt = CompileCounterWithBackend(sac("aot_eager"))
    opt_fn = torch.compile(fn, backend=cnt)
    for n in (4, 5):
        x = torch.randn(n, n, requires_grad=True)
        y = torch.randn(n, n, requires_grad=True)
        expected = fn(x, y)
        result = opt_fn(x, y)
        result.sum().backward()
    assert result.shape == expected.shape
    assert cnt.frame_count == 2
    assert len(cnt.graphs) == 2
    wrap_node = next(n for n in cnt.graphs[0].graph.nodes if n.target is tag_activation_checkpoint)
    assert len(wrap_node.args) == 3


# --- Selective checkpointing policies (create_selective_checkpoint_contexts) -------------


@BOTH_WAYS
@PARTITIONERS
def test_compile_selective_checkpoint_must_recompute(partition_fn):
    def must_recompute_mm():
        return create_selective_checkpoint_contexts(
            _get_custom_policy(must_recompute_list=[torch.ops.aten.mm.default])
        )

    def gn(x):
        return torch.cos(torch.sin(torch.matmul(x, x) @ x))

    mm = torch.ops.aten.mm.default
    # 2 recomputed + 2 bwd mm per fwd matmul = 6; saved: 2 bwd mm per fwd matmul = 4
    for context_fn, bw_freq in ((must_recompute_mm, 6), (_no_recompute_mm, 4)):

        def fn(x, context_fn=context_fn):
            return torch.utils.checkpoint.checkpoint(gn, x, use_reentrant=False, context_fn=context_fn)

        x = torch.randn(4, 4, requires_grad=True)
        backend, fw, bw = counting_backend({"freq": 2, "op": mm}, {"freq": bw_freq, "op": mm}, partition_fn)
        torch._dynamo.reset()
        validate(fn, sac(backend), x)
        assert_ran(fw, bw)


@BOTH_WAYS
def test_sac_with_partial_context_fn():
    class CustomPolicy:
        def __call__(self, ctx, out, func, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE

    def f(x, y):
        return torch.sigmoid(torch.matmul(torch.matmul(x, y), y)) * y

    context_fn = functools.partial(create_selective_checkpoint_contexts, CustomPolicy())

    def fn(x, y):
        return torch.utils.checkpoint.checkpoint(f, x, y, use_reentrant=False, context_fn=context_fn)

    opt_fn = torch.compile(fn, backend=sac(decomp_partition()), fullgraph=True)
    a = torch.randn(4, 4, requires_grad=True)
    b = torch.randn(4, 4, requires_grad=True)
    torch.testing.assert_close(opt_fn(a, b), fn(a, b))


@BOTH_WAYS
@PARTITIONERS
def test_compile_selective_checkpoint_must_not_recompute_gemm(partition_fn):
    def gn(x, y):
        return torch.sigmoid(torch.matmul(torch.matmul(x, y), y)) * y

    def fn(x, y):
        return torch.utils.checkpoint.checkpoint(gn, x, y, use_reentrant=False, context_fn=_no_recompute_mm)

    x = torch.randn(4, 4, requires_grad=True)
    y = torch.randn(4, 4, requires_grad=True)
    mm = torch.ops.aten.mm.default
    # 6 without selective checkpointing (2 recomputed + 2 bwd mm per fwd matmul)
    backend, fw, bw = counting_backend({"freq": 2, "op": mm}, {"freq": 4, "op": mm}, partition_fn)
    validate(fn, sac(backend), x, y)
    assert_ran(fw, bw)
    if partition_fn is min_cut_rematerialization_partition:  # (the same for both: once)
        compare_orig_and_checkpointed_fns(gn, fn, x, y)


@BOTH_WAYS
def test_compile_selective_checkpoint_must_not_recompute_gemm_no_functionalization():
    def gn(x, y):
        return torch.sigmoid(torch.matmul(torch.matmul(x, y), y)) * y

    def fn(x, y):
        return torch.utils.checkpoint.checkpoint(gn, x, y, use_reentrant=False, context_fn=_no_recompute_mm)

    x = torch.randn(4, 4, requires_grad=True)
    y = torch.randn(4, 4, requires_grad=True)
    # sigmoid recomputed: a sigmoid and a sigmoid_backward in the bw graph
    sigmoid = {"freq": 1, "op": torch.ops.aten.sigmoid.default}
    backend, fw, bw = counting_backend(
        sigmoid, sigmoid, min_cut_rematerialization_partition, disable_functionalization=True
    )
    validate(fn, sac(backend), x, y)
    assert_ran(fw, bw)


@BOTH_WAYS
def test_compile_selective_checkpoint_tensor_subclass():
    def gn(x, y):
        return torch.sigmoid(torch.matmul(torch.matmul(x, y), y)) * y

    def fn(x, y):
        return torch.utils.checkpoint.checkpoint(gn, x, y, use_reentrant=False, context_fn=_no_recompute_mm)

    rand_tensor = torch.randn(4, 4, requires_grad=True)
    x = TwoTensor(rand_tensor, rand_tensor.clone())
    y = TwoTensor(rand_tensor.clone(), rand_tensor.clone())
    mm = torch.ops.aten.mm.default
    # 12 without selective checkpointing (4 recomputed + 2 bwd mm per fwd matmul)
    backend, fw, bw = counting_backend(
        {"freq": 4, "op": mm}, {"freq": 8, "op": mm}, min_cut_rematerialization_partition
    )
    validate(fn, sac(backend), x, y)
    assert_ran(fw, bw)


@BOTH_WAYS
def test_compile_selective_checkpoint_custom_rule():
    def _policy(meta):
        def _custom_policy(mode, func, *args, **kwargs):
            key = f"{mode}_mm_count"
            meta.setdefault(key, 0)
            if func == torch.ops.aten.mm.default:
                meta[key] += 1
            # save every mm but the second (a hint: the partitioner may recompute it)
            return func == torch.ops.aten.mm.default and meta[key] != 2

        return _custom_policy

    def context_fn():
        return create_selective_checkpoint_contexts(_policy({}))

    def gn(x, y):
        return torch.sigmoid(torch.sigmoid(torch.matmul(torch.matmul(x, y) * y, y) * y))

    def fn(x, y):
        return torch.utils.checkpoint.checkpoint(gn, x, y, use_reentrant=False, context_fn=context_fn)

    x = torch.randn(4, 4, requires_grad=True)
    y = torch.randn(4, 4, requires_grad=True)
    mm = torch.ops.aten.mm.default
    backend, fw, bw = counting_backend(
        {"freq": 2, "op": mm}, {"freq_ge": 4, "op": mm}, min_cut_rematerialization_partition
    )
    validate(fn, sac(backend), x, y)
    assert_ran(fw, bw)


@BOTH_WAYS
def test_compile_selective_checkpoint_partial_ctx_fn():
    def context_fn(no_recompute_list):
        return create_selective_checkpoint_contexts(_get_custom_policy(no_recompute_list=no_recompute_list))

    def gn(x, y):
        return torch.sigmoid(torch.matmul(torch.matmul(x, y), y)) * y

    def fn(x, y):
        return torch.utils.checkpoint.checkpoint(
            gn,
            x,
            y,
            use_reentrant=False,
            context_fn=functools.partial(context_fn, [torch.ops.aten.mm.default]),
        )

    x = torch.randn(4, 4, requires_grad=True)
    y = torch.randn(4, 4, requires_grad=True)
    mm = torch.ops.aten.mm.default
    backend, fw, bw = counting_backend(
        {"freq": 2, "op": mm}, {"freq": 4, "op": mm}, min_cut_rematerialization_partition
    )
    validate(fn, sac(backend), x, y)
    assert_ran(fw, bw)


@BOTH_WAYS
def test_compile_selective_checkpoint_outplace_op():
    def context_fn():
        return create_selective_checkpoint_contexts(
            _get_custom_policy(no_recompute_list=[torch.ops.aten.mm.default, torch.ops.aten.sigmoid.default])
        )

    def gn(x, y):
        return torch.sigmoid(torch.selu(torch.matmul(torch.matmul(x, y), y))).relu()

    def fn(x, y):
        return torch.utils.checkpoint.checkpoint(gn, x, y, use_reentrant=False, context_fn=context_fn)

    x = torch.randn(4, 4, requires_grad=True)
    y = torch.randn(4, 4, requires_grad=True)
    ops = [torch.ops.aten.mm.default, torch.ops.aten.sigmoid.default]
    backend, fw, bw = counting_backend(
        {"freqs": [2, 1], "ops": ops}, {"freqs": [4, 0], "ops": ops}, min_cut_rematerialization_partition
    )
    validate(fn, sac(backend), x, y)
    assert_ran(fw, bw)
    compare_orig_and_checkpointed_fns(gn, fn, x, y)


@BOTH_WAYS
def test_compile_selective_checkpoint_list_ops():
    def context_fn():  # recompute everything
        return create_selective_checkpoint_contexts(_get_custom_policy(no_recompute_list=[]))

    def gn(x, y):
        return torch.cat([x, y]).sin()

    def fn(x, y):
        return torch.utils.checkpoint.checkpoint(gn, x, y, use_reentrant=False, context_fn=context_fn)

    x = torch.randn(4, 4, requires_grad=True)
    y = torch.randn(4, 4, requires_grad=True)
    cat = {"freqs": [1], "ops": [torch.ops.aten.cat.default]}
    backend, fw, bw = counting_backend(cat, cat, min_cut_rematerialization_partition)
    validate(fn, sac(backend), x, y)
    assert_ran(fw, bw)


@BOTH_WAYS
@pytest.mark.parametrize("preserve_rng_state", [True, False])
def test_compile_selective_checkpoint_random_op(preserve_rng_state):
    def context_fn():
        return create_selective_checkpoint_contexts(
            _get_custom_policy(no_recompute_list=[torch.ops.aten.sigmoid.default])
        )

    def gn(x):
        return torch.sigmoid(torch.dropout(torch.sigmoid(x), p=0.5, train=True))

    def fn(x):
        # torch.compile always preserves the RNG state, whatever preserve_rng_state says
        return torch.utils.checkpoint.checkpoint(
            gn, x, use_reentrant=False, preserve_rng_state=preserve_rng_state, context_fn=context_fn
        )

    x = torch.randn(4, 4, requires_grad=True)
    ops = [torch.ops.aten.sigmoid.default, torch.ops.aten.native_dropout.default]
    # dropout is recomputed (native_dropout once in the bw graph), the sigmoids saved
    backend, fw, bw = counting_backend(
        {"freqs": [2, 1], "ops": ops}, {"freqs": [0, 1], "ops": ops}, min_cut_rematerialization_partition
    )
    # eager does not preserve the RNG state when asked not to: no comparison then
    validate(fn, sac(backend), x, skip_check=not preserve_rng_state)
    assert_ran(fw, bw)
    if preserve_rng_state:  # (compiled, the same either way: once)
        compare_orig_and_checkpointed_fns(gn, fn, x)


class _InvalidContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def _invalid_context_gen():
    return _InvalidContext(), _InvalidContext()


@BOTH_WAYS
def test_compile_selective_checkpoint_invalid_context():
    def gn(x, y):
        return torch.sigmoid(torch.matmul(x, y)) * y

    def fn(x, y):
        return torch.utils.checkpoint.checkpoint(
            gn, x, y, use_reentrant=False, context_fn=_invalid_context_gen
        )

    x = torch.randn(4, 4, requires_grad=True)
    y = torch.randn(4, 4, requires_grad=True)
    mm = torch.ops.aten.mm.default
    backend, _, _ = counting_backend(
        {"freq": 1, "op": mm}, {"freq_ge": 2, "op": mm}, min_cut_rematerialization_partition
    )
    with pytest.raises(Exception, match="must generate a tuple of two `TorchDispatchMode`s"):
        validate(fn, sac(backend), x, y)


@BOTH_WAYS
@PARTITIONERS
def test_compile_selective_checkpoint_parametrization(partition_fn):
    def sac_policy():
        def _custom_policy(ctx, func, *args, **kwargs):
            to_recompute = func in {torch.ops.aten.mul.Tensor, torch.ops.aten.sigmoid.default}
            return CheckpointPolicy.MUST_RECOMPUTE if to_recompute else CheckpointPolicy.MUST_SAVE

        return create_selective_checkpoint_contexts(_custom_policy)

    class Parametrization(nn.Module):
        def parametrization(self, x):
            return torch.sigmoid(torch.mul(x, x))

        def forward(self, x):
            return checkpoint(self.parametrization, x, use_reentrant=False, context_fn=sac_policy)

    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(16, 16, bias=False))
    for mod in list(model.modules()):
        for p_name, p in dict(mod.named_parameters(recurse=False)).items():
            mod.register_parameter(p_name, nn.Parameter(p))
            nn.utils.parametrize.register_parametrization(mod, p_name, Parametrization(), unsafe=True)

    ops = [torch.ops.aten.mul.Tensor, torch.ops.aten.sigmoid.default]
    # bw: 1 mul recomputed, 1 from mul's backward (without CSE, one more); 1 sigmoid recomputed
    bw_mul = 3 if partition_fn is default_partition else 2
    backend, fw, bw = counting_backend(
        {"freqs": [1, 1], "ops": ops}, {"freqs": [bw_mul, 1], "ops": ops}, partition_fn
    )
    model_compiled = torch.compile(copy.deepcopy(model), backend=sac(backend), fullgraph=True)
    inp = torch.randn(8, 16, requires_grad=True)
    inp_compiled = copy.deepcopy(inp)
    out = model(inp)
    out.sum().backward()
    out_compiled = model_compiled(inp_compiled)
    out_compiled.sum().backward()
    torch.testing.assert_close(out, out_compiled)
    torch.testing.assert_close(inp.grad, inp_compiled.grad)
    assert_ran(fw, bw)


# --- Mutation and annotations ------------------------------------------------------------


@BOTH_WAYS
@torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)
def test_nonlocal_mutation():
    counter = 0

    def gn(x):
        nonlocal counter
        counter += 1
        return torch.sin(x)

    def fn(x):
        return torch.utils.checkpoint.checkpoint(gn, x, use_reentrant=True)

    x = torch.randn(4, 4, requires_grad=True)
    fn(x).sum().backward()
    assert counter == 2  # eager: the mutation is reapplied in the backward
    counter = 0
    opt_fn = torch.compile(fn, backend=sac(decomp_partition()), fullgraph=True)
    opt_fn(x).sum().backward()
    assert counter == 1  # compiled with the flag: not reapplied


@BOTH_WAYS
@torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)
def test_nonlocal_list_mutation_hidden():
    def gn(x, z):
        o = torch.matmul(x, x) @ x
        z.append(x.sin())
        return torch.cos(torch.sin(o)), torch.sin(x)

    def fn(x):
        z = []
        outs = torch.utils.checkpoint.checkpoint(gn, x, z, use_reentrant=False)
        return outs[0] + outs[-1], z[0]

    x = torch.randn(4, 4, requires_grad=True)
    ref = fn(x)
    res = torch.compile(fn, backend=sac(decomp_partition()), fullgraph=True)(x)
    torch.testing.assert_close(ref[0], res[0])
    torch.testing.assert_close(ref[1], res[1])
    (res[0].sum() + res[1].sum()).backward()


def _sac_annotations(checkpointed_fn, policy_fn, decompositions=None):
    """Upstream's ``_get_sac_annotations``: the recompute tags the partitioner receives."""
    annotations = []

    def capture_partition(joint_gm, joint_args, **kwargs):
        for node in joint_gm.graph.nodes:
            recompute = node.meta.get("recompute") if node.op == "call_function" else None
            if recompute is not None:
                annotations.append(f"{node.name}: {node.target} -> {recompute.name}")
        return min_cut_rematerialization_partition(joint_gm, joint_args, **kwargs)

    backend = aot_autograd(
        fw_compiler=nop, bw_compiler=nop, partition_fn=capture_partition, decompositions=decompositions
    )

    def fn(x):
        return checkpoint(
            checkpointed_fn,
            x,
            use_reentrant=False,
            context_fn=functools.partial(create_selective_checkpoint_contexts, policy_fn),
        )

    torch._dynamo.reset()
    torch.compile(fn, backend=sac(backend))(torch.randn(4, requires_grad=True)).sum().backward()
    return "\n".join(annotations)


@BOTH_WAYS
def test_post_mode_decomp():
    from torch._inductor.compile_fx import select_decomp_table

    def policy_fn(ctx, func, *args, **kwargs):
        if func == torch.ops.aten.silu.default:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def fn(x):
        return torch.nn.functional.silu(x.sin()).cos()

    assert _sac_annotations(fn, policy_fn, decompositions=select_decomp_table) == (
        "sin: aten.sin.default -> PREFER_RECOMPUTE\n"
        "neg: aten.neg.default -> MUST_SAVE\n"
        "exp: aten.exp.default -> MUST_SAVE\n"
        "add: aten.add.Tensor -> MUST_SAVE\n"
        "div: aten.div.Tensor -> MUST_SAVE\n"
        "cos: aten.cos.default -> PREFER_RECOMPUTE"
    )


@BOTH_WAYS
def test_multi_output_op():
    def policy_fn(ctx, func, *args, **kwargs):
        if func == torch.ops.aten.topk.default:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def fn(x):
        vals, _ = torch.topk(x.sin(), k=2)
        return vals.sum().cos()

    assert _sac_annotations(fn, policy_fn) == (
        "sin: aten.sin.default -> PREFER_RECOMPUTE\n"
        "topk: aten.topk.default -> MUST_SAVE\n"
        "getitem: <built-in function getitem> -> MUST_SAVE\n"
        "getitem_1: <built-in function getitem> -> MUST_SAVE\n"
        "sum_1: aten.sum.default -> PREFER_RECOMPUTE\n"
        "cos: aten.cos.default -> PREFER_RECOMPUTE"
    )


# --- region_activation_memory_budget ------------------------------------------------------

N = 64  # upstream: 1000 on a GPU


def _linears(n):
    return nn.ModuleList([nn.Linear(N, N) for _ in range(n)])


def test_region_activation_memory_budget_reduces_act_mem():
    class Model(nn.Module):
        def __init__(self, budget=None):
            super().__init__()
            self.budget = budget
            self.linears = _linears(4)

        def forward(self, x):
            if self.budget is None:
                for linear in self.linears:
                    x = linear(x).relu()
                return x.sum()
            with torch.autograd.graph.region_activation_memory_budget(self.budget):
                for linear in self.linears:
                    x = linear(x).relu()
                return x.sum()

    x = torch.randn(N, N)
    for budget, check in ((None, lambda held: held > 0), (0.0, lambda held: held == 0)):
        torch._dynamo.reset()
        model = Model(budget)
        compiled = torch.compile(model, backend=sac("aot_eager"))
        held = held_bytes(lambda compiled=compiled: compiled(x), _inputs_of(model, x))
        assert check(held), (budget, held)


def test_region_activation_memory_budget_per_region():
    """Graphs separated by a graph break have their own budgets."""

    class Model(nn.Module):
        def __init__(self, budget_a, budget_b):
            super().__init__()
            self.budget_a, self.budget_b = budget_a, budget_b
            self.linears_a, self.linears_b = _linears(2), _linears(2)

        def forward(self, x):
            with torch.autograd.graph.region_activation_memory_budget(self.budget_a):
                for linear in self.linears_a:
                    x = linear(x).relu()
            torch._dynamo.graph_break()
            with torch.autograd.graph.region_activation_memory_budget(self.budget_b):
                for linear in self.linears_b:
                    x = linear(x).relu()
                return x.sum()

    x = torch.randn(N, N)
    held = {}
    for budgets in ((1.0, 1.0), (0.0, 1.0), (1.0, 0.0), (0.0, 0.0)):
        torch._dynamo.reset()
        model = Model(*budgets)
        compiled = torch.compile(model, backend=sac("aot_eager"))
        held[budgets] = held_bytes(lambda compiled=compiled: compiled(x), _inputs_of(model, x))
    # both save > either one recomputing > both recomputing
    assert held[1.0, 1.0] > held[0.0, 1.0] > held[0.0, 0.0], held
    assert held[1.0, 1.0] > held[1.0, 0.0] > held[0.0, 0.0], held


def test_region_activation_memory_budget_conflict_raises():
    """Two budgets in one graph: the partitioner applies one budget per graph."""

    def fn(x, y):
        with torch.autograd.graph.region_activation_memory_budget(0.3):
            a = (torch.mm(x, y) + 1).relu()
        with torch.autograd.graph.region_activation_memory_budget(0.8):
            return (torch.mm(a, y) + 1).relu()

    cfn = torch.compile(fn, backend=sac("aot_eager"), fullgraph=True)
    x = torch.randn(8, 8, requires_grad=True)
    y = torch.randn(8, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="conflicting budgets"):
        cfn(x, y).sum().backward()


def test_region_activation_memory_budget_partial_annotation_raises():
    """A budget must cover the whole forward of its graph."""

    def fn(x, y):
        with torch.autograd.graph.region_activation_memory_budget(0.3):
            a = (torch.mm(x, y) + 1).relu()
        return (a * 2).relu()  # outside the region

    cfn = torch.compile(fn, backend=sac("aot_eager"), fullgraph=True)
    x = torch.randn(8, 8, requires_grad=True)
    y = torch.randn(8, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="must cover the entire forward"):
        cfn(x, y).sum().backward()


@torch._dynamo.config.patch(inline_single_use_invoke_subgraph=False)
def test_region_activation_memory_budget_covers_invoke_subgraph():
    """A budget covering a forward that calls a nested_compile_region applies inside its body."""
    from torch.compiler import nested_compile_region

    def build(budget):
        linears = _linears(4)

        @nested_compile_region
        def region(x):
            for lin in linears:
                x = lin(x).relu()
            return x

        def fn(x):
            if budget is None:
                return region(x).sum()
            with torch.autograd.graph.region_activation_memory_budget(budget):
                return region(x).sum()

        return fn, list(linears.parameters())

    x = torch.randn(N, N)
    for budget, check in ((None, lambda held: held > 0), (0.0, lambda held: held == 0)):
        torch._dynamo.reset()
        fn, params = build(budget)
        compiled = torch.compile(fn, backend=sac("aot_eager"), fullgraph=True)
        held = held_bytes(lambda compiled=compiled: compiled(x), [*params, x])
        assert check(held), (budget, held)


@torch._dynamo.config.patch(inline_single_use_invoke_subgraph=False)
def test_region_activation_memory_budget_distinct_per_invoke_subgraph_raises():
    """Two nested_compile_regions of one graph with different budgets: rejected."""
    from torch.compiler import nested_compile_region

    wa = torch.randn(8, 8, requires_grad=True)
    wb = torch.randn(8, 8, requires_grad=True)

    @nested_compile_region
    def region_a(x):
        with torch.autograd.graph.region_activation_memory_budget(0.3):
            return (x @ wa).relu()

    @nested_compile_region
    def region_b(x):
        with torch.autograd.graph.region_activation_memory_budget(0.8):
            return (x @ wb).relu()

    def fn(x):
        return region_b(region_a(x)).sum()

    cfn = torch.compile(fn, backend=sac("aot_eager"), fullgraph=True)
    with pytest.raises(RuntimeError, match="conflicting budgets"):
        cfn(torch.randn(8, 8, requires_grad=True)).backward()


# --- Our contract -------------------------------------------------------------------------


class Unmarked(nn.Module):
    """No sac_compile marker: what PyTorch's backend saves, ours must save."""

    def __init__(self, region_budget=None, nested=False):
        super().__init__()
        self.region_budget, self.nested = region_budget, nested
        self.linears = linears = _linears(3)

        def body(x):
            for lin in linears:
                x = torch.nn.functional.gelu(lin(x)).sin()
            return x

        self.body = torch.compiler.nested_compile_region(body) if nested else body

    def _forward(self, x):
        if self.nested:  # called twice: not inlined
            return (self.body(x) + self.body(x.cos())).sum()
        return self.body(x).sum()

    def forward(self, x):
        if self.region_budget is None:
            return self._forward(x)
        with torch.autograd.graph.region_activation_memory_budget(self.region_budget):
            return self._forward(x)


def _unmarked_held(backend, x, **model_kwargs):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Unmarked(**model_kwargs)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    xs = x.detach().clone().requires_grad_()
    held = held_bytes(lambda: compiled(xs), _inputs_of(model, xs))
    return held, compiled(xs).detach(), xs.grad


UNMARKED_CASES = {
    "plain": ({}, {}),
    "global_budget_0.5": ({}, {"activation_memory_budget": 0.5}),
    "region_budget_0": ({"region_budget": 0.0}, {}),
    "region_budget_0.5": ({"region_budget": 0.5}, {}),
    "region_budget_1": ({"region_budget": 1.0}, {}),
    "nested_compile_region": ({"nested": True}, {}),
    "nested_compile_region_budget_0.5": ({"nested": True, "region_budget": 0.5}, {}),
}


@pytest.mark.parametrize("case", list(UNMARKED_CASES))
def test_unmarked_model_saves_what_pytorch_saves(case):
    model_kwargs, functorch_config = UNMARKED_CASES[case]
    x = torch.randn(8, N)
    with torch._functorch.config.patch(**functorch_config):
        theirs, out_theirs, grad_theirs = _unmarked_held("aot_eager", x, **model_kwargs)
        ours, out_ours, grad_ours = _unmarked_held(sac("aot_eager"), x, **model_kwargs)
    if "region_budget" not in model_kwargs:  # (PyTorch's budgets 0, and 0.5 nested, save nothing)
        assert theirs > 0
    assert ours == theirs
    torch.testing.assert_close(out_ours, out_theirs)
    torch.testing.assert_close(grad_ours, grad_theirs)


@pytest.mark.slow
def test_unmarked_model_saves_what_inductor_saves():
    x = torch.randn(8, N)
    theirs, out_theirs, grad_theirs = _unmarked_held("inductor", x)
    ours, out_ours, grad_ours = _unmarked_held(sac("inductor"), x)
    assert theirs > 0
    assert ours == theirs
    torch.testing.assert_close(out_ours, out_theirs)
    torch.testing.assert_close(grad_ours, grad_theirs)


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(N, N), nn.Linear(N, N)

    def forward(self, x):
        q, k = self.q(x).sin(), self.k(x).cos()
        with sc.region("attn"):
            scores = torch.matmul(q, k.transpose(-1, -2))
        return torch.sigmoid(scores).sum()


@pytest.mark.skipif(REFERENCE, reason="keeps a sac_compile region: no PyTorch reference")
def test_custom_aot_autograd_inner_keeps_a_region():
    calls = []

    def rec(kind):
        def compiler(gm, example_inputs):
            calls.append(kind)
            return gm

        return compiler

    inner = aot_autograd(
        fw_compiler=rec("forward"),
        bw_compiler=rec("backward"),
        partition_fn=min_cut_rematerialization_partition,
    )
    x = torch.randn(8, N)
    held = {}
    for keep in ({"attn"}, ()):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Attn()
        compiled = torch.compile(model, backend=sc.make_sac_backend(keep=keep, inner=inner), fullgraph=True)
        held[bool(keep)] = held_bytes(lambda compiled=compiled: compiled(x), _inputs_of(model, x))
    assert held[True] > held[False], held
    assert "forward" in calls and "backward" in calls, calls
