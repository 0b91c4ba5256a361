"""`omnikube serve` of the text-chat pipeline on the tiny Qwen2 model, with two replicas of its stage,
driven through the real OpenAI client.

One run for the module (vLLM loads in about half a minute on CPU). The replica-kill test comes last:
it SIGKILLs a stage process, which `omnikube serve` then restarts.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest
from servelib import Serve, http_get, metric_values, pid_alive, process_tree, shm_segments

pytestmark = [pytest.mark.models, pytest.mark.timeout(900)]

MAX_MODEL_LEN = 256
LIMITS = {"max_concurrent_requests": 4, "max_queued_requests": 2, "request_timeout_s": 60,
          "max_body_bytes": 256 * 1024}  # fmt: skip


@pytest.fixture(scope="module")
def serve(tiny_chat_model, tmp_path_factory):
    spec = {
        "model": str(tiny_chat_model),
        "name": "chat-e2e",
        "stages": [
            {
                "name": "llm",
                "replicas": 2,
                "engine_args": {"max_model_len": MAX_MODEL_LEN, "kv_cache_memory_bytes": 64 * 1024**2, "seed": 0},
            }
        ],
        "limits": LIMITS,
    }
    run = Serve(spec, tmp_path_factory.mktemp("serve-chat"))
    tree = set()
    try:
        yield run
        for p in run.processes():
            if p.get("pid"):
                tree |= process_tree(p["pid"])
    finally:
        code = run.stop()
    assert code == 0, run.log.read_text()[-3000:]
    assert [pid for pid in tree if pid_alive(pid)] == [], "processes left behind after serve stopped"
    assert shm_segments(run.name) == []


@pytest.fixture
def api(serve):
    client = openai.OpenAI(base_url=serve.endpoint, api_key="none", max_retries=0, timeout=120)
    yield client
    client.close()


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


GREEDY = {"temperature": 0.0, "max_tokens": 16, "extra_body": {"ignore_eos": True}}


def test_models_health_and_metrics(serve, api) -> None:
    assert [m.id for m in api.models.list().data] == ["chat-e2e"]
    status, body = http_get(f"{serve.base}/health")
    assert status == 200 and '"llm":2' in body.replace(" ", "")
    assert "omnikube_stage_ready" in serve.stage_metrics("llm")[0]


def test_chat_answers_with_usage(api) -> None:
    reply = api.chat.completions.create(model="chat-e2e", messages=user("Tell me about the sea."), **GREEDY)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 16 and reply.usage.prompt_tokens > 5
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 16


def test_stream_deltas_concatenate_to_the_full_answer(api) -> None:
    whole = api.chat.completions.create(model="chat-e2e", messages=user("Write about a lighthouse."), **GREEDY)
    stream = api.chat.completions.create(
        model="chat-e2e", messages=user("Write about a lighthouse."), stream=True,
        stream_options={"include_usage": True}, **GREEDY,
    )  # fmt: skip
    deltas, usage, finish = [], None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.delta.content:
                deltas.append(choice.delta.content)
            finish = choice.finish_reason or finish
    assert len(deltas) > 1
    assert "".join(deltas) == whole.choices[0].message.content
    assert finish == "length" and usage.completion_tokens == 16


def test_n_gives_independent_choices(api) -> None:
    reply = api.chat.completions.create(
        model="chat-e2e", messages=user("A poem, please."), n=3, temperature=1.0, seed=5, max_tokens=8,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.message.content for c in reply.choices)
    assert len({c.message.content for c in reply.choices}) > 1  # seeds 5, 6, 7
    assert reply.usage.completion_tokens == 24


def test_bad_requests_get_openai_errors(serve, api) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        api.chat.completions.create(model="no-such-model", messages=user("hi"))
    assert "The model `no-such-model` does not exist" in err.value.body["message"]

    with pytest.raises(openai.BadRequestError) as err:
        api.chat.completions.create(model="chat-e2e", messages=user("hi"), modalities=["audio"])
    assert "modalities ['audio'] cannot be produced" in err.value.body["message"]
    assert "it can produce ['text']" in err.value.body["message"]

    long_prompt = "The quick brown fox jumps over the lazy dog. " * 40
    with pytest.raises(openai.BadRequestError) as err:
        api.chat.completions.create(model="chat-e2e", messages=user(long_prompt), max_tokens=4)
    message = err.value.body["message"]
    assert f"has max_model_len {MAX_MODEL_LEN}" in message and "the prompt is" in message
    assert int(message.split("the prompt is ")[1].split()[0]) > MAX_MODEL_LEN

    with httpx.Client(base_url=serve.base, trust_env=False) as http:
        bad = http.post("/v1/chat/completions", content=b'{"model": "chat-e2e", "messages": [}',
                        headers={"content-type": "application/json"})  # fmt: skip
        assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
        huge = http.post("/v1/chat/completions", json={"model": "chat-e2e", "messages": user("x" * 300_000)})
        assert huge.status_code == 413
        assert huge.json()["error"]["message"].startswith("the request body is")
        assert f"at most {256 * 1024} bytes" in huge.json()["error"]["message"]


async def test_full_admission_gives_429_and_disconnects_abort_every_stage_work(serve) -> None:
    body = {"model": "chat-e2e", "messages": user("Tell a very long story."), "stream": True,
            "max_tokens": 220, "ignore_eos": True}  # fmt: skip
    async with httpx.AsyncClient(base_url=serve.base, timeout=60, trust_env=False) as http:
        streams = []

        async def hold() -> None:
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                async for _ in response.aiter_lines():
                    streams.append(1)
                    await asyncio.sleep(0.05)  # a slow reader

        holders = [asyncio.create_task(hold()) for _ in range(6)]  # 4 in flight + 2 queued
        deadline = time.monotonic() + 30
        while True:
            metrics = serve.router_metrics()
            flight = metric_values(metrics, "omnikube_requests_in_flight")
            queued = metric_values(metrics, "omnikube_queue_depth")
            if flight == [4.0] and queued == [2.0]:
                break
            assert time.monotonic() < deadline, (flight, queued)
            await asyncio.sleep(0.05)
        refused = await http.post("/v1/chat/completions", json={**body, "stream": False})
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "RateLimitError"
        assert serve.running("llm") >= 1
        for task in holders:  # the clients go away mid-stream
            task.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
    serve.wait_idle(["llm"], timeout=30)
    metrics = serve.router_metrics()
    assert metric_values(metrics, "omnikube_requests_in_flight") == [0.0]
    assert metric_values(metrics, "omnikube_queue_depth") == [0.0]


def test_killed_replica_fails_its_request_and_the_other_replica_serves(serve, api) -> None:
    stream = api.chat.completions.create(
        model="chat-e2e", messages=user("Tell a very long story."), stream=True, max_tokens=220,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    iterator = iter(stream)
    next(iterator)
    busy = [p for p in serve.stage_processes("llm")
            if sum(metric_values(http_get(p["probe"].replace("/readyz", "/metrics"))[1],
                                 "omnikube_stage_requests_running")) == 1]  # fmt: skip
    assert len(busy) == 1
    victim = busy[0]
    started = time.monotonic()
    os.killpg(victim["pid"], signal.SIGKILL)  # the whole pod: stage server and vLLM engine core
    with pytest.raises(openai.APIError) as err:
        for _ in iterator:
            pass
    assert time.monotonic() - started < 10
    assert "failed while running request" in str(err.value.body or err.value.message)

    for i in range(4):
        reply = api.chat.completions.create(model="chat-e2e", messages=user(f"Hello {i}"), max_tokens=4)
        assert reply.choices[0].message.content is not None

    # `omnikube serve` restarts the dead process; the router takes it back once it answers
    deadline = time.monotonic() + 240
    while sum(metric_values(serve.router_metrics(), "omnikube_stage_replica_up", stage="llm")) < 2:
        assert time.monotonic() < deadline, serve.logs_tail()
        time.sleep(1)
    assert any(p["pid"] != victim["pid"] for p in serve.stage_processes("llm"))
