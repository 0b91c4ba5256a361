"""Sequence parallelism of a diffusion stage (engine arg `sequence_parallel`), on the CPU: two ranks (the engine's
process and one worker process, gloo) give the image one process gives, on the real tiny Flux folder through
the real engine (self-check, text prompts, PNG); settings that cannot run are refused before anything loads,
and a denoiser diffusers cannot split is refused from its folder before any worker starts. The GPU figures
(NCCL, two H200s) are in bench/results-h200-diffusion-speed.txt."""

from __future__ import annotations

import io
import multiprocessing
from pathlib import Path

import numpy as np
import pytest

from omni_runtime.engines.base import EngineError, EngineInput
from omni_runtime.engines.diffusion import DiffusionEngine
from omni_runtime.registry import get_pipeline
from omni_runtime.spec import StageOverride
from omni_runtime.spec.resolved import resolve_pipeline

PARAMS = {"num_inference_steps": 3, "height": 64, "width": 64, "guidance_scale": 3.5}


def _engine(topology: str, model: Path | str, **engine_args: object) -> DiffusionEngine:
    stage = StageOverride(name="dit", engine_args={"torch_dtype": "float32", **engine_args}, sampling_params=PARAMS)
    pipeline = resolve_pipeline(get_pipeline(topology), name="t", model=str(model), stages=[stage])
    return DiffusionEngine(pipeline, pipeline.topology.stage("dit"))


async def _image(engine: DiffusionEngine) -> bytes:
    async for out in engine.generate(EngineInput("r", {"prompt": "a red cube"}, {"seed": 5})):
        if out.finished:
            return out.data["images"][0]
    raise AssertionError("no final output")


def _psnr(a: bytes, b: bytes) -> float:
    from PIL import Image

    x, y = (np.asarray(Image.open(io.BytesIO(v)), dtype=np.float64) for v in (a, b))
    mse = float(((x - y) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


@pytest.mark.models
@pytest.mark.timeout(600)
@pytest.mark.asyncio
async def test_two_cpu_ranks_give_the_image_of_one_process(tiny_flux_model: Path) -> None:
    one = _engine("flux", tiny_flux_model, sequence_parallel=1)
    await one.start()
    try:
        want = await _image(one)
    finally:
        await one.stop()
    two = _engine("flux", tiny_flux_model, sequence_parallel=2)
    await two.start()
    try:
        assert two.sequence_parallel == 2
        workers = [p for p in multiprocessing.active_children() if p.name == "omnikube-dit-rank1"]
        assert len(workers) == 1 and workers[0].is_alive()
        got = await _image(two)
        assert await _image(two) == got  # the next call runs on both ranks again
    finally:
        await two.stop()
    assert not workers[0].is_alive()
    # Ulysses only reorders the attention's work: measured 6.7e-8 latents relative error on this model.
    assert _psnr(got, want) >= 45.0


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"sequence_parallel": 0}, "sequence_parallel=0 is not allowed; use auto or a number of ranks"),
        ({"sequence_parallel": "two"}, "sequence_parallel='two' is not allowed"),
        ({"sequence_parallel": 2, "step_cache_threshold": 0.1}, r"step_cache\) and sequence_parallel=2"),
        (
            {"sequence_parallel": 2, "step_cache": {"policy": "taylorseer"}},
            r"a step cache \(step_cache_threshold or step_cache\) and sequence_parallel=2",
        ),
        ({"sequence_parallel": 2, "device": "cuda:1"}, "one rank per GPU from cuda:0.*'cuda:1'"),
        ({"sequence_parallel": 4, "device": "cuda"}, "sequence_parallel=4 needs 4 GPUs and this pod sees"),
    ],
)
async def test_settings_that_cannot_run_are_refused_before_loading(args: dict, message: str) -> None:
    engine = _engine("flux", "/nonexistent/model", **args)
    with pytest.raises(EngineError, match=message):
        await engine.start()
    assert engine.pipe is None and not [p for p in multiprocessing.active_children() if "rank" in p.name]


@pytest.mark.models
@pytest.mark.timeout(600)
@pytest.mark.asyncio
async def test_a_denoiser_without_a_parallel_plan_is_refused_before_any_rank_starts(tiny_sd3_model: Path) -> None:
    engine = _engine("stable-diffusion-3", tiny_sd3_model, sequence_parallel=2)
    with pytest.raises(EngineError, match="SD3Transformer2DModel has no diffusers context-parallel plan.*: 1"):
        await engine.start()
    assert engine.pipe is None
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("omnikube-dit-rank")]
