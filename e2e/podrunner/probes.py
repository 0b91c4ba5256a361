"""Probe handlers (httpGet, tcpSocket, exec; grpc as a TCP connect) and the probe settings' defaults.

httpGet and tcpSocket go from the host to the pod IP across the bridge, as the kubelet's do from the node.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

__all__ = ["ExecFn", "ProbeSettings", "run_handler", "resolve_port"]

ExecFn = Callable[[list[str], float], Awaitable[tuple[int, str]]]


@dataclass(frozen=True)
class ProbeSettings:
    initial_delay: float
    period: float
    timeout: float
    success_threshold: int
    failure_threshold: int

    @classmethod
    def of(cls, probe: dict) -> ProbeSettings:
        return cls(
            initial_delay=float(probe.get("initialDelaySeconds", 0)),
            period=float(probe.get("periodSeconds", 10)),
            timeout=float(probe.get("timeoutSeconds", 1)),
            success_threshold=int(probe.get("successThreshold", 1)),
            failure_threshold=int(probe.get("failureThreshold", 3)),
        )


def resolve_port(port: int | str, container: dict) -> int:
    """A numeric port, or the containerPort of the container's port with that name."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"port {port!r} is neither a number nor the name of one of the container's ports")


async def run_handler(
    handler: dict, *, pod_ip: str, container: dict, http: httpx.AsyncClient, exec_fn: ExecFn, timeout: float
) -> tuple[bool, str]:
    """Run one probe (or lifecycle hook) handler: (success, message)."""
    try:
        if "httpGet" in handler:
            return await _http_get(handler["httpGet"], pod_ip, container, http, timeout)
        if "tcpSocket" in handler or "grpc" in handler:
            spec = handler.get("tcpSocket") or handler["grpc"]
            return await _tcp(spec.get("host") or pod_ip, resolve_port(spec["port"], container), timeout)
        if "exec" in handler:
            code, out = await exec_fn(list(handler["exec"].get("command") or []), timeout)
            return code == 0, (out.strip()[-500:] or f"command exited with {code}")
        if "sleep" in handler:
            await asyncio.sleep(float(handler["sleep"].get("seconds", 0)))
            return True, ""
    except ValueError as e:
        return False, str(e)
    return False, f"handler {sorted(handler)} is not supported by the pod runner"


async def _http_get(
    spec: dict, pod_ip: str, container: dict, http: httpx.AsyncClient, timeout: float
) -> tuple[bool, str]:
    host = spec.get("host") or pod_ip
    port = resolve_port(spec.get("port", 80), container)
    scheme = (spec.get("scheme") or "HTTP").lower()
    path = spec.get("path") or "/"
    if not path.startswith("/"):
        path = "/" + path
    url = f"{scheme}://{host}:{port}{path}"
    headers = {h["name"]: h["value"] for h in spec.get("httpHeaders") or []}
    headers.setdefault("User-Agent", "kube-probe/podrunner")
    try:
        resp = await http.get(url, headers=headers, timeout=timeout)
    except httpx.TimeoutException:
        return False, f'Get "{url}": context deadline exceeded (timeout {timeout}s)'
    except httpx.HTTPError as e:
        return False, f'Get "{url}": {type(e).__name__}: {e}'
    if 200 <= resp.status_code < 400:
        return True, ""
    return False, f"HTTP probe failed with statuscode: {resp.status_code}"


async def _tcp(host: str, port: int, timeout: float) -> tuple[bool, str]:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError) as e:
        return False, f"dial tcp {host}:{port}: {e or 'timeout'}"
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()
    return True, ""
