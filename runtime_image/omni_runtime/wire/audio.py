"""Audio in an output payload: how long it is, and the sample rate an `audio` output that names none has.

Both sides read it: the stage server counts the audio it produced, the router the audio it sent clients."""

from __future__ import annotations

from typing import Any

from omni_runtime.processors.payloads import QWEN_CODEC_SAMPLE_RATE

__all__ = ["DEFAULT_SAMPLE_RATE", "audio_seconds"]

DEFAULT_SAMPLE_RATE = QWEN_CODEC_SAMPLE_RATE
"""Rate of an `audio` output that names no `sample_rate` (the Qwen-Omni codecs', the only ones served)."""


def audio_seconds(data: dict[str, Any] | None) -> float:
    """Seconds of audio in an output piece: samples along `audio`'s last axis over its `sample_rate`."""
    if not data or data.get("audio") is None:
        return 0.0
    shape = getattr(data["audio"], "shape", None)
    samples = int(shape[-1]) if shape else len(data["audio"])
    return samples / float(data.get("sample_rate") or DEFAULT_SAMPLE_RATE)
