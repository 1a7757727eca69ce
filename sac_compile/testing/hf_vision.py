"""Tiny random-weight vision-language models of transformers 5.x, with a batch that runs
every stack (CPU, no download).

Each family is a vision tower's blocks + a language decoder's layers (two stacks for
:func:`sac_compile.hf.stacks`), two layers each: LLaVA (a CLIP tower before Llama),
Qwen2.5-VL (windowed, variable-length vision attention: one ``cu_seqlens`` per window) and
Gemma-3 (a SigLIP tower pooled into Gemma-3, bidirectional attention over image tokens).
:func:`build` returns ``(model, inputs)``: ``model(**inputs).loss`` trains both stacks.
Used by ``tests/test_hf_stacks.py``; :mod:`sac_compile.testing._dev.hf_multimodal` adds more
families (built from the pieces here).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from .._compat.transformers import from_config

__all__ = ["FAMILIES", "build", "build_from"]

TEXT: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=0,
    eos_token_id=0,
)
VISION: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
)
IMAGE_TOKEN = 127  # the image placeholder token of every family here
SEQ = 24


def image_ids(batch: int, image_at: int, image_tokens: int) -> torch.Tensor:
    ids = torch.randint(1, 120, (batch, SEQ), generator=torch.Generator().manual_seed(1))
    ids[:, image_at : image_at + image_tokens] = IMAGE_TOKEN
    return ids


def _llava() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(**VISION, image_size=16, patch_size=4, projection_dim=32)
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=LlamaConfig(**TEXT),
        image_token_index=IMAGE_TOKEN,
        vision_feature_layer=-1,
    )
    model = from_config(LlavaForConditionalGeneration, cfg, attn_implementation="sdpa")
    ids = image_ids(2, 2, (16 // 4) ** 2)  # one token per patch (the CLS token dropped)
    return model, dict(input_ids=ids, pixel_values=random_pixels(2, 3, 16, 16), labels=ids)


def _qwen2_5_vl() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    rope = dict(rope_type="default", mrope_section=[1, 1, 2], rope_theta=10000.0)
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        out_hidden_size=32,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=16,  # windows of 2 x 2 merged patches: block 0 attends per window
        fullatt_block_indexes=[1],
    )
    cfg = Qwen2_5_VLConfig(
        text_config=dict(TEXT, rope_parameters=rope),
        vision_config=vision,
        image_token_id=IMAGE_TOKEN,
        vision_start_token_id=125,
        vision_end_token_id=126,
    )
    model = from_config(Qwen2_5_VLForConditionalGeneration, cfg, attn_implementation="sdpa")
    grid = torch.tensor([[1, 8, 8], [1, 8, 8]])  # (t, h, w) patches per image, one image per row
    tokens = 8 * 8 // 4  # merged 2 x 2
    ids = image_ids(2, 2, tokens)
    ids[:, 1], ids[:, 2 + tokens] = 125, 126
    pixels = random_pixels(int(grid.prod(-1).sum()), 3 * 2 * 4 * 4)  # channels x temporal x patch x patch
    return model, dict(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, labels=ids)


def _gemma3() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    cfg = Gemma3Config(
        vision_config=SiglipVisionConfig(**VISION, image_size=16, patch_size=4),
        text_config=Gemma3TextConfig(**TEXT, sliding_window=8),
        mm_tokens_per_image=4,
        image_token_index=IMAGE_TOKEN,
        boi_token_index=125,
        eoi_token_index=126,
    )
    model: Any = from_config(Gemma3ForConditionalGeneration, cfg, attn_implementation="sdpa")
    # transformers initialises the projection into the decoder at zero (the vision tower
    # would get zero gradients): random here, so that a wrong vision gradient shows
    nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.5)
    ids = image_ids(2, 2, 4)
    return model, dict(
        input_ids=ids,
        pixel_values=random_pixels(2, 3, 16, 16),
        token_type_ids=(ids == IMAGE_TOKEN).long(),
        labels=ids,
    )


def random_pixels(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(2))


# -- pieces the families of hf_multimodal and hf_encoders share ------------------------------------------------------------


def mrope() -> dict[str, Any]:  # a new dict each time: configs complete theirs in place
    return dict(rope_type="default", mrope_section=[1, 1, 2], rope_theta=10000.0)


AUDIO: dict[str, Any] = dict(  # a Whisper-style audio encoder: 32 mel frames of 8 bins
    num_mel_bins=8,
    encoder_layers=2,
    encoder_attention_heads=4,
    encoder_ffn_dim=64,
    d_model=32,
    max_source_positions=16,
)
BART: dict[str, Any] = dict(
    vocab_size=128,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=0,
    eos_token_id=0,
    decoder_start_token_id=0,
)


def text_config(model_type: str, **extra: Any) -> dict[str, Any]:
    return dict(TEXT, model_type=model_type, **extra)


def vision_config(model_type: str, size: int = 16, **extra: Any) -> dict[str, Any]:
    return dict(VISION, model_type=model_type, image_size=size, patch_size=4, **extra)


def make(model_cls: type, cfg: Any) -> nn.Module:
    return from_config(model_cls, cfg, attn_implementation="sdpa")  # every family here has SDPA


def lm_batch(image_tokens: int, **inputs: Any) -> dict[str, Any]:
    """Token ids with ``image_tokens`` placeholders from position 2 (one image a row), as
    labels too, and ``inputs``."""
    ids = image_ids(2, 2, image_tokens)
    return dict(input_ids=ids, labels=ids, **inputs)


def seq2seq_batch() -> dict[str, Any]:
    ids = image_ids(2, 0, 0)
    return dict(input_ids=ids, labels=ids.flip(-1))


#: family -> builder of ``(model, inputs)``
FAMILIES: dict[str, Callable[[], tuple[nn.Module, dict[str, Any]]]] = {
    "llava": _llava,
    "qwen2_5_vl": _qwen2_5_vl,
    "gemma3": _gemma3,
}


def build(name: str, *, seed: int = 0) -> tuple[nn.Module, dict[str, Any]]:
    """``(model in training mode, inputs)``; the same weights for the same ``seed``."""
    return build_from(FAMILIES, name, seed=seed)


def build_from(
    families: dict[str, Callable[[], tuple[nn.Module, dict[str, Any]]]], name: str, *, seed: int = 0
) -> tuple[nn.Module, dict[str, Any]]:
    """:func:`build` from another table of families (the development fixtures' wider one)."""
    torch.manual_seed(seed)
    model, inputs = families[name]()
    return model.train(), inputs
