"""`tiny-qwen-image` / `tiny-qwen-image-edit`: random-weight QwenImagePipeline / QwenImageEditPipeline.

Folder (`DiffusionPipeline.save_pretrained` layout, the real component names and classes):

    transformer/     QwenImageTransformer2DModel: 1 block, 2 heads x 16, rope axes (4, 6, 6), 64 packed latent
                     channels (16 VAE latents x 2x2 patches), joint attention 64 wide (the text encoder's)
    vae/             AutoencoderKLQwenImage: base_dim 8, 16 latents, scale factor 8
    text_encoder/    Qwen2_5_VLForConditionalGeneration shrunk: text 64 wide, 2 layers, mrope (2, 3, 3);
                     vision tower 1 block 32 wide (patch 14, merge 2), which the edit pipeline feeds the picture
    tokenizer/       Qwen2Tokenizer: byte-level BPE trained locally, ChatML and vision special tokens
    processor/       (edit only) Qwen2VLProcessor: that tokenizer + a Qwen2VLImageProcessor
    scheduler/       FlowMatchEulerDiscreteScheduler with dynamic shifting (as Qwen-Image)

Heights and widths must be multiples of 16 (VAE 8 x packed 2x2 patches). All weights are float32; a stage
picks the dtype its device runs.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["EDIT_NAME", "NAME", "VERSION", "build", "build_edit"]

NAME = "tiny-qwen-image"
EDIT_NAME = "tiny-qwen-image-edit"
VERSION = "1"
"""Bump whenever the output of `build` changes; cached builds of another version are rebuilt."""

SEED = 1357
BPE_VOCAB_SIZE = 1024
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
TEXT_DIM = 64


def _tokenizer():
    from transformers import Qwen2Tokenizer

    from omni_runtime.tiny_models._tokenizers import train_byte_bpe

    vocab, merges = train_byte_bpe(BPE_VOCAB_SIZE)
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("<|im_end|>", "<|endoftext|>")],
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
        errors="replace",
        split_special_tokens=False,
    )


def _text_encoder(tokenizer):
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": TEXT_DIM,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2048,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "bos_token_id": ids("<|endoftext|>"),
            "eos_token_id": ids("<|im_end|>"),
            "pad_token_id": ids("<|endoftext|>"),
        },
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": TEXT_DIM,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [0],
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        eos_token_id=ids("<|im_end|>"),
        pad_token_id=ids("<|endoftext|>"),
    )
    torch.manual_seed(SEED + 10)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def _components(tokenizer) -> dict:
    import torch
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    torch.manual_seed(SEED)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=64,
        out_channels=16,
        num_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT_DIM,
        axes_dims_rope=(4, 6, 6),
    )
    torch.manual_seed(SEED + 1)
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
        max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    )  # fmt: skip
    return {
        "transformer": transformer.eval(),
        "vae": vae.eval(),
        "scheduler": scheduler,
        "text_encoder": _text_encoder(tokenizer),
        "tokenizer": tokenizer,
    }


def build(out: Path) -> None:
    """Write the tiny Qwen-Image (text-to-image) pipeline into the empty folder `out`."""
    from diffusers import QwenImagePipeline

    from omni_runtime.tiny_models._tokenizers import write_vocab_and_merges

    QwenImagePipeline(**_components(_tokenizer())).save_pretrained(out, safe_serialization=True)
    write_vocab_and_merges(out / "tokenizer")


def build_edit(out: Path) -> None:
    """Write the tiny Qwen-Image-Edit pipeline (the same components plus a Qwen2-VL processor) into `out`."""
    from diffusers import QwenImageEditPipeline
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    from omni_runtime.tiny_models._tokenizers import write_vocab_and_merges

    tokenizer = _tokenizer()
    common = {
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "size": {"shortest_edge": 28 * 28, "longest_edge": 112 * 112},
    }
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**common),
        video_processor=Qwen2VLVideoProcessor(**common),
        tokenizer=tokenizer,
    )
    QwenImageEditPipeline(processor=processor, **_components(tokenizer)).save_pretrained(out, safe_serialization=True)
    write_vocab_and_merges(out / "tokenizer")
