"""Bounded admission: at most `max_concurrent` requests in flight, `max_queued` more waiting (FIFO);
anything beyond is refused at once with 429 and a Retry-After."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

from omni_runtime.router.errors import Overloaded

__all__ = ["Admission", "Slot"]


class Slot:
    """One admitted request; `release()` (idempotent) lets the next waiting request in."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._release()

    async def __aenter__(self) -> Slot:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class Admission:
    """Counts in-flight and waiting requests; `on_change(in_flight, queued)` feeds the gauges."""

    def __init__(
        self,
        max_concurrent: int,
        max_queued: int,
        *,
        retry_after_s: int = 1,
        on_change: Callable[[int, int], None] | None = None,
    ) -> None:
        if max_concurrent < 1 or max_queued < 0:
            raise ValueError("max_concurrent must be >= 1 and max_queued >= 0")
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._on_change = on_change

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> Slot:
        """A slot now, or after waiting in line; Overloaded when the line is full.

        Cancelling the wait (client gone, timeout) leaves the line without taking a slot."""
        if self.in_flight < self.max_concurrent and not self._waiters:
            self.in_flight += 1
            self._changed()
            return Slot(self)
        if len(self._waiters) >= self.max_queued:
            raise Overloaded(
                f"the server is at capacity: {self.in_flight} requests in flight (limit "
                f"{self.max_concurrent}) and {len(self._waiters)} waiting (limit {self.max_queued}); "
                f"retry after {self.retry_after_s}s or raise router.limits",
                retry_after=self.retry_after_s,
            )
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._changed()
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():  # the slot was handed over just now: pass it on
                self._release()
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
                self._changed()
            raise
        return Slot(self)

    def _release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot moves to the waiter; in_flight is unchanged
                self._changed()
                return
        self.in_flight -= 1
        self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.in_flight, len(self._waiters))
