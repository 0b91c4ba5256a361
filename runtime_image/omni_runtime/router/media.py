"""Turning stage outputs into what OpenAI clients expect: base64 PNG data URLs and WAV audio."""

from __future__ import annotations

import base64
import io
import wave
from typing import Any

import numpy as np

from omni_runtime.wire.audio import DEFAULT_SAMPLE_RATE

__all__ = [
    "audio_of",
    "b64",
    "encode_audio",
    "image_url_part",
    "images_of",
    "pcm16_bytes",
    "wav_bytes",
    "wav_stream_header",
]


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
    """(float samples, sample rate) of a stage output's `audio` (`processors.payloads.AudioOutput`: tensor or
    array, (samples,) or channels x samples; the rate `wire.audio.DEFAULT_SAMPLE_RATE` when it names none)."""
    if not data or data.get("audio") is None:
        return None
    samples = data["audio"]
    if hasattr(samples, "detach"):
        samples = samples.detach().float().cpu().numpy()
    array = np.asarray(samples, dtype=np.float32)
    rate = int(data.get("sample_rate") or DEFAULT_SAMPLE_RATE)
    return array, rate


def _pcm(samples: np.ndarray) -> np.ndarray:
    """Channels x samples int16 of float samples in [-1, 1] (1-D, or channels x samples)."""
    array = np.atleast_2d(samples) if samples.ndim <= 2 else samples.reshape(samples.shape[0], -1)
    if array.shape[0] > array.shape[1]:  # samples x channels
        array = array.T
    return (np.clip(array, -1.0, 1.0) * 32767.0).astype("<i2")


def pcm16_bytes(samples: np.ndarray) -> bytes:
    """Raw 16-bit little-endian PCM of float samples in [-1, 1], channels interleaved."""
    return _pcm(samples).T.tobytes()


def encode_audio(samples: np.ndarray, rate: int, fmt: str) -> bytes:
    """`samples` as a WAV file (`wav`) or raw 16-bit PCM (`pcm`, `pcm16`)."""
    return wav_bytes(samples, rate) if fmt == "wav" else pcm16_bytes(samples)


def wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    """16-bit PCM WAV of float samples in [-1, 1] (1-D, or channels x samples)."""
    pcm = _pcm(samples)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(pcm.shape[0])
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.T.tobytes())
    return buf.getvalue()


def wav_stream_header(rate: int, channels: int = 1) -> bytes:
    """A 16-bit PCM WAV header whose lengths say "until the end of the stream" (0xFFFFFFFF, as
    streaming encoders write): the header of a WAV sent while its samples are still being made."""
    import struct

    block = channels * 2
    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * block, block, 16)
    return (
        b"RIFF"
        + struct.pack("<I", 0xFFFFFFFF)
        + b"WAVEfmt "
        + struct.pack("<I", 16)
        + fmt
        + b"data"
        + struct.pack("<I", 0xFFFFFFFF)
    )
