"""offload=: a region's saved values sent to host memory in the forward and brought back for
the backward, compiled (through PyTorch's partitioner offload pass). On this CPU the copies
are host to host: the tests check the graphs (offload and reload on exactly the region's
saved values), the reports and the gradients; the eager engine copies its cache to the host."""

from __future__ import annotations

import copy

import pytest
import torch

import sac_compile as sc
from sac_compile.testing.models import Block

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
