"""Tiny random-weight vision-language models of transformers 5.x, with a batch that runs
every stack (CPU, no download).

Each family is a vision tower's blocks + a language decoder's layers (two stacks for
:func:`sac_compile.hf.stacks`), two layers each: LLaVA (a CLIP tower before Llama),
Qwen2.5-VL (windowed, variable-length vision attention: one ``cu_seqlens`` per window) and
Gemma-3 (a SigLIP tower pooled into Gemma-3, bidirectional attention over image tokens).
:func:`build` returns ``(model, inputs)``: ``model(**inputs).loss`` trains both stacks.
Used by ``tests/test_hf_stacks.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from .._compat.transformers import from_config

__all__ = ["FAMILIES", "build"]

_TEXT: dict[str, Any] = dict(
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
_VISION: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
)
_IMAGE = 127  # the image placeholder token of every family here
_SEQ = 24


def _ids(batch: int, image_at: int, image_tokens: int) -> torch.Tensor:
    ids = torch.randint(1, 120, (batch, _SEQ), generator=torch.Generator().manual_seed(1))
    ids[:, image_at : image_at + image_tokens] = _IMAGE
    return ids


def _llava() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(**_VISION, image_size=16, patch_size=4, projection_dim=32)
    cfg = LlavaConfig(
        vision_config=vision, text_config=LlamaConfig(**_TEXT), image_token_id=_IMAGE, vision_feature_layer=-1
    )
    model = from_config(LlavaForConditionalGeneration, cfg, attn_implementation="sdpa")
    ids = _ids(2, 2, (16 // 4) ** 2)  # one token per patch (the CLS token dropped)
    return model, dict(input_ids=ids, pixel_values=_pixels(2, 3, 16, 16), labels=ids)


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
        text_config=dict(_TEXT, rope_parameters=rope),
        vision_config=vision,
        image_token_id=_IMAGE,
        vision_start_token_id=125,
        vision_end_token_id=126,
    )
    model = from_config(Qwen2_5_VLForConditionalGeneration, cfg, attn_implementation="sdpa")
    grid = torch.tensor([[1, 8, 8], [1, 8, 8]])  # (t, h, w) patches per image, one image per row
    tokens = 8 * 8 // 4  # merged 2 x 2
    ids = _ids(2, 2, tokens)
    ids[:, 1], ids[:, 2 + tokens] = 125, 126
    pixels = _pixels(int(grid.prod(-1).sum()), 3 * 2 * 4 * 4)  # channels x temporal x patch x patch
    return model, dict(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, labels=ids)


def _gemma3() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    cfg = Gemma3Config(
        vision_config=SiglipVisionConfig(**_VISION, image_size=16, patch_size=4),
        text_config=Gemma3TextConfig(**_TEXT, sliding_window=8),
        mm_tokens_per_image=4,
        image_token_id=_IMAGE,
        boi_token_index=125,
        eoi_token_index=126,
    )
    model = from_config(Gemma3ForConditionalGeneration, cfg, attn_implementation="sdpa")
    # transformers initialises the projection into the decoder at zero (the vision tower
    # would get zero gradients): random here, so that a wrong vision gradient shows
    nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.5)
    ids = _ids(2, 2, 4)
    return model, dict(
        input_ids=ids, pixel_values=_pixels(2, 3, 16, 16), token_type_ids=(ids == _IMAGE).long(), labels=ids
    )


def _pixels(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(2))


#: family -> builder of ``(model, inputs)``
FAMILIES: dict[str, Callable[[], tuple[nn.Module, dict[str, Any]]]] = {
    "llava": _llava,
    "qwen2_5_vl": _qwen2_5_vl,
    "gemma3": _gemma3,
}


def build(name: str, *, seed: int = 0) -> tuple[nn.Module, dict[str, Any]]:
    """``(model in training mode, inputs)``; the same weights for the same ``seed``."""
    torch.manual_seed(seed)
    model, inputs = FAMILIES[name]()
    return model.train(), inputs
