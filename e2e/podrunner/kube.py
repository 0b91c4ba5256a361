"""The runner's one door to the API server: JSON over HTTP(S) with httpx, objects as plain dicts.

Credentials come from a kubeconfig, read by kubernetes_asyncio's loader (client certificates, tokens,
inline data); watches are streamed line by line.
"""

from __future__ import annotations

import json
import logging
import ssl
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httpx
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config

__all__ = ["Kube", "KubeError", "MERGE_PATCH"]

log = logging.getLogger("omnikube.e2e.podrunner")

MERGE_PATCH = "application/merge-patch+json"
USER_AGENT = "omnikube-podrunner/0.1"


class KubeError(RuntimeError):
    """An API call failed; `status` is the HTTP status (0 when no response came)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Kube:
    def __init__(self, http: httpx.AsyncClient, server: str, ca: bytes = b"") -> None:
        self.http = http
        self.server = server
        self.ca = ca  # the cluster CA (PEM) from the kubeconfig; empty when the kubeconfig names none

    @classmethod
    async def from_kubeconfig(cls, path: str) -> Kube:
        cfg = k8s_client.Configuration()
        await k8s_config.load_kube_config(config_file=path, client_configuration=cfg)
        headers = {"User-Agent": USER_AGENT}
        token = (cfg.api_key or {}).get("BearerToken") or (cfg.api_key or {}).get("authorization")
        if token:
            headers["Authorization"] = token if token.startswith("Bearer ") else f"Bearer {token}"
        ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert or None)
        if not cfg.verify_ssl:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if cfg.cert_file:
            ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
        http = httpx.AsyncClient(
            base_url=cfg.host,
            verify=ctx,
            headers=headers,
            trust_env=False,
            timeout=httpx.Timeout(30.0),
            limits=httpx.Limits(max_connections=50),
        )
        ca = b""
        if cfg.ssl_ca_cert:
            with open(cfg.ssl_ca_cert, "rb") as f:
                ca = f.read()
        return cls(http, cfg.host, ca)

    @property
    def server_address(self) -> tuple[str, int]:
        url = urlsplit(self.server)
        return url.hostname or "127.0.0.1", url.port or (443 if url.scheme == "https" else 80)

    async def close(self) -> None:
        await self.http.aclose()

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: dict | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> dict:
        content = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        try:
            resp = await self.http.request(method, path, params=params, content=content, headers=headers)
        except httpx.HTTPError as e:
            raise KubeError(0, f"{method} {path}: {type(e).__name__}: {e}") from e
        if resp.status_code >= 400:
            try:
                message = resp.json().get("message", resp.text)
            except ValueError:
                message = resp.text
            raise KubeError(resp.status_code, f"{method} {path}: {resp.status_code} {message}")
        return resp.json() if resp.content else {}

    async def get(self, path: str, **params: Any) -> dict | None:
        """The object at `path`, or None when it does not exist."""
        try:
            return await self.request("GET", path, params=params or None)
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    async def watch(self, path: str, params: dict) -> AsyncIterator[tuple[str, dict]]:
        """(type, object) of each watch event until the server ends the watch."""
        params = {**params, "watch": "true"}
        timeout = httpx.Timeout(30.0, read=None)
        async with self.http.stream("GET", path, params=params, timeout=timeout) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                raise KubeError(resp.status_code, f"watch {path}: {resp.status_code} {resp.text}")
            async for line in resp.aiter_lines():
                if line.strip():
                    event = json.loads(line)
                    yield event["type"], event["object"]
