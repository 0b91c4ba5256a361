"""Video: the diffusion engine's time per video vs the raw diffusers pipeline call plus MP4 encoding.

    # CPU, the tiny Wan2.2 T2V model built locally (both experts, boundary_ratio):
    .venv/bin/python bench/video.py --frames 17 --size 64 --steps 4 --rounds 8
    # One H200: Wan2.2-T2V-A14B-sized (both 14B experts, Wan2.1 VAE, random weights built on the GPU;
    # the text encoder is a 1-layer UMT5 of width 4096, the tokenizer the tiny model's), 832x480, 33 frames:
    python3 bench/video.py --a14b --frames 33 --width 832 --size 480 --steps 4 --rounds 4
    # the same on a CPU with every model shrunk (checks the code path only):
    .venv/bin/python bench/video.py --a14b --shrink --frames 5 --size 64 --steps 2 --rounds 1

Both sides run in the same process on the same loaded pipeline, alternating in ABBA order so drift
(thermal, other load) falls on both equally. Engine: `DiffusionEngine.generate` (request parsing, the
batcher, the per-step callback that reports progress and can stop the call, the encoder thread pool).
Baseline: `pipe(...)` with the same arguments and seed, then the same `encode_mp4` (H.264) — what a
hand-written script would do. Prints the median seconds of each and their ratio, the median of the
per-round ratios, the ratio of the best (least disturbed) run of each, and the time each side spends around
the pipeline call (measured by timing the call itself), which a loaded machine disturbs least; the
target is <= 1.05: the job machinery costs nothing a user notices. The engine runs the topology's own engine settings.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "runtime_image"))

from omni_runtime.engines.base import EngineInput  # noqa: E402
from omni_runtime.engines.diffusion.engine import DiffusionEngine  # noqa: E402
from omni_runtime.engines.diffusion.video import encode_mp4  # noqa: E402
from omni_runtime.registry import get_pipeline  # noqa: E402
from omni_runtime.spec import StageOverride  # noqa: E402
from omni_runtime.spec.resolved import resolve_pipeline  # noqa: E402
from omni_runtime.tiny_models import ensure  # noqa: E402

# Wan2.2-T2V-A14B's transformer (each expert; Wan-AI/Wan2.2-T2V-A14B-Diffusers transformer/config.json).
A14B = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=40,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=13824,
    num_layers=40,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)
SHRUNK = dict(A14B, num_attention_heads=2, attention_head_dim=64, ffn_dim=256, num_layers=1)


def build_a14b(tiny_folder: str, device: str, dtype: object, shrink: bool) -> object:
    """WanPipeline with two A14B-sized experts, the Wan2.1 VAE (diffusers' defaults) and a 1-layer UMT5 of
    width 4096 (the DiT's text_dim), random weights made on `device` in `dtype`; the tokenizer and the
    scheduler come from the tiny Wan folder (nothing can be downloaded)."""
    import torch
    from diffusers import AutoencoderKLWan, DiffusionPipeline, WanPipeline, WanTransformer3DModel
    from transformers import UMT5EncoderModel

    tiny = DiffusionPipeline.from_pretrained(tiny_folder, local_files_only=True)
    text_cfg = tiny.text_encoder.config
    text_cfg.d_model = A14B["text_dim"]
    dit = SHRUNK if shrink else A14B
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # type: ignore[arg-type]  # no float32 copy of 2 x 14B parameters
    try:
        with torch.device(device):
            experts = [WanTransformer3DModel(**dit).eval() for _ in range(2)]
            vae = AutoencoderKLWan(base_dim=32 if shrink else 96).eval()
            text_encoder = UMT5EncoderModel(text_cfg).eval()
    finally:
        torch.set_default_dtype(default)
    params = sum(p.numel() for e in experts for p in e.parameters())
    print(f"wan-a14b-sized experts: {params / 1e9:.1f}B parameters ({dtype}) on {device}", flush=True)
    pipe = WanPipeline(
        tokenizer=tiny.tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=tiny.scheduler,
        transformer=experts[0],
        transformer_2=experts[1],
        boundary_ratio=0.875,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


class A14BEngine(DiffusionEngine):
    """The real DiffusionEngine whose `_load` builds the A14B-sized pipeline on the device."""

    shrink = False

    def _load(self, dtype: object) -> object:
        return build_a14b(self.model_path, self.device, dtype, self.shrink)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a WanPipeline folder (default: tiny-wan2-2-t2v, built)")
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--size", type=int, default=64, help="height (and width unless --width)")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--a14b", action="store_true", help="Wan2.2-A14B-sized random experts, built on the device")
    parser.add_argument("--shrink", action="store_true", help="with --a14b: every model shrunk (CPU check)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--fps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    import torch

    model = args.model or str(ensure("tiny-wan2-2-t2v"))
    width = args.width or args.size
    call = {"num_inference_steps": args.steps, "height": args.size, "width": width, "num_frames": args.frames}
    engine_args: dict[str, object] = {}  # the topology's defaults, as a user gets them
    if args.a14b:  # bf16 on the GPU; eager, so both sides run the same uncompiled blocks
        # the dtype the raw baseline runs in: both sides of the ratio run the same one
        engine_args = {"torch_dtype": "bfloat16" if args.device != "cpu" else "float32", "enforce_eager": True}
    if args.device:
        engine_args["device"] = args.device
    stage = StageOverride(name="dit", engine_args=engine_args, sampling_params=call)
    pipeline = resolve_pipeline(get_pipeline("wan2-2-t2v"), name="bench", model=model, stages=[stage])
    engine_class = A14BEngine if args.a14b else DiffusionEngine
    A14BEngine.shrink = args.shrink
    engine = engine_class(pipeline, pipeline.topology.stage("dit"))
    started = time.perf_counter()
    await engine.start()
    print(f"engine started in {time.perf_counter() - started:.1f}s on {engine.device}", flush=True)
    pipe = engine.pipe
    # the same call arguments the engine makes: the stage's defaults (topology + overrides, guidance included)
    call = dict(pipeline.topology.stage("dit").sampling_params)
    prompt = "a cat on a skateboard, cinematic"

    # Time inside each pipeline call, so the cost around it (the job machinery vs a plain script) can be read
    # apart from the call itself, whose time swings with other load on a shared machine.
    in_call: list[float] = []
    pipe_class = type(pipe)
    plain_call = pipe_class.__call__

    def timed_call(self: object, *a: object, **k: object) -> object:
        t0 = time.perf_counter()
        try:
            return plain_call(self, *a, **k)
        finally:
            in_call.append(time.perf_counter() - t0)

    pipe_class.__call__ = timed_call

    async def through_engine(i: int) -> float:
        started = time.perf_counter()
        outs = [
            o async for o in engine.generate(EngineInput(f"b{i}", {"prompt": prompt}, {"seed": i, "fps": args.fps}))
        ]
        assert outs[-1].data["video"]
        return time.perf_counter() - started

    def raw(i: int) -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            frames = pipe(
                prompt=[prompt], generator=[torch.Generator("cpu").manual_seed(i)], output_type="np", **call
            ).frames
        assert encode_mp4(frames[0], args.fps)["video"]
        return time.perf_counter() - started

    await through_engine(0)  # warm both paths (allocator, first-call kernels)
    raw(0)
    engine_times: list[float] = []
    raw_times: list[float] = []
    engine_around: list[float] = []  # wall time less the pipeline call: parsing, batcher, hops, encoding
    raw_around: list[float] = []  # the same for the plain script: its encoding
    for r in range(args.rounds):
        order = ("engine", "raw") if r % 2 == 0 else ("raw", "engine")
        for side in order:
            if side == "engine":
                engine_times.append(await through_engine(r + 1))
                engine_around.append(engine_times[-1] - in_call[-1])
            else:
                raw_times.append(await asyncio.to_thread(raw, r + 1))  # a thread, as the engine runs it
                raw_around.append(raw_times[-1] - in_call[-1])
    await engine.stop()
    pipe_class.__call__ = plain_call
    e, b = statistics.median(engine_times), statistics.median(raw_times)
    what = ("wan-a14b-sized" + (" (shrunk)" if args.shrink else "")) if args.a14b else f"model {model}"
    print(f"video {width}x{args.size}, {args.frames} frames, {args.steps} steps, {args.rounds} rounds (ABBA), {what}")
    print(f"  guidance_scale {call.get('guidance_scale')}, device {engine.device}, torch {torch.__version__}")
    print(f"  raw pipeline + encode_mp4: median {b:.3f}s per video")
    print(f"  DiffusionEngine.generate:  median {e:.3f}s per video")
    print(f"  ratio engine/raw: {e / b:.3f} (target <= 1.05)")
    # Each round's two runs sit next to each other in time, so their ratio cancels slow drift in load.
    paired = statistics.median(x / y for x, y in zip(engine_times, raw_times, strict=True))
    print(f"  median of per-round ratios engine/raw: {paired:.3f}")
    extra = statistics.median(engine_around) - statistics.median(raw_around)
    print(
        f"  around the pipeline call: engine median {statistics.median(engine_around) * 1000:.1f} ms, raw "
        f"{statistics.median(raw_around) * 1000:.1f} ms: the machinery adds {extra * 1000:.1f} ms per video = "
        f"ratio {(b + extra) / b:.3f} on the raw median (robust to load on the call itself)"
    )
    best_e, best_b = min(engine_times), min(raw_times)
    print(
        f"  best of each: engine {best_e:.3f}s, raw {best_b:.3f}s, ratio {best_e / best_b:.3f} (least disturbed runs)"
    )
    print(f"  per round, engine: {[round(t, 3) for t in engine_times]}")
    print(f"  per round, raw:    {[round(t, 3) for t in raw_times]}")


if __name__ == "__main__":
    asyncio.run(main())
