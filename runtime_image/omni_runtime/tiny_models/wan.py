"""`tiny-wan2-2-t2v` and `tiny-wan2-2-i2v`: random-weight Wan2.2 A14B-shaped pipelines, in seconds on a CPU.

Both have Wan2.2's two experts: `transformer` (high noise) and `transformer_2` (low noise), switched
at `boundary_ratio` (0.875 for T2V, 0.9 for I2V, as in Wan-AI's `model_index.json`), so the engine's
code path is the one of the real checkpoints.

Folder (`DiffusionPipeline.save_pretrained` layout; `model_index.json` `_class_name` is `WanPipeline`
or `WanImageToVideoPipeline`):

    transformer/, transformer_2/  WanTransformer3DModel: 1 layer, 2 heads x 16, patch (1, 2, 2),
                                  text_dim 32; in_channels 16 (T2V) or 36 (I2V: noise + image latents + mask)
    vae/             AutoencoderKLWan: base_dim 8, z_dim 16, scale factors 8 (space) and 4 (time), as Wan2.1's
    text_encoder/    UMT5EncoderModel: d_model 32, 1 layer
    tokenizer/       T5Tokenizer (Unigram), trained locally with sentencepiece
    scheduler/       FlowMatchEulerDiscreteScheduler, shift 3.0 (UniPC in the real folders; both flow-matching)

Heights and widths are multiples of 16 (VAE 8 x patch 2); `num_frames - 1` must be a multiple of 4.
A 64x64, 5-frame, 2-step video takes well under a second. I2V has no CLIP image encoder: like
Wan2.2-I2V-A14B it conditions on the VAE latents of the first frame only (`image_dim` None).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["I2V_NAME", "I2V_PIPELINE_CLASS", "T2V_NAME", "T2V_PIPELINE_CLASS", "VERSION", "build_i2v", "build_t2v"]

T2V_NAME = "tiny-wan2-2-t2v"
I2V_NAME = "tiny-wan2-2-i2v"
VERSION = "1"
"""Bump whenever the output of a builder changes; cached builds of another version are rebuilt."""

T2V_PIPELINE_CLASS = "WanPipeline"
I2V_PIPELINE_CLASS = "WanImageToVideoPipeline"
SEED = 2202
TEXT_DIM = 32
T5_VOCAB_SIZE = 512


def _transformer(in_channels: int, seed: int):
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=in_channels,
        out_channels=16,
        text_dim=TEXT_DIM,
        freq_dim=32,
        ffn_dim=64,
        num_layers=1,
        rope_max_seq_len=64,
    ).eval()


def _components(in_channels: int) -> dict:
    import torch
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler
    from transformers import T5Tokenizer, UMT5Config, UMT5EncoderModel

    from omni_runtime.tiny_models._tokenizers import train_unigram

    tokenizer = T5Tokenizer(vocab=train_unigram(T5_VOCAB_SIZE), extra_ids=0, model_max_length=512)
    config = UMT5Config(
        vocab_size=len(tokenizer),
        d_model=TEXT_DIM,
        d_kv=16,
        d_ff=64,
        num_layers=1,
        num_heads=2,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        is_encoder_decoder=False,
        use_cache=False,
    )
    torch.manual_seed(SEED)
    text_encoder = UMT5EncoderModel(config).eval()
    torch.manual_seed(SEED + 1)
    vae = AutoencoderKLWan(
        base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    ).eval()
    return {
        "tokenizer": tokenizer,
        "text_encoder": text_encoder,
        "vae": vae,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0),
        "transformer": _transformer(in_channels, SEED + 2),
        "transformer_2": _transformer(in_channels, SEED + 3),
    }


def build_t2v_pipeline():
    """The tiny T2V pipeline in memory (deterministic: fixed seeds per component)."""
    from diffusers import WanPipeline

    return WanPipeline(**_components(16), boundary_ratio=0.875)


def build_i2v_pipeline():
    """The tiny I2V pipeline in memory: 36 input channels, no image encoder, as Wan2.2-I2V-A14B."""
    from diffusers import WanImageToVideoPipeline

    return WanImageToVideoPipeline(**_components(36), boundary_ratio=0.9)


def build_t2v(out: Path) -> None:
    """Write the tiny Wan2.2 T2V pipeline into the empty folder `out`."""
    build_t2v_pipeline().save_pretrained(out, safe_serialization=True)


def build_i2v(out: Path) -> None:
    """Write the tiny Wan2.2 I2V pipeline into the empty folder `out`."""
    build_i2v_pipeline().save_pretrained(out, safe_serialization=True)
