"""BAGEL served as two stages by `omnikube serve`: vLLM's thinker hands each context's KV cache to omnikube's
generation expert, in another process, over the edge's connector (shm: the stages are colocated here).

One serve of `tiny-bagel` (the registry's `bagel` topology, every engine arg untouched, so it is also the thinker's
topology-defaults start; only the dit's 50 steps and its size made tiny) for every behaviour a user meets:

- text to image through the `openai` client: size, seed, the CFG companion's KV (cfg_text), guidance at 1 running
  no companion (the thinker gets no work for it), the KV metrics;
- the anchor: the staged image equals one in-process generation by the same engine from a plain-torch prefill
  of the same tokens (the K/V that left vLLM are within bfloat16 of that prefill's, qk-norm and rope included);
- understanding (text, and an image) through /v1/chat/completions: the dit gets no work;
- edits (the dit alone builds their contexts from the picture), think mode (the plan returned);
- what is refused with a 400 naming it: guidance out of bounds, sizes past max_latent_size, what an edit cannot take.

Payload checks (another checkpoint, dtype, version) and a lost companion are the engine's, tested in
tests/test_bagel.py without a thinker; the KV export route itself in tests/test_kv_export.py.
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
from collections.abc import Iterator

import numpy as np
import openai
import pytest
from PIL import Image
from servelib import Serve, metric_values
from test_serve_t2i import serving

pytestmark = [pytest.mark.models, pytest.mark.timeout(900)]

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DIT = {"num_inference_steps": 3, "height": 64, "width": 64}
PROMPT = "a red fox in the snow"


@pytest.fixture(scope="module")
def bagel(tiny_bagel_model, tmp_path_factory) -> Iterator[Serve]:
    spec = {
        "model": str(tiny_bagel_model),
        "name": "bagel-e2e",
        "stages": [
            {"name": "dit", "sampling_params": DIT},  # the thinker exactly as the registry has it
        ],
        "connectors": {"default": "shm"},
    }
    run = Serve(spec, tmp_path_factory.mktemp("serve-bagel"))
    yield from serving(run)


def png(b64: str) -> np.ndarray:
    raw = base64.b64decode(b64)
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    return np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))


def stage_requests(run: Serve, stage: str) -> float:
    return sum(sum(metric_values(text, "omnikube_stage_requests_total")) for text in run.stage_metrics(stage))


def client(run: Serve) -> openai.OpenAI:
    return openai.OpenAI(base_url=run.endpoint, api_key="none", max_retries=0)


def test_bagel_draws_over_the_thinkers_kv_with_its_companion(bagel) -> None:
    api = client(bagel)
    assert bagel.resolved["topology"]["name"] == "bagel"
    thinker_before = stage_requests(bagel, "thinker")
    first = api.images.generate(model=bagel.model, prompt=PROMPT, extra_body={"seed": 3})
    image = png(first.data[0].b64_json)
    assert image.shape == (64, 64, 3)
    assert stage_requests(bagel, "thinker") - thinker_before == 2  # the primary and its cfg_text companion
    again = api.images.generate(model=bagel.model, prompt=PROMPT, extra_body={"seed": 3})
    assert again.data[0].b64_json == first.data[0].b64_json
    other = api.images.generate(model=bagel.model, prompt=PROMPT, extra_body={"seed": 4})
    assert other.data[0].b64_json != first.data[0].b64_json
    wide = api.images.generate(model=bagel.model, prompt=PROMPT, size="96x48", extra_body={"seed": 3})
    assert png(wide.data[0].b64_json).shape == (48, 96, 3)

    before = stage_requests(bagel, "thinker")
    unguided = api.images.generate(model=bagel.model, prompt=PROMPT, extra_body={"seed": 3, "cfg_text_scale": 1})
    assert stage_requests(bagel, "thinker") - before == 1  # guidance 1: no companion ran
    assert unguided.data[0].b64_json != first.data[0].b64_json
    negative = api.images.generate(
        model=bagel.model, prompt=PROMPT, extra_body={"seed": 3, "negative_prompt": "blurry"}
    )
    assert negative.data[0].b64_json != first.data[0].b64_json  # the companion's context is the negative prompt

    (dit_metrics,) = bagel.stage_metrics("dit")
    assert sum(metric_values(dit_metrics, "omnikube_stage_kv_cache_bytes_count", source="thinker")) >= 9
    assert sum(metric_values(dit_metrics, "omnikube_stage_kv_cache_bytes_sum", source="thinker")) > 0
    companions = metric_values(dit_metrics, "omnikube_stage_cfg_companions_sum")
    assert sum(companions) == 5  # every request but the unguided one brought one companion
    assert sum(metric_values(dit_metrics, "omnikube_stage_vae_decode_seconds_count")) >= 6
    assert (
        sum(metric_values(dit_metrics, "omnikube_stage_denoise_step_seconds_count")) >= 6 * DIT["num_inference_steps"]
    )
    bagel.wait_idle(["thinker", "dit"])
    api.close()


def test_the_staged_image_equals_an_in_process_generation(bagel, tiny_bagel_model) -> None:
    """The thinker's KV (vLLM, bfloat16, another process) against a plain-torch prefill of the same framed tokens,
    through the same generator, seed and steps. Measured: the images differ by 0.69 of 255 on average (the
    KV's bfloat16 rounding), while another seed's image differs by 41."""
    import torch
    from transformers import AutoTokenizer

    from omni_runtime.engines.diffusion.bagel import BagelGenerator
    from omni_runtime.spec.guidance import BagelGuidance

    api = client(bagel)
    staged = png(api.images.generate(model=bagel.model, prompt=PROMPT, extra_body={"seed": 5}).data[0].b64_json)
    other = png(api.images.generate(model=bagel.model, prompt=PROMPT, extra_body={"seed": 6}).data[0].b64_json)
    api.close()

    dtype = getattr(torch, bagel.resolved["topology"]["stages"][1]["engine_args"].get("torch_dtype", "float32"))
    generator = BagelGenerator.from_pretrained(tiny_bagel_model, dtype)
    tokenizer = AutoTokenizer.from_pretrained(tiny_bagel_model)
    contexts = {
        "primary": generator.prefill(generator.frame_text(tokenizer.encode(PROMPT, add_special_tokens=False))),
        "cfg_text": generator.prefill(generator.frame_text([])),  # no negative prompt: the empty turn
    }
    defaults = {k: v for k, v in bagel.resolved["topology"]["stages"][1]["sampling_params"].items()
                if k in BagelGuidance.model_fields}  # fmt: skip
    local = generator.generate(contexts, 64, 64, DIT["num_inference_steps"], 5, BagelGuidance(**defaults))
    near = float(np.abs(local.astype(float) - staged.astype(float)).mean())
    far = float(np.abs(other.astype(float) - staged.astype(float)).mean())
    assert near < 3.0 < 10.0 < far, (near, far)


def test_understanding_answers_in_the_thinker_alone(bagel, tiny_bagel_model) -> None:
    api = client(bagel)
    dit_before = stage_requests(bagel, "dit")
    reply = api.chat.completions.create(
        model=bagel.model, messages=[{"role": "user", "content": "what is in a fox's den?"}], max_tokens=5, seed=0
    )
    assert reply.choices[0].message.content and reply.usage.completion_tokens >= 1

    def about(color: tuple[int, int, int]):
        picture = io.BytesIO()
        Image.new("RGB", (80, 60), color).save(picture, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(picture.getvalue()).decode()
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is it?"}]
        return api.chat.completions.create(
            model=bagel.model, messages=[{"role": "user", "content": content}], max_tokens=1, temperature=0,
            logprobs=True, top_logprobs=1,
        )  # fmt: skip

    red, blue = about((220, 30, 30)), about((20, 40, 230))
    assert red.usage.prompt_tokens > 16  # the picture became vit_max_num_patch_per_side**2 = 16 ViT tokens
    # the picture reaches the model through SigLIP: another picture, another next-token distribution
    assert red.choices[0].logprobs.content[0].logprob != blue.choices[0].logprobs.content[0].logprob
    assert stage_requests(bagel, "dit") == dit_before  # understanding sends the dit no work
    drawn = api.chat.completions.create(
        model=bagel.model, messages=[{"role": "user", "content": PROMPT}], seed=3, extra_body={"modalities": ["image"]}
    )
    parts = drawn.choices[0].message.content
    assert isinstance(parts, list) and parts[0]["type"] == "image_url"  # a chat may ask for the image alone
    api.close()


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"cfg_text_scale": 0.5}, "cfg_text_scale"),
        ({"cfg_text_scale": 99}, "cfg_text_scale"),
        ({"cfg_interval": [0.9, 0.1]}, "cfg_interval"),
        ({"cfg_renorm_type": "sideways"}, "cfg_renorm_type"),
        ({"timestep_shift": 0}, "timestep_shift"),
        ({"guidance_scale": 3.0}, "guidance_scale"),  # SD3's guidance: not BAGEL's, refused rather than ignored
    ],
)
def test_guidance_outside_bagels_bounds_is_a_400_naming_it(bagel, extra: dict, field: str) -> None:
    api = client(bagel)
    with pytest.raises(openai.BadRequestError) as err:
        api.images.generate(model=bagel.model, prompt=PROMPT, extra_body=extra)
    assert field in str(err.value)
    api.close()


def test_a_context_too_large_for_either_stage_is_a_400_before_any_work(bagel) -> None:
    """A size past the dit's max_latent_size (which the dit reports to the router once loaded) and a prompt past
    the thinker's max_model_len are refused before the other stage works."""
    api = client(bagel)

    def dit_steps() -> float:
        (text,) = bagel.stage_metrics("dit")
        return sum(metric_values(text, "omnikube_stage_denoise_step_seconds_count"))

    steps = dit_steps()
    side = 16 * 16  # tiny-bagel: max_latent_size 8 latent tokens of 16 px, so a side of at most 128
    with pytest.raises(openai.BadRequestError) as err:
        api.images.generate(model=bagel.model, prompt=PROMPT, size=f"{side}x64", extra_body={"seed": 1})
    assert "size" in str(err.value) and "from 16 to 128" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:  # per stage, too: the same bound
        api.images.generate(
            model=bagel.model, prompt=PROMPT, extra_body={"sampling_params_list": [{}, {"height": side}]}
        )
    assert "from 16 to 128" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        api.images.generate(model=bagel.model, prompt="fox " * 5000, extra_body={"seed": 1})
    assert "maximum" in str(err.value) or "max_model_len" in str(err.value)
    bagel.wait_idle(["thinker", "dit"])
    assert dit_steps() == steps  # the dit drew nothing for any of them
    api.close()


THINK = {"think": True, "sampling_params_list": [{"max_tokens": 12}, {}]}
"""Think mode with the thinker's reasoning made short (its default is upstream's 1000 tokens)."""


def test_think_mode_writes_a_plan_and_draws_in_its_context(bagel, tiny_bagel_model) -> None:
    """`think`: the thinker writes its plan (greedy, after BAGEL's think instruction), returned as revised_prompt,
    and the image is drawn over the context [instruction, prompt, plan] with the companion [instruction, empty
    turn]: it equals an in-process generation over a plain-torch prefill of exactly those segments."""
    import torch
    from transformers import AutoTokenizer

    from omni_runtime.engines.ar.context import BAGEL_THINK_INSTRUCTION
    from omni_runtime.engines.diffusion.bagel import BagelGenerator
    from omni_runtime.spec.guidance import BagelGuidance

    api = client(bagel)
    thinker = stage_requests(bagel, "thinker")
    out = api.images.generate(model=bagel.model, prompt=PROMPT, extra_body={"seed": 5, **THINK})
    assert stage_requests(bagel, "thinker") - thinker == 2  # the primary (plan, then context) and cfg_text
    plan = out.data[0].revised_prompt
    assert plan, "the thinker's plan comes back as revised_prompt"
    again = api.images.generate(model=bagel.model, prompt=PROMPT, extra_body={"seed": 5, **THINK})
    assert again.data[0].revised_prompt == plan and again.data[0].b64_json == out.data[0].b64_json  # greedy
    plain = api.images.generate(model=bagel.model, prompt=PROMPT, extra_body={"seed": 5})
    assert plain.data[0].revised_prompt is None and plain.data[0].b64_json != out.data[0].b64_json
    chat = api.chat.completions.create(
        model=bagel.model, messages=[{"role": "user", "content": PROMPT}], seed=5, max_tokens=12,
        extra_body={"modalities": ["text", "image"]},
    )  # fmt: skip
    parts = chat.choices[0].message.content
    assert [p["type"] for p in parts] == ["text", "image_url"] and parts[0]["text"] == plan
    api.close()

    staged = png(out.data[0].b64_json)
    dtype = getattr(torch, bagel.resolved["topology"]["stages"][1]["engine_args"].get("torch_dtype", "float32"))
    generator = BagelGenerator.from_pretrained(tiny_bagel_model, dtype)
    tokenizer = AutoTokenizer.from_pretrained(tiny_bagel_model)

    def segments(*texts: str) -> list[int]:
        return [t for text in texts for t in generator.frame_text(tokenizer.encode(text, add_special_tokens=False))]

    contexts = {
        "primary": generator.prefill(segments(BAGEL_THINK_INSTRUCTION, PROMPT, plan)),
        "cfg_text": generator.prefill(segments(BAGEL_THINK_INSTRUCTION, "")),
    }
    defaults = {k: v for k, v in bagel.resolved["topology"]["stages"][1]["sampling_params"].items()
                if k in BagelGuidance.model_fields}  # fmt: skip
    local = generator.generate(contexts, 64, 64, DIT["num_inference_steps"], 5, BagelGuidance(**defaults))
    near = float(np.abs(local.astype(float) - staged.astype(float)).mean())
    far = float(np.abs(png(plain.data[0].b64_json).astype(float) - staged.astype(float)).mean())
    assert near < 3.0 < far, (near, far)


def test_a_client_gone_while_the_thinker_plans_aborts_the_plan_and_its_companion(bagel) -> None:
    """Think mode cancelled mid-plan (1000 tokens, far from done): the plan's vLLM request is aborted with its
    primary, the companion's KV is released, and the dit never draws."""
    import asyncio

    import httpx

    def count(stage: str, name: str, **labels: str) -> float:
        return sum(sum(metric_values(text, name, **labels)) for text in bagel.stage_metrics(stage))

    aborted = count("thinker", "omnikube_stage_requests_total", status="aborted")
    steps = count("dit", "omnikube_stage_denoise_step_seconds_count")
    body = {"model": bagel.model, "prompt": PROMPT, "think": True, "sampling_params_list": [{"max_tokens": 1000}]}

    async def main() -> None:
        async with httpx.AsyncClient(base_url=bagel.base, timeout=120) as http:
            call = asyncio.ensure_future(http.post("/v1/images/generations", json=body))
            deadline = asyncio.get_running_loop().time() + 60
            while bagel.running("thinker") == 0:
                assert not call.done() and asyncio.get_running_loop().time() < deadline, "the thinker never ran"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # into the plan
            assert not call.done()
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await call

    asyncio.run(main())
    bagel.wait_idle(["thinker", "dit"])  # every work ended, every KV handle released
    assert count("thinker", "omnikube_stage_requests_total", status="aborted") >= aborted + 1
    assert count("dit", "omnikube_stage_denoise_step_seconds_count") == steps


def test_a_client_gone_mid_drawing_aborts_the_dit_and_leaves_nothing_held(bagel) -> None:
    import asyncio

    import httpx

    def aborted() -> float:
        (text,) = bagel.stage_metrics("dit")
        return sum(metric_values(text, "omnikube_stage_requests_total", status="aborted"))

    before = aborted()
    body = {"model": bagel.model, "prompt": PROMPT, "size": "128x128", "num_inference_steps": 200}

    async def main() -> None:
        async with httpx.AsyncClient(base_url=bagel.base, timeout=120) as http:
            call = asyncio.ensure_future(http.post("/v1/images/generations", json=body))
            deadline = asyncio.get_running_loop().time() + 60
            while bagel.running("dit") == 0:  # the thinker's contexts are in: the dit draws
                assert not call.done() and asyncio.get_running_loop().time() < deadline, "the dit never ran"
                await asyncio.sleep(0.05)
            call.cancel()  # the client goes away mid-drawing
            with contextlib.suppress(asyncio.CancelledError):
                await call

    asyncio.run(main())
    bagel.wait_idle(["thinker", "dit"])  # stopped between two steps, every KV handle released
    assert aborted() == before + 1


def test_an_edit_is_drawn_by_the_dit_alone_at_the_pictures_bagel_size(bagel) -> None:
    """/v1/images/edits through the `openai` client: the dit builds the edit's contexts from the picture itself (the
    thinker gets no work), draws at the picture's size as BAGEL resizes it (70x50 -> 128x96 on tiny-bagel), the seed
    decides the image and the picture changes it; what an edit cannot take is a 400 naming it."""
    api = client(bagel)
    thinker, dit = stage_requests(bagel, "thinker"), stage_requests(bagel, "dit")

    def picture(value: int) -> bytes:
        raw = io.BytesIO()
        pixels = np.random.default_rng(value).integers(0, 256, (50, 70, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(raw, format="PNG")
        return raw.getvalue()

    def edit(image: bytes, **extra):
        return api.images.edit(
            model=bagel.model, image=("in.png", image, "image/png"), prompt="make it red", extra_body=extra
        )

    first = edit(picture(1), seed=3)
    assert png(first.data[0].b64_json).shape == (96, 128, 3)
    assert edit(picture(1), seed=3).data[0].b64_json == first.data[0].b64_json
    assert edit(picture(1), seed=4).data[0].b64_json != first.data[0].b64_json
    assert edit(picture(2), seed=3).data[0].b64_json != first.data[0].b64_json
    assert stage_requests(bagel, "thinker") == thinker  # an edit's context is the dit's own
    assert stage_requests(bagel, "dit") - dit == 4
    with pytest.raises(openai.BadRequestError, match="negative_prompt"):
        edit(picture(1), negative_prompt="blurry")
    with pytest.raises(openai.BadRequestError, match="input picture's size"):
        api.images.edit(model=bagel.model, image=("in.png", picture(1), "image/png"), prompt="x", size="256x256")
    with pytest.raises(openai.BadRequestError, match="think"):
        edit(picture(1), think=True)
    with pytest.raises(openai.BadRequestError, match="could not be read"):
        edit(b"not a picture")
    drawing_chat = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(
        picture(1)).decode()}}, {"type": "text", "text": "make it red"}]  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="/v1/images/edits"):
        api.chat.completions.create(
            model=bagel.model, messages=[{"role": "user", "content": drawing_chat}],
            extra_body={"modalities": ["image"]},
        )  # fmt: skip
    bagel.wait_idle(["thinker", "dit"])
    api.close()


def test_a_dit_killed_mid_drawing_fails_its_request_retriably_and_releases_the_kv(bagel) -> None:
    """Destructive, so last: the dit stage's process SIGKILLed while it draws. The request fails with the router's
    replica-lost error (5xx: a client may retry), the thinker's KV payloads are released (no shm segment stays
    busy), and `omnikube serve` starts the dit again, which then draws the next image."""
    import asyncio
    import signal
    import time

    import httpx
    from servelib import busy_shm_segments

    body = {"model": bagel.model, "prompt": PROMPT, "size": "128x128", "num_inference_steps": 200}

    async def main() -> httpx.Response:
        async with httpx.AsyncClient(base_url=bagel.base, timeout=120) as http:
            call = asyncio.ensure_future(http.post("/v1/images/generations", json=body))
            deadline = asyncio.get_running_loop().time() + 60
            while bagel.running("dit") == 0:
                assert not call.done() and asyncio.get_running_loop().time() < deadline, "the dit never ran"
                await asyncio.sleep(0.05)
            (victim,) = bagel.stage_processes("dit")
            os.killpg(victim["pid"], signal.SIGKILL)
            return await call

    reply = asyncio.run(main())
    assert reply.status_code in (502, 503), reply.text
    assert "retry" in reply.json()["error"]["message"].lower()
    deadline = time.monotonic() + 240
    while sum(metric_values(bagel.router_metrics(), "omnikube_stage_replica_up", stage="dit")) < 1:
        assert time.monotonic() < deadline, bagel.logs_tail()
        time.sleep(1)
    bagel.wait_idle(["thinker"])
    assert busy_shm_segments(bagel.name) == []
    api = client(bagel)
    after = api.images.generate(model=bagel.model, prompt=PROMPT, extra_body={"seed": 3})
    assert png(after.data[0].b64_json).shape == (64, 64, 3)
    api.close()
