"""`tiny-flux`: a random-weight FluxPipeline (FLUX.1 layout) that draws small images in well under a second.

Folder (`DiffusionPipeline.save_pretrained` layout; `model_index.json` `_class_name` is `FluxPipeline`):

    transformer/     FluxTransformer2DModel: 1 double + 1 single block, 2 heads x 16, rope axes (4, 6, 6),
                     64 packed latent channels (16 VAE latents x 2x2 patches), guidance embedding (as FLUX.1-dev)
    vae/             AutoencoderKL: 4 levels (scale factor 8), 16 latents, channels 8-16-16-16
    text_encoder/    CLIPTextModel (pooled prompt embedding, 32 wide), tokenizer/ its CLIPTokenizer
    text_encoder_2/  T5EncoderModel, d_model 64 (the joint attention width), tokenizer_2/ its T5 tokenizer
    scheduler/       FlowMatchEulerDiscreteScheduler with dynamic shifting (as FLUX.1)

The tokenizers are tiny-sd3's, trained locally. Heights and widths must be multiples of 16 (VAE 8 x packed
2x2 patches). All weights are float32; a stage picks the dtype its device runs.
"""

from __future__ import annotations

from pathlib import Path

from omni_runtime.tiny_models import sd3

__all__ = ["NAME", "PIPELINE_CLASS", "VERSION", "build"]

NAME = "tiny-flux"
VERSION = "1"
"""Bump whenever the output of `build` changes; cached builds of another version are rebuilt."""

PIPELINE_CLASS = "FluxPipeline"
SEED = 2468


def build_pipeline():
    """The tiny pipeline in memory (deterministic: fixed seeds per component)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    clip_tokenizer = sd3._clip_tokenizer()
    t5_tokenizer = sd3._t5_tokenizer()
    torch.manual_seed(SEED)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=sd3.JOINT_DIM,
        pooled_projection_dim=sd3.CLIP_HIDDEN,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    )
    torch.manual_seed(SEED + 1)
    vae = sd3._vae(scaling_factor=0.3611, shift_factor=0.1159)
    clip_config = CLIPTextConfig(
        vocab_size=len(clip_tokenizer),
        hidden_size=sd3.CLIP_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=sd3.CLIP_MAX_LENGTH,
        hidden_act="gelu",
        bos_token_id=clip_tokenizer.bos_token_id,
        eos_token_id=clip_tokenizer.eos_token_id,
        pad_token_id=clip_tokenizer.pad_token_id,
    )
    torch.manual_seed(SEED + 10)
    clip = CLIPTextModel(clip_config).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096,
    )  # fmt: skip
    return FluxPipeline(
        transformer=transformer.eval(),
        scheduler=scheduler,
        vae=vae.eval(),
        text_encoder=clip,
        tokenizer=clip_tokenizer,
        text_encoder_2=sd3._t5_encoder(t5_tokenizer),
        tokenizer_2=t5_tokenizer,
    )


def build(out: Path) -> None:
    """Write the tiny FLUX pipeline into the empty folder `out`."""
    from omni_runtime.tiny_models._tokenizers import write_vocab_and_merges

    build_pipeline().save_pretrained(out, safe_serialization=True)
    write_vocab_and_merges(out / "tokenizer")
