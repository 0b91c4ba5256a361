"""Video jobs of one router replica: queue, run, keep the finished MP4s on a directory, expire them.

Ownership: a job lives on the replica that created it, and its id names that replica:
`video_<owner>_<random>`, `<owner>` being the replica's `host:port` in lowercase base32. Another
replica that gets `GET/DELETE /v1/videos/{id}` forwards it to that address — but only when the
address is one of this pipeline's router replicas it discovered (the EndpointSlices of the router
Service), so a forged id cannot make a router call anything else. Why forwarding rather than shared
state: the state that matters (the running orchestration, its cancellation, its progress) exists only
in the owner's memory, and would need a store (Redis, as AIBrix's gateway keeps) that omnikube does
not otherwise run; forwarding needs nothing new, and a job id alone says where to ask. Finished
videos are files: when the directory is a shared PVC every replica serves them itself, and a
restarted replica finds them again (each MP4 has a JSON sidecar holding its job).

Bounds (`router.limits.videos`): `max_concurrent_jobs` run at once, `max_queued_jobs` wait, more get
429; finished and failed jobs are kept `ttl_s`, and at most `max_bytes` of MP4s (oldest removed
first). A job whose stage dies, or whose replica disappears, fails with the reason; it never stays
`in_progress`. `request_timeout_s` does not apply to jobs (a video may take longer than any HTTP request
should); a hung stage is caught by the router's ping timeout instead. A SIGTERM's drain period bounds
them like requests.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from omni_runtime.metrics import Router as M
from omni_runtime.router.errors import OmniError, Overloaded
from omni_runtime.router.protocol.videos import VideoError, VideoJob
from omni_runtime.spec import VideoLimits

__all__ = ["JobRunner", "ProgressCallback", "VideoJobs", "owner_of"]

log = logging.getLogger(__name__)

ProgressCallback = Callable[[int, int], None]
"""`(steps_done, steps)` after each denoising step."""
JobRunner = Callable[[ProgressCallback], Awaitable[tuple[bytes, dict]]]
"""Runs a job's pipeline: the MP4 and what the stage reported (`num_frames`, `fps`, `width`, `height`)."""

_STATUSES = ("queued", "in_progress", "completed", "failed")


def _tag(address: str) -> str:
    return base64.b32encode(address.encode()).decode().rstrip("=").lower()


def owner_of(job_id: str) -> str | None:
    """The `host:port` of the replica owning `job_id`; None when the id is not one of ours."""
    parts = job_id.split("_")
    if len(parts) != 3 or parts[0] != "video" or not parts[1] or len(parts[1]) > 120:
        return None
    if len(parts[2]) != 24 or any(c not in "0123456789abcdef" for c in parts[2]):
        return None  # ids name files: only what new_id makes is ever looked up
    tag = parts[1].upper()
    try:
        return base64.b32decode(tag + "=" * (-len(tag) % 8)).decode("ascii")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None


@dataclass(eq=False)
class _Entry:
    job: VideoJob
    runner: JobRunner | None = None
    task: asyncio.Task | None = None
    error: OmniError | None = None
    """The error a failed job ended with (a sync request raises it)."""
    done: asyncio.Event = field(default_factory=asyncio.Event)
    started: float = field(default_factory=time.monotonic)


class VideoJobs:
    """The jobs this replica owns, and the finished videos on `directory`."""

    def __init__(self, pipeline: str, limits: VideoLimits, directory: Path, address: str) -> None:
        self.pipeline = pipeline
        self.limits = limits
        self.directory = directory
        self.address = address
        self.peers: set[str] = set()
        """`host:port` of this pipeline's other router replicas (from discovery; empty in local mode)."""
        self._tag = _tag(address)
        self._entries: dict[str, _Entry] = {}
        self._slots = asyncio.Semaphore(limits.max_concurrent_jobs)
        self._sweeper: asyncio.Task | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        for sidecar in sorted(self.directory.glob("*.json")):
            try:
                job = VideoJob.model_validate_json(sidecar.read_text())
            except (OSError, ValueError) as err:
                log.warning("video store: skipping %s: %s", sidecar, err)
                continue
            entry = _Entry(job)
            entry.done.set()
            self._entries[job.id] = entry
        if self._entries:
            log.info("video store %s: found %d finished job(s)", self.directory, len(self._entries))
        self._gauges()
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="video-jobs-sweeper")

    async def stop(self) -> None:
        tasks = [e.task for e in self._entries.values() if e.task is not None and not e.task.done()]
        if self._sweeper is not None:
            tasks.append(self._sweeper)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- jobs ----------------------------------------------------------------------------------

    def new_id(self) -> str:
        return f"video_{self._tag}_{secrets.token_hex(12)}"

    def owns(self, job_id: str) -> bool:
        return owner_of(job_id) == self.address

    def active(self) -> int:
        return sum(1 for e in self._entries.values() if e.job.status in ("queued", "in_progress"))

    def submit(self, job: VideoJob, runner: JobRunner) -> None:
        """Queue `job`; 429 when this replica already has as many jobs as it runs and queues."""
        room = self.limits.max_concurrent_jobs + self.limits.max_queued_jobs
        if self.active() >= room:
            raise Overloaded(
                f"this router replica has {self.active()} video jobs running or queued, its most "
                f"({self.limits.max_concurrent_jobs} running + {self.limits.max_queued_jobs} queued: "
                "router.limits.videos maxConcurrentJobs and maxQueuedJobs); retry later",
                retry_after=5,
            )
        entry = _Entry(job, runner)
        self._entries[job.id] = entry
        entry.task = asyncio.create_task(self._run(entry), name=f"video-job-{job.id}")
        self._gauges()

    def get(self, job_id: str) -> VideoJob | None:
        entry = self._entries.get(job_id)
        if entry is None:
            return self._from_disk(job_id)
        return entry.job

    def jobs(self) -> list[VideoJob]:
        return [e.job for e in self._entries.values()]

    def content(self, job_id: str) -> Path | None:
        """The MP4 of a completed job, when this replica (or the shared directory) has it."""
        job = self.get(job_id)
        path = self._mp4(job_id)
        return path if job is not None and job.status == "completed" and path.is_file() else None

    async def wait(self, job_id: str) -> tuple[VideoJob, OmniError | None]:
        entry = self._entries[job_id]
        await entry.done.wait()
        return entry.job, entry.error

    async def delete(self, job_id: str) -> bool:
        """Cancel a queued or running job (its stage work is aborted) or remove a finished one."""
        entry = self._entries.pop(job_id, None)
        found = entry is not None or self._sidecar(job_id).is_file()
        if entry is not None and entry.task is not None and not entry.task.done():
            entry.task.cancel()
            await asyncio.gather(entry.task, return_exceptions=True)
        await asyncio.to_thread(self._remove_files, job_id)
        self._gauges()
        return found

    # -- running -------------------------------------------------------------------------------

    async def _run(self, entry: _Entry) -> None:
        job = entry.job
        assert entry.runner is not None
        try:
            async with self._slots:
                job.status = "in_progress"
                self._gauges()

                def progress(done: int, steps: int) -> None:
                    job.denoising_steps_done, job.num_inference_steps = done, steps
                    job.progress = min(99, int(100 * done / max(steps, 1)))

                video, info = await entry.runner(progress)
                job.num_frames = info.get("num_frames", job.num_frames)
                job.fps = info.get("fps", job.fps)
                if info.get("width") and info.get("height"):
                    job.size = f"{info['width']}x{info['height']}"
                if len(video) > self.limits.max_bytes:
                    raise _TooLarge(
                        f"the video is {len(video)} bytes; this router keeps at most {self.limits.max_bytes} "
                        "bytes of videos (router.videos.maxBytes); ask for fewer frames or a smaller size"
                    )
                job.status, job.progress, job.bytes = "completed", 100, len(video)
                job.completed_at = int(time.time())
                job.expires_at = int(job.completed_at + self.limits.ttl_s)
                await asyncio.to_thread(self._store, job, video)
                M.video_e2el.labels(self.pipeline).observe(time.monotonic() - entry.started)
        except asyncio.CancelledError:
            M.video_jobs_finished.labels(self.pipeline, "cancelled").inc()
            raise
        except OmniError as err:
            self._fail(entry, err.type, err.message, err)
        except Exception as err:  # a bug or a full disk: the job says so instead of hanging
            log.exception("video job %s failed", job.id)
            self._fail(entry, "internal_error", f"{type(err).__name__}: {err}", OmniError(str(err)))
        else:
            M.video_jobs_finished.labels(self.pipeline, "completed").inc()
        finally:
            entry.done.set()
            self._gauges()

    def _fail(self, entry: _Entry, code: str, message: str, err: OmniError) -> None:
        job = entry.job
        job.status, job.error = "failed", VideoError(code=code, message=message)
        job.completed_at = int(time.time())
        job.expires_at = int(job.completed_at + self.limits.ttl_s)
        entry.error = err
        M.video_jobs_finished.labels(self.pipeline, "failed").inc()
        with contextlib.suppress(OSError):
            self._write_sidecar(job)

    # -- storage -------------------------------------------------------------------------------

    def _mp4(self, job_id: str) -> Path:
        return self.directory / f"{job_id}.mp4"

    def _sidecar(self, job_id: str) -> Path:
        return self.directory / f"{job_id}.json"

    def _from_disk(self, job_id: str) -> VideoJob | None:
        """A job another replica (sharing the directory) or an earlier run of this one finished."""
        if owner_of(job_id) is None:
            return None
        try:
            return VideoJob.model_validate_json(self._sidecar(job_id).read_text())
        except (OSError, ValueError):
            return None

    def _store(self, job: VideoJob, video: bytes) -> None:
        self._make_room(len(video))
        tmp = self._mp4(job.id).with_suffix(".mp4.tmp")
        tmp.write_bytes(video)
        os.replace(tmp, self._mp4(job.id))
        self._write_sidecar(job)

    def _write_sidecar(self, job: VideoJob) -> None:
        tmp = self._sidecar(job.id).with_suffix(".json.tmp")
        tmp.write_text(job.model_dump_json())
        os.replace(tmp, self._sidecar(job.id))

    def _remove_files(self, job_id: str) -> None:
        for path in (self._mp4(job_id), self._sidecar(job_id)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def _make_room(self, incoming: int) -> None:
        """Remove the oldest finished videos until `incoming` more bytes fit under `max_bytes`."""
        files = sorted(self.directory.glob("*.mp4"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        for path in files:
            if total + incoming <= self.limits.max_bytes:
                break
            job_id = path.stem
            total -= path.stat().st_size
            log.info("video store: removing %s to stay under %d bytes", job_id, self.limits.max_bytes)
            self._remove_files(job_id)
            self._entries.pop(job_id, None)

    async def _sweep_forever(self) -> None:
        every = max(1.0, min(60.0, self.limits.ttl_s / 4))
        while True:
            await asyncio.sleep(every)
            try:
                await asyncio.to_thread(self.sweep)
            except OSError as err:
                log.warning("video store %s: sweeping failed: %s", self.directory, err)
            self._gauges()

    def sweep(self, now: float | None = None) -> list[str]:
        """Remove the jobs (and files) whose `expires_at` has passed; returns their ids."""
        now = time.time() if now is None else now
        gone = [i for i, e in self._entries.items() if e.job.expires_at is not None and e.job.expires_at <= now]
        for sidecar in self.directory.glob("*.json"):
            if sidecar.stem in self._entries:
                continue
            job = self._from_disk(sidecar.stem)
            if job is not None and job.expires_at is not None and job.expires_at <= now:
                gone.append(job.id)
        for job_id in gone:
            self._entries.pop(job_id, None)
            self._remove_files(job_id)
        return gone

    def _gauges(self) -> None:
        counts = dict.fromkeys(_STATUSES, 0)
        for entry in self._entries.values():
            counts[entry.job.status] += 1
        for status, n in counts.items():
            M.video_jobs.labels(self.pipeline, status).set(n)
        M.video_queue_depth.labels(self.pipeline).set(counts["queued"])


class _TooLarge(OmniError):
    status, type = 507, "InsufficientStorage"
