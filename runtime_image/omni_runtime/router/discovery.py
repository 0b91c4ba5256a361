"""Finding a stage's replicas: a static list (local mode) or the EndpointSlices of its Service.

A discovery calls `on_change(addresses)` with the full set of `host:port` replica addresses whenever it
changes. Kubernetes discovery watches `discovery.k8s.io/v1` EndpointSlices labelled
`kubernetes.io/service-name=<service>` through the API server (no DNS, no ClusterIP) and lists only
endpoints that may take new work: `conditions.ready` true (or unset, which the API defines as ready),
and neither `terminating` nor `serving: false`. A terminating pod drains: the works it runs finish
(the pool keeps its connection until they end), it only gets no new ones.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from omni_runtime.spec import StageDiscovery

__all__ = [
    "Discovery",
    "KubernetesDiscovery",
    "OnChange",
    "StaticDiscovery",
    "make_discovery",
    "ready_addresses",
]

log = logging.getLogger(__name__)

OnChange = Callable[[set[str]], None]
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


class Discovery(Protocol):
    async def run(self, on_change: OnChange) -> None:
        """Report the replica set now and on every change; runs until cancelled."""


class StaticDiscovery:
    """A fixed list of addresses."""

    def __init__(self, addresses: Iterable[str]) -> None:
        self.addresses = set(addresses)

    async def run(self, on_change: OnChange) -> None:
        on_change(set(self.addresses))
        await asyncio.Event().wait()


def ready_addresses(slices: Iterable[Any], port: int) -> set[str]:
    """`host:port` of every ready endpoint in V1EndpointSlice objects (or their dict form); terminating
    endpoints are left out even where a slice reports them ready (an API server before 1.26 does).

    The port is the slice's port numbered `port` when present, its only port when it has one, else
    `port` itself."""
    found: set[str] = set()
    for item in slices:
        ports = [_get(p, "port") for p in (_get(item, "ports") or [])]
        ports = [p for p in ports if p]
        use = port if port in ports or len(ports) != 1 else ports[0]
        for endpoint in _get(item, "endpoints") or []:
            conditions = _get(endpoint, "conditions")
            if _get(conditions, "ready") is False or _get(conditions, "serving") is False:
                continue
            if _get(conditions, "terminating") is True:
                continue
            for address in _get(endpoint, "addresses") or []:
                host = f"[{address}]" if ":" in address else address
                found.add(f"{host}:{use}")
    return found


def _get(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


class KubernetesDiscovery:
    """Watches the EndpointSlices of `service` in `namespace` through `api_client`
    (a `kubernetes_asyncio.client.ApiClient`, e.g. from `config.new_client_from_config(kubeconfig)`)."""

    def __init__(
        self,
        api_client: Any,
        namespace: str,
        service: str,
        port: int,
        *,
        watch_timeout_s: int = 300,
        retry_s: float = 1.0,
    ) -> None:
        self.api_client = api_client
        self.namespace = namespace
        self.service = service
        self.port = port
        self.watch_timeout_s = watch_timeout_s
        self.retry_s = retry_s
        self.slices: dict[str, Any] = {}

    @property
    def selector(self) -> str:
        return f"{SERVICE_NAME_LABEL}={self.service}"

    async def run(self, on_change: OnChange) -> None:
        from kubernetes_asyncio import client, watch
        from kubernetes_asyncio.client.exceptions import ApiException

        api = client.DiscoveryV1Api(self.api_client)
        last: set[str] | None = None

        def report() -> None:
            nonlocal last
            now = ready_addresses(self.slices.values(), self.port)
            if now != last:
                last = now
                log.info("service %s/%s: replicas %s", self.namespace, self.service, sorted(now) or "none")
                on_change(now)

        backoff = self.retry_s
        while True:
            try:
                listed = await api.list_namespaced_endpoint_slice(self.namespace, label_selector=self.selector)
                self.slices = {s.metadata.name: s for s in listed.items}
                report()
                version = listed.metadata.resource_version
                backoff = self.retry_s
                while True:
                    w = watch.Watch()
                    async with w:
                        async for event in w.stream(
                            api.list_namespaced_endpoint_slice,
                            self.namespace,
                            label_selector=self.selector,
                            resource_version=version,
                            timeout_seconds=self.watch_timeout_s,
                            allow_watch_bookmarks=True,
                        ):
                            kind, obj = event["type"], event["object"]
                            version = w.resource_version or version
                            if kind == "DELETED":
                                self.slices.pop(obj.metadata.name, None)
                            elif kind in ("ADDED", "MODIFIED"):
                                self.slices[obj.metadata.name] = obj
                            else:  # BOOKMARK: only a newer resourceVersion (ERROR raises ApiException)
                                continue
                            report()
            except asyncio.CancelledError:
                raise
            except ApiException as err:
                if err.status != 410:  # 410 Gone: our resourceVersion is too old; list again
                    log.warning("watching EndpointSlices of %s/%s failed: %s %s; retrying in %.0fs",
                                self.namespace, self.service, err.status, err.reason, backoff)  # fmt: skip
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 30.0)
            except Exception as err:
                log.warning("watching EndpointSlices of %s/%s failed: %s; retrying in %.0fs",
                            self.namespace, self.service, err, backoff)  # fmt: skip
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)


def make_discovery(spec: StageDiscovery, namespace: str, api_client: Any | None) -> Discovery:
    """Static discovery when the spec lists addresses, else Kubernetes discovery of its Service."""
    if spec.static or not spec.service:
        return StaticDiscovery(spec.static)
    if api_client is None:
        raise ValueError(
            f"discovery of service {spec.service!r} needs the Kubernetes API; run the router in the "
            "cluster (in-cluster config) or give it --kubeconfig"
        )
    return KubernetesDiscovery(api_client, spec.namespace or namespace or "default", spec.service, spec.port)
