"""What keeps the router and the stages safe to expose: the API key, the liveness/readiness split, the
request limits (`n`, `max_tokens`), the stage socket's frame bound, and a stage `/readyz` that names no work.

Real stage servers (EchoEngine, see servelib) over ZeroMQ, the router app on uvicorn, the `openai` client.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import httpx
import openai
import pytest
import zmq
import zmq.asyncio
from servelib import chat_topology, echo_cluster, echo_pipeline, metric_values
from zmq.utils.monitor import recv_monitor_message

from omni_runtime.router.auth import ApiKeyError, ApiKeyFile
from omni_runtime.spec import RouterLimits, StageDiscovery
from omni_runtime.stage.server import max_message_bytes
from omni_runtime.wire import protocol as P
from omni_runtime.wire.auth import PipelineKey

pytestmark = pytest.mark.timeout(60)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def write_key(path: Path, key: str) -> None:
    """As the kubelet updates a Secret volume: a new file renamed over the old one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(key + "\n")
    os.replace(tmp, path)


# -- API key -------------------------------------------------------------------------------------


async def test_v1_routes_need_the_api_key_and_probes_stay_open(tmp_path: Path) -> None:
    key_file = tmp_path / "api-key"
    write_key(key_file, "s3cret-key")
    async with echo_cluster(echo_pipeline(chat_topology()), api_key_file=key_file) as cluster:
        base = f"{cluster.base}/v1"
        async with openai.AsyncOpenAI(base_url=base, api_key="wrong", max_retries=0) as api:
            with pytest.raises(openai.AuthenticationError) as err:
                await api.chat.completions.create(model="echo", messages=user("hi"))
            assert err.value.status_code == 401
            assert err.value.body["type"] == "AuthenticationError" and err.value.body["code"] == 401
            assert "not valid" in err.value.body["message"]
            with pytest.raises(openai.AuthenticationError):
                await api.models.list()
        async with openai.AsyncOpenAI(base_url=base, api_key="s3cret-key", max_retries=0) as api:
            reply = await api.chat.completions.create(model="echo", messages=user("hello there"))
            assert reply.choices[0].message.content == "hello there "
            assert [m.id for m in (await api.models.list()).data] == ["echo"]
        async with httpx.AsyncClient(base_url=cluster.base) as http:
            bare = await http.post("/v1/chat/completions", json={"model": "echo", "messages": user("x")})
            assert bare.status_code == 401 and bare.headers["www-authenticate"].startswith("Bearer")
            assert set(bare.json()["error"]) >= {"message", "type", "code"}
            assert "Authorization: Bearer" in bare.json()["error"]["message"]
            basic = await http.get("/v1/models", headers={"Authorization": "Basic czNjcmV0LWtleQ=="})
            assert basic.status_code == 401 and "must be 'Bearer <key>'" in basic.json()["error"]["message"]
            unknown = await http.get("/v1/nothing-here")
            assert unknown.status_code == 401  # no route under /v1 is probed without the key
            assert (await http.get("/health")).status_code == 200
            assert (await http.get("/livez")).json() == {"status": "alive"}
            metrics = await http.get("/metrics")
            assert metrics.status_code == 200
        assert metric_values(metrics.text, "omnikube_request_errors_total", pipeline="echo", type="AuthenticationError")


async def test_a_rotated_key_is_accepted_without_a_restart(tmp_path: Path) -> None:
    key_file = tmp_path / "api-key"
    write_key(key_file, "first-key")
    async with echo_cluster(echo_pipeline(chat_topology()), api_key_file=key_file) as cluster:
        server = cluster._uvicorn
        async with httpx.AsyncClient(base_url=cluster.base) as http:

            async def status(key: str) -> int:
                return (await http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})).status_code

            assert await status("first-key") == 200
            write_key(key_file, "second-key")
            deadline = time.monotonic() + 20
            while await status("second-key") != 200:
                assert time.monotonic() < deadline, "the rotated key was never accepted"
                await asyncio.sleep(0.2)
            assert await status("first-key") == 401
            key_file.write_text("")  # a rotation gone wrong keeps the last good key: the endpoint never opens
            await asyncio.sleep(1.2)
            assert await status("second-key") == 200
            assert await status("first-key") == 401
        assert cluster._uvicorn is server and not server.should_exit


def test_api_key_file_is_reread_only_when_it_changes(tmp_path: Path) -> None:
    now = [0.0]
    path = tmp_path / "key"
    with pytest.raises(ApiKeyError, match="mount the Secret there or fix the path"):
        ApiKeyFile(path)
    path.write_text("")
    with pytest.raises(ApiKeyError, match="is empty"):
        ApiKeyFile(path)
    path.write_bytes(b"k" * 5000)
    with pytest.raises(ApiKeyError, match="over 4096 bytes"):
        ApiKeyFile(path)
    write_key(path, "  one \n")
    key = ApiKeyFile(path, recheck_s=1.0, clock=lambda: now[0])
    assert key.key() == b"one"
    write_key(path, "two")
    assert key.key() == b"one"  # not looked at again within recheck_s
    now[0] = 1.5
    assert key.key() == b"two"
    path.unlink()
    now[0] = 3.0
    assert key.key() == b"two"  # gone: the previous key stays in force
    write_key(path, "three")
    now[0] = 4.5
    assert key.key() == b"three"  # back: read again


def test_router_command_refuses_an_unusable_key_file(tmp_path: Path, capsys) -> None:
    from omni_runtime.cli import main

    config = tmp_path / "resolved.json"
    config.write_text(echo_pipeline(chat_topology()).model_dump_json(by_alias=True))
    PipelineKey.write_new(tmp_path / "pipeline.key")
    pipeline_key = ["--pipeline-key-file", str(tmp_path / "pipeline.key")]
    code = main(
        ["router", "--config", str(config), "--port", "0", "--api-key-file", str(tmp_path / "missing"), *pipeline_key]
    )
    assert code == 2
    assert "API key file" in capsys.readouterr().err


def test_router_command_refuses_a_missing_or_short_pipeline_key(tmp_path: Path, capsys) -> None:
    from omni_runtime.cli import main

    config = tmp_path / "resolved.json"
    config.write_text(echo_pipeline(chat_topology()).model_dump_json(by_alias=True))
    (tmp_path / "short.key").write_bytes(b"x" * 8)
    for key_file, words in (
        (tmp_path / "missing.key", "cannot read the pipeline key file"),
        (tmp_path / "short.key", "holds 8 bytes"),
    ):
        code = main(["router", "--config", str(config), "--port", "0", "--pipeline-key-file", str(key_file)])
        assert code == 2
        assert words in capsys.readouterr().err


# -- liveness is not readiness -------------------------------------------------------------------


async def test_livez_answers_while_health_says_no_stage_is_ready() -> None:
    from omni_runtime.router.app import build_app

    pipeline = echo_pipeline(chat_topology())
    pipeline.discovery["llm"] = StageDiscovery(static=["127.0.0.1:9"])  # nothing listens there
    app = build_app(pipeline, key=PipelineKey.generate())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as http:
        assert (await http.get("/livez")).status_code == 200
        health = await http.get("/health")
        assert health.status_code == 503 and "stages without a ready replica: ['llm']" in health.json()["message"]


# -- request limits ------------------------------------------------------------------------------


async def test_n_and_max_tokens_are_capped_by_the_pipeline_limits() -> None:
    limits = RouterLimits(max_n=2, max_tokens=50)
    async with echo_cluster(echo_pipeline(chat_topology(), limits=limits)) as cluster:
        async with openai.AsyncOpenAI(base_url=f"{cluster.base}/v1", api_key="none", max_retries=0) as api:
            with pytest.raises(openai.BadRequestError) as err:
                await api.chat.completions.create(model="echo", messages=user("x"), n=3)
            assert "n is 3" in err.value.body["message"] and "router.limits.maxN" in err.value.body["message"]
            assert err.value.body["param"] == "n"
            with pytest.raises(openai.BadRequestError) as err:
                await api.chat.completions.create(model="echo", messages=user("x"), max_tokens=51)
            assert "max_tokens is 51" in err.value.body["message"]
            assert "at most 50 tokens" in err.value.body["message"]
            with pytest.raises(openai.BadRequestError) as err:
                await api.chat.completions.create(model="echo", messages=user("x"), max_completion_tokens=1000)
            assert err.value.body["param"] == "max_completion_tokens"
            with pytest.raises(openai.BadRequestError) as err:
                await api.chat.completions.create(
                    model="echo", messages=user("x"), extra_body={"sampling_params_list": [{"max_tokens": 10**9}]}
                )
            assert "sampling_params_list[0].max_tokens is 1000000000" in err.value.body["message"]
            assert err.value.body["param"] == "sampling_params_list"
            with pytest.raises(openai.BadRequestError) as err:
                await api.images.generate(model="echo", prompt="a cat", n=1000)
            assert "n is 1000" in err.value.body["message"]
            reply = await api.chat.completions.create(model="echo", messages=user("a b"), n=2, max_tokens=50)
            assert [c.message.content for c in reply.choices] == ["a b ", "a b "]


# -- the stage side ------------------------------------------------------------------------------


async def test_stage_readyz_counts_works_without_naming_them() -> None:
    async with echo_cluster(echo_pipeline(chat_topology())) as cluster:
        (stage,) = cluster.servers["llm"]
        async with openai.AsyncOpenAI(base_url=f"{cluster.base}/v1", api_key="none", max_retries=0) as api:
            slow = asyncio.create_task(
                api.chat.completions.create(
                    model="echo", messages=user("a b c d"), extra_body={"sampling_params_list": [{"delay": 0.3}]}
                )
            )
            deadline = time.monotonic() + 10
            while not stage.works:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            ids = list(stage.works)
            async with httpx.AsyncClient() as http:
                ready = await http.get(f"http://127.0.0.1:{stage.http_port}/readyz")
            await slow
        body = ready.json()
        assert ready.status_code == 200 and body["running"] == 1 and sum(body["phases"].values()) == 1
        text = json.dumps(body)
        assert not any(work_id in text or work_id.split(".")[0] in text for work_id in ids)


def test_the_stage_frame_bound_covers_what_the_router_may_send() -> None:
    from omni_runtime.spec import MediaLimits

    plain = echo_pipeline(chat_topology(), limits=RouterLimits(max_body_bytes=4096))
    inline = plain.topology.connectors.inline_max_bytes
    assert 4096 + inline <= max_message_bytes(plain) <= 4096 + inline + 2 * 1024**2
    # Media the router fetches itself is not part of the body, and reaches the stage as base64 data URLs.
    media = MediaLimits(allowed_domains=["example.com"], max_parts=3, max_part_bytes=1024**2)
    fetching = echo_pipeline(chat_topology(), limits=RouterLimits(max_body_bytes=4096, media=media))
    assert max_message_bytes(fetching) >= max_message_bytes(plain) + 3 * (1024**2 * 4 // 3)


async def test_stage_socket_drops_a_peer_that_sends_an_oversize_frame() -> None:
    limits = RouterLimits(max_body_bytes=4096)
    async with echo_cluster(echo_pipeline(chat_topology(), limits=limits)) as cluster:
        (stage,) = cluster.servers["llm"]
        bound = max_message_bytes(cluster.pipeline)
        assert bound < 8 * 1024**2  # derived from the limits, not unbounded
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        try:
            sock.connect(f"tcp://127.0.0.1:{stage.port}")
            events = []
            while zmq.EVENT_HANDSHAKE_SUCCEEDED not in events:
                events.append((await asyncio.wait_for(recv_monitor_message(monitor), 10))["event"])
            submit = P.Submit(id="big.0.llm.primary", request_id="big", stage="llm", data=True, final=True)
            frames = P.encode(submit, {"prompt": b"x" * (bound + 1)})
            assert max(len(memoryview(f)) for f in frames) > bound
            await sock.send_multipart(frames, copy=True)
            while zmq.EVENT_DISCONNECTED not in events:
                events.append((await asyncio.wait_for(recv_monitor_message(monitor), 10))["event"])
        finally:
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
            ctx.term()
        assert "big.0.llm.primary" not in stage.works
        async with openai.AsyncOpenAI(base_url=f"{cluster.base}/v1", api_key="none", max_retries=0) as api:
            reply = await api.chat.completions.create(model="echo", messages=user("still here"))
        assert reply.choices[0].message.content == "still here "
