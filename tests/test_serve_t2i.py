"""`omnikube serve` of image pipelines on the tiny models, through the real OpenAI client.

- `tiny-sd3` alone (one diffusion stage, the topology's engine args untouched): text-to-image, sizes,
  seeds, `n`; a stage whose self-check fails never becomes ready.
- `tiny-flux`, `tiny-qwen-image` (their topologies' engine args untouched): text-to-image at the requested size.
- `tiny-qwen-image-edit` (QwenImageEditPipeline): `/v1/images/edits`.
- `tiny-sd3-img2img` (one diffusion stage that takes an image): `/v1/images/edits`.
- `prompt-enhanced-t2i` (enhancer AR stage with a CFG negative companion -> SD3 stage), once per
  connector of its edge (`inline`, `mooncake` p2p): the enhancer's text reaches the diffusion stage
  with the companion's, cancellation releases everything, and a mixed load with cancellations leaves nothing held.
  The other two kinds are covered elsewhere, so they cost no third and fourth enhancer load here: `shm`
  cross-process by tests/test_connectors.py::test_shm_between_two_processes, served (talker -> code2wav, with
  a disconnect mid-audio) by tests/test_serve_speech.py and between colocated pods by
  e2e/test_connectors_cluster.py; mooncake `store` cross-process by
  tests/test_connectors.py::test_mooncake_store_between_two_processes (its cancelled puts by
  `::test_mooncake_store_cancelled_put_leaves_nothing` and `::test_mooncake_store_leaves_nothing_after_churn`)
  and between real pods by e2e/test_connectors_cluster.py.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import yaml
from PIL import Image
from servelib import (
    REPO,
    Serve,
    assert_nothing_held,
    http_get,
    metric_values,
    pid_alive,
    process_tree,
    shm_segments,
)

pytestmark = [pytest.mark.models, pytest.mark.timeout(900)]

AR_ARGS = {"max_model_len": 2048, "kv_cache_memory_bytes": 64 * 1024**2, "seed": 0}
"""The enhancer's max_model_len is the tiny model's position limit: room for LONG_ENHANCE tokens."""
LONG_ENHANCE = 1800
"""Tokens of an enhancement the test cancels once it sees it running. With 230 the whole request was once
over (200 OK) before the test's poll saw the enhancer run it, on a moment of the machine running fast."""
DIT_PARAMS = {"num_inference_steps": 2, "height": 64, "width": 64}


def stopped_cleanly(run: Serve, tree: set[int]) -> None:
    code = run.stop()
    assert code == 0, run.log.read_text()[-3000:]
    assert [pid for pid in tree if pid_alive(pid)] == [], "processes left behind after serve stopped"
    assert shm_segments(run.name) == []


def all_pids(run: Serve) -> set[int]:
    tree = set()
    for p in run.processes():
        for pid in [p.get("pid"), *(p.get("pids") or [])]:
            if pid:
                tree |= process_tree(pid)
    return tree


def serving(run: Serve) -> Iterator[Serve]:
    """A fixture's body: yield the running `serve`, then check it stops leaving nothing behind."""
    tree: set[int] = set()
    try:
        yield run
        tree = all_pids(run)
    finally:
        stopped_cleanly(run, tree)


def png(b64: str) -> Image.Image:
    raw = base64.b64decode(b64)
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    return Image.open(io.BytesIO(raw))


def differ(a: str, b: str) -> float:
    """Mean absolute difference of two PNGs' pixels (0..255)."""
    x, y = (png(i).convert("RGB").tobytes() for i in (a, b))
    return sum(abs(p - q) for p, q in zip(x, y, strict=True)) / len(x)


# -- one diffusion stage -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sd3(tiny_sd3_model, tmp_path_factory):
    spec = {  # the topology's engine args as they are (bfloat16): the stage picks what this CPU runs
        "model": str(tiny_sd3_model),
        "name": "sd3-e2e",
        "stages": [{"name": "dit", "sampling_params": DIT_PARAMS}],
    }
    yield from serving(Serve(spec, tmp_path_factory.mktemp("serve-sd3")))


def test_text_to_image_honours_size_seed_and_n(sd3) -> None:
    api = openai.OpenAI(base_url=sd3.endpoint, api_key="none", max_retries=0)
    first = api.images.generate(model="sd3-e2e", prompt="a red apple", size="96x48", extra_body={"seed": 11})
    image = png(first.data[0].b64_json)
    assert image.size == (96, 48) and image.format == "PNG"
    again = api.images.generate(model="sd3-e2e", prompt="a red apple", size="96x48", extra_body={"seed": 11})
    assert again.data[0].b64_json == first.data[0].b64_json
    other = api.images.generate(model="sd3-e2e", prompt="a red apple", size="96x48", extra_body={"seed": 12})
    assert other.data[0].b64_json != first.data[0].b64_json
    two = api.images.generate(model="sd3-e2e", prompt="a red apple", size="96x48", n=2, extra_body={"seed": 11})
    assert len(two.data) == 2
    # image i uses seed + i: batched with another image, the same picture up to bfloat16's rounding
    # (measured: ~0.1 of 255 apart, while another seed's picture is ~30 apart)
    assert (
        differ(two.data[0].b64_json, first.data[0].b64_json)
        < 2
        < 8
        < differ(other.data[0].b64_json, first.data[0].b64_json)
    )
    assert differ(two.data[1].b64_json, other.data[0].b64_json) < 2
    default = api.images.generate(model="sd3-e2e", prompt="a red apple")
    assert png(default.data[0].b64_json).size == (64, 64)  # the stage's sampling_params
    metrics = sd3.router_metrics()
    assert sum(metric_values(metrics, "omnikube_time_to_first_packet_seconds_count", modality="image")) >= 4
    assert sum(metric_values(metrics, "omnikube_e2e_request_latency_seconds_count")) >= 5
    api.close()


def test_image_errors_say_what_is_allowed(sd3) -> None:
    api = openai.OpenAI(base_url=sd3.endpoint, api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        api.images.generate(model="sd3-e2e", prompt="x", size="100x64")
    assert "needs a positive multiple of 16" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        api.images.generate(model="sd3-e2e", prompt="x", size="big")
    assert "WIDTHxHEIGHT" in err.value.body["message"] and err.value.body["param"] == "size"
    with pytest.raises(openai.BadRequestError) as err:
        api.chat.completions.create(model="sd3-e2e", messages=[{"role": "user", "content": "x"}], modalities=["text"])
    assert "it can produce ['image']" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        api.images.edit(model="sd3-e2e", image=("a.png", b"\x89PNG"), prompt="x")
    assert "takes no image input" in err.value.body["message"]
    api.close()


def test_a_stage_that_would_fail_every_request_never_becomes_ready(tiny_sd3_model, tmp_path) -> None:
    """The stage's self-check (one tiny denoising step before it reports ready) fails, and `omnikube serve`
    exits saying what to change, instead of serving 500s. `max_pixels: 1` is a valid engine arg (so the
    launcher's check passes) that refuses every image, the self-check's smallest one included."""
    spec = {
        "model": str(tiny_sd3_model),
        "name": "never-ready",
        "stages": [{"name": "dit", "engine_args": {"max_pixels": 1}}],
    }
    with pytest.raises(RuntimeError) as err:
        Serve(spec, tmp_path, ready_timeout=300)
    text = str(err.value)
    assert "self-check" in text and "every request would fail" in text
    assert "allows at most 1 (max_pixels)" in text and "engine_args or sampling_params" in text


def test_ctrl_c_while_the_stages_load_stops_everything_and_exits_0(tiny_sd3_model, tmp_path) -> None:
    """Ctrl-C (SIGINT) as soon as the stage processes exist, long before they are ready: `omnikube serve`
    stops them in order and exits 0, leaving no process behind. The launcher's signal handler only sets a
    flag; it once raised from wherever the main thread was, and a signal landing in an import (numpy's, while
    a dead stage was swept) made the orderly stop fail with exit 1."""
    spec = {"model": str(tiny_sd3_model), "name": "stopped-early", "stages": [{"name": "dit"}]}
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(spec))
    run_dir, log = tmp_path / "run", tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "omni_runtime.cli", "serve", str(tmp_path / "pipeline.yaml"), "--run-dir",
             str(run_dir)], stdout=out, stderr=subprocess.STDOUT, cwd=REPO)  # fmt: skip
        try:
            deadline = time.monotonic() + 120  # a hang guard, not a timing assertion
            while not (run_dir / "processes.json").exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            pids = [p["pid"] for p in json.loads((run_dir / "processes.json").read_text())]
            assert "OpenAI endpoint" not in log.read_text()  # still loading
            proc.send_signal(signal.SIGINT)
            code = proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "omnikube serve: stopping" in text and "omnikube serve: stopped" in text
    assert [pid for pid in pids if pid_alive(pid)] == [], "processes left behind after serve stopped"


@pytest.fixture(scope="module")
def flux(tiny_flux_model, tmp_path_factory):
    spec = {  # the flux topology's engine args untouched; only its 1024x1024, 28 steps made tiny
        "model": str(tiny_flux_model),
        "name": "flux-e2e",
        "stages": [{"name": "dit", "sampling_params": DIT_PARAMS}],
    }
    yield from serving(Serve(spec, tmp_path_factory.mktemp("serve-flux")))


def test_flux_draws_the_requested_size(flux) -> None:
    assert flux.resolved["topology"]["name"] == "flux"  # chosen by the folder's FluxPipeline
    api = openai.OpenAI(base_url=flux.endpoint, api_key="none", max_retries=0)
    out = api.images.generate(model="flux-e2e", prompt="a red apple", size="80x48", n=2, extra_body={"seed": 3})
    assert [png(d.b64_json).size for d in out.data] == [(80, 48), (80, 48)]
    default = api.images.generate(model="flux-e2e", prompt="a red apple")
    assert png(default.data[0].b64_json).size == (64, 64)
    api.close()


@pytest.fixture(scope="module")
def qwen_image(tiny_qwen_image_model, tmp_path_factory):
    spec = {  # the qwen-image topology's engine args untouched; only its 1024x1024, 50 steps made tiny
        "model": str(tiny_qwen_image_model),
        "name": "qwen-image-e2e",
        "stages": [{"name": "dit", "sampling_params": DIT_PARAMS}],
    }
    yield from serving(Serve(spec, tmp_path_factory.mktemp("serve-qwen-image")))


def test_qwen_image_draws_the_requested_size(qwen_image) -> None:
    assert qwen_image.resolved["topology"]["name"] == "qwen-image"
    api = openai.OpenAI(base_url=qwen_image.endpoint, api_key="none", max_retries=0)
    out = api.images.generate(
        model="qwen-image-e2e", prompt="a red apple", size="80x48", n=2, extra_body={"negative_prompt": "blurry"}
    )
    assert [png(d.b64_json).size for d in out.data] == [(80, 48), (80, 48)]
    api.close()


# -- image to image: /v1/images/edits --------------------------------------------------------------


def png_file(color: str, size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def img2img(tiny_sd3_img2img_model, tmp_path_factory):
    spec = {  # the registry pipeline comes from the folder's model_index.json: stable-diffusion-3-img2img
        "model": str(tiny_sd3_img2img_model),
        "name": "edit-e2e",
        "stages": [{"name": "dit", "sampling_params": {"num_inference_steps": 3}}],
    }
    yield from serving(Serve(spec, tmp_path_factory.mktemp("serve-img2img")))


def test_image_edit_takes_the_uploaded_image(img2img) -> None:
    api = openai.OpenAI(base_url=img2img.endpoint, api_key="none", max_retries=0)
    red, blue = png_file("red", (96, 48)), png_file("blue", (96, 48))
    first = api.images.edit(model="edit-e2e", image=("red.png", red), prompt="a boat", extra_body={"seed": 5})
    out = png(first.data[0].b64_json)
    assert out.size == (96, 48)  # the input image's size unless the request names one
    again = api.images.edit(model="edit-e2e", image=("red.png", red), prompt="a boat", extra_body={"seed": 5})
    assert again.data[0].b64_json == first.data[0].b64_json
    other = api.images.edit(model="edit-e2e", image=("blue.png", blue), prompt="a boat", extra_body={"seed": 5})
    assert other.data[0].b64_json != first.data[0].b64_json  # the picture itself went into the pipeline
    sized = api.images.edit(model="edit-e2e", image=("red.png", red), prompt="a boat", size="64x64", n=2)
    assert [png(d.b64_json).size for d in sized.data] == [(64, 64), (64, 64)]
    api.close()


def test_image_edit_errors_say_what_to_change(img2img) -> None:
    api = openai.OpenAI(base_url=img2img.endpoint, api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        api.images.edit(model="edit-e2e", image=("x.png", b"not an image"), prompt="a boat")
    assert "could not be read" in err.value.body["message"] and "PNG, JPEG or WebP" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:  # an edit pipeline needs its image
        api.images.generate(model="edit-e2e", prompt="a boat")
    assert "got none" in err.value.body["message"] and "/v1/images/edits" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        api.images.edit(model="edit-e2e", image=("red.png", png_file("red", (64, 64))), prompt="x", size="100x64")
    assert "needs a positive multiple of 16" in err.value.body["message"]
    red = png_file("red", (64, 64))
    with pytest.raises(openai.BadRequestError) as err:  # inpainting is not served: never silently ignored
        api.images.edit(model="edit-e2e", image=("red.png", red), mask=("m.png", red), prompt="a boat")
    assert err.value.body["param"] == "mask" and "masks are not served" in err.value.body["message"]
    api.close()


@pytest.fixture(scope="module")
def qwen_edit(tiny_qwen_image_edit_model, tmp_path_factory):
    spec = {  # the qwen-image-edit topology's engine args untouched
        "model": str(tiny_qwen_image_edit_model),
        "name": "qwen-edit-e2e",
        "stages": [{"name": "dit", "sampling_params": {"num_inference_steps": 2}}],
    }
    yield from serving(Serve(spec, tmp_path_factory.mktemp("serve-qwen-edit")))


def test_qwen_image_edit_takes_the_uploaded_image(qwen_edit) -> None:
    assert qwen_edit.resolved["topology"]["name"] == "qwen-image-edit"
    api = openai.OpenAI(base_url=qwen_edit.endpoint, api_key="none", max_retries=0)
    red = png_file("red", (80, 48))
    out = api.images.edit(model="qwen-edit-e2e", image=("red.png", red), prompt="a boat", extra_body={"seed": 5})
    assert png(out.data[0].b64_json).size == (80, 48)  # the input image's size unless the request names one
    sized = api.images.edit(model="qwen-edit-e2e", image=("red.png", red), prompt="a boat", size="64x64")
    assert png(sized.data[0].b64_json).size == (64, 64)
    with pytest.raises(openai.BadRequestError) as err:
        api.images.generate(model="qwen-edit-e2e", prompt="a boat")
    assert "/v1/images/edits" in err.value.body["message"]
    api.close()


# -- prompt enhancer + CFG companion -> diffusion, per connector ----------------------------------


@pytest.fixture(scope="module", params=["inline", "mooncake"])
def t2i(request, tiny_t2i_model, tmp_path_factory):
    connector = request.param
    spec = {
        "model": str(tiny_t2i_model),
        "name": f"t2i-{connector}",
        "stages": [
            {"name": "enhancer", "engine_args": AR_ARGS, "sampling_params": {"max_tokens": 12, "ignore_eos": True}},
            {"name": "dit", "sampling_params": DIT_PARAMS},
        ],
        "connectors": {
            "default": "inline",
            "edges": [{"from": "enhancer", "to": "dit", "connector": connector}],
            "mooncake": {
                "global_segment_size": 64 * 1024**2,
                "local_buffer_size": 16 * 1024**2,
                "mode": "p2p",
            },
        },
        "limits": {"max_concurrent_requests": 16, "max_queued_requests": 64, "request_timeout_s": 120},
    }
    run = Serve(spec, tmp_path_factory.mktemp(f"serve-t2i-{connector}"))
    run.connector = connector
    run.pooled = connector == "mooncake"  # p2p: the producer lends blocks out and counts them
    yield from serving(run)


def test_enhanced_prompt_and_cfg_companion_reach_the_diffusion_stage(t2i) -> None:
    api = openai.OpenAI(base_url=t2i.endpoint, api_key="none", max_retries=0)
    model = t2i.model
    prompt = "a lighthouse at sunset"
    first = api.images.generate(model=model, prompt=prompt, size="64x48", extra_body={"seed": 3})
    item = first.data[0]
    assert png(item.b64_json).size == (64, 48)
    # the diffusion stage received the enhancer's text, not the user's prompt, and the companion's text
    assert item.revised_prompt and item.revised_prompt != prompt
    default_negative = item.model_extra["revised_negative_prompt"]
    assert default_negative and default_negative != item.revised_prompt

    again = api.images.generate(model=model, prompt=prompt, size="64x48", extra_body={"seed": 3})
    assert again.data[0].b64_json == item.b64_json  # seeded: same enhancement, same image

    negative = api.images.generate(
        model=model, prompt=prompt, size="64x48", extra_body={"seed": 3, "negative_prompt": "green grass, rain"}
    )
    assert negative.data[0].revised_prompt == item.revised_prompt
    assert negative.data[0].model_extra["revised_negative_prompt"] != default_negative
    assert negative.data[0].b64_json != item.b64_json  # only the CFG negative changed

    chat = api.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], seed=3)
    parts = chat.choices[0].message.content
    assert isinstance(parts, list) and parts[0]["type"] == "image_url"
    url = parts[0]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    assert png(url.split(",", 1)[1]).size == (64, 64)
    assert_nothing_held(t2i, ["enhancer", "dit"], master_keys=True, idle_timeout=30, timeout=10)
    if t2i.pooled:  # the producer reports what it lent out, so "nothing held" above means something
        series = [
            metric_values(text, "omnikube_connector_payloads_unreleased") for text in t2i.stage_metrics("enhancer")
        ]
        assert any(series), "the enhancer reports no omnikube_connector_payloads_unreleased"
    api.close()


async def cancel_while_running(t2i: Serve, http: httpx.AsyncClient, body: dict, stage: str) -> None:
    """Send an image request and drop the connection once `stage` works on it."""
    task = asyncio.create_task(http.post("/v1/images/generations", json=body, timeout=60))
    deadline = time.monotonic() + 30
    while t2i.running(stage) < 1:
        assert time.monotonic() < deadline and not task.done(), f"{stage} never ran the request"
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def aborted(t2i: Serve, stage: str) -> float:
    return sum(sum(metric_values(text, "omnikube_stage_requests_total", status="aborted"))
               for text in t2i.stage_metrics(stage))  # fmt: skip


async def test_cancelled_requests_release_everything(t2i) -> None:
    model = t2i.model
    async with httpx.AsyncClient(base_url=t2i.base, trust_env=False) as http:
        # cancelled while the enhancer (primary and companion) generates
        long_enhance = {"model": model, "prompt": "a cat", "sampling_params_list": [{"max_tokens": LONG_ENHANCE}, {}]}
        await cancel_while_running(t2i, http, long_enhance, "enhancer")
        assert_nothing_held(t2i, ["enhancer", "dit"], master_keys=True, idle_timeout=30, timeout=10)
        assert aborted(t2i, "enhancer") >= 1
        # cancelled while the diffusion stage runs on the enhancer's handles
        long_draw = {"model": model, "prompt": "a cat", "size": "256x256", "num_inference_steps": 60}
        await cancel_while_running(t2i, http, long_draw, "dit")
    assert_nothing_held(t2i, ["enhancer", "dit"], master_keys=True, idle_timeout=30, timeout=10)
    assert aborted(t2i, "dit") >= 1


MIXED_REQUESTS = 100
"""Requests of the mixed load, per connector: 40 cancelled (20 dropped mid-image, 20 mid-stream) among 60
that run to their end, 8 at a time. The race it guards against (an Abort read right behind its Submit
left a work whose cleanup never ran: 6 payloads held after 200 requests on shm) was in the stage server,
which every connector shares, so the two connectors' runs give that path the 200 requests it had when
only shm ran it; each connector's own release path gets 40 cancellations."""


def stage_states(run: Serve) -> str:
    """What each stage replica runs and waits for (its /readyz) and its engine queue: a request that timed
    out under load sits in an engine queue; one lost in the protocol does not."""
    out = []
    for stage in ("enhancer", "dit"):
        for p in run.stage_processes(stage):
            status, text = http_get(p["probe"].replace("/readyz", "/metrics"))
            queue = sum(metric_values(text, "omnikube_stage_engine_queue_depth")) if status == 200 else None
            out.append(f"{p['name']}: {http_get(p['probe'])[1]} engine queue {queue}")
    return "\n".join(out)


async def test_mixed_load_with_cancellations_leaves_nothing_held(t2i) -> None:
    """Images, chats and streams, some dropped by their client mid-request, 8 at a time: afterwards no
    stage runs a work or holds a handle, no producer counts a payload unreleased and no Mooncake key is
    left."""
    model = t2i.model
    kinds = ["image", "chat", "stream", "cancel", "cancel_stream"] * (MIXED_REQUESTS // 5)
    random.Random(7).shuffle(kinds)
    outcomes: dict[str, int] = {}
    limit = asyncio.Semaphore(8)

    async def one(i: int, kind: str, http: httpx.AsyncClient) -> None:
        async with limit:
            try:
                if kind in ("image", "cancel"):
                    body = {"model": model, "prompt": f"picture {i}", "seed": i}
                    if kind == "cancel":
                        body["sampling_params_list"] = [{"max_tokens": 120}, {}]
                    r = await http.post("/v1/images/generations", json=body, timeout=0.3 if kind == "cancel" else 120)
                    assert r.status_code == 200, f"{r.status_code} {r.text}\n{stage_states(t2i)}"
                elif kind == "chat":
                    body = {"model": model, "messages": [{"role": "user", "content": f"p {i}"}]}
                    r = await http.post("/v1/chat/completions", json=body, timeout=120)
                    assert r.status_code == 200, f"{r.status_code} {r.text}\n{stage_states(t2i)}"
                else:
                    body = {"model": model, "messages": [{"role": "user", "content": f"s {i}"}], "stream": True}
                    async with http.stream("POST", "/v1/chat/completions", json=body, timeout=120) as r:
                        assert r.status_code == 200
                        async for line in r.aiter_lines():
                            if kind == "cancel_stream":
                                break
                            assert '"error"' not in line, f"{line}\n{stage_states(t2i)}"
                outcomes[kind] = outcomes.get(kind, 0) + 1
            except httpx.TimeoutException as err:
                # only the intended cancels (dropped by their 0.3 s client timeout) may time out: any other
                # request that runs past its 120 s was lost in the protocol, the bug class this test is for
                if kind != "cancel":
                    raise AssertionError(
                        f"a {kind!r} request (#{i}) timed out: lost in the protocol?\n{stage_states(t2i)}"
                    ) from err
                outcomes["cancel timed out"] = outcomes.get("cancel timed out", 0) + 1

    async with httpx.AsyncClient(base_url=t2i.base, trust_env=False) as http:
        await asyncio.gather(*(one(i, kind, http) for i, kind in enumerate(kinds)))
    assert sum(outcomes.values()) == MIXED_REQUESTS and outcomes.get("image", 0) > 0, outcomes
    assert_nothing_held(t2i, ["enhancer", "dit"], master_keys=True, idle_timeout=30, timeout=10)
