"""Serving `POST /v1/chat/completions`.

Each of the `n` choices runs the planned stages once. As in vLLM-Omni, every final-output stage of a
choice becomes its own OpenAI choice (text first, then audio...): index = choice x stages + stage.
Text is `message.content`; images are `image_url` parts (PNG data URLs) in `message.content`; audio
is `message.audio.data` (base64 WAV).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omni_runtime.metrics import Router as M
from omni_runtime.router.errors import BadRequest, OmniError, error_body
from omni_runtime.router.media import audio_of, b64, image_url_part, images_of, wav_bytes
from omni_runtime.router.orchestrator import PipelineRequest, RunResult, StageEvent
from omni_runtime.router.plan import Plan, plan_request
from omni_runtime.router.protocol.chat import (
    AssistantMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    Choice,
    ChunkChoice,
    Delta,
    Usage,
)
from omni_runtime.router.protocol.images import parse_size
from omni_runtime.router.serving.base import ManagedStream, ServingBase
from omni_runtime.router.serving.inputs import AR_FIELDS, entry_inputs, normalize_messages, stage_params

__all__ = ["ServingChat"]


@dataclass
class _Acc:
    """One OpenAI choice being assembled."""

    modality: str
    text: str = ""
    images: list[bytes] = field(default_factory=list)
    audio: list[np.ndarray] = field(default_factory=list)
    rate: int = 0
    finish_reason: str | None = None


class ServingChat(ServingBase):
    endpoint = "/v1/chat/completions"

    async def create(self, body: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(body.model)
        modalities = self.check_modalities(body.modalities)
        plan = plan_request(self.topology, modalities)
        request_id = self.new_id("chatcmpl")
        requests = self._requests(body, plan, request_id)
        clock = _Clock(self.pipeline.name)
        if body.stream:
            return await self._stream(body, plan, request_id, requests, clock)
        accs: dict[int, _Acc] = {}

        def collect(event: StageEvent) -> None:
            index = _index(plan, event)
            acc = accs.setdefault(index, _Acc(event.modality))
            _fold(acc, event)
            clock.saw(event)

        results = await self.run_to_end(raw, requests, collect)
        usage = _usage(results)
        clock.done(usage.completion_tokens)
        choices = [Choice(index=i, message=_message(a), finish_reason=a.finish_reason) for i, a in sorted(accs.items())]
        response = ChatCompletionResponse(id=request_id, model=body.model, choices=choices, usage=usage)
        return JSONResponse(response.model_dump(exclude_none=True))

    # -- building the request ------------------------------------------------------------------

    def _requests(self, body: ChatCompletionRequest, plan: Plan, request_id: str) -> list[PipelineRequest]:
        self.check_n(body.n)
        self.check_max_tokens(body.max_tokens, "max_tokens")
        self.check_max_tokens(body.max_completion_tokens, "max_completion_tokens")
        self.check_stage_params(body.sampling_params_list)
        messages = normalize_messages(body.messages)
        ar = {k: getattr(body, k) for k in AR_FIELDS}
        ar["max_tokens"] = body.max_completion_tokens or body.max_tokens
        ar.update({k: v for k, v in (body.model_extra or {}).items() if k in _AR_EXTRA})
        try:
            size = parse_size(body.size)
        except ValueError as err:
            raise BadRequest(str(err), param="size") from None
        image = {
            "height": body.height or (size[1] if size else None),
            "width": body.width or (size[0] if size else None),
            "seed": body.seed,
            "num_inference_steps": body.num_inference_steps,
            "guidance_scale": body.guidance_scale,
        }
        entry = entry_inputs(self.topology, plan, messages=messages, negative_prompt=body.negative_prompt)
        return [
            PipelineRequest(
                request_id=request_id,
                plan=plan,
                entry=entry,
                params=stage_params(
                    self.topology, plan, ar=ar, image=image, per_stage=body.sampling_params_list, choice=i
                ),
                negative_prompt=body.negative_prompt,
                stream=body.stream,
                choice=i,
            )
            for i in range(body.n)
        ]

    # -- streaming -----------------------------------------------------------------------------

    async def _stream(
        self, body: ChatCompletionRequest, plan: Plan, request_id: str, requests: list, clock: _Clock
    ) -> Response:
        stream = await self.open_stream(requests)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        model = body.model

        def chunk(index: int, delta: Delta, finish: str | None = None) -> str:
            c = ChatCompletionStreamResponse(
                id=request_id,
                model=model,
                choices=[ChunkChoice(index=index, delta=delta, finish_reason=finish)],
            )
            return f"data: {c.model_dump_json(exclude_none=True)}\n\n"

        async def body_iter() -> AsyncIterator[str]:
            opened: set[int] = set()
            try:
                async for event in stream:
                    clock.saw(event)
                    index = _index(plan, event)
                    if index not in opened:
                        opened.add(index)
                        yield chunk(index, Delta(role="assistant", content=""))
                    delta = _delta(event)
                    if delta is not None:
                        yield chunk(index, delta)
                    if event.finished:
                        yield chunk(index, Delta(), event.finish_reason or "stop")
                usage = _usage(stream.results)
                clock.done(usage.completion_tokens)
                if include_usage:
                    final = ChatCompletionStreamResponse(id=request_id, model=model, choices=[], usage=usage)
                    yield f"data: {final.model_dump_json(exclude_none=True)}\n\n"
            except OmniError as err:
                M.errors.labels(self.pipeline.name, self.endpoint, err.type).inc()
                yield f"data: {json.dumps(error_body(err.message, err.type, err.status, err.param))}\n\n"
            yield "data: [DONE]\n\n"

        return ManagedStream(body_iter(), stream.close, media_type="text/event-stream")


_AR_EXTRA = {"bad_words", "skip_special_tokens", "include_stop_str_in_output", "allowed_token_ids", "top_k"}


def _index(plan: Plan, event: StageEvent) -> int:
    return event.choice * len(plan.final) + plan.final.index(event.stage)


def _fold(acc: _Acc, event: StageEvent) -> None:
    data = event.data or {}
    if isinstance(data.get("text"), str):
        acc.text += data["text"]
    acc.images.extend(images_of(data))
    audio = audio_of(data)
    if audio is not None:
        acc.audio.append(audio[0])
        acc.rate = audio[1]
    if event.finished:
        acc.finish_reason = event.finish_reason or "stop"


def _message(acc: _Acc) -> AssistantMessage:
    if acc.images:
        return AssistantMessage(content=[image_url_part(p) for p in acc.images])
    if acc.audio:
        samples = np.concatenate([np.atleast_1d(a) for a in acc.audio], axis=-1)
        return AssistantMessage(content=acc.text or None, audio=_audio(wav_bytes(samples, acc.rate)))
    return AssistantMessage(content=acc.text)


def _delta(event: StageEvent) -> Delta | None:
    data = event.data or {}
    images = images_of(data)
    if images:
        return Delta(content=[image_url_part(p) for p in images])
    audio = audio_of(data)
    if audio is not None:
        return Delta(audio=_audio(wav_bytes(*audio)))
    text = data.get("text")
    if isinstance(text, str) and text:
        return Delta(content=text)
    return None


def _audio(wav: bytes) -> dict[str, Any]:
    return {"id": f"audio-{int(time.time() * 1000)}", "data": b64(wav), "format": "wav",
            "expires_at": int(time.time()) + 3600, "transcript": ""}  # fmt: skip


def _usage(results: list[RunResult]) -> Usage:
    """Prompt tokens of the first choice (the prompt is shared), completion tokens of all choices."""
    prompt = sum(u.get("prompt_tokens", 0) for u in results[0].usage.values()) if results else 0
    completion = sum(u.get("completion_tokens", 0) for r in results for u in r.usage.values())
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class _Clock:
    """TTFT, TTFP, TPOT for one request."""

    def __init__(self, pipeline: str) -> None:
        self.pipeline = pipeline
        self.start = time.monotonic()
        self.first_token: float | None = None
        self.first_packet: set[str] = set()

    def saw(self, event: StageEvent) -> None:
        now = time.monotonic()
        data = event.data or {}
        if event.modality == "text":
            if self.first_token is None and data.get("text"):
                self.first_token = now
                M.ttft.labels(self.pipeline).observe(now - self.start)
        elif data and event.modality not in self.first_packet:
            self.first_packet.add(event.modality)
            M.ttfp.labels(self.pipeline, event.modality).observe(now - self.start)

    def done(self, completion_tokens: int) -> None:
        if self.first_token is not None and completion_tokens > 1:
            M.tpot.labels(self.pipeline).observe((time.monotonic() - self.first_token) / (completion_tokens - 1))
