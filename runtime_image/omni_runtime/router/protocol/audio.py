"""`POST /v1/audio/speech` and `GET /v1/audio/voices`: request and response models.

The speech request is OpenAI's (`input`, `voice`, `response_format`, `stream_format`, `speed`) plus
vLLM-Omni's `sampling_params_list`. `response_format` is `wav` or `pcm` (16-bit little-endian mono at
the model's rate, 24 kHz for Qwen-Omni); `stream_format: sse` sends `speech.audio.delta` events (one per
decoded window) then `speech.audio.done`; `audio` streams the raw bytes.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["SPEECH_FORMATS", "STREAM_FORMATS", "SpeechRequest", "VoiceList"]

SPEECH_FORMATS = ("wav", "pcm")
STREAM_FORMATS = ("sse", "audio")


class SpeechRequest(BaseModel):
    # A field we would accept and ignore is worse than a 400: unknown fields are refused by name.
    model_config = ConfigDict(extra="forbid")

    input: str = Field(min_length=1, description="The text to speak.")
    model: str | None = None
    voice: str | None = Field(None, description="A speaker of the model (GET /v1/audio/voices); unset: its default.")
    response_format: str = Field("wav", description=f"One of {SPEECH_FORMATS}.")
    stream_format: str | None = Field(None, description=f"{STREAM_FORMATS}; unset returns the whole file at the end.")
    speed: float = Field(1.0, description="Only 1.0: the models speak at their own pace.")
    instructions: str | None = Field(None, description="Refused when set: the speech models take no instructions.")
    sampling_params_list: list[dict[str, Any]] | None = None


class VoiceList(BaseModel):
    object: Literal["list"] = "list"
    voices: list[str]
    """Every speaker the speech stages of this model know."""
    data: list[dict[str, str]] = Field(default_factory=list)
    """The same, as `{"id", "object": "voice"}` entries."""
