"""Serving `POST /v1/audio/speech` (OpenAI's speech shape) and `GET /v1/audio/voices`.

Any pipeline with an audio final output serves speech: the request runs the stages that produce audio
(for Qwen-Omni the thinker answers `input` and the talker and code2wav speak that answer). Without
`stream_format` the whole file comes back at the end; `sse` sends one `speech.audio.delta` event per
decoded window and a `speech.audio.done` event with usage; `audio` streams the bytes themselves (a WAV
header with an open length, then PCM, for `wav`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from omni_runtime.router.errors import BadRequest, OmniError
from omni_runtime.router.media import audio_of, b64, encode_audio, wav_stream_header
from omni_runtime.router.orchestrator import PipelineRequest, RunResult, StageEvent
from omni_runtime.router.plan import plan_request
from omni_runtime.router.protocol.audio import SPEECH_FORMATS, STREAM_FORMATS, SpeechRequest, VoiceList
from omni_runtime.router.serving.base import ManagedStream, ServingBase
from omni_runtime.router.serving.clock import RequestClock
from omni_runtime.router.serving.inputs import entry_inputs, stage_params
from omni_runtime.router.serving.voices import all_voices, voice_params
from omni_runtime.wire.audio import DEFAULT_SAMPLE_RATE

__all__ = ["ServingSpeech"]

MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm"}


class ServingSpeech(ServingBase):
    endpoint = "/v1/audio/speech"

    def voices(self) -> VoiceList:
        names = all_voices(self.ctx.pool)
        return VoiceList(voices=names, data=[{"id": n, "object": "voice"} for n in names])

    async def create(self, body: SpeechRequest, raw: Request) -> Response:
        self.check_model(body.model, required=False)
        self._check(body)
        self.check_stage_params(body.sampling_params_list)
        plan = plan_request(self.topology, ["audio"])
        voices = voice_params(self.ctx.pool, plan, body.voice, "voice")
        entry = entry_inputs(self.topology, plan, messages=[{"role": "user", "content": body.input}])
        params = stage_params(self.topology, plan, ar={}, image={}, per_stage=body.sampling_params_list, extra=voices)
        request = PipelineRequest(
            request_id=self.new_id("speech"), plan=plan, entry=entry, params=params,
            stream=body.stream_format is not None,
        )  # fmt: skip
        clock = RequestClock(self.pipeline.name, self.endpoint)
        fmt = body.response_format
        if body.stream_format is not None:
            return await self._stream(request, body.stream_format, fmt, clock)
        pieces: list[np.ndarray] = []
        rate = DEFAULT_SAMPLE_RATE

        def collect(event: StageEvent) -> None:
            nonlocal rate
            clock.saw(event)
            audio = audio_of(event.data) if event.modality == "audio" else None
            if audio is not None:
                pieces.append(np.atleast_1d(audio[0]))
                rate = audio[1]

        results = await self.run_to_end(raw, [request], collect)
        clock.done(_usage(results)["output_tokens"])
        samples = np.concatenate(pieces, axis=-1) if pieces else np.zeros(0, dtype=np.float32)
        return Response(encode_audio(samples, rate, fmt), media_type=MEDIA_TYPES[fmt])

    def _check(self, body: SpeechRequest) -> None:
        if "audio" not in self.producible():
            raise BadRequest(
                f"model `{self.ctx.model_name}` (pipeline {self.topology.name}) produces {self.producible()}, "
                "not audio; /v1/audio/speech needs a pipeline whose final output is audio",
                param="model",
            )
        if body.response_format not in SPEECH_FORMATS:
            raise BadRequest(
                f"response_format {body.response_format!r} is not supported; use one of {list(SPEECH_FORMATS)}",
                param="response_format",
            )
        if body.stream_format is not None and body.stream_format not in STREAM_FORMATS:
            raise BadRequest(
                f"stream_format {body.stream_format!r} is not supported; use one of {list(STREAM_FORMATS)}",
                param="stream_format",
            )
        if body.instructions:
            raise BadRequest(
                "instructions are not supported: the model's voice is chosen by `voice` alone; omit instructions",
                param="instructions",
            )
        if body.speed != 1.0:
            raise BadRequest(
                f"speed {body.speed} is not supported: the model speaks at its own pace; send 1.0 or omit it",
                param="speed",
            )

    async def _stream(self, request: PipelineRequest, kind: str, fmt: str, clock: RequestClock) -> Response:
        stream = await self.open_stream([request])

        async def sse() -> AsyncIterator[str]:
            try:
                async for event in stream:
                    clock.saw(event)
                    audio = audio_of(event.data) if event.modality == "audio" else None
                    if audio is not None and audio[0].size:
                        delta = {"type": "speech.audio.delta", "audio": b64(encode_audio(audio[0], audio[1], fmt))}
                        yield f"data: {json.dumps(delta)}\n\n"
                usage = _usage(stream.results)
                clock.done(usage["output_tokens"])
                yield f"data: {json.dumps({'type': 'speech.audio.done', 'usage': usage})}\n\n"
            except OmniError as err:
                yield self.error_event(err)

        async def raw_audio() -> AsyncIterator[bytes]:
            header_sent = False
            async for event in stream:
                clock.saw(event)
                audio = audio_of(event.data) if event.modality == "audio" else None
                if audio is None or not audio[0].size:
                    continue
                if fmt == "wav" and not header_sent:
                    header_sent = True
                    yield wav_stream_header(audio[1])
                yield encode_audio(audio[0], audio[1], "pcm")
            clock.done(_usage(stream.results)["output_tokens"])

        if kind == "sse":
            return ManagedStream(sse(), stream.close, media_type="text/event-stream")
        return ManagedStream(raw_audio(), stream.close, media_type=MEDIA_TYPES[fmt])


def _usage(results: list[RunResult]) -> dict[str, int]:
    """OpenAI's speech usage: the entry (text) stage's prompt and generated tokens."""
    usage = next(iter(results[0].usage.values()), {}) if results else {}
    prompt, output = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {"input_tokens": prompt, "output_tokens": output, "total_tokens": prompt + output}
