"""SIGTERM to real processes: `omnikube serve` of the text-chat pipeline on the tiny Qwen2 model (vLLM)
with two replicas of its stage, driven through the real OpenAI client.

A stage process sent SIGTERM while it streams a request finishes that request, takes no new work
meanwhile (the other replica answers), and exits with code 0 (the launcher then restarts it, as a
Deployment would). The fast behaviours (drain period ending, payloads, router drain) are in
test_drain.py.

The serve is the session's shared one (`chat_serve` in conftest.py, started with `--drain-timeout
CHAT_DRAIN_TIMEOUT_S`: far above what the requests need, however slow the machine; test_drain.py checks
what happens when the period ends first). Both tests are `destructive` and run after every test that only
reads the serve; the router's SIGTERM comes last of all (`last`: nothing can use the serve while its
router drains and the launcher restarts it).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionChunk
from servelib import CHAT_MAX_MODEL_LEN, CHAT_MODEL, Serve, http_get, metric_values, wait_serving

pytestmark = [pytest.mark.models, pytest.mark.timeout(900)]

PROMPT_ROOM = 256
"""Context left for the prompts below (a short sentence in the chat template: a few dozen tokens)."""
SHORTEST, LONGEST = 200, CHAT_MAX_MODEL_LEN - PROMPT_ROOM
"""Bounds of the tokens of the stream the tests interrupt (ignore_eos: exactly these); see `long_stream`."""
STREAM_SECONDS = 8
"""About how long that stream should run on this machine, far above the few tenths of a second the tests
need between its first chunk and the end of their checks on the draining process."""


@pytest.fixture
def serve(chat_serve):
    """The session's shared text-chat serve (conftest.py)."""
    return chat_serve


@pytest.fixture
def api(serve):
    """A client, once the router and both replicas are up: each destructive test kills or SIGTERMs one of
    them, which the launcher then restarts (a stage reloads its model: minutes under load)."""
    wait_serving(serve, "llm")
    client = openai.OpenAI(base_url=serve.endpoint, api_key="none", max_retries=0, timeout=120)
    yield client
    client.close()


def running(probe: str) -> float:
    """Works the replica of `probe` runs; 0 for one not up (restarting after the stage drain test)."""
    try:
        status, text = http_get(probe.replace("/readyz", "/metrics"))
    except OSError:
        return 0.0
    return sum(metric_values(text, "omnikube_stage_requests_running")) if status == 200 else 0.0


@dataclass
class LongStream:
    """A streamed chat request caught while a stage replica runs it."""

    tokens: int
    """Its max_tokens (ignore_eos: it ends after exactly these)."""
    chunks: Iterator[ChatCompletionChunk]
    received: list[ChatCompletionChunk]
    """The chunks read so far (the first one)."""
    replica: dict[str, Any]
    """The stage process that runs it (processes.json entry)."""

    def finish(self) -> list[ChatCompletionChunk]:
        """Every chunk of the stream, read to its end; asserts it ran to its length."""
        self.received += list(self.chunks)
        usage = [c.usage for c in self.received if c.usage]
        assert usage and usage[-1].completion_tokens == self.tokens, "the stream ran to its end"
        return self.received


def tokens_per_second(api: openai.OpenAI) -> float:
    """How fast the stage generates on this machine now (one 100-token request, overheads included)."""
    started = time.monotonic()
    reply = api.chat.completions.create(
        model=CHAT_MODEL,
        messages=[{"role": "user", "content": "count"}],
        max_tokens=100,
        extra_body={"ignore_eos": True},
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 100
    return 100 / (time.monotonic() - started)


def long_stream(serve: Serve, api: openai.OpenAI, prompt: str) -> LongStream:
    """A stream whose first chunk has arrived while exactly one replica runs it, with seconds to go.

    The stage counts a work as running from its Submit until it has sent its last output, so a replica
    reads 1 when the first chunk arrives unless the whole stream was generated first. The tiny model's
    speed varies by two orders of magnitude with the machine's load (about 6 tokens/s under heavy load,
    hundreds idle, where a fixed 200 tokens were over before the client had read the first chunk), so the
    length is measured: about STREAM_SECONDS of generation. A stream over already anyway is read to its
    end (it must be complete, else the gauge is wrong) and one three times as long tried.
    """
    tokens = max(SHORTEST, min(LONGEST, int(tokens_per_second(api) * STREAM_SECONDS)))
    while True:
        stream = api.chat.completions.create(
            model=CHAT_MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        received = [next(chunks)]
        loads = {p["name"]: running(p["probe"]) for p in serve.stage_processes("llm")}
        busy = [p for p in serve.stage_processes("llm") if loads[p["name"]] == 1]
        if busy:
            assert len(busy) == 1 and sum(loads.values()) == 1, f"one replica runs the stream: {loads}"
            return LongStream(tokens, chunks, received, busy[0])
        LongStream(tokens, chunks, received, {}).finish()
        assert tokens < LONGEST, f"even a stream of {tokens} tokens was over before its first chunk was read"
        tokens = min(LONGEST, tokens * 3)


@pytest.mark.destructive
def test_a_stage_given_sigterm_mid_stream_finishes_it_takes_no_new_work_and_exits_cleanly(serve, api) -> None:
    stream = long_stream(serve, api, "Tell me a long story.")
    victim = stream.replica
    exited = f"{victim['name']} exited with code 0"
    exits = serve.log.read_text(errors="replace").count(exited)  # earlier tests' restarts may have some
    drained = Path(victim["log"]).read_text(errors="replace").count("drained: every work finished")
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
            model=CHAT_MODEL, messages=[{"role": "user", "content": f"quick {i}"}], max_tokens=4
        )
        assert reply.choices[0].message.content is not None
    received = stream.finish()
    finish = [c.choices[0].finish_reason for c in received if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    deadline = time.monotonic() + 60
    while serve.log.read_text(errors="replace").count(exited) == exits:
        assert time.monotonic() < deadline, f"{victim['name']} did not exit cleanly:\n{serve.logs_tail(60)}"
        time.sleep(0.2)
    log = Path(victim["log"]).read_text(errors="replace")
    assert log.count("drained: every work finished") > drained, log[-3000:]


@pytest.mark.destructive(last=True)
def test_the_router_given_sigterm_mid_stream_refuses_new_connections_and_finishes_it(serve, api) -> None:
    stream = long_stream(serve, api, "Tell me another long story.")
    (router,) = [p for p in serve.processes() if p["name"] == "router"]
    exits = serve.log.read_text(errors="replace").count("router exited with code 0")
    drains = Path(router["log"]).read_text(errors="replace").count("router draining")
    os.kill(router["pid"], signal.SIGTERM)
    deadline = time.monotonic() + 30
    while True:  # it stops listening at once (readiness fails, the Service sends nobody new)
        try:
            http_get(f"{serve.base}/health", timeout=2)
        except OSError:
            break
        assert time.monotonic() < deadline, "the draining router still accepts connections"
        time.sleep(0.05)
    stream.finish()
    deadline = time.monotonic() + 60
    while serve.log.read_text(errors="replace").count("router exited with code 0") == exits:  # not 143: it drained
        assert time.monotonic() < deadline, f"the router did not exit cleanly:\n{serve.logs_tail(60)}"
        time.sleep(0.2)
    assert Path(router["log"]).read_text(errors="replace").count("router draining") > drains
