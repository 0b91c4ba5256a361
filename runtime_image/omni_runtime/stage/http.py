"""The stage server's HTTP side: /healthz (alive), /readyz (engine loaded, not draining), /metrics (Prometheus).

Nothing here is authenticated (probes and scrapers call it), so it tells counts, never work ids."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from omni_runtime.metrics import render

__all__ = ["Probe", "ProbeServer", "build_app", "start_http"]

Probe = Callable[[], tuple[int, dict[str, Any]]]
"""/readyz's answer now: HTTP status and JSON body (`StageServer.probe`)."""


def build_app(stage: str, probe: Probe) -> Starlette:
    """/healthz names `stage`; /readyz answers what `probe()` says at each request."""

    async def healthz(_: Request) -> Response:
        return JSONResponse({"status": "alive", "stage": stage})

    async def readyz(_: Request) -> Response:
        status, body = probe()
        return JSONResponse(body, status_code=status)

    async def metrics(_: Request) -> Response:
        body, content_type = render()
        return Response(body, media_type=content_type)

    return Starlette(routes=[Route("/healthz", healthz), Route("/readyz", readyz), Route("/metrics", metrics)])


class _NoSignalServer(uvicorn.Server):
    """uvicorn that leaves SIGTERM and SIGINT to the stage process. uvicorn's `serve` would otherwise
    take them over (it has done so in `capture_signals` since 0.29; the old `install_signal_handlers`
    hook is gone): the probe server would stop on the first signal, before the stage itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class ProbeServer:
    """uvicorn serving the probe app on the running event loop."""

    def __init__(self, app: Starlette, host: str, port: int) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self.server = _NoSignalServer(config)
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]), name="stage-http")

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self.task, 5)
        self.sock.close()


async def start_http(stage: str, probe: Probe, host: str, port: int) -> ProbeServer:
    server = ProbeServer(build_app(stage, probe), host, port)
    server.start()
    return server
