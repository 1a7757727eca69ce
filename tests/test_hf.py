"""Real outside models: Hugging Face transformers Llama and Qwen3-MoE (both expert implementations).

Tiny random configs on CPU, no downloads. Regions are declared by module path
(``sac_compile.hf.regions_for``); every decoder layer is wrapped by one
``SacConfig``. Eager results are bit-identical to the unwrapped model, compiled
ones match within float tolerance, and the regions show up by name.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

pytest.importorskip("transformers")

import sac_compile as sc  # noqa: E402
from sac_compile import hf  # noqa: E402
from sac_compile.testing import hf_families  # noqa: E402

from .models import bit_identical, lm_step  # noqa: E402
from .parity import parity_report  # noqa: E402

MODELS = {
    "llama": (lambda: hf_families.tiny_llama(), ("attn", "mlp")),
    "qwen3moe-grouped_mm": (
        lambda: hf_families.tiny_qwen3_moe(experts_implementation="grouped_mm"),
        ("attn", "experts"),
    ),
    "qwen3moe-eager": (
        lambda: hf_families.tiny_qwen3_moe(experts_implementation="eager"),
        ("attn", "experts"),
    ),
}


def _pair(name: str):
    build, regions = MODELS[name]
    ref = build().train()
    model = build().train()
    model.load_state_dict(ref.state_dict())
    return ref, model, regions


def _layer0(model: nn.Module) -> tuple[hf.LayerCall, torch.Tensor]:
    return hf.layer_call(model, hf.batch(model))


@pytest.mark.parametrize("name", list(MODELS))
def test_eager_sac_is_bit_identical_to_the_unwrapped_model(name):
    ref, model, (a, b) = _pair(name)
    hf.config_for(model, keep={a, b}).apply(model)
    ids = hf.batch(model)
    loss_ref, g_ref = lm_step(ref, ids)
    for _ in range(2):  # a second step reuses everything
        loss, g = lm_step(model, ids)
        assert torch.equal(loss, loss_ref)
        assert g.keys() == g_ref.keys()
        assert all(torch.equal(g[k], g_ref[k]) for k in g), [k for k in g if not torch.equal(g[k], g_ref[k])]


# One Inductor smoke case (a dense model that compiles to one graph per layer); aot_eager
# covers the rest (the region tagging is the same; Inductor only adds codegen).
COMPILED_CASES = [(name, "aot_eager") for name in MODELS] + [
    pytest.param("llama", "inductor", marks=pytest.mark.slow)
]


@pytest.mark.slow
@pytest.mark.parametrize("name, inner", COMPILED_CASES)
def test_compiled_per_layer_sac_matches_the_unwrapped_model(name, inner):
    ref, model, (a, b) = _pair(name)
    hf.config_for(model, keep={a}, compile={"inner": inner}).apply(model)
    ids = hf.batch(model)
    loss_ref, g_ref = lm_step(ref, ids)
    loss, g = lm_step(model, ids)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    assert g.keys() == g_ref.keys()
    for k in g:
        torch.testing.assert_close(g[k], g_ref[k], rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen3moe-grouped_mm"])
def test_whole_model_fullgraph_compile_with_declared_regions(name):
    ref, model, (a, _) = _pair(name)
    hf.config_for(model, keep={a}).apply(model)
    ids = hf.batch(model)
    loss_ref, g_ref = lm_step(ref, ids)
    with sc.inspection.collect_records() as recs:
        compiled = torch.compile(model, backend=sc.make_sac_backend({a}, inner="aot_eager"), fullgraph=True)
        loss, g = lm_step(compiled, ids)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    for k in g:
        torch.testing.assert_close(g[k], g_ref[k], rtol=1e-4, atol=1e-6, msg=k)
    [rec] = recs
    assert [s.source for s in rec.scopes] == ["scope markers"] * 2  # one scope per decoder layer
    assert rec.regions[a].entered == 2 and rec.regions[a].saved_nodes > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen3moe-grouped_mm"])
def test_compiled_saved_bytes_per_layer_fall_from_none_and_rise_from_full(name):
    _, model, (a, b) = _pair(name)
    sc.declare_regions(model, hf.regions_for(model))
    layer, h = _layer0(model)
    none = sc.inspection.capture_partition(layer, h, backend="aot_eager")
    saved = {}
    for keep in [(), (a,), (b,), (a, b)]:
        torch._dynamo.reset()
        report = sc.inspection.capture_partition(
            layer, h, backend=sc.make_sac_backend(set(keep), inner="aot_eager")
        )
        saved[keep] = report.saved_bytes
        assert report.saved_regions() == set(keep), (keep, report.format())
        for region in keep:
            assert f" {region} " in report.format()  # by name in the printed table
    assert saved[()] < saved[(a,)] < none.saved_bytes
    assert saved[()] < saved[(b,)] < none.saved_bytes
    assert max(saved[(a,)], saved[(b,)]) < saved[(a, b)]
    # keeping both may exceed the no-checkpoint partition slightly: kept regions save their
    # pointwise outputs (MUST_SAVE), which the unconstrained partitioner recomputes
    assert saved[(a, b)] < 1.1 * none.saved_bytes


@pytest.mark.parametrize("name", list(MODELS))
def test_eager_held_bytes_per_layer_rise_with_kept_regions(name):
    _, model, (a, b) = _pair(name)
    sc.declare_regions(model, hf.regions_for(model))
    layer, h = _layer0(model)
    none = sc.inspection.autograd_saved_bytes(layer, h, exclude=model.parameters())
    from sac_compile.eager import checkpoint_with_regions

    held = {}
    for keep in [(), (a,), (a, b)]:
        stats: list = []
        checkpoint_with_regions(layer, h, keep=set(keep), stats_out=stats).sum().backward()
        by_region = stats[0].held_by_region
        # activations only: "rng" is the RNG state kept to replay a random op (dropout)
        held[keep] = sum(v for k, v in by_region.items() if k != "rng")
        assert {r for key in by_region if by_region[key] for r in key.split("+")} - {"-", "rng"} == set(keep)
    assert held[()] == 0 < held[(a,)] < held[(a, b)] <= none


@pytest.mark.parametrize("name", ["llama", "qwen3moe-grouped_mm"])
def test_parity_report_names_the_declared_regions(name):
    _, model, (a, b) = _pair(name)
    sc.declare_regions(model, hf.regions_for(model))
    layer, h = _layer0(model)
    report = parity_report(layer, h, keep={a, b}, inner="aot_eager")
    assert report.saved_regions("eager") == {a, b}
    assert report.saved_regions("compiled") == {a, b}
    assert f"\n{a} " in report.format() and f"\n{b} " in report.format()


@pytest.mark.slow
def test_eager_experts_under_compile_are_reported_not_silently_uncompiled(caplog):
    """The 'eager' experts loop graph-breaks at nonzero: the diagnostics say that the declared
    region is split across graphs (each piece still starts inside it: tests/test_graph_breaks.py)."""
    import logging

    caplog.set_level(logging.WARNING, logger="sac_compile")
    _, model, _ = _pair("qwen3moe-eager")
    hf.config_for(model, keep={"experts"}, compile={"inner": "aot_eager"}).apply(model)
    ids = hf.batch(model)
    lm_step(model, ids)
    lm_step(model, ids)
    msgs = [r.getMessage() for r in caplog.records if r.name == "sac_compile"]
    assert any("[graph-break] region 'experts'" in m for m in msgs), msgs
    assert not any("[unbalanced]" in m for m in msgs), msgs


def test_compiling_a_wrapped_layer_raises_no_warning_of_ours(monkeypatch):
    """A transformers layer compiled through the seam warns of nothing sac-compile does: red
    while the cache-argument positions were memoised by ``functools.cache`` (Dynamo warns
    that it traces through an ``lru_cache`` wrapper)."""
    import torch._dynamo.utils as dynamo_utils

    monkeypatch.setattr(dynamo_utils, "warn_once_cache", set())  # Dynamo warns once per process
    ref, model, (a, _) = _pair("llama")
    hf.config_for(model, keep={a}, compile={"inner": "aot_eager"}).apply(model)
    ids = hf.batch(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm_step(model, ids)
    ours = [str(w.message) for w in caught if "sac_compile" in str(w.message) or "sac_compile" in w.filename]
    assert not ours, ours


# --- the transformers releases sac_compile.hf supports ---------------------------------------


def test_the_installed_transformers_is_in_the_supported_range():
    import transformers

    from sac_compile._compat.transformers import SUPPORTED, _release, check_version

    check_version()
    assert SUPPORTED[0] <= _release(transformers.__version__) < SUPPORTED[1]


@pytest.mark.parametrize("version", ["5.23.0", "5.26.0", "4.57.1"])
def test_an_unsupported_transformers_is_one_clear_error(version, monkeypatch):
    from sac_compile._compat.transformers import ANY_RELEASE_ENV, check_version

    monkeypatch.delenv(ANY_RELEASE_ENV, raising=False)
    with pytest.raises(
        ImportError, match=rf"supports transformers >=5\.24\.0,<5\.26; transformers {version} is installed"
    ):
        check_version(version)
    monkeypatch.setenv(ANY_RELEASE_ENV, "1")
    with pytest.warns(UserWarning, match=version):
        check_version(version)


def test_kernelized_attention_lets_dynamo_trace_the_checkpoints_forward_side_effects(caplog):
    """transformers 5.25 routes each attention's functions through kernels, whose forward sets a
    context variable: under transformers' switch and torch.compile that broke the graph at every
    layer (tests/test_integrations.py's compiled switch tests, red on 5.25.0 before). Simulated
    here on the installed release: the switch's kwargs turn Dynamo's knob on, said once."""
    import logging

    config = torch._dynamo.config
    # config.patch restores the value (pytest's monkeypatch would hide the key: its undo deletes)
    with config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=False):
        plain = hf_families.tiny_llama()
        for layer in plain.model.layers:
            vars(layer.self_attn).pop("_kernel_funcs", None)  # as on 5.24 and before
        hf.checkpointing_kwargs(plain, keep={"attn"})
        assert config.skip_fwd_side_effects_in_bwd_under_checkpoint is False  # nothing kernelized
        model = hf_families.tiny_llama()
        for layer in model.model.layers:
            if "_kernel_funcs" not in vars(layer.self_attn):  # transformers 5.25 sets it in __init__
                layer.self_attn._kernel_funcs = {}
        with caplog.at_level(logging.WARNING, logger="sac_compile"):
            hf.checkpointing_kwargs(model, keep={"attn"})
            hf.checkpointing_kwargs(model, keep={"attn"})
        assert config.skip_fwd_side_effects_in_bwd_under_checkpoint is True
    said = [r.getMessage() for r in caplog.records if "skip_fwd_side_effects" in r.getMessage()]
    assert len(said) == 1 and "LlamaAttention" in said[0], said


@pytest.mark.subprocess
def test_importing_sac_compile_hf_with_an_unsupported_transformers_fails_at_once():
    import subprocess
    import sys

    code = "import importlib.metadata as m; m.version = lambda name: '5.23.0'; import sac_compile.hf"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "ImportError: sac_compile.hf supports transformers >=5.24.0,<5.26" in done.stderr, done.stderr[
        -2000:
    ]


def _tiny_dbrx():
    from transformers import DbrxConfig, DbrxForCausalLM

    cfg = DbrxConfig(
        d_model=64,
        n_heads=4,
        n_layers=2,
        max_seq_len=128,
        vocab_size=128,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
    )
    torch.manual_seed(0)
    return DbrxForCausalLM._from_config(cfg, attn_implementation="sdpa")


def test_a_region_inside_layer_glue_is_found_dbrx_keeps_attention():
    """DBRX's attention sits inside DbrxNormAttentionNorm, which reads as glue (a norm): red
    before, keep={"attn"} answered "has no region 'attn'" and ALL_REGIONS kept no attention."""
    import copy

    ref = _tiny_dbrx()
    assert hf.regions_for(ref)["transformer.blocks.*.norm_attn_norm.attn"] == "attn"
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    held = {}
    for keep in ((), {"attn"}):
        model = copy.deepcopy(ref)
        hf.config_for(model, keep=keep).apply(model)
        assert bit_identical(lm_step(model, ids), lm_step(ref, ids))

        def loss(i, m=model):
            return m(input_ids=i, labels=i, use_cache=False).loss

        held[bool(keep)] = sc.inspection.autograd_saved_bytes(loss, ids, exclude=list(model.parameters()))
    assert held[False] < held[True], held
