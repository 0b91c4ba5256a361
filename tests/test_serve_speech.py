"""`omnikube serve` of the tiny Qwen3-Omni (thinker on vLLM -> talker -> code2wav), through the real
OpenAI client, on one serve whose two edges take different connectors, as e2e/test_speech_cluster.py
deploys it: thinker -> talker `mooncake` (p2p), talker -> code2wav `shm`. Text and speech in one reply
(over both edges, each counted under its connector), audio streamed while the thinker still writes,
`modalities: ["text"]` running the thinker alone, an image and an audio part reaching the thinker, and a
client that disconnects mid-audio stopping every stage and leaving no payload behind on either side
(no mooncake block lent out by the thinker, no shm segment held or left by the talker).

One serve, not one per connector: a serve takes about a minute on an idle 2-core machine and up to 14 on
a loaded one (vLLM then needs about 6 to load the thinker). `inline` between served stage processes is
tested by tests/test_serve_t2i.py (`t2i[inline]`, enhancer -> dit), on the speech edges with echo stages
by tests/test_speech_api.py::test_text_and_audio_in_one_message[inline], and across pods by
e2e/test_end_to_end.py's `enhanced` pipeline.
"""

from __future__ import annotations

import base64
import io
import wave
from collections.abc import Iterator

import httpx
import openai
import pytest
from servelib import (
    Serve,
    assert_nothing_held,
    http_get,
    metric_values,
    pid_alive,
    process_tree,
    shm_segments,
)

pytestmark = [pytest.mark.models, pytest.mark.timeout(1500)]

STAGES = ("thinker", "talker", "code2wav")
THINKER_ARGS = {"max_model_len": 512, "kv_cache_memory_bytes": 64 * 1024**2, "seed": 0,
                "limit_mm_per_prompt": {"image": 1, "audio": 1, "video": 0}}  # fmt: skip
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
TALKER_FRAMES = 40


@pytest.fixture(scope="session")
def tiny_qwen3_omni_model():
    from servelib import tiny_model

    return tiny_model("tiny-qwen3-omni")


EDGE_CONNECTORS = {"talker": "mooncake", "code2wav": "shm"}
"""The connector of the edge into each downstream stage: the thinker's rows go over Mooncake p2p, the
talker's codec frames over shm."""


@pytest.fixture(scope="module")
def omni(tiny_qwen3_omni_model, tmp_path_factory) -> Iterator[Serve]:
    spec = {
        "model": str(tiny_qwen3_omni_model),
        "name": "omni-mixed",
        "stages": [
            {"name": "thinker", "engine_args": THINKER_ARGS},
            # random weights rarely say codec-eos: bound the frames (a request may ask for more)
            {"name": "talker", "sampling_params": {"max_tokens": TALKER_FRAMES}},
        ],
        "connectors": {
            "default": "mooncake",
            "edges": [{"from": "talker", "to": "code2wav", "connector": "shm"}],
            "mooncake": {"mode": "p2p", "global_segment_size": 64 * 1024**2, "local_buffer_size": 16 * 1024**2},
        },
        "limits": {"max_concurrent_requests": 8, "request_timeout_s": 300, "media": {"max_parts": 1}},
    }
    # shm: idle segments are unlinked as soon as they are released, so "no segment left" is checkable live
    run = Serve(spec, tmp_path_factory.mktemp("serve-omni-mixed"), args=("--shm-pool-bytes", "0"), ready_timeout=900)
    tree: set[int] = set()
    try:
        yield run
        for p in run.processes():
            for pid in [p.get("pid"), *(p.get("pids") or [])]:
                if pid:
                    tree |= process_tree(pid)
    finally:
        code = run.stop()
    assert code == 0, run.log.read_text()[-3000:]
    assert [pid for pid in tree if pid_alive(pid)] == [], "processes left behind after serve stopped"
    assert shm_segments(run.name) == []


def api_of(run: Serve) -> openai.OpenAI:
    return openai.OpenAI(base_url=run.endpoint, api_key="none", max_retries=0, timeout=600)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def stage_total(run: Serve, stage: str, name: str, **labels: str) -> float:
    return sum(sum(metric_values(text, name, **labels)) for text in run.stage_metrics(stage))


def chunks_over(run: Serve, source: str, target: str) -> float:
    """Handles `source` put on its edge to `target` under that edge's connector (EDGE_CONNECTORS)."""
    return stage_total(run, source, "omnikube_edge_chunks_total", target=target, connector=EDGE_CONNECTORS[target])


def test_text_and_speech_in_one_reply(omni: Serve) -> None:
    before = {"talker": chunks_over(omni, "thinker", "talker"), "code2wav": chunks_over(omni, "talker", "code2wav")}
    with api_of(omni) as api:
        voices = http_get(f"{omni.base}/v1/audio/voices")[1]
        assert '"voices":["aiden","chelsie","ethan"]' in voices.replace(" ", "")
        reply = api.chat.completions.create(
            model=omni.model, messages=user("Tell me about the sea."), modalities=["text", "audio"],
            audio={"voice": "ethan", "format": "wav"}, max_tokens=16, **GREEDY,
        )  # fmt: skip
        message = reply.choices[0].message
        assert message.content and reply.usage.completion_tokens == 16  # the thinker's tokens
        with wave.open(io.BytesIO(base64.b64decode(message.audio.data))) as w:
            assert w.getframerate() == 24000 and w.getnframes() > 0
    # the reply crossed both edges, each over its own connector
    assert chunks_over(omni, "thinker", "talker") > before["talker"]
    assert chunks_over(omni, "talker", "code2wav") > before["code2wav"]
    assert_nothing_held(omni, STAGES, kinds=("mooncake", "shm"), no_segments=True)


def test_a_parameter_a_speech_stage_does_not_take_is_a_400(omni: Serve) -> None:
    """Talker and code2wav read only their own knobs; anything else in `sampling_params_list` would be
    ignored without a word, so it is refused, naming the parameter and the stage."""
    with api_of(omni) as api:
        cases = [
            ([{}, {"min_p": 0.1}], "'talker' does not take the parameter(s) ['min_p']"),
            ([{}, {}, {"speed": 2}], "'code2wav' does not take the parameter(s) ['speed']"),
        ]
        for per_stage, named in cases:
            with pytest.raises(openai.BadRequestError) as err:
                api.chat.completions.create(
                    model=omni.model, messages=user("Hi."), modalities=["text", "audio"], max_tokens=4,
                    extra_body={"sampling_params_list": per_stage},
                )  # fmt: skip
            assert named in str(err.value)
    assert_nothing_held(omni, STAGES, kinds=("mooncake", "shm"), no_segments=True)


def test_streamed_audio_starts_before_the_text_is_finished(omni: Serve) -> None:
    with api_of(omni) as api:
        # 400 thinker tokens (ignore_eos): on an idle machine 96 tokens could all be written before the first
        # window (4 talker frames) was decoded; the talker is capped so the request stays short.
        stream = api.chat.completions.create(
            model=omni.model, messages=user("Tell me a long story."), modalities=["text", "audio"],
            audio={"format": "pcm16"}, stream=True, max_tokens=400, temperature=0.0,
            extra_body={**GREEDY["extra_body"], "sampling_params_list": [{}, {"max_tokens": 60}]},
        )  # fmt: skip
        order: list[str] = []
        for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    order.append("text")
                if choice.delta.audio:
                    order.append("audio")
        assert order.count("audio") > 1 and order.count("text") > 1
        last_text = len(order) - 1 - order[::-1].index("text")
        assert order.index("audio") < last_text, "no audio arrived before the thinker finished"
    # every thinker output went to the talker as it came (vLLM merges the steps a slow reader missed)
    assert chunks_over(omni, "thinker", "talker") > 1
    assert_nothing_held(omni, STAGES, kinds=("mooncake", "shm"), no_segments=True)


def test_text_only_runs_the_thinker_alone(omni: Serve) -> None:
    before = {s: stage_total(omni, s, "omnikube_stage_requests_total") for s in ("talker", "code2wav")}
    with api_of(omni) as api:
        reply = api.chat.completions.create(
            model=omni.model, messages=user("hi"), modalities=["text"], max_tokens=4, **GREEDY
        )
    assert reply.choices[0].message.content and reply.choices[0].message.audio is None
    assert {s: stage_total(omni, s, "omnikube_stage_requests_total") for s in ("talker", "code2wav")} == before


def test_an_image_reaches_the_thinker_and_is_spoken_about(omni: Serve) -> None:
    """vLLM's Qwen3-Omni thinker reads images on CPU and sends its rows at the image positions to the talker
    with the first chunk, over Mooncake: text and audio come back."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    content = [{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": url}}]
    with api_of(omni) as api:
        plain = api.chat.completions.create(model=omni.model, messages=user("what is this"), modalities=["text"],
                                            max_tokens=2, **GREEDY)  # fmt: skip
        reply = api.chat.completions.create(
            model=omni.model, messages=[{"role": "user", "content": content}], modalities=["text"], max_tokens=2,
            **GREEDY,
        )  # fmt: skip
        assert reply.usage.prompt_tokens > plain.usage.prompt_tokens + 2  # the image's placeholder tokens
        spoken = api.chat.completions.create(
            model=omni.model, messages=[{"role": "user", "content": content}], modalities=["text", "audio"],
            audio={"voice": "ethan", "format": "wav"}, max_tokens=8, **GREEDY,
        )  # fmt: skip
        message = spoken.choices[0].message
        assert message.content and spoken.usage.completion_tokens == 8
        with wave.open(io.BytesIO(base64.b64decode(message.audio.data))) as w:
            assert w.getframerate() == 24000 and w.getnframes() > 0
        with pytest.raises(openai.BadRequestError) as err:
            api.chat.completions.create(
                model=omni.model, messages=[{"role": "user", "content": content + content[1:]}], max_tokens=2
            )
        assert err.value.body["message"].startswith("messages[0].content[2]: the request has 2 media parts")


def test_an_audio_part_reaches_the_thinker_and_is_spoken_about(omni: Serve) -> None:
    """An `input_audio` part (a WAV, decoded by vLLM with PyAV) reaches the thinker, whose rows at the audio
    positions go to the talker over Mooncake: text and audio come back."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes(bytes(2 * 16000 // 2))  # half a second of silence
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(), "format": "wav"}}
    content = [{"type": "text", "text": "what do you hear"}, part]
    with api_of(omni) as api:
        plain = api.chat.completions.create(model=omni.model, messages=user("what do you hear"), modalities=["text"],
                                            max_tokens=2, **GREEDY)  # fmt: skip
        spoken = api.chat.completions.create(
            model=omni.model, messages=[{"role": "user", "content": content}], modalities=["text", "audio"],
            audio={"voice": "ethan", "format": "wav"}, max_tokens=8, **GREEDY,
        )  # fmt: skip
    assert spoken.usage.prompt_tokens > plain.usage.prompt_tokens + 2  # the audio's placeholder tokens
    message = spoken.choices[0].message
    assert message.content and spoken.usage.completion_tokens == 8
    with wave.open(io.BytesIO(base64.b64decode(message.audio.data))) as w:
        assert w.getframerate() == 24000 and w.getnframes() > 0
    assert_nothing_held(omni, STAGES, kinds=("mooncake", "shm"), no_segments=True)


async def test_disconnect_mid_audio_stops_every_stage_and_releases_every_payload(omni: Serve) -> None:
    body = {"model": omni.model, "messages": user("Talk for a long time."), "stream": True,
            "modalities": ["text", "audio"], "max_tokens": 400, "ignore_eos": True, "temperature": 0.0,
            "sampling_params_list": [{}, {"max_tokens": 4000}]}  # fmt: skip
    aborted = stage_total(omni, "talker", "omnikube_stage_requests_total", status="aborted")
    async with httpx.AsyncClient(base_url=omni.base, timeout=600, trust_env=False) as http:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if '"audio"' in line:
                    break
    assert_nothing_held(omni, STAGES, kinds=("mooncake", "shm"), no_segments=True)
    for stage in STAGES:  # each stage's work ended as aborted, not finished
        assert stage_total(omni, stage, "omnikube_stage_requests_total", status="aborted") >= 1
    assert stage_total(omni, "talker", "omnikube_stage_requests_total", status="aborted") > aborted
