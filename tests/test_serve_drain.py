"""SIGTERM to real processes: `omnikube serve` of the text-chat pipeline on the tiny Qwen2 model (vLLM)
with two replicas of its stage, driven through the real OpenAI client.

A stage process sent SIGTERM while it streams a request finishes that request, takes no new work
meanwhile (the other replica answers), and exits with code 0 (the launcher then restarts it, as a
Deployment would). The fast behaviours (drain period ending, payloads, router drain) are in
test_drain.py.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import openai
import pytest
from servelib import Serve, http_get, metric_values

pytestmark = [pytest.mark.models, pytest.mark.timeout(900)]

MAX_MODEL_LEN = 256
LONG = 200
"""Tokens of the request the stage is given SIGTERM in the middle of (ignore_eos: exactly these)."""


@pytest.fixture(scope="module")
def serve(tiny_chat_model, tmp_path_factory):
    spec = {
        "model": str(tiny_chat_model),
        "name": "chat-drain",
        "stages": [
            {
                "name": "llm",
                "replicas": 2,
                "engine_args": {"max_model_len": MAX_MODEL_LEN, "kv_cache_memory_bytes": 64 * 1024**2, "seed": 0},
            }
        ],
        "limits": {"request_timeout_s": 120},
    }
    # A drain period far above what the requests need, however slow the machine: the tests check that
    # work finishes during a drain; test_drain.py checks what happens when the period ends first.
    run = Serve(spec, tmp_path_factory.mktemp("serve-drain"), args=("--drain-timeout", "300"))
    try:
        yield run
    finally:
        run.stop()


@pytest.fixture
def api(serve):
    client = openai.OpenAI(base_url=serve.endpoint, api_key="none", max_retries=0, timeout=120)
    yield client
    client.close()


def running(probe: str) -> float:
    status, text = http_get(probe.replace("/readyz", "/metrics"))
    return sum(metric_values(text, "omnikube_stage_requests_running")) if status == 200 else 0.0


def test_a_stage_given_sigterm_mid_stream_finishes_it_takes_no_new_work_and_exits_cleanly(serve, api) -> None:
    stream = api.chat.completions.create(
        model="chat-drain",
        messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=LONG,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    received = [next(chunks)]
    busy = [p for p in serve.stage_processes("llm") if running(p["probe"]) == 1]
    assert len(busy) == 1, "one replica runs the stream"
    victim = busy[0]
    os.kill(victim["pid"], signal.SIGTERM)
    deadline = time.monotonic() + 30
    while http_get(victim["probe"])[0] != 503:  # readiness turns false at once
        assert time.monotonic() < deadline, "the draining stage still reports ready"
        time.sleep(0.05)
    assert "draining" in http_get(victim["probe"])[1]
    assert running(victim["probe"]) == 1, "the stream still runs while its stage drains"
    # New requests go to the other replica meanwhile, and succeed.
    for i in range(3):
        reply = api.chat.completions.create(
            model="chat-drain", messages=[{"role": "user", "content": f"quick {i}"}], max_tokens=4
        )
        assert reply.choices[0].message.content is not None
    received += list(chunks)
    usage = [c.usage for c in received if c.usage]
    assert usage and usage[-1].completion_tokens == LONG, "the stream ran to its end"
    finish = [c.choices[0].finish_reason for c in received if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    deadline = time.monotonic() + 60
    exited = f"{victim['name']} exited with code 0"
    while exited not in serve.log.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"{victim['name']} did not exit cleanly:\n{serve.logs_tail(60)}"
        time.sleep(0.2)
    log = Path(victim["log"]).read_text(errors="replace")
    assert "drained: every work finished" in log, log[-3000:]


def test_the_router_given_sigterm_mid_stream_refuses_new_connections_and_finishes_it(serve, api) -> None:
    stream = api.chat.completions.create(
        model="chat-drain",
        messages=[{"role": "user", "content": "Tell me another long story."}],
        max_tokens=LONG,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    received = [next(chunks)]
    (router,) = [p for p in serve.processes() if p["name"] == "router"]
    os.kill(router["pid"], signal.SIGTERM)
    deadline = time.monotonic() + 30
    while True:  # it stops listening at once (readiness fails, the Service sends nobody new)
        try:
            http_get(f"{serve.base}/health", timeout=2)
        except OSError:
            break
        assert time.monotonic() < deadline, "the draining router still accepts connections"
        time.sleep(0.05)
    received += list(chunks)
    usage = [c.usage for c in received if c.usage]
    assert usage and usage[-1].completion_tokens == LONG, "the stream ran to its end"
    deadline = time.monotonic() + 60
    while "router exited with code" not in serve.log.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"the router did not exit:\n{serve.logs_tail(60)}"
        time.sleep(0.2)
    assert "router draining" in Path(router["log"]).read_text(errors="replace")
