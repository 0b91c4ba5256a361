"""`POST /v1/chat/completions`: request, response and stream chunk models.

Besides OpenAI's fields the request accepts vLLM's sampling extras (`top_k`, `min_p`, `ignore_eos`,
`min_tokens`, `repetition_penalty`), vLLM-Omni's `sampling_params_list` (one dict per stage, in the
pipeline's topological order) and, for image-producing pipelines, `negative_prompt`, `size`,
`height`/`width`, `num_inference_steps` and `guidance_scale` (send them with the SDK's `extra_body`).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "AUDIO_FORMATS",
    "AudioParam",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatCompletionStreamResponse",
    "ChatMessage",
    "Choice",
    "ChunkChoice",
    "StreamOptions",
    "Usage",
]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


AUDIO_FORMATS = ("wav", "pcm16")
"""`audio.format` values: a WAV file, or raw 16-bit little-endian mono PCM at the model's rate."""


class AudioParam(BaseModel):
    """OpenAI's `audio` request field: which speaker and which encoding `message.audio.data` uses."""

    model_config = ConfigDict(extra="forbid")

    voice: str | None = Field(None, description="A speaker of the model (GET /v1/audio/voices); unset: its default.")
    format: str = Field("wav", description=f"One of {AUDIO_FORMATS}.")


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    modalities: list[str] | None = Field(
        None,
        description="Output modalities wanted (text, image, audio, video); default: all the pipeline makes.",
    )
    audio: AudioParam | None = Field(None, description="Voice and format of the audio reply (with modality audio).")
    n: int = Field(1, ge=1, description="Choices; at most the pipeline's router.limits.maxN.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, description="At most the pipeline's router.limits.maxTokens.")
    max_completion_tokens: int | None = Field(None, ge=1, description="As max_tokens (OpenAI's newer name).")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    user: str | None = None
    # vLLM sampling extras
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    repetition_penalty: float | None = Field(None, gt=0.0)
    # vLLM-Omni extras
    sampling_params_list: list[dict[str, Any]] | None = None
    negative_prompt: str | None = None
    size: str | None = None
    height: int | None = Field(None, ge=1)
    width: int | None = Field(None, ge=1)
    num_inference_steps: int | None = Field(None, ge=1)
    guidance_scale: float | None = Field(None, ge=0.0)


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None


class Choice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Choice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
