"""Checking the media parts of a chat request before any stage sees them.

Parts: `image_url` ({url}), `input_audio` ({data: base64, format: wav|mp3}), `audio_url` and `video_url`
({url}). A URL is a `data:` URL, or an http(s) URL whose host is one of the pipeline's
`limits.media.allowed_domains` (or a subdomain): the router fetches it (no redirects, bounded size)
and passes it on as a data URL, so stage pods never fetch anything and nobody can make them reach an
arbitrary address. Every part is decoded to check it: count, bytes, and seconds of audio and video
are bounded by the pipeline's `MediaLimits`; the 400 names the part (`messages[1].content[2]`).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import tempfile
import wave
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from omni_runtime.router.errors import BadRequest
from omni_runtime.spec import MediaLimits

__all__ = ["MEDIA_PART_TYPES", "MediaPart", "check_media", "media_parts"]

MEDIA_PART_TYPES = {"image_url": "image", "input_audio": "audio", "audio_url": "audio", "video_url": "video"}
"""Content part type -> the modality it brings to the thinker."""

AUDIO_FORMATS = ("wav", "mp3")
FETCH_TIMEOUT_S = 10.0


@dataclass
class MediaPart:
    where: str
    """`messages[i].content[j]`, for error messages."""
    kind: str
    """The part's type (image_url, input_audio, audio_url, video_url)."""
    part: dict[str, Any]


def media_parts(messages: list[dict[str, Any]]) -> list[MediaPart]:
    """The media parts of `messages`, in order."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA_PART_TYPES:
                out.append(MediaPart(f"messages[{i}].content[{j}]", kind, part))
    return out


def check_media(messages: list[dict[str, Any]], limits: MediaLimits, accepted: list[str]) -> None:
    """Check every media part (count, kind, readability, bytes, seconds), fetching allowed remote URLs
    and replacing them by data URLs in place. `accepted`: modalities the entry stage takes.
    Raises BadRequest naming the part. Blocking (decodes media): call it in a worker thread."""
    parts = media_parts(messages)
    for n, media in enumerate(parts):
        modality = MEDIA_PART_TYPES[media.kind]
        if modality not in accepted:
            raise BadRequest(
                f"{media.where}: this model takes {accepted}, not {modality} ({media.kind}); remove the part",
                param="messages",
            )
        if n >= limits.max_parts:
            raise BadRequest(
                f"{media.where}: the request has {len(parts)} media parts; this pipeline accepts at most "
                f"{limits.max_parts} per request (limits.media.maxParts); send fewer",
                param="messages",
            )
        _check_part(media, limits)


def _check_part(media: MediaPart, limits: MediaLimits) -> None:
    if media.kind == "input_audio":
        body = media.part.get("input_audio")
        if not isinstance(body, dict) or not isinstance(body.get("data"), str):
            raise BadRequest(f"{media.where}: input_audio needs {{data: base64, format}}", param="messages")
        fmt = str(body.get("format", "wav")).lower()
        if fmt not in AUDIO_FORMATS:
            raise BadRequest(
                f"{media.where}: input_audio format {fmt!r} is not supported; use one of {list(AUDIO_FORMATS)}",
                param="messages",
            )
        data = _b64(media, body["data"], limits)
        _check_audio(media, data, fmt, limits)
        return
    body = media.part.get(media.kind)
    if not isinstance(body, dict):
        body = {}
    url = body.get("url")
    if not isinstance(url, str) or not url:
        raise BadRequest(f"{media.where}: {media.kind} needs {{url}}", param="messages")
    if url.startswith("data:"):
        mime, data = _data_url(media, url, limits)
    else:
        mime, data = _fetch(media, url, limits)
        body["url"] = f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"
    if media.kind == "image_url":
        _check_image(media, data)
    elif media.kind == "audio_url":
        _check_audio(media, data, "mp3" if "mpeg" in mime or "mp3" in mime else "wav", limits)
    else:
        _check_video(media, data, limits)


def _too_big(media: MediaPart, size: str, limits: MediaLimits) -> BadRequest:
    return BadRequest(
        f"{media.where}: the {media.kind} is {size} bytes; this pipeline accepts at most {limits.max_part_bytes} "
        "bytes per media part (limits.media.maxPartBytes); send a smaller or shorter one",
        param="messages",
    )


def _b64(media: MediaPart, text: str, limits: MediaLimits) -> bytes:
    if len(text) * 3 // 4 > limits.max_part_bytes + 3:  # bound before decoding
        raise _too_big(media, f"about {len(text) * 3 // 4}", limits)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{media.where}: the {media.kind} data is not valid base64", param="messages") from None
    if len(data) > limits.max_part_bytes:
        raise _too_big(media, str(len(data)), limits)
    return data


def _data_url(media: MediaPart, url: str, limits: MediaLimits) -> tuple[str, bytes]:
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise BadRequest(
            f"{media.where}: the {media.kind} data URL must look like data:<type>;base64,<data>", param="messages"
        )
    return head[5 : -len(";base64")].lower(), _b64(media, payload, limits)


def _fetch(media: MediaPart, url: str, limits: MediaLimits) -> tuple[str, bytes]:
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    allowed = [d.lower().lstrip(".") for d in limits.allowed_domains]
    if parts.scheme not in ("http", "https") or not host:
        raise BadRequest(f"{media.where}: {media.kind} URL scheme {parts.scheme!r} is not supported; send a data "
                         "URL (data:<type>;base64,...)", param="messages")  # fmt: skip
    if not any(host == d or host.endswith(f".{d}") for d in allowed):
        raise BadRequest(
            f"{media.where}: the router does not fetch media from {host!r}: remote URLs are only fetched from "
            f"the pipeline's allowed domains {allowed} (limits.media.allowedDomains); send the media as a data URL",
            param="messages",
        )
    import httpx

    try:
        with httpx.Client(timeout=FETCH_TIMEOUT_S, follow_redirects=False, trust_env=False) as http:  # noqa: SIM117
            with http.stream("GET", url) as response:
                if response.status_code != 200:
                    raise BadRequest(
                        f"{media.where}: fetching {url} gave HTTP {response.status_code} (redirects are not "
                        "followed); give a URL that answers 200, or a data URL",
                        param="messages",
                    )
                data = bytearray()
                for piece in response.iter_bytes():
                    data.extend(piece)
                    if len(data) > limits.max_part_bytes:
                        raise _too_big(media, f"more than {limits.max_part_bytes}", limits)
                mime = response.headers.get("content-type", "application/octet-stream").split(";")[0].strip()
    except httpx.HTTPError as err:
        raise BadRequest(f"{media.where}: fetching {url} failed: {err}", param="messages") from None
    return mime.lower(), bytes(data)


def _unreadable(media: MediaPart, what: str, err: Exception | str) -> BadRequest:
    return BadRequest(f"{media.where}: the {media.kind} is not a readable {what} ({err})", param="messages")


def _check_image(media: MediaPart, data: bytes) -> None:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
    except Exception as err:  # PIL raises many types for bad data
        raise _unreadable(media, "image (PNG, JPEG, WebP...)", err) from None


def _check_seconds(media: MediaPart, seconds: float, limit: float, key: str) -> None:
    if seconds > limit:
        raise BadRequest(
            f"{media.where}: the {media.kind} lasts {seconds:.1f}s; this pipeline accepts at most {limit:g}s "
            f"(limits.media.{key}); send a shorter one",
            param="messages",
        )


def _check_audio(media: MediaPart, data: bytes, fmt: str, limits: MediaLimits) -> None:
    if fmt == "wav":
        try:
            with wave.open(io.BytesIO(data)) as w:
                seconds = w.getnframes() / float(w.getframerate())
        except (wave.Error, EOFError, ZeroDivisionError) as err:
            raise _unreadable(media, "WAV file", err) from None
    else:
        seconds = _mp3_seconds(data)
        if seconds is None:
            raise _unreadable(media, "MP3 file", "no MPEG audio frames found")
    _check_seconds(media, seconds, limits.max_audio_seconds, "maxAudioSeconds")


def _check_video(media: MediaPart, data: bytes, limits: MediaLimits) -> None:
    import cv2

    fd, path = tempfile.mkstemp(suffix=".video")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        capture = cv2.VideoCapture(path)
        try:
            frames = capture.get(cv2.CAP_PROP_FRAME_COUNT)
            fps = capture.get(cv2.CAP_PROP_FPS)
            ok = capture.isOpened() and frames > 0 and fps > 0 and capture.read()[0]
        finally:
            capture.release()
    finally:
        os.unlink(path)
    if not ok:
        raise _unreadable(media, "video (MP4, WebM...)", "no frames could be decoded")
    _check_seconds(media, frames / fps, limits.max_video_seconds, "maxVideoSeconds")


_MP3_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}
_MP3_KBPS = {
    (3, 1): (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    (2, 1): (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
}


def _mp3_seconds(data: bytes) -> float | None:
    """Duration of MPEG audio layer III data by walking its frame headers (skipping an ID3v2 tag);
    None when no frame is found."""
    pos = 0
    if data[:3] == b"ID3" and len(data) >= 10:
        pos = 10 + ((data[6] & 0x7F) << 21 | (data[7] & 0x7F) << 14 | (data[8] & 0x7F) << 7 | data[9] & 0x7F)
    seconds, frames = 0.0, 0
    while pos + 4 <= len(data):
        b1, b2 = data[pos + 1], data[pos + 2]
        version, layer = (b1 >> 3) & 3, (b1 >> 1) & 3
        if data[pos] != 0xFF or (b1 & 0xE0) != 0xE0 or version == 1 or layer != 1:
            if frames:
                break  # trailing tag or garbage after the audio
            pos += 1
            continue
        kbps = _MP3_KBPS[(3 if version == 3 else 2, 1)][(b2 >> 4) & 0xF] if (b2 >> 4) & 0xF < 15 else 0
        rate_index = (b2 >> 2) & 3
        if not kbps or rate_index == 3:
            pos += 1
            continue
        rate = _MP3_RATES[version][rate_index]
        samples = 1152 if version == 3 else 576
        size = samples // 8 * kbps * 1000 // rate + ((b2 >> 1) & 1)
        seconds += samples / rate
        frames += 1
        pos += size
    return seconds if frames else None
