"""The diffusion engine's keyed batcher: requests with the same key run as one pipeline call, with abort.

Requests that arrive within `window` seconds of the oldest waiting one and share its key (`request.Job.key`)
run as ONE call, up to `max_images` images. The call itself is a function the engine hands in (`call`, run
in a worker thread, one call at a time, so the event loop stays responsive); so is the encoding of a call's
results (`encode`), which runs while the next call runs on the device. A queued request that is aborted
leaves the queue; a running one's result is discarded, and the engine's step callback stops the call
(`Interrupted`) once every request of it is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from omni_runtime.engines.base import EngineError
from omni_runtime.engines.diffusion.parallel import RankDied
from omni_runtime.engines.diffusion.request import Job, call_steps

__all__ = ["Batcher", "Interrupted"]

log = logging.getLogger(__name__)

Results = list[dict[str, Any]]
"""One output payload per job of a call."""


class Interrupted(Exception):
    """Raised between two denoising steps once every request of the batch is aborted."""


class Batcher:
    """Gathers jobs into pipeline calls by key and hands each job its result (or error) through its future.

    `stats` holds `last_batch_size` (requests), `last_batch_images`, `last_batch_seconds`, `last_step_seconds`,
    `batches_total`; `batch_log` the request ids of the last 100 pipeline calls.
    """

    def __init__(
        self,
        stage_name: str,
        call: Callable[[list[Job]], Results],
        encode: Callable[[Results], Awaitable[Results]],
        window: float,
        max_images: int,
    ) -> None:
        self.stage_name = stage_name
        self.call = call
        """One pipeline call for a batch (run in a worker thread); one output payload per job."""
        self.encode = encode
        """A call's outputs as the stage returns them (PNG, MP4), run while the next call runs."""
        self.window = window
        """Seconds the oldest waiting request waits for company."""
        self.max_images = max_images
        self.default_steps = 1
        """The steps of a call that leaves num_inference_steps to the pipeline (the pipeline's default)."""
        self.pending: list[Job] = []
        self.running: list[Job] = []
        self.batch_log: deque[list[str]] = deque(maxlen=100)
        self.stats = {
            "last_batch_size": 0.0,
            "last_batch_images": 0.0,
            "last_batch_seconds": 0.0,
            "last_step_seconds": 0.0,
            "batches_total": 0.0,
        }
        self._arrived: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._current: asyncio.Future | None = None
        self._encoding: asyncio.Future | None = None

    @property
    def started(self) -> bool:
        """Whether `start` ran (the batcher takes jobs)."""
        return self._arrived is not None

    def start(self) -> None:
        """Start gathering (on the event loop)."""
        self._arrived = asyncio.Event()
        self._worker = asyncio.create_task(self._loop(), name=f"diffusion-batcher-{self.stage_name}")

    def submit(self, job: Job) -> None:
        """Queue `job` (its `future` set) for the next call its key fits."""
        assert self._arrived is not None, "a started batcher takes jobs"
        self.pending.append(job)
        self._arrived.set()

    def withdraw(self, job: Job) -> None:
        """Take `job` out of the queue (its consumer went away while it waited); a running job stays."""
        if job in self.pending:
            self.pending.remove(job)

    def abort(self, request_id: str) -> None:
        """Drop a queued request (its result is None); a running one's result is discarded."""
        for job in list(self.pending):
            if job.request_id == request_id:
                self.pending.remove(job)
                if job.future is not None and not job.future.done():
                    job.future.set_result(None)
        for job in self.running:
            if job.request_id == request_id:
                job.aborted = True

    def fail(self, error: BaseException, grace_s: float) -> None:
        """The engine died: queued jobs fail now with `error`, and the running call's jobs after `grace_s`
        (its call should end sooner, failing them with its own error)."""
        for job in self.pending:
            if job.future is not None and not job.future.done():
                job.future.set_exception(error)
        self.pending.clear()
        running = list(self.running)

        def fail_running() -> None:
            for job in running:
                if job.future is not None and not job.future.done():
                    job.future.set_exception(error)

        asyncio.get_running_loop().call_later(grace_s, fail_running)

    async def stop(self, running_wait_s: float | None) -> None:
        """Stop gathering, give a running call `running_wait_s` to end (None: as long as it takes), let encoded
        results reach their requests, and fail every job left."""
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker
        if self._current is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._current), running_wait_s)
        if self._encoding is not None:  # results already computed reach their requests
            with contextlib.suppress(Exception):
                await self._encoding
        for job in self.pending + self.running:
            if job.future is not None and not job.future.done():
                job.future.set_exception(EngineError(f"stage {self.stage_name!r} is stopping"))
        self.pending.clear()
        self.running = []

    def steps_queued(self) -> float:
        """The backlog an autoscaler reads: denoising steps still to run for the requests waiting or running
        (a running one less the steps its step callback reported done)."""
        return float(
            sum(call_steps(j.call, self.default_steps) for j in self.pending)
            + sum(max(0, call_steps(j.call, self.default_steps) - j.steps_done) for j in self.running)
        )

    async def _loop(self) -> None:
        assert self._arrived is not None
        loop = asyncio.get_running_loop()
        while True:
            while not self.pending:
                self._arrived.clear()
                await self._arrived.wait()
            first = self.pending[0]
            deadline = first.arrival + self.window
            while self.pending and self.pending[0] is first and loop.time() < deadline:
                if sum(j.n for j in self.pending if j.key == first.key) >= self.max_images:
                    break
                self._arrived.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._arrived.wait(), deadline - loop.time())
            if not self.pending or self.pending[0] is not first:
                continue  # the oldest request was aborted while we gathered
            batch, images = [], 0
            for job in list(self.pending):
                if job.key == first.key and images + job.n <= self.max_images:
                    batch.append(job)
                    images += job.n
                    self.pending.remove(job)
            await self._run_batch(batch)

    async def _run_batch(self, batch: list[Job]) -> None:
        self.running = batch
        started = time.monotonic()
        self._current = asyncio.ensure_future(asyncio.to_thread(self.call, batch))
        try:
            results = await asyncio.shield(self._current)
        except Interrupted:
            log.info("stage %s: stopped a pipeline call: every request of it was aborted", self.stage_name)
            self.batch_log.append([j.request_id for j in batch])
            for job in batch:
                if job.future is not None and not job.future.done():
                    job.future.set_result(None)
            return
        except Exception as exc:
            ids = [j.request_id for j in batch]
            log.exception("stage %s: pipeline call failed for %s", self.stage_name, ids)
            error = (
                exc
                if isinstance(exc, RankDied)
                else EngineError(f"stage {self.stage_name!r}: the diffusion pipeline failed: {exc}")
            )
            for job in batch:
                if job.future is not None and not job.future.done():
                    job.future.set_exception(error)
            return
        finally:
            self._current = None
            self.running = []
        seconds = time.monotonic() - started
        steps = call_steps(batch[0].call, self.default_steps)
        self.stats.update(
            last_batch_size=float(len(batch)),
            last_batch_images=float(sum(j.n for j in batch)),
            last_batch_seconds=seconds,
            last_step_seconds=seconds / steps,
            batches_total=self.stats["batches_total"] + 1,
        )
        self.batch_log.append([j.request_id for j in batch])
        # Encode this batch's results on another thread while the next batch runs on the device: the
        # accelerator never waits for CPU-side encoding. One batch encodes at a time (bounded memory).
        if self._encoding is not None:
            await asyncio.shield(self._encoding)
        self._encoding = asyncio.ensure_future(self._deliver(batch, results))

    async def _deliver(self, batch: list[Job], results: Results) -> None:
        try:
            encoded = await self.encode(results)
        except Exception as exc:
            error = EngineError(f"stage {self.stage_name!r}: encoding the images failed: {exc}")
            for job in batch:
                if job.future is not None and not job.future.done():
                    job.future.set_exception(error)
            return
        for job, result in zip(batch, encoded, strict=True):
            if job.future is not None and not job.future.done():
                job.future.set_result(None if job.aborted else result)
