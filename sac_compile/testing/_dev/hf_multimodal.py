"""More tiny multimodal and encoder-decoder models of transformers 5.x, with a batch that
runs every stack (CPU, no download), for ``benchmarks/hf_vision_families.py``.

:data:`FAMILIES` holds :mod:`sac_compile.testing.hf_vision`'s three and these (hidden 32,
two layers a stack, vocabulary 128, SDPA attention): image-text-to-text (Qwen2-VL, Qwen3-VL,
Qwen3-VL-MoE, Qwen3.5, GLM-4V, Idefics3, SmolVLM, PaliGemma, LLaVA-NeXT, LLaVA-OneVision,
Mistral3 / Pixtral, InternVL, Aya Vision, Gemma-4, Mllama's cross-attention decoder, BLIP-2's
Q-Former, Kosmos-2, Pix2Struct, Florence-2), encoder-decoders (BART, T5, Whisper) and audio
(Qwen2-Audio, Qwen2.5-Omni's thinker: audio, vision and text stacks). :func:`build` returns
``(model, inputs)``: ``model(**inputs).loss`` trains every stack (each stack's parameters
get non-zero gradients; projections and gates transformers initialises at zero are random
here).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from .. import hf_vision
from ..hf_vision import (
    AUDIO,
    IMAGE_TOKEN,
    TEXT,
    VISION,
    image_ids,
    lm_batch,
    make,
    mrope,
    random_pixels,
    text_config,
    vision_config,
)
from . import hf_encoders

__all__ = ["FAMILIES", "build"]


def _qwen_vl(config_cls: type, model_cls: type, vision: dict, text: dict, **tokens: Any) -> tuple:
    """A Qwen-VL-style family (M-RoPE, patches of 4 x 4 pixels x 2 frames, an 8 x 8 grid per
    image merged 2 x 2 into 16 tokens between a start and an end token)."""
    cfg = config_cls(
        text_config=dict(TEXT, rope_parameters=mrope(), **text),
        vision_config=dict(
            depth=2, num_heads=4, patch_size=4, spatial_merge_size=2, temporal_patch_size=2, **vision
        ),
        image_token_id=IMAGE_TOKEN,
        **(tokens or dict(vision_start_token_id=125, vision_end_token_id=126)),
    )
    grid = torch.tensor([[1, 8, 8], [1, 8, 8]])
    ids = image_ids(2, 2, 16)
    ids[:, 1], ids[:, 18] = 125, 126
    pixels = random_pixels(int(grid.prod(-1).sum()), 3 * 2 * 4 * 4)
    mm = (ids == IMAGE_TOKEN).int()  # the modality of each token, for the M-RoPE positions
    return make(model_cls, cfg), dict(
        input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=mm, labels=ids
    )


_QWEN3_VISION = dict(hidden_size=32, intermediate_size=64, out_hidden_size=32, num_position_embeddings=16)


# -- Qwen-VL-style: windowed / variable-length vision attention, M-RoPE ------------------------


def _qwen2_vl() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    vision = dict(embed_dim=32, hidden_size=32, mlp_ratio=2)
    return _qwen_vl(Qwen2VLConfig, Qwen2VLForConditionalGeneration, vision, {})


def _qwen3_vl() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    vision = dict(_QWEN3_VISION, deepstack_visual_indexes=[0])  # block 0's output into decoder layer 0
    return _qwen_vl(Qwen3VLConfig, Qwen3VLForConditionalGeneration, vision, {})


def _qwen3_vl_moe() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    vision = dict(_QWEN3_VISION, deepstack_visual_indexes=[0])
    moe = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    return _qwen_vl(Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration, vision, moe)


def _qwen3_5() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(  # a gated-DeltaNet layer (mixer) then an attention layer
        layer_types=["linear_attention", "full_attention"],
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    )
    return _qwen_vl(Qwen3_5Config, Qwen3_5ForConditionalGeneration, _QWEN3_VISION, text)


def _glm4v() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration

    vision = dict(hidden_size=32, intermediate_size=64, out_hidden_size=32, image_size=32)
    tokens = dict(image_start_token_id=125, image_end_token_id=126)
    return _qwen_vl(Glm4vConfig, Glm4vForConditionalGeneration, vision, {}, **tokens)


def _qwen2_5_omni_thinker() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration

    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        out_hidden_size=32,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=16,
        fullatt_block_indexes=[1],
    )
    # (attributes Qwen2_5OmniThinkerConfig's fields leave out)
    extra: dict[str, Any] = {"vision_start_token_id": 125, "vision_end_token_id": 126}
    cfg = Qwen2_5OmniThinkerConfig(
        audio_config=dict(AUDIO, n_window=8, output_dim=32),
        vision_config=vision,
        text_config=dict(TEXT, rope_parameters=mrope()),
        audio_token_index=124,
        image_token_index=IMAGE_TOKEN,
        video_token_index=123,
        audio_start_token_id=121,
        audio_end_token_id=122,
        **extra,
    )
    ids = image_ids(2, 2, 4)  # a 4 x 4 grid of patches merged 2 x 2, then 32 mel frames: 8 audio tokens
    ids[:, 1], ids[:, 6], ids[:, 8], ids[:, 9:17], ids[:, 17] = 125, 126, 121, 124, 122
    return make(Qwen2_5OmniThinkerForConditionalGeneration, cfg), dict(
        input_ids=ids,
        labels=ids,
        pixel_values=random_pixels(2 * 16, 3 * 2 * 4 * 4),
        image_grid_thw=torch.tensor([[1, 4, 4], [1, 4, 4]]),
        input_features=random_pixels(2, 8, 32),
        feature_attention_mask=torch.ones(2, 32, dtype=torch.long),
    )


# -- a ViT / SigLIP / CLIP tower projected into a decoder ---------------------------------------


def _idefics3_like(config_cls: type, model_cls: type) -> tuple[nn.Module, dict[str, Any]]:
    cfg = config_cls(
        vision_config=dict(VISION, image_size=16, patch_size=4),
        text_config=text_config("llama"),
        image_token_id=IMAGE_TOKEN,
        scale_factor=2,
    )
    # 4 x 4 patches shuffled 2 x 2 into 4 tokens; pixels (batch, images, channels, h, w)
    return make(model_cls, cfg), lm_batch(4, pixel_values=random_pixels(2, 1, 3, 16, 16))


def _idefics3() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    return _idefics3_like(Idefics3Config, Idefics3ForConditionalGeneration)


def _smolvlm() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration

    return _idefics3_like(SmolVLMConfig, SmolVLMForConditionalGeneration)


def _paligemma() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    cfg = PaliGemmaConfig(
        vision_config=vision_config("siglip_vision_model", projection_dim=32),
        text_config=text_config("gemma"),
        image_token_index=IMAGE_TOKEN,
        projection_dim=32,
        hidden_size=32,
        vocab_size=128,
    )
    batch = lm_batch(16, pixel_values=random_pixels(2, 3, 16, 16))  # a token per patch
    return make(PaliGemmaForConditionalGeneration, cfg), dict(
        batch, token_type_ids=(batch["input_ids"] == IMAGE_TOKEN).long()
    )


def _anyres(config_cls: type, model_cls: type, vision: dict, text: dict, **config: Any) -> tuple:
    """LLaVA-NeXT-style: an 8 x 8 image and its one 8 x 8 crop, 2 x 2 patches each: 4 tokens
    and 2 x 2 with a newline per row."""
    cfg = config_cls(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE_TOKEN,
        image_grid_pinpoints=[[8, 8]],
        **config,
    )
    inputs = lm_batch(
        4 + 6, pixel_values=random_pixels(2, 2, 3, 8, 8), image_sizes=torch.tensor([[8, 8]] * 2)
    )
    return make(model_cls, cfg), inputs


def _llava_next() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration

    vision = vision_config("clip_vision_model", 8, projection_dim=32)
    return _anyres(
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        vision,
        text_config("llama"),
        vision_feature_layer=-1,
    )


def _llava_onevision() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    vision = vision_config("siglip_vision_model", 8)
    cls = LlavaOnevisionForConditionalGeneration
    return _anyres(LlavaOnevisionConfig, cls, vision, text_config("qwen2"), video_token_index=126)


def _mistral3() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    cfg = Mistral3Config(
        vision_config=vision_config("pixtral", head_dim=8),
        text_config=text_config("mistral"),
        image_token_index=IMAGE_TOKEN,
        spatial_merge_size=2,
    )
    pixels, sizes = random_pixels(2, 3, 16, 16), torch.tensor([[16, 16]] * 2)
    return make(Mistral3ForConditionalGeneration, cfg), lm_batch(4, pixel_values=pixels, image_sizes=sizes)


def _internvl() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    cfg = InternVLConfig(
        vision_config=dict(VISION, image_size=16, patch_size=4),
        text_config=text_config("qwen2"),
        image_token_id=IMAGE_TOKEN,
        image_seq_length=4,
    )
    return make(InternVLForConditionalGeneration, cfg), lm_batch(4, pixel_values=random_pixels(2, 3, 16, 16))


def _aya_vision() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import AyaVisionConfig, AyaVisionForConditionalGeneration

    cfg = AyaVisionConfig(
        vision_config=vision_config("siglip_vision_model"),
        text_config=text_config("cohere2", sliding_window=8),
        image_token_index=IMAGE_TOKEN,
        downsample_factor=2,
    )
    return make(AyaVisionForConditionalGeneration, cfg), lm_batch(4, pixel_values=random_pixels(2, 3, 16, 16))


def _gemma4() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    vision = dict(
        VISION,
        num_key_value_heads=4,
        head_dim=8,
        patch_size=4,
        pooling_kernel_size=2,
        position_embedding_size=16,
    )
    text = dict(
        TEXT,
        sliding_window=8,
        vocab_size_per_layer_input=128,
        hidden_size_per_layer_input=8,
        global_head_dim=8,
    )
    cfg = Gemma4Config(
        vision_config=vision,
        text_config=text,
        image_token_id=IMAGE_TOKEN,
        boi_token_id=125,
        eoi_token_id=126,
        video_token_id=124,
    )
    ids = image_ids(2, 2, 4)  # 4 x 4 patches (flattened, with their (x, y)) pooled 2 x 2
    xy = torch.stack([torch.arange(16) % 4, torch.arange(16) // 4], -1).expand(2, 16, 2)
    return make(Gemma4ForConditionalGeneration, cfg), dict(
        input_ids=ids,
        labels=ids,
        pixel_values=random_pixels(2, 16, 3 * 4 * 4),
        image_position_ids=xy,
        mm_token_type_ids=(ids == IMAGE_TOKEN).long(),
    )


#: family -> builder of ``(model, inputs)``
FAMILIES: dict[str, Callable[[], tuple[nn.Module, dict[str, Any]]]] = {
    **hf_vision.FAMILIES,
    "qwen2_vl": _qwen2_vl,
    "qwen3_vl": _qwen3_vl,
    "qwen3_vl_moe": _qwen3_vl_moe,
    "qwen3_5": _qwen3_5,
    "glm4v": _glm4v,
    "idefics3": _idefics3,
    "smolvlm": _smolvlm,
    "paligemma": _paligemma,
    "llava_next": _llava_next,
    "llava_onevision": _llava_onevision,
    "mistral3": _mistral3,
    "internvl": _internvl,
    "aya_vision": _aya_vision,
    "gemma4": _gemma4,
    "qwen2_5_omni_thinker": _qwen2_5_omni_thinker,
    **hf_encoders.FAMILIES,
}


def build(name: str, *, seed: int = 0) -> tuple[nn.Module, dict[str, Any]]:
    """``(model in training mode, inputs)``; the same weights for the same ``seed``."""
    return hf_vision.build_from(FAMILIES, name, seed=seed)
