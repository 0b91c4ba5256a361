"""Run BAGEL's upstream code (ByteDance-Seed/Bagel) on a checkpoint folder: the anchor `test_bagel` compares with.

`python bagel_upstream_run.py <upstream dir> <model dir> <inputs.pt> <outputs.pt>`, in a process of its own: the
upstream tree is imported as top-level `modeling` / `data` packages, which must not leak into the test process.
`bagel_reference.py` extracts the tree and adapts it (see there); this script only drives upstream's own entry
points: `prepare_prompts` + `forward_cache_update_text` for contexts (as `InterleaveInferencer.update_context_text`
does), `prepare_vae_latent(_cfg)` + `generate_image` for the latents (as `gen_image` does, with the test's noise in
place of upstream's unseeded `torch.randn`), and the FLUX `AutoEncoder.decode` as `decode_image` does.

inputs.pt: {"contexts": {name: [segments]}, "cases": [{"name", "height", "width", "steps",
"noise", "contexts": {role: context name}, "guidance": {...}}], "transforms": {"vae": [max, min, stride], "vit":
[...]}}; a segment is a list of raw token ids (upstream frames each with <|im_start|> ... <|im_end|> itself) or
{"image": uint8 (H, W, 3), "seed": int}: an edit's input image, resized by the VAE transform's resize first as
`interleave_inference` does, then put in the context as `update_context_image(vae=True, vit=True)` does (the
VAE posterior sampled right after `torch.manual_seed(seed)`). outputs.pt: {"contexts": {name: {"keys", "values",
"next_position"}}, "latents": {case: tensor}, "images": {case: float image (1, 3, H, W) in [-1, 1]}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def _default_rope(config, device=None, seq_len=None, **kwargs):
    """transformers 4's `_compute_default_rope_parameters`, which upstream's Qwen2RotaryEmbedding looks up as
    ROPE_INIT_FUNCTIONS["default"] and transformers 5 no longer registers: inv_freq = theta^(-2i/d), scale 1."""
    theta = getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]
    dim = config.hidden_size // config.num_attention_heads
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float().to(device) / dim)), 1.0


def _load_model(model_dir: Path):
    from modeling.autoencoder import AutoEncoder, AutoEncoderParams
    from modeling.bagel import Bagel, BagelConfig, Qwen2Config, Qwen2ForCausalLM, SiglipVisionConfig, SiglipVisionModel
    from safetensors.torch import load_file

    config = json.loads((model_dir / "config.json").read_text())
    # as upstream app.py: llm_config.json with qk_norm, untied embeddings and the MoT layer set on top
    llm_config = Qwen2Config.from_json_file(str(model_dir / "llm_config.json"))
    llm_config.qk_norm = True
    llm_config.tie_word_embeddings = False
    llm_config.layer_module = "Qwen2MoTDecoderLayer"
    llm_config._attn_implementation = "eager"  # upstream's default names flash-attn 2; its packed forward ignores it
    llm_config.pad_token_id = None  # transformers 4's PretrainedConfig default, which upstream's Qwen2Model reads
    vit_config = SiglipVisionConfig.from_json_file(str(model_dir / "vit_config.json"))
    vit_config.rope = False  # app.py also drops the real checkpoint's unused 27th layer; the tiny one stores all
    ae_state = load_file(str(model_dir / "ae.safetensors"))
    levels = sorted({int(k.split(".")[2]) for k in ae_state if k.startswith("decoder.up.")})
    ch = int(ae_state["encoder.conv_in.weight"].shape[0])
    ae_params = AutoEncoderParams(
        resolution=256,
        in_channels=3,
        downsample=8,
        ch=ch,
        out_ch=3,
        ch_mult=[int(ae_state[f"decoder.up.{i}.block.0.conv2.weight"].shape[0]) // ch for i in levels],
        num_res_blocks=len({k.split(".")[4] for k in ae_state if k.startswith("decoder.up.0.block.")}) - 1,
        z_channels=int(ae_state["decoder.conv_in.weight"].shape[1]),
        scale_factor=0.3611,
        shift_factor=0.1159,
    )
    vae = AutoEncoder(ae_params)
    vae.load_state_dict(ae_state, strict=True)
    bagel_config = BagelConfig(
        visual_gen=True,
        visual_und=True,
        llm_config=llm_config,
        vit_config=vit_config,
        vae_config=ae_params,
        vit_max_num_patch_per_side=config["vit_max_num_patch_per_side"],
        connector_act=config["connector_act"],
        latent_patch_size=config["latent_patch_size"],
        max_latent_size=config["max_latent_size"],
    )
    model = Bagel(Qwen2ForCausalLM(llm_config), SiglipVisionModel(vit_config), bagel_config)
    model.vit_model.vision_model.embeddings.convert_conv2d_to_linear(vit_config)
    state = {k: v.float() for k, v in load_file(str(model_dir / "ema.safetensors")).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # rotary inv_freq buffers are computed, not stored; every stored tensor must land
    missing = [k for k in missing if not k.endswith("inv_freq")]
    if missing or unexpected:
        raise SystemExit(f"upstream model and checkpoint disagree: missing {missing}, unexpected {unexpected}")
    return model.float().eval(), vae.float().eval()


def _with_image(model, vae, segment: dict, context: dict, transforms: dict, new_token_ids: dict) -> dict:
    """`context` after an edit's input image, as `interleave_inference` + `update_context_image` put it there."""
    from PIL import Image

    image = transforms["vae"].resize_transform(Image.fromarray(segment["image"].numpy()).convert("RGB"))
    past, kv_lens, ropes = context["past_key_values"], context["kv_lens"], context["ropes"]
    generation_input, kv_lens, ropes = model.prepare_vae_images(
        curr_kvlens=kv_lens, curr_rope=ropes, images=[image], transforms=transforms["vae"], new_token_ids=new_token_ids
    )
    torch.manual_seed(segment["seed"])
    with torch.no_grad():
        past = model.forward_cache_update_vae(vae, past, **generation_input)
    generation_input, kv_lens, ropes = model.prepare_vit_images(
        curr_kvlens=kv_lens, curr_rope=ropes, images=[image], transforms=transforms["vit"], new_token_ids=new_token_ids
    )
    with torch.no_grad():
        past = model.forward_cache_update_vit(past, **generation_input)
    return {"kv_lens": kv_lens, "ropes": ropes, "past_key_values": past}


def main(upstream_dir: str, model_dir: str, inputs_file: str, outputs_file: str) -> None:
    sys.path.insert(0, upstream_dir)
    from transformers import modeling_rope_utils

    modeling_rope_utils.ROPE_INIT_FUNCTIONS.setdefault("default", _default_rope)
    from data.data_utils import add_special_tokens
    from modeling.bagel.qwen2_navit import NaiveCache
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    inputs = torch.load(inputs_file)
    from data.transforms import ImageTransform

    transforms = {
        k: ImageTransform(*v)
        for k, v in inputs.get("transforms", {"vae": (1024, 512, 16), "vit": (980, 224, 14)}).items()
    }
    model, vae = _load_model(Path(model_dir))
    tokenizer, new_token_ids, _ = add_special_tokens(AutoTokenizer.from_pretrained(model_dir))

    class _Ids:
        """Hands upstream's `prepare_prompts` the test's token ids where it calls `tokenizer.encode(prompt)`."""

        def encode(self, ids):
            return list(ids)

    contexts = {}
    for name, segments in inputs["contexts"].items():
        context = {
            "kv_lens": [0],
            "ropes": [0],
            "past_key_values": NaiveCache(model.config.llm_config.num_hidden_layers),
        }
        for segment in segments:
            if isinstance(segment, dict):
                context = _with_image(model, vae, segment, context, transforms, new_token_ids)
                continue
            generation_input, kv_lens, ropes = model.prepare_prompts(
                curr_kvlens=context["kv_lens"],
                curr_rope=context["ropes"],
                prompts=[segment],
                tokenizer=_Ids(),
                new_token_ids=new_token_ids,
            )
            with torch.no_grad():
                past = model.forward_cache_update_text(context["past_key_values"], **generation_input)
            context = {"kv_lens": kv_lens, "ropes": ropes, "past_key_values": past}
        contexts[name] = context

    out = {"contexts": {}, "latents": {}, "images": {}}
    for name, context in contexts.items():
        cache = context["past_key_values"]
        layers = range(model.config.llm_config.num_hidden_layers)
        out["contexts"][name] = {
            "keys": torch.stack([cache.key_cache[i] for i in layers], dim=1),
            "values": torch.stack([cache.value_cache[i] for i in layers], dim=1),
            "next_position": context["ropes"][0],
        }

    for case in inputs["cases"]:
        shape = (case["height"], case["width"])
        roles = {role: contexts[name] for role, name in case["contexts"].items()}
        empty = {"kv_lens": [0], "ropes": [0], "past_key_values": NaiveCache(model.config.llm_config.num_hidden_layers)}
        gen = roles["primary"]
        generation_input = model.prepare_vae_latent(
            curr_kvlens=gen["kv_lens"], curr_rope=gen["ropes"], image_sizes=[shape], new_token_ids=new_token_ids
        )
        generation_input["packed_init_noises"] = case["noise"]
        cfg = {}
        for role in ("cfg_text", "cfg_img"):
            context = roles.get(role, empty)
            prepared = model.prepare_vae_latent_cfg(
                curr_kvlens=context["kv_lens"], curr_rope=context["ropes"], image_sizes=[shape]
            )
            cfg.update(
                {
                    f"{role}_past_key_values": context["past_key_values"],
                    f"{role}_packed_position_ids": prepared["cfg_packed_position_ids"],
                    f"{role}_packed_query_indexes": prepared["cfg_packed_query_indexes"],
                    f"{role}_key_values_lens": prepared["cfg_key_values_lens"],
                    f"{role}_packed_key_value_indexes": prepared["cfg_packed_key_value_indexes"],
                }
            )
        guidance = case["guidance"]
        with torch.no_grad():
            latents = model.generate_image(
                past_key_values=gen["past_key_values"],
                num_timesteps=case["steps"] + 1,
                cfg_text_scale=guidance["cfg_text_scale"],
                cfg_img_scale=guidance["cfg_img_scale"],
                cfg_interval=list(guidance["cfg_interval"]),
                cfg_renorm_min=guidance["cfg_renorm_min"],
                cfg_renorm_type=guidance["cfg_renorm_type"],
                timestep_shift=guidance["timestep_shift"],
                **generation_input,
                **cfg,
            )[0]
            h, w = case["height"] // model.latent_downsample, case["width"] // model.latent_downsample
            p, c = model.latent_patch_size, model.latent_channel
            grid = torch.einsum("nhwpqc->nchpwq", latents.reshape(1, h, w, p, p, c)).reshape(1, c, h * p, w * p)
            out["images"][case["name"]] = vae.decode(grid)
        out["latents"][case["name"]] = latents
    torch.save(out, outputs_file)


if __name__ == "__main__":
    main(*sys.argv[1:5])
