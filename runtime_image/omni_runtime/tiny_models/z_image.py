"""`tiny-z-image`: a random-weight ZImagePipeline (Z-Image-Turbo's layout) drawing 64x64 images in well under a second.

Folder (`DiffusionPipeline.save_pretrained` layout; `model_index.json` names the classes Tongyi-MAI/Z-Image-Turbo's
does: `ZImagePipeline`, transformer `ZImageTransformer2DModel`, text_encoder `Qwen3Model`, tokenizer
`Qwen2Tokenizer`, vae `AutoencoderKL`, scheduler `FlowMatchEulerDiscreteScheduler`):

    transformer/     ZImageTransformer2DModel: single-stream DiT 32 wide, 1 main + 1 noise-refiner + 1 context-refiner
                     block, 2 heads x 16 (rope axes (4, 6, 6)), patch 2, 16 latent channels, caption features 64
                     wide (the text encoder's)
    vae/             AutoencoderKL: tiny-flux's shape (4 levels, scale factor 8, 16 latents) and FLUX.1's latent
                     scaling (0.3611, shift 0.1159), as Z-Image-Turbo ships FLUX.1's VAE
    text_encoder/    Qwen3Model (no LM head), 64 wide, 2 layers (the pipeline reads the second-to-last hidden state)
    tokenizer/       Qwen2Tokenizer: byte-level BPE trained locally, ChatML + <think> tokens, a Qwen3-style chat
                     template (the pipeline wraps each prompt in it with `enable_thinking=True`)
    scheduler/       FlowMatchEulerDiscreteScheduler, shift 3.0, no dynamic shifting (Z-Image-Turbo's config)

Heights and widths must be multiples of 16 (VAE 8 x patch 2). All weights are float32; a stage picks the dtype its
device runs. Assumed where this environment has no copy of the real checkpoint: the component classes and the
scheduler's `shift` / `use_dynamic_shifting` are those public tools record for Z-Image-Turbo's model_index.json and
scheduler_config.json; the transformer's config keys are `ZImageTransformer2DModel.__init__`'s (diffusers 0.42).
"""

from __future__ import annotations

import json
from pathlib import Path

from omni_runtime.tiny_models import sd3

__all__ = ["CHAT_TEMPLATE", "NAME", "PIPELINE_CLASS", "VERSION", "build", "build_pipeline"]

NAME = "tiny-z-image"
VERSION = "1"
"""Bump whenever the output of `build` changes; cached builds of another version are rebuilt."""

PIPELINE_CLASS = "ZImagePipeline"
SEED = 3579
BPE_VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
TEXT_DIM = 64

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
"""Qwen3's chat template cut to what ZImagePipeline renders: user turns and the generation prompt, with Qwen3's
empty think block only when thinking is off (the pipeline asks `enable_thinking=True`, so it renders none)."""


def _tokenizer():
    from transformers import Qwen2Tokenizer

    from omni_runtime.tiny_models._tokenizers import train_byte_bpe

    vocab, merges = train_byte_bpe(BPE_VOCAB_SIZE)
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=["<|im_start|>"],
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
        errors="replace",
        split_special_tokens=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _text_encoder(tokenizer):
    import torch
    from transformers import Qwen3Config, Qwen3Model

    ids = tokenizer.convert_tokens_to_ids
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_DIM,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=ids("<|endoftext|>"),
        eos_token_id=ids("<|im_end|>"),
        pad_token_id=ids("<|endoftext|>"),
    )
    torch.manual_seed(SEED + 10)
    return Qwen3Model(config).eval()


def build_pipeline():
    """The tiny pipeline in memory (deterministic: fixed seeds per component)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    tokenizer = _tokenizer()
    torch.manual_seed(SEED)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=32,
        n_layers=1,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        qk_norm=True,
        cap_feat_dim=TEXT_DIM,
        axes_dims=[4, 6, 6],
        # rope table rows per axis (caption tokens + the frame index, latent rows, latent columns): diffusers'
        # defaults, room for the 512-token caption and for max_pixels' 2048-px sides (128 patches)
        axes_lens=[1024, 512, 512],
    )
    torch.manual_seed(SEED + 1)
    vae = sd3._vae(scaling_factor=0.3611, shift_factor=0.1159)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    return ZImagePipeline(
        scheduler=scheduler,
        vae=vae.eval(),
        text_encoder=_text_encoder(tokenizer),
        tokenizer=tokenizer,
        transformer=transformer.eval(),
    )


def build(out: Path) -> None:
    """Write the tiny Z-Image pipeline into the empty folder `out`."""
    from omni_runtime.tiny_models._tokenizers import write_vocab_and_merges

    build_pipeline().save_pretrained(out, safe_serialization=True)
    _keep_template_in_config(out / "tokenizer" / "tokenizer_config.json")
    write_vocab_and_merges(out / "tokenizer")


def _keep_template_in_config(path: Path) -> None:
    """Also keep `chat_template` in tokenizer_config.json, where readers other than transformers 5 look
    (transformers 5 writes it to chat_template.jinja beside it and reads that first)."""
    config = json.loads(path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
