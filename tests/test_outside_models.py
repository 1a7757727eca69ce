"""Outside models (transformers GPT-2, GPT-NeoX, Falcon), every region kept: never more than no checkpoint.

Each family is declared by module path (``SacConfig(layers=..., regions=...)``), every decoder
layer wrapped, all regions kept under the default policy. Measured with the profiler's
allocator accounting (bytes the forward allocates and still holds when it returns, the same
measure for eager and compiled code): keeping every region holds no more than running the same
model without checkpointing, eager (bit-identical gradients, GPT-2's dropout included) and with
every layer compiled (``aot_eager``; gradients within float tolerance).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import sac_compile as sc  # noqa: E402
from sac_compile.compiler.backend import baseline_backend  # noqa: E402
from sac_compile.policy import SAVE_ALL  # noqa: E402

from .models import net_forward_bytes  # noqa: E402
from .releases import beyond  # noqa: E402


# Default configs (use_cache=True): the seam turns cache writes off while training, as
# transformers' own checkpointing does (a recompute would append to the KV cache again).
def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4, eos_token_id=0, bos_token_id=0
    )
    return GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")  # dropout 0.1 everywhere


def _neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
    )
    return GPTNeoXForCausalLM._from_config(cfg, attn_implementation="sdpa")


def _falcon():
    from transformers import FalconConfig, FalconForCausalLM

    cfg = FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    return FalconForCausalLM._from_config(cfg, attn_implementation="sdpa")


FAMILIES = {
    "gpt2": (_gpt2, "transformer.h.*", {"transformer.h.*.attn": "attn", "transformer.h.*.mlp": "mlp"}),
    "gpt-neox": (
        _neox,
        "gpt_neox.layers.*",
        {"gpt_neox.layers.*.attention": "attn", "gpt_neox.layers.*.mlp": "mlp"},
    ),
    "falcon": (
        _falcon,
        "transformer.h.*",
        {"transformer.h.*.self_attention": "attn", "transformer.h.*.mlp": "mlp"},
    ),
}


def _pair(name):
    build, layers, regions = FAMILIES[name]
    torch.manual_seed(0)
    ref = build().train()
    model = build().train()
    model.load_state_dict(ref.state_dict())
    return ref, model, layers, regions


def _ids():
    return torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))


def _step(model, ids, seed=3):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _held(model, ids, seed=3):
    torch.manual_seed(seed)
    return net_forward_bytes(lambda: model(input_ids=ids, labels=ids).loss)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_eager_keeping_every_region_is_bit_identical_and_holds_no_more(name):
    ref, model, layers, regions = _pair(name)
    ids = _ids()
    none = _held(ref, ids)
    ref_loss, ref_grads = _step(ref, ids)
    sc.SacConfig(layers=layers, keep=sc.ALL_REGIONS, regions=regions).apply(model)
    held = _held(model, ids)
    loss, grads = _step(model, ids)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))
    assert held <= none, (name, held, none)


@pytest.mark.slow
@pytest.mark.parametrize("name", beyond(list(FAMILIES), "gpt2"))
def test_compiled_keeping_every_region_holds_no_more_than_compiled_without_checkpointing(name):
    ref, model, layers, regions = _pair(name)
    ids = _ids()
    ref_loss, ref_grads = _step(ref, ids)
    base = _pair(name)[1]
    for path, layer in base.named_modules():
        if sc.declare.match_path(layers, path):
            layer.compile(backend=baseline_backend("aot_eager"))
    none = _held(base, ids)
    held = {}
    for policy in (sc.SAVE_COSTLY, SAVE_ALL):
        torch._dynamo.reset()
        _, model, _, _ = _pair(name)
        cfg = sc.SacConfig(
            layers=layers, keep=sc.ALL_REGIONS, regions=regions, compile={"inner": "aot_eager"}, policy=policy
        )
        cfg.apply(model)
        held[policy] = _held(model, ids)
        loss, grads = _step(model, ids)
        if name != "gpt2":  # dropout: compiled code draws its own masks
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
            for a, b in zip(grads, ref_grads, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert held[sc.SAVE_COSTLY] <= none, (name, held, none)
    assert held[sc.SAVE_COSTLY] < held[SAVE_ALL], (name, held)
