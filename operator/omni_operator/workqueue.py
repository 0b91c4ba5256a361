"""A work queue in the manner of controller-runtime: keys, not events.

Events only say *which* object to look at; a key queued many times is reconciled once, never by two
workers at once, and a failed key comes back after an exponential backoff.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["WorkQueue"]

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)


class WorkQueue(Generic[K]):
    """Deduplicating, per-key serial, rate-limited queue feeding `workers` coroutines."""

    def __init__(
        self,
        handler: Callable[[K], Awaitable[None]],
        *,
        workers: int = 8,
        base_delay: float = 0.5,
        max_delay: float = 60.0,
    ) -> None:
        self._handler = handler
        self._workers = workers
        self._base_delay = base_delay
        self._max_delay = max_delay
        self._queue: asyncio.Queue[K] = asyncio.Queue()
        self._queued: set[K] = set()
        self._active: set[K] = set()
        self._dirty: set[K] = set()
        self._failures: dict[K, int] = {}
        self._delayed: dict[K, asyncio.TimerHandle] = {}
        self._tasks: list[asyncio.Task] = []

    def add(self, key: K) -> None:
        """Queue `key` now (at most once; if it is being worked on, once more after)."""
        if key in self._active:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    def add_after(self, key: K, delay: float) -> None:
        if key in self._delayed:
            return
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self._delayed.pop(key, None)
            self.add(key)

        self._delayed[key] = loop.call_later(delay, fire)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._work(), name=f"reconcile-worker-{i}") for i in range(self._workers)]

    async def stop(self) -> None:
        for handle in self._delayed.values():
            handle.cancel()
        self._delayed.clear()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def depth(self) -> int:
        return len(self._queued)

    def idle(self) -> bool:
        return not self._queued and not self._active and not self._delayed

    async def _work(self) -> None:
        while True:
            key = await self._queue.get()
            self._queued.discard(key)
            self._active.add(key)
            try:
                await self._handler(key)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures = self._failures.get(key, 0) + 1
                self._failures[key] = failures
                delay = min(self._max_delay, self._base_delay * 2 ** (failures - 1))
                log.warning("reconcile %s failed (%s); retrying in %.1fs", key, exc, delay)
                self.add_after(key, delay)
            else:
                self._failures.pop(key, None)
            finally:
                self._active.discard(key)
                if key in self._dirty:
                    self._dirty.discard(key)
                    self.add(key)
