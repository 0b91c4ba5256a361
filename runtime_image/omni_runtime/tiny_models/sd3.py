"""`tiny-sd3`: a random-weight StableDiffusion3Pipeline that draws 64x64 images in well under a second.

Why SD3 rather than Flux: SD3 does real classifier-free guidance with negative prompts (what the
AR -> DiT "CFG companion" path feeds), takes `prompt_embeds` / `pooled_prompt_embeds` and their
negative twins directly, and all of its text encoders are stock transformers classes.

Folder (`DiffusionPipeline.save_pretrained` layout; `model_index.json` `_class_name` is
`StableDiffusion3Pipeline`):

    transformer/     SD3Transformer2DModel: 2 joint blocks, 4 heads x 16, patch 2, 16 latent channels,
                     sample_size 8 (so the default image is 8 * 8 = 64 px), pos_embed_max_size 32 (<= 512 px)
    vae/             AutoencoderKL: 4 levels (scale factor 8, as in SD3), channels 8-16-16-16, 16 latents
    text_encoder/    CLIPTextModelWithProjection: hidden 32, 2 layers, projection 32
    text_encoder_2/  the same shape, another seed (the pipeline concatenates both: 64 = joint dim)
    text_encoder_3/  T5EncoderModel: d_model 64 = joint_attention_dim, 2 layers
    tokenizer/, tokenizer_2/  CLIPTokenizer (tokenizer.json, plus vocab.json + merges.txt), trained locally
    tokenizer_3/     T5Tokenizer (tokenizer.json, Unigram), trained locally with sentencepiece
    scheduler/       FlowMatchEulerDiscreteScheduler, shift 3.0

All weights are float32 (CPU diffusion runs in float32; bfloat16 also loads with `torch_dtype=`).
Heights and widths must be multiples of 16 (VAE factor 8 x patch 2). The pipeline accepts
`prompt_embeds` (B, 77 + T5 length, 64) with `pooled_prompt_embeds` (B, 64), their `negative_*`
twins when `guidance_scale > 1`, a list of prompts, and `num_images_per_prompt`.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CLIP_SPECIALS", "NAME", "PIPELINE_CLASS", "VERSION", "build"]

NAME = "tiny-sd3"
VERSION = "2"
"""Bump whenever the output of `build` changes; cached builds of another version are rebuilt."""

PIPELINE_CLASS = "StableDiffusion3Pipeline"
SEED = 4321
CLIP_SPECIALS = ["<|startoftext|>", "<|endoftext|>"]
CLIP_VOCAB_SIZE = 1024
T5_VOCAB_SIZE = 512
CLIP_MAX_LENGTH = 77

CLIP_HIDDEN = 32
JOINT_DIM = 2 * CLIP_HIDDEN  # the pipeline concatenates both CLIP hidden states, then pads to T5's width
POOLED_DIM = 2 * CLIP_HIDDEN  # and concatenates both projected pooled outputs


def _clip_tokenizer():
    from transformers import CLIPTokenizer

    from omni_runtime.tiny_models._tokenizers import train_clip_bpe

    vocab, merges = train_clip_bpe(CLIP_VOCAB_SIZE, CLIP_SPECIALS)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=CLIP_MAX_LENGTH)


def _t5_tokenizer():
    from transformers import T5Tokenizer

    from omni_runtime.tiny_models._tokenizers import train_unigram

    pieces = train_unigram(T5_VOCAB_SIZE)
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=512)


def _clip_encoder(tokenizer, seed: int):
    import torch
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=CLIP_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=CLIP_MAX_LENGTH,
        projection_dim=CLIP_HIDDEN,
        hidden_act="gelu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return CLIPTextModelWithProjection(config).eval()


def _t5_encoder(tokenizer):
    import torch
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=JOINT_DIM,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        is_encoder_decoder=False,
        use_cache=False,
    )
    torch.manual_seed(SEED + 3)
    return T5EncoderModel(config).eval()


def _vae(scaling_factor: float, shift_factor: float):
    """The tiny 16-latent VAE of SD3 and FLUX (4 levels, scale factor 8); they differ only in its latent
    scaling. Random weights from the caller's seed."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 16, 16),
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=4,
        sample_size=64,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def build_pipeline():
    """The tiny pipeline in memory (deterministic: fixed seeds per component)."""
    import torch
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    clip_tokenizer = _clip_tokenizer()
    t5_tokenizer = _t5_tokenizer()
    torch.manual_seed(SEED)
    transformer = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=JOINT_DIM,
        caption_projection_dim=64,
        pooled_projection_dim=POOLED_DIM,
        out_channels=16,
        pos_embed_max_size=32,
    )
    torch.manual_seed(SEED + 1)
    vae = _vae(scaling_factor=1.5305, shift_factor=0.0609)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae.eval(),
        text_encoder=_clip_encoder(clip_tokenizer, SEED + 10),
        tokenizer=clip_tokenizer,
        text_encoder_2=_clip_encoder(clip_tokenizer, SEED + 20),
        tokenizer_2=clip_tokenizer,
        text_encoder_3=_t5_encoder(t5_tokenizer),
        tokenizer_3=t5_tokenizer,
    )
    return pipe


def build(out: Path) -> None:
    """Write the tiny SD3 pipeline into the empty folder `out`."""
    from omni_runtime.tiny_models._tokenizers import write_vocab_and_merges

    build_pipeline().save_pretrained(out, safe_serialization=True)
    for sub in ("tokenizer", "tokenizer_2"):
        write_vocab_and_merges(out / sub)
