"""`tiny-bagel`: a random-weight BAGEL (ByteDance-Seed/BAGEL-7B-MoT layout) for both of its paths.

Folder (the real checkpoint's files, shrunk):

    config.json              model_type "bagel", BagelForConditionalGeneration; llm_config (Qwen2, hidden 128,
                             2 layers, 4 heads x 32, 2 KV heads, qk_norm, Qwen2MoTDecoderLayer), vit_config (SigLIP,
                             patch 14, 56 px: 4x4 patches), vae_config {z_channels 16, downsample 8},
                             latent_patch_size 2, max_latent_size 8 (images up to 128 px)
    llm_config.json          the Qwen2 part alone, as upstream's app.py reads it (it sets qk_norm and
                             layer_module itself)
    vit_config.json          the SigLIP part alone
    ema.safetensors          every non-VAE weight in BAGEL's own names, bfloat16 (as the real one): the
                             understanding expert (`language_model.model.*`, `lm_head`), the generation expert
                             (every `*_moe_gen`), `vit_model.*` (patch embedding stored as a Linear, as upstream's
                             `convert_conv2d_to_linear` leaves it), `connector`, `vit_pos_embed`, `latent_pos_embed`,
                             `time_embedder`, `vae2llm`, `llm2vae`
    ae.safetensors           a FLUX-format autoencoder (`encoder.*`, `decoder.*`), 4 levels (downsample 8),
                             channels 32-64-64-64, one resnet per level, 16 latent channels, float32
    tokenizer files          byte-level BPE trained on `corpus.CORPUS` + BAGEL's special tokens, ChatML template
                             with image parts as `<|vision_start|><|image_pad|><|vision_end|>`
    preprocessor_config.json SiglipImageProcessor at 56x56 (what vLLM's BagelProcessor loads)
    generation_config.json   eos = [<|im_end|>, <|endoftext|>]

vLLM's image path replaces each `<|image_pad|>` by vit_max_num_patch_per_side**2 tokens and runs SigLIP over
(image_size / patch_size)**2 patches, so the two are equal here (4 per side). vLLM only rewrites a ViT of 27
layers to 26 (the real checkpoint's quirk), so this ViT's config names exactly the layers stored.

Unlike upstream's zero init, `llm2vae` gets random weights, so the images depend on the weights. Norm weights are
1 plus noise, so a swapped und/gen norm shows up in an anchor. Deterministic: one seeded generator fills every
tensor in a fixed order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = [
    "AE_CONFIG",
    "CHAT_TEMPLATE",
    "CONFIG",
    "LLM_CONFIG",
    "NAME",
    "SPECIAL_TOKENS",
    "VERSION",
    "VIT_CONFIG",
    "build",
]

NAME = "tiny-bagel"
VERSION = "1"
"""Bump whenever the output of `build` changes; cached builds of another version are rebuilt."""

SEED = 2424
BPE_VOCAB_SIZE = 1536
INIT_STD = 0.05
"""Std of the random LM / head weights: larger than the usual 0.02 so attention is not uniform and the
context visibly steers the image."""

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
]
"""BAGEL's special tokens (upstream `data_utils.add_special_tokens` adds none of them to this tokenizer)."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ['image', 'image_url'] %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

HIDDEN = 128
VIT_HIDDEN = 64
VIT_PATCH = 14
VIT_PATCHES_PER_SIDE = 4
LATENT_PATCH = 2
MAX_LATENT_SIZE = 8
Z_CHANNELS = 16

LLM_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": HIDDEN,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 2,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "use_cache": True,
    "torch_dtype": "bfloat16",
}
"""llm_config.json without the ids the tokenizer decides (vocab_size, bos/eos ids: filled in by `build`)."""

BAGEL_LLM_KEYS = {"qk_norm": True, "layer_module": "Qwen2MoTDecoderLayer", "tie_word_embeddings": False}
"""What upstream's app.py sets on the loaded llm_config, and vLLM reads from config.json's llm_config."""

VIT_CONFIG: dict[str, Any] = {
    "model_type": "siglip_vision_model",
    "hidden_size": VIT_HIDDEN,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_channels": 3,
    "image_size": VIT_PATCH * VIT_PATCHES_PER_SIDE,
    "patch_size": VIT_PATCH,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
    "attention_dropout": 0.0,
    "vision_use_head": False,
}

AE_CONFIG: dict[str, Any] = {"ch": 32, "ch_mult": [1, 2, 2, 2], "num_res_blocks": 1, "z_channels": Z_CHANNELS}
"""The FLUX autoencoder's shape (upstream `AutoEncoderParams`; the real one is ch 128, [1, 2, 4, 4], 2 blocks)."""

CONFIG: dict[str, Any] = {
    "architectures": ["BagelForConditionalGeneration"],
    "model_type": "bagel",
    "visual_gen": True,
    "visual_und": True,
    "vae_config": {"z_channels": Z_CHANNELS, "downsample": 8},
    "latent_patch_size": LATENT_PATCH,
    "max_latent_size": MAX_LATENT_SIZE,
    "vit_max_num_patch_per_side": VIT_PATCHES_PER_SIDE,
    "connector_act": "gelu_pytorch_tanh",
    "interpolate_pos": False,
    "timestep_shift": 1.0,
    "torch_dtype": "bfloat16",
}
"""config.json without llm_config / vit_config (added by `build`)."""


def build_tokenizer(out: Path):
    """Train the BPE, wrap it in a Qwen2Tokenizer with BAGEL's specials and the template, save it; return it."""
    from transformers import Qwen2Tokenizer

    from omni_runtime.tiny_models._tokenizers import train_byte_bpe, write_vocab_and_merges

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
        extra_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("<|im_end|>", "<|endoftext|>")],
        model_max_length=LLM_CONFIG["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
        errors="replace",
        split_special_tokens=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_vocab_and_merges(out)
    return tokenizer


def sincos_2d(embed_dim: int, grid_size: int):
    """BAGEL's frozen 2D sin-cos table, (grid_size**2, embed_dim), row-major over the grid.

    As upstream's `get_2d_sincos_pos_embed`: the first half of each row encodes the column index (its
    `meshgrid(w, h)` puts w first), the second half the row index."""
    import numpy as np

    def one_axis(dim: int, pos):
        omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2.0))
        out = np.outer(pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    coords = np.arange(grid_size, dtype=np.float32)
    grid = np.stack(np.meshgrid(coords, coords), axis=0)
    return np.concatenate([one_axis(embed_dim // 2, grid[0]), one_axis(embed_dim // 2, grid[1])], axis=1)


class _Filler:
    """Random tensors from one seeded generator, in call order (so the build is deterministic)."""

    def __init__(self, seed: int) -> None:
        import torch

        self.torch = torch
        self.generator = torch.Generator().manual_seed(seed)

    def normal(self, *shape: int, std: float = INIT_STD):
        return self.torch.randn(*shape, generator=self.generator) * std

    def norm_weight(self, size: int):
        return 1.0 + self.normal(size, std=0.1)

    def uniform_fan_in(self, *shape: int, fan_in: int):
        bound = fan_in**-0.5
        return (self.torch.rand(*shape, generator=self.generator) * 2 - 1) * bound


def _lm_weights(fill: _Filler, vocab_size: int) -> dict[str, Any]:
    """The language model's tensors, both experts, in BAGEL's names."""
    heads, kv_heads = LLM_CONFIG["num_attention_heads"], LLM_CONFIG["num_key_value_heads"]
    head_dim = HIDDEN // heads
    inter = LLM_CONFIG["intermediate_size"]
    out: dict[str, Any] = {"language_model.model.embed_tokens.weight": fill.normal(vocab_size, HIDDEN)}
    for layer in range(LLM_CONFIG["num_hidden_layers"]):
        prefix = f"language_model.model.layers.{layer}."
        for suffix in ("", "_moe_gen"):
            attn = prefix + "self_attn."
            out[attn + f"q_proj{suffix}.weight"] = fill.normal(heads * head_dim, HIDDEN)
            out[attn + f"q_proj{suffix}.bias"] = fill.normal(heads * head_dim)
            out[attn + f"k_proj{suffix}.weight"] = fill.normal(kv_heads * head_dim, HIDDEN)
            out[attn + f"k_proj{suffix}.bias"] = fill.normal(kv_heads * head_dim)
            out[attn + f"v_proj{suffix}.weight"] = fill.normal(kv_heads * head_dim, HIDDEN)
            out[attn + f"v_proj{suffix}.bias"] = fill.normal(kv_heads * head_dim)
            out[attn + f"o_proj{suffix}.weight"] = fill.normal(HIDDEN, heads * head_dim)
            out[attn + f"q_norm{suffix}.weight"] = fill.norm_weight(head_dim)
            out[attn + f"k_norm{suffix}.weight"] = fill.norm_weight(head_dim)
            out[prefix + f"mlp{suffix}.gate_proj.weight"] = fill.normal(inter, HIDDEN)
            out[prefix + f"mlp{suffix}.up_proj.weight"] = fill.normal(inter, HIDDEN)
            out[prefix + f"mlp{suffix}.down_proj.weight"] = fill.normal(HIDDEN, inter)
            out[prefix + f"input_layernorm{suffix}.weight"] = fill.norm_weight(HIDDEN)
            out[prefix + f"post_attention_layernorm{suffix}.weight"] = fill.norm_weight(HIDDEN)
    out["language_model.model.norm.weight"] = fill.norm_weight(HIDDEN)
    out["language_model.model.norm_moe_gen.weight"] = fill.norm_weight(HIDDEN)
    out["language_model.lm_head.weight"] = fill.normal(vocab_size, HIDDEN)
    return out


def _vit_weights() -> dict[str, Any]:
    """SigLIP (transformers' names under `vit_model.`), the patch embedding flattened to a Linear over (p, p, c)."""
    import torch
    from transformers import SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(SEED + 1)
    vit = SiglipVisionModel(SiglipVisionConfig(**VIT_CONFIG))
    # transformers 5 flattened SigLIP's `vision_model.` level away; BAGEL (and vLLM) keep it
    out = {
        "vit_model." + (name if name.startswith("vision_model.") else f"vision_model.{name}"): tensor.detach().clone()
        for name, tensor in vit.state_dict().items()
    }
    conv = out["vit_model.vision_model.embeddings.patch_embedding.weight"]  # (hidden, c, p, p)
    out["vit_model.vision_model.embeddings.patch_embedding.weight"] = conv.permute(0, 2, 3, 1).reshape(VIT_HIDDEN, -1)
    return out


def _head_weights(fill: _Filler) -> dict[str, Any]:
    """The connector, the two position tables, the timestep embedder and the latent projections."""
    import torch

    patch_dim = LATENT_PATCH**2 * Z_CHANNELS
    return {
        "connector.fc1.weight": fill.normal(HIDDEN, VIT_HIDDEN),
        "connector.fc1.bias": fill.normal(HIDDEN),
        "connector.fc2.weight": fill.normal(HIDDEN, HIDDEN),
        "connector.fc2.bias": fill.normal(HIDDEN),
        "vit_pos_embed.pos_embed": torch.from_numpy(sincos_2d(HIDDEN, VIT_PATCHES_PER_SIDE)).float(),
        "latent_pos_embed.pos_embed": torch.from_numpy(sincos_2d(HIDDEN, MAX_LATENT_SIZE)).float(),
        "time_embedder.mlp.0.weight": fill.normal(HIDDEN, 256),
        "time_embedder.mlp.0.bias": fill.normal(HIDDEN),
        "time_embedder.mlp.2.weight": fill.normal(HIDDEN, HIDDEN),
        "time_embedder.mlp.2.bias": fill.normal(HIDDEN),
        "vae2llm.weight": fill.normal(HIDDEN, patch_dim),
        "vae2llm.bias": fill.normal(HIDDEN),
        "llm2vae.weight": fill.normal(patch_dim, HIDDEN),
        "llm2vae.bias": fill.normal(patch_dim),
    }


def _ae_weights(fill: _Filler) -> dict[str, Any]:
    """A FLUX autoencoder in its original names (black-forest-labs/flux `Encoder` / `Decoder`)."""
    ch, mult, blocks, z = AE_CONFIG["ch"], AE_CONFIG["ch_mult"], AE_CONFIG["num_res_blocks"], AE_CONFIG["z_channels"]
    out: dict[str, Any] = {}

    def conv(name: str, c_out: int, c_in: int, k: int) -> None:
        out[name + ".weight"] = fill.uniform_fan_in(c_out, c_in, k, k, fan_in=c_in * k * k)
        out[name + ".bias"] = fill.uniform_fan_in(c_out, fan_in=c_in * k * k)

    def norm(name: str, c: int) -> None:
        out[name + ".weight"] = fill.norm_weight(c)
        out[name + ".bias"] = fill.normal(c, std=0.1)

    def resnet(name: str, c_in: int, c_out: int) -> None:
        norm(name + ".norm1", c_in)
        conv(name + ".conv1", c_out, c_in, 3)
        norm(name + ".norm2", c_out)
        conv(name + ".conv2", c_out, c_out, 3)
        if c_in != c_out:
            conv(name + ".nin_shortcut", c_out, c_in, 1)

    def middle(side: str, c: int) -> None:
        resnet(f"{side}.mid.block_1", c, c)
        norm(f"{side}.mid.attn_1.norm", c)
        for proj in ("q", "k", "v", "proj_out"):
            conv(f"{side}.mid.attn_1.{proj}", c, c, 1)
        resnet(f"{side}.mid.block_2", c, c)

    conv("encoder.conv_in", ch, 3, 3)
    block_in = ch
    for level, m in enumerate(mult):
        for block in range(blocks):
            resnet(f"encoder.down.{level}.block.{block}", block_in, ch * m)
            block_in = ch * m
        if level != len(mult) - 1:
            conv(f"encoder.down.{level}.downsample.conv", block_in, block_in, 3)
    middle("encoder", block_in)
    norm("encoder.norm_out", block_in)
    conv("encoder.conv_out", 2 * z, block_in, 3)

    block_in = ch * mult[-1]
    conv("decoder.conv_in", block_in, z, 3)
    middle("decoder", block_in)
    for level in reversed(range(len(mult))):
        for block in range(blocks + 1):
            resnet(f"decoder.up.{level}.block.{block}", block_in, ch * mult[level])
            block_in = ch * mult[level]
        if level != 0:
            conv(f"decoder.up.{level}.upsample.conv", block_in, block_in, 3)
    norm("decoder.norm_out", block_in)
    conv("decoder.conv_out", 3, block_in, 3)
    return out


def _save_image_processor(out: Path) -> None:
    from transformers import SiglipImageProcessor

    side = VIT_CONFIG["image_size"]
    SiglipImageProcessor(
        size={"height": side, "width": side},
        do_resize=True,
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    ).save_pretrained(out)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def build(out: Path) -> None:
    """Write the tiny BAGEL into the empty folder `out`."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    tokenizer = build_tokenizer(out)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab_size = -(-len(tokenizer) // 64) * 64
    llm_config = {
        **LLM_CONFIG,
        "vocab_size": vocab_size,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
    }
    _write_json(out / "llm_config.json", llm_config)
    _write_json(out / "vit_config.json", VIT_CONFIG)
    _write_json(
        out / "config.json", {**CONFIG, "llm_config": {**llm_config, **BAGEL_LLM_KEYS}, "vit_config": VIT_CONFIG}
    )
    _save_image_processor(out)

    fill = _Filler(SEED)
    ema = {**_lm_weights(fill, vocab_size), **_vit_weights(), **_head_weights(fill)}
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in sorted(ema.items())}, str(out / "ema.safetensors"))
    ae = _ae_weights(_Filler(SEED + 2))
    save_file({k: v.float().contiguous() for k, v in sorted(ae.items())}, str(out / "ae.safetensors"))
    GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        do_sample=False,
    ).save_pretrained(out)
