"""The router's FastAPI application: serving classes, routes, error mapping, body limit, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omni_runtime.metrics import Router as M
from omni_runtime.router.admission import Admission
from omni_runtime.router.auth import ApiKeyFile, BearerAuth
from omni_runtime.router.contract_header import ContractHeader
from omni_runtime.router.discovery import Discovery
from omni_runtime.router.errors import OmniError, RequestTooLarge, error_response
from omni_runtime.router.jobs import VideoJobs
from omni_runtime.router.openapi import REJECTING_BODIES, document
from omni_runtime.router.orchestrator import Orchestrator
from omni_runtime.router.pool import StagePool
from omni_runtime.router.routes import ROUTES, endpoint_of, router
from omni_runtime.router.serving.base import RouterContext
from omni_runtime.router.serving.chat import ServingChat
from omni_runtime.router.serving.completions import ServingCompletions
from omni_runtime.router.serving.images import ServingImages
from omni_runtime.router.serving.models import ServingModels
from omni_runtime.router.serving.speech import ServingSpeech
from omni_runtime.router.serving.videos import ServingVideos
from omni_runtime.spec import ResolvedPipeline
from omni_runtime.wire.auth import PipelineKey

__all__ = ["build_app"]


@dataclass
class _Serving:
    chat: ServingChat
    completions: ServingCompletions
    images: ServingImages
    models: ServingModels
    speech: ServingSpeech
    videos: ServingVideos


def build_app(
    pipeline: ResolvedPipeline,
    pool: StagePool | None = None,
    *,
    key: PipelineKey | None = None,
    api_client: Any = None,
    ping_timeout_s: float = 10.0,
    api_key_file: str | Path | None = None,
    videos_dir: str | Path | None = None,
    address: str = "127.0.0.1:0",
    peers: Discovery | None = None,
) -> FastAPI:
    """The router app for `pipeline`. The pool (made from the pipeline's discovery and `key` unless
    given) starts and stops with the app's lifespan; `ping_timeout_s`: silence after which a replica
    counts as hung; `api_key_file`: where the key every `/v1/*` request must send as a Bearer token is
    (None: no key). Raises ApiKeyError when that file cannot be used. Video jobs: finished MP4s go to
    `videos_dir` (None: a temporary directory removed at shutdown); `address` is how the other router
    replicas reach this one, `peers` finds them (None: alone)."""
    api_key = ApiKeyFile(api_key_file) if api_key_file is not None else None
    if pool is None:
        if key is None:
            raise ValueError("the router needs the pipeline key to talk to its stages; pass key= or a pool")
        pool = StagePool(pipeline, key=key, api_client=api_client, ping_timeout_s=ping_timeout_s)
    name = pipeline.name

    def gauges(in_flight: int, queued: int) -> None:
        M.in_flight.labels(name).set(in_flight)
        M.queue_depth.labels(name).set(queued)

    limits = pipeline.limits
    admission = Admission(limits.max_concurrent_requests, limits.max_queued_requests, on_change=gauges)
    ctx = RouterContext(pipeline=pipeline, pool=pool, orchestrator=Orchestrator(pipeline, pool), admission=admission)
    gauges(0, 0)
    scratch = None if videos_dir is not None else Path(tempfile.mkdtemp(prefix="omnikube-videos-"))
    jobs = VideoJobs(name, limits.videos, Path(videos_dir) if videos_dir is not None else scratch, address)  # type: ignore[arg-type]  # one of the two is set

    def on_peers(addresses: set[str]) -> None:
        jobs.peers = addresses

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await pool.start()
        await jobs.start()
        watcher = asyncio.create_task(peers.run(on_peers), name="router-peers") if peers is not None else None
        try:
            yield
        finally:
            if watcher is not None:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
            await jobs.stop()
            await pool.stop()
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)

    app = FastAPI(title=f"omnikube router: {pipeline.served_model_name}", lifespan=lifespan, docs_url=None,
                  redoc_url=None)  # fmt: skip
    app.state.context = ctx
    app.state.serving = _Serving(
        ServingChat(ctx),
        ServingCompletions(ctx),
        ServingImages(ctx),
        ServingModels(ctx),
        ServingSpeech(ctx),
        ServingVideos(ctx, jobs),
    )
    app.include_router(router)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document(
                get_openapi(title=app.title, version=app.version, routes=app.routes),
                model_names=sorted({pipeline.served_model_name, pipeline.name}),
                closed_bodies=REJECTING_BODIES if limits.unknown_fields == "reject" else (),
            )
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to replace the document

    async def handle(request: Request, exc: Exception):
        return error_response(exc, (*ROUTES, "/openapi.json"))

    for exc_type in (OmniError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(exc_type, handle)
    if api_key is not None:
        app.add_middleware(BearerAuth, key=api_key)  # inside the guard, so its 401s are counted too
    app.add_middleware(_Guard, max_bytes=limits.max_body_bytes, pipeline=name)
    app.add_middleware(ContractHeader)  # outermost: every response of a request that ran on stages
    return app


class _BodyTooLarge(StarletteHTTPException):
    """Raised from `receive` once a streamed body passes the limit. An HTTPException, so FastAPI's body
    parsing re-raises it instead of turning it into a 400."""


class _Guard:
    """Refuses bodies over `max_bytes` with 413 and counts every answer by endpoint and status."""

    def __init__(self, app: ASGIApp, max_bytes: int, pipeline: str) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.pipeline = pipeline

    def _too_large(self, size: str) -> RequestTooLarge:
        return RequestTooLarge(
            f"the request body is {size} bytes; this server accepts at most {self.max_bytes} bytes "
            "(router limit max_body_bytes); send smaller inputs"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = endpoint_of(path)
        status = 500
        started = False

        async def send_counted(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
            await send(message)

        try:
            length = int(dict(scope.get("headers") or []).get(b"content-length", b"0") or 0)
        except ValueError:
            length = 0
        try:
            if length > self.max_bytes:
                await error_response(self._too_large(str(length)))(scope, receive, send_counted)
                return
            received = 0

            async def receive_limited() -> Message:
                nonlocal received
                message = await receive()
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    if received > self.max_bytes:
                        raise _BodyTooLarge(413, self._too_large(f"more than {self.max_bytes}").message)
                return message

            try:
                await self.app(scope, receive_limited, send_counted)
            except _BodyTooLarge as err:
                if not started:
                    await error_response(err)(scope, receive, send_counted)
        finally:
            M.requests.labels(self.pipeline, endpoint, str(status)).inc()
            if status >= 400:
                M.errors.labels(self.pipeline, endpoint, _ERROR_TYPES.get(status, str(status))).inc()


_ERROR_TYPES = {
    400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "RequestTooLargeError",
    429: "RateLimitError", 499: "ClientClosedRequest", 500: "InternalServerError", 502: "BadGatewayError",
    503: "ServiceUnavailableError", 504: "TimeoutError",
}  # fmt: skip
