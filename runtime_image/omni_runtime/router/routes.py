"""The HTTP routes: thin functions handing each request to its serving class."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from omni_runtime.metrics import render
from omni_runtime.router.protocol.audio import SpeechRequest, VoiceList
from omni_runtime.router.protocol.chat import ChatCompletionRequest
from omni_runtime.router.protocol.completions import CompletionRequest, DetokenizeRequest, TokenizeRequest
from omni_runtime.router.protocol.images import ImageGenerationRequest
from omni_runtime.router.protocol.models import ModelList

__all__ = ["ROUTES", "endpoint_of", "router"]

router = APIRouter()

ROUTES = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/v1/images/generations",
          "/v1/images/edits", "/v1/audio/speech",
          "/v1/audio/voices", "/v1/videos", "/v1/videos/sync", "/v1/videos/{video_id}",
          "/v1/videos/{video_id}/content", "/v1/models", "/health", "/livez", "/metrics")  # fmt: skip


def endpoint_of(path: str) -> str:
    """The route a request path is counted under in the metrics: one of ROUTES, or `other`."""
    if path in ROUTES:
        return path
    if path.startswith("/v1/videos/") and path != "/v1/videos/":
        return "/v1/videos/{video_id}/content" if path.endswith("/content") else "/v1/videos/{video_id}"
    return "other"


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
    return await raw.app.state.serving.chat.create(body, raw)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, raw: Request) -> Response:
    return await raw.app.state.serving.completions.create(body, raw)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, raw: Request) -> Response:
    """vLLM's: the token ids of a prompt or of a chat rendered with the model's template."""
    return await raw.app.state.serving.completions.tokenize(body, raw)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, raw: Request) -> Response:
    """vLLM's: the text of token ids."""
    return await raw.app.state.serving.completions.detokenize(body, raw)


@router.post("/v1/images/generations")
async def images_generations(body: ImageGenerationRequest, raw: Request) -> Response:
    return await raw.app.state.serving.images.generate(body, raw)


@router.post("/v1/images/edits")
async def images_edits(raw: Request) -> Response:
    return await raw.app.state.serving.images.edit(raw)


@router.post("/v1/audio/speech")
async def audio_speech(body: SpeechRequest, raw: Request) -> Response:
    return await raw.app.state.serving.speech.create(body, raw)


@router.get("/v1/audio/voices", response_model=VoiceList)
async def audio_voices(raw: Request) -> VoiceList:
    return raw.app.state.serving.speech.voices()


@router.post("/v1/videos")
async def videos_create(raw: Request) -> Response:
    """A video job (JSON or multipart/form-data): `{id, object: "video", status: "queued", ...}`."""
    return await raw.app.state.serving.videos.create(raw)


@router.post("/v1/videos/sync")
async def videos_sync(raw: Request) -> Response:
    """The same request as POST /v1/videos, answered with the MP4 once it is made."""
    return await raw.app.state.serving.videos.sync(raw)


@router.get("/v1/videos")
async def videos_list(raw: Request) -> Response:
    return await raw.app.state.serving.videos.list_jobs(raw)


@router.get("/v1/videos/{video_id}")
async def videos_get(video_id: str, raw: Request) -> Response:
    return await raw.app.state.serving.videos.get(raw, video_id)


@router.get("/v1/videos/{video_id}/content")
async def videos_content(video_id: str, raw: Request) -> Response:
    return await raw.app.state.serving.videos.content(raw, video_id)


@router.delete("/v1/videos/{video_id}")
async def videos_delete(video_id: str, raw: Request) -> Response:
    """Cancels a queued or running job (its stage work is aborted), or removes a finished one."""
    return await raw.app.state.serving.videos.delete(raw, video_id)


@router.get("/v1/models", response_model=ModelList)
async def models(raw: Request) -> ModelList:
    return raw.app.state.serving.models.list()


@router.get("/livez")
async def livez() -> Response:
    """Liveness: the router process serves. It says nothing about the stages, so a router is never
    restarted while a stage loads its model (readiness, `/health`, says that)."""
    return JSONResponse({"status": "alive"})


@router.get("/health")
async def health(raw: Request) -> Response:
    """Readiness: every stage has at least one ready replica, or is scaled to zero by its autoscaler
    (503 with the missing stages otherwise)."""
    pool = raw.app.state.context.pool
    ready = pool.ready()
    ok = pool.serving()
    body = {"status": "ok" if ok else "unavailable", "ready_replicas": ready}
    if not ok:
        body["message"] = f"stages without a ready replica: {sorted(s for s, n in ready.items() if not n)}"
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics() -> Response:
    data, content_type = render()
    return Response(data, media_type=content_type)
