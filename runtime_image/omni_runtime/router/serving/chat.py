"""Serving `POST /v1/chat/completions`.

Each of the `n` choices runs the planned stages once and is one OpenAI choice: the outputs of all its
final-output stages meet in one message, as OpenAI's audio replies do. Text is `message.content`;
images are `image_url` parts (PNG data URLs) in `message.content`; audio is `message.audio.data`
(base64 of a WAV file, or of raw 16-bit PCM with `audio.format: pcm16`). Streamed, each decoded audio
window is one `delta.audio` chunk, sent as soon as it arrives, between the text deltas. `modalities`
picks the final stages: `["text"]` on a speech model runs the thinker alone. Media parts of the
messages (images, audio, video) are checked first (`media_inputs`). Usage counts the tokens
of the text-producing stages (the thinker), not the talker's codec frames.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omni_runtime.router.errors import BadRequest, OmniError
from omni_runtime.router.media import audio_of, b64, encode_audio, image_url_part, images_of
from omni_runtime.router.orchestrator import PipelineRequest, RunResult, StageEvent
from omni_runtime.router.plan import Plan, plan_request
from omni_runtime.router.protocol.chat import (
    AUDIO_FORMATS,
    RENDER_ONLY,
    TEXT_ONLY,
    TOOL_FIELDS,
    AssistantMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogProbs,
    Choice,
    ChunkChoice,
    Delta,
    Usage,
)
from omni_runtime.router.protocol.images import parse_size
from omni_runtime.router.serving.base import ManagedStream, ServingBase
from omni_runtime.router.serving.clock import RequestClock
from omni_runtime.router.serving.inputs import (
    AR_FIELDS,
    entry_inputs,
    normalize_messages,
    render_inputs,
    stage_params,
    text_params,
    text_stages,
)
from omni_runtime.router.serving.logprobs import chat_logprobs
from omni_runtime.router.serving.media_inputs import check_media, media_parts
from omni_runtime.router.serving.voices import voice_params
from omni_runtime.spec import Modality, PipelineSpec

__all__ = ["ServingChat"]


@dataclass
class _Acc:
    """One OpenAI choice being assembled."""

    pending: set[str]
    """Final stages of this choice that have not finished yet."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    """Generated tokens of the text stage, with their logprob rows when the request asked for them."""
    logprob_rows: list[list[list[Any]]] = field(default_factory=list)
    prompt_tokens: int = 0
    images: list[bytes] = field(default_factory=list)
    audio: list[np.ndarray] = field(default_factory=list)
    rate: int = 0
    finish_reason: str | None = None
    tool_message: dict[str, Any] | None = None
    """With tools: the text stage's whole reply as its vLLM parser read it (`content`, `tool_calls`)."""
    stream_finish: str | None = None
    """With tools: the finish reason vLLM's server streams (it decides from what was streamed)."""

    def fold(self, event: StageEvent) -> None:
        data = event.data or {}
        if isinstance(data.get("text"), str):
            self.text += data["text"]
        if event.modality == "text":
            self.token_ids.extend(data.get("token_ids") or [])
            self.logprob_rows.extend(data.get("logprobs") or [])
            self.prompt_tokens = len(data.get("prompt_token_ids") or []) or self.prompt_tokens
            if isinstance(data.get("message"), dict):
                self.tool_message = data["message"]
                self.stream_finish = data.get("stream_finish_reason")
        self.images.extend(images_of(data))
        audio = audio_of(data)
        if audio is not None:
            self.audio.append(audio[0])
            self.rate = audio[1]
        if event.finished:
            self.pending.discard(event.stage)
            if event.modality == "text" or self.finish_reason is None:
                self.finish_reason = event.finish_reason or "stop"
            if event.modality == "text" and data.get("finish_reason"):
                self.finish_reason = data["finish_reason"]

    @property
    def done(self) -> bool:
        return not self.pending


class ServingChat(ServingBase):
    endpoint = "/v1/chat/completions"

    async def create(self, body: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(body.model)
        self.check_fields(body)
        modalities = self.check_modalities(body.modalities)
        audio_format = _audio_format(body)
        plan = plan_request(self.topology, modalities)
        self.check_text_fields(body, plan, TEXT_ONLY, RENDER_ONLY)
        self._check_tool_fields(body, plan)
        voice = body.audio.voice if body.audio else None
        voices = voice_params(self.ctx.pool, plan, voice, "audio.voice")
        messages = normalize_messages(body.messages)
        if media_parts(messages):
            accepted = sorted({m.value for n in plan.entry for m in self.topology.stage(n).input_modalities})
            await asyncio.to_thread(check_media, messages, self.limits.media, accepted)
        request_id = self.new_id("chatcmpl")
        requests = self._requests(body, messages, plan, request_id, voices)
        clock = RequestClock(self.pipeline.name, self.endpoint)
        if body.stream:
            return await self._stream(body, plan, request_id, requests, clock, audio_format, _echo(body, messages))
        accs = {r.choice: _Acc(set(plan.final)) for r in requests}

        def collect(event: StageEvent) -> None:
            accs[event.choice].fold(event)
            clock.saw(event)

        results = await self.run_to_end(raw, requests, collect)
        usage = _usage(plan, self.topology, results)
        clock.done(usage.completion_tokens)
        echo = _echo(body, messages)
        top = _top(body)
        choices = [
            Choice(
                index=i,
                message=_message(a, audio_format, echo),
                finish_reason=a.finish_reason,
                logprobs=chat_logprobs(a.token_ids, a.logprob_rows, top) if top is not None else None,
            )
            for i, a in sorted(accs.items())
        ]
        response = ChatCompletionResponse(id=request_id, model=body.model, choices=choices, usage=usage)
        return JSONResponse(response.model_dump(exclude_none=True))

    def _check_tool_fields(self, body: ChatCompletionRequest, plan: Plan) -> None:
        """Tools need one AR stage that renders the chat (sees the tools) and writes the reply's text
        (where the calls are constrained and parsed): 400 naming the field otherwise."""
        asked = sorted(k for k in TOOL_FIELDS & body.model_fields_set if getattr(body, k) is not None)
        if not asked:
            return
        texts = text_stages(self.topology, plan)
        if texts and all(n in plan.entry for n in texts):
            return
        raise BadRequest(
            f"{asked[0]} needs an AR stage that both renders the chat and writes the reply's text; in this "
            f"request (pipeline {self.topology.name}) the entry stages are {list(plan.entry)} and the text comes from "
            f"{texts or 'no AR stage'}; remove {asked[0]}"
            + (" or ask for modalities ['text']" if "text" in self.producible() else ""),
            param=asked[0],
        )

    # -- building the request ------------------------------------------------------------------

    def _requests(
        self,
        body: ChatCompletionRequest,
        messages: list[dict[str, Any]],
        plan: Plan,
        request_id: str,
        extra: dict[str, dict[str, Any]],
    ) -> list[PipelineRequest]:
        self.check_n(body.n)
        self.check_max_tokens(body.max_tokens, "max_tokens")
        self.check_max_tokens(body.max_completion_tokens, "max_completion_tokens")
        self.check_stage_params(body.sampling_params_list)
        ar = {k: getattr(body, k) for k in AR_FIELDS}
        ar["max_tokens"] = body.max_completion_tokens or body.max_tokens
        text = text_params(body)
        # the stage writing the reply's text sizes a missing max_tokens to its context, and refuses one
        # beyond it, as vLLM's server does (wire/PROTOCOL.md: context_max_tokens, check_max_tokens)
        if ar["max_tokens"] is None:
            text["context_max_tokens"] = self.limits.max_tokens
        else:
            text["check_max_tokens"] = True
        render = {k: getattr(body, k) for k in sorted(RENDER_ONLY) if k in body.model_fields_set}
        chat = render_inputs(render)
        chat.update({k: getattr(body, k) for k in sorted(TOOL_FIELDS) if getattr(body, k) is not None})
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
        entry = entry_inputs(self.topology, plan, messages=messages, negative_prompt=body.negative_prompt,
                             chat=chat)  # fmt: skip
        requests = [
            PipelineRequest(
                request_id=request_id,
                plan=plan,
                entry=entry,
                params=stage_params(
                    self.topology,
                    plan,
                    ar=ar,
                    image=image,
                    text=text,
                    per_stage=body.sampling_params_list,
                    choice=i,
                    extra=extra,
                ),  # fmt: skip
                negative_prompt=body.negative_prompt,
                stream=body.stream,
                choice=i,
            )
            for i in range(body.n)
        ]
        for request in requests:
            self.check_image_sizes(plan, request.params)
        return requests

    # -- streaming -----------------------------------------------------------------------------

    async def _stream(
        self,
        body: ChatCompletionRequest,
        plan: Plan,
        request_id: str,
        requests: list,
        clock: RequestClock,
        audio_format: str,
        echo: str,
    ) -> Response:
        stream = await self.open_stream(requests)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
        top = _top(body)
        model = body.model
        accs = {r.choice: _Acc(set(plan.final)) for r in requests}

        def chunk(index: int, delta: Delta, finish: str | None = None, logprobs: ChatLogProbs | None = None) -> str:
            c = ChatCompletionStreamResponse(
                id=request_id,
                model=model,
                choices=[ChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=logprobs)],
            )
            if continuous:
                prompt = max((a.prompt_tokens for a in accs.values()), default=0)
                done = sum(len(a.token_ids) for a in accs.values())
                c.usage = Usage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)
            return f"data: {c.model_dump_json(exclude_none=True)}\n\n"

        async def body_iter() -> AsyncIterator[str]:
            opened: set[int] = set()
            try:
                async for event in stream:
                    clock.saw(event)
                    index = event.choice
                    acc = accs[index]
                    acc.fold(event)
                    if index not in opened:
                        opened.add(index)
                        yield chunk(index, Delta(role="assistant", content=""))
                        if echo:
                            yield chunk(index, Delta(content=echo))
                    delta = _delta(event, audio_format)
                    if delta is not None:
                        data = event.data or {}
                        logprobs = None
                        if top is not None and event.modality == "text":
                            logprobs = chat_logprobs(data.get("token_ids") or [], data.get("logprobs") or [], top)
                        yield chunk(index, delta, logprobs=logprobs)
                    if event.finished and acc.done:
                        yield chunk(index, Delta(), acc.stream_finish or acc.finish_reason or "stop")
                usage = _usage(plan, self.topology, stream.results)
                clock.done(usage.completion_tokens)
                if include_usage:
                    final = ChatCompletionStreamResponse(id=request_id, model=model, choices=[], usage=usage)
                    yield f"data: {final.model_dump_json(exclude_none=True)}\n\n"
            except OmniError as err:
                yield self.error_event(err)
            yield "data: [DONE]\n\n"

        return ManagedStream(body_iter(), stream.close, media_type="text/event-stream")


def _top(body: ChatCompletionRequest) -> int | None:
    """How many alternatives each token's logprobs lists (None: no logprobs asked)."""
    return (body.top_logprobs or 0) if body.logprobs else None


def _echo(body: ChatCompletionRequest, messages: list[dict[str, Any]]) -> str:
    """vLLM's `echo`: the last message's text when it has the reply's role (`assistant`, or the last
    message's own role without a generation prompt)."""
    if not body.echo or not messages:
        return ""
    last = messages[-1]
    role = "assistant" if body.add_generation_prompt else last.get("role")
    content = last.get("content")
    if last.get("role") != role or not content:
        return ""
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if p.get("type") == "text")
    return str(content)


def _audio_format(body: ChatCompletionRequest) -> str:
    fmt = body.audio.format if body.audio else "wav"
    if fmt not in AUDIO_FORMATS:
        raise BadRequest(
            f"audio.format {fmt!r} is not supported; use one of {list(AUDIO_FORMATS)}", param="audio.format"
        )
    return fmt


def _message(acc: _Acc, audio_format: str, echo: str = "") -> AssistantMessage:
    if acc.tool_message is not None:
        content = acc.tool_message.get("content")
        return AssistantMessage(content=echo + content if content is not None else (echo or None),
                                tool_calls=list(acc.tool_message.get("tool_calls") or []))  # fmt: skip
    if acc.images:  # after the text it was drawn from, when the thinker answered too (BAGEL's think mode)
        lead = [{"type": "text", "text": acc.text}] if acc.text else []
        return AssistantMessage(content=[*lead, *(image_url_part(p) for p in acc.images)])
    if acc.audio:
        samples = np.concatenate([np.atleast_1d(a) for a in acc.audio], axis=-1)
        audio = _audio(encode_audio(samples, acc.rate, audio_format), audio_format, acc.text)
        return AssistantMessage(content=acc.text or None, audio=audio)
    return AssistantMessage(content=echo + acc.text)


def _delta(event: StageEvent, audio_format: str) -> Delta | None:
    data = event.data or {}
    images = images_of(data)
    if images:
        return Delta(content=[image_url_part(p) for p in images])
    audio = audio_of(data)
    if audio is not None and audio[0].size:
        return Delta(audio=_audio(encode_audio(audio[0], audio[1], audio_format), audio_format))
    text = data.get("text")
    calls = data.get("tool_calls")
    if isinstance(calls, list) and calls:
        return Delta(content=text or None, tool_calls=calls)
    if isinstance(text, str) and text:
        return Delta(content=text)
    return None


def _audio(data: bytes, fmt: str, transcript: str = "") -> dict[str, Any]:
    return {"id": f"audio-{int(time.time() * 1000)}", "data": b64(data), "format": fmt,
            "expires_at": int(time.time()) + 3600, "transcript": transcript}  # fmt: skip


def _usage(plan: Plan, topology: PipelineSpec, results: list[RunResult]) -> Usage:
    """Tokens of the stages that produce text (the thinker; a talker's codec frames are not tokens),
    or of every stage when none does: prompt tokens of the first choice (the prompt is shared),
    completion tokens of all choices."""
    text = {n for n in plan.stages if topology.stage(n).output_modality is Modality.TEXT} or set(plan.stages)

    def counted(result: RunResult) -> list[dict[str, int]]:
        return [u for stage, u in result.usage.items() if stage in text]

    prompt = sum(u.get("prompt_tokens", 0) for u in counted(results[0])) if results else 0
    completion = sum(u.get("completion_tokens", 0) for r in results for u in counted(r))
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
