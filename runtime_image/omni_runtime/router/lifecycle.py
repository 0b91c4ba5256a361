"""The router's shutdown: on SIGTERM it drains instead of cutting requests.

uvicorn stops accepting connections at once (so readiness fails and the pod leaves its Service) and
waits for the requests it runs; `Lifecycle` bounds that wait. When the drain period ends, every request
still running (or still waiting for admission) fails with a retriable 503 that says why, streamed
requests with an error event, instead of a dropped connection or a hang.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

from omni_runtime.router.errors import RouterDraining

__all__ = ["Lifecycle"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class Lifecycle:
    """Whether the router drains, and the end of its drain period."""

    def __init__(self) -> None:
        self.draining = False
        self.timeout_s = 0.0
        self._expired = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None

    @property
    def expired(self) -> bool:
        return self._expired.is_set()

    def begin_drain(self, timeout_s: float) -> None:
        """Start the drain period (idempotent); call it on the event loop."""
        if self.draining:
            return
        self.draining = True
        self.timeout_s = timeout_s
        log.info("router draining: running requests have %gs to finish; new connections are refused", timeout_s)
        self._timer = asyncio.get_running_loop().call_later(timeout_s, self._expire)

    def _expire(self) -> None:
        log.warning("router drain period of %gs ended: failing the requests still running with 503", self.timeout_s)
        self._expired.set()

    def error(self) -> RouterDraining:
        return RouterDraining(
            f"the router shut down before this request finished: its drain period of {self.timeout_s:g}s "
            "ended (router terminationGracePeriodSeconds); retry the request, other router replicas take it"
        )

    async def bounded(self, work: Awaitable[T]) -> T:
        """Await `work`; if the drain period ends first, cancel it and raise RouterDraining."""
        task = asyncio.ensure_future(work)
        if self._expired.is_set():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise self.error()
        expired = asyncio.ensure_future(self._expired.wait())
        try:
            await asyncio.wait({task, expired}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
        finally:
            expired.cancel()
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise self.error()
