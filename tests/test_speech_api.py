"""Speech out through the router's OpenAI API, against real stage servers over ZeroMQ with stand-in
engines (EchoEngine thinker, EchoTalker, EchoCodec: see their docstrings for why). The hand-off,
windows, voices, audio encodings, metrics and cleanup are ours and real here; test_serve_speech.py
checks the same with the real engines on the tiny Qwen3-Omni.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import wave

import httpx
import numpy as np
import openai
import pytest
from servelib import EchoCodec, EchoTalker, busy_shm_segments, echo_cluster, echo_pipeline, metric_values

from omni_runtime.metrics import render
from omni_runtime.spec import EdgeSpec, PipelineSpec, StageSpec

pytestmark = pytest.mark.timeout(60)

ENGINES = {"talker": EchoTalker, "code2wav": EchoCodec}
WORDS = "one two three four five six seven"


def speech_topology(connector: str, window: int, name: str, first_window: int = 0) -> PipelineSpec:
    return PipelineSpec(
        name=name,
        stages=[
            StageSpec(name="thinker", kind="ar", output_modality="text", final_output=True),
            StageSpec(name="talker", kind="generation", input_modalities=["hidden"], output_modality="hidden"),
            StageSpec(
                name="code2wav",
                kind="generation",
                input_modalities=["hidden"],
                output_modality="audio",
                final_output=True,
            ),  # fmt: skip
        ],
        edges=[
            EdgeSpec(**{"from": "thinker", "to": "talker", "connector": connector, "window": 1 if window else 0}),
            EdgeSpec(source="talker", target="code2wav", connector=connector, window=window, first_window=first_window),
        ],
    )


def speech_pipeline(connector: str = "shm", window: int = 2, name: str = "speech", first_window: int = 0):
    return echo_pipeline(speech_topology(connector, window, name, first_window), name=name)


def client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def wav_samples(data: bytes) -> tuple[np.ndarray, int]:
    with wave.open(io.BytesIO(data)) as w:
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2"), w.getframerate()


def expected_pcm(n_tokens: int) -> np.ndarray:
    """EchoThinker emits token ids 0..n-1; EchoTalker one frame per id; EchoCodec 240 samples each."""
    floats = np.repeat((np.arange(n_tokens, dtype=np.float32) + 1) / 1000, EchoCodec.SAMPLES)
    return (floats * 32767.0).astype("<i2")


def stage_count(stage: str, status: str = "ok") -> float:
    text = render()[0].decode()
    return sum(metric_values(text, "omnikube_stage_requests", stage=stage, status=status))


@pytest.mark.parametrize("connector", ["inline", "shm", "mooncake"])
async def test_text_and_audio_in_one_message(connector: str, request) -> None:
    pipeline = speech_pipeline(connector, name=f"speech-{connector}")
    if connector == "mooncake":  # p2p: every stage's transfer engine registers with the metadata server
        master = request.getfixturevalue("mooncake_master")
        pipeline.topology.connectors.mooncake.master_port = master.rpc_port
        pipeline.topology.connectors.mooncake.metadata_port = master.metadata_port
        pipeline.topology.connectors.mooncake.global_segment_size = 64 * 1024**2
    async with echo_cluster(pipeline, engines=ENGINES) as cluster, client(cluster.base) as api:
        reply = await api.chat.completions.create(
            model=pipeline.name, messages=user(WORDS), modalities=["text", "audio"],
            audio={"voice": "ethan", "format": "wav"},
        )  # fmt: skip
        assert len(reply.choices) == 1
        message = reply.choices[0].message
        assert message.content == WORDS + " "
        samples, rate = wav_samples(base64.b64decode(message.audio.data))
        assert rate == 24000
        assert np.array_equal(samples, expected_pcm(7))
        assert reply.usage.completion_tokens == 7  # the thinker's tokens, not the talker's frames
        talker = cluster.engines["talker"][0]
        assert talker.voices_seen == ["ethan"]
        # thinker -> talker streams per step (window 1); talker -> code2wav in windows of 2 frames
        assert talker.chunks_seen == [[i] for i in range(7)]
        assert cluster.engines["code2wav"][0].chunks_seen == [[2], [2], [2], [1]]
        moved = metric_values(render()[0].decode(), "omnikube_edge_chunks_total", pipeline=pipeline.name)
        assert moved and sum(moved) == 7 + 4  # every chunk went through `connector`
        labels = metric_values(render()[0].decode(), "omnikube_edge_chunks_total", connector=connector)
        assert sum(labels) >= 11
        assert busy_shm_segments(pipeline.name) == []


async def test_pcm16_format_and_whole_output_edges() -> None:
    pipeline = speech_pipeline("shm", window=0, name="speech-whole")
    async with echo_cluster(pipeline, engines=ENGINES) as cluster, client(cluster.base) as api:
        reply = await api.chat.completions.create(
            model=pipeline.name, messages=user(WORDS), modalities=["text", "audio"], audio={"format": "pcm16"}
        )
        pcm = np.frombuffer(base64.b64decode(reply.choices[0].message.audio.data), dtype="<i2")
        assert np.array_equal(pcm, expected_pcm(7))
        # window 0: each stage gets its upstream's whole output once
        assert cluster.engines["talker"][0].chunks_seen == [list(range(7))]
        assert cluster.engines["code2wav"][0].chunks_seen == [[7]]


async def test_a_small_first_window_starts_the_decoder_sooner() -> None:
    pipeline = speech_pipeline("shm", window=3, first_window=1, name="speech-first")
    async with echo_cluster(pipeline, engines=ENGINES) as cluster, client(cluster.base) as api:
        reply = await api.chat.completions.create(model=pipeline.name, messages=user(WORDS), modalities=["audio"])
        samples, _ = wav_samples(base64.b64decode(reply.choices[0].message.audio.data))
        assert np.array_equal(samples, expected_pcm(7))
        assert reply.choices[0].message.content is None  # audio only: the thinker's text is not returned
        assert cluster.engines["code2wav"][0].chunks_seen == [[1], [3], [3]]


async def test_text_only_sends_no_work_to_the_speech_stages() -> None:
    pipeline = speech_pipeline(name="speech-text")
    async with echo_cluster(pipeline, engines=ENGINES) as cluster, client(cluster.base) as api:
        before = stage_count("talker"), stage_count("code2wav")
        reply = await api.chat.completions.create(model=pipeline.name, messages=user("hi there"), modalities=["text"])
        assert reply.choices[0].message.content == "hi there "
        assert reply.choices[0].message.audio is None
        assert (stage_count("talker"), stage_count("code2wav")) == before
        assert cluster.engines["talker"][0].seen == [] and cluster.engines["code2wav"][0].seen == []


async def test_stream_sends_audio_deltas_while_the_text_is_still_coming() -> None:
    pipeline = speech_pipeline(name="speech-stream")
    async with echo_cluster(pipeline, engines=ENGINES) as cluster, client(cluster.base) as api:
        stream = await api.chat.completions.create(
            model=pipeline.name, messages=user(WORDS), modalities=["text", "audio"], stream=True,
            audio={"voice": "chelsie", "format": "pcm16"}, stream_options={"include_usage": True},
            extra_body={"sampling_params_list": [{"delay": 0.05}]},
        )  # fmt: skip
        order, text, pcm, finishes, usage = [], "", b"", [], None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                if choice.delta.content:
                    order.append("text")
                    text += choice.delta.content
                if choice.delta.audio:
                    order.append("audio")
                    pcm += base64.b64decode(choice.delta.audio.data)
                if choice.finish_reason:
                    finishes.append(choice.finish_reason)
        assert text == WORDS + " "
        assert np.array_equal(np.frombuffer(pcm, dtype="<i2"), expected_pcm(7))
        assert order.count("audio") == 4  # one delta per decoded window: 2 + 2 + 2 + 1 frames
        assert order.index("audio") < len(order) - 1 - order[::-1].index("text")  # audio before the text ended
        assert finishes == ["stop"] and usage.completion_tokens == 7
        assert cluster.engines["talker"][0].voices_seen == ["chelsie"]


async def test_voices_are_listed_and_an_unknown_voice_is_a_400() -> None:
    pipeline = speech_pipeline(name="speech-voices")
    async with echo_cluster(pipeline, engines=ENGINES) as cluster, client(cluster.base) as api:
        async with httpx.AsyncClient(base_url=cluster.base) as http:
            voices = (await http.get("/v1/audio/voices")).json()
        assert voices["voices"] == ["chelsie", "ethan"]
        with pytest.raises(openai.BadRequestError) as err:
            await api.chat.completions.create(
                model=pipeline.name, messages=user("hi"), modalities=["text", "audio"], audio={"voice": "bob"}
            )
        message = err.value.body["message"]
        assert message == "audio.voice 'bob' is not a voice of this model; use one of ['chelsie', 'ethan']"
        with pytest.raises(openai.BadRequestError) as err:
            await api.chat.completions.create(
                model=pipeline.name, messages=user("hi"), modalities=["text", "audio"], audio={"format": "mp3"}
            )
        assert "audio.format 'mp3' is not supported; use one of ['wav', 'pcm16']" in err.value.body["message"]
        with pytest.raises(openai.BadRequestError) as err:
            await api.audio.speech.create(model=pipeline.name, input="hi", voice="bob")
        assert "use one of ['chelsie', 'ethan']" in json.loads(err.value.response.text)["error"]["message"]
        assert cluster.engines["talker"][0].seen == []


async def test_speech_endpoint_whole_file_sse_and_raw_stream() -> None:
    pipeline = speech_pipeline(name="speech-tts")
    async with echo_cluster(pipeline, engines=ENGINES) as cluster, client(cluster.base) as api:
        wav = await api.audio.speech.create(model=pipeline.name, input=WORDS, voice="ethan", response_format="wav")
        samples, _ = wav_samples(wav.content)
        assert np.array_equal(samples, expected_pcm(7))
        pcm = await api.audio.speech.create(model=pipeline.name, input=WORDS, voice="ethan", response_format="pcm")
        assert np.array_equal(np.frombuffer(pcm.content, dtype="<i2"), expected_pcm(7))
        async with httpx.AsyncClient(base_url=cluster.base, timeout=20) as http:
            body = {"model": pipeline.name, "input": WORDS, "response_format": "pcm", "stream_format": "sse"}
            events = []
            async with http.stream("POST", "/v1/audio/speech", json=body) as response:
                assert response.headers["content-type"].startswith("text/event-stream")
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        events.append(json.loads(line[6:]))
            assert [e["type"] for e in events] == ["speech.audio.delta"] * 4 + ["speech.audio.done"]
            joined = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
            assert np.array_equal(np.frombuffer(joined, dtype="<i2"), expected_pcm(7))
            assert events[-1]["usage"]["output_tokens"] == 7
            body["stream_format"], body["response_format"] = "audio", "wav"
            raw = await http.post("/v1/audio/speech", json=body)
            assert raw.headers["content-type"] == "audio/wav" and raw.content[:4] == b"RIFF"
            assert np.array_equal(np.frombuffer(raw.content[44:], dtype="<i2"), expected_pcm(7))
            bad = await http.post("/v1/audio/speech", json={**body, "response_format": "mp3"})
            assert bad.status_code == 400 and "use one of ['wav', 'pcm']" in bad.json()["error"]["message"]
            # What the models cannot honour is refused by name, never accepted and ignored.
            for field, value, says in (
                ("speed", 1.5, "speed 1.5 is not supported"),
                ("instructions", "whisper", "instructions are not supported"),
                ("pitch", 2, "pitch"),
            ):
                refused = await http.post("/v1/audio/speech", json={**body, field: value})
                error = refused.json()["error"]
                assert refused.status_code == 400 and says in error["message"] and error["param"] == field, error
        assert len(cluster.engines["talker"][0].seen) == 4


async def test_speech_needs_an_audio_pipeline() -> None:
    pipeline = echo_pipeline(PipelineSpec(name="txt", stages=[StageSpec(name="llm", kind="ar", final_output=True)]),
                             name="speech-none")  # fmt: skip
    async with echo_cluster(pipeline) as cluster, httpx.AsyncClient(base_url=cluster.base) as http:
        reply = await http.post("/v1/audio/speech", json={"input": "hi"})
        assert reply.status_code == 400
        assert "produces ['text'], not audio" in reply.json()["error"]["message"]
        assert (await http.get("/v1/audio/voices")).json()["voices"] == []


async def test_metrics_count_audio_edges_and_first_packet() -> None:
    pipeline = speech_pipeline(name="speech-metrics")
    async with echo_cluster(pipeline, engines=ENGINES) as cluster, client(cluster.base) as api:
        await api.chat.completions.create(model=pipeline.name, messages=user(WORDS), modalities=["text", "audio"])
        text = render()[0].decode()
        name = pipeline.name

        def edge_chunks(source: str, target: str) -> list[float]:
            return metric_values(text, "omnikube_edge_chunks_total", pipeline=name, stage=source, target=target)

        seconds = 7 * EchoCodec.SAMPLES / 24000
        assert metric_values(text, "omnikube_stage_audio_seconds_total", pipeline=name, stage="code2wav") == [
            pytest.approx(seconds)
        ]
        assert metric_values(text, "omnikube_audio_seconds_total", pipeline=name) == [pytest.approx(seconds)]
        assert metric_values(text, "omnikube_audio_real_time_factor_count", pipeline=name) == [1.0]
        ttfp = metric_values(text, "omnikube_time_to_first_packet_seconds_count", pipeline=name, modality="audio")
        assert ttfp == [1.0]
        assert metric_values(text, "omnikube_stage_time_to_first_packet_seconds_count", pipeline=name) == [1.0]
        # 7 per-step chunks (the last token's chunk is marked last); windows 2+2+2+1
        assert edge_chunks("thinker", "talker") == [7.0]
        assert edge_chunks("talker", "code2wav") == [4.0]
        assert metric_values(text, "omnikube_edge_bytes_total", pipeline=name, stage="talker")[0] > 0


async def test_disconnect_mid_audio_aborts_every_stage_and_releases_every_payload() -> None:
    pipeline = speech_pipeline(name="speech-cancel")
    async with echo_cluster(pipeline, engines=ENGINES) as cluster:
        body = {"model": pipeline.name, "messages": user("w " * 80), "stream": True, "modalities": ["text", "audio"],
                "sampling_params_list": [{"delay": 0.02}, {"frame_delay": 0.02}]}  # fmt: skip
        async with httpx.AsyncClient(base_url=cluster.base, timeout=10) as http:
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if '"audio"' in line:
                        break
        for stage in ("thinker", "talker", "code2wav"):
            deadline = asyncio.get_running_loop().time() + 5
            while any(s.works for s in cluster.servers[stage]):
                assert asyncio.get_running_loop().time() < deadline, f"{stage} still runs"
                await asyncio.sleep(0.02)
        assert cluster.engines["talker"][0].aborted and cluster.engines["thinker"][0].aborted
        assert cluster.engines["code2wav"][0].aborted
        deadline = asyncio.get_running_loop().time() + 5
        while busy_shm_segments(pipeline.name):
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.02)
