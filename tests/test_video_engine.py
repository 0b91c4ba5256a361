"""The diffusion engine on the tiny Wan2.2 pipelines (both experts, `boundary_ratio`), loaded from their
real folder layout: MP4 output at the requested frame count and fps, progress per denoising step, the
frame-count checks, image-to-video, and an abort that stops the pipeline between two steps."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import av
import pytest
import pytest_asyncio
from PIL import Image

from omni_runtime.engines.base import EngineInput, EngineOutput, InvalidRequest
from omni_runtime.engines.diffusion.engine import DiffusionEngine
from omni_runtime.engines.diffusion.video import encode_mp4
from omni_runtime.registry import get_pipeline
from omni_runtime.spec import StageOverride
from omni_runtime.spec.resolved import resolve_pipeline

pytestmark = [pytest.mark.models, pytest.mark.timeout(600), pytest.mark.asyncio(loop_scope="module")]

PARAMS = {"num_inference_steps": 2, "height": 64, "width": 64, "num_frames": 5}


async def _engine(topology: str, model: Path) -> DiffusionEngine:
    stage = StageOverride(name="dit", sampling_params=PARAMS)  # the topology's engine args: its defaults serve
    pipeline = resolve_pipeline(get_pipeline(topology), name="t", model=str(model), stages=[stage])
    engine = DiffusionEngine(pipeline, pipeline.topology.stage("dit"))
    await engine.start()
    return engine


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def t2v(tiny_wan_t2v_model: Path):
    engine = await _engine("wan2-2-t2v", tiny_wan_t2v_model)
    yield engine
    await engine.stop()


async def _collect(engine: DiffusionEngine, request: EngineInput) -> list[EngineOutput]:
    return [out async for out in engine.generate(request)]


def decoded(mp4: bytes) -> tuple[int, float, tuple[int, int], str]:
    """(frames, fps, (width, height), codec) of an MP4, read back by FFmpeg."""
    with av.open(io.BytesIO(mp4)) as container:
        stream = container.streams.video[0]
        frames = list(container.decode(video=0))
        return len(frames), float(stream.average_rate), (frames[0].width, frames[0].height), stream.codec_context.name


async def test_t2v_gives_an_h264_mp4_with_progress(t2v: DiffusionEngine) -> None:
    pipe = t2v.pipe
    assert type(pipe).__name__ == "WanPipeline" and pipe.transformer_2 is not None
    assert pipe.config.boundary_ratio == 0.875 and t2v.video
    outs = await _collect(t2v, EngineInput("v1", {"prompt": "a cat"}, {"fps": 8, "num_frames": 9, "seed": 1}))
    assert [o.data["progress"] for o in outs[:-1]] == [{"steps_done": 1, "steps": 2}, {"steps_done": 2, "steps": 2}]
    final = outs[-1]
    assert final.finished and final.data["format"] == "mp4" and final.data["num_frames"] == 9
    assert decoded(final.data["video"]) == (9, 8.0, (64, 64), "h264")
    wide = await _collect(t2v, EngineInput("v2", {"prompt": "a cat"}, {"width": 96, "height": 32, "seed": 1}))
    assert decoded(wide[-1].data["video"]) == (5, 16.0, (96, 32), "h264")  # default fps: Wan's 16
    # seconds x fps is rounded to a frame count the VAE makes (a multiple of 4, plus the first frame)
    timed = await _collect(t2v, EngineInput("v3", {"prompt": "a cat"}, {"seconds": 1.4, "fps": 5}))
    assert decoded(timed[-1].data["video"])[:2] == (9, 5.0)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"num_frames": 6}, "num_frames 6 is not allowed: stage 'dit' needs num_frames - 1 to be a multiple of 4"),
        ({"num_frames": 1000}, "num_frames 1000 is out of range: stage 'dit' makes 1 to 241 frames (max_frames)"),
        ({"fps": 0}, "fps 0 is out of range"),
        ({"fps": 2.5}, "fps must be an integer"),
    ],
)
async def test_frame_and_fps_checks(t2v: DiffusionEngine, params: dict, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message.replace("(", r"\(").replace(")", r"\)")):
        await _collect(t2v, EngineInput("bad", {"prompt": "a cat"}, params))


async def test_abort_stops_the_pipeline_between_steps(t2v: DiffusionEngine) -> None:
    request = EngineInput("long", {"prompt": "a cat"}, {"num_inference_steps": 200, "seed": 3})
    outs: list[EngineOutput] = []

    async def run() -> None:
        async for out in t2v.generate(request):
            outs.append(out)

    task = asyncio.create_task(run())
    while not outs:  # the first step is done: the call runs
        await asyncio.sleep(0.05)
    await t2v.abort("long")
    await asyncio.wait_for(task, 120)
    assert outs[-1].finish_reason == "abort" and outs[-2].data["progress"]["steps_done"] < 200
    assert t2v.stats()["running_batch"] == 0
    # the engine serves on
    assert (await _collect(t2v, EngineInput("after", {"prompt": "a dog"}, {"seed": 1})))[-1].data["video"]


async def test_i2v_takes_the_first_frame(tiny_wan_i2v_model: Path) -> None:
    engine = await _engine("wan2-2-i2v", tiny_wan_i2v_model)
    try:
        assert type(engine.pipe).__name__ == "WanImageToVideoPipeline" and engine.pipe.config.boundary_ratio == 0.9
        buf = io.BytesIO()
        Image.new("RGB", (64, 48), "red").save(buf, format="PNG")
        outs = await _collect(engine, EngineInput("i1", {"prompt": "a red ball", "image": buf.getvalue()}, {}))
        assert decoded(outs[-1].data["video"]) == (5, 16.0, (64, 64), "h264")
        with pytest.raises(InvalidRequest, match="got none"):
            await _collect(engine, EngineInput("i2", {"prompt": "a red ball"}, {}))
    finally:
        await engine.stop()


async def test_odd_sides_are_cropped_to_even() -> None:
    import numpy as np

    out = encode_mp4(np.zeros((3, 33, 47, 3), dtype=np.float32), 24)
    assert decoded(out["video"]) == (3, 24.0, (46, 32), "h264")
