"""Silence between router and stage: a stage stops the works of a router that went silent, and says so;
neither side takes a stall of its own machine for the other's silence.

Real stage servers (EchoEngine, see its docstring for why), real ZeroMQ, the real router app on uvicorn.
In the stage tests the test speaks the stage protocol itself over a DEALER socket with the pipeline's key,
as a router does, so it decides when the "router" is silent. Silence limits are lowered for the tests (the
stage's `peer_timeout_s` attribute, the router pool's `ping_timeout_s`) to `SILENCE_S`, twice the longest
stall that neither side recognises as one (see there): a real stall of this loaded machine, which comes
at any moment, then either stays well inside the limit or is taken for what it is. A stall injected by a
test is a blocking sleep on the one event loop that runs stage, router and client here.

A work stopped without the router asking used to end silently: the router, which still waited for it,
answered its client only when the request timeout hit (a 504 after two minutes). After a stall longer
than the limits, the stage stopped every work and the router dropped every replica (a 502 per request).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import httpx
import pytest
import zmq
import zmq.asyncio
from servelib import echo_cluster, echo_pipeline, until

from omni_runtime.router import client as router_client
from omni_runtime.spec import PipelineSpec, StageSpec
from omni_runtime.stage import server as stage_server
from omni_runtime.wire import protocol as P
from omni_runtime.wire.auth import Channel

pytestmark = pytest.mark.timeout(120)

PING_PERIOD_S = 0.2
"""How often this test's routers ping (the echo cluster's router pool pings every 0.1 s)."""
UNNOTICED_STALL_S = max(
    stage_server.HOUSEKEEPING_S + stage_server.STALL_S,  # a housekeeping tick up to this late is on time
    router_client.STALL_S + PING_PERIOD_S,  # a ping-loop wake-up up to this late is on time
)
"""The longest stall of the machine that neither side recognises as one: silence up to this long is
counted as the other side's."""
SILENCE_S = 2 * UNNOTICED_STALL_S
"""The silence limit of these tests: a real stall of this machine shorter than UNNOTICED_STALL_S cannot
reach it, and a longer one is recognised as a stall, so only the tests' own silences and stalls count."""
MACHINE_STALL_S = 1.5 * SILENCE_S
"""An injected stall: longer than the silence limit, so taking it for silence stops the work."""


def one_stage() -> PipelineSpec:
    return PipelineSpec(name="silence", stages=[StageSpec(name="llm", kind="ar", final_output=True)])


class FakeRouter:
    """One router connection to a stage: Hello/Welcome, then Submit and Ping; collects what comes back."""

    def __init__(self, cluster, port: int) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.channel = Channel(cluster.key, "router")
        self.received: list[P.Message] = []

    async def hello(self) -> None:
        await self.sock.send_multipart(self.channel.seal(P.encode(P.Hello())))
        welcome, _ = P.decode(self.channel.open(await asyncio.wait_for(self.sock.recv_multipart(), 10)))
        assert isinstance(welcome, P.Welcome)

    async def send(self, message: P.Message, payload: dict | None = None) -> None:
        await self.sock.send_multipart(self.channel.seal(P.encode(message, payload)))

    async def ping(self) -> None:
        await self.send(P.Ping(nonce=0, sent_at=time.monotonic()))

    async def collect(self) -> None:
        while True:
            message, _ = P.decode(self.channel.open(await self.sock.recv_multipart()))
            self.received.append(message)

    def failures(self, work_id: str) -> list[P.Failed]:
        return [m for m in self.received if isinstance(m, P.Failed) and m.id == work_id]

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@contextlib.asynccontextmanager
async def router_to(cluster, stage) -> AsyncIterator[FakeRouter]:
    router = FakeRouter(cluster, stage.port)
    collector: asyncio.Task | None = None
    try:
        await router.hello()
        collector = asyncio.create_task(router.collect())
        yield router
    finally:
        if collector is not None:
            collector.cancel()
            await asyncio.gather(collector, return_exceptions=True)
        router.close()


def long_work(work_id: str) -> tuple[P.Submit, dict]:
    """A work of words at 0.25 s each, four silence limits long: it outlasts every phase of these tests
    (it cannot end sooner, only later on a loaded machine), so a work gone before the end was stopped."""
    submit = P.Submit(
        id=work_id, request_id=work_id, stage="llm", role="primary", data=True, final=True, params={"delay": 0.25}
    )  # fmt: skip
    return submit, {"prompt": " ".join(f"w{i}" for i in range(int(4 * SILENCE_S / 0.25)))}


def pongs(router: FakeRouter) -> int:
    return sum(isinstance(m, P.Pong) for m in router.received)


async def test_a_work_stopped_because_its_router_went_silent_is_reported_to_that_router() -> None:
    async with echo_cluster(echo_pipeline(one_stage(), name="silent-router")) as cluster:
        stage = cluster.servers["llm"][0]
        stage.peer_timeout_s = SILENCE_S
        async with router_to(cluster, stage) as router:
            submit, payload = long_work("silent-1")
            await router.send(submit, payload)
            await until(lambda: submit.id in stage.works, "the stage never ran the work", timeout=15.0)
            # The router now sends nothing, not even a ping. (A real stall meanwhile only postpones the stop.)
            await until(lambda: submit.id not in stage.works, "the work of a silent router kept running", 3 * SILENCE_S)
            await until(
                lambda: router.failures(submit.id),
                "the stage stopped the work without telling its router",
                timeout=15.0,
            )
            (failed,) = router.failures(submit.id)
            assert failed.kind == "unavailable"  # the router answers a retriable 503 at once
            assert "sent nothing for" in failed.message and "retry" in failed.message
            assert [i for i in cluster.engines["llm"][0].aborted if i == submit.id], "the engine kept generating"


async def test_a_stall_of_the_whole_machine_longer_than_the_silence_limit_stops_no_work(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The stall is a blocking sleep on the event loop that runs both the stage and this test's router, as
    when a loaded machine runs neither for a while: the router sends no ping during it, and after it the
    stage's housekeeping is due at the same moment the router's next ping is. A stage that took that
    silence for the router's used to stop every work of every router then.

    The stage's first housekeeping tick after the stall is the one that decides: it logs that it ran late
    (the stage noticed the stall) and, in the same step, would mark the work stopped and cancel it."""
    caplog.set_level(logging.INFO, logger=stage_server.__name__)
    async with echo_cluster(echo_pipeline(one_stage(), name="stalled-stage")) as cluster:
        stage = cluster.servers["llm"][0]
        stage.peer_timeout_s = SILENCE_S
        async with router_to(cluster, stage) as router:
            submit, payload = long_work("stalled-1")
            await router.send(submit, payload)
            await until(lambda: submit.id in stage.works, "the stage never ran the work", timeout=15.0)
            pinger = asyncio.create_task(ping_every(router, PING_PERIOD_S))
            await until(lambda: pongs(router) >= 3, "the stage does not answer pings", timeout=15.0)  # pinging steadily
            caplog.clear()  # from here, a "ran late" record is from a tick after the injected stall
            time.sleep(MACHINE_STALL_S)
            await until(
                lambda: any("housekeeping ran" in r.getMessage() and "late" in r.getMessage() for r in caplog.records),
                "the stage did not notice the stall of its machine",
                timeout=15.0,
            )
            work = stage.works.get(submit.id)
            assert work is not None and work.stopped_because is None, "the stall was taken for the router's silence"
            after = pongs(router)
            await until(lambda: pongs(router) >= after + 3, "the pings did not resume after the stall", timeout=15.0)
            pinger.cancel()
            await asyncio.gather(pinger, return_exceptions=True)
            assert router.failures(submit.id) == [], router.failures(submit.id)
            assert submit.id in stage.works and stage.works[submit.id].stopped_because is None, (
                "the work of a router that kept pinging was stopped"
            )


async def ping_every(router: FakeRouter, period: float) -> None:
    while True:
        await router.ping()
        await asyncio.sleep(period)


async def test_a_stall_of_the_whole_machine_longer_than_the_ping_timeout_fails_no_request() -> None:
    async with echo_cluster(echo_pipeline(one_stage(), name="stalled-router"), ping_timeout_s=SILENCE_S) as cluster:
        await cluster.wait_ready()
        stage = cluster.servers["llm"][0]
        words = " ".join(f"w{i}" for i in range(16))
        async with httpx.AsyncClient(base_url=cluster.base, trust_env=False, timeout=60) as http:
            body = {
                "model": "stalled-router",
                "messages": [{"role": "user", "content": words}],
                "sampling_params_list": [{"delay": 0.25}],
            }
            request = asyncio.create_task(http.post("/v1/chat/completions", json=body))
            # The router's pool was ready (its replica answered pings) and the stage runs the request now,
            # four seconds of words at the least: the stall lands mid-request.
            await until(lambda: len(stage.works) == 1, "the stage never ran the request", timeout=15.0)
            time.sleep(MACHINE_STALL_S)
            reply = await request
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"].split() == words.split()
