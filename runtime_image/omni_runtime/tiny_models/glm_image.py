"""`tiny-glm-image`: a random-weight GlmImagePipeline (AR `vision_language_encoder` + DiT), real layout.

Folder (`DiffusionPipeline.save_pretrained` layout, the real component names and classes):

    vision_language_encoder/  GlmImageForConditionalGeneration shrunk: text 32 wide, 1 layer, mrope (2, 3, 3);
                              vision tower 1 block 32 wide (patch 16); VQ-VAE codebook of 16384 codes (the
                              real size, so the AR's image-token ids and the DiT's prior codebook line up)
    processor/                GlmImageProcessor: the tokenizer below + a GlmImageImageProcessor
    tokenizer/                ByT5Tokenizer (no files beyond its config: bytes are its vocabulary)
    text_encoder/             T5EncoderModel (glyph encoder) 32 wide, 1 layer
    vae/                      AutoencoderKL: 4 latent channels, scale factor 8, latents_mean/std set
    transformer/              GlmImageTransformer2DModel: 1 layer, 2 heads x 16, prior codebook 16384
    scheduler/                FlowMatchEulerDiscreteScheduler with dynamic shifting (as GLM-Image)

The AR's token ids keep the real layout: ids 0..16383 are VQ codes, 16384 / 16385 begin / end an image (the
AR's end token is 16385), 0..16511 is the AR head's vision vocabulary; text pieces come after it. The processor
asks for a 16x16 preview grid before the target grid (factor 32), so a 64x64 t2i image makes the AR emit
256 + 4 tokens plus its end token. Heights and widths must be multiples of 32. Weights are float32.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["NAME", "VERSION", "build"]

NAME = "tiny-glm-image"
VERSION = "1"
"""Bump whenever the output of `build` changes; cached builds of another version are rebuilt."""

SEED = 2468
VISION_VOCAB = 16512
CODEBOOK = 16384
IMAGE_START = 16384
IMAGE_END = 16385
BPE_VOCAB_SIZE = 512
CHAT_TOKENS = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<sop>", "<eop>", "<|image|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|user|>"
    "{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|begin_of_image|><|image|><|end_of_image|>"
    "{% else %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endfor %}<|assistant|>"
)
TEXT_DIM = 32
GLYPH_DIM = 32


def _tokenizer():
    """A byte-level BPE whose ids start after the AR's vision vocabulary (0..16511 stay image ids)."""
    from transformers import Qwen2Tokenizer

    from omni_runtime.tiny_models._tokenizers import train_byte_bpe

    bpe, merges = train_byte_bpe(BPE_VOCAB_SIZE)
    # Image ids are named placeholders, so that `len(tokenizer)` covers them and 16384 / 16385 decode.
    named = {IMAGE_START: "<|begin_of_image|>", IMAGE_END: "<|end_of_image|>"}
    vocab = {named.get(i, f"<|vq_{i}|>"): i for i in range(VISION_VOCAB)}
    for piece, index in sorted(bpe.items(), key=lambda kv: kv[1]):
        vocab[piece] = VISION_VOCAB + index
    for token in CHAT_TOKENS:
        vocab[token] = len(vocab)
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token="<|begin_of_image|>",
        eos_token="<|end_of_image|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={
            "image_token": "<|image|>",
            "grid_bos_token": "<sop>",
            "grid_eos_token": "<eop>",
            "boi_token": "<|begin_of_image|>",
            "eoi_token": "<|end_of_image|>",
            "user_token": "<|user|>",
            "assistant_token": "<|assistant|>",
        },
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
        errors="replace",
        split_special_tokens=False,
    )


def _ar(tokenizer):
    import torch
    from transformers import GlmImageConfig, GlmImageForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    config = GlmImageConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "vision_vocab_size": VISION_VOCAB,
            "hidden_size": TEXT_DIM,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                "partial_rotary_factor": 1.0},
            "pad_token_id": ids("<|endoftext|>"),
            "eos_token_id": IMAGE_END,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 16,
            "image_size": 512,
            "spatial_merge_size": 1,
        },
        vq_config={"embed_dim": 8, "num_embeddings": CODEBOOK, "latent_channels": 32},
        image_token_id=ids("<|image|>"),
        image_start_token_id=IMAGE_START,
        image_end_token_id=IMAGE_END,
    )  # fmt: skip
    torch.manual_seed(SEED + 10)
    model = GlmImageForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = IMAGE_END
    model.generation_config.pad_token_id = ids("<|endoftext|>")
    return model


def _processor(tokenizer):
    from transformers import GlmImageImageProcessor, GlmImageProcessor

    image_processor = GlmImageImageProcessor(
        patch_size=16, temporal_patch_size=1, merge_size=1, min_pixels=32 * 32, max_pixels=128 * 128
    )
    return GlmImageProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)


def _components() -> dict:
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, GlmImageTransformer2DModel
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    tokenizer = _tokenizer()
    torch.manual_seed(SEED)
    transformer = GlmImageTransformer2DModel(
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        text_embed_dim=GLYPH_DIM,
        time_embed_dim=32,
        condition_dim=16,
        prior_vq_quantizer_codebook_size=CODEBOOK,
    )
    torch.manual_seed(SEED + 1)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4,
        down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[8, 8, 8, 8], layers_per_block=1, norm_num_groups=4,
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    )  # fmt: skip
    torch.manual_seed(SEED + 2)
    text_encoder = T5EncoderModel(
        T5Config(vocab_size=384, d_model=GLYPH_DIM, d_kv=8, d_ff=64, num_layers=1, num_heads=2)
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.25, max_shift=0.75, base_image_seq_len=256,
        max_image_seq_len=4096, time_shift_type="linear",
    )  # fmt: skip
    return {
        "tokenizer": ByT5Tokenizer(),
        "processor": _processor(tokenizer),
        "text_encoder": text_encoder.eval(),
        "vision_language_encoder": _ar(tokenizer),
        "vae": vae.eval(),
        "transformer": transformer.eval(),
        "scheduler": scheduler,
    }


def build(out: Path) -> None:
    """Write the tiny GLM-Image pipeline (AR + DiT, t2i and i2i) into the empty folder `out`."""
    from diffusers import GlmImagePipeline

    GlmImagePipeline(**_components()).save_pretrained(out, safe_serialization=True)
