"""`omnikube router`: load the resolved pipeline and serve the OpenAI API with uvicorn.

SIGTERM drains: uvicorn stops accepting connections and waits for the running requests, which get
`drain_timeout_s` to finish; then those still running fail with a retriable 503 (see `lifecycle`).
A second SIGINT stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from omni_runtime.router.app import build_app
from omni_runtime.router.discovery import KubernetesDiscovery
from omni_runtime.router.lifecycle import Lifecycle
from omni_runtime.router.settings import RouterSettings
from omni_runtime.spec import ResolvedPipeline
from omni_runtime.wire.auth import PipelineKey

__all__ = ["load_resolved", "make_api_client", "serve"]

log = logging.getLogger(__name__)

FLUSH_S = 5.0
"""After the drain period, the time uvicorn still gives the 503s to reach their clients."""


class _DrainingServer(uvicorn.Server):
    """uvicorn that starts the app's drain period when it is asked to exit."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.drain_timeout_s = drain_timeout_s
        self.loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.loop is not None:  # a signal handler: hand over to the loop
            self.loop.call_soon_threadsafe(self.lifecycle.begin_drain, self.drain_timeout_s)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn re-raises a caught SIGTERM once it has shut down, so the process died of it (exit 143,
        a container status of Error) even after a complete drain. The router stopped as asked: exit 0."""
        with super().capture_signals():
            yield
            self._captured_signals.clear()


def load_resolved(path: str | Path) -> ResolvedPipeline:
    """The resolved pipeline JSON written by the operator (ConfigMap) or the local launcher."""
    return ResolvedPipeline.model_validate_json(Path(path).read_text(encoding="utf-8"))


async def make_api_client(kubeconfig: str | None) -> Any:
    """A kubernetes_asyncio ApiClient from `kubeconfig`, or the in-cluster service account."""
    from kubernetes_asyncio import client, config

    if kubeconfig:
        return await config.new_client_from_config(config_file=kubeconfig)
    config.load_incluster_config()
    return client.ApiClient()


def _needs_kubernetes(pipeline: ResolvedPipeline) -> bool:
    return any(d.service and not d.static for d in pipeline.discovery.values())


async def serve(settings: RouterSettings, *, key: PipelineKey, log_level: str = "info") -> None:
    pipeline = load_resolved(settings.config)
    host, port, api_key_file = settings.host, settings.port, settings.api_key_file
    drain_timeout_s = settings.drain_timeout
    kube = _needs_kubernetes(pipeline) or settings.peers_service is not None
    api_client = await make_api_client(settings.kubeconfig) if kube else None
    try:
        peers = None
        if settings.peers_service is not None:
            namespace = pipeline.namespace or "default"
            peers = KubernetesDiscovery(api_client, namespace, settings.peers_service, settings.port)
        app = build_app(
            pipeline,
            key=key,
            api_client=api_client,
            ping_timeout_s=settings.ping_timeout,
            api_key_file=settings.api_key_file,
            videos_dir=settings.videos_dir,
            address=_address(settings.advertise_host, settings.port),
            peers=peers,
        )
    except BaseException:
        if api_client is not None:
            await api_client.close()
        raise
    config_ = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=False,
        timeout_graceful_shutdown=int(drain_timeout_s + FLUSH_S),
    )  # fmt: skip
    server = _DrainingServer(config_, app.state.context.lifecycle, drain_timeout_s)
    server.loop = asyncio.get_running_loop()
    log.info("router for %s (model %s) on http://%s:%d/v1%s (pipeline key %s)", pipeline.name,
             pipeline.served_model_name, host, port,
             f", API key from {api_key_file}" if api_key_file else ", no API key", key.fingerprint)  # fmt: skip
    try:
        await server.serve()
    finally:
        if api_client is not None:
            await api_client.close()


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def run(settings: RouterSettings, *, key: PipelineKey, log_level: str = "info") -> int:
    asyncio.run(serve(settings, key=key, log_level=log_level))
    return 0
