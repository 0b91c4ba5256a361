"""`tiny-qwen2-5-omni`: a random-weight Qwen2_5OmniForConditionalGeneration in the real folder layout.

Thinker (text model + vision + audio towers), talker and token2wav (DiT flow matching + BigVGAN),
shaped like Qwen/Qwen2.5-Omni-7B but small (hidden 64, head_dim 32, 2 layers), with the real token
ids (vocabulary 152064, see `_omni_tokenizer`), the real talker codec ids (pad/bos/eos/mask
8292/8293/8294/8296 in a vocab of 8448), text ids 151859-151861, and `spk_dict.pt` holding the two
real speakers (Chelsie, Ethan) with random conditioning vectors and reference mels.

Folder: config.json, generation_config.json, model.safetensors (bfloat16), spk_dict.pt, tokenizer
files (ChatML with media parts) and the processor config (`Qwen2_5OmniProcessor`).
`Qwen2_5OmniForConditionalGeneration.from_pretrained` loads it (and needs `spk_dict.pt`);
vLLM serves its thinker (`Qwen2_5OmniForConditionalGeneration` -> the thinker class).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "CONFIG", "NAME", "SPEAKERS", "SPECIAL_TOKENS", "VERSION", "build"]

NAME = "tiny-qwen2-5-omni"
VERSION = "1"
"""Bump whenever the output of `build` changes; cached builds of another version are rebuilt."""

SEED = 2525

SPECIAL_TOKENS: dict[int, str] = {
    151643: "<|endoftext|>",
    151644: "<|im_start|>",
    151645: "<|im_end|>",
    151646: "<|AUDIO|>",
    151647: "<|audio_bos|>",
    151648: "<|audio_eos|>",
    151649: "<|box_end|>",
    151650: "<|quad_start|>",
    151651: "<|quad_end|>",
    151652: "<|vision_bos|>",
    151653: "<|vision_eos|>",
    151654: "<|vision_pad|>",
    151655: "<|IMAGE|>",
    151656: "<|VIDEO|>",
    151657: "<tool_call>",
    151658: "</tool_call>",
    151659: "<|fim_prefix|>",
    151660: "<|fim_middle|>",
    151661: "<|fim_suffix|>",
    151662: "<|fim_pad|>",
    151663: "<|repo_name|>",
    151664: "<|file_sep|>",
}
"""Qwen2.5-Omni's added tokens at their real ids."""

NAMED_SPECIALS = {
    "image_token": "<|IMAGE|>",
    "video_token": "<|VIDEO|>",
    "audio_token": "<|AUDIO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}
"""Tokenizer attributes `Qwen2_5OmniProcessor` reads."""

SPEAKERS = {"Chelsie": 151870, "Ethan": 151872}
"""Speaker name -> the thinker-vocabulary id the talker starts its text with (`bos_token` in spk_dict.pt)."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ['image', 'image_url'] %}{{ '<|vision_bos|><|IMAGE|><|vision_eos|>' }}"
    "{% elif part['type'] in ['audio', 'input_audio', 'audio_url'] %}{{ '<|audio_bos|><|AUDIO|><|audio_eos|>' }}"
    "{% elif part['type'] in ['video', 'video_url'] %}{{ '<|vision_bos|><|VIDEO|><|vision_eos|>' }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

HIDDEN = 64
MROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]}  # sums to head_dim / 2

CONFIG: dict = {
    "architectures": ["Qwen2_5OmniForConditionalGeneration"],
    "model_type": "qwen2_5_omni",
    "enable_audio_output": True,
    "thinker_config": {
        "audio_token_index": 151646,
        "image_token_index": 151655,
        "video_token_index": 151656,
        "audio_start_token_id": 151647,
        "audio_end_token_id": 151648,
        "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
        "user_token_id": 872,
        "position_id_per_seconds": 25,
        "seconds_per_chunk": 2,
        "tie_word_embeddings": False,
        "text_config": {
            "vocab_size": 152064,
            "hidden_size": HIDDEN,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "rope_parameters": MROPE,
        },
        "vision_config": {
            "depth": 2,
            "hidden_size": 32,
            "num_heads": 1,
            "intermediate_size": 64,
            "in_channels": 3,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "out_hidden_size": HIDDEN,
            "fullatt_block_indexes": [1],
        },
        "audio_config": {
            "num_mel_bins": 128,
            "encoder_layers": 1,
            "encoder_attention_heads": 1,
            "encoder_ffn_dim": 64,
            "d_model": 32,
            "output_dim": HIDDEN,
            "n_window": 100,
            "max_source_positions": 1500,
        },
    },
    "talker_config": {
        "vocab_size": 8448,
        "embedding_size": HIDDEN,
        "hidden_size": HIDDEN,
        "head_dim": 32,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "rope_parameters": MROPE,
        "tts_text_start_token_id": 151860,
        "tts_text_end_token_id": 151861,
        "tts_text_pad_token_id": 151859,
        "tts_codec_start_token_id": 8293,
        "tts_codec_end_token_id": 8294,
        "tts_codec_pad_token_id": 8292,
        "tts_codec_mask_token_id": 8296,
        "audio_token_index": 151646,
        "image_token_index": 151655,
        "video_token_index": 151656,
        "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
        "audio_start_token_id": 151647,
        "audio_end_token_id": 151648,
        "spatial_merge_size": 2,
    },
    "token2wav_config": {
        "dit_config": {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "head_dim": 32,
            "ff_mult": 2,
            "emb_dim": 32,
            "block_size": 24,
            "look_ahead_layers": [1],
            "look_backward_layers": [0],
            "repeats": 2,
            "num_embeds": 8193,
            "mel_dim": 80,
            "enc_emb_dim": 32,
            "enc_dim": 32,
            "enc_channels": [32, 32, 32, 32, 96],
            "enc_kernel_sizes": [5, 3, 3, 3, 1],
            "enc_dilations": [1, 2, 3, 4, 1],
            "enc_attention_channels": 16,
            "enc_res2net_scale": 2,
            "enc_se_channels": 16,
            "dropout": 0.0,
        },
        "bigvgan_config": {
            "mel_dim": 80,
            "upsample_initial_channel": 128,
            "resblock_kernel_sizes": [3, 7, 11],
            "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
            "upsample_rates": [5, 3, 2, 2, 2, 2],
            "upsample_kernel_sizes": [11, 7, 4, 4, 4, 4],
        },
    },
}
"""config.json (before transformers fills in defaults)."""


def build_tokenizer(out: Path):
    """Save the Qwen2.5-Omni-shaped tokenizer (real special ids, ChatML with media parts); return it."""
    from omni_runtime.tiny_models._omni_tokenizer import build_omni_tokenizer

    return build_omni_tokenizer(
        out,
        specials=SPECIAL_TOKENS,
        named_specials=NAMED_SPECIALS,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=CONFIG["thinker_config"]["text_config"]["max_position_embeddings"],
    )


def _save_processor(out: Path, tokenizer) -> None:
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor, WhisperFeatureExtractor
    from transformers.models.qwen2_5_omni import Qwen2_5OmniProcessor

    vision = CONFIG["thinker_config"]["vision_config"]
    common = {
        "patch_size": vision["patch_size"],
        "temporal_patch_size": vision["temporal_patch_size"],
        "merge_size": vision["spatial_merge_size"],
        "size": {"shortest_edge": 28 * 28, "longest_edge": 224 * 224},
    }
    Qwen2_5OmniProcessor(
        image_processor=Qwen2VLImageProcessor(**common),
        video_processor=Qwen2VLVideoProcessor(**common),
        feature_extractor=WhisperFeatureExtractor(feature_size=128, sampling_rate=16000),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    ).save_pretrained(out)


def _speakers(generator) -> dict:
    """spk_dict.pt: {name: {bos_token, cond [1, enc_emb_dim], ref_mel [1, T, mel_dim]}}."""
    import torch

    dit = CONFIG["token2wav_config"]["dit_config"]
    return {
        name: {
            "bos_token": bos,
            "cond": torch.randn(1, dit["enc_emb_dim"], generator=generator),
            "ref_mel": torch.randn(1, 48, dit["mel_dim"], generator=generator),
        }
        for name, bos in SPEAKERS.items()
    }


def _make_audible(bigvgan) -> None:
    """Scale BigVGAN's last convolution so a random mel gives a waveform of std ~0.1 (else ~1e-7)."""
    import torch

    generator = torch.Generator().manual_seed(SEED)
    mel = torch.randn(1, CONFIG["token2wav_config"]["bigvgan_config"]["mel_dim"], 16, generator=generator)
    with torch.no_grad():
        if bigvgan.conv_post.bias is not None:
            bigvgan.conv_post.bias.zero_()
        std = bigvgan(mel).std().item()
        bigvgan.conv_post.weight.mul_(0.1 / std)


def build(out: Path) -> None:
    """Write the tiny Qwen2.5-Omni into the empty folder `out`."""
    import torch
    from transformers import GenerationConfig, Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

    tokenizer = build_tokenizer(out)
    _save_processor(out, tokenizer)
    config = Qwen2_5OmniConfig(**{k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")})
    config.architectures = CONFIG["architectures"]
    torch.manual_seed(SEED)
    model = Qwen2_5OmniForConditionalGeneration(config).eval()
    _make_audible(model.token2wav.code2wav_bigvgan_model)
    model.to(torch.bfloat16).save_pretrained(out)
    torch.save(_speakers(torch.Generator().manual_seed(SEED)), out / "spk_dict.pt")
    GenerationConfig(
        bos_token_id=151643,
        eos_token_id=[151645, 151643],
        pad_token_id=151643,
        do_sample=False,
    ).save_pretrained(out)
