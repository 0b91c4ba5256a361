"""BAGEL: the tiny checkpoint (`tiny-bagel`) and our torch generation engine (`engines.diffusion.bagel`).

Unit tests (no model): the sampler's schedule, guidance and its bounds, the context checks. With the tiny model
(`models`): the generator's behaviour, the anchor against BAGEL's upstream code (`bagel_reference`: prefill K/V
and generated latents equal upstream's in float32), and `BagelEngine` (the dit stage) on payloads a thinker would
send. vLLM loading the folder (text and image understanding) is tests/test_serve_bagel.py's, through the router.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from servelib import tiny_model

from omni_runtime.engines.diffusion.bagel import BagelGuidance, KvContext, MissingContext, empty_context
from omni_runtime.engines.diffusion.bagel.generate import latent_grid, select_contexts
from omni_runtime.engines.diffusion.bagel.sampler import guide, sample, timesteps
from omni_runtime.engines.diffusion.bagel.weights import BagelConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CONFIG = BagelConfig(
    hidden_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    qk_norm=True,
    latent_channels=16,
    vae_downsample=8,
    latent_patch_size=2,
    max_latent_size=8,
)
"""tiny-bagel's shape: images of 16 to 128 px in steps of 16."""

UPSTREAM_ATOL = 1e-4
"""float32 on both sides; the differences seen are ~3e-6 (summation order of SDPA vs the stand-in's loop)."""


def _context(tokens: int, position: int | None = None, config: BagelConfig = CONFIG) -> KvContext:
    shape = (tokens, config.num_layers, config.num_kv_heads, config.head_dim)
    return KvContext(torch.randn(shape), torch.randn(shape), tokens if position is None else position)


def _counting_velocity(calls: list[tuple[str, float]]):
    """A velocity of a fixed linear form per role, recording each call (the sampler's seam, no model)."""
    factor = {"primary": 1.0, "cfg_text": 0.5, "cfg_img": 0.25}

    def velocity(role, x, t):
        calls.append((role, float(t)))
        return x * factor[role] + t

    return velocity


# --- the schedule and the guidance (no model) ---------------------------------------------------------------


@pytest.mark.parametrize("shift", [1.0, 3.0, 7.5])
def test_timesteps_are_upstreams_shifted_linspace(shift: float) -> None:
    steps = 6
    plain = [1 - i / steps for i in range(steps + 1)]
    expected = torch.tensor([shift * t / (1 + (shift - 1) * t) for t in plain])
    got = timesteps(steps, shift)
    assert got.shape == (steps + 1,) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    assert got[0] == 1.0 and got[-1] == 0.0
    with pytest.raises(ValueError, match="steps: 0"):
        timesteps(0, shift)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("cfg_text_scale", 0.5),
        ("cfg_text_scale", 8.5),
        ("cfg_img_scale", 0.9),
        ("cfg_img_scale", 4.5),
        ("cfg_renorm_min", -0.1),
        ("cfg_renorm_min", 1.5),
        ("cfg_renorm_type", "local"),
        ("timestep_shift", 0.5),
        ("timestep_shift", 11.0),
        ("cfg_interval", (0.5, 0.5)),
        ("cfg_interval", (-0.1, 1.0)),
        ("cfg_interval", (0.2, 1.1)),
        ("num_timesteps", 50),
    ],
)
def test_guidance_outside_its_bounds_is_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as error:
        BagelGuidance(**{field: value})
    assert field in str(error.value)


def test_guidance_defaults_are_upstreams_text_to_image_ones_and_name_their_roles() -> None:
    default = BagelGuidance()
    assert (default.cfg_text_scale, default.cfg_img_scale, default.cfg_interval) == (4.0, 1.0, (0.4, 1.0))
    assert (default.cfg_renorm_type, default.cfg_renorm_min, default.timestep_shift) == ("global", 0.0, 3.0)
    assert default.roles() == ("primary", "cfg_text")
    assert BagelGuidance(cfg_text_scale=1, cfg_img_scale=2).roles() == ("primary", "cfg_img")
    assert BagelGuidance(cfg_text_scale=1).roles() == ("primary",)


def test_scales_of_one_run_no_companion_forward() -> None:
    calls: list[tuple[str, float]] = []
    noise = torch.randn(16, 64)
    result = sample(noise, _counting_velocity(calls), BagelGuidance(cfg_text_scale=1.0, cfg_img_scale=1.0), 5)
    assert result.forwards == {"primary": 5, "cfg_text": 0, "cfg_img": 0}
    assert {role for role, _ in calls} == {"primary"}
    # unguided: plain Euler steps of the primary velocity
    x, schedule = noise.clone(), timesteps(5, 3.0)
    for i in range(5):
        x = x - (x + schedule[i]) * (schedule[i] - schedule[i + 1])
    torch.testing.assert_close(result.latents, x)


@pytest.mark.parametrize(
    ("interval", "guided"),
    [((0.0, 1.0), [1.0, 0.75, 0.5, 0.25]), ((0.5, 1.0), [1.0, 0.75]), ((0.25, 0.75), [0.75, 0.5])],
)
def test_guidance_runs_at_timesteps_inside_the_interval_lo_excluded_hi_included(
    interval: tuple[float, float], guided: list[float]
) -> None:
    calls: list[tuple[str, float]] = []
    guidance = BagelGuidance(cfg_text_scale=3.0, cfg_img_scale=2.0, cfg_interval=interval, timestep_shift=1.0)
    result = sample(torch.randn(4, 64), _counting_velocity(calls), guidance, 4)
    assert [t for role, t in calls if role == "cfg_text"] == guided
    assert [t for role, t in calls if role == "cfg_img"] == guided
    assert result.forwards == {"primary": 4, "cfg_text": len(guided), "cfg_img": len(guided)}


def test_global_renorm_caps_the_guided_norm_at_the_unguided_one() -> None:
    v, v_text = torch.randn(16, 64), torch.randn(16, 64)
    raw = v_text + 4.0 * (v - v_text)
    capped = guide(v, v_text, None, text_scale=4.0, img_scale=1.0, renorm_type="global", renorm_min=0.0)
    torch.testing.assert_close(capped, raw * (v.norm() / (raw.norm() + 1e-8)))
    assert capped.norm() == pytest.approx(v.norm().item(), rel=1e-5)
    uncapped = guide(v, v_text, None, text_scale=4.0, img_scale=1.0, renorm_type="global", renorm_min=1.0)
    torch.testing.assert_close(uncapped, raw)


def test_channel_renorm_caps_each_token_and_leaves_smaller_ones() -> None:
    v = torch.randn(8, 64)
    v_text = v * 1.5  # guided = v_text + 2 (v - v_text) = 0.5 v: already smaller than v, left as it is
    v_text[0] = -v[0]  # token 0: guided = 3 v[0], capped to v[0]
    out = guide(v, v_text, None, text_scale=2.0, img_scale=1.0, renorm_type="channel", renorm_min=0.0)
    torch.testing.assert_close(out[0], v[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1:], 0.5 * v[1:], atol=1e-5, rtol=1e-5)


def test_text_channel_renorms_the_text_guidance_then_applies_image_guidance_unnormed() -> None:
    v, v_text, v_img = torch.randn(8, 64), torch.randn(8, 64), torch.randn(8, 64)
    raw = v_text + 3.0 * (v - v_text)
    text_guided = raw * (v.norm(dim=-1, keepdim=True) / (raw.norm(dim=-1, keepdim=True) + 1e-8)).clamp(0.2, 1.0)
    out = guide(v, v_text, v_img, text_scale=3.0, img_scale=2.0, renorm_type="text_channel", renorm_min=0.2)
    torch.testing.assert_close(out, v_img + 2.0 * (text_guided - v_img))


def test_image_guidance_applies_when_text_guidance_is_off() -> None:
    """Upstream drops image guidance at cfg_text_scale 1 (after running its forward); ours applies it."""
    v, v_img = torch.randn(8, 64), torch.randn(8, 64)
    raw = v_img + 2.0 * (v - v_img)
    out = guide(v, None, v_img, text_scale=1.0, img_scale=2.0, renorm_type="global", renorm_min=0.0)
    torch.testing.assert_close(out, raw * (v.norm() / (raw.norm() + 1e-8)).clamp(0.0, 1.0))
    calls: list[tuple[str, float]] = []
    result = sample(torch.randn(4, 64), _counting_velocity(calls), BagelGuidance(cfg_text_scale=1, cfg_img_scale=2), 4)
    assert result.forwards["cfg_text"] == 0 and result.forwards["cfg_img"] > 0


# --- contexts and bounds (no model) --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("guidance", "given", "missing"),
    [
        (BagelGuidance(), {"primary"}, "cfg_text"),
        (BagelGuidance(cfg_text_scale=1.0, cfg_img_scale=2.0), {"primary", "cfg_text"}, "cfg_img"),
        (BagelGuidance(cfg_text_scale=1.0), {"cfg_text", "cfg_img"}, "primary"),
    ],
)
def test_a_role_the_guidance_needs_and_lacks_is_an_error_naming_it(
    guidance: BagelGuidance, given: set[str], missing: str
) -> None:
    contexts = {role: _context(5) for role in given}
    with pytest.raises(MissingContext, match=repr(missing)) as error:
        select_contexts(CONFIG, contexts, guidance, torch.float32, "cpu")
    assert error.value.role == missing


def test_unneeded_roles_are_ignored_and_needed_ones_converted_once() -> None:
    base = _context(7)
    contexts = {
        "primary": KvContext(base.keys.to(torch.bfloat16), base.values.to(torch.bfloat16), 7),
        "cfg_img": _context(3),
    }
    selected = select_contexts(CONFIG, contexts, BagelGuidance(cfg_text_scale=1.0), torch.float32, "cpu")
    assert list(selected) == ["primary"]
    assert selected["primary"].keys.dtype == torch.float32 and selected["primary"].next_position == 7


def test_a_context_from_another_model_is_refused_naming_both_shapes() -> None:
    other = BagelConfig(**{**CONFIG.__dict__, "num_layers": 3})
    contexts = {"primary": _context(4, config=other), "cfg_text": empty_context(CONFIG)}
    with pytest.raises(
        ValueError, match=r"'primary' has \(layers, kv_heads, head_dim\) = \(3, 2, 32\), this model \(2, 2, 32\)"
    ):
        select_contexts(CONFIG, contexts, BagelGuidance(), torch.float32, "cpu")


def test_kv_context_refuses_keys_and_values_of_different_shapes() -> None:
    with pytest.raises(ValueError, match="tokens, layers, kv_heads, head_dim"):
        KvContext(torch.zeros(3, 2, 2, 32), torch.zeros(4, 2, 2, 32), 3)
    with pytest.raises(ValueError, match="next_position -1"):
        KvContext(torch.zeros(3, 2, 2, 32), torch.zeros(3, 2, 2, 32), -1)


@pytest.mark.parametrize(
    ("height", "width", "field"),
    [
        (72, 64, "height"),
        (64, 8, "width"),
        (0, 64, "height"),
        (64, 144, "width"),
        (64.0, 64, "height"),
        (True, 64, "height"),
    ],
)
def test_image_sizes_out_of_bounds_are_refused_naming_the_field(height: object, width: object, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: .* use a multiple of 16 from 16 to 128"):
        latent_grid(CONFIG, height, width)  # type: ignore[arg-type]  # the wrong types are the point


def test_image_sizes_in_bounds_give_the_latent_grid() -> None:
    assert latent_grid(CONFIG, 64, 128) == (4, 8)
    assert latent_grid(CONFIG, 16, 16) == (1, 1)


# --- the tiny model ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model("tiny-bagel")


@pytest.fixture(scope="module")
def generator(model_dir: Path):
    from omni_runtime.engines.diffusion.bagel import BagelGenerator

    return BagelGenerator.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def prompt_ids(model_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).encode("A red apple on a wooden table")


def _t2i(generator, prompt_ids: list[int]) -> dict[str, KvContext]:
    return {"primary": generator.prefill(generator.frame_text(prompt_ids)), "cfg_text": empty_context(generator.config)}


@pytest.mark.models
def test_tiny_bagel_folder_has_the_checkpoints_layout(model_dir: Path) -> None:
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "bagel" and config["architectures"] == ["BagelForConditionalGeneration"]
    llm, vit = config["llm_config"], config["vit_config"]
    assert llm["qk_norm"] and llm["layer_module"] == "Qwen2MoTDecoderLayer" and not llm["tie_word_embeddings"]
    assert llm["hidden_size"] // llm["num_attention_heads"] == 32
    # vLLM gives an image vit_max_num_patch_per_side**2 tokens and its SigLIP makes (image_size / patch)**2
    assert config["vit_max_num_patch_per_side"] == vit["image_size"] // vit["patch_size"]
    assert json.loads((model_dir / "vit_config.json").read_text()) == vit
    with safe_open(str(model_dir / "ema.safetensors"), "pt") as ema:
        names = set(ema.keys())
        assert ema.get_tensor("language_model.model.embed_tokens.weight").dtype == torch.bfloat16
        assert ema.get_tensor("llm2vae.weight").abs().sum() > 0  # random, not upstream's zero init
        assert ema.get_tensor("vit_model.vision_model.embeddings.patch_embedding.weight").ndim == 2
    for name in (
        "language_model.model.layers.1.self_attn.q_proj_moe_gen.weight",
        "language_model.model.layers.1.self_attn.k_norm_moe_gen.weight",
        "language_model.model.layers.1.mlp_moe_gen.down_proj.weight",
        "language_model.model.norm_moe_gen.weight",
        "language_model.lm_head.weight",
        "vit_model.vision_model.post_layernorm.weight",
        "connector.fc2.weight",
        "vit_pos_embed.pos_embed",
        "latent_pos_embed.pos_embed",
        "time_embedder.mlp.2.weight",
        "vae2llm.weight",
    ):
        assert name in names
    with safe_open(str(model_dir / "ae.safetensors"), "pt") as ae:
        prefixes = {key.split(".")[0] for key in ae.keys()}
    assert prefixes == {"encoder", "decoder"}


@pytest.mark.models
def test_prefill_gives_every_layers_kv_time_first_and_is_causal(generator, prompt_ids: list[int]) -> None:
    ids = generator.frame_text(prompt_ids)
    context = generator.prefill(ids)
    assert context.keys.shape == (len(ids), 2, 2, 32) == context.values.shape
    assert context.next_position == len(ids)
    more = generator.prefill(prompt_ids[:3], past=context)
    assert more.num_tokens == len(ids) + 3 and more.next_position == len(ids) + 3
    torch.testing.assert_close(more.keys[: len(ids)], context.keys)  # later tokens do not change earlier K/V
    whole = generator.prefill(ids + prompt_ids[:3])
    torch.testing.assert_close(more.keys, whole.keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(more.values, whole.values, atol=1e-5, rtol=1e-5)


@pytest.mark.models
def test_same_seed_same_image_other_seed_other_image(generator, prompt_ids: list[int]) -> None:
    contexts = _t2i(generator, prompt_ids)
    first = generator.generate(contexts, 64, 48, 4, seed=7)
    assert first.shape == (64, 48, 3) and first.dtype == np.uint8
    assert np.array_equal(first, generator.generate(contexts, 64, 48, 4, seed=7))
    other = generator.generate(contexts, 64, 48, 4, seed=8)
    assert np.abs(first.astype(int) - other).mean() > 5


@pytest.mark.models
def test_cfg_text_scale_changes_the_image(generator, prompt_ids: list[int]) -> None:
    contexts = _t2i(generator, prompt_ids)
    guided = generator.generate(contexts, 64, 64, 4, seed=3, guidance=BagelGuidance(cfg_text_scale=6.0))
    unguided = generator.generate(contexts, 64, 64, 4, seed=3, guidance=BagelGuidance(cfg_text_scale=1.0))
    assert np.abs(guided.astype(int) - unguided).mean() > 1
    result = generator.denoise(contexts, 64, 64, 4, seed=3, guidance=BagelGuidance(cfg_text_scale=1.0))
    assert result.forwards == {"primary": 4, "cfg_text": 0, "cfg_img": 0}


@pytest.mark.models
def test_the_prompt_steers_the_image(generator, prompt_ids: list[int]) -> None:
    contexts = _t2i(generator, prompt_ids)
    other = {**contexts, "primary": generator.prefill(generator.frame_text(prompt_ids[::-1]))}
    first = generator.generate(contexts, 64, 64, 4, seed=3)
    assert np.abs(first.astype(int) - generator.generate(other, 64, 64, 4, seed=3)).mean() > 1


# --- the anchor: BAGEL's own code ---------------------------------------------------------------------------


ANCHOR_CASES = [
    # name, primary, cfg_text, cfg_img, guidance: global renorm with both companions, the interval excluding a step
    ("global", "two", "other", "prompt", dict(cfg_text_scale=4.0, cfg_img_scale=1.5, cfg_interval=(0.6, 1.0))),
    (
        "text_channel",
        "prompt",
        "other",
        "two",
        dict(
            cfg_text_scale=3.0,
            cfg_img_scale=2.0,
            cfg_interval=(0.0, 1.0),
            cfg_renorm_type="text_channel",
            cfg_renorm_min=0.2,
        ),
    ),
    # text-to-image as served: the cfg_text context is empty (upstream's fresh context)
    ("channel_t2i", "prompt", None, None, dict(cfg_text_scale=2.5, cfg_renorm_type="channel", timestep_shift=2.0)),
]


@pytest.mark.models
def test_prefill_kv_and_generated_latents_equal_upstream_bagel(
    generator, model_dir: Path, prompt_ids: list[int], tmp_path: Path
) -> None:
    from bagel_reference import run_upstream
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    segments = {
        "prompt": [prompt_ids],
        "two": [tokenizer.encode("You are a painter."), prompt_ids],  # two segments: prefill after a past
        "other": [tokenizer.encode("a blue sea")],
    }
    ours = {}
    for name, parts in segments.items():
        context = None
        for part in parts:
            context = generator.prefill(generator.frame_text(part), context)
        ours[name] = context
    ours["empty"] = empty_context(generator.config)
    cases = []
    for index, (name, primary, cfg_text, cfg_img, guidance) in enumerate(ANCHOR_CASES):
        roles = {"primary": primary, "cfg_text": cfg_text, "cfg_img": cfg_img}
        cases.append(
            {
                "name": name,
                "height": 64,
                "width": 32 if index == 1 else 64,
                "steps": 4,
                "noise": generator.noise(index, 16 if index != 1 else 8),
                "contexts": {role: ctx for role, ctx in roles.items() if ctx is not None},
                "guidance": BagelGuidance(**guidance).model_dump(),
            }
        )
    upstream = run_upstream(model_dir, {"contexts": segments, "cases": cases}, tmp_path)

    for name in segments:
        theirs = upstream["contexts"][name]
        assert ours[name].next_position == theirs["next_position"]
        torch.testing.assert_close(ours[name].keys, theirs["keys"], atol=UPSTREAM_ATOL, rtol=0)
        torch.testing.assert_close(ours[name].values, theirs["values"], atol=UPSTREAM_ATOL, rtol=0)
    for case in cases:
        contexts = {role: ours[ctx] for role, ctx in case["contexts"].items()}
        contexts.setdefault("cfg_text", ours["empty"])
        result = generator.denoise(
            contexts, case["height"], case["width"], case["steps"], 0, BagelGuidance(**case["guidance"]), case["noise"]
        )
        theirs = upstream["latents"][case["name"]]
        assert float(theirs.abs().max()) > 0.5  # the comparison is of real latents, not of zeros
        torch.testing.assert_close(result.latents, theirs, atol=UPSTREAM_ATOL, rtol=0)
        # the VAE: diffusers' AutoencoderKL on the converted keys decodes as upstream's FLUX AutoEncoder
        grid = generator.grid(case["height"], case["width"])
        from omni_runtime.engines.diffusion.bagel.vae import unpatchify

        decoded = generator.vae.decode_latent(unpatchify(theirs, *grid, generator.config.latent_patch_size))
        torch.testing.assert_close(decoded, upstream["images"][case["name"]], atol=UPSTREAM_ATOL, rtol=0)


EDIT_SEED = 11
EDIT_GUIDANCE = dict(cfg_text_scale=4.0, cfg_img_scale=2.0, cfg_interval=(0.0, 1.0), cfg_renorm_type="text_channel")
"""Upstream app.py's edit defaults."""


def _edit_picture() -> np.ndarray:
    """A 70 x 50 random picture: resized up (shortest side to the VAE's minimum), then down for the ViT."""
    return np.random.default_rng(7).integers(0, 256, (50, 70, 3), dtype=np.uint8)


@pytest.mark.models
def test_edit_contexts_and_the_edited_latents_equal_upstream_bagel(
    generator, model_dir: Path, prompt_ids: list[int], tmp_path: Path
) -> None:
    """An edit's three contexts (the picture's VAE block through the generation expert, its ViT block through the
    understanding expert, then the prompt; the picture alone; the prompt alone) and the latents drawn over them
    with upstream's edit guidance equal upstream's `update_context_image` / `update_context_text` and
    `generate_image`, the VAE posterior sampled from the same seed. The tolerance is the text anchor's (1e-4,
    float32); putting the VAE block through the understanding expert instead misses by far more."""
    from bagel_reference import run_upstream
    from PIL import Image

    from omni_runtime.engines.diffusion.bagel.context import empty_context
    from omni_runtime.engines.diffusion.bagel.mot import extend_with_image

    picture = _edit_picture()
    image = generator.prepare_edit(Image.fromarray(picture))
    height, width = image.size
    assert (width, height) == (128, 96)  # upstream's resize: up to the VAE's 128-px minimum side, within its max
    assert tuple(image.vit_pixels.shape[1:]) == (42, 56)  # the ViT's view, resized from the VAE's
    ours = generator.edit_contexts(image, prompt_ids, EDIT_SEED)
    pic = {"image": torch.from_numpy(picture), "seed": EDIT_SEED}
    segments = {"primary": [pic, prompt_ids], "cfg_text": [pic], "cfg_img": [prompt_ids]}
    sizes = generator.edit_sizes()
    tokens = (height // 16) * (width // 16)
    case = {
        "name": "edit",
        "height": height,
        "width": width,
        "steps": 4,
        "noise": generator.noise(3, tokens),
        "contexts": {role: role for role in segments},
        "guidance": BagelGuidance(**EDIT_GUIDANCE).model_dump(),
    }
    transforms = {
        "vae": [sizes.vae_max, sizes.vae_min, sizes.vae_stride],
        "vit": [sizes.vit_max, sizes.vit_min, sizes.vit_stride],
    }
    upstream = run_upstream(model_dir, {"contexts": segments, "cases": [case], "transforms": transforms}, tmp_path)
    for role in segments:
        theirs = upstream["contexts"][role]
        assert ours[role].next_position == theirs["next_position"], role
        assert ours[role].num_tokens == theirs["keys"].shape[0], role
        torch.testing.assert_close(ours[role].keys, theirs["keys"], atol=UPSTREAM_ATOL, rtol=0)
        torch.testing.assert_close(ours[role].values, theirs["values"], atol=UPSTREAM_ATOL, rtol=0)
    assert ours["cfg_text"].num_tokens == (tokens + 2) + (12 + 2)  # the VAE block, then 4 x 3 ViT patches framed
    result = generator.denoise(ours, height, width, 4, 0, BagelGuidance(**EDIT_GUIDANCE), case["noise"])
    assert float(upstream["latents"]["edit"].abs().max()) > 0.5
    torch.testing.assert_close(result.latents, upstream["latents"]["edit"], atol=UPSTREAM_ATOL, rtol=0)

    # the check has teeth: the picture's VAE tokens through the understanding expert give another context
    latents = generator.vae.encode(image.vae_pixels[None], generator=torch.Generator().manual_seed(EDIT_SEED))
    from omni_runtime.engines.diffusion.bagel.mot import latent_embeddings, latent_position_ids

    clean = latent_embeddings(generator.weights, latents, torch.zeros(()), latent_position_ids(6, 8, 8))
    wrong = extend_with_image(generator.weights, empty_context(generator.config), clean, "und")
    miss = (wrong.keys - upstream["contexts"]["cfg_text"]["keys"][: wrong.num_tokens]).abs().max()
    assert float(miss) > 100 * UPSTREAM_ATOL


# --- the dit stage's engine, on payloads a thinker would send ----------------------------------------------------


@pytest.fixture(scope="module")
def dit_engine(model_dir: Path):
    """The bagel topology's dit stage (its engine args as the registry has them), started: it loads the generation
    path and passes its self-check."""
    import asyncio

    from omni_runtime.engines.diffusion.bagel.engine import BagelEngine
    from omni_runtime.registry import get_pipeline
    from omni_runtime.spec import resolve_pipeline

    pipeline = resolve_pipeline(get_pipeline("bagel"), name="bagel-dit", model=str(model_dir))
    engine = BagelEngine(pipeline, pipeline.topology.stage("dit"))
    loop = asyncio.new_event_loop()
    loop.run_until_complete(engine.start())
    yield engine, loop
    loop.run_until_complete(engine.stop())
    loop.close()


def _payload(engine, context: KvContext, dtype: torch.dtype = torch.bfloat16) -> dict:
    from omni_runtime.processors.kv_cache import make_kv_payload

    n = context.num_tokens
    return dict(
        make_kv_payload(
            context.keys.to(dtype), context.values.to(dtype), model=engine.expected.model, positions=list(range(n))
        )
    )


def _draw(engine, loop, contexts: dict, **params):
    from omni_runtime.engines.base import EngineInput

    request = EngineInput("r1", {"contexts": contexts}, {"height": 32, "width": 32, "num_inference_steps": 2,
                                                          "seed": 1, **params})  # fmt: skip

    async def run():
        return [out async for out in engine.generate(request)]

    return loop.run_until_complete(run())


@pytest.mark.models
def test_the_dit_stage_draws_from_the_thinkers_payloads(dit_engine, generator, prompt_ids) -> None:
    engine, loop = dit_engine
    primary = generator.prefill(generator.frame_text(prompt_ids))
    empty = generator.prefill(generator.frame_text([]))
    (out,) = _draw(engine, loop, {"primary": _payload(engine, primary), "cfg_text": _payload(engine, empty)})
    assert out.finished and out.data["images"][0][:8] == b"\x89PNG\r\n\x1a\n"
    assert engine.forwards_log[-1] == {"primary": 2, "cfg_text": 2, "cfg_img": 0}
    (unguided,) = _draw(engine, loop, {"primary": _payload(engine, primary)}, cfg_text_scale=1)
    assert engine.forwards_log[-1]["cfg_text"] == 0 and unguided.data["images"] != out.data["images"]


@pytest.mark.models
def test_a_companion_whose_kv_did_not_arrive_fails_the_request_naming_its_role(dit_engine, generator, prompt_ids):
    from omni_runtime.engines.base import EngineError

    engine, loop = dit_engine
    primary = _payload(engine, generator.prefill(generator.frame_text(prompt_ids)))
    with pytest.raises(EngineError, match="context 'cfg_text' is missing"):
        _draw(engine, loop, {"primary": primary})  # the stage's default cfg_text_scale is 4: it needs cfg_text


@pytest.mark.models
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_layers": 28}, "payload from a checkpoint with 28 layers"),
        ({"kv_version": 2}, "version 2), this stage expects"),
        ({"model": "Other/2L/2x32/bfloat16/0123"}, "payload from checkpoint 'Other/2L/2x32/bfloat16/0123'"),
    ],
)
def test_a_payload_from_another_checkpoint_or_version_is_refused_naming_both(
    dit_engine, generator, prompt_ids, change: dict, message: str
) -> None:
    from omni_runtime.engines.base import EngineError

    engine, loop = dit_engine
    context = generator.prefill(generator.frame_text(prompt_ids))
    bad = {**_payload(engine, context), **change}
    with pytest.raises(EngineError, match="role primary") as err:
        _draw(engine, loop, {"primary": bad, "cfg_text": _payload(engine, context)})
    assert message in str(err.value) and "this stage expects" in str(err.value)
    float32 = _payload(engine, context, torch.float32)  # another cache dtype: the header and arrays agree
    with pytest.raises(EngineError, match="float32.*this stage expects .*bfloat16"):
        _draw(engine, loop, {"primary": float32, "cfg_text": _payload(engine, context)})


@pytest.mark.models
def test_the_dit_stage_refuses_what_it_does_not_read(dit_engine, generator, prompt_ids) -> None:
    from omni_runtime.engines.base import InvalidRequest

    engine, loop = dit_engine
    contexts = {"primary": _payload(engine, generator.prefill(generator.frame_text(prompt_ids)))}
    refused = (
        ({"guidance_scale": 2.0}, "guidance_scale"),
        ({"cfg_text_scale": 9}, "cfg_text_scale"),
        ({"height": 40}, "height"),
        ({"num_inference_steps": 500}, "num_inference_steps"),
    )
    for params, field in refused:
        with pytest.raises(InvalidRequest, match=field):
            _draw(engine, loop, contexts, **params)


def _edit(engine, loop, data: dict, **params):
    from omni_runtime.engines.base import EngineInput

    request = EngineInput("e1", data, {"num_inference_steps": 2, "seed": 1, **params})

    async def run():
        return [out async for out in engine.generate(request)]

    return loop.run_until_complete(run())


def _png(picture: np.ndarray) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(picture).save(out, format="PNG")
    return out.getvalue()


@pytest.mark.models
def test_the_dit_stage_edits_a_picture_it_is_sent_with_upstreams_edit_guidance(dit_engine) -> None:
    """An edit (a prompt and a picture, no contexts) is drawn by the dit alone at the picture's BAGEL-resized size,
    over the contexts `edit_contexts` builds (the upstream-anchored path above) with upstream's edit guidance: the
    engine's image equals the generator's for the same seed; the picture, the prompt and cfg_img_scale each change
    it."""
    import io

    from PIL import Image

    from omni_runtime.engines.diffusion.bagel.engine import EDIT_GUIDANCE

    engine, loop = dit_engine
    picture = _png(_edit_picture())
    (out,) = _edit(engine, loop, {"prompt": "make it red", "image": picture})
    drawn = np.asarray(Image.open(io.BytesIO(out.data["images"][0])))
    assert drawn.shape == (96, 128, 3) and (out.data["width"], out.data["height"]) == (128, 96)
    same = engine.generator  # its own dtype (the topology's bfloat16 where the CPU has it): the same numbers
    image = same.prepare_edit(Image.open(io.BytesIO(picture)))
    ids = engine.tokenizer.encode("make it red", add_special_tokens=False)
    with torch.inference_mode():
        local = same.generate(same.edit_contexts(image, ids, 1), 96, 128, 2, 1, BagelGuidance(**EDIT_GUIDANCE))
    assert np.array_equal(local, drawn)
    for change in ({"prompt": "make it blue"}, {"image": _png(255 - _edit_picture())}):
        (other,) = _edit(engine, loop, {"prompt": "make it red", "image": picture, **change})
        assert other.data["images"][0] != out.data["images"][0], change
    assert engine.forwards_log[-1] == {"primary": 2, "cfg_text": 2, "cfg_img": 2}  # interval (0, 1]: every step
    (unguided,) = _edit(engine, loop, {"prompt": "make it red", "image": picture}, cfg_img_scale=1.0)
    assert unguided.data["images"][0] != out.data["images"][0] and engine.forwards_log[-1]["cfg_img"] == 0


@pytest.mark.models
@pytest.mark.parametrize(
    ("data", "params", "message"),
    [
        ({"prompt": "x", "image": b"not a picture"}, {}, "could not be read"),
        ({"prompt": " ", "image": None}, {}, "needs one input image"),
        ({"prompt": "", "image": "png"}, {}, "needs one input image"),
        ({"prompt": "make it red", "image": "PICTURE", "negative_prompt": "blurry"}, {}, "negative_prompt"),
        ({"prompt": "   ", "image": "PICTURE"}, {}, "non-empty prompt"),
    ],
)
def test_an_edit_the_dit_cannot_take_is_refused_naming_why(dit_engine, data, params, message) -> None:
    from omni_runtime.engines.base import InvalidRequest

    engine, loop = dit_engine
    data = {k: (_png(_edit_picture()) if v == "PICTURE" else v) for k, v in data.items()}
    with pytest.raises(InvalidRequest, match=message):
        _edit(engine, loop, data, **params)
