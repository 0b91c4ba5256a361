"""The stage server's HTTP side: /healthz (alive), /readyz (engine loaded, not draining), /metrics (Prometheus).

Nothing here is authenticated (probes and scrapers call it), so it tells counts, never work ids."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from omni_runtime.metrics import render

if TYPE_CHECKING:
    from omni_runtime.stage.server import StageServer

__all__ = ["ProbeServer", "start_http"]


def build_app(server: StageServer) -> Starlette:
    async def healthz(_: Request) -> Response:
        return JSONResponse({"status": "alive", "stage": server.stage})

    async def readyz(_: Request) -> Response:
        if server.draining:  # shutting down: the pod leaves the Service's ready endpoints at once
            return JSONResponse({"status": "draining", "stage": server.stage, "running": len(server.works)}, 503)
        if server.ready:
            # Counts only: this port is unauthenticated, and a work id is what abort/feed messages name.
            phases = collections.Counter(w.phase for w in list(server.works.values()))
            return JSONResponse(
                {"status": "ready", "stage": server.stage, "running": sum(phases.values()), "phases": dict(phases)}
            )
        return JSONResponse({"status": server.phase, "stage": server.stage}, status_code=503)

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


async def start_http(server: StageServer, host: str, port: int) -> ProbeServer:
    probe = ProbeServer(build_app(server), host, port)
    probe.start()
    return probe
