"""The connectors one stage process uses, one per kind, made on first use and timed into metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from omni_runtime.connectors import AnyHandle, Connector, ConnectorError, Handle, make_connector
from omni_runtime.metrics import Stage as M
from omni_runtime.spec import ConnectorKind, ResolvedPipeline

__all__ = ["ConnectorSet", "ConnectorSettings", "ConnectorUnavailable"]

log = logging.getLogger(__name__)

START_RETRY_S = 2.0
"""Pause between attempts to start a connector at start-up."""


class ConnectorUnavailable(ConnectorError):
    """A connector an edge of the stage needs could not start within the start-up time."""


@dataclass
class ConnectorSettings:
    """What only the running stage process knows about its connectors."""

    owner: str = "stage"
    """Names this process's shm segments (`omnikube-<pipeline>-<owner>-p<pid>-...`)."""
    shm_pool_bytes: int = 64 * 1024**2
    """Idle shm bytes kept for reuse; 0 unlinks each segment soon after it is released."""
    mooncake_host: str = "127.0.0.1"
    """This pod's address as other pods reach it (Mooncake transfer engine). The master's host is the
    pipeline's (`ResolvedPipeline.mooncake_master_host`), its ports the spec's."""
    start_timeout_s: float = 120.0
    """How long `start` keeps trying to make the connectors the stage's edges need."""
    extra: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Additional `make_connector` keyword arguments by kind."""


class ConnectorSet:
    """Lazily built connectors of a stage process, by kind; `put`/`get`/`release` through them."""

    def __init__(self, pipeline: ResolvedPipeline, stage: str, settings: ConnectorSettings) -> None:
        self.pipeline = pipeline
        self.stage = stage
        self.settings = settings
        self._connectors: dict[ConnectorKind, Connector] = {}

    def connector(self, kind: ConnectorKind | str) -> Connector:
        kind = ConnectorKind(kind)
        found = self._connectors.get(kind)
        if found is None:
            found = self._connectors[kind] = make_connector(
                kind, self.pipeline.topology.connectors, **self._runtime_info(kind)
            )
            stats = getattr(found, "stats", None)  # pooled connectors know what is still lent out
            if stats is not None:
                gauge = M.connector_unreleased.labels(self.pipeline.name, self.stage, kind.value)
                gauge.set_function(lambda: stats()["busy"])
        return found

    def needed(self) -> list[ConnectorKind]:
        """The connector kinds of the edges into and out of this stage."""
        topo = self.pipeline.topology
        kinds = {topo.edge_connector(e) for e in topo.edges if self.stage in (e.source, e.target)}
        return sorted(kinds, key=lambda k: k.value)

    async def start(self) -> None:
        """Make every connector this stage's edges need, before the stage calls itself ready.

        A connector that fails is tried again every few seconds (the Mooncake master may still be
        starting) until `settings.start_timeout_s`; then ConnectorUnavailable says which kind, for which
        edges, and what it tried (the connector's own error names the addresses)."""
        deadline = time.monotonic() + self.settings.start_timeout_s
        for kind in self.needed():
            attempt = 0
            while True:
                attempt += 1
                try:
                    await asyncio.to_thread(self.connector, kind)
                    break
                except ConnectorError as err:
                    if time.monotonic() + START_RETRY_S > deadline:
                        topo = self.pipeline.topology
                        edges = ", ".join(
                            f"{e.source}->{e.target}"
                            for e in topo.edges
                            if self.stage in (e.source, e.target) and topo.edge_connector(e) is kind
                        )
                        raise ConnectorUnavailable(
                            f"connector {kind.value!r} (edges {edges}) did not start in "
                            f"{self.settings.start_timeout_s:.0f}s ({attempt} attempts): {err}"
                        ) from err
                    log.warning("stage %s: connector %s not started yet (%s); retrying", self.stage, kind.value, err)
                    await asyncio.sleep(START_RETRY_S)

    def _runtime_info(self, kind: ConnectorKind) -> dict[str, Any]:
        s = self.settings
        info: dict[str, Any] = {}
        if kind is ConnectorKind.SHM:
            info = {"pipeline": self.pipeline.name, "owner": s.owner, "pool_max_bytes": s.shm_pool_bytes}
        elif kind is ConnectorKind.MOONCAKE:
            info = {
                "pipeline": self.pipeline.name,
                "local_hostname": s.mooncake_host,
                "master_host": self.pipeline.mooncake_master_host or "127.0.0.1",
            }
        return {**info, **s.extra.get(kind.value, {})}

    async def put(self, kind: str, target: str, key: str, payload: dict[str, Any]) -> AnyHandle:
        started = time.perf_counter()
        handle = await self.connector(kind).put(self.stage, target, key, payload)
        self._observe(kind, "put", handle.nbytes, started)
        return handle

    async def get(self, handle: Handle) -> dict[str, Any]:
        started = time.perf_counter()
        data = await self.connector(handle.kind).get(handle)
        self._observe(handle.kind.value, "get", handle.nbytes, started)
        return data

    async def release(self, handle: Handle) -> None:
        await self.connector(handle.kind).release(handle)

    def unreleased(self) -> int:
        """Payloads this process `put` that nobody has released yet (consumers may still read them).

        Counted by the connectors that keep their payloads in this process (shm, mooncake p2p);
        inline payloads travel in the messages, and mooncake store objects live in the store."""
        total = 0
        for conn in self._connectors.values():
            stats = getattr(conn, "stats", None)
            if stats is not None:
                total += int(stats().get("busy", 0))
        return total

    def trim(self) -> None:
        """Let the shm pool unlink idle segments beyond its limit (consumers release in other
        processes; the owner notices on its next put, or here)."""
        shm = self._connectors.get(ConnectorKind.SHM)
        if shm is not None:
            shm.trim()

    def close(self) -> None:
        for conn in self._connectors.values():
            conn.close()
        self._connectors.clear()

    def _observe(self, kind: str, op: str, nbytes: int, started: float) -> None:
        labels = (self.pipeline.name, self.stage, kind, op)
        M.connector_bytes.labels(*labels).inc(nbytes)
        M.connector_seconds.labels(*labels).observe(time.perf_counter() - started)
