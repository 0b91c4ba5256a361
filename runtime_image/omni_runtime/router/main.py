"""`omnikube router`: load the resolved pipeline and serve the OpenAI API with uvicorn."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import uvicorn

from omni_runtime.router.app import build_app
from omni_runtime.spec import ROUTER_PORT, ResolvedPipeline

__all__ = ["load_resolved", "make_api_client", "serve"]

log = logging.getLogger(__name__)


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


async def serve(
    config: str | Path,
    *,
    host: str = "0.0.0.0",
    port: int = ROUTER_PORT,
    kubeconfig: str | None = None,
    log_level: str = "info",
    ping_timeout_s: float = 10.0,
    api_key_file: str | Path | None = None,
) -> None:
    pipeline = load_resolved(config)
    api_client = await make_api_client(kubeconfig) if _needs_kubernetes(pipeline) else None
    try:
        app = build_app(pipeline, api_client=api_client, ping_timeout_s=ping_timeout_s, api_key_file=api_key_file)
    except BaseException:
        if api_client is not None:
            await api_client.close()
        raise
    config_ = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=False, timeout_graceful_shutdown=5
    )
    server = uvicorn.Server(config_)
    log.info("router for %s (model %s) on http://%s:%d/v1%s", pipeline.name, pipeline.served_model_name, host, port,
             f", API key from {api_key_file}" if api_key_file else ", no API key")  # fmt: skip
    try:
        await server.serve()
    finally:
        if api_client is not None:
            await api_client.close()


def run(config: str | Path, **kwargs: Any) -> int:
    asyncio.run(serve(config, **kwargs))
    return 0
