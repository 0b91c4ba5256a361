"""Diffusion stage throughput: requests/s at concurrency C (engine batching on) vs one at a time.

    # CPU, the tiny SD3 model built locally:
    .venv/bin/python bench/diffusion_batching.py --model tiny
    # GPU, a Flux.1-dev-sized transformer with random weights at 512x512 (built on the GPU):
    python3 bench/diffusion_batching.py --model flux-sized --size 512 --steps 8

Both runs go through omnikube's DiffusionEngine (the stage's real batcher: requests arriving within the
gathering window and compatible are run as one pipeline call). Baseline, same run, same engine: the same
requests sent one at a time. Also printed: the raw pipeline with a batch of C prompts vs C single calls,
the upper bound batching can reach. Prints the ratios; the target on an H200 is >= 1.35.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "runtime_image"))

from omni_runtime.engines.base import EngineInput  # noqa: E402
from omni_runtime.engines.diffusion.engine import DiffusionEngine  # noqa: E402
from omni_runtime.spec import Modality, ResolvedPipeline, StageKind, StageSpec  # noqa: E402
from omni_runtime.spec.pipeline import PipelineSpec  # noqa: E402

# FLUX.1-dev's transformer and VAE configurations (public model cards); weights are random.
FLUX_TRANSFORMER = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
FLUX_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=16,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
    sample_size=1024,
)
FLUX_TEXT_TOKENS = 512


class FluxSizedEngine(DiffusionEngine):
    """The real DiffusionEngine with `_load` replaced: a random-weight Flux-sized pipeline built on the
    device, since no weights can be downloaded here and 24 GB would take minutes to write and read."""

    def _load(self, dtype: Any) -> Any:
        import torch
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

        torch.manual_seed(0)
        with torch.device(self.device):
            transformer = FluxTransformer2DModel(**FLUX_TRANSFORMER).to(dtype)
            vae = AutoencoderKL(**FLUX_VAE).to(dtype)
        params = sum(p.numel() for p in transformer.parameters())
        print(f"flux-sized transformer: {params / 1e9:.1f}B parameters ({dtype}) on {self.device}", flush=True)
        scheduler = FlowMatchEulerDiscreteScheduler(
            shift=3.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
        )
        pipe = FluxPipeline(
            scheduler=scheduler,
            vae=vae,
            transformer=transformer,
            text_encoder=None,
            tokenizer=None,
            text_encoder_2=None,
            tokenizer_2=None,
        )
        pipe.set_progress_bar_config(disable=True)
        return pipe


def _resolved(model: str, kind: str, args: argparse.Namespace) -> tuple[ResolvedPipeline, StageSpec]:
    stage = StageSpec(
        name="dit",
        kind=StageKind.DIFFUSION,
        output_modality=Modality.IMAGE,
        final_output=True,
        engine_args={
            "max_batch_size": args.concurrency,
            "batch_window_ms": args.window_ms,
            # a hand-built stage has no topology default; a FLUX stage runs bfloat16 (the flux topology's)
            **({"torch_dtype": "bfloat16"} if kind == "flux-sized" else {}),
        },
    )
    topo = PipelineSpec(name="bench", stages=[stage])
    return ResolvedPipeline(name="bench", model=model, served_model_name="bench", topology=topo), stage


def _requests(kind: str, n: int, args: argparse.Namespace, device: str) -> list[EngineInput]:
    params = {"height": args.size, "width": args.size, "num_inference_steps": args.steps, "seed": 0}
    if kind == "tiny":
        return [
            EngineInput(f"r{i}", {"prompt": f"a small red cube number {i}"}, {**params, "seed": i}) for i in range(n)
        ]
    import torch

    out = []
    for i in range(n):
        g = torch.Generator(device).manual_seed(i)
        embeds = torch.randn(1, FLUX_TEXT_TOKENS, 4096, generator=g, device=device, dtype=torch.bfloat16)
        pooled = torch.randn(1, 768, generator=g, device=device, dtype=torch.bfloat16)
        out.append(
            EngineInput(
                f"r{i}",
                {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled},
                {**params, "seed": i, "guidance_scale": 3.5},
            )
        )
    return out


async def _run(engine: DiffusionEngine, request: EngineInput) -> None:
    async for out in engine.generate(request):
        if out.finished:
            assert out.data.get("images"), "every request returns its image"


async def _sequential(engine: DiffusionEngine, requests: list[EngineInput]) -> float:
    # A lone request should not pay the gathering window in the baseline: that would flatter the ratio.
    window, engine.batch_window = engine.batch_window, 0.0
    try:
        started = time.perf_counter()
        for r in requests:
            await _run(engine, r)
        return len(requests) / (time.perf_counter() - started)
    finally:
        engine.batch_window = window


async def _concurrent(engine: DiffusionEngine, requests: list[EngineInput], concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)

    async def one(r: EngineInput) -> None:
        async with sem:
            await _run(engine, r)

    started = time.perf_counter()
    await asyncio.gather(*(one(r) for r in requests))
    return len(requests) / (time.perf_counter() - started)


def _raw_forward_ratios(engine: DiffusionEngine, requests: list[EngineInput], c: int, repeats: int) -> list[float]:
    """Pipeline alone, to latents: one call with C inputs vs C calls with one, same steps and size;
    `repeats` rounds, each timing both, so drifting clocks hit both alike."""
    import torch

    pipe = engine.pipe
    common = {
        "height": requests[0].params["height"],
        "width": requests[0].params["width"],
        "num_inference_steps": requests[0].params["num_inference_steps"],
        "output_type": "latent",
    }
    batch = requests[:c]

    def inputs(rs: list[EngineInput]) -> dict:
        if "prompt" in rs[0].data:
            return {"prompt": [r.data["prompt"] for r in rs]}
        return {k: torch.cat([r.data[k] for r in rs]) for k in rs[0].data}

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def timed(fn) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    with torch.inference_mode():
        pipe(**inputs(batch), **common)  # warm-up, both shapes
        pipe(**inputs(batch[:1]), **common)
        ratios = []
        for _ in range(repeats):
            single = timed(lambda: [pipe(**inputs([r]), **common) for r in batch])
            batched = timed(lambda: pipe(**inputs(batch), **common))
            ratios.append(single / batched)
    return ratios


async def main_async(args: argparse.Namespace) -> int:
    if args.model == "tiny":
        from omni_runtime.tiny_models import ensure

        model, engine_cls = str(ensure("tiny-sd3")), DiffusionEngine
    else:
        model, engine_cls = "/nonexistent/flux-sized", FluxSizedEngine
    resolved, stage = _resolved(model, args.model, args)
    engine = engine_cls(resolved, stage)
    await engine.start()
    try:
        warm = _requests(args.model, 2, args, engine.device)
        await _sequential(engine, warm)  # compile caches, allocator
        seq, conc = [], []
        for _ in range(args.repeats):
            reqs = _requests(args.model, args.requests, args, engine.device)
            seq.append(await _sequential(engine, reqs))
            conc.append(await _concurrent(engine, reqs, args.concurrency))
        stats = engine.stats()
        raw_requests = _requests(args.model, args.concurrency, args, engine.device)
        raw = _raw_forward_ratios(engine, raw_requests, args.concurrency, args.repeats)
    finally:
        await engine.stop()
    s, c = statistics.median(seq), statistics.median(conc)
    print(
        f"model={args.model} device={engine.device} size={args.size} steps={args.steps} "
        f"requests={args.requests} repeats={args.repeats}"
    )
    ratios = [b / a for a, b in zip(seq, conc, strict=True)]
    print(
        f"one at a time: {s:.3f} req/s (min {min(seq):.3f}, max {max(seq):.3f})   concurrency "
        f"{args.concurrency}: {c:.3f} req/s (min {min(conc):.3f}, max {max(conc):.3f})"
    )
    print(
        f"ratio={c / s:.2f}  (per repeat: {', '.join(f'{r:.2f}' for r in ratios)}; "
        f"last batch: {int(stats.get('last_batch_size', 0))} requests)"
    )
    print(
        f"raw pipeline to latents, batch of {args.concurrency} vs {args.concurrency} single calls: "
        f"{statistics.median(raw):.2f}x median (per repeat: {', '.join(f'{r:.2f}' for r in raw)})"
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", "flux-sized"], default="tiny")
    parser.add_argument("--size", type=int, default=None, help="image side (default: 64 tiny, 512 flux-sized)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: 4 tiny, 8 flux)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--window-ms", type=float, default=10.0)
    args = parser.parse_args()
    args.size = args.size or (64 if args.model == "tiny" else 512)
    args.steps = args.steps or (4 if args.model == "tiny" else 8)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
