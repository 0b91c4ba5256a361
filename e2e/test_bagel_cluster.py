"""BAGEL in the cluster: tiny-bagel applied as an OmniPipeline (`kubectl apply`), thinker and dit each in its own
pod, the thinker's KV caches (the prompt's and its cfg_text companion's) crossing to the dit's pod over Mooncake
p2p, answered through the router pod with the official `openai` client.

One pipeline for the module's cases: text to image (the seed decides the image, the companion's KV came too, the
image equals one in-process generation over a plain-torch prefill of the same tokens, nothing stays held in the
connector), understanding (the thinker answers alone: the dit's pod gets no work), an edit (the router sends
it to the dit's pod alone, which builds the edit's contexts from the picture), and last, the dit's pod killed
mid-drawing (a retriable error, the KV held in the thinker's pod released, the next image drawn by the new pod).

Real: the control plane, Helm, the operator holding only the chart ServiceAccount's token, the pod runner running
router, stages and the Mooncake master as processes in their own network namespaces, vLLM for the thinker,
omnikube's BAGEL generation engine for the dit, the real Mooncake transfer engines and the real `openai` client.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from clusterlib import apply
from PIL import Image
from pipelinelib import PipelineEnv
from podrunner.node import ON_RUNNER

from omni_runtime.tiny_models import default_cache_dir, ensure

pytestmark = [pytest.mark.cluster, pytest.mark.models]

NAME = "bagel"
THINKER_ARGS = {"max_model_len": 512, "kv_cache_memory_bytes": 64 * 1024**2}
DIT = {"num_inference_steps": 3, "height": 64, "width": 64}
PROMPT = "a red fox in the snow"
LONG_DRAWING = 5000
PIPELINE = {
    "apiVersion": "omnikube.io/v1alpha1",
    "kind": "OmniPipeline",
    "metadata": {"name": NAME},
    "spec": {
        "model": "tiny-bagel",
        "pipeline": "bagel",
        "servedModelName": NAME,
        "runtime": {
            "modelCache": {"hostPath": {"path": str(default_cache_dir())}, "mountPath": "/models", "readOnly": True}
        },
        "router": {**ON_RUNNER, "limits": {"requestTimeoutSeconds": 300}},
        "connectors": {
            "default": "mooncake",
            "mooncake": {"mode": "p2p", "globalSegmentSize": "64Mi", "localBufferSize": "16Mi"},
        },
        "stages": [
            {
                **ON_RUNNER,
                "name": "thinker",
                "engineArgs": {"max_model_len": 512, "kv_cache_memory_bytes": 64 * 1024**2},
            },
            # a long drawing to kill the dit's pod in (the engine's default bound is 200 steps)
            {**ON_RUNNER, "name": "dit", "engineArgs": {"max_inference_steps": LONG_DRAWING}, "samplingParams": DIT},
        ],
    },
}


@pytest.fixture(scope="module")
def env(cluster, podrunner, shared_release) -> Iterator[PipelineEnv]:
    ensure("tiny-bagel")
    with shared_release.module("bg") as (release, operator):
        e = PipelineEnv(cluster, podrunner, release, operator, NAME)
        apply(cluster, e.ns, PIPELINE)
        e.wait_ready()
        yield e


def png(b64: str | None) -> np.ndarray:
    raw = base64.b64decode(b64 or "")
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    return np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))


def requests_of(env: PipelineEnv, stage: str) -> float:
    return env.stage_metric("omnikube_stage_requests_total", stage=stage)


def in_process_image(seed: int) -> np.ndarray:
    """The image one BagelGenerator in this process draws for PROMPT over a plain-torch prefill of the tokens the
    thinker frames (its cfg_text companion: the empty turn), at the registry's guidance and dtype."""
    import torch
    from transformers import AutoTokenizer

    from omni_runtime.engines.diffusion.bagel import BagelGenerator
    from omni_runtime.registry import get_pipeline
    from omni_runtime.spec.guidance import BagelGuidance

    dit = get_pipeline("bagel").stages[1]
    path = ensure("tiny-bagel")
    generator = BagelGenerator.from_pretrained(path, getattr(torch, dit.engine_args["torch_dtype"]))
    tokens = AutoTokenizer.from_pretrained(path).encode(PROMPT, add_special_tokens=False)
    contexts = {
        "primary": generator.prefill(generator.frame_text(tokens)),
        "cfg_text": generator.prefill(generator.frame_text([])),
    }
    guidance = BagelGuidance(**{k: v for k, v in dit.sampling_params.items() if k in BagelGuidance.model_fields})
    return generator.generate(contexts, DIT["height"], DIT["width"], DIT["num_inference_steps"], seed, guidance)


def test_the_stages_run_in_pods_of_their_own(env: PipelineEnv) -> None:
    stages = {p["metadata"]["labels"]["omnikube.io/stage"]: p for p in env.pods("stage")}
    assert set(stages) == {"thinker", "dit"}
    assert stages["thinker"]["status"]["podIP"] != stages["dit"]["status"]["podIP"]
    status = env.pipeline()["status"]
    assert "mooncake" in str(status["topology"]["edges"]), status
    assert len(status["contract"]) == 16, status  # the pipeline contract's digest
    for name, pod in stages.items():  # each stage's pods carry their part of it
        assert len(pod["metadata"]["labels"][f"contract.omnikube.io/{name}"]) == 16


def test_an_image_is_drawn_over_kv_that_crossed_pods(env: PipelineEnv) -> None:
    """Each guided image: two thinker requests (the primary and its cfg_text companion), two KV caches that reach
    the dit's pod over Mooncake, and nothing left held once it is drawn; the image is the in-process one (within
    the KV's bfloat16 rounding: 0.7 of 255 on average, where another seed's differs by ~40)."""
    thinker, kv = requests_of(env, "thinker"), env.stage_metric("omnikube_stage_kv_cache_bytes_count", source="thinker")
    moved = env.stage_metric("omnikube_edge_bytes_total", stage="thinker", target="dit", connector="mooncake")
    with env.client() as api:
        raw = api.images.with_raw_response.generate(model=NAME, prompt=PROMPT, extra_body={"seed": 3})
        first = png(raw.parse().data[0].b64_json)
        again = png(api.images.generate(model=NAME, prompt=PROMPT, extra_body={"seed": 3}).data[0].b64_json)
        other = png(api.images.generate(model=NAME, prompt=PROMPT, extra_body={"seed": 4}).data[0].b64_json)
    assert first.shape == (64, 64, 3)
    assert set(json.loads(raw.headers["x-omnikube-contract"])) == {"thinker", "dit"}  # one generation's digests
    assert np.array_equal(first, again) and not np.array_equal(first, other)
    assert requests_of(env, "thinker") - thinker == 6
    assert env.stage_metric("omnikube_stage_kv_cache_bytes_count", source="thinker") - kv == 6
    assert env.stage_metric("omnikube_edge_bytes_total", stage="thinker", target="dit", connector="mooncake") > moved
    env.wait_payloads_released()

    near = float(np.abs(in_process_image(3).astype(float) - first.astype(float)).mean())
    far = float(np.abs(other.astype(float) - first.astype(float)).mean())
    assert near < 3.0 < 10.0 < far, (near, far)


def test_understanding_is_answered_by_the_thinker_alone(env: PipelineEnv) -> None:
    dit = requests_of(env, "dit")
    picture = io.BytesIO()
    Image.new("RGB", (80, 60), (220, 30, 30)).save(picture, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(picture.getvalue()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is it?"}]
    with env.client() as api:
        reply = api.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": content}], max_tokens=4, seed=0
        )
    assert reply.choices[0].message.content and reply.usage.prompt_tokens > 16  # the picture's ViT tokens came
    assert requests_of(env, "dit") == dit


def test_an_edit_goes_to_the_dits_pod_alone(env: PipelineEnv) -> None:
    thinker, dit = requests_of(env, "thinker"), requests_of(env, "dit")
    raw = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (50, 70, 3), dtype=np.uint8)).save(raw, format="PNG")
    with env.client() as api:
        edited = api.images.edit(
            model=NAME, image=("in.png", raw.getvalue(), "image/png"), prompt="make it red", extra_body={"seed": 3}
        )
    assert png(edited.data[0].b64_json).shape == (96, 128, 3)  # 70x50 as BAGEL resizes it on tiny-bagel
    assert (requests_of(env, "thinker"), requests_of(env, "dit") - dit) == (thinker, 1)


def test_a_dit_pod_killed_mid_drawing_fails_retriably_and_releases_the_kv(env: PipelineEnv) -> None:
    """Destructive, so last: the dit's pod force-deleted while it draws. The request fails with the router's
    replica-lost error (5xx: a client may retry) instead of hanging, the thinker's pod releases the KV caches it
    holds for the dead reader (Mooncake p2p blocks), and once the Deployment's new dit pod is Ready it draws."""
    victim = env.stage_pod("dit")["metadata"]["name"]
    body = {"model": NAME, "prompt": PROMPT, "size": "128x128", "num_inference_steps": LONG_DRAWING}

    held: list[float] = []

    async def kill_while_drawing() -> httpx.Response:
        async with httpx.AsyncClient(base_url=env.base, timeout=300, trust_env=False) as http:
            call = asyncio.ensure_future(http.post("/v1/images/generations", json=body))
            deadline = time.monotonic() + 120
            while not await asyncio.to_thread(env.stage_metric, "omnikube_stage_requests_running", stage="dit"):
                assert not call.done() and time.monotonic() < deadline, "the dit never drew"
                await asyncio.sleep(0.1)
            held.append(env.stage_metric("omnikube_connector_payloads_unreleased", stage="thinker"))
            env.cluster.kubectl("delete", "pod", victim, "-n", env.ns, "--grace-period=0", "--force", "--wait=false")
            return await call

    reply = asyncio.run(kill_while_drawing())
    assert reply.status_code in (502, 503), reply.text[:500]
    assert "retry" in reply.json()["error"]["message"].lower(), reply.text[:500]
    assert held == [2]  # the primary's and the companion's KV, held while the dit drew
    env.wait_payloads_released()
    env.wait_ready(since={victim})
    assert env.stage_pod("dit")["metadata"]["name"] != victim
    with env.client() as api:
        after = api.images.generate(model=NAME, prompt=PROMPT, extra_body={"seed": 3})
    assert png(after.data[0].b64_json).shape == (64, 64, 3)
    env.wait_payloads_released()
