"""The router app against real stage servers over ZeroMQ, with the EchoEngine (fast, no models).

Everything runs in the test's event loop: stage servers with `EchoEngine`s (see its docstring for
why), the router's FastAPI app on uvicorn, and the real OpenAI client / httpx talking HTTP to it.
The same behaviours are checked end to end with the real engines in test_serve_*.py.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from servelib import (
    busy_shm_segments,
    chat_topology,
    echo_cluster,
    echo_pipeline,
    metric_values,
    until,
    windowed_topology,
)

from omni_runtime.metrics import REGISTRY
from omni_runtime.spec import CompanionSpec, EdgeSpec, PipelineSpec, RouterLimits, StageSpec

pytestmark = pytest.mark.timeout(60)


def enhanced_topology(connector: str) -> PipelineSpec:
    return PipelineSpec(
        name="echo2",
        stages=[
            StageSpec(name="a", kind="ar", companions=[CompanionSpec(role="cfg_text", negative_prompt="ugly dark")]),
            StageSpec(name="b", kind="ar", final_output=True),
        ],
        edges=[EdgeSpec(**{"from": "a", "to": "b", "connector": connector, "input_processor": "ar_text_to_prompt"})],
    )


def client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def running(cluster, stage: str) -> float:
    return sum(len(s.works) for s in cluster.servers[stage])


def handles_open(cluster, stage: str) -> int:
    return sum(len(w.held) + len(w.created) for s in cluster.servers[stage] for w in s.works.values())


# -- one stage -----------------------------------------------------------------------------------


async def test_chat_answers_streams_and_counts_usage() -> None:
    async with echo_cluster(echo_pipeline(chat_topology())) as cluster, client(cluster.base) as api:
        reply = await api.chat.completions.create(model="echo", messages=user("hello big world"))
        assert reply.choices[0].message.content == "hello big world "
        assert reply.choices[0].finish_reason == "stop"
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (3, 3, 6)

        stream = await api.chat.completions.create(
            model="echo", messages=user("one two three"), stream=True, stream_options={"include_usage": True}
        )
        deltas, usage, finish = [], None, None
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for choice in chunk.choices:
                deltas.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        assert "".join(deltas) == "one two three " and len([d for d in deltas if d]) == 3
        assert finish == "stop" and usage.completion_tokens == 3

        many = await api.chat.completions.create(model="echo", messages=user("a b"), n=3)
        assert [c.index for c in many.choices] == [0, 1, 2]
        assert {c.message.content for c in many.choices} == {"a b "}
        assert many.usage.prompt_tokens == 2 and many.usage.completion_tokens == 6

        models = await api.models.list()
        assert [m.id for m in models.data] == ["echo"]


async def test_request_errors_are_openai_shaped() -> None:
    limits = RouterLimits(max_body_bytes=2048)
    async with echo_cluster(echo_pipeline(chat_topology(), limits=limits)) as cluster, client(cluster.base) as api:
        with pytest.raises(openai.NotFoundError) as err:
            await api.chat.completions.create(model="gpt-9", messages=user("x"))
        assert err.value.body["message"].startswith("The model `gpt-9` does not exist")
        assert err.value.body["param"] == "model" and err.value.body["code"] == 404

        with pytest.raises(openai.BadRequestError) as err:
            await api.chat.completions.create(model="echo", messages=user("x"), modalities=["image"])
        assert "it can produce ['text']" in err.value.body["message"]

        with pytest.raises(openai.BadRequestError) as err:
            await api.chat.completions.create(
                model="echo", messages=user("x"), extra_body={"sampling_params_list": [{"invalid": "too long"}]}
            )
        assert err.value.body["message"] == "echo: too long"

        with pytest.raises(openai.InternalServerError) as err:
            await api.chat.completions.create(
                model="echo", messages=user("x"), extra_body={"sampling_params_list": [{"fail": "kaput"}]}
            )
        assert "echo: kaput" in err.value.body["message"]

        with pytest.raises(openai.BadRequestError) as err:
            await api.images.generate(model="echo", prompt="a cat")
        assert "produces ['text'], not images" in err.value.body["message"]

        async with httpx.AsyncClient(base_url=cluster.base) as http:
            bad = await http.post("/v1/chat/completions", content=b'{"model": "echo", "messages": [',
                                  headers={"content-type": "application/json"})  # fmt: skip
            assert bad.status_code == 400
            assert bad.json()["error"]["type"] == "BadRequestError"
            assert "not valid JSON" in bad.json()["error"]["message"]

            big = await http.post("/v1/chat/completions", json={"model": "echo", "messages": user("x" * 5000)})
            assert big.status_code == 413
            assert "at most 2048 bytes" in big.json()["error"]["message"]

            async def chunks():
                for _ in range(5):
                    yield b" " * 1000

            streamed = await http.post("/v1/chat/completions", content=chunks(),
                                       headers={"content-type": "application/json"})  # fmt: skip
            assert streamed.status_code == 413

            missing = await http.post("/v1/chat/completions", json={"model": "echo"})
            assert missing.status_code == 400 and "messages: field required" in missing.json()["error"]["message"]

            edits = await http.post("/v1/images/edits", files={"image": ("a.png", b"x")}, data={"prompt": "p"})
            assert edits.status_code == 400

            nope = await http.get("/nope")
            assert nope.status_code == 404
            offered = nope.json()["error"]["message"].removeprefix("no such route; this server offers ").split(", ")
            served = {route.path for route in cluster.app.routes} - {"/docs", "/docs/oauth2-redirect", "/redoc"}
            assert set(offered) == served, "the 404 must list every route the router serves, and only those"
            health = await http.get("/health")
            assert health.status_code == 200 and health.json()["ready_replicas"] == {"llm": 1}
            metrics = (await http.get("/metrics")).text
        assert metric_values(metrics, "omnikube_requests_total", pipeline="echo", status="413")
        assert metric_values(metrics, "omnikube_request_errors_total", pipeline="echo", type="NotFoundError")


async def test_admission_full_gives_429_with_retry_after() -> None:
    limits = RouterLimits(max_concurrent_requests=1, max_queued_requests=1)
    async with echo_cluster(echo_pipeline(chat_topology(), limits=limits)) as cluster, client(cluster.base) as api:
        slow = {"sampling_params_list": [{"delay": 0.2}]}
        first = asyncio.create_task(api.chat.completions.create(model="echo", messages=user("a b c"), extra_body=slow))
        await until(lambda: running(cluster, "llm") == 1)
        queued = asyncio.create_task(api.chat.completions.create(model="echo", messages=user("d"), extra_body=slow))
        await until(lambda: cluster.app.state.context.admission.queued == 1)
        async with httpx.AsyncClient(base_url=cluster.base) as http:
            refused = await http.post("/v1/chat/completions", json={"model": "echo", "messages": user("e")})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "RateLimitError"
        assert (await first).choices[0].message.content == "a b c "
        assert (await queued).choices[0].message.content == "d "


async def test_timeout_gives_504_and_aborts_the_work() -> None:
    """The work (50 words at 0.1 s) outlasts the 0.5 s request timeout tenfold: the 504 names the timeout,
    and the stage is told to stop (the engine saw the abort) rather than left generating for nobody."""
    limits = RouterLimits(request_timeout_s=0.5)
    async with echo_cluster(echo_pipeline(chat_topology(), limits=limits)) as cluster, client(cluster.base) as api:
        with pytest.raises(openai.APIStatusError) as err:
            await api.chat.completions.create(
                model="echo", messages=user("w " * 50), extra_body={"sampling_params_list": [{"delay": 0.1}]}
            )
        assert err.value.status_code == 504
        assert "did not finish within 0.5s" in err.value.body["message"]
        engine = cluster.engines["llm"][0]
        await until(lambda: running(cluster, "llm") == 0 and len(engine.aborted) == 1, timeout=20)
        assert len(engine.seen) == 1  # the one work, aborted: not finished, not retried


async def test_a_stage_scaled_to_zero_holds_requests_until_a_replica_is_ready_then_503s() -> None:
    """Discovery reporting no replica (the stage's autoscaler took it to zero) is driven through the
    pool's discovery callback, as the EndpointSlice watch would call it; the stage server is real."""
    pipeline = echo_pipeline(chat_topology(), limits=RouterLimits(request_timeout_s=3))
    pipeline.scale_from_zero = ["llm"]
    async with (
        echo_cluster(pipeline) as cluster,
        client(cluster.base) as api,
        httpx.AsyncClient(base_url=cluster.base) as http,
    ):
        pool = cluster.pool
        (address,) = pool["llm"].replicas

        async def scale_to_zero() -> None:
            pool._update("llm", set())
            await until(lambda: not pool["llm"].replicas, timeout=10)  # drained, then closed

        async def waiting() -> list[float]:
            text = (await http.get("/metrics")).text
            return metric_values(text, "omnikube_stage_requests_waiting_for_replica", pipeline="echo", stage="llm")

        await scale_to_zero()
        health = await http.get("/health")
        assert health.status_code == 200, health.text  # ready: the stage waits for demand, not broken
        held = asyncio.create_task(api.chat.completions.create(model="echo", messages=user("after idle")))
        deadline = time.monotonic() + 5
        while await waiting() != [1.0]:
            assert time.monotonic() < deadline and not held.done(), "the request was not held"
            await asyncio.sleep(0.05)
        pool._update("llm", {address})  # the autoscaler started a replica; it becomes ready
        assert (await held).choices[0].message.content == "after idle "
        assert await waiting() == [0.0]

        await scale_to_zero()
        refused = await http.post("/v1/chat/completions", json={"model": "echo", "messages": user("nobody")})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "10"
        assert "scaled to zero" in refused.json()["error"]["message"]
        assert await waiting() == [0.0]


async def test_client_disconnect_mid_stream_aborts_the_stage() -> None:
    async with echo_cluster(echo_pipeline(chat_topology())) as cluster:
        async with httpx.AsyncClient(base_url=cluster.base, timeout=10) as http:
            body = {"model": "echo", "messages": user("w " * 100), "stream": True,
                    "sampling_params_list": [{"delay": 0.05}]}  # fmt: skip
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.aiter_lines()
                while "w" not in await anext(lines):
                    pass
                assert running(cluster, "llm") == 1
        await until(lambda: running(cluster, "llm") == 0)
        assert len(cluster.engines["llm"][0].aborted) == 1
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"{cluster.base}/metrics")).text
        assert metric_values(text, "omnikube_requests_in_flight", pipeline="echo") == [0.0]


async def test_a_lost_replica_fails_its_requests_and_the_next_go_to_the_live_one() -> None:
    """A replica whose connection drops fails its running request at once, from the connection loss.
    The ping timeout is set far beyond the test's wait (60 s against a 20 s deadline), so the ping path
    cannot be what fails the request: a router that only noticed a dead replica by its silence fails this
    test instead of passing it late."""
    pipeline = echo_pipeline(chat_topology())
    async with echo_cluster(pipeline, {"llm": 2}, ping_timeout_s=60.0) as cluster, client(cluster.base) as api:
        slow = {"sampling_params_list": [{"delay": 0.1}]}  # 40 words: 4 s, so both still run at the stop
        calls = [
            asyncio.create_task(api.chat.completions.create(model="echo", messages=user("w " * 40), extra_body=slow))
            for _ in range(2)
        ]
        await until(lambda: all(len(s.works) == 1 for s in cluster.servers["llm"]))  # one on each replica
        victim = cluster.servers["llm"][0]
        lost = f"127.0.0.1:{victim.port}"
        await victim.stop()  # closes its socket: the router sees the connection drop
        done, _ = await asyncio.wait(calls, timeout=20, return_when=asyncio.FIRST_COMPLETED)
        assert done, "no request ended within 20 s of the replica's connection loss"
        first = done.pop()
        assert isinstance(first.exception(), openai.APIStatusError), "the first to end is the lost one's, failed"
        state = cluster.pool["llm"].replicas[lost]
        assert state.state.value == "down" and state.reason == "its connection was lost"
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = [r for r in results if isinstance(r, Exception)]
        assert len(failed) == 1 and failed[0] is first.exception()
        assert failed[0].status_code == 502
        message = failed[0].body["message"]
        assert f"replica {lost} failed while running request" in message and "its connection was lost" in message
        assert [r.choices[0].message.content for r in results if not isinstance(r, Exception)] == ["w " * 40]
        for _ in range(4):
            reply = await api.chat.completions.create(model="echo", messages=user("still here"))
            assert reply.choices[0].message.content == "still here "
        live = cluster.engines["llm"][1]
        assert len(live.seen) == 5, "its own first request, then all four went to the live one"
        # the victim's engine may not have started its work before the stop (a loaded machine): 0 or 1
        assert len(cluster.engines["llm"][0].seen) <= 1


# -- two stages: companions and handles ----------------------------------------------------------


@pytest.mark.parametrize("connector", ["inline", "shm"])
async def test_companion_output_reaches_the_next_stage_with_the_primary(connector: str) -> None:
    pipeline = echo_pipeline(enhanced_topology(connector), name=f"echo2-{connector}")
    async with echo_cluster(pipeline) as cluster, client(cluster.base) as api:
        params = {"sampling_params_list": [{"upper": True}, {}]}
        reply = await api.chat.completions.create(model=pipeline.name, messages=user("a red fox"), extra_body=params)
        assert reply.choices[0].message.content == "A RED FOX "
        b_input = cluster.engines["b"][0].seen[-1].data
        assert b_input == {"prompt": "A RED FOX", "negative_prompt": "UGLY DARK"}
        roles = sorted(r.role for r in cluster.engines["a"][0].seen)
        assert roles == ["cfg_text", "primary"]

        await api.chat.completions.create(
            model=pipeline.name, messages=user("a cat"), extra_body={"negative_prompt": "no dogs"}
        )
        assert cluster.engines["b"][0].seen[-1].data == {"prompt": "a cat", "negative_prompt": "no dogs"}
        assert handles_open(cluster, "a") == 0 and handles_open(cluster, "b") == 0
        assert busy_shm_segments(pipeline.name) == []


async def test_cancelling_mid_pipeline_releases_every_handle() -> None:
    pipeline = echo_pipeline(enhanced_topology("shm"), name="echo2-cancel")
    async with echo_cluster(pipeline) as cluster:
        async with httpx.AsyncClient(base_url=cluster.base, timeout=10) as http:
            body = {"model": pipeline.name, "messages": user("w " * 60), "stream": True,
                    "sampling_params_list": [{}, {"delay": 0.05}]}  # fmt: skip
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                lines = response.aiter_lines()
                while "w" not in await anext(lines):
                    pass
                assert running(cluster, "b") == 1 and busy_shm_segments(pipeline.name)
        await until(lambda: running(cluster, "b") == 0 and running(cluster, "a") == 0)
        assert cluster.engines["b"][0].aborted
        await until(lambda: busy_shm_segments(pipeline.name) == [])
        assert handles_open(cluster, "a") == 0 and handles_open(cluster, "b") == 0


async def test_windowed_edge_starts_downstream_on_the_first_chunk() -> None:
    pipeline = echo_pipeline(windowed_topology(window=2), name="echo3")
    async with echo_cluster(pipeline) as cluster, client(cluster.base) as api:
        reply = await api.chat.completions.create(model="echo3", messages=user("one two three four five"))
        assert reply.choices[0].message.content == "one two three four five "
        seen = cluster.engines["b"][0].seen
        assert [s.data["text"] for s in seen] == ["one two ", "three four ", "five "]
        assert [s.params["chunk_index"] for s in seen] == [0, 1, 2]
        assert [s.params["last_chunk"] for s in seen] == [False, False, True]
        assert busy_shm_segments("echo3") == []


def test_metrics_registry_has_the_vocabulary() -> None:
    names = {m.name for m in REGISTRY.collect()}
    for name in (
        "omnikube_requests", "omnikube_request_errors", "omnikube_queue_depth", "omnikube_requests_in_flight",
        "omnikube_time_to_first_token_seconds", "omnikube_time_per_output_token_seconds",
        "omnikube_time_to_first_packet_seconds", "omnikube_e2e_request_latency_seconds",
        "omnikube_stage_requests", "omnikube_stage_engine_queue_depth", "omnikube_stage_latency_seconds",
        "omnikube_connector_bytes", "omnikube_connector_transfer_seconds",
    ):  # fmt: skip
        assert name in names
