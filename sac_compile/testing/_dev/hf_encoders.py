"""Tiny encoder-decoder, cross-attention and audio models of transformers 5.x, with a batch
that runs every stack (CPU, no download): Mllama's cross-attention decoder, BLIP-2's
Q-Former, Kosmos-2, Pix2Struct, Florence-2, BART, T5, Whisper and Qwen2-Audio. Part of
:data:`sac_compile.testing._dev.hf_multimodal.FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..hf_vision import (
    AUDIO,
    BART,
    IMAGE_TOKEN,
    SEQ,
    TEXT,
    VISION,
    image_ids,
    lm_batch,
    make,
    random_pixels,
    seq2seq_batch,
    text_config,
)

__all__ = ["FAMILIES"]


# -- cross-attention to the image, learned queries, encoder-decoders ---------------------------


def _mllama() -> tuple[nn.Module, dict[str, Any]]:
    """Mllama's vision encoder layers are not checkpointing layers in transformers: its one
    stack is the decoder, a cross-attention layer (1) after a self-attention one."""
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_global_layers=2,
        attention_heads=4,
        image_size=16,
        patch_size=4,
        max_num_tiles=1,
        supported_aspect_ratios=[[1, 1]],
        intermediate_layers_indices=[0],
        vision_output_dim=64,
    )
    text = {k: v for k, v in TEXT.items() if k != "head_dim"} | dict(cross_attention_layers=[1])
    cfg = MllamaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN)
    model: Any = make(MllamaForConditionalGeneration, cfg)
    # the cross-attention layer's tanh gates are initialised at zero (nothing of the image
    # would reach the loss): open here
    cross = model.model.language_model.layers[1]
    nn.init.constant_(cross.cross_attn_attn_gate, 0.5)
    nn.init.constant_(cross.cross_attn_mlp_gate, 0.5)
    ids = image_ids(2, 1, 1)
    return model, dict(
        input_ids=ids,
        labels=ids,
        pixel_values=random_pixels(2, 1, 1, 3, 16, 16),  # (batch, images, tiles, channels, h, w)
        aspect_ratio_ids=torch.ones(2, 1, dtype=torch.long),
        aspect_ratio_mask=torch.ones(2, 1, 1, dtype=torch.long),
        cross_attention_mask=torch.ones(2, SEQ, 1, 1, dtype=torch.long),
    )


def _blip2() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import Blip2Config, Blip2ForConditionalGeneration

    opt = dict(
        model_type="opt",
        vocab_size=128,
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        word_embed_proj_dim=32,
        max_position_embeddings=128,
    )
    cfg = Blip2Config(
        vision_config=dict(VISION, image_size=16, patch_size=4, initializer_range=0.02),
        qformer_config=dict(VISION, cross_attention_frequency=1, encoder_hidden_size=32, vocab_size=128),
        text_config=opt,
        num_query_tokens=4,
        image_token_index=IMAGE_TOKEN,
    )
    model: Any = make(Blip2ForConditionalGeneration, cfg)
    # the learned queries are initialised at zero (all alike: the Q-Former's self-attention
    # would get zero gradients): random here
    nn.init.normal_(model.query_tokens, std=0.5)
    return model, lm_batch(4, pixel_values=random_pixels(2, 3, 16, 16))


def _kosmos2() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import Kosmos2Config, Kosmos2ForConditionalGeneration

    text = dict(
        vocab_size=128, embed_dim=32, ffn_dim=64, layers=2, attention_heads=4, max_position_embeddings=128
    )
    vision = dict(VISION, image_size=16, patch_size=4)
    cfg = Kosmos2Config(text_config=text, vision_config=vision, latent_query_num=4)
    ids = image_ids(2, 2, 4)
    return make(Kosmos2ForConditionalGeneration, cfg), dict(
        input_ids=ids,
        labels=ids,
        pixel_values=random_pixels(2, 3, 16, 16),
        image_embeds_position_mask=ids == IMAGE_TOKEN,
    )


def _pix2struct() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import Pix2StructConfig, Pix2StructForConditionalGeneration

    t5 = dict(hidden_size=32, d_kv=8, d_ff=64, num_heads=4, relative_attention_num_buckets=8)
    vision = dict(
        t5, num_hidden_layers=2, num_attention_heads=4, patch_embed_hidden_size=3 * 4 * 4, seq_len=16
    )
    cfg = Pix2StructConfig(text_config=dict(t5, vocab_size=128, num_layers=2), vision_config=vision)
    rows_cols = torch.stack([torch.arange(16) // 4, torch.arange(16) % 4], -1).float() + 1  # 1-based
    patches = torch.cat(
        [rows_cols.expand(2, 16, 2), random_pixels(2, 16, 3 * 4 * 4)], -1
    )  # 4 x 4 patches of 4 x 4
    return make(Pix2StructForConditionalGeneration, cfg), dict(
        flattened_patches=patches, attention_mask=torch.ones(2, 16), labels=image_ids(2, 0, 0)
    )


def _florence2() -> tuple[nn.Module, dict[str, Any]]:
    """Florence-2's DaViT vision blocks are not checkpointing layers in transformers: its
    stacks are the BART encoder's and decoder's layers (image tokens into the encoder)."""
    from transformers import Florence2Config, Florence2ForConditionalGeneration

    vision = dict(
        depths=[1, 1],
        patch_size=[7, 3],
        patch_stride=[4, 2],
        patch_padding=[3, 1],
        patch_prenorm=[False, True],
        embed_dim=[16, 32],
        num_heads=[2, 4],
        num_groups=[2, 4],
        window_size=2,
        projection_dim=32,
        drop_path_rate=0.0,
    )
    cfg = Florence2Config(
        vision_config=vision, text_config=dict(BART, model_type="bart"), image_token_id=IMAGE_TOKEN
    )
    # a 32 x 32 image: 8 x 8 then 4 x 4 cells, 16 tokens and a pooled one
    return make(Florence2ForConditionalGeneration, cfg), lm_batch(
        17, pixel_values=random_pixels(2, 3, 32, 32)
    )


def _bart() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import BartConfig, BartForConditionalGeneration

    return make(BartForConditionalGeneration, BartConfig(**BART)), seq2seq_batch()


def _t5() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import T5Config, T5ForConditionalGeneration

    extra: dict[str, Any] = {"decoder_start_token_id": 0}  # (an attribute T5Config's fields leave out)
    cfg = T5Config(
        vocab_size=128,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        **extra,
    )
    return make(T5ForConditionalGeneration, cfg), seq2seq_batch()


# -- audio ---------------------------------------------------------------------------------


def _whisper() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(**BART, num_mel_bins=8, max_source_positions=16, max_target_positions=32)
    return make(WhisperForConditionalGeneration, cfg), dict(
        input_features=random_pixels(2, 8, 32), labels=image_ids(2, 0, 0)
    )


def _qwen2_audio() -> tuple[nn.Module, dict[str, Any]]:
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    cfg = Qwen2AudioConfig(
        audio_config=dict(AUDIO), text_config=text_config("qwen2"), audio_token_index=IMAGE_TOKEN
    )
    # 32 mel frames: 16 after the strided convolution, 8 after pooling
    features, mask = random_pixels(2, 8, 32), torch.ones(2, 32, dtype=torch.long)
    return make(Qwen2AudioForConditionalGeneration, cfg), lm_batch(
        8, input_features=features, feature_attention_mask=mask
    )


#: family -> builder of ``(model, inputs)``
FAMILIES: dict[str, Callable[[], tuple[nn.Module, dict[str, Any]]]] = {
    "mllama": _mllama,
    "blip2": _blip2,
    "kosmos2": _kosmos2,
    "pix2struct": _pix2struct,
    "florence2": _florence2,
    "whisper": _whisper,
    "bart": _bart,
    "t5": _t5,
    "qwen2_audio": _qwen2_audio,
}
