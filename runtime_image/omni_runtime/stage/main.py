"""`omnikube stage`: run one stage server until SIGTERM/SIGINT, then drain it and stop.

The first signal starts a drain (no new work, running works finish, bounded by `drain_timeout_s`: see
`StageServer.drain`); a second signal stops at once, failing what still runs with a retriable error.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from pathlib import Path

from omni_runtime.spec import ResolvedPipeline
from omni_runtime.spec.reasons import Reason
from omni_runtime.stage.connectors import ConnectorSettings, ConnectorUnavailable
from omni_runtime.stage.server import StageServer
from omni_runtime.stage.settings import StageSettings
from omni_runtime.stage.termination import Termination
from omni_runtime.wire.auth import PipelineKey

__all__ = ["connector_settings", "run", "serve"]

log = logging.getLogger(__name__)


def connector_settings(settings: StageSettings, pipeline: ResolvedPipeline, replica: str) -> ConnectorSettings:
    """The stage's connector settings: `--connector-timeout` when given, else the pipeline's
    `connectors.start_timeout_seconds` (what the OmniPipeline's `connectors.startTimeoutSeconds` sets)."""
    timeout = settings.connector_timeout
    return ConnectorSettings(
        owner=f"{settings.stage}-{replica}",
        shm_pool_bytes=settings.shm_pool_bytes,
        advertise_host=settings.advertise_host,
        start_timeout_s=float(pipeline.topology.connectors.start_timeout_seconds if timeout is None else timeout),
    )


async def serve(settings: StageSettings, *, key: PipelineKey) -> int:
    """Serve until SIGTERM/SIGINT (then 0). 1 when the engine failed to load or died while serving (a
    sequence-parallel rank died), or a connector of the stage's edges could not start in time; each writes a
    termination message (reason EngineFailed or ConnectorUnavailable)."""
    pipeline = ResolvedPipeline.model_validate_json(Path(settings.config).read_text(encoding="utf-8"))
    stage = settings.stage
    replica = settings.replica or socket.gethostname()
    connectors = connector_settings(settings, pipeline, replica)
    server = StageServer(
        pipeline, stage, key=key, host=settings.host, port=settings.port, http_port=settings.http_port,
        replica=replica, connectors=connectors,
    )  # fmt: skip
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
        err = serving.exception()
        log.error("%s", err)
        code = 1
        if server.engine_failure is not None:
            # The engine died while serving: its works fail with its error (a 5xx naming it), routers are
            # told to send no more; then the process exits non-zero and the pod restarts.
            await server.drain(settings.drain_timeout)
        if isinstance(err, ConnectorUnavailable):
            # The operator reads this (pod terminationMessagePath) and reports Degraded with the reason.
            Termination(reason=Reason.CONNECTOR_UNAVAILABLE, message=str(err)[-3000:]).write(settings.termination_log)
        else:  # the engine failed to load, its self-check failed, or it died: the pod's status says why
            Termination(reason=Reason.ENGINE_FAILED, message=str(err)[-3000:]).write(settings.termination_log)
    elif stop.is_set():
        drain = asyncio.create_task(server.drain(settings.drain_timeout))
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


def run(settings: StageSettings, *, key: PipelineKey) -> int:
    return asyncio.run(serve(settings, key=key))
