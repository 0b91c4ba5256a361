"""GLM-Image staged as AR (transformers, `glm_image_ar`) -> `glm_ar_to_dit` -> DiT (the diffusion engine) draws
the image `GlmImagePipeline` draws as one program, on tiny-glm-image: same prompt, seed, size and steps.

Tolerance: pixel-exact (0 of 255) for t2i: both runs are float32 on the same CPU and the same operations in the
same order. For i2i the one-program reference cannot be the pipeline's own `__call__`: diffusers 0.42.1's
`generate_prior_tokens` concatenates the pictures' feature maps before `get_image_tokens`, which transformers
5.19 iterates per map, so the pipeline fails (a conv sees 1 channel); the reference there is the pipeline's
`__call__` fed the prior tokens computed in the same process the way transformers expects (one map per picture).
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import openai
import pytest
import pytest_asyncio
import torch

from omni_runtime.engines.base import EngineInput
from omni_runtime.engines.factory import make_engine
from omni_runtime.engines.glm_image.ar import GlmImageArEngine, upsample_tokens
from omni_runtime.processors import ProcessorContext, ProcessorError, apply_processor
from omni_runtime.registry import get_pipeline
from omni_runtime.spec import ResolvedPipeline, StageOverride, StageSpec, resolve_pipeline

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.timeout(900)
models = pytest.mark.models

STEPS, SIZE, SEED = 2, 64, 7
PROMPT = 'a red cube with the word "hi"'


def _resolved(model: Path | str, as_is: bool = False) -> ResolvedPipeline:
    stages = [
        StageOverride(name="ar", engine_args={"torch_dtype": "float32"}),
        StageOverride(name="dit", engine_args={"torch_dtype": "float32"}),
    ]
    if as_is:  # the topology's own engine args (bfloat16)
        stages = []
    return resolve_pipeline(get_pipeline("glm-image"), name="g", model=str(model), stages=stages)


def _pixels(image) -> np.ndarray:
    from PIL import Image

    if isinstance(image, bytes | bytearray):
        image = Image.open(io.BytesIO(image))
    return np.asarray(image.convert("RGB")).astype(np.int16)


async def _staged(
    model: Path, params: dict, image: bytes | None = None, as_is: bool = False
) -> tuple[np.ndarray, dict]:
    pipeline = _resolved(model, as_is)
    ar, dit = make_engine(pipeline, "ar"), make_engine(pipeline, "dit")
    await ar.start()
    await dit.start()
    try:
        data = {"prompt": PROMPT, **({"image": image} if image is not None else {})}
        ar_params = {"seed": SEED, "height": SIZE, "width": SIZE}
        (tokens,) = [o async for o in ar.generate(EngineInput("r", data, ar_params))]
        fed = apply_processor("glm_ar_to_dit", pipeline.topology.stage("ar"), {"primary": tokens.data},
                              ProcessorContext("r", target="dit"))  # fmt: skip
        outs = [o async for o in dit.generate(EngineInput("r", dict(fed), {"seed": SEED, **params}))]
        return _pixels(outs[-1].data["images"][0]), tokens.data
    finally:
        await ar.stop()
        await dit.stop()


def _one_program(model: Path, **call) -> np.ndarray:
    from diffusers import GlmImagePipeline

    pipe = GlmImagePipeline.from_pretrained(model, dtype=torch.float32, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    generator = [torch.Generator("cpu").manual_seed(SEED)]
    with torch.inference_mode():
        out = pipe(PROMPT, height=SIZE, width=SIZE, num_inference_steps=STEPS, generator=generator, **call)
    return _pixels(out.images[0])


# --- no model ---------------------------------------------------------------------------------------


def test_upsampling_repeats_each_code_over_a_two_by_two_block_as_the_pipeline_does() -> None:
    from diffusers import GlmImagePipeline

    codes = torch.arange(6)
    ours = upsample_tokens(codes, 2, 3)
    assert ours.tolist() == [[0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 3, 3, 4, 4, 5, 5]]
    assert torch.equal(ours, GlmImagePipeline._upsample_token_ids(codes, 2, 3))


def test_glm_ar_to_dit_gives_the_pipelines_call_shapes_and_refuses_half_an_i2i_payload() -> None:
    upstream = StageSpec(name="ar", kind="generation", engine_args={"runner": "glm_image_ar"})
    payload = {
        "prior_token_ids": torch.zeros(1, 16, dtype=torch.long),
        "prior_token_image_ids": torch.ones(16, dtype=torch.long),
        "source_image_grid_thw": torch.tensor([[1, 4, 4]]),
        "prompt": "p",
        "image": b"png",
        "height": 64,
        "width": 64,
    }
    out = apply_processor("glm_ar_to_dit", upstream, {"primary": payload}, ProcessorContext("r", target="dit"))
    assert out["prior_token_ids"].shape == (1, 16)
    assert [t.tolist() for t in out["source_image_grid_thw"]] == [[[1, 4, 4]]]
    assert len(out["prior_token_image_ids"]) == 1 and out["image"] == b"png" and out["height"] == 64
    with pytest.raises(ProcessorError, match="only one of"):
        apply_processor("glm_ar_to_dit", upstream, {"primary": {**payload, "source_image_grid_thw": None}},
                        ProcessorContext("r", target="dit"))  # fmt: skip


def test_the_glm_image_topology_runs_its_ar_on_the_glm_image_ar_engine() -> None:
    assert type(make_engine(_resolved("/models/none"), "ar")) is GlmImageArEngine


# --- models -----------------------------------------------------------------------------------------


@models
async def test_staged_t2i_equals_the_pipeline_run_as_one_program(tiny_glm_image_model: Path) -> None:
    staged, tokens = await _staged(tiny_glm_image_model, {"num_inference_steps": STEPS, "guidance_scale": 1.5})
    assert tokens["prior_token_ids"].shape == (1, (SIZE // 16) ** 2)
    reference = _one_program(tiny_glm_image_model, guidance_scale=1.5)
    assert np.abs(staged - reference).max() == 0


@models
async def test_guidance_scale_changes_the_staged_image(tiny_glm_image_model: Path) -> None:
    guided, _ = await _staged(tiny_glm_image_model, {"num_inference_steps": STEPS, "guidance_scale": 4.0})
    plain, _ = await _staged(tiny_glm_image_model, {"num_inference_steps": STEPS, "guidance_scale": 1.0})
    assert np.abs(guided - plain).max() > 0


@models
async def test_staged_i2i_equals_the_pipeline_fed_the_same_process_prior_tokens(tiny_glm_image_model: Path) -> None:
    from PIL import Image

    picture = Image.fromarray(np.random.default_rng(0).integers(0, 255, (SIZE, SIZE, 3), dtype=np.uint8))
    buf = io.BytesIO()
    picture.save(buf, format="PNG")
    staged, tokens = await _staged(tiny_glm_image_model, {"num_inference_steps": STEPS}, image=buf.getvalue())
    assert tokens["source_image_grid_thw"].tolist() == [[1, 4, 4]]
    # The reference's prior tokens: the pipeline's AR half in this process, one feature map per picture.
    from diffusers import GlmImagePipeline

    pipe = GlmImagePipeline.from_pretrained(tiny_glm_image_model, dtype=torch.float32, local_files_only=True)
    inputs = pipe.processor.apply_chat_template(
        [[{"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": PROMPT}]}]],
        tokenize=True, target_h=SIZE, target_w=SIZE, return_dict=True, return_tensors="pt",
    )  # fmt: skip
    grids = inputs["image_grid_thw"]
    with torch.inference_mode():
        maps = pipe.vision_language_encoder.get_image_features(inputs["pixel_values"], grids[:-1]).pooler_output
        codes = pipe.vision_language_encoder.get_image_tokens(list(maps), grids[:-1])
        torch.manual_seed(SEED)
        out = pipe.vision_language_encoder.generate(**inputs, max_new_tokens=int(grids[-1].prod()) + 1, do_sample=True)
    h, w = int(grids[-1][1]), int(grids[-1][2])
    prior = GlmImagePipeline._upsample_token_ids(out[0][inputs["input_ids"].shape[-1] :][: h * w], h, w)
    image_ids = GlmImagePipeline._upsample_token_ids(codes.reshape(-1), int(grids[0][1]), int(grids[0][2]))
    reference = _one_program(
        tiny_glm_image_model,
        image=[picture],
        prior_token_ids=prior,
        prior_token_image_ids=[image_ids.reshape(-1)],
        source_image_grid_thw=[torch.tensor([[1, 2 * int(grids[0][1]), 2 * int(grids[0][2])]])],
    )
    assert np.abs(staged - reference).max() == 0


@models
async def test_glm_image_topology_as_is_draws_the_requested_size(tiny_glm_image_model: Path) -> None:
    """Both stages with the topology's engine args (bfloat16; the DiT falls back to float32 on a CPU without it)."""
    image, tokens = await _staged(tiny_glm_image_model, {"num_inference_steps": STEPS}, as_is=True)
    assert image.shape == (SIZE, SIZE, 3)
    assert tokens["prior_token_ids"].shape == (1, (SIZE // 16) ** 2)


# --- served: the router and both stages in this process (servelib.echo_cluster), the `openai` client ---------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def glm_served(tiny_glm_image_model: Path):
    """The topology the folder's model_index.json selects, float32, tiny steps, served in this process: router and
    two stage servers over loopback TCP with the stage protocol (what `omnikube serve` adds is the same for every
    topology and tested by tests/test_serve_t2i.py)."""
    from servelib import echo_cluster

    from omni_runtime.engines.diffusion.engine import DiffusionEngine
    from omni_runtime.registry import resolve_model_pipeline
    from omni_runtime.spec import check_engine_args

    pipeline = resolve_pipeline(
        resolve_model_pipeline(tiny_glm_image_model),
        name=SERVED,
        model=str(tiny_glm_image_model),
        served_model_name=SERVED,
        stages=[
            # The AR decides the grid (and so the size) when the client names none: the default size is its.
            StageOverride(
                name="ar", engine_args={"torch_dtype": "float32"}, sampling_params={"height": SIZE, "width": SIZE}
            ),
            StageOverride(
                name="dit", engine_args={"torch_dtype": "float32"}, sampling_params={"num_inference_steps": STEPS}
            ),
        ],
    )
    check_engine_args(pipeline.topology)
    engines = {"ar": GlmImageArEngine, "dit": DiffusionEngine}
    async with echo_cluster(pipeline, engines=engines, ready_timeout=300) as cluster:
        api = openai.AsyncOpenAI(base_url=f"{cluster.base}/v1", api_key="none", max_retries=0)
        yield cluster, api
        await api.close()


SERVED = "glm-image-e2e"
served = [models, pytest.mark.asyncio(loop_scope="module")]


def _b64_pixels(b64: str) -> np.ndarray:
    import base64

    raw = base64.b64decode(b64)
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    return _pixels(raw)


@pytest.mark.models
@pytest.mark.asyncio(loop_scope="module")
async def test_generations_through_the_router_equal_the_pipeline_run_as_one_program(
    glm_served, tiny_glm_image_model: Path
) -> None:
    cluster, api = glm_served
    assert cluster.pipeline.topology.name == "glm-image"  # chosen by the folder's GlmImagePipeline
    out = await api.images.generate(model=SERVED, prompt=PROMPT, size=f"{SIZE}x{SIZE}", extra_body={"seed": SEED})
    reference = _one_program(tiny_glm_image_model, guidance_scale=1.5)  # the topology's default guidance
    assert np.abs(_b64_pixels(out.data[0].b64_json) - reference).max() == 0
    plain = await api.images.generate(
        model=SERVED, prompt=PROMPT, size=f"{SIZE}x{SIZE}", extra_body={"seed": SEED, "guidance_scale": 1.0}
    )
    assert plain.data[0].b64_json != out.data[0].b64_json  # guidance_scale reaches the DiT
    wide = await api.images.generate(model=SERVED, prompt=PROMPT, size="96x64", extra_body={"seed": SEED})
    assert _b64_pixels(wide.data[0].b64_json).shape == (64, 96, 3)  # the AR sampled the grid the client asked


@pytest.mark.models
@pytest.mark.asyncio(loop_scope="module")
async def test_an_edit_through_the_router_conditions_on_the_input_picture(glm_served) -> None:
    from PIL import Image

    _cluster, api = glm_served
    pictures = []
    for fill in (0, 1):
        picture = Image.fromarray(np.random.default_rng(fill).integers(0, 255, (SIZE, SIZE, 3), dtype=np.uint8))
        buf = io.BytesIO()
        picture.save(buf, format="PNG")
        pictures.append(buf.getvalue())
    edits = [
        await api.images.edit(
            model=SERVED, image=("in.png", raw, "image/png"), prompt=PROMPT, extra_body={"seed": SEED}
        )
        for raw in pictures
    ]
    first, second = (_b64_pixels(e.data[0].b64_json) for e in edits)
    assert first.shape == (SIZE, SIZE, 3)
    assert np.abs(first - second).max() > 0  # the picture reached the AR (its codes) and the DiT
    with pytest.raises(openai.BadRequestError, match="could not be read"):
        await api.images.edit(model=SERVED, image=("in.png", b"not an image", "image/png"), prompt=PROMPT)


@pytest.mark.models
@pytest.mark.asyncio(loop_scope="module")
async def test_an_aborted_ar_request_stops_sampling_and_the_next_one_runs(tiny_glm_image_model: Path) -> None:
    """Abort while the AR samples: its generate ends with finish_reason abort (no payload), and the engine serves
    the next request (the lock released)."""
    import asyncio

    engine = make_engine(_resolved(tiny_glm_image_model), "ar")
    assert isinstance(engine, GlmImageArEngine)
    await engine.start()
    try:
        request = EngineInput("r1", {"prompt": PROMPT}, {"seed": SEED, "height": 1024, "width": 1024})

        async def run(req: EngineInput) -> list:
            return [out async for out in engine.generate(req)]

        task = asyncio.create_task(run(request))
        while "r1" not in engine._running:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        await engine.abort("r1")
        outs = await asyncio.wait_for(task, 120)
        assert [o.finish_reason for o in outs] == ["abort"]
        after = await run(EngineInput("r2", {"prompt": PROMPT}, {"seed": SEED, "height": SIZE, "width": SIZE}))
        assert after[-1].finish_reason == "stop"
    finally:
        await engine.stop()
