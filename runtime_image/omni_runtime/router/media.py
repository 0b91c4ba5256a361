"""Turning stage outputs into what OpenAI clients expect: base64 PNG data URLs and WAV audio."""

from __future__ import annotations

import base64
import io
import wave
from typing import Any

import numpy as np

__all__ = ["audio_of", "b64", "image_url_part", "images_of", "wav_bytes"]

DEFAULT_SAMPLE_RATE = 24000


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def images_of(data: dict[str, Any] | None) -> list[bytes]:
    """The encoded images (PNG bytes) of a stage output: `images` list or a single `image`."""
    if not data:
        return []
    images = data.get("images")
    if images is None and data.get("image") is not None:
        images = [data["image"]]
    return [bytes(i) for i in images or [] if isinstance(i, bytes | bytearray | memoryview)]


def image_url_part(png: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(png)}"}}


def audio_of(data: dict[str, Any] | None) -> tuple[np.ndarray, int] | None:
    """(float samples, sample rate) of a stage output's `audio` (tensor or array; channels x samples)."""
    if not data or data.get("audio") is None:
        return None
    samples = data["audio"]
    if hasattr(samples, "detach"):
        samples = samples.detach().float().cpu().numpy()
    array = np.asarray(samples, dtype=np.float32)
    rate = int(data.get("sample_rate") or DEFAULT_SAMPLE_RATE)
    return array, rate


def wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    """16-bit PCM WAV of float samples in [-1, 1] (1-D, or channels x samples)."""
    array = np.atleast_2d(samples) if samples.ndim <= 2 else samples.reshape(samples.shape[0], -1)
    if array.shape[0] > array.shape[1]:  # samples x channels
        array = array.T
    pcm = (np.clip(array, -1.0, 1.0) * 32767.0).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(pcm.shape[0])
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.T.tobytes())
    return buf.getvalue()
