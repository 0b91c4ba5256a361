"""`omnikube serve` of the text-chat pipeline on the tiny Qwen2 model, with two replicas of its stage,
driven through the real OpenAI client.

The serve is the session's shared one (`chat_serve` in conftest.py, specified by servelib.chat_serve_spec;
the drain, fuzz and conformance modules use it too). The replica-kill test is `destructive`: it SIGKILLs
a stage process, which `omnikube serve` then restarts, so it runs after every test that only reads the
serve (conftest.py's collection hook).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest
from servelib import (
    CHAT_LIMITS,
    CHAT_MAX_MODEL_LEN,
    CHAT_MODEL,
    CHAT_REPLICAS,
    http_get,
    metric_values,
    pid_alive,
    process_tree,
    wait_serving,
)

pytestmark = [pytest.mark.models, pytest.mark.timeout(900)]

MODEL = CHAT_MODEL
IN_FLIGHT, QUEUED = CHAT_LIMITS["max_concurrent_requests"], CHAT_LIMITS["max_queued_requests"]
MAX_BODY = CHAT_LIMITS["max_body_bytes"]


@pytest.fixture
def serve(chat_serve):
    """The session's shared text-chat serve (conftest.py)."""
    return chat_serve


@pytest.fixture
def api(serve):
    client = openai.OpenAI(base_url=serve.endpoint, api_key="none", max_retries=0, timeout=120)
    yield client
    client.close()


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


GREEDY = {"temperature": 0.0, "max_tokens": 16, "extra_body": {"ignore_eos": True}}


def test_models_health_and_metrics(serve, api) -> None:
    assert [m.id for m in api.models.list().data] == [MODEL]
    status, body = http_get(f"{serve.base}/health")
    assert status == 200 and f'"llm":{CHAT_REPLICAS}' in body.replace(" ", "")
    assert "omnikube_stage_ready" in serve.stage_metrics("llm")[0]


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace")


def test_each_stage_process_runs_vllms_worker_inside_its_engine_core(serve) -> None:
    """`omnikube stage` keeps vLLM's worker in the engine-core process (stage.settings.STAGE_ENV_DEFAULTS):
    each replica is its own process plus vLLM's engine core, not a third process importing vLLM again."""
    for proc in serve.stage_processes("llm"):
        below = [_cmdline(pid) for pid in process_tree(proc["pid"]) - {proc["pid"]}]
        vllm = [cmd for cmd in below if "resource_tracker" not in cmd]  # multiprocessing's own helper
        assert len(vllm) == 1, f"{proc['name']}: processes below the stage: {below}"
        with open(f"/proc/{proc['pid']}/environ", "rb") as f:
            assert b"VLLM_ENABLE_V1_MULTIPROCESSING=0" not in f.read().split(b"\0")  # the stage set it itself


def test_chat_answers_with_usage(api) -> None:
    reply = api.chat.completions.create(model=MODEL, messages=user("Tell me about the sea."), **GREEDY)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 16 and reply.usage.prompt_tokens > 5
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 16


def test_stream_deltas_concatenate_to_the_full_answer(api) -> None:
    whole = api.chat.completions.create(model=MODEL, messages=user("Write about a lighthouse."), **GREEDY)
    stream = api.chat.completions.create(
        model=MODEL, messages=user("Write about a lighthouse."), stream=True,
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
        model=MODEL, messages=user("A poem, please."), n=3, temperature=1.0, seed=5, max_tokens=8,
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
        api.chat.completions.create(model=MODEL, messages=user("hi"), modalities=["audio"])
    assert "modalities ['audio'] cannot be produced" in err.value.body["message"]
    assert "it can produce ['text']" in err.value.body["message"]

    long_prompt = "sea " * CHAT_MAX_MODEL_LEN  # a token a word at least (the tokenizer splits at spaces)
    with pytest.raises(openai.BadRequestError) as err:
        api.chat.completions.create(model=MODEL, messages=user(long_prompt), max_tokens=4)
    message = err.value.body["message"]
    assert f"has max_model_len {CHAT_MAX_MODEL_LEN}" in message and "the prompt is" in message
    assert int(message.split("the prompt is ")[1].split()[0]) > CHAT_MAX_MODEL_LEN

    with httpx.Client(base_url=serve.base, trust_env=False) as http:
        bad = http.post("/v1/chat/completions", content=b'{"model": MODEL, "messages": [}',
                        headers={"content-type": "application/json"})  # fmt: skip
        assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
        huge = http.post("/v1/chat/completions", json={"model": MODEL, "messages": user("x" * MAX_BODY)})
        assert huge.status_code == 413
        assert huge.json()["error"]["message"].startswith("the request body is")
        assert f"at most {MAX_BODY} bytes" in huge.json()["error"]["message"]


async def test_full_admission_gives_429_and_disconnects_abort_every_stage_work(serve) -> None:
    body = {"model": MODEL, "messages": user("Tell a very long story."), "stream": True,
            "max_tokens": 220, "ignore_eos": True}  # fmt: skip
    async with httpx.AsyncClient(base_url=serve.base, timeout=60, trust_env=False) as http:
        streams = []

        async def hold() -> None:
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                async for _ in response.aiter_lines():
                    streams.append(1)
                    await asyncio.sleep(0.05)  # a slow reader

        holders = [asyncio.create_task(hold()) for _ in range(IN_FLIGHT + QUEUED)]
        deadline = time.monotonic() + 30
        while True:
            metrics = serve.router_metrics()
            flight = metric_values(metrics, "omnikube_requests_in_flight")
            queued = metric_values(metrics, "omnikube_queue_depth")
            if flight == [float(IN_FLIGHT)] and queued == [float(QUEUED)]:
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


def ok_works(probe: str) -> float:
    """Works the replica of `probe` finished with status ok; 0 while it is down."""
    try:
        status, text = http_get(probe.replace("/readyz", "/metrics"))
    except OSError:
        return 0.0
    return sum(metric_values(text, "omnikube_stage_requests_total", status="ok")) if status == 200 else 0.0


@pytest.mark.destructive
def test_killed_replica_fails_its_request_and_the_other_replica_serves(serve, api) -> None:
    """A replica SIGKILLed mid-stream: its request fails with the router's replica-lost error (not a
    timeout: the client would then see no error body), new requests go to the other replica and succeed,
    and `omnikube serve` starts the killed one again, which the router takes back. No timing bound: each
    step polls with a deadline, so a loaded machine is slower, never red."""
    wait_serving(serve, "llm")
    replicas = serve.stage_processes("llm")
    # Each replica's engine processes (vLLM's engine core, under the stage server): paused below so that the
    # stream cannot end while the test reads which replica runs it. The tiny model makes its ~2000 tokens in a
    # few seconds on an idle machine, and a warm run once found the stream already over (both gauges at 0)
    # by the time three probes had been read on a loaded one.
    engines = {p["name"]: sorted(process_tree(p["pid"]) - {p["pid"]}) for p in replicas}

    def signal_engines(sig: signal.Signals, names: list[str]) -> None:
        for pid in (pid for name in names for pid in engines[name]):
            os.kill(pid, sig)

    stream = api.chat.completions.create(
        model=MODEL, messages=user("Tell a very long story."), stream=True, max_tokens=CHAT_MAX_MODEL_LEN - 64,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    iterator = iter(stream)
    next(iterator)
    signal_engines(signal.SIGSTOP, list(engines))
    running = {p["name"]: sum(metric_values(http_get(p["probe"].replace("/readyz", "/metrics"))[1],
                                            "omnikube_stage_requests_running"))
               for p in replicas}  # fmt: skip
    busy = [p for p in replicas if running[p["name"]] == 1]
    if len(busy) != 1:  # resume every engine first: the shared serve's later tests and teardown need them
        signal_engines(signal.SIGCONT, list(engines))
    assert len(busy) == 1, (running, {p["name"]: http_get(p["probe"]) for p in replicas})
    victim = busy[0]
    (survivor,) = [p for p in replicas if p["name"] != victim["name"]]
    signal_engines(signal.SIGCONT, [survivor["name"]])
    served_before = ok_works(survivor["probe"])
    os.killpg(victim["pid"], signal.SIGKILL)  # the whole pod: stage server and (paused) vLLM engine core
    with pytest.raises(openai.APIError) as err:
        for _ in iterator:
            pass
    assert "failed while running request" in str(err.value.body or err.value.message), err.value

    for i in range(4):
        reply = api.chat.completions.create(model=MODEL, messages=user(f"Hello {i}"), max_tokens=4)
        assert reply.choices[0].message.content is not None
    # All four finished on a live replica: the survivor, or the restarted one had it been taken back
    # already (a restart reloads vLLM; the router routes to a replica only once it answers).
    (again,) = [p for p in serve.stage_processes("llm") if p["name"] == victim["name"]]
    late = ok_works(again["probe"]) if again["pid"] != victim["pid"] else 0.0
    assert ok_works(survivor["probe"]) - served_before + late == 4

    # `omnikube serve` restarts the dead process (a new pid under the same name); the router takes it back
    deadline = time.monotonic() + 240
    while True:
        (again,) = [p for p in serve.stage_processes("llm") if p["name"] == victim["name"]]
        up = sum(metric_values(serve.router_metrics(), "omnikube_stage_replica_up", stage="llm"))
        if again["pid"] != victim["pid"] and pid_alive(again["pid"]) and up == CHAT_REPLICAS:
            break
        assert time.monotonic() < deadline, f"{victim['name']} was not restarted and taken back:\n{serve.logs_tail()}"
        time.sleep(1)
    assert not pid_alive(victim["pid"])
