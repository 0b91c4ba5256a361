"""BAGEL-7B-sized dit on one GPU: seconds per 1024x1024 image and the KV hand-off's share of it.

    python3 bench/ar_dit_gpu.py [--steps 50] [--size 1024] [--prompt-tokens 64] [--images 2]

Random weights of BAGEL-7B-MoT's shape (28 layers, hidden 3584, 28 heads, 4 KV heads, both experts, bfloat16) are
built on the GPU in memory (no checkpoint: writing 28 GB first would cost more than the run), and a random FLUX
AE. The thinker is not run: the device has no CUDA vLLM (its torch is not the one vLLM pins, and no wheel of it
can be carried within the transfer limit). Its output is what this measures the hand-off of: the KV caches of
the prompt (`--prompt-tokens`) and of the cfg_text companion (an empty turn), as the thinker sends them
(bfloat16 on the host, `processors.kv_cache` payloads).

Per image, the same path as the dit stage: hand-off = the thinker's D2H of its caches + the shm connector's put
(producer) and get (consumer, a view) + the payload check + H2D; then 50 flow steps with text guidance (two
forwards per step in the cfg interval, one outside) and the VAE decode. Printed: s/image, the hand-off in ms
and its share (target: <= 2 %, the reference system's HunyuanImage-3 figure). Mooncake is not measured here:
its transfer engine needs libibverbs, which the device image lacks.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from omni_runtime.connectors.shm import ShmConnector
from omni_runtime.engines.diffusion.bagel.context import KvContext
from omni_runtime.engines.diffusion.bagel.generate import BagelGenerator
from omni_runtime.engines.diffusion.bagel.vae import SCALE_FACTOR, SHIFT_FACTOR, BagelVae
from omni_runtime.engines.diffusion.bagel.weights import (
    AttentionWeights,
    BagelConfig,
    BagelWeights,
    ExpertWeights,
    LayerWeights,
    SpecialTokens,
)
from omni_runtime.processors.kv_cache import make_kv_payload
from omni_runtime.spec.guidance import BagelGuidance

CONFIG = BagelConfig(
    hidden_size=3584,
    num_layers=28,
    num_heads=28,
    num_kv_heads=4,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    qk_norm=True,
    latent_channels=16,
    vae_downsample=8,
    latent_patch_size=2,
    max_latent_size=64,
)
INTERMEDIATE = 18944
VOCAB = 152064


def _rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 0.02


def _expert() -> ExpertWeights:
    h, kv = CONFIG.hidden_size, CONFIG.num_kv_heads * CONFIG.head_dim
    ones = torch.ones(CONFIG.head_dim, device="cuda", dtype=torch.bfloat16)
    return ExpertWeights(
        input_norm=torch.ones(h, device="cuda", dtype=torch.bfloat16),
        attention=AttentionWeights(
            q_weight=_rand(h, h),
            q_bias=_rand(h),
            k_weight=_rand(kv, h),
            k_bias=_rand(kv),
            v_weight=_rand(kv, h),
            v_bias=_rand(kv),
            o_weight=_rand(h, h),
            q_norm=ones,
            k_norm=ones.clone(),
        ),  # fmt: skip
        post_attention_norm=torch.ones(h, device="cuda", dtype=torch.bfloat16),
        gate_proj=_rand(INTERMEDIATE, h),
        up_proj=_rand(INTERMEDIATE, h),
        down_proj=_rand(h, INTERMEDIATE),
    )


def random_generator() -> BagelGenerator:
    """BAGEL-7B-MoT's generation path with random weights, bfloat16 on the GPU, and a random FLUX AE."""
    from diffusers import AutoencoderKL

    h = CONFIG.hidden_size
    weights = BagelWeights(
        config=CONFIG,
        tokens=SpecialTokens(bos=151644, eos=151645, vision_start=151652, vision_end=151653),
        embed_tokens=_rand(VOCAB, h),
        layers=tuple(LayerWeights(und=_expert(), gen=_expert()) for _ in range(CONFIG.num_layers)),
        norm_und=torch.ones(h, device="cuda", dtype=torch.bfloat16),
        norm_gen=torch.ones(h, device="cuda", dtype=torch.bfloat16),
        time_mlp=(_rand(h, 256), _rand(h), _rand(h, h), _rand(h)),
        vae2llm=(_rand(h, CONFIG.patch_latent_dim), _rand(h)),
        llm2vae=(_rand(CONFIG.patch_latent_dim, h), _rand(CONFIG.patch_latent_dim)),
        latent_pos_embed=_rand(CONFIG.max_latent_size**2, h),
    )
    ae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[128, 256, 512, 512],
        down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4, layers_per_block=2,
        norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False, scaling_factor=SCALE_FACTOR,
        shift_factor=SHIFT_FACTOR,
    )  # fmt: skip
    return BagelGenerator(weights, BagelVae(ae.to("cuda", torch.bfloat16).eval(), CONFIG.latent_patch_size))


async def hand_off(shm: ShmConnector, thinker_kv: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, KvContext]:
    """The thinker's caches (on its GPU) to the dit's contexts (on its GPU), as the stages move them."""
    contexts = {}
    for role, (keys, values) in thinker_kv.items():
        n = keys.shape[0]
        payload = make_kv_payload(keys.cpu(), values.cpu(), model="bench", positions=list(range(n)))
        handle = await shm.put("thinker", "dit", role, dict(payload))
        got = await shm.get(handle)
        contexts[role] = KvContext(
            keys=torch.as_tensor(got["keys"]).to("cuda", non_blocking=True),
            values=torch.as_tensor(got["values"]).to("cuda", non_blocking=True),
            next_position=int(got["next_position"]),
        )
        await shm.release(handle)
    torch.cuda.synchronize()
    return contexts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--images", type=int, default=2)
    args = parser.parse_args()
    started = time.monotonic()
    generator = random_generator()
    print(
        f"# {torch.cuda.get_device_name()}: random BAGEL-7B-MoT generation path built in "
        f"{time.monotonic() - started:.0f} s"
    )
    shape = (CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim)
    thinker_kv = {
        "primary": (_rand(args.prompt_tokens, *shape), _rand(args.prompt_tokens, *shape)),
        "cfg_text": (_rand(2, *shape), _rand(2, *shape)),
    }
    kv_bytes = sum(k.numel() * 2 * 2 for k, _ in thinker_kv.values())
    guidance = BagelGuidance(cfg_text_scale=4.0)
    rows = []
    shm = ShmConnector(pipeline="bench", owner="thinker").__enter__()
    for i in range(args.images + 1):  # the first is a warm-up
        torch.cuda.synchronize()
        t0 = time.monotonic()
        contexts = asyncio.run(hand_off(shm, thinker_kv))
        t1 = time.monotonic()
        with torch.inference_mode():
            result = generator.denoise(contexts, args.size, args.size, args.steps, i, guidance)
            generator.vae.decode(result.latents, *generator.grid(args.size, args.size))
        torch.cuda.synchronize()
        t2 = time.monotonic()
        if i:
            rows.append((t1 - t0, t2 - t0))
    shm.__exit__(None, None, None)
    handoff = statistics.median(r[0] for r in rows)
    e2e = statistics.median(r[1] for r in rows)
    print(
        f"bagel-7b dit {args.size}x{args.size} {args.steps} steps cfg_text: {e2e:.2f} s/image, KV "
        f"{kv_bytes / 1e6:.1f} MB ({args.prompt_tokens}+2 tokens), hand-off over shm {handoff * 1e3:.2f} ms = "
        f"{100 * handoff / e2e:.3f} % of E2E"
    )


if __name__ == "__main__":
    main()
