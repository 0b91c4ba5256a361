"""`/v1/videos`: the create request and the job object, as OpenAI's Videos API and vLLM-Omni shape them.

Create (JSON or multipart/form-data): `prompt`; `size` (`WxH`) or `width` + `height`; `seconds` or
`num_frames` (+ `fps`); `num_inference_steps`, `guidance_scale`, `guidance_scale_2`, `negative_prompt`,
`seed`; `input_reference`: the first frame of an image-to-video pipeline (a multipart file, or in JSON a
`data:` URL). A field not listed is a 400 naming it.

The job (`GET /v1/videos/{id}`): OpenAI's fields (`id`, `object: "video"`, `status`, `progress` in
percent, `created_at`, `completed_at`, `expires_at`, `model`, `prompt`, `seconds`, `size`, `error`) plus
what a diffusion model adds: `num_frames`, `fps`, and `denoising_steps_done` of `num_inference_steps`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["VIDEO_FIELDS", "VideoCreateRequest", "VideoDeleted", "VideoError", "VideoJob", "VideoList"]


class VideoCreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=20000)
    model: str | None = None
    size: str | None = Field(None, description="WIDTHxHEIGHT, e.g. 832x480; or give width and height.")
    width: int | None = Field(None, ge=1, le=16384)
    height: int | None = Field(None, ge=1, le=16384)
    seconds: float | None = Field(None, gt=0, le=3600, description="Length; frames = seconds x fps (+1).")
    num_frames: int | None = Field(None, ge=1, le=100000)
    fps: int | None = Field(None, ge=1, le=240)
    num_inference_steps: int | None = Field(None, ge=1, le=100000)
    guidance_scale: float | None = Field(None, ge=0.0, le=100.0)
    guidance_scale_2: float | None = Field(None, ge=0.0, le=100.0)
    negative_prompt: str | None = Field(None, max_length=20000)
    seed: int | None = Field(None, ge=0, lt=2**63)
    input_reference: str | None = Field(None, description="JSON only: the first frame as a data: URL.")
    user: str | None = None


VIDEO_FIELDS = frozenset(VideoCreateRequest.model_fields)
"""Every field a create request may carry."""


class VideoError(BaseModel):
    code: str
    message: str


class VideoJob(BaseModel):
    """One video job, as every replica reports it."""

    id: str
    object: Literal["video"] = "video"
    status: Literal["queued", "in_progress", "completed", "failed"] = "queued"
    progress: int = Field(0, description="Percent of the denoising steps done (100 once the MP4 is ready).")
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    model: str
    prompt: str
    seconds: str
    size: str
    num_frames: int | None = None
    fps: int | None = None
    num_inference_steps: int | None = None
    denoising_steps_done: int = 0
    error: VideoError | None = None
    bytes: int | None = Field(None, description="Size of the finished MP4.")


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VideoJob]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = True


def form_fields(form: dict[str, Any]) -> dict[str, Any]:
    """A multipart form's text fields with empty strings dropped (clients send unset fields as '')."""
    return {k: v for k, v in form.items() if isinstance(v, str) and v != ""}
