"""Graceful drain, fast: stage servers with the EchoEngine (see its docstring for why) behind the real
router app on uvicorn, driven by the real OpenAI client and httpx.

A stage that drains (what SIGTERM starts) tells its routers at once, gets no new work, finishes what it
runs (streams and the payloads its consumers still read included), and fails only what outlives its
drain period, with a retriable 503. The router drains the same way. `test_serve_drain.py` sends the
real SIGTERM to real processes.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import msgspec
import openai
import pytest
from servelib import chat_topology, echo_cluster, echo_pipeline, until, windowed_topology

from omni_runtime.engines.base import EngineError
from omni_runtime.router.discovery import ready_addresses
from omni_runtime.wire import protocol as P

pytestmark = pytest.mark.timeout(60)


def client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def slow(delay: float) -> dict:
    return {"sampling_params_list": [{"delay": delay}]}


def replica(cluster, stage: str, index: int):
    return cluster.pool[stage].replicas[f"127.0.0.1:{cluster.servers[stage][index].port}"]


async def sse_events(response: httpx.Response) -> list[dict]:
    events = []
    async for line in response.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line.removeprefix("data: ")))
    return events


def streamed_text(events: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in events if c.get("choices"))


# -- the stage -------------------------------------------------------------------------------------


async def test_a_draining_stage_finishes_the_stream_it_runs_and_tells_the_router_at_once() -> None:
    async with echo_cluster(echo_pipeline(chat_topology())) as cluster:
        server, seen_by_router = cluster.servers["llm"][0], replica(cluster, "llm", 0)
        body = {"model": "echo", "messages": user("w " * 30), "stream": True, **slow(0.03)}
        async with httpx.AsyncClient(base_url=cluster.base, timeout=30) as http:
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.aiter_lines()
                first = [await anext(lines)]
                while "w " not in first[-1]:
                    first.append(await anext(lines))
                drain = asyncio.create_task(server.drain(20))
                # The Draining message reaches the router long before its next ping would.
                await until(lambda: seen_by_router.stage_draining, timeout=10.0)
                assert not seen_by_router.usable and "draining" in seen_by_router.describe()
                probe = await http.get(f"http://127.0.0.1:{server.http_port}/readyz")
                assert probe.status_code == 503 and probe.json()["status"] == "draining"
                assert len(server.works) == 1, "the stream still runs while the stage drains"
                rest = [line async for line in lines]
        events = [json.loads(x.removeprefix("data: ")) for x in first + rest if x.startswith("data: {")]
        assert streamed_text(events) == "w " * 30
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
        assert "data: [DONE]" in rest
        assert await drain is True
        assert cluster.engines["llm"][0].aborted == []


async def test_an_engine_that_dies_while_serving_ends_the_stage_with_its_error() -> None:
    """`Engine.fail` (what a diffusion engine calls when a sequence-parallel rank dies): the stage stops being
    ready and `serve_forever` raises the engine's error, which `omnikube stage` writes as its EngineFailed
    termination message before it exits 1 (tests/test_diffusion_parallel.py runs that served, with a real rank
    killed)."""
    async with echo_cluster(echo_pipeline(chat_topology())) as cluster, client(cluster.base) as api:
        server = cluster.servers["llm"][0]
        serving = asyncio.create_task(server.serve_forever())
        died = EngineError("stage 'llm': rank 1 died (exit code -9)")
        cluster.engines["llm"][0].fail(died)
        with pytest.raises(EngineError) as raised:
            await asyncio.wait_for(serving, 10)
        assert raised.value is died and server.engine_failure is died and not server.ready
        async with httpx.AsyncClient() as http:
            probe = await http.get(f"http://127.0.0.1:{server.http_port}/readyz")
        assert probe.status_code == 503 and probe.json()["status"] == "engine failed"
        await until(lambda: not replica(cluster, "llm", 0).usable, timeout=10.0)
        with pytest.raises(openai.APIStatusError) as refused:
            await api.chat.completions.create(model="echo", messages=user("after"))
        assert refused.value.status_code == 503


async def test_the_works_running_when_the_engine_dies_fail_with_its_error_not_a_generic_one() -> None:
    """The running works are told the engine's error before the stage stops being ready. Were readiness to
    drop first, the router would fail them as lost on a replica "not ready" (a 502 that hides the cause: a
    served SP run saw it when a rank was killed). The engine here goes on running the request after `fail`,
    so only the stage's own failure notice can end it with the cause."""
    async with echo_cluster(echo_pipeline(chat_topology())) as cluster, client(cluster.base) as api:
        server = cluster.servers["llm"][0]
        serving = asyncio.create_task(server.serve_forever())
        running = asyncio.create_task(
            api.chat.completions.create(model="echo", messages=user("w " * 100), extra_body=slow(0.2))
        )
        await until(lambda: bool(server.works), timeout=10.0)
        died = EngineError("stage 'llm': rank 1 died (exit code -9)")
        cluster.engines["llm"][0].fail(died)
        with pytest.raises(openai.InternalServerError) as failed:
            await asyncio.wait_for(running, 10)
        assert "rank 1 died (exit code -9)" in str(failed.value), str(failed.value)
        with pytest.raises(EngineError):
            await asyncio.wait_for(serving, 10)


async def test_a_draining_replica_gets_no_new_work_while_its_running_work_finishes() -> None:
    async with echo_cluster(echo_pipeline(chat_topology()), {"llm": 2}) as cluster, client(cluster.base) as api:
        long = asyncio.create_task(
            api.chat.completions.create(model="echo", messages=user("w " * 20), extra_body=slow(0.05))
        )
        await until(lambda: any(s.works for s in cluster.servers["llm"]), timeout=10.0)
        index = 0 if cluster.servers["llm"][0].works else 1
        draining, other = cluster.engines["llm"][index], cluster.engines["llm"][1 - index]
        drain = asyncio.create_task(cluster.servers["llm"][index].drain(20))
        await until(lambda: replica(cluster, "llm", index).stage_draining, timeout=10.0)
        before = len(draining.seen)
        replies = await asyncio.gather(
            *(api.chat.completions.create(model="echo", messages=user(f"quick {i}")) for i in range(6))
        )
        assert [r.choices[0].message.content for r in replies] == [f"quick {i} " for i in range(6)]
        assert len(draining.seen) == before, "a draining replica got new work"
        assert len(other.seen) == 6
        assert (await long).choices[0].message.content == "w " * 20
        assert await drain is True


async def test_a_drain_that_outlives_its_period_fails_the_request_with_a_retriable_503() -> None:
    async with echo_cluster(echo_pipeline(chat_topology())) as cluster, client(cluster.base) as api:
        server = cluster.servers["llm"][0]
        call = asyncio.create_task(
            api.chat.completions.create(model="echo", messages=user("w " * 200), extra_body=slow(0.05))
        )
        await until(lambda: server.works, timeout=10.0)
        assert await server.drain(0.3) is False
        with pytest.raises(openai.APIStatusError) as err:
            await asyncio.wait_for(call, 10)
        assert err.value.status_code == 503
        message = err.value.body["message"]
        assert f"replica {server.replica} shut down before this work finished" in message
        assert "drain period of 0.3s ended" in message and "retry the request" in message
        assert err.value.response.headers["retry-after"] == "1"
        await until(lambda: not server.works, timeout=10.0)
        assert len(cluster.engines["llm"][0].aborted) == 1, "the engine stopped the work"


async def test_a_stream_cut_by_the_end_of_a_drain_ends_with_an_error_event() -> None:
    async with echo_cluster(echo_pipeline(chat_topology())) as cluster:
        server = cluster.servers["llm"][0]
        body = {"model": "echo", "messages": user("w " * 200), "stream": True, **slow(0.05)}
        async with httpx.AsyncClient(base_url=cluster.base, timeout=30) as http:
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                await until(lambda: server.works, timeout=10.0)
                drained = asyncio.create_task(server.drain(0.3))
                events = await sse_events(response)
        assert await drained is False
        assert events[-1]["error"]["code"] == 503
        assert "drain period of 0.3s ended" in events[-1]["error"]["message"]


@pytest.mark.parametrize("connector", ["shm", "inline"])
async def test_an_upstream_stage_that_drains_mid_request_still_feeds_its_consumer(connector: str) -> None:
    """Stage a streams chunks to b; a drains while it runs: the request completes, and a's drain ends
    only once b has released every payload a put (b reads them from a's memory)."""
    async with echo_cluster(echo_pipeline(windowed_topology(connector))) as cluster, client(cluster.base) as api:
        producer = cluster.servers["a"][0]
        call = asyncio.create_task(
            api.chat.completions.create(
                model="echo", messages=user("w " * 12), extra_body={"sampling_params_list": [{"delay": 0.05}, {}]}
            )
        )
        await until(lambda: producer.works and cluster.servers["b"][0].works, timeout=10.0)
        drain = asyncio.create_task(producer.drain(20))
        reply = await call
        assert reply.choices[0].message.content == "w " * 12
        assert await drain is True
        assert producer.connectors.unreleased() == 0


async def test_while_a_stage_is_between_replicas_a_request_waits_for_the_new_one() -> None:
    """A roll: the old replica drains before discovery lists the new one (the SIGTERM of the old pod and
    the EndpointSlice update race). The request waits for the new replica instead of failing.

    "Waits" is read from the router's own first call for replicas: `pool.choose_generation` (the generation
    of the pipeline whose every stage has a usable replica) is wrapped (it still does the real work) so the
    test sees the request ask and not be answered yet. A call that failed or returned at once would have ended
    in the same step (it does not yield before raising). This wait
    has no metric of its own (the scale-from-zero wait has omnikube_stage_requests_waiting_for_replica)."""
    async with echo_cluster(echo_pipeline(chat_topology()), {"llm": 2}) as cluster, client(cluster.base) as api:
        pool = cluster.pool
        old, new = (f"127.0.0.1:{s.port}" for s in cluster.servers["llm"])
        pool._update("llm", {old})  # discovery's callback: the new replica is not listed yet
        await until(lambda: new not in pool["llm"].replicas, timeout=10.0)  # dropped (idle): as if never seen
        drain = asyncio.create_task(cluster.servers["llm"][0].drain(20))
        await until(lambda: pool["llm"].replicas[old].stage_draining, timeout=10.0)
        asked: list[list[str]] = []
        answered: list[list[str]] = []
        real_choose = pool.choose_generation

        async def choose_generation(stages):
            asked.append(list(stages))
            try:
                return await real_choose(stages)
            finally:
                answered.append(list(stages))

        pool.choose_generation = choose_generation
        call = asyncio.create_task(api.chat.completions.create(model="echo", messages=user("during the roll")))
        await until(lambda: asked, timeout=10.0)  # the router asked for a replica of the stage
        assert answered == [], "the router did not wait for a usable replica"
        assert not call.done() and cluster.engines["llm"][1].seen == [], "the request waits for a usable replica"
        pool._update("llm", {old, new})  # the new replica's EndpointSlice update arrives
        reply = await asyncio.wait_for(call, 10)
        assert reply.choices[0].message.content == "during the roll "
        assert len(cluster.engines["llm"][1].seen) == 1 and cluster.engines["llm"][0].seen == []
        assert await drain is True


def test_pong_and_draining_messages_round_trip_and_old_pongs_still_decode() -> None:
    message, _ = P.decode(P.encode(P.Draining(stage="llm", grace_s=25.0)))
    assert message == P.Draining(stage="llm", grace_s=25.0)
    message, _ = P.decode(P.encode(P.Pong(nonce=1, ready=True, draining=True)))
    assert isinstance(message, P.Pong) and message.draining and message.ready
    old = msgspec.msgpack.encode({"type": "pong", "nonce": 1, "ready": True})  # a stage without the field
    message, _ = P.decode([old])
    assert isinstance(message, P.Pong) and message.ready and not message.draining


# -- the router ------------------------------------------------------------------------------------


async def test_the_router_drain_lets_a_running_request_finish() -> None:
    async with echo_cluster(echo_pipeline(chat_topology())) as cluster, client(cluster.base) as api:
        call = asyncio.create_task(
            api.chat.completions.create(model="echo", messages=user("w " * 10), extra_body=slow(0.03))
        )
        await until(lambda: cluster.servers["llm"][0].works, timeout=10.0)
        cluster.app.state.context.lifecycle.begin_drain(20)
        assert (await call).choices[0].message.content == "w " * 10


async def test_the_end_of_the_router_drain_fails_running_requests_with_a_retriable_503() -> None:
    async with echo_cluster(echo_pipeline(chat_topology())) as cluster, client(cluster.base) as api:
        call = asyncio.create_task(
            api.chat.completions.create(model="echo", messages=user("w " * 200), extra_body=slow(0.05))
        )
        body = {"model": "echo", "messages": user("w " * 200), "stream": True, **slow(0.05)}
        async with httpx.AsyncClient(base_url=cluster.base, timeout=30) as http:
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                await until(lambda: len(cluster.servers["llm"][0].works) == 2, timeout=10.0)
                cluster.app.state.context.lifecycle.begin_drain(0.3)
                events = await sse_events(response)
        with pytest.raises(openai.APIStatusError) as err:
            await asyncio.wait_for(call, 10)
        assert err.value.status_code == 503
        assert "the router shut down before this request finished" in err.value.body["message"]
        assert events[-1]["error"]["code"] == 503
        assert "drain period of 0.3s ended" in events[-1]["error"]["message"]
        await until(lambda: not cluster.servers["llm"][0].works, timeout=10.0)
        assert len(cluster.engines["llm"][0].aborted) == 2, "both works were stopped in the stage"


# -- discovery -------------------------------------------------------------------------------------


def test_terminating_or_not_serving_endpoints_get_no_new_work() -> None:
    slices = [
        {
            "ports": [{"port": 8100}],
            "endpoints": [
                {"addresses": ["10.0.0.1"], "conditions": {"ready": True, "serving": True, "terminating": False}},
                # a terminating pod still passing its readiness probe (as the API reports it since 1.26)
                {"addresses": ["10.0.0.2"], "conditions": {"ready": False, "serving": True, "terminating": True}},
                # an older API server reporting a terminating pod as ready
                {"addresses": ["10.0.0.3"], "conditions": {"ready": True, "terminating": True}},
                {"addresses": ["10.0.0.4"], "conditions": {"serving": False}},
            ],
        }
    ]
    assert ready_addresses(slices, 8100) == {"10.0.0.1:8100"}
