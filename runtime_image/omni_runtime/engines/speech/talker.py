"""The talker stage engine (Qwen3-Omni): step-batched codec-frame decoding fed by the thinker's tokens.

API for a stage server or a test (all on the event loop): `add_request(id, prompt_ids, speaker,
params)`, `push_text(id, token_ids, finished)`, `frames(id)` (an async iterator of frame lists, each
frame 16 codes, ending when the request finishes), `abort(id)`. `generate(EngineInput)` wires the
same for the stage server: the first chunk's `thinker_prompt_ids` and `thinker_token_ids` (and, for
a prompt with media, `thinker_media_rows` and `thinker_media_grids`: see `media_inputs`), then
each later chunk's `thinker_token_ids` (new tokens), the speaker from param `voice`; it yields
`{"codes": int64 array (frames, 16)}` as frames are made.

One background task runs the decode loop (`Qwen3Talker.advance`) in a worker thread, one iteration
at a time, over every live request: a new request joins at the next iteration, a finished or
aborted one leaves at the next. When no request can move (all wait for thinker tokens) the loop
sleeps until text, a request or an abort arrives. Engine args: `device` (cuda when available),
`torch_dtype` (bfloat16 on cuda, float32 on cpu), `max_requests` (64: more running at once are refused).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from omni_runtime.engines.base import Engine, EngineError, EngineInput, EngineOutput, InvalidRequest
from omni_runtime.engines.speech.sampling import Sampling
from omni_runtime.engines.speech.stage_args import checked_engine_args, stage_device, stage_dtype, stage_model_path
from omni_runtime.spec import ResolvedPipeline, StageSpec

__all__ = ["Qwen3TalkerEngine", "engine_device_and_dtype"]

log = logging.getLogger(__name__)

DEFAULT_SPEAKER = "ethan"
ENGINE_ARGS = {"runner", "device", "torch_dtype", "max_requests"}


def engine_device_and_dtype(stage: StageSpec) -> tuple[str, Any, dict[str, Any]]:
    """(device, torch dtype, the other engine args) for a speech stage; unknown keys are refused."""
    args = checked_engine_args(stage, ENGINE_ARGS)
    device = stage_device(args)
    return device, stage_dtype(stage, args, "bfloat16" if device.startswith("cuda") else "float32"), args


MEDIA_GRID_KEYS = {
    "image_grid_thw",
    "video_grid_thw",
    "video_second_per_grid",
    "audio_feature_lengths",
    "use_audio_in_video",
}


def media_inputs(data: dict[str, Any], stage: str) -> Any:
    """`MediaInputs` from a first chunk's `thinker_media_rows` (media positions, hidden) and
    `thinker_media_grids` ({image_grid_thw, video_grid_thw, video_second_per_grid,
    audio_feature_lengths, use_audio_in_video}); None without rows. Raises InvalidRequest on a
    malformed one (the shapes against the prompt are checked by `Qwen3Talker.new_request`)."""
    import torch

    from omni_runtime.engines.speech.qwen3_talker import MediaInputs

    rows = data.get("thinker_media_rows")
    if rows is None:
        return None
    grids = data.get("thinker_media_grids") or {}
    unknown = sorted(set(grids) - MEDIA_GRID_KEYS) if isinstance(grids, dict) else None
    if unknown is None or unknown:
        raise InvalidRequest(
            f"stage {stage!r}: thinker_media_grids must be a mapping with keys from {sorted(MEDIA_GRID_KEYS)}; "
            f"got {unknown if unknown is not None else type(grids).__name__}"
        )
    try:
        return MediaInputs(
            rows=rows if isinstance(rows, torch.Tensor) else torch.as_tensor(rows),
            image_grid_thw=[[int(v) for v in g] for g in grids.get("image_grid_thw") or []],
            video_grid_thw=[[int(v) for v in g] for g in grids.get("video_grid_thw") or []],
            video_second_per_grid=[float(v) for v in grids.get("video_second_per_grid") or []],
            audio_feature_lengths=[int(v) for v in grids.get("audio_feature_lengths") or []],
            use_audio_in_video=bool(grids.get("use_audio_in_video", False)),
        )
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"stage {stage!r}: unreadable thinker_media_grids {grids!r}: {exc}") from None


@dataclass(eq=False)
class _Live:
    request: Any
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    inbox: list[int] = field(default_factory=list)
    inbox_done: bool = False
    aborted: bool = False
    frames: int = 0


class Qwen3TalkerEngine(Engine):
    """`generation` stage with engine arg `runner: qwen3_omni_talker` (see the module docstring)."""

    streams_input = True

    def __init__(self, pipeline: ResolvedPipeline, stage: StageSpec) -> None:
        super().__init__(pipeline, stage)
        self.model_path = stage_model_path(pipeline, stage)
        self.device, self.dtype, args = engine_device_and_dtype(stage)
        self.max_requests = int(args.get("max_requests", 64))
        self.model: Any = None
        self._live: dict[str, _Live] = {}
        self._lock = threading.Lock()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stats = {"steps_total": 0.0, "frames_total": 0.0, "last_step_seconds": 0.0}

    async def start(self) -> None:
        from omni_runtime.engines.speech.qwen3_talker import Qwen3Talker

        try:
            self.model = await asyncio.to_thread(Qwen3Talker, self.model_path, self.device, self.dtype)
        except Exception as exc:
            raise EngineError(f"stage {self.stage.name!r}: cannot load the talker of {self.model_path}: {exc}") from exc
        self._task = asyncio.create_task(self._loop(), name=f"talker-{self.stage.name}")

    def voices(self) -> list[str]:
        return sorted(self.model.speakers) if self.model is not None else []

    # -- the request API -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        speaker: str | None,
        params: dict[str, Any],
        media: Any = None,
    ) -> None:
        """Register a request (`media`: a `qwen3_talker.MediaInputs` for a prompt with media); raises
        InvalidRequest (unknown speaker, no assistant turn, bad params, media rows that do not fit)."""
        from omni_runtime.engines.speech.qwen3_talker import MediaPromptError

        if self.model is None:
            raise EngineError(f"stage {self.stage.name!r} is not started")
        if request_id in self._live:
            raise InvalidRequest(f"request {request_id!r} is already running on stage {self.stage.name!r}")
        if len(self._live) >= self.max_requests:
            raise EngineError(f"stage {self.stage.name!r} runs {len(self._live)} requests (max_requests); retry later")
        try:
            sampling = Sampling.from_params(params, default_max=4096)
            request = self.model.new_request(request_id, prompt_ids, speaker or DEFAULT_SPEAKER, sampling, media)
        except (KeyError, ValueError, MediaPromptError) as exc:
            raise InvalidRequest(f"stage {self.stage.name!r}: {exc.args[0] if exc.args else exc}") from None
        self._live[request_id] = _Live(request)
        self._wake.set()

    def push_text(self, request_id: str, token_ids: list[int], finished: bool = False) -> None:
        """Append thinker tokens (and say whether the thinker is done); unknown ids are ignored."""
        live = self._live.get(request_id)
        if live is None:
            return
        with self._lock:
            live.inbox.extend(int(t) for t in token_ids)
            live.inbox_done = live.inbox_done or finished
        self._wake.set()

    async def frames(self, request_id: str) -> AsyncIterator[tuple[list[list[int]], str | None]]:
        """(new frames, finish reason or None) as they are made; the last item has the reason."""
        live = self._live[request_id]
        while True:
            frames, reason = await live.out.get()
            yield frames, reason
            if reason is not None:
                return

    async def abort(self, request_id: str) -> None:
        """Stop a request at the next step boundary; its frames iterator ends with reason 'abort'."""
        live = self._live.get(request_id)
        if live is not None:
            live.aborted = True
            self._wake.set()

    # -- the stage-server seam ------------------------------------------------------------------

    async def generate(self, request: EngineInput) -> AsyncIterator[EngineOutput]:
        import numpy as np

        rid = request.request_id
        data = request.data
        prompt = data.get("thinker_prompt_ids")
        if not prompt:
            raise InvalidRequest(
                f"stage {self.stage.name!r} needs thinker_prompt_ids (the thinker's prompt token ids) in its "
                f"first input; got {sorted(data)}"
            )
        media = media_inputs(data, self.stage.name)
        self.add_request(rid, [int(t) for t in prompt], request.params.get("voice"), request.params, media)
        self.push_text(rid, list(data.get("thinker_token_ids") or []), finished=request.chunks is None)
        feeder = asyncio.create_task(self._feed(rid, request.chunks)) if request.chunks is not None else None
        try:
            async for frames, reason in self.frames(rid):
                if frames:
                    yield EngineOutput(rid, {"codes": np.asarray(frames, dtype=np.int64)})
                if reason is not None and reason.startswith("error"):
                    raise EngineError(f"stage {self.stage.name!r}: the talker failed on request {rid!r}: {reason}")
                if reason is not None:
                    live = self._live[rid]
                    usage = {"prompt_tokens": len(prompt), "completion_tokens": live.frames}
                    yield EngineOutput(rid, {}, finished=True, finish_reason=reason, usage=usage)
        finally:
            if feeder is not None:
                feeder.cancel()
            await self.abort(rid)
            self._live.pop(rid, None)

    async def _feed(self, rid: str, chunks: AsyncIterator[dict[str, Any]]) -> None:
        try:
            async for chunk in chunks:
                self.push_text(rid, list(chunk.get("thinker_token_ids") or []))
        finally:
            self.push_text(rid, [], finished=True)

    # -- the loop --------------------------------------------------------------------------------

    def _step(self, lives: list[_Live]) -> tuple[dict[str, list[list[int]]], bool]:
        with self._lock:
            for live in lives:
                live.request.text.extend(live.inbox)
                live.inbox.clear()
                live.request.text_done = live.inbox_done
        started = time.monotonic()
        frames, moved = self.model.advance([live.request for live in lives])
        if moved:
            self._stats["steps_total"] += 1
            self._stats["last_step_seconds"] = time.monotonic() - started
        return frames, moved

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                lives = []
                for live in list(self._live.values()):
                    if live.aborted and live.request.finish_reason is None:
                        live.request.finish_reason = "abort"
                        live.out.put_nowait(([], "abort"))
                    if live.request.finish_reason is None:
                        lives.append(live)
                if not lives:
                    break
                try:
                    frames, moved = await asyncio.to_thread(self._step, lives)
                except Exception as exc:  # a model fault fails the requests it touched, not the stage
                    log.exception("talker step failed")
                    for live in lives:
                        live.request.finish_reason = "error"
                        live.out.put_nowait(([], f"error: {exc}"))
                    continue
                for live in lives:
                    new = frames.get(live.request.id, [])
                    live.frames += len(new)
                    self._stats["frames_total"] += len(new)
                    if new or live.request.finish_reason is not None:
                        live.out.put_nowait((new, live.request.finish_reason))
                if not moved:
                    break

    async def stop(self) -> None:
        """Stop the loop; requests still running end with reason 'abort'."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        for live in self._live.values():
            if live.request.finish_reason is None:
                live.request.finish_reason = "abort"
                live.out.put_nowait(([], "abort"))
        self.model = None

    def stats(self) -> dict[str, float]:
        return {"running_requests": float(len(self._live)), **self._stats}
