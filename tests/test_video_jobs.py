"""The video job store of one router replica (`router/jobs.py`), with runners standing in for the pipeline
(the seam `VideoJobs.submit` takes; the served pipeline is tested in test_serve_video.py): ids that name
their owner, the TTL, the size cap (oldest first), a restart finding the finished videos again, and a
failing run ending `failed` with its reason."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from omni_runtime.router.errors import StageLost
from omni_runtime.router.jobs import VideoJobs, owner_of
from omni_runtime.router.protocol.videos import VideoJob
from omni_runtime.spec import VideoLimits

pytestmark = pytest.mark.asyncio

MiB = 1024**2


def job(jobs: VideoJobs) -> VideoJob:
    return VideoJob(id=jobs.new_id(), created_at=int(time.time()), model="m", prompt="p", seconds="1", size="64x64")


def runner(size: int):
    async def run(progress):
        progress(1, 2)
        progress(2, 2)
        return b"\0" * size, {"num_frames": 5, "fps": 8, "width": 64, "height": 64}

    return run


async def finished(jobs: VideoJobs, size: int) -> VideoJob:
    new = job(jobs)
    jobs.submit(new, runner(size))
    done, error = await jobs.wait(new.id)
    assert error is None and done.status == "completed"
    return done


async def test_ids_name_their_owner() -> None:
    jobs = VideoJobs("p", VideoLimits(), Path("/nonexistent"), "10.1.2.3:8000")
    new = jobs.new_id()
    assert owner_of(new) == "10.1.2.3:8000" and jobs.owns(new)
    assert owner_of("video_nope") is None and owner_of("video_!!_x") is None and owner_of("chatcmpl-1") is None
    tag = new.split("_")[1]
    assert owner_of(f"video_{tag}_..") is None and owner_of(f"video_{tag}_{'g' * 24}") is None


async def test_ttl_and_size_cap_remove_videos_and_a_restart_finds_the_rest(tmp_path: Path) -> None:
    limits = VideoLimits(ttl_s=60, max_bytes=MiB)
    jobs = VideoJobs("p", limits, tmp_path, "127.0.0.1:1")
    await jobs.start()
    try:
        first = await finished(jobs, 400 * 1024)
        assert first.progress == 100 and first.num_frames == 5 and first.bytes == 400 * 1024
        assert jobs.content(first.id) is not None
        await asyncio.sleep(0.01)  # distinct file times
        second = await finished(jobs, 400 * 1024)
        third = await finished(jobs, 400 * 1024)  # 1.2 MiB > 1 MiB: the oldest goes
        assert jobs.get(first.id) is None and jobs.content(first.id) is None
        assert jobs.content(second.id) is not None and jobs.content(third.id) is not None
    finally:
        await jobs.stop()
    again = VideoJobs("p", limits, tmp_path, "127.0.0.1:2")  # a restarted replica, on the same volume
    await again.start()
    try:
        assert {j.id for j in again.jobs()} == {second.id, third.id}
        assert again.content(second.id).read_bytes() == b"\0" * 400 * 1024
        assert sorted(again.sweep(now=time.time() + 61)) == sorted([second.id, third.id])
        assert again.jobs() == [] and list(tmp_path.iterdir()) == []
    finally:
        await again.stop()


async def test_a_failed_run_says_why_and_a_video_over_the_cap_fails(tmp_path: Path) -> None:
    jobs = VideoJobs("p", VideoLimits(max_bytes=MiB), tmp_path, "127.0.0.1:1")
    await jobs.start()
    try:

        async def dies(progress):
            raise StageLost("stage 'dit' replica 1.2.3.4 failed while running request x")

        new = job(jobs)
        jobs.submit(new, dies)
        done, error = await jobs.wait(new.id)
        assert done.status == "failed" and "failed while running request" in done.error.message
        assert isinstance(error, StageLost) and done.error.code == "BadGatewayError"
        big = job(jobs)
        jobs.submit(big, runner(2 * MiB))
        done, _ = await jobs.wait(big.id)
        assert done.status == "failed" and "router.videos.maxBytes" in done.error.message
    finally:
        await jobs.stop()
