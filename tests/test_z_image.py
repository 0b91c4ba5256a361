"""Z-Image-Turbo (the `z-image` topology) on `tiny-z-image`, through `/v1/images/generations`.

The router app and a stage server running the real diffusion engine serve it in this process
(servelib.echo_cluster), router and stage talking over loopback TCP with the stage protocol, the topology's
engine args untouched. Not a `serve` of its own: what `omnikube serve` adds (its launcher, one process per
component) is the same for every topology and tested by tests/test_serve_t2i.py, and what such a serve costs is
mostly its stage process importing torch, transformers and diffusers (~20 s of this machine's time). Here, in
the `served` lane, the modules before this one have imported them already, so this module costs the model's
load, its self-check and the requests (~4 s).
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import openai
import pytest
import pytest_asyncio
from PIL import Image
from servelib import echo_cluster

pytestmark = [pytest.mark.models, pytest.mark.timeout(600), pytest.mark.asyncio(loop_scope="module")]

MODEL = "z-image-e2e"
TINY = {"num_inference_steps": 2, "height": 64, "width": 64}
"""The request defaults made tiny (the topology's are 1024x1024, 8 steps); its guidance_scale 0 stays."""


def png_size(b64: str) -> tuple[int, int]:
    raw = base64.b64decode(b64)
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    return Image.open(io.BytesIO(raw)).size


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def z_image(tiny_z_image_model: Path):
    """The topology the folder's model_index.json selects (as `omnikube serve <folder>` selects it), resolved with
    only its sampling_params made tiny and checked as the launcher checks it, served in this process."""
    from omni_runtime.engines.diffusion.engine import DiffusionEngine
    from omni_runtime.registry import resolve_model_pipeline
    from omni_runtime.spec import StageOverride, check_engine_args, resolve_pipeline

    pipeline = resolve_pipeline(
        resolve_model_pipeline(tiny_z_image_model),
        name=MODEL,
        model=str(tiny_z_image_model),
        served_model_name=MODEL,
        stages=[StageOverride(name="dit", sampling_params=TINY)],
    )
    check_engine_args(pipeline.topology)
    async with echo_cluster(pipeline, engines={"dit": DiffusionEngine}, ready_timeout=300) as cluster:
        api = openai.AsyncOpenAI(base_url=f"{cluster.base}/v1", api_key="none", max_retries=0)
        yield cluster, api
        await api.close()


async def test_z_image_draws_the_requested_size_and_its_seed_decides_it(z_image) -> None:
    cluster, api = z_image
    topology = cluster.pipeline.topology
    assert topology.name == "z-image"  # chosen by the folder's ZImagePipeline
    assert topology.stage("dit").engine_args == {"torch_dtype": "bfloat16"}  # the topology's own
    assert topology.stage("dit").sampling_params["guidance_scale"] == 0.0  # Turbo's: no CFG pass
    first = await api.images.generate(model=MODEL, prompt="a red apple", size="80x48", extra_body={"seed": 7})
    assert png_size(first.data[0].b64_json) == (80, 48)
    again = await api.images.generate(model=MODEL, prompt="a red apple", size="80x48", extra_body={"seed": 7})
    assert again.data[0].b64_json == first.data[0].b64_json
    other = await api.images.generate(model=MODEL, prompt="a red apple", size="80x48", extra_body={"seed": 8})
    assert other.data[0].b64_json != first.data[0].b64_json
    default = await api.images.generate(model=MODEL, prompt="a red apple")
    assert png_size(default.data[0].b64_json) == (64, 64)  # the stage's sampling_params


async def test_z_image_refuses_what_its_pipeline_cannot_take(z_image) -> None:
    _cluster, api = z_image
    with pytest.raises(openai.BadRequestError) as err:  # Qwen-Image's CFG knob: ZImagePipeline has none
        await api.images.generate(
            model=MODEL, prompt="a red apple", extra_body={"sampling_params_list": [{"true_cfg_scale": 4.0}]}
        )
    message = err.value.body["message"]
    assert "'true_cfg_scale'" in message and "not supported by stage 'dit'" in message and "guidance_scale" in message
    with pytest.raises(openai.BadRequestError) as err:  # 2x2 latent patches: multiples of 16, not the VAE's 8
        await api.images.generate(model=MODEL, prompt="a red apple", size="72x40")
    assert "needs a positive multiple of 16" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:  # BAGEL's think mode: no thinker draws this image
        await api.images.generate(model=MODEL, prompt="a red apple", extra_body={"think": True})
    assert err.value.body["param"] == "think" and "no think mode" in err.value.body["message"]
