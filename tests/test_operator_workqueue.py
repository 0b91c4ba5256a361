"""The reconcile work queue: keys deduplicated, one worker per key at a time, failures retried with backoff."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Any

import pytest
from servelib import until

from omni_operator.workqueue import WorkQueue

pytestmark = pytest.mark.timeout(10)


async def test_a_key_added_many_times_while_queued_runs_once():
    calls: list[Hashable] = []

    async def handler(key: Hashable) -> None:
        calls.append(key)

    queue = WorkQueue(handler, workers=4)
    for _ in range(10):
        queue.add(("default", "a"))
    queue.add(("default", "b"))
    queue.add(("other", "a"))
    queue.start()
    try:
        await until(queue.idle, timeout=3.0, interval=0.002)
        await asyncio.sleep(0.02)  # nothing more arrives later
    finally:
        await queue.stop()
    assert sorted(calls) == [("default", "a"), ("default", "b"), ("other", "a")]


async def test_a_key_added_while_running_runs_once_more_after():
    calls: list[str] = []
    started, release = asyncio.Event(), asyncio.Event()

    async def handler(key: str) -> None:
        calls.append(key)
        if len(calls) == 1:
            started.set()
            await release.wait()

    queue = WorkQueue(handler, workers=4)
    queue.start()
    try:
        queue.add("a")
        await started.wait()
        for _ in range(5):
            queue.add("a")
        await asyncio.sleep(0.02)
        assert calls == ["a"]  # not started again while the first run is going
        release.set()
        await until(lambda: len(calls) == 2 and queue.idle(), timeout=3.0, interval=0.002)
        await asyncio.sleep(0.02)
    finally:
        await queue.stop()
    assert calls == ["a", "a"]


async def test_a_key_never_runs_on_two_workers_at_once():
    running: dict[str, int] = {}
    most_per_key: dict[str, int] = {}
    most_overall = 0
    runs: dict[str, int] = {}

    async def handler(key: str) -> None:
        nonlocal most_overall
        running[key] = running.get(key, 0) + 1
        most_per_key[key] = max(most_per_key.get(key, 0), running[key])
        most_overall = max(most_overall, sum(running.values()))
        runs[key] = runs.get(key, 0) + 1
        await asyncio.sleep(0.005)
        running[key] -= 1

    queue = WorkQueue(handler, workers=8)
    queue.start()
    try:
        for _ in range(40):
            for key in ("a", "b", "c"):
                queue.add(key)
            await asyncio.sleep(0.001)
        await until(queue.idle, timeout=3.0, interval=0.002)
    finally:
        await queue.stop()
    assert most_per_key == {"a": 1, "b": 1, "c": 1}
    assert most_overall > 1  # the workers did run different keys side by side
    assert all(runs[key] > 1 for key in ("a", "b", "c"))  # events during a run were not lost


class RecordingQueue(WorkQueue[str]):
    """The real queue, recording each retry delay it schedules (`add_after` is the queue's own
    entry point for a delayed key): the backoff policy is read from what the queue asked for, while the
    timers themselves are checked only from below (they never fire early, however loaded the machine;
    how late they fire says nothing about the queue)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scheduled: list[float] = []

    def add_after(self, key: str, delay: float) -> None:
        self.scheduled.append(delay)
        super().add_after(key, delay)


async def test_a_failing_key_is_retried_with_growing_delays_and_its_count_resets_after_success():
    loop = asyncio.get_running_loop()
    times: list[float] = []
    outcomes = iter(
        [
            False,
            False,
            False,
            False,
            True,  # four failures, then success
            False,
            True,
        ]
    )  # a later failure starts from the base delay again

    async def handler(key: str) -> None:
        times.append(loop.time())
        if not next(outcomes):
            raise RuntimeError("the world is not ready")

    base = 0.05
    queue = RecordingQueue(handler, workers=2, base_delay=base, max_delay=10.0)
    queue.start()
    try:
        queue.add("a")
        await until(lambda: len(times) == 5 and queue.idle(), timeout=3.0, interval=0.002)
        assert queue.scheduled == [base, 2 * base, 4 * base, 8 * base]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        for gap, expected in zip(gaps, queue.scheduled, strict=True):
            assert gap >= expected * 0.9, (gaps, expected)  # each retry did wait its delay
        queue.add("a")
        await until(lambda: len(times) == 7 and queue.idle(), timeout=3.0, interval=0.002)
        assert queue.scheduled[4:] == [base]  # not 16 * base: the success reset the count
        assert times[6] - times[5] >= base * 0.9
    finally:
        await queue.stop()


async def test_retry_delays_stop_growing_at_max_delay():
    loop = asyncio.get_running_loop()
    times: list[float] = []

    async def handler(key: str) -> None:
        times.append(loop.time())
        if len(times) < 7:
            raise RuntimeError("still failing")

    queue = RecordingQueue(handler, workers=1, base_delay=0.02, max_delay=0.03)
    queue.start()
    try:
        queue.add("a")
        await until(lambda: len(times) == 7 and queue.idle(), timeout=3.0, interval=0.002)
    finally:
        await queue.stop()
    assert queue.scheduled == [0.02] + [0.03] * 5  # uncapped, the last would be 0.64 s
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert all(gap >= delay * 0.9 for gap, delay in zip(gaps, queue.scheduled, strict=True)), gaps


async def test_stop_cancels_delayed_retries():
    calls: list[str] = []

    async def handler(key: str) -> None:
        calls.append(key)
        raise RuntimeError("fails")

    queue = WorkQueue(handler, workers=2, base_delay=0.1)
    queue.start()
    queue.add("a")
    await until(
        lambda: len(calls) == 1, timeout=3.0, interval=0.002
    )  # the handler fails without awaiting: its run is over
    assert not queue.idle()  # a retry is pending
    await queue.stop()
    assert queue.idle()
    await asyncio.sleep(0.2)  # past the retry delay
    assert queue.idle()  # the cancelled retry did not queue the key
    queue.start()  # a restarted queue has nothing to do either
    try:
        await asyncio.sleep(0.05)
    finally:
        await queue.stop()
    assert calls == ["a"]


async def test_a_key_added_during_a_failing_run_runs_again_without_waiting_for_the_backoff():
    """The backoff is an hour, far past the test's own timeout: the second run can only come from the
    event that arrived during the failing run, never from the retry timer."""
    runs = 0
    started, release = asyncio.Event(), asyncio.Event()

    async def handler(key: str) -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            started.set()
            await release.wait()
            raise RuntimeError("fails once")

    queue = RecordingQueue(handler, workers=2, base_delay=3600.0, max_delay=3600.0)
    queue.start()
    try:
        queue.add("a")
        await started.wait()
        queue.add("a")  # a new event while the failing run is going
        release.set()
        await until(lambda: runs == 2, timeout=8.0, interval=0.002)
        assert queue.scheduled == [3600.0]  # the failure did schedule its retry; the event did not wait for it
    finally:
        await queue.stop()
