"""`omnikube stage`: run one stage server until SIGTERM/SIGINT, then drain it and stop.

The first signal starts a drain (no new work, running works finish, bounded by `drain_timeout_s`: see
`StageServer.drain`); a second signal stops at once, failing what still runs with a retriable error.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

from omni_runtime.spec import DRAIN_TIMEOUT_S, ResolvedPipeline
from omni_runtime.stage.auth import PipelineKey
from omni_runtime.stage.connectors import ConnectorSettings
from omni_runtime.stage.server import StageServer

__all__ = ["run", "serve"]

log = logging.getLogger(__name__)


async def serve(
    config: str | Path,
    stage: str,
    *,
    host: str,
    port: int,
    http_port: int,
    replica: str,
    connectors: ConnectorSettings,
    drain_timeout_s: float = DRAIN_TIMEOUT_S,
    key: PipelineKey,
) -> int:
    pipeline = ResolvedPipeline.model_validate_json(Path(config).read_text(encoding="utf-8"))
    server = StageServer(
        pipeline, stage, key=key, host=host, port=port, http_port=http_port, replica=replica, connectors=connectors
    )
    stop = asyncio.Event()
    force = asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():
            force.set()
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await server.start()
    waiter = asyncio.create_task(stop.wait())
    serving = asyncio.create_task(server.serve_forever())
    await asyncio.wait({waiter, serving}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if serving.done() and serving.exception() is not None:
        log.error("%s", serving.exception())
        code = 1
    elif stop.is_set():
        drain = asyncio.create_task(server.drain(drain_timeout_s))
        forced = asyncio.create_task(force.wait())
        await asyncio.wait({drain, forced}, return_when=asyncio.FIRST_COMPLETED)
        if not drain.done():
            log.warning("stage %s: a second signal: stopping without waiting for running works", stage)
            drain.cancel()
        forced.cancel()
        await asyncio.gather(drain, forced, return_exceptions=True)
    waiter.cancel()
    serving.cancel()
    log.info("stage %s: stopping", stage)
    await server.stop()
    return code


def run(config: str | Path, stage: str, **kwargs) -> int:
    return asyncio.run(serve(config, stage, **kwargs))
