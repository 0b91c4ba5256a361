"""Kubernetes Events about pods (Started, Killing, Unhealthy, BackOff, FailedMount...), best effort.

The same (pod, reason, message) is recorded at most once per `every` seconds, so a probe failing each
second does not flood the API server.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from podrunner.downward import now
from podrunner.kube import Kube

__all__ = ["EventRecorder"]

log = logging.getLogger("omnikube.e2e.podrunner")


class EventRecorder:
    def __init__(self, kube: Kube, every: float = 10.0) -> None:
        self.kube = kube
        self.every = every
        self._last: dict[tuple[str, str, str], float] = {}
        self._tasks: set[asyncio.Task] = set()

    def record(self, pod: dict, node: str, kind: str, reason: str, message: str) -> None:
        meta = pod["metadata"]
        key = (meta["uid"], reason, message)
        t = time.monotonic()
        if t - self._last.get(key, -1e9) < self.every:
            return
        if len(self._last) > 4096:
            self._last = {k: v for k, v in self._last.items() if t - v < self.every}
        self._last[key] = t
        log.debug("%s/%s %s: %s", meta["namespace"], meta["name"], reason, message)
        stamp = now()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta["uid"],
            },
            "reason": reason,
            "message": message[:1024],
            "type": kind,
            "source": {"component": "kubelet", "host": node},
            "reportingComponent": "kubelet",
            "reportingInstance": node,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        task = asyncio.create_task(self._post(meta["namespace"], body))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _post(self, namespace: str, body: dict) -> None:
        try:
            await self.kube.request("POST", f"/api/v1/namespaces/{namespace}/events", body=body)
        except Exception as e:  # noqa: BLE001 - events are best effort
            log.debug("event not recorded: %s", e)

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
