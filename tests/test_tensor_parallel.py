"""DTensor tensor parallelism on two gloo ranks: a Llama-style stack sharded as torchtitan
shards Llama (``sac_compile.testing.tp``: Colwise / Rowwise, and with sequence parallelism
its full plan), every block wrapped by the seam.

Each keep set against the same sharded model without checkpointing: gradients equal (the
full gradients, all-gathered), and the bytes each rank holds for the backward ordered full
recompute < each keep set < no checkpoint.
"""

from __future__ import annotations

import functools

import pytest
import torch

from sac_compile.testing.ranks import run_ranks

from .releases import every_release, extended

pytestmark = pytest.mark.distributed

KEEPS: list[tuple[str, ...] | None] = [None, (), ("attn",), ("mlp",), ("attn", "mlp")]
# torch 2.13's AOTAutograd saves a DeviceMesh among the tensors when a checkpoint recomputes a
# tensor-parallel attention under torch.compile ("expected all tensors_saved_with_vc_check to
# be Tensors"): PyTorch's own bug, reproduced without sac_compile by
# examples/repros/tp_checkpoint_compile.py; 2.14.1 and 2.15 run it.
TORCH_213 = torch.__version__.startswith("2.13")


def _configurations(rank: int, world_size: int, compile: bool, keeps: list = KEEPS, sp: bool = False) -> dict:
    """Per keep set (None: no checkpoint): ``(loss difference, largest gradient difference,
    bytes held)``, the differences to no checkpoint (plain numbers: tensors do not outlive a
    rank's exit on their way back)."""
    from torch.distributed.device_mesh import init_device_mesh

    import sac_compile as sc
    from sac_compile.compiler.backend import baseline_backend
    from sac_compile.testing.tp import REGIONS, LlamaStack, parallelize

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(1)
    x = torch.randn(2, 16, 32)
    if sp:  # sequence parallel: the residual stream is this rank's chunk of the sequence
        x = x.chunk(world_size, dim=1)[rank].contiguous()  # its own storage, as an embedding's output
    runs = {}
    for keep in keeps:
        torch._dynamo.reset()  # each configuration compiled afresh (not as a dynamic-shape recompile)
        torch.manual_seed(0)
        stack = parallelize(LlamaStack(n=2, d=32), mesh, sequence_parallel=sp)
        sc.declare_regions(stack, REGIONS)
        for layer in stack.layers:
            if keep is not None:
                options = {"inner": "aot_eager", "dynamic": False}
                sc.apply_selective_checkpointing(layer, keep=set(keep), compile=options if compile else False)
            elif compile:  # compiled, no checkpoint: the same compile without the tagging pass
                layer.compile(backend=baseline_backend("aot_eager"), dynamic=False)
        # the least of two sightings: one storage of 4096 B ([2, 16, 32] fp32) more is seen in
        # some runs only (eager and compiled; garbage not yet collected, cause not found), never twice
        held = min(
            sc.inspection.autograd_saved_bytes(stack, x, exclude=list(stack.parameters())) for _ in range(2)
        )
        stack.zero_grad()
        loss = stack(x).sum()
        loss.backward()
        loss = getattr(loss, "full_tensor", loss.detach)()
        # (the norms are not sharded: plain tensors)
        grads = {n: getattr(p.grad, "full_tensor", p.grad.clone)() for n, p in stack.named_parameters()}
        runs[keep] = (loss.detach(), grads, held)
    loss_ref, g_ref, _ = runs[None]
    return {
        keep: (
            abs(loss - loss_ref).item(),
            max((g[n] - g_ref[n]).abs().max().item() for n in g_ref),
            held,
        )
        for keep, (loss, g, held) in runs.items()
    }


def _check(results: list[dict]) -> None:
    for per_rank in results:
        none = per_rank[None][2]
        for keep, (loss_diff, grad_diff, held) in per_rank.items():
            assert loss_diff < 1e-4 and grad_diff < 1e-5, (keep, loss_diff, grad_diff)
            assert held < none or keep is None, (keep, held, none)
            if keep and () in per_rank:
                assert per_rank[()][2] < held, (keep, per_rank[()][2], held)
        both = per_rank[("attn", "mlp")][2]
        assert max(per_rank[k][2] for k in (("attn",), ("mlp",)) if k in per_rank) < both


def _both_plans(rank: int, world_size: int, compile: bool, keeps: list) -> dict:
    """:func:`_configurations` with and without sequence parallelism, in one spawn of the ranks."""
    return {sp: _configurations(rank, world_size, compile, keeps, sp) for sp in (False, True)}


def _held_bytes_without_tp(keeps: list) -> dict:
    """The same stack unsharded in this process: what each keep set holds."""
    import sac_compile as sc
    from sac_compile.testing.tp import REGIONS, LlamaStack

    torch.manual_seed(1)
    x = torch.randn(2, 16, 32)
    out = {}
    for keep in keeps:
        torch.manual_seed(0)
        stack = LlamaStack(n=2, d=32)
        sc.declare_regions(stack, REGIONS)
        if keep is not None:
            for layer in stack.layers:
                sc.apply_selective_checkpointing(layer, keep=set(keep))
        out[keep] = sc.inspection.autograd_saved_bytes(stack, x, exclude=list(stack.parameters()))
    return out


@every_release
def test_tensor_parallel_eager_every_keep_set():
    """Both plans (Colwise / Rowwise, and with sequence parallelism), every keep set. Per
    rank, full recompute holds what it holds without TP (the layer inputs and RNG state:
    replicated), a kept region less than without TP (its values are sharded). Red before:
    ``AttributeError: 'Tensor' object has no attribute 'placements'`` in ColwiseParallel's
    output hook (the engine tracked storages of plain tensors only, so it took a DTensor
    kept value for dead and handed a plain stand-in to the recompute)."""
    results = run_ranks(_both_plans, False, KEEPS)
    for sp in (False, True):
        _check([r[sp] for r in results])
    tp, whole = results[0][False], _held_bytes_without_tp(KEEPS)
    assert tp[()][2] == whole[()]
    for keep in (("attn",), ("mlp",), ("attn", "mlp"), None):
        assert tp[keep][2] < whole[keep], (keep, tp[keep][2], whole[keep])
    # the planner's eager figure for a rank (one layer measured whole in this process) against
    # what each rank held, both plans: every checkpointed keep set exact, no checkpoint within
    # 1% without sequence parallelism and 6% with it (red before, without: keep mlp 0.81,
    # attn+mlp 0.82, attn 0.92: the row-parallel projection's output before its all-reduce and
    # the engine's RNG state were split like the partition's values; with: 0.64-1.19, what the
    # engine holds split as the partition's values are, where only the layer input is split)
    for sp, tolerance in ((False, 0.01), (True, 0.06)):
        predicted = _predicted_eager_per_rank(KEEPS, sp)
        table = {k: (predicted[k], results[0][sp][k][2]) for k in KEEPS}
        assert all(p == m for k, (p, m) in table.items() if k is not None), (sp, table)
        assert abs(table[None][0] - table[None][1]) <= tolerance * table[None][1], (sp, table)


@pytest.mark.slow
@every_release
def test_tensor_parallel_compiled_every_keep_set():
    """Compiled per layer (``aot_eager``, ``dynamic=False``: with sequence parallelism a
    dynamic-shape recompile fails in DTensor's sharding propagation, "unhashable type:
    non-nested SymInt", without checkpointing too), both plans: full recompute holds the
    layer inputs only (red before, on 2.15: 0.71x the no-checkpoint bytes, from
    ``autograd_saved_bytes`` counting the DTensor weights' shards as held and missing the
    DTensors autograd saved)."""
    keeps = [k for k in KEEPS if not (TORCH_213 and k in ((), ("mlp",)))]
    results = run_ranks(_both_plans, True, keeps)
    for sp in (False, True):
        _check([r[sp] for r in results])
    if not TORCH_213:
        assert results[0][False][()][2] == 2 * 2 * 16 * 32 * 4  # two layers' inputs, [2, 16, 32] fp32
    # the planner's prediction of what each rank holds, from the layer measured whole in this
    # process (sac_compile.planning.parallel): within 10% for every keep set, both plans
    predicted = _predicted_per_rank(keeps)
    table = {(sp, k): (predicted[sp][k], results[0][sp][k][2]) for sp in (False, True) for k in keeps}
    assert all(abs(p - m) <= 0.10 * m for p, m in table.values()), table


@functools.cache
def _one_layer_plan():
    """One block of the stack planned whole in this process (keep sets, offloading pairs,
    the eager engine's figures): what the planner predicts the ranks from."""
    import sac_compile as sc
    from sac_compile.planning import plan
    from sac_compile.testing.tp import REGIONS, LlamaStack

    torch.manual_seed(0)
    stack = LlamaStack(n=1, d=32)
    sc.declare_regions(stack, REGIONS)
    x = torch.randn(2, 16, 32, requires_grad=True)
    return plan(stack.layers[0], x, memory=1.0, budgets=(None,), offload=True)


def _kept(keep: tuple[str, ...]):
    """The one-layer plan's candidate keeping ``keep`` (nothing offloaded, no budget)."""
    return next(
        c
        for c in _one_layer_plan().candidates
        if c.keep == frozenset(keep) and not c.offload and c.budget is None
    )


def _tp2(sequence_parallel: bool = False):
    from sac_compile.planning.devices import Target

    return Target(
        "cpu", tp=2, sequence_parallel=sequence_parallel, batch=2, seq=16, param_dtype=torch.float32
    )


def _predicted_per_rank(keeps: list) -> dict:
    """Per plan (sequence parallel or not) and keep set: the bytes one of two ranks holds for
    the two-layer stack compiled, predicted from one layer planned whole."""
    from sac_compile.planning.parallel import per_rank_bytes

    table = _one_layer_plan()
    split = {k: (_kept(k).saved_bytes, _kept(k).tp_split) for k in keeps if k is not None}
    split[None] = (table.no_checkpoint_bytes, table.no_checkpoint_tp)
    return {sp: {k: 2 * per_rank_bytes(*split[k], 2, sp) for k in keeps} for sp in (False, True)}


def _predicted_eager_per_rank(keeps: list, sequence_parallel: bool) -> dict:
    """Per keep set: the bytes one of two ranks holds for the two-layer stack run eagerly,
    predicted from one layer planned whole (the planner's eager figures:
    ``planning.figures.figures_of`` / ``no_checkpoint_figures``)."""
    from sac_compile.planning.figures import figures_of, no_checkpoint_figures

    table, target = _one_layer_plan(), _tp2(sequence_parallel)
    out = {
        k: 2 * figures_of(_kept(k), table, (0, 0), 1, target, compile=False).saved_bytes
        for k in keeps
        if k is not None
    }
    out[None] = 2 * no_checkpoint_figures(table, (0, 0), 1, target).saved_bytes
    return out


def _fsdp2_x_tp(rank: int, world_size: int, keep: tuple[str, ...], compile: bool) -> dict:
    """torchtitan's 2-D layout on a (dp=2, tp=2) mesh: TP inside each block, then the seam,
    then ``fully_shard`` over dp (each block, then the root); SGD steps on per-dp-rank halves
    of the batch against one process running the whole batch unsharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import sac_compile as sc
    from sac_compile.testing.tp import REGIONS, LlamaStack, parallelize

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    ref = LlamaStack(n=2, d=32)
    model = LlamaStack(n=2, d=32)
    model.load_state_dict(ref.state_dict())
    parallelize(model, mesh["tp"])
    sc.declare_regions(model, REGIONS)
    for layer in model.layers:
        sc.apply_selective_checkpointing(
            layer, keep=set(keep), compile={"inner": "aot_eager"} if compile else False
        )
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    dp_rank = mesh["dp"].get_local_rank()
    worst_loss = worst_grad = 0.0
    for _ in range(2):
        x = torch.randn(4, 16, 32, generator=g)
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = model(x.chunk(2)[dp_rank]).pow(2).mean()
        loss.backward()
        ref_loss = ref(x).pow(2).mean()
        ref_loss.backward()
        mean_loss = loss.detach().clone()
        torch.distributed.all_reduce(mean_loss, group=mesh["dp"].get_group())
        worst_loss = max(worst_loss, abs(mean_loss.item() / 2 - ref_loss.item()))
        for p, q in zip(model.parameters(), ref.parameters()):
            worst_grad = max(worst_grad, (p.grad.full_tensor() - q.grad).abs().max().item())
        opt.step()
        ref_opt.step()
    return {"loss": worst_loss, "grad": worst_grad}


@pytest.mark.parametrize(
    "keep, compile",
    # (extended: FSDP2 and TP each in CI; torchtitan's FSDP x TP trainer on newer releases)
    [
        pytest.param(("attn",), False, marks=extended),
        pytest.param(("attn", "mlp"), True, marks=[pytest.mark.slow, extended]),
    ],
    ids=["attn-eager", "attn+mlp-compiled"],
)
def test_fsdp2_x_tensor_parallel_matches_a_single_process(keep, compile):
    for r in run_ranks(_fsdp2_x_tp, keep, compile, world_size=4):
        assert r["loss"] < 1e-5 and r["grad"] < 1e-5, r


OFFLOADS = [({"attn"}, {"mlp"}), ({"mlp"}, {"attn"})]


def _offloaded_run(stack, x, keep, offload, compile: bool = False) -> tuple:
    """``stack`` wrapped keeping ``keep`` and offloading ``offload`` (None: not wrapped), eagerly
    or each block compiled (``aot_eager``, static shapes): the loss, the full gradients and the
    bytes sent to the host (eager: what the engine copied; compiled: what the first block's
    partition offloads, ``capture_partition``)."""
    import sac_compile as sc
    from sac_compile import seam

    if keep is not None and compile:
        backend = sc.make_sac_backend(keep=keep, offload=offload, inner="aot_eager")
        moved = sc.inspection.capture_partition(stack.layers[0], x, backend=backend).offloaded_bytes
        stack.zero_grad(set_to_none=True)  # (the capture ran a backward)
        torch._dynamo.reset()
        for layer in stack.layers:
            options = {"inner": "aot_eager", "dynamic": False}
            sc.apply_selective_checkpointing(layer, keep=keep, offload=offload, compile=options)
        loss = stack(x).sum()
        loss.backward()
        grads = {n: getattr(p.grad, "full_tensor", p.grad.clone)() for n, p in stack.named_parameters()}
        return getattr(loss, "full_tensor", loss.detach)().detach(), grads, moved
    if keep is not None:
        for layer in stack.layers:
            sc.apply_selective_checkpointing(layer, keep=keep, offload=offload)
    copied = []
    real = seam.checkpoint_with_regions

    def counting(*args, **kwargs):  # every call's stats (the seam asks for the first one's only)
        stats = kwargs.setdefault("stats_out", [])
        out = real(*args, **kwargs)
        copied.append(stats[-1].offloaded_bytes)
        return out

    seam.checkpoint_with_regions = counting
    try:
        loss = stack(x).sum()
        loss.backward()
    finally:
        seam.checkpoint_with_regions = real
    loss = getattr(loss, "full_tensor", loss.detach)()
    grads = {n: getattr(p.grad, "full_tensor", p.grad.clone)() for n, p in stack.named_parameters()}
    return loss.detach(), grads, sum(copied)


def _offloading(rank: int, world_size: int, compile: bool = False) -> dict:
    """Per plan (sequence parallel or not) and offload set: ``(loss difference, largest gradient
    difference, bytes sent to the host)`` against the same sharded stack unwrapped
    (:func:`_offloaded_run`)."""
    from torch.distributed.device_mesh import init_device_mesh

    import sac_compile as sc
    from sac_compile.testing.tp import REGIONS, LlamaStack, parallelize

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for sp in (False, True):
        torch.manual_seed(1)
        x = torch.randn(2, 16, 32)
        if sp:
            x = x.chunk(world_size, dim=1)[rank].contiguous()
        runs = {}
        for keep, offload in [(None, None), *OFFLOADS]:
            torch._dynamo.reset()
            torch.manual_seed(0)
            stack = parallelize(LlamaStack(n=2, d=32), mesh, sequence_parallel=sp)
            sc.declare_regions(stack, REGIONS)
            runs[None if offload is None else min(offload)] = _offloaded_run(stack, x, keep, offload, compile)
        loss_ref, g_ref, _ = runs.pop(None)
        out[sp] = {
            name: (
                (loss - loss_ref).abs().item(),
                max((g[n] - g_ref[n]).abs().max().item() for n in g_ref),
                moved,
            )
            for name, (loss, g, moved) in runs.items()
        }
    return out


def _stream_copies(rank: int, world_size: int, batches: tuple[int, ...]) -> dict:
    """Per batch, the whole-stream copies (``aten.cat`` of the full ``[batch, seq, hidden]``)
    and the collectives one sequence-parallel block's forward and backward run."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils._python_dispatch import TorchDispatchMode

    from sac_compile.testing.tp import LlamaStack, parallelize

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[str, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.seen.append((func.name(), out.numel() if isinstance(out, torch.Tensor) else 0))
            return out

    mesh = init_device_mesh("cpu", (world_size,))
    counts = {}
    for batch in batches:
        torch.manual_seed(0)
        stack = parallelize(LlamaStack(n=1, d=32), mesh, sequence_parallel=True)
        x = torch.randn(batch, 16, 32).chunk(world_size, dim=1)[rank].contiguous().requires_grad_()
        with Ops() as ops:
            stack(x).sum().backward()
        copies = sum(n == "aten::cat" and numel == batch * 16 * 32 for n, numel in ops.seen)
        collectives = [n for n, _ in ops.seen if n.startswith("_c10d_functional::")]
        counts[batch] = (copies, sum("wait" not in n and "wrap" not in n for n in collectives))
    return counts


def test_sequence_parallel_collectives_copy_the_stream_as_the_step_time_counts():
    """The step time's TP term adds whole copies of the stream around a sequence-parallel
    layer's collectives (``planning.step_time.sequence_parallel_copies``): counted here in
    one block's forward and backward on two ranks, two passes of 2 all-gathers and 2
    reduce-scatters each; every reduce-scatter copies its input, an all-gather its output
    but where the batch is 1 (a view)."""
    from sac_compile.planning.step_time import sequence_parallel_copies

    for counts in run_ranks(_stream_copies, (1, 2)):
        for batch, (copies, collectives) in counts.items():
            assert collectives == 8 and copies == 2 * sequence_parallel_copies(batch), (batch, counts)


def test_tensor_parallel_eager_offload_moves_each_ranks_shards_and_keeps_the_gradients():
    """Both plans, ``keep={"attn"}, offload={"mlp"}`` and the reverse, eagerly on two ranks:
    gradients equal the unwrapped sharded stack's, and each rank copies less to the host than
    the unsharded stack does. Red before: with sequence parallelism offloading the attention
    failed in the recompute ("aten.clone.default ran during the recompute ... but not in the
    forward": the host copy was the DTensor's own ``clone()``, which all-reduces a ``Partial``
    value into a ``Replicate`` one, so the recompute redistributed it another way), and a
    DTensor's bytes were counted at its global size (40,960 B a rank against 32,768 B
    unsharded)."""
    import sac_compile as sc
    from sac_compile.testing.tp import REGIONS, LlamaStack

    whole = {}
    for keep, offload in OFFLOADS:
        torch.manual_seed(0)
        stack = LlamaStack(n=2, d=32)
        sc.declare_regions(stack, REGIONS)
        torch.manual_seed(1)
        whole[min(offload)] = _offloaded_run(stack, torch.randn(2, 16, 32), keep, offload)[2]
    results = run_ranks(_offloading)
    for per_rank in results:
        for sp in (False, True):
            for name, (loss_diff, grad_diff, moved) in per_rank[sp].items():
                assert loss_diff < 1e-4 and grad_diff < 1e-5, (sp, name, loss_diff, grad_diff)
                assert whole[name] / 2 <= moved < whole[name], (sp, name, moved, whole[name])
    # the planner's per-rank figure (planning.offload.offloaded_per_rank, one layer planned whole
    # in this process), both plans: within 1% (red before: without sequence parallelism 0.67x
    # and 0.84x, the offloaded bytes split tp ways; with it 1.33x and 1.36x, split as the
    # partition's values are)
    for sp in (False, True):
        predicted = _predicted_offloaded_per_rank(sp)
        table = {name: (predicted[name], results[0][sp][name][2]) for name in predicted}
        assert all(abs(p - m) <= 0.01 * m for p, m in table.values()), (sp, table)


def _predicted_offloaded_per_rank(sequence_parallel: bool) -> dict:
    """Per offloaded region: the bytes one of two ranks sends to the host for the two-layer stack
    run eagerly, as the planner predicts it."""
    from sac_compile.planning.offload import offloaded_per_rank

    return {
        min(offload): 2 * offloaded_per_rank(c, _tp2(sequence_parallel), compile=False)
        for keep, offload in OFFLOADS
        for c in _one_layer_plan().candidates
        if c.keep == frozenset(keep) and c.offload == frozenset(offload)
    }


@pytest.mark.slow
@every_release
def test_tensor_parallel_compiled_offload_sends_each_ranks_split_and_keeps_the_gradients():
    """Both plans, ``keep={"attn"}, offload={"mlp"}`` and the reverse, each block compiled
    (PyTorch's partitioner offload pass on DTensor blocks): gradients equal the unwrapped
    sharded stack's, and what a block sends to the host is the planner's per-rank figure
    exactly (``Candidate.tp_offloaded_split``: the offloaded values split as the saved ones
    are; with sequence parallelism the rank also sends the input it gathered). Before, the
    difference of two candidates' held bytes said 0.73 for the attention without sequence
    parallelism and 0.98 with it (the feed-forward's was exact)."""
    from sac_compile.planning.offload import offloaded_per_rank

    results = run_ranks(_offloading, True)
    for sp in (False, True):
        for keep, offload in OFFLOADS:
            name = min(offload)
            c = next(c for c in _one_layer_plan().candidates if c.keep == keep and c.offload == offload)
            predicted = offloaded_per_rank(c, _tp2(sp), compile=True)
            for per_rank in results:
                loss_diff, grad_diff, moved = per_rank[sp][name]
                assert loss_diff < 1e-4 and grad_diff < 1e-5, (sp, name, loss_diff, grad_diff)
                assert predicted == moved < c.offloaded_bytes, (sp, name, predicted, moved, c.offloaded_bytes)
