"""Video: the diffusion engine's time per video vs the raw diffusers pipeline call plus MP4 encoding.

    # CPU, the tiny Wan2.2 T2V model built locally (both experts, boundary_ratio):
    .venv/bin/python bench/video.py --frames 17 --size 64 --steps 4 --rounds 8

Both sides run in the same process on the same loaded pipeline, alternating in ABBA order so drift
(thermal, other load) falls on both equally. Engine: `DiffusionEngine.generate` (request parsing, the
batcher, the per-step callback that reports progress and can stop the call, the encoder thread pool).
Baseline: `pipe(...)` with the same arguments and seed, then the same `encode_mp4` (H.264) — what a
hand-written script would do. Prints the median seconds of each and their ratio, the median of the
per-round ratios, and the ratio of the best (least disturbed) run of each; the target is <= 1.05: the job
machinery costs nothing a user notices. The engine runs the topology's own engine settings.
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
from omni_runtime.engines.diffusion import DiffusionEngine  # noqa: E402
from omni_runtime.engines.video import encode_mp4  # noqa: E402
from omni_runtime.registry import get_pipeline  # noqa: E402
from omni_runtime.spec import StageOverride  # noqa: E402
from omni_runtime.spec.resolved import resolve_pipeline  # noqa: E402
from omni_runtime.tiny_models import ensure  # noqa: E402


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a WanPipeline folder (default: tiny-wan2-2-t2v, built)")
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--fps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    import torch

    model = args.model or str(ensure("tiny-wan2-2-t2v"))
    call = {"num_inference_steps": args.steps, "height": args.size, "width": args.size, "num_frames": args.frames}
    stage = StageOverride(name="dit", sampling_params=call)
    pipeline = resolve_pipeline(get_pipeline("wan2-2-t2v"), name="bench", model=model, stages=[stage])
    engine = DiffusionEngine(pipeline, pipeline.topology.stage("dit"))
    await engine.start()
    pipe = engine.pipe
    # the same call arguments the engine makes: the stage's defaults (topology + overrides, guidance included)
    call = dict(pipeline.topology.stage("dit").sampling_params)
    prompt = "a cat on a skateboard, cinematic"

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
    for r in range(args.rounds):
        order = ("engine", "raw") if r % 2 == 0 else ("raw", "engine")
        for side in order:
            if side == "engine":
                engine_times.append(await through_engine(r + 1))
            else:
                raw_times.append(await asyncio.to_thread(raw, r + 1))  # a thread, as the engine runs it
    await engine.stop()
    e, b = statistics.median(engine_times), statistics.median(raw_times)
    print(f"video {args.size}x{args.size}, {args.frames} frames, {args.steps} steps, {args.rounds} rounds (ABBA)")
    print(f"  raw pipeline + encode_mp4: median {b:.3f}s per video")
    print(f"  DiffusionEngine.generate:  median {e:.3f}s per video")
    print(f"  ratio engine/raw: {e / b:.3f} (target <= 1.05)")
    # Each round's two runs sit next to each other in time, so their ratio cancels slow drift in load.
    paired = statistics.median(x / y for x, y in zip(engine_times, raw_times, strict=True))
    print(f"  median of per-round ratios engine/raw: {paired:.3f}")
    best_e, best_b = min(engine_times), min(raw_times)
    print(
        f"  best of each: engine {best_e:.3f}s, raw {best_b:.3f}s, ratio {best_e / best_b:.3f} (least disturbed runs)"
    )
    print(f"  per round, engine: {[round(t, 3) for t in engine_times]}")
    print(f"  per round, raw:    {[round(t, 3) for t in raw_times]}")


if __name__ == "__main__":
    asyncio.run(main())
