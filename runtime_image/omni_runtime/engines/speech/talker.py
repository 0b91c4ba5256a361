"""The talker stage engines: step-batched codec decoding fed by the thinker, one loop for both models.

`TalkerEngine` is the machinery (a model class supplies the inputs): requests join the running batch
at the next step and leave when done, each with its own KV cache, and stop between steps when
aborted. API for a stage server or a test (all on the event loop): `add(id, first_payload, speaker,
params)`, `push(id, payload, finished)`, `frames(id)` (an async iterator of frame lists, ending
when the request finishes), `abort(id)`. `generate(EngineInput)` wires the same for the stage
server: the first chunk creates the request and is its first payload, each later chunk is pushed;
the speaker is param `voice`; it yields `TalkerOutput`s, `{"codes": int64 array (frames, codes per frame)}`.
The payloads are `processors.payloads.TalkerInput`s, as `processors.thinker_to_talker` builds them.

- `Qwen3TalkerEngine` (`runner: qwen3_omni_talker`, model `qwen3_talker.Qwen3Talker`, on CUDA wrapped
  in `slab_talker.SlabTalker`: KV slabs of `max_requests` slots, CUDA graphs): payloads are
  the thinker's token ids (`thinker_prompt_ids` first, then `thinker_token_ids`; for a prompt with
  media the first also has `thinker_media_rows` and `thinker_media_grids`: see `media_inputs`); 16
  codes per frame.
- `Qwen25TalkerEngine` (`runner: qwen2_5_omni_talker`, model `qwen25_talker.Qwen25Talker`): payloads
  also carry the thinker's rows (`thinker_embeds`, `thinker_hidden`, `thinker_hidden_layer`; for a
  prompt with media the first also has `thinker_media_grids`); 1 code per frame.

One background task runs the decode loop (the model's `advance`) in a worker thread, one iteration
at a time, over every live request. When no request can move (all wait for the thinker) the loop
sleeps until a payload, a request or an abort arrives. Engine args: `device` (cuda when available),
`torch_dtype` (bfloat16 on cuda, float32 on cpu), `max_requests` (64: more running at once are refused).

Before the stage reports ready, `start()` runs a self-check through `generate`: one greedy one-frame
request for the default speaker (a prefill and one code-predictor pass); when it fails the engine stops
and `start()` raises with what to change, instead of the stage failing every request.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

from omni_runtime.engines.base import (
    SELF_CHECK_ID,
    Engine,
    EngineError,
    EngineInput,
    EngineOutput,
    InvalidRequest,
    refuse_unknown_params,
    self_check,
)
from omni_runtime.engines.common import (
    default_device,
    one_build_at_a_time,
    stage_dtype,
    stage_model_path,
    typed_engine_args,
)
from omni_runtime.engines.speech.sampling import Sampling
from omni_runtime.processors.payloads import MediaGrids, TalkerInput, TalkerOutput, as_payload
from omni_runtime.spec import ResolvedPipeline, StageSpec
from omni_runtime.spec.engine_args import TalkerArgs

__all__ = ["Qwen25TalkerEngine", "Qwen3TalkerEngine", "TalkerEngine", "engine_device_and_dtype"]

log = logging.getLogger(__name__)


def engine_device_and_dtype(stage: StageSpec, args: TalkerArgs) -> tuple[str, Any]:
    """(device, torch dtype) of a talker stage: bfloat16 on CUDA and float32 elsewhere unless it names one."""
    device = default_device(args.device)
    return device, stage_dtype(stage.name, args.torch_dtype, "bfloat16" if device.startswith("cuda") else "float32")


MEDIA_GRID_KEYS = frozenset(MediaGrids.__annotations__)


def media_inputs(data: TalkerInput, stage: str, rows_needed: bool = True) -> Any:
    """`MediaInputs` from a first chunk's `thinker_media_rows` (media positions, hidden) and
    `thinker_media_grids` ({image_grid_thw, video_grid_thw, video_second_per_grid,
    audio_feature_lengths, use_audio_in_video}); None without rows (`rows_needed`, Qwen3-Omni) or
    without grids (otherwise: Qwen2.5-Omni, whose rows come apart). Raises InvalidRequest on a
    malformed one (the shapes against the prompt are checked by the model's `new_request`)."""
    import torch

    from omni_runtime.engines.speech.qwen3_talker import MediaInputs

    rows = data.get("thinker_media_rows")
    if rows is None and (rows_needed or data.get("thinker_media_grids") is None):
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
            rows=rows if rows is None or isinstance(rows, torch.Tensor) else torch.as_tensor(rows),
            image_grid_thw=[[int(v) for v in g] for g in grids.get("image_grid_thw") or []],
            video_grid_thw=[[int(v) for v in g] for g in grids.get("video_grid_thw") or []],
            video_second_per_grid=[float(v) for v in grids.get("video_second_per_grid") or []],
            audio_feature_lengths=[int(v) for v in grids.get("audio_feature_lengths") or []],
            use_audio_in_video=bool(grids.get("use_audio_in_video", False)),
        )
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"stage {stage!r}: unreadable thinker_media_grids {grids!r}: {exc}") from None


@dataclass(frozen=True)
class _Failed:
    """The last item of a failed request's output queue (its finish reason is 'error'): why it failed."""

    detail: str


@dataclass(eq=False)
class _Live:
    request: Any
    prompt_tokens: int
    out: asyncio.Queue[tuple[list[list[int]], str | None] | _Failed] = field(default_factory=asyncio.Queue)
    inbox: list[TalkerInput] = field(default_factory=list)
    inbox_done: bool = False
    aborted: bool = False
    failure: str | None = None
    frames: int = 0


class TalkerEngine(Engine):
    """The shared loop (see the module docstring); subclasses load the model and translate payloads."""

    streams_input = True
    default_speaker = ""

    def __init__(self, pipeline: ResolvedPipeline, stage: StageSpec) -> None:
        super().__init__(pipeline, stage)
        self.model_path = stage_model_path(pipeline, stage)
        self.args = typed_engine_args(stage, TalkerArgs)
        """The stage's engine args (InvalidEngineArgs at construction when they are wrong)."""
        self.device, self.dtype = engine_device_and_dtype(stage, self.args)
        self.max_requests = self.args.max_requests
        self.model: Any = None
        self._live: dict[str, _Live] = {}
        self._lock = threading.Lock()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stats = {"steps_total": 0.0, "frames_total": 0.0, "last_step_seconds": 0.0}

    # -- what a model supplies -------------------------------------------------------------------

    def load(self) -> Any:
        """Load the model (in a worker thread)."""
        raise NotImplementedError

    def new_request(
        self, request_id: str, first: TalkerInput, speaker: str, sampling: Sampling, extra: Any = None
    ) -> Any:
        """The model's request for the first payload (`extra`: what `add` was given besides it);
        KeyError / ValueError / InvalidRequest say what is wrong."""
        raise NotImplementedError

    def absorb(self, request: Any, payloads: list[TalkerInput], done: bool) -> None:
        """Hand payloads that arrived to the model's request (in the loop's thread, between steps)."""
        raise NotImplementedError

    def check(self, payload: TalkerInput) -> None:
        """Refuse a malformed payload before it reaches the loop (InvalidRequest); default: accept."""

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            self.model = await asyncio.to_thread(one_build_at_a_time(self.load))
        except Exception as exc:
            raise EngineError(f"stage {self.stage.name!r}: cannot load the talker of {self.model_path}: {exc}") from exc
        self._task = asyncio.create_task(self._loop(), name=f"talker-{self.stage.name}")
        try:
            await self_check(
                self,
                EngineInput(
                    SELF_CHECK_ID, as_payload(self.self_check_payload()), {"max_tokens": 1, "temperature": 0.0}
                ),
                f"a greedy one-frame request for the default speaker {self.default_speaker!r} on {self.device} in "
                f"{self.dtype}",
                "check the stage's engine_args device and torch_dtype (float32 runs everywhere), and that the model "
                "folder holds the talker of a complete checkpoint",
            )
        except EngineError:
            await self.stop()
            raise
        # the counters count served work from zero (the check is no client's)
        self._stats = dict.fromkeys(self._stats, 0.0)

    def self_check_payload(self) -> TalkerInput:
        """The first (and only) payload of the self-check: a short user turn and the assistant's turn with
        two thinker tokens, the thinker done (the model's own ids, so the check fits any checkpoint)."""
        raise NotImplementedError

    def voices(self) -> list[str]:
        return sorted(self.model.speakers) if self.model is not None else []

    # -- the request API -------------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        first: TalkerInput,
        speaker: str | None,
        params: dict[str, Any],
        extra: Any = None,
    ) -> None:
        """Register a request from its first payload (`extra`: model-specific, see `new_request`); raises
        InvalidRequest (unknown speaker, bad prompt or params)."""
        if self.model is None:
            raise EngineError(f"stage {self.stage.name!r} is not started")
        if request_id in self._live:
            raise InvalidRequest(f"request {request_id!r} is already running on stage {self.stage.name!r}")
        if len(self._live) >= self.max_requests:
            raise EngineError(f"stage {self.stage.name!r} runs {len(self._live)} requests (max_requests); retry later")
        refuse_unknown_params(self.stage.name, params, Sampling.PARAMS | {"voice"})
        try:
            sampling = Sampling.from_params(params, default_max=4096)
            request = self.new_request(request_id, first, speaker or self.default_speaker, sampling, extra)
        except (KeyError, ValueError) as exc:
            raise InvalidRequest(f"stage {self.stage.name!r}: {exc.args[0] if exc.args else exc}") from None
        self._live[request_id] = _Live(request, len(first.get("thinker_prompt_ids") or []))
        self._wake.set()

    def push(self, request_id: str, payload: TalkerInput, finished: bool = False) -> None:
        """Queue a payload for the request (and say whether the thinker is done); unknown ids are ignored."""
        live = self._live.get(request_id)
        if live is None:
            return
        self.check(payload)
        with self._lock:
            live.inbox.append(payload)
            live.inbox_done = live.inbox_done or finished
        self._wake.set()

    async def frames(self, request_id: str) -> AsyncIterator[tuple[list[list[int]], str | None]]:
        """(new frames, finish reason or None) as they are made; the last item has the reason.

        A request that failed (a malformed later input, a model fault) raises EngineError instead of its
        last item; the stage server turns that into the request's Failed message."""
        live = self._live[request_id]
        while True:
            item = await live.out.get()
            if isinstance(item, _Failed):
                raise EngineError(
                    f"stage {self.stage.name!r}: the talker failed on request {request_id!r}: error: {item.detail}"
                )
            frames, reason = item
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
        first = cast(TalkerInput, request.data)  # thinker_to_talker built it
        self.add(rid, first, request.params.get("voice"), request.params)
        try:
            self.push(rid, first, finished=request.chunks is None)
        except InvalidRequest:
            self._live.pop(rid, None)
            raise
        chunks = cast(AsyncIterator[TalkerInput] | None, request.chunks)  # each through thinker_to_talker
        feeder = asyncio.create_task(self._feed(rid, chunks)) if chunks is not None else None
        try:
            async for frames, reason in self.frames(rid):
                if frames:
                    yield EngineOutput(rid, as_payload(TalkerOutput(codes=np.asarray(frames, dtype=np.int64))))
                if reason is not None:
                    live = self._live[rid]
                    usage = {"prompt_tokens": live.prompt_tokens, "completion_tokens": live.frames}
                    yield EngineOutput(rid, {}, finished=True, finish_reason=reason, usage=usage)
        finally:
            if feeder is not None:
                feeder.cancel()
            await self.abort(rid)
            self._live.pop(rid, None)

    async def _feed(self, rid: str, chunks: AsyncIterator[TalkerInput]) -> None:
        try:
            async for chunk in chunks:
                self.push(rid, chunk)
        except InvalidRequest as exc:  # a malformed later chunk fails its request, not the stage
            live = self._live.get(rid)
            if live is not None:
                live.failure = str(exc)
        finally:
            self.push(rid, {}, finished=True)

    # -- the loop --------------------------------------------------------------------------------

    def _step(self, lives: list[_Live]) -> tuple[dict[str, list[list[int]]], bool]:
        with self._lock:
            for live in lives:
                self.absorb(live.request, live.inbox, live.inbox_done)
                live.inbox.clear()
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
                    if live.failure is not None and live.request.finish_reason is None:
                        live.request.finish_reason = "error"
                        live.out.put_nowait(_Failed(live.failure))
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
                        live.out.put_nowait(_Failed(str(exc)))
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


class Qwen3TalkerEngine(TalkerEngine):
    """`generation` stage with engine arg `runner: qwen3_omni_talker` (see the module docstring)."""

    default_speaker = "ethan"

    def load(self) -> Any:
        from omni_runtime.engines.speech.qwen3_talker import Qwen3Talker

        talker = Qwen3Talker(self.model_path, self.device, self.dtype)
        if not self.device.startswith("cuda"):
            return talker
        # on a GPU: KV slabs for max_requests slots, grouped MoE and CUDA graphs (slab_talker)
        from omni_runtime.engines.speech.slab_talker import SlabTalker

        return SlabTalker(talker, max_batch=self.max_requests)

    def self_check_payload(self) -> TalkerInput:
        c = self.model.config
        user = [c.im_start_token_id, c.user_token_id, c.im_end_token_id]
        return {
            "thinker_prompt_ids": [*user, c.im_start_token_id, c.assistant_token_id, c.im_end_token_id],
            "thinker_token_ids": [c.im_end_token_id, c.im_end_token_id],
        }

    def new_request(
        self, request_id: str, first: TalkerInput, speaker: str, sampling: Sampling, extra: Any = None
    ) -> Any:
        """`extra`: a `qwen3_talker.MediaInputs` (else read from the payload by `media_inputs`)."""
        prompt = first.get("thinker_prompt_ids")
        if not prompt:
            raise InvalidRequest(
                f"stage {self.stage.name!r} needs thinker_prompt_ids (the thinker's prompt token ids) in its "
                f"first input; got {sorted(first)}"
            )
        media = extra if extra is not None else media_inputs(first, self.stage.name)
        return self.model.new_request(request_id, [int(t) for t in prompt], speaker, sampling, media)

    def absorb(self, request: Any, payloads: list[TalkerInput], done: bool) -> None:
        for payload in payloads:
            request.text.extend(int(t) for t in payload.get("thinker_token_ids") or [])
        request.text_done = done

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        speaker: str | None,
        params: dict[str, Any],
        media: Any = None,
    ) -> None:
        """`add` from the thinker's prompt ids (`media`: a `qwen3_talker.MediaInputs` for a prompt with media)."""
        self.add(request_id, {"thinker_prompt_ids": prompt_ids}, speaker, params, media)

    def push_text(self, request_id: str, token_ids: list[int], finished: bool = False) -> None:
        """`push` of new thinker tokens."""
        self.push(request_id, {"thinker_token_ids": token_ids}, finished)


class Qwen25TalkerEngine(TalkerEngine):
    """`generation` stage with engine arg `runner: qwen2_5_omni_talker` (see the module docstring).

    Its thinker must stream rows (`hidden_state_layers: [0, -1]`); the registry's qwen2-5-omni does."""

    default_speaker = "chelsie"

    def load(self) -> Any:
        from omni_runtime.engines.speech.qwen25_talker import Qwen25Talker

        return Qwen25Talker(self.model_path, self.device, self.dtype)

    def self_check_payload(self) -> TalkerInput:
        import torch

        rows = torch.zeros(3, self.model.hidden_size)  # two prompt positions and the first thinker token
        return {
            "thinker_prompt_ids": [0, 1],
            "thinker_token_ids": [2],
            "thinker_embeds": rows,
            "thinker_hidden": rows,
            "thinker_hidden_layer": self.model.thinker_layers,
        }

    def new_request(
        self, request_id: str, first: TalkerInput, speaker: str, sampling: Sampling, extra: Any = None
    ) -> Any:
        prompt = first.get("thinker_prompt_ids")
        if not prompt or first.get("thinker_embeds") is None:
            raise InvalidRequest(
                f"stage {self.stage.name!r} needs thinker_prompt_ids and the thinker's rows (thinker_embeds, "
                f"thinker_hidden: set the thinker's hidden_state_layers to [0, -1]) in its first input; "
                f"got {sorted(first)}"
            )
        media = media_inputs(first, self.stage.name, rows_needed=False)
        return self.model.new_request(request_id, [int(t) for t in prompt], speaker, sampling, media)

    def check(self, payload: TalkerInput) -> None:
        import torch

        if payload.get("thinker_embeds") is None:
            return
        try:
            self.model.check_rows(
                torch.as_tensor(payload["thinker_embeds"]),
                torch.as_tensor(payload.get("thinker_hidden")),
                int(payload.get("thinker_hidden_layer", -1)),
            )
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidRequest(f"stage {self.stage.name!r}: {exc}") from None

    def absorb(self, request: Any, payloads: list[TalkerInput], done: bool) -> None:
        for payload in payloads:
            if not request.tokens:  # only the first is read (the talker's rope index)
                request.tokens.extend(int(t) for t in payload.get("thinker_token_ids") or [])
            if payload.get("thinker_embeds") is not None:
                self.model.add_rows(request, payload["thinker_embeds"], payload["thinker_hidden"])
        request.text_done = done
