"""Media parts of chat requests (image_url, input_audio, audio_url, video_url): the router's checks and
400s, through the real OpenAI client, with the EchoEngine thinker (why: see its docstring). Media are
made here with the real encoders (PIL, wave, OpenCV); MP3 frames are built by hand (no MP3 encoder is
installed), with valid MPEG-1 layer III headers.

These tests stop at the stage boundary and check that the entry stage receives the parts as data URLs.
Real thinkers reading media: test_serve_speech.py (an image and a WAV `input_audio` part into the tiny
Qwen3-Omni thinker) and test_serve_qwen25_speech.py (image and audio compared with transformers, and a
`video_url` part).
"""

from __future__ import annotations

import base64
import http.server
import io
import os
import tempfile
import threading
import wave

import numpy as np
import openai
import pytest
from servelib import echo_cluster, echo_pipeline

from omni_runtime.spec import MediaLimits, PipelineSpec, RouterLimits, StageSpec

pytestmark = pytest.mark.timeout(60)

LIMITS = MediaLimits(max_parts=3, max_part_bytes=64 * 1024, max_audio_seconds=1.0, max_video_seconds=1.0,
                     allowed_domains=["localhost"])  # fmt: skip


def pipeline(name: str, modalities=("text", "image", "audio", "video")):
    topology = PipelineSpec(
        name=name, stages=[StageSpec(name="thinker", kind="ar", input_modalities=list(modalities), final_output=True)]
    )
    return echo_pipeline(topology, name=name, limits=RouterLimits(media=LIMITS))


def png(size: int = 8) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def wav(seconds: float, rate: int = 8000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.zeros(int(seconds * rate), dtype="<i2").tobytes())
    return buf.getvalue()


def mp3(seconds: float) -> bytes:
    """MPEG-1 layer III frames at 128 kb/s, 44.1 kHz (417 bytes, 1152 samples each), silent payload."""
    frames = int(seconds * 44100 / 1152) + 1
    return (bytes([0xFF, 0xFB, 0x90, 0x00]) + bytes(413)) * frames


def mp4(seconds: float, fps: int = 10) -> bytes:
    import cv2

    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, (32, 32))
        for i in range(int(seconds * fps)):
            writer.write(np.full((32, 32, 3), i * 8 % 255, dtype=np.uint8))
        writer.release()
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.unlink(path)


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image(data: bytes = b"", url: str | None = None) -> dict:
    return {"type": "image_url", "image_url": {"url": url or data_url("image/png", data or png())}}


def audio(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def video(data: bytes) -> dict:
    return {"type": "video_url", "video_url": {"url": data_url("video/mp4", data)}}


def ask(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "what is this"}, *parts]}]


async def bad(api, messages) -> str:
    with pytest.raises(openai.BadRequestError) as err:
        await api.chat.completions.create(model=api.model_name, messages=messages)
    return err.value.body["message"]


def client(base: str, name: str) -> openai.AsyncOpenAI:
    api = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    api.model_name = name  # type: ignore[attr-defined]
    return api


async def test_valid_media_reach_the_thinker_as_data_urls() -> None:
    p = pipeline("media-ok")
    async with echo_cluster(p) as cluster, client(cluster.base, p.name) as api:
        messages = ask(image(), audio(wav(0.5)), video(mp4(0.5)))
        await api.chat.completions.create(model=p.name, messages=messages)
        seen = cluster.engines["thinker"][0].seen[-1].data["messages"][0]["content"]
        assert [part["type"] for part in seen] == ["text", "image_url", "input_audio", "video_url"]
        assert seen[1]["image_url"]["url"].startswith("data:image/png;base64,")
        await api.chat.completions.create(model=p.name, messages=ask(audio(mp3(0.5), "mp3")))


async def test_count_bytes_and_seconds_are_bounded_naming_the_part() -> None:
    p = pipeline("media-limits")
    async with echo_cluster(p) as cluster, client(cluster.base, p.name) as api:
        message = await bad(api, ask(image(), image(), image(), image()))
        assert message.startswith("messages[0].content[4]: the request has 4 media parts")
        assert "at most 3 per request (limits.media.maxParts)" in message
        big = base64.b64encode(os.urandom(70 * 1024)).decode()
        message = await bad(api, ask({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{big}"}}))
        assert "messages[0].content[1]: the image_url is about" in message
        assert f"at most {64 * 1024} bytes per media part (limits.media.maxPartBytes)" in message
        message = await bad(api, ask(audio(wav(2.0))))
        assert message.startswith("messages[0].content[1]: the input_audio lasts 2.0s")
        assert "at most 1s (limits.media.maxAudioSeconds)" in message
        message = await bad(api, ask(audio(mp3(2.0), "mp3")))
        assert "the input_audio lasts 2.0s" in message
        message = await bad(api, ask(video(mp4(3.0))))
        assert "the video_url lasts 3.0s" in message and "limits.media.maxVideoSeconds" in message
        assert cluster.engines["thinker"][0].seen == []


async def test_unreadable_media_are_400s_naming_the_part() -> None:
    p = pipeline("media-bad")
    async with echo_cluster(p) as cluster, client(cluster.base, p.name) as api:
        message = await bad(api, ask(image(b"not a png at all")))
        assert message.startswith("messages[0].content[1]: the image_url is not a readable image")
        message = await bad(api, ask(audio(b"RIFF....garbage")))
        assert "the input_audio is not a readable WAV file" in message
        message = await bad(api, ask(audio(b"\x00" * 100, "mp3")))
        assert "the input_audio is not a readable MP3 file" in message
        message = await bad(api, ask(audio(wav(0.1), "flac")))
        assert "input_audio format 'flac' is not supported; use one of ['wav', 'mp3']" in message
        message = await bad(api, ask(video(b"\x00" * 1000)))
        assert "the video_url is not a readable video" in message
        broken = {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}
        assert "not valid base64" in await bad(api, ask(broken))
        assert cluster.engines["thinker"][0].seen == []


async def test_a_text_only_model_refuses_media() -> None:
    p = pipeline("media-text", modalities=("text",))
    async with echo_cluster(p) as cluster, client(cluster.base, p.name) as api:
        message = await bad(api, ask(image()))
        assert message == "messages[0].content[1]: this model takes ['text'], not image (image_url); remove the part"


class _PNGHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "http://169.254.169.254/latest/meta-data")
            self.end_headers()
            return
        body = png()
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


async def test_remote_urls_only_from_allowed_domains_and_never_redirected() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _PNGHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    p = pipeline("media-remote")
    try:
        async with echo_cluster(p) as cluster, client(cluster.base, p.name) as api:
            message = await bad(api, ask(image(url=f"http://127.0.0.1:{port}/x.png")))
            assert "the router does not fetch media from '127.0.0.1'" in message
            assert "allowed domains ['localhost'] (limits.media.allowedDomains)" in message
            message = await bad(api, ask(image(url="file:///etc/passwd")))
            assert "URL scheme 'file' is not supported" in message
            message = await bad(api, ask(image(url=f"http://localhost:{port}/moved")))
            assert "gave HTTP 302 (redirects are not followed)" in message
            await api.chat.completions.create(model=p.name, messages=ask(image(url=f"http://localhost:{port}/a.png")))
            seen = cluster.engines["thinker"][0].seen[-1].data["messages"][0]["content"][1]
            assert seen["image_url"]["url"] == data_url("image/png", png())
    finally:
        server.shutdown()
