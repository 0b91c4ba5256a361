"""The connectors one stage process uses, one per kind, made on first use and timed into metrics.

Which kinds exist and how each is made is the connectors registry's business (`connectors.registry`);
this module only keeps the stage's connectors, starts those its edges need, and times every call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from omni_runtime.connectors import Connector, ConnectorError, ConnectorSettings, Handle, registry
from omni_runtime.metrics import Stage as M
from omni_runtime.spec import ConnectorKind, ResolvedPipeline

__all__ = ["ConnectorSet", "ConnectorSettings", "ConnectorUnavailable"]

log = logging.getLogger(__name__)

START_RETRY_S = 2.0
"""Pause between attempts to start a connector at start-up."""


class ConnectorUnavailable(ConnectorError):
    """A connector an edge of the stage needs could not start within the start-up time."""


class ConnectorSet:
    """Lazily built connectors of a stage process, by kind; `put`/`get`/`release` through them."""

    def __init__(self, pipeline: ResolvedPipeline, stage: str, settings: ConnectorSettings) -> None:
        self.pipeline = pipeline
        self.stage = stage
        self.settings = settings
        self._connectors: dict[str, Connector] = {}

    def connector(self, kind: str) -> Connector:
        """This process's connector of `kind`, made on first use (an unknown kind is a ValueError)."""
        name = str(kind)
        found = self._connectors.get(name)
        if found is None:
            info = registry.runtime_info(name, self.pipeline, self.settings)
            found = self._connectors[name] = registry.make_connector(name, self.pipeline.topology.connectors, **info)
            stats = getattr(found, "stats", None)  # pooled connectors know what is still lent out
            if stats is not None:
                gauge = M.connector_unreleased.labels(self.pipeline.name, self.stage, name)
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

    async def put(self, kind: str, target: str, key: str, payload: dict[str, Any]) -> Handle:
        started = time.perf_counter()
        handle = await self.connector(kind).put(self.stage, target, key, payload)
        self._observe(kind, "put", handle.nbytes, started)
        return handle

    async def get(self, handle: Handle) -> dict[str, Any]:
        started = time.perf_counter()
        data = await self.connector(handle.kind).get(handle)
        self._observe(handle.kind, "get", handle.nbytes, started)
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
        """Let the pools of the kinds that ask for it (`KindDeclaration.trim_on_tick`: shm) give back idle
        memory beyond their limit (consumers release in other processes; the owner notices on its next
        put, or here)."""
        for name, conn in self._connectors.items():
            if registry.declaration(name).trim_on_tick:
                conn.trim()

    def close(self) -> None:
        for conn in self._connectors.values():
            conn.close()
        self._connectors.clear()

    def _observe(self, kind: str, op: str, nbytes: int, started: float) -> None:
        labels = (self.pipeline.name, self.stage, str(kind), op)
        M.connector_bytes.labels(*labels).inc(nbytes)
        M.connector_seconds.labels(*labels).observe(time.perf_counter() - started)
