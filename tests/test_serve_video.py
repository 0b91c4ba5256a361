"""`omnikube serve` of the tiny Wan2.2 pipelines, through the real OpenAI client (`client.videos.*`) and
httpx where it has no call (`/v1/videos/sync`, fields beyond OpenAI's).

- `tiny-wan2-2-t2v`: create -> poll -> content is an H.264 MP4 with the requested frame count and fps;
  sync; list; delete of a running job aborts its stage work; the limits of `router.limits.videos`
  (frames, size, steps, jobs per replica) and unknown fields are 400s / 429 naming them; a job whose
  stage dies fails with the reason.
- `tiny-wan2-2-i2v`: the first frame sent as a multipart `input_reference`.
"""

from __future__ import annotations

import io
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import av
import httpx
import openai
import pytest
from PIL import Image
from servelib import Serve, metric_values
from test_serve_t2i import serving

pytestmark = [
    pytest.mark.models,
    pytest.mark.timeout(900),
    pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning"),  # the client warns; the API is ours
]

DIT = {"num_inference_steps": 2, "height": 64, "width": 64, "num_frames": 5}
VIDEO_LIMITS = {"max_frames": 33, "max_pixels": 96 * 96, "max_inference_steps": 200, "max_concurrent_jobs": 1,
                "max_queued_jobs": 1}  # fmt: skip


def spec(model: Any, pipeline: str, name: str) -> dict[str, Any]:
    return {
        "model": str(model),
        "pipeline": pipeline,
        "name": name,
        "stages": [{"name": "dit", "sampling_params": DIT}],  # the topology's engine args: its defaults serve
        "limits": {"videos": VIDEO_LIMITS},
    }


def decoded(mp4: bytes) -> tuple[int, float, tuple[int, int], str]:
    """(frames, fps, (width, height), codec) of an MP4, read back by FFmpeg."""
    with av.open(io.BytesIO(mp4)) as container:
        stream = container.streams.video[0]
        frames = list(container.decode(video=0))
        return len(frames), float(stream.average_rate), (frames[0].width, frames[0].height), stream.codec_context.name


def wait_status(api: openai.OpenAI, video_id: str, want: set[str], timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        job = api.videos.retrieve(video_id)
        if job.status in want:
            return job
        assert time.monotonic() < deadline, f"video {video_id} still {job.status} after {timeout}s"
        time.sleep(0.1)


def running_steps(api: openai.OpenAI, video_id: str, timeout: float = 120) -> Any:
    """The job once its first denoising step is done."""
    deadline = time.monotonic() + timeout
    while True:
        job = api.videos.retrieve(video_id)
        if job.status == "in_progress" and job.model_extra.get("denoising_steps_done", 0) >= 1:
            return job
        assert job.status in ("queued", "in_progress"), job
        assert time.monotonic() < deadline, f"video {video_id} never ran a step: {job}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def t2v(tiny_wan_t2v_model, tmp_path_factory) -> Iterator[Serve]:
    yield from serving(Serve(spec(tiny_wan_t2v_model, "wan2-2-t2v", "wan-t2v"), tmp_path_factory.mktemp("t2v")))


@pytest.fixture(scope="module")
def api(t2v: Serve) -> openai.OpenAI:
    return openai.OpenAI(base_url=t2v.endpoint, api_key="none", max_retries=0)


def test_create_poll_download(t2v: Serve, api: openai.OpenAI) -> None:
    job = api.videos.create(prompt="a cat on a skateboard", size="64x64", seconds="1", extra_body={"fps": 8})
    assert (job.object, job.status, job.size, job.seconds) == ("video", "queued", "64x64", "1")
    assert job.id.startswith("video_")
    done = wait_status(api, job.id, {"completed", "failed"})
    assert done.status == "completed", done.error
    assert done.progress == 100 and done.model_extra["denoising_steps_done"] == 2
    assert done.model_extra["num_frames"] == 9 and done.model_extra["fps"] == 8  # 1 s x 8 fps + the first frame
    mp4 = api.videos.download_content(job.id).read()
    assert decoded(mp4) == (9, 8.0, (64, 64), "h264")
    assert job.id in [v.id for v in api.videos.list()]
    metrics = t2v.router_metrics()
    assert metric_values(metrics, "omnikube_video_jobs_finished_total", status="completed") >= [1.0]
    assert metric_values(metrics, "omnikube_video_e2e_latency_seconds_count") >= [1.0]
    assert sum(metric_values(t2v.stage_metrics("dit")[0], "omnikube_stage_denoise_step_seconds_count")) >= 2
    api.videos.delete(job.id)
    with pytest.raises(openai.NotFoundError):
        api.videos.retrieve(job.id)


def test_sync_answers_the_mp4(t2v: Serve) -> None:
    body = {"prompt": "a dog", "num_frames": 9, "fps": 4, "width": 96, "height": 64, "seed": 7}
    answer = httpx.post(f"{t2v.endpoint}/videos/sync", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "video/mp4"
    assert decoded(answer.content) == (9, 4.0, (96, 64), "h264")
    # the sync job is not kept
    listed = httpx.get(f"{t2v.endpoint}/videos", timeout=10).json()
    assert answer.headers["x-video-id"] not in [v["id"] for v in listed["data"]]
    # what the stage refuses is a 400 there too
    bad = httpx.post(f"{t2v.endpoint}/videos/sync", json={"prompt": "a dog", "num_frames": 6}, timeout=60)
    assert bad.status_code == 400 and "multiple of 4" in bad.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"num_frames": 41}, "at most 33 (router.limits.videos.maxFrames)"),
        ({"seconds": 5, "fps": 8}, "the video would have 41 frames"),
        ({"size": "128x128"}, "at most 9216 (router.limits.videos.maxPixels)"),
        ({"num_inference_steps": 201}, "at most 200 (router.limits.videos.maxInferenceSteps)"),
        ({"boundary_ratio": 0.5}, "unknown fields ['boundary_ratio']"),
        ({"input_reference": "data:image/png;base64,AAAA"}, "takes no input_reference"),
        ({"size": "64x64", "width": 64}, "not both"),
    ],
)
def test_limits_are_400s_naming_them(t2v: Serve, body: dict, message: str) -> None:
    answer = httpx.post(f"{t2v.endpoint}/videos", json={"prompt": "a cat", **body}, timeout=30)
    assert answer.status_code == 400 and message in answer.json()["error"]["message"], answer.text


def test_delete_cancels_a_running_job_and_the_replica_takes_no_more_than_its_limit(
    t2v: Serve, api: openai.OpenAI
) -> None:
    running = api.videos.create(prompt="a long one", extra_body={"num_inference_steps": 200})
    queued = api.videos.create(prompt="a queued one", extra_body={"num_inference_steps": 200})
    running_steps(api, running.id)
    assert api.videos.retrieve(queued.id).status == "queued"
    # one running + one queued: the replica's most (maxConcurrentJobs 1, maxQueuedJobs 1)
    with pytest.raises(openai.RateLimitError, match="maxConcurrentJobs and maxQueuedJobs"):
        api.videos.create(prompt="one too many")
    assert metric_values(t2v.router_metrics(), "omnikube_video_queue_depth") == [1.0]
    deleted = api.videos.delete(running.id)
    assert deleted.deleted and deleted.id == running.id
    with pytest.raises(openai.NotFoundError):
        api.videos.retrieve(running.id)
    running_steps(api, queued.id)  # the slot went to the queued job: the deleted one's stage work stopped
    api.videos.delete(queued.id)
    t2v.wait_idle(["dit"], timeout=60)


def test_unknown_ids_are_404s(t2v: Serve, api: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="not an id this server made"):
        api.videos.retrieve("video_nope")
    # an id naming a replica that is not one of this pipeline's routers is never called
    with pytest.raises(openai.NotFoundError, match="not running any more"):
        api.videos.retrieve("video_gaytcmzoguwtgmbqhaytsnrx_" + "0" * 24)


def test_a_job_whose_stage_dies_fails_with_the_reason(t2v: Serve, api: openai.OpenAI) -> None:
    job = api.videos.create(prompt="doomed", extra_body={"num_inference_steps": 200})
    running_steps(api, job.id)
    (victim,) = t2v.stage_processes("dit")
    os.killpg(victim["pid"], signal.SIGKILL)
    failed = wait_status(api, job.id, {"failed", "completed"}, timeout=60)
    assert failed.status == "failed" and "failed while running request" in failed.error.message
    with pytest.raises(openai.NotFoundError, match="is failed, so it has no content"):
        api.videos.download_content(job.id)
    # `omnikube serve` restarts the stage; the next job completes
    deadline = time.monotonic() + 240
    while sum(metric_values(t2v.router_metrics(), "omnikube_stage_replica_up", stage="dit")) < 1:
        assert time.monotonic() < deadline, t2v.logs_tail()
        time.sleep(1)
    after = api.videos.create(prompt="alive again")
    assert wait_status(api, after.id, {"completed", "failed"}).status == "completed"


# -- image to video ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def i2v(tiny_wan_i2v_model, tmp_path_factory) -> Iterator[Serve]:
    yield from serving(Serve(spec(tiny_wan_i2v_model, "wan2-2-i2v", "wan-i2v"), tmp_path_factory.mktemp("i2v")))


def test_i2v_takes_the_first_frame_as_input_reference(i2v: Serve) -> None:
    api = openai.OpenAI(base_url=i2v.endpoint, api_key="none", max_retries=0)
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), "red").save(buf, format="PNG")
    job = api.videos.create(prompt="a red ball rolls", input_reference=("first.png", buf.getvalue(), "image/png"))
    done = wait_status(api, job.id, {"completed", "failed"})
    assert done.status == "completed", done.error
    assert decoded(api.videos.download_content(job.id).read()) == (5, 16.0, (64, 64), "h264")
    with pytest.raises(openai.BadRequestError, match="send its first frame as input_reference"):
        api.videos.create(prompt="no image")
