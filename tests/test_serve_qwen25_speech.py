"""`omnikube serve` of the tiny Qwen2.5-Omni (thinker on vLLM streaming its rows -> talker -> token2wav),
through the real OpenAI client: one served pipeline for the whole module (shm connectors).

The anchor: greedy thinker and talker, the reply's text equals transformers' own `generate()` of the
whole model (`qwen25_reference`) and its waveform equals transformers' codec codes decoded in the
windows the edge cuts (4, then 25; within 2e-4 after the reply's 16-bit WAV quantization), so the
staged codes equal transformers' (the thinker's rows come from vLLM here, within about 1e-6 of
transformers'). Whole-output decoding equal to transformers' waveform is tested on the engine
(test_speech_engines). The same anchor for a prompt with an image and an audio part (vLLM's rows at
the media positions, the media grids the thinker stage sends, the talker's 3-D rope index). Also
streamed audio deltas, a `video_url` prompt, `/v1/audio/speech` and the voices of the token2wav speaker
dictionary.
"""

from __future__ import annotations

import base64
import io
import wave
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from servelib import Serve, http_get, tiny_model

pytestmark = [pytest.mark.models, pytest.mark.timeout(1500)]

THINKER_ARGS = {"max_model_len": 512, "kv_cache_memory_bytes": 64 * 1024**2, "seed": 0,
                "limit_mm_per_prompt": {"image": 1, "audio": 1, "video": 1}}  # fmt: skip
TOKENS = 8
FRAMES = 30
PROMPT = "Hello, who are you?"


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Serve]:
    spec = {
        "model": str(tiny_model("tiny-qwen2-5-omni")),
        "name": "q25",
        "stages": [
            {"name": "thinker", "engine_args": THINKER_ARGS, "sampling_params": {"repetition_penalty": 1.0}},
            # random weights rarely say codec-end: bound the codes (a request may ask for more)
            {"name": "talker", "sampling_params": {"max_tokens": FRAMES}},
        ],
        # whole outputs to token2wav: its decode is then transformers' own (windows: test_speech_engines)
        "connectors": {"default": "shm", "edges": [{"from": "talker", "to": "code2wav", "window": 0}]},
        "limits": {"max_concurrent_requests": 8, "request_timeout_s": 300},
    }
    run = Serve(spec, tmp_path_factory.mktemp("serve-q25"), ready_timeout=900)
    try:
        yield run
    finally:
        code = run.stop()
    assert code == 0, run.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def reference() -> dict:
    """transformers' generate() of the whole tiny model: generated ids and the waveform (seed 0)."""
    from qwen25_reference import generate_reference

    return generate_reference([(PROMPT, TOKENS, FRAMES)])[0]


def api_of(run: Serve) -> openai.OpenAI:
    return openai.OpenAI(base_url=run.endpoint, api_key="none", max_retries=0, timeout=600)


def samples(wav_bytes: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(wav_bytes)) as w:
        assert w.getframerate() == 24000 and w.getsampwidth() == 2
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32) / 32768


GREEDY_TALKER = {"sampling_params_list": [{}, {"temperature": 0.0}]}
MEDIA_FRAMES = 12
"""Codes of the media reply (fewer than FRAMES: transformers' token2wav decode is the slow part on CPU)."""


def test_chat_speaks_what_transformers_speaks(served: Serve, reference: dict) -> None:
    from transformers import AutoTokenizer

    voices = http_get(f"{served.base}/v1/audio/voices")[1]
    assert '"voices":["chelsie","ethan"]' in voices.replace(" ", "")
    with api_of(served) as api:
        reply = api.chat.completions.create(
            model=served.model, messages=[{"role": "user", "content": PROMPT}], modalities=["text", "audio"],
            audio={"voice": "ethan", "format": "wav"}, max_tokens=TOKENS, temperature=0.0, extra_body=GREEDY_TALKER,
        )  # fmt: skip
    message = reply.choices[0].message
    tokenizer = AutoTokenizer.from_pretrained(tiny_model("tiny-qwen2-5-omni"))
    assert reply.usage.completion_tokens == len(reference["tokens"])
    assert message.content == tokenizer.decode(reference["tokens"], skip_special_tokens=True)
    wav = samples(base64.b64decode(message.audio.data))
    expected = reference["wav"].numpy()
    assert wav.shape == expected.shape
    np.testing.assert_allclose(wav, np.clip(expected, -1, 1), atol=2e-4)


def test_image_and_audio_prompt_speaks_what_transformers_speaks(served: Serve) -> None:
    """`image_url` (PNG) + `input_audio` (16-bit WAV) + text, modalities [text, audio], greedy: the text
    equals transformers' generate() of the whole model on the same image and samples, and so does the
    WAV (within 2e-4, the 16-bit quantization of the reply), so the staged codes equal transformers'."""
    from qwen25_reference import generate_media_reference, media_parts
    from transformers import AutoTokenizer

    # a text whose reference codes all lie in token2wav's codebook (transformers would hand it any code;
    # the staged talker never draws those, so that reference could not be decoded nor equal)
    reference = generate_media_reference(("image", "audio"), "Describe it.", TOKENS, MEDIA_FRAMES)
    parts = media_parts()
    png, wav_in = io.BytesIO(), io.BytesIO()
    parts["image"].save(png, format="PNG")
    with wave.open(wav_in, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes((parts["audio"] * 32768).astype("<i2").tobytes())
    content = [
        {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()},
        },
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav_in.getvalue()).decode(), "format": "wav"}},
        {"type": "text", "text": "Describe it."},
    ]
    with api_of(served) as api:
        reply = api.chat.completions.create(
            model=served.model, messages=[{"role": "user", "content": content}], modalities=["text", "audio"],
            audio={"voice": "ethan", "format": "wav"}, max_tokens=TOKENS, temperature=0.0,
            extra_body={"sampling_params_list": [{}, {"temperature": 0.0, "max_tokens": MEDIA_FRAMES}]},
        )  # fmt: skip
    message = reply.choices[0].message
    tokenizer = AutoTokenizer.from_pretrained(tiny_model("tiny-qwen2-5-omni"))
    assert reply.usage.prompt_tokens == len(reference["prompt"])
    assert reply.usage.completion_tokens == len(reference["tokens"])
    assert message.content == tokenizer.decode(reference["tokens"], skip_special_tokens=True)
    wav = samples(base64.b64decode(message.audio.data))
    expected = reference["wav"].numpy()
    assert wav.shape == expected.shape
    np.testing.assert_allclose(wav, np.clip(expected, -1, 1), atol=2e-4)


def tiny_mp4(seconds: float = 0.5, fps: int = 8, size: int = 64) -> bytes:
    """An H.264 clip of grey frames growing lighter, made with PyAV (the engine's own MP4 library)."""
    import av

    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(int(seconds * fps)):
            frame = av.VideoFrame.from_ndarray(np.full((size, size, 3), 30 * i, np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return out.getvalue()


def test_a_video_prompt_is_spoken_about(served: Serve) -> None:
    """A `video_url` part reaches the thinker (its frames count as prompt tokens) and the talker speaks the
    reply from the thinker's rows, the video's grid and its 3-D rope index."""
    video = {
        "type": "video_url",
        "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(tiny_mp4()).decode()},
    }
    with api_of(served) as api:
        replies = [
            api.chat.completions.create(
                model=served.model,
                messages=[{"role": "user", "content": [*parts, {"type": "text", "text": "What happens?"}]}],
                modalities=["text", "audio"],
                audio={"voice": "ethan", "format": "wav"},
                max_tokens=TOKENS,
                temperature=0.0,
                extra_body={"sampling_params_list": [{}, {"max_tokens": 12}]},
            )  # fmt: skip
            for parts in ([video], [])
        ]
    with_video, text_only = replies
    assert with_video.usage.prompt_tokens > text_only.usage.prompt_tokens + 16  # the clip's tokens
    message = with_video.choices[0].message
    assert message.content and samples(base64.b64decode(message.audio.data)).size > 0


def test_streamed_chat_sends_audio_deltas(served: Serve) -> None:
    with api_of(served) as api:
        stream = api.chat.completions.create(
            model=served.model, messages=[{"role": "user", "content": "Tell me a story."}],
            modalities=["text", "audio"], audio={"voice": "chelsie", "format": "pcm16"}, stream=True,
            max_tokens=TOKENS, temperature=0.0,
        )  # fmt: skip
        text, audio = [], []
        for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    text.append(choice.delta.content)
                if choice.delta.audio and choice.delta.audio.data:
                    audio.append(base64.b64decode(choice.delta.audio.data))
    assert text and audio and sum(len(a) for a in audio) > 0


def test_speech_route_and_unknown_voice(served: Serve) -> None:
    body = {"model": served.model, "input": "Say hello.", "voice": "chelsie", "response_format": "wav"}
    with httpx.Client(base_url=served.base, timeout=600, trust_env=False) as http:
        response = http.post("/v1/audio/speech", json=body)
        assert response.status_code == 200, response.text
        assert len(samples(response.content)) > 0
        bad = http.post("/v1/audio/speech", json={**body, "voice": "nobody"})
        assert bad.status_code == 400 and "chelsie" in bad.text
