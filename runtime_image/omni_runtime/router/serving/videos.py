"""Serving `/v1/videos`: create (JSON or multipart), get, list, content, delete, and `/v1/videos/sync`.

A create is checked against `router.limits.videos` (frames, size, steps) and the stage's own rules
(the engine answers 400 for a frame count its VAE cannot make), then runs as a job on this replica
(`router/jobs.py`). Requests about a job another replica owns are forwarded to it; a list asks every
replica for its own jobs. `/v1/videos/sync` runs the same job and answers with the MP4 (for short
clips; a client that goes away cancels it).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import time
from typing import Any

import httpx
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

from omni_runtime.router.errors import BadRequest, NotFound, OmniError, StageLost
from omni_runtime.router.jobs import ProgressCallback, VideoJobs, owner_of
from omni_runtime.router.orchestrator import PipelineRequest, StageEvent
from omni_runtime.router.plan import Plan, plan_request
from omni_runtime.router.protocol.images import parse_size
from omni_runtime.router.protocol.videos import (
    VIDEO_FIELDS,
    VideoCreateRequest,
    VideoDeleted,
    VideoJob,
    VideoList,
    form_fields,
)
from omni_runtime.router.serving.base import RouterContext, ServingBase, _until_disconnected
from omni_runtime.router.serving.inputs import entry_inputs, stage_params
from omni_runtime.spec import Modality

__all__ = ["FORWARDED_HEADER", "ServingVideos"]

log = logging.getLogger(__name__)

FORWARDED_HEADER = "x-omnikube-forwarded"
"""Set on a request one replica forwards to another: the receiver answers for itself only."""
_DEFAULT_FPS = 16
"""The fps the router assumes, for its frame limit, when a request gives `seconds` but no `fps`
(the engine's `default_fps`, Wan's native rate)."""


class ServingVideos(ServingBase):
    endpoint = "/v1/videos"

    def __init__(self, ctx: RouterContext, jobs: VideoJobs) -> None:
        super().__init__(ctx)
        self.jobs = jobs
        self.video_limits = ctx.pipeline.limits.videos

    # -- checks --------------------------------------------------------------------------------

    def _plan(self) -> Plan:
        if "video" not in self.producible():
            raise BadRequest(
                f"model `{self.ctx.model_name}` (pipeline {self.topology.name}) produces {self.producible()}, "
                "not video; serve a video pipeline (wan2-2-t2v, wan2-2-i2v) for /v1/videos",
                param="model",
            )
        return plan_request(self.topology, ["video"])

    def _takes_image(self, plan: Plan) -> bool:
        return any(Modality.IMAGE in self.topology.stage(n).input_modalities for n in plan.entry)

    async def _parse(self, raw: Request) -> tuple[VideoCreateRequest, bytes | None]:
        kind = raw.headers.get("content-type", "").split(";")[0].strip().lower()
        image: bytes | None = None
        if kind in ("multipart/form-data", "application/x-www-form-urlencoded"):
            form = await raw.form()
            fields: dict[str, Any] = form_fields(dict(form))
            upload = form.get("input_reference")
            if upload is not None and hasattr(upload, "read"):
                image = await upload.read()
        else:
            try:
                fields = await raw.json()
            except ValueError:
                raise BadRequest("the body is not JSON; send JSON or multipart/form-data") from None
            if not isinstance(fields, dict):
                raise BadRequest(f"the body must be a JSON object, not {type(fields).__name__}")
        unknown = sorted(set(fields) - VIDEO_FIELDS)
        if unknown:
            raise BadRequest(
                f"unknown fields {unknown} in the request to /v1/videos; this server accepts {sorted(VIDEO_FIELDS)}",
                param=unknown[0],
            )
        try:
            body = VideoCreateRequest.model_validate(fields)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            raise BadRequest(f"{where}: {first['msg']} (got {first.get('input')!r})", param=where) from None
        if body.input_reference is not None:
            image = _data_url(body.input_reference)
        return body, image

    def _check_limits(self, body: VideoCreateRequest) -> tuple[int | None, int | None, int | None]:
        """(width, height, num_frames) after the `router.limits.videos` checks (None: the stage's default)."""
        lim = self.video_limits
        try:
            size = parse_size(body.size)
        except ValueError as err:
            raise BadRequest(str(err), param="size") from None
        width, height = size if size else (body.width, body.height)
        if size and (body.width or body.height):
            raise BadRequest("give size or width and height, not both", param="size")
        if (width is None) != (height is None):
            raise BadRequest("width and height go together; give both, or size as WIDTHxHEIGHT", param="width")
        if width is not None and height is not None and width * height > lim.max_pixels:
            raise BadRequest(
                f"{width}x{height} is {width * height} pixels per frame; this pipeline makes at most "
                f"{lim.max_pixels} (router.limits.videos.maxPixels); ask for a smaller size",
                param="size",
            )
        frames = body.num_frames
        if body.seconds is not None and frames is not None:
            raise BadRequest("give seconds or num_frames, not both", param="seconds")
        if body.seconds is not None:  # an estimate: the stage rounds it to what its VAE makes
            frames = int(round(body.seconds * (body.fps or _DEFAULT_FPS))) + 1
        if frames is not None and frames > lim.max_frames:
            raise BadRequest(
                f"the video would have {frames} frames; this pipeline makes at most {lim.max_frames} "
                "(router.limits.videos.maxFrames); ask for fewer seconds, a lower fps or fewer frames",
                param="seconds" if body.seconds is not None else "num_frames",
            )
        steps = body.num_inference_steps
        if steps is not None and steps > lim.max_inference_steps:
            raise BadRequest(
                f"num_inference_steps is {steps}; this pipeline runs at most {lim.max_inference_steps} "
                "(router.limits.videos.maxInferenceSteps); ask for fewer",
                param="num_inference_steps",
            )
        return width, height, frames

    # -- create --------------------------------------------------------------------------------

    async def _create_job(self, raw: Request) -> VideoJob:
        body, image = await self._parse(raw)
        self.check_model(body.model, required=False)
        plan = self._plan()
        takes_image = self._takes_image(plan)
        if image is not None and not takes_image:
            raise BadRequest(
                f"pipeline {self.topology.name} makes video from text and takes no input_reference; remove it, "
                "or serve an image-to-video pipeline (wan2-2-i2v)",
                param="input_reference",
            )
        if image is None and takes_image:
            raise BadRequest(
                f"pipeline {self.topology.name} makes video from an image: send its first frame as "
                "input_reference (a multipart file, or a data: URL in JSON)",
                param="input_reference",
            )
        width, height, frames = self._check_limits(body)
        job_id = self.jobs.new_id()
        params = {
            "width": width,
            "height": height,
            "num_frames": body.num_frames,
            "seconds": body.seconds,  # the stage rounds seconds x fps to a frame count its VAE makes
            "fps": body.fps,
            "seed": body.seed,
            "num_inference_steps": body.num_inference_steps,
            "guidance_scale": body.guidance_scale,
            "guidance_scale_2": body.guidance_scale_2,
        }
        request = PipelineRequest(
            request_id=job_id,
            plan=plan,
            entry=entry_inputs(
                self.topology,
                plan,
                prompt=body.prompt,
                negative_prompt=body.negative_prompt,
                extra={"image": image} if image is not None else None,
            ),
            params=stage_params(self.topology, plan, ar={"seed": body.seed}, image=params),
            negative_prompt=body.negative_prompt,
            stream=True,  # every output reaches the router as it comes: the progress steps, then the MP4
        )
        fps = body.fps or _DEFAULT_FPS
        job = VideoJob(
            id=job_id,
            created_at=int(time.time()),
            model=self.ctx.model_name,
            prompt=body.prompt,
            seconds=f"{body.seconds:g}" if body.seconds else (f"{(frames - 1) / fps:g}" if frames else ""),
            size=f"{width}x{height}" if width else "",
            num_frames=frames,
            fps=body.fps,
            num_inference_steps=body.num_inference_steps,
        )
        self.jobs.submit(job, lambda progress: self._run(request, progress))
        return job

    async def _run(self, request: PipelineRequest, progress: ProgressCallback) -> tuple[bytes, dict]:
        found: dict[str, Any] = {}

        def collect(event: StageEvent) -> None:
            data = event.data or {}
            if isinstance(data.get("progress"), dict):
                step = data["progress"]
                progress(int(step.get("steps_done", 0)), int(step.get("steps", 0)))
            if isinstance(data.get("video"), bytes | bytearray | memoryview):
                found.update(data)

        await self.ctx.lifecycle.bounded(self.ctx.orchestrator.run(request, collect))
        if "video" not in found:
            raise OmniError("the pipeline finished without a video; check the prompt and parameters")
        info = {k: found[k] for k in ("num_frames", "fps", "width", "height") if isinstance(found.get(k), int)}
        return bytes(found["video"]), info

    async def create(self, raw: Request) -> Response:
        job = await self._create_job(raw)
        return JSONResponse(job.model_dump(), status_code=200)

    async def sync(self, raw: Request) -> Response:
        """Create, wait, answer the MP4; the job is removed once answered (or when the client leaves)."""
        job = await self._create_job(raw)
        try:
            done, error = await _until_disconnected(raw, self.jobs.wait(job.id))
            if error is not None:
                raise error
            path = self.jobs.content(job.id)
            if path is None:
                raise NotFound(f"video {job.id} finished without content")
            data = await asyncio.to_thread(path.read_bytes)
            return Response(data, media_type="video/mp4", headers={"x-video-id": job.id})
        finally:
            await asyncio.shield(self.jobs.delete(job.id))

    # -- the others ----------------------------------------------------------------------------

    async def _forward(self, raw: Request, job_id: str) -> Response | None:
        """The owner's answer when another replica owns `job_id`; None when this one answers."""
        owner = owner_of(job_id)
        if owner is None:
            raise NotFound(f"no video {job_id!r}: that is not an id this server made", param="video_id")
        if owner == self.jobs.address or raw.headers.get(FORWARDED_HEADER):
            return None
        if self.jobs.get(job_id) is not None:  # a shared directory holds it
            return None
        if owner not in self.jobs.peers:
            raise NotFound(
                f"video {job_id} belongs to router replica {owner}, which is not running any more; its jobs "
                "went with it (keep videos on a PVC: router.videos.volumeClaim)",
                param="video_id",
            )
        return await self._call_peer(raw, owner)

    async def _call_peer(self, raw: Request, peer: str, params: dict[str, str] | None = None) -> Response:
        headers = {FORWARDED_HEADER: "1"}
        if "authorization" in raw.headers:
            headers["authorization"] = raw.headers["authorization"]
        url = f"http://{peer}{raw.url.path}"
        try:
            async with httpx.AsyncClient(timeout=30.0) as client:
                answer = await client.request(
                    raw.method, url, params=params if params is not None else dict(raw.query_params), headers=headers
                )
        except httpx.HTTPError as err:
            raise StageLost(f"router replica {peer}, which owns this video, did not answer: {err}; retry") from None
        keep = {k: v for k, v in answer.headers.items() if k.lower() in ("content-type", "retry-after")}
        return Response(answer.content, status_code=answer.status_code, headers=keep)

    def _local(self, job_id: str) -> VideoJob:
        job = self.jobs.get(job_id)
        if job is None:
            raise NotFound(f"no video {job_id!r} (it was deleted, or expired)", param="video_id")
        return job

    async def get(self, raw: Request, job_id: str) -> Response:
        forwarded = await self._forward(raw, job_id)
        return forwarded or JSONResponse(self._local(job_id).model_dump())

    async def content(self, raw: Request, job_id: str) -> Response:
        variant = raw.query_params.get("variant", "video")
        if variant != "video":
            raise BadRequest(f"variant {variant!r} is not available; this server keeps only 'video'", param="variant")
        forwarded = await self._forward(raw, job_id)
        if forwarded is not None:
            return forwarded
        job = self._local(job_id)
        path = self.jobs.content(job_id)
        if path is None:
            raise NotFound(
                f"video {job_id} is {job.status}, so it has no content"
                + (f": {job.error.message}" if job.error else "; poll GET /v1/videos/{id} until it is completed"),
                param="video_id",
            )
        return FileResponse(path, media_type="video/mp4", filename=f"{job_id}.mp4")

    async def delete(self, raw: Request, job_id: str) -> Response:
        forwarded = await self._forward(raw, job_id)
        if forwarded is not None:
            return forwarded
        if not await self.jobs.delete(job_id):
            raise NotFound(f"no video {job_id!r} (it was deleted, or expired)", param="video_id")
        return JSONResponse(VideoDeleted(id=job_id).model_dump())

    async def list_jobs(self, raw: Request) -> Response:
        try:
            limit = int(raw.query_params.get("limit", "20"))
        except ValueError:
            raise BadRequest("limit must be an integer", param="limit") from None
        if not 1 <= limit <= 100:
            raise BadRequest(f"limit {limit} is out of range; use 1 to 100", param="limit")
        order = raw.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise BadRequest(f"order {order!r} is not allowed; use asc or desc", param="order")
        jobs = self.jobs.jobs()
        if not raw.headers.get(FORWARDED_HEADER):
            answers = await asyncio.gather(
                *(self._peer_jobs(raw, p) for p in sorted(self.jobs.peers - {self.jobs.address}))
            )
            seen = {j.id for j in jobs}
            jobs += [j for found in answers for j in found if j.id not in seen]
        jobs.sort(key=lambda j: (j.created_at, j.id), reverse=order == "desc")
        after = raw.query_params.get("after")
        if after:
            ids = [j.id for j in jobs]
            jobs = jobs[ids.index(after) + 1 :] if after in ids else []
        page = jobs[:limit]
        body = VideoList(
            data=page,
            first_id=page[0].id if page else None,
            last_id=page[-1].id if page else None,
            has_more=len(jobs) > limit,
        )
        return JSONResponse(body.model_dump())

    async def _peer_jobs(self, raw: Request, peer: str) -> list[VideoJob]:
        """A peer's own jobs (all of them: paging happens here); none when it does not answer."""
        try:
            answer = await self._call_peer(raw, peer, {"limit": "100"})
            if answer.status_code != 200:
                return []
            return VideoList.model_validate_json(bytes(answer.body)).data
        except (OmniError, ValueError) as err:
            log.warning("listing videos: router replica %s did not answer: %s", peer, err)
            return []


def _data_url(value: str) -> bytes:
    """The bytes of a `data:image/...;base64,` URL (JSON's input_reference)."""
    head, _, payload = value.partition(",")
    if not head.startswith("data:") or not head.endswith(";base64") or not payload:
        raise BadRequest(
            "input_reference in JSON must be a data URL (data:image/png;base64,...); or send the image as the "
            "multipart file input_reference",
            param="input_reference",
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest("input_reference is not valid base64", param="input_reference") from None
