"""`tiny-qwen3-omni`: a random-weight Qwen3OmniMoeForConditionalGeneration in the real folder layout.

Thinker (MoE text model + vision + audio towers), talker (MoE, with its 16-group code predictor) and
code2wav, shaped like Qwen/Qwen3-Omni-30B-A3B-Instruct but small: hidden 64, head_dim 32, 3 thinker
layers, 2 talker layers, 4 experts; every token id the configs name is the real one (the vocabulary
is 152064, see `_omni_tokenizer`), and so are the codec ids (pad/bos/eos 2148/2149/2150 below the
talker vocab of 3072), the speakers (chelsie 2301, ethan 2302, aiden 2303), `num_code_groups` 16
and the code2wav upsampling (1920 samples per frame at 24 kHz). `accept_hidden_layer` is 2 (the
real one is 24 of 48).

Folder: config.json, generation_config.json, model.safetensors (bfloat16, about 45 MB),
tokenizer files with a ChatML template that takes text and media parts, and the processor configs
(`Qwen3OmniMoeProcessor`: Whisper features, Qwen2-VL image and video processors).

Loads with `Qwen3OmniMoeForConditionalGeneration.from_pretrained` (whole model, `generate(...,
return_audio=True)` speaks) and with vLLM's thinker (`Qwen3OmniMoeForConditionalGeneration` ->
`Qwen3OmniMoeThinkerForConditionalGeneration`): head_dim >= 32 for vLLM's CPU attention,
`mrope_section` summing to head_dim / 2, and the vision fields vLLM reads that HF configs lack
(`image_size`, `apply_vit_abs_pos_embed`).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "CONFIG", "NAME", "SPECIAL_TOKENS", "VERSION", "build"]

NAME = "tiny-qwen3-omni"
VERSION = "1"
"""Bump whenever the output of `build` changes; cached builds of another version are rebuilt."""

SEED = 4321

SPECIAL_TOKENS: dict[int, str] = {
    151643: "<|endoftext|>",
    151644: "<|im_start|>",
    151645: "<|im_end|>",
    151646: "<|object_ref_start|>",
    151647: "<|object_ref_end|>",
    151648: "<|box_start|>",
    151649: "<|box_end|>",
    151650: "<|quad_start|>",
    151651: "<|quad_end|>",
    151652: "<|vision_start|>",
    151653: "<|vision_end|>",
    151654: "<|vision_pad|>",
    151655: "<|image_pad|>",
    151656: "<|video_pad|>",
    151657: "<tool_call>",
    151658: "</tool_call>",
    151659: "<|fim_prefix|>",
    151660: "<|fim_middle|>",
    151661: "<|fim_suffix|>",
    151662: "<|fim_pad|>",
    151663: "<|repo_name|>",
    151664: "<|file_sep|>",
    151665: "<tool_response>",
    151666: "</tool_response>",
    151667: "<think>",
    151668: "</think>",
    151669: "<|audio_start|>",
    151670: "<|audio_end|>",
    151671: "<tts_pad>",
    151672: "<tts_text_bos>",
    151673: "<tts_text_eod>",
    151674: "<tts_text_bos_single>",
    151675: "<|audio_pad|>",
}
"""Qwen3-Omni's added tokens at their real ids."""

NAMED_SPECIALS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "audio_token": "<|audio_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}
"""Tokenizer attributes `Qwen3OmniMoeProcessor` reads."""

# ChatML; a message's content is a string or a list of parts (text, image, audio, video), as the
# OpenAI chat API and Qwen's processor give them. No default system turn (Qwen3 adds none).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ['image', 'image_url'] %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] in ['audio', 'input_audio', 'audio_url'] %}"
    "{{ '<|audio_start|><|audio_pad|><|audio_end|>' }}"
    "{% elif part['type'] in ['video', 'video_url'] %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

HIDDEN = 64
HEAD_DIM = 32
MROPE_SECTION = [6, 5, 5]  # sums to HEAD_DIM / 2, like the real [24, 20, 20] for 128

CONFIG: dict = {
    "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
    "model_type": "qwen3_omni_moe",
    "enable_audio_output": True,
    "im_start_token_id": 151644,
    "im_end_token_id": 151645,
    "tts_pad_token_id": 151671,
    "tts_bos_token_id": 151672,
    "tts_eos_token_id": 151673,
    "system_token_id": 8948,
    "user_token_id": 872,
    "assistant_token_id": 77091,
    "thinker_config": {
        "audio_token_id": 151675,
        "image_token_id": 151655,
        "video_token_id": 151656,
        "audio_start_token_id": 151669,
        "audio_end_token_id": 151670,
        "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
        "user_token_id": 872,
        "position_id_per_seconds": 13,
        "seconds_per_chunk": 2,
        "tie_word_embeddings": False,
        "text_config": {
            "vocab_size": 152064,
            "hidden_size": HIDDEN,
            "head_dim": HEAD_DIM,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "shared_expert_intermediate_size": 0,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "use_qk_norm": True,
            "tie_word_embeddings": False,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000,
                "mrope_section": MROPE_SECTION,
                "interleaved": True,
                "mrope_interleaved": True,
            },
        },
        "vision_config": {
            "depth": 2,
            "hidden_size": 32,
            "num_heads": 1,
            "intermediate_size": 64,
            "hidden_act": "gelu_pytorch_tanh",
            "in_channels": 3,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": HIDDEN,
            # vLLM reads image_size / apply_vit_abs_pos_embed (HF does not): (64 / 16)^2 = 16 positions.
            "image_size": 64,
            "num_position_embeddings": 16,
            "apply_vit_abs_pos_embed": True,
            "deepstack_visual_indexes": [0, 1],
        },
        "audio_config": {
            "num_mel_bins": 128,
            "encoder_layers": 1,
            "encoder_attention_heads": 1,
            "encoder_ffn_dim": 64,
            "d_model": 32,
            "output_dim": HIDDEN,
            "downsample_hidden_size": 16,
            "n_window": 50,
            "n_window_infer": 800,
            "conv_chunksize": 500,
            "max_source_positions": 1500,
        },
    },
    "talker_config": {
        "num_code_groups": 16,
        "thinker_hidden_size": HIDDEN,
        "accept_hidden_layer": 2,
        "codec_pad_id": 2148,
        "codec_bos_id": 2149,
        "codec_eos_token_id": 2150,
        "codec_nothink_id": 2155,
        "codec_think_bos_id": 2156,
        "codec_think_eos_id": 2157,
        "speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303},
        "audio_token_id": 151675,
        "image_token_id": 151655,
        "video_token_id": 151656,
        "vision_start_token_id": 151652,
        "audio_start_token_id": 151669,
        "audio_end_token_id": 151670,
        "spatial_merge_size": 2,
        "position_id_per_seconds": 13,
        "seconds_per_chunk": 2,
        "tie_word_embeddings": False,
        "text_config": {
            "vocab_size": 3072,
            "hidden_size": HIDDEN,
            "head_dim": HEAD_DIM,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000,
                "mrope_section": MROPE_SECTION,
                "interleaved": True,
            },
        },
        "code_predictor_config": {
            "vocab_size": 2048,
            "hidden_size": HIDDEN,
            "head_dim": HEAD_DIM,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "num_code_groups": 16,
            "max_position_embeddings": 64,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000},
        },
    },
    "code2wav_config": {
        "codebook_size": 2048,
        "num_quantizers": 16,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "sliding_window": 72,
        "max_position_embeddings": 8000,
        "layer_scale_initial_scale": 0.01,
        "rms_norm_eps": 1e-5,
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        "decoder_dim": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000},
    },
}
"""config.json (before transformers fills in defaults)."""


def build_tokenizer(out: Path):
    """Save the Qwen3-Omni-shaped tokenizer (real special ids, ChatML with media parts); return it."""
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
    """preprocessor_config.json / video_preprocessor_config.json as Qwen3OmniMoeProcessor saves them."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor, WhisperFeatureExtractor
    from transformers.models.qwen3_omni_moe import Qwen3OmniMoeProcessor

    vision = CONFIG["thinker_config"]["vision_config"]
    sizes = {"shortest_edge": 32 * 32, "longest_edge": 256 * 256}
    common = {
        "patch_size": vision["patch_size"],
        "temporal_patch_size": vision["temporal_patch_size"],
        "merge_size": vision["spatial_merge_size"],
        "size": sizes,
    }
    processor = Qwen3OmniMoeProcessor(
        image_processor=Qwen2VLImageProcessor(**common),
        video_processor=Qwen2VLVideoProcessor(**common),
        feature_extractor=WhisperFeatureExtractor(feature_size=128, sampling_rate=16000),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)


def _init_talker_experts(talker) -> None:
    """Draw the talker's expert and router weights, which transformers 5.19 leaves uninitialised.

    `_init_weights` covers the thinker's MoE blocks but not the talker's: its experts keep whatever
    `torch.empty` held (values up to 1e38 and NaN, different in every build) and its router is zeros.
    """
    import torch

    std = talker.config.initializer_range
    with torch.no_grad():
        for module in talker.model.modules():
            name = type(module).__name__
            if name.endswith("TextExperts"):
                module.gate_up_proj.normal_(0.0, std)
                module.down_proj.normal_(0.0, std)
            elif name.endswith("TextTopKRouter"):
                module.weight.normal_(0.0, std)


def _make_audible(code2wav) -> None:
    """Scale code2wav's last convolution so random codes give a waveform of std ~0.1.

    With random weights every decoder block shrinks the signal ~10x, and the waveform comes out near
    1e-7: a test comparing waveforms, or a person listening, could not tell audio from silence.
    """
    import torch

    last = code2wav.decoder[-1].conv
    generator = torch.Generator().manual_seed(SEED)
    shape = (1, code2wav.config.num_quantizers, 16)
    codes = torch.randint(0, code2wav.config.codebook_size, shape, generator=generator)
    with torch.no_grad():
        last.bias.zero_()
        std = code2wav(codes).std().item()
        last.weight.mul_(0.1 / std)


def build(out: Path) -> None:
    """Write the tiny Qwen3-Omni into the empty folder `out`."""
    import torch
    from transformers import GenerationConfig, Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    tokenizer = build_tokenizer(out)
    _save_processor(out, tokenizer)
    config = Qwen3OmniMoeConfig(**{k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")})
    config.architectures = CONFIG["architectures"]
    torch.manual_seed(SEED)
    model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    _init_talker_experts(model.talker)
    _make_audible(model.code2wav)
    model.to(torch.bfloat16).save_pretrained(out)
    GenerationConfig(
        bos_token_id=151643,
        eos_token_id=[151645, 151643],
        pad_token_id=151643,
        do_sample=False,
    ).save_pretrained(out)
