"""Trust between pods: only a peer holding the pipeline's key is heard by a stage server.

The stage server here is the real one (ZeroMQ ROUTER socket, real shm connector) with the EchoEngine
(see its docstring: protocol behaviour without loading a model). Peers are raw ZeroMQ DEALER sockets
speaking the real wire format, so a test can send what an intruder would: unauthenticated frames,
messages sealed with another pipeline's key, and replays of a legitimate router's captured frames.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
import zmq
import zmq.asyncio
from servelib import EchoEngine, echo_pipeline

from omni_runtime.metrics import REGISTRY
from omni_runtime.spec import PipelineSpec, StageSpec
from omni_runtime.stage.connectors import ConnectorSettings
from omni_runtime.stage.server import StageServer
from omni_runtime.wire import protocol as P
from omni_runtime.wire.auth import (
    AUTH_FRAME_BYTES,
    THREAD_MIN_BYTES,
    AuthError,
    Channel,
    PipelineKey,
    open_hello,
)

pytestmark = pytest.mark.timeout(60)


# -- the key and the channel, without sockets ---------------------------------------------------


def test_the_key_never_shows_and_short_keys_are_refused(tmp_path) -> None:
    secret = os.urandom(32)
    key = PipelineKey(secret)
    assert secret.hex() not in repr(key) and secret.hex() not in str(key)
    assert len(key.fingerprint) == 8 and key.fingerprint == PipelineKey(secret).fingerprint
    assert key.fingerprint != PipelineKey.generate().fingerprint
    with pytest.raises(ValueError, match="holds 16 bytes; at least 32 random bytes are required"):
        PipelineKey(os.urandom(16))
    path = tmp_path / "pipeline.key"
    written = PipelineKey.write_new(path)
    assert path.stat().st_mode & 0o777 == 0o600 and len(path.read_bytes()) == 32
    assert PipelineKey.from_file(path).fingerprint == written.fingerprint
    with pytest.raises(ValueError, match="cannot read the pipeline key file .*missing"):
        PipelineKey.from_file(tmp_path / "missing")


def _pair(key: PipelineKey) -> tuple[Channel, Channel]:
    """A router channel and the stage channel its Hello opened (Welcome accepted)."""
    router = Channel(key, "router")
    stage, _ = open_hello(key, router.seal(P.encode(P.Hello())))
    router.open(stage.seal(P.encode(P.Welcome(stage="s"))))
    return router, stage


def test_channel_accepts_the_peer_and_refuses_others_replays_and_reflections() -> None:
    key = PipelineKey.generate()
    router, stage = _pair(key)
    sealed = router.seal(P.encode(P.Abort(id="w1")))
    assert len(sealed[0]) == AUTH_FRAME_BYTES
    message, _ = P.decode(stage.open(sealed))
    assert message == P.Abort(id="w1")

    with pytest.raises(AuthError) as replay:
        stage.open(sealed)
    assert replay.value.reason == "replay"

    tampered = router.seal(P.encode(P.Abort(id="w2")))
    tampered[1] = P.encode(P.Abort(id="w3"))[0]
    with pytest.raises(AuthError) as bad:
        stage.open(tampered)
    assert bad.value.reason == "bad_mac"

    # Another pipeline's router, even one that knows this connection's sessions, fails the MAC.
    other = Channel(PipelineKey.generate(), "router", local=router.local, remote=router.remote, sent=100)
    with pytest.raises(AuthError) as foreign:
        stage.open(other.seal(P.encode(P.Abort(id="w1"))))
    assert foreign.value.reason == "bad_mac"

    # A stage's own message sent back to it (reflection) is not a router's.
    mirror = Channel(key, "stage", local=router.local, remote=router.remote, sent=200)
    with pytest.raises(AuthError) as reflected:
        stage.open(mirror.seal(P.encode(P.Abort(id="w1"))))
    assert reflected.value.reason == "bad_mac"

    # A message of another connection (another session pair) is refused before its MAC is even read.
    router2, _ = _pair(key)
    with pytest.raises(AuthError) as elsewhere:
        stage.open(router2.seal(P.encode(P.Abort(id="w1"))))
    assert elsewhere.value.reason == "unknown_session"

    with pytest.raises(AuthError) as bare:
        stage.open(P.encode(P.Abort(id="w1")))
    assert bare.value.reason == "no_auth"


async def test_large_messages_are_sealed_and_checked_off_the_event_loop_with_the_same_rules() -> None:
    key = PipelineKey.generate()
    router, stage = _pair(key)
    big = {"blob": os.urandom(THREAD_MIN_BYTES + 1)}
    sealed = await router.seal_async(P.encode(P.Output(id="w", seq=0, data=True), big))
    assert stage.open(sealed)  # the same wire format as `seal`
    sealed = await router.seal_async(P.encode(P.Output(id="w", seq=1, data=True), big))
    message, rest = P.decode(await stage.open_async(sealed))
    assert P.payload_of(message, rest) == big
    with pytest.raises(AuthError) as replay:
        await stage.open_async(sealed)
    assert replay.value.reason == "replay"
    tampered = await router.seal_async(P.encode(P.Output(id="w", seq=2, data=True), big))
    tampered[-1] = bytes(tampered[-1])[:-1] + b"!"
    with pytest.raises(AuthError) as bad:
        await stage.open_async(tampered)
    assert bad.value.reason == "bad_mac"


def test_a_large_opening_message_is_refused_unread() -> None:
    key = PipelineKey.generate()
    hello = Channel(key, "router").seal(P.encode(P.Hello()))
    assert open_hello(key, hello)
    padded = Channel(key, "router").seal([*P.encode(P.Hello()), b"x" * 10])
    bulky = Channel(key, "router").seal([b"x" * 2048])
    for frames in (padded, bulky):
        with pytest.raises(AuthError) as refused:
            open_hello(key, frames)
        assert refused.value.reason == "no_auth"


# -- the real stage server -----------------------------------------------------------------------


def _pipeline():
    topo = PipelineSpec(name="trust", stages=[StageSpec(name="llm", kind="ar", final_output=True)])
    return echo_pipeline(topo, name="trust")


class Peer:
    """A raw DEALER connection to a stage; seals with `key` when given (None: an old-style client)."""

    def __init__(self, ctx: zmq.asyncio.Context, port: int, key: PipelineKey | None) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.channel = Channel(key, "router") if key is not None else None
        self.sent: list[list[bytes]] = []
        self.last_rest: list[Any] = []

    def send(self, message: P.Message, payload: dict[str, Any] | None = None) -> list[bytes]:
        frames = P.encode(message, payload)
        frames = [bytes(f) for f in (self.channel.seal(frames) if self.channel else frames)]
        self.send_frames(frames)
        return frames

    def send_frames(self, frames: list[bytes]) -> None:
        self.sent.append(frames)
        self.sock.send_multipart(frames)

    async def recv(self, timeout_s: float = 10.0) -> P.Message:
        frames = await asyncio.wait_for(self.sock.recv_multipart(), timeout_s)
        assert self.channel is not None
        message, self.last_rest = P.decode(self.channel.open(frames))
        return message

    def nothing_received(self) -> bool:
        return not self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN

    async def hello(self) -> P.Welcome:
        self.send(P.Hello())
        welcome = await self.recv()
        assert isinstance(welcome, P.Welcome)
        return welcome

    async def run(self, submit: P.Submit, payload: dict[str, Any]) -> list[P.Message]:
        self.send(submit, payload)
        out = []
        while not (out and (isinstance(out[-1], P.Failed) or getattr(out[-1], "finished", False))):
            out.append(await self.recv())
        return out


def _rejected(reason: str) -> float:
    labels = {"pipeline": "trust", "stage": "llm", "replica": "r0", "reason": reason}
    return REGISTRY.get_sample_value("omnikube_stage_protocol_messages_rejected_total", labels) or 0.0


async def _dropped(reason: str, before: float) -> None:
    """Until the stage has dropped (and counted) one more message for `reason`."""
    while _rejected(reason) <= before:
        await asyncio.sleep(0.01)


class _Stage:
    def __init__(self) -> None:
        self.key = PipelineKey.generate()
        pipeline = _pipeline()
        self.engine = EchoEngine(pipeline, pipeline.topology.stage("llm"))
        self.server = StageServer(
            pipeline, "llm", key=self.key, engine=self.engine, http_port=None, replica="r0",
            connectors=ConnectorSettings(owner="llm-r0", shm_pool_bytes=0),
        )  # fmt: skip
        self.ctx = zmq.asyncio.Context()

    async def __aenter__(self) -> _Stage:
        await self.server.start()
        while not self.server.ready:
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.ctx.destroy(0)
        await self.server.stop()

    def peer(self, key: PipelineKey | None) -> Peer:
        return Peer(self.ctx, self.server.port, key)


def _submit(work_id: str, **params: Any) -> P.Submit:
    return P.Submit(id=work_id, request_id=work_id, stage="llm", data=True, final=True, params=params)


async def test_a_peer_without_the_key_can_neither_submit_nor_get_an_answer() -> None:
    async with _Stage() as s:
        # An old-style client: protocol frames with no auth frame at all.
        plain = s.peer(None)
        before = _rejected("no_auth")
        plain.send(_submit("intruder-1"), {"prompt": "steal this"})
        plain.send(P.Ping(nonce=1))
        await _dropped("no_auth", before + 1)

        # Another pipeline's router: a proper Hello, sealed with the wrong key...
        foreign = s.peer(PipelineKey.generate())
        before = _rejected("bad_mac")
        foreign.send(P.Hello())
        await _dropped("bad_mac", before)
        # ...and a Submit sealed as if that Hello had been welcomed.
        before = _rejected("unknown_session")
        foreign.channel.remote = os.urandom(16)
        foreign.send(_submit("intruder-2"), {"prompt": "steal this"})
        await _dropped("unknown_session", before)

        # The pipeline's own router, on its own connection, is served as always; large messages too
        # (their MACs are computed in a worker thread).
        router = s.peer(s.key)
        await router.hello()
        outputs = await router.run(_submit("ours"), {"prompt": "hello there"})
        assert isinstance(outputs[-1], P.Output) and outputs[-1].finished and outputs[-1].data
        word = "w" * (2 * THREAD_MIN_BYTES)
        outputs = await router.run(_submit("ours-big"), {"prompt": word})
        assert isinstance(outputs[-1], P.Output) and outputs[-1].finished and outputs[-1].data
        assert P.payload_of(outputs[-1], router.last_rest)["text"] == word + " "

        assert [r.request_id for r in s.engine.seen] == ["ours", "ours-big"]  # the intruders' works never ran
        assert plain.nothing_received() and foreign.nothing_received()  # not even a pong


async def test_a_foreign_peer_cannot_abort_a_work_or_release_a_payload() -> None:
    async with _Stage() as s:
        router = s.peer(s.key)
        await router.hello()
        handle = await s.server.connectors.put("shm", "next", "payload-1", {"secret": b"x" * 4096})
        shm = s.server.connectors.connector("shm")
        assert shm.stats()["busy"] == 1
        router.send(_submit("slow", delay=0.2), {"prompt": "one two three four five six"})
        first = await router.recv()
        assert isinstance(first, P.Output) and not first.finished  # it runs (0.2 s per word)

        for intruder in (s.peer(None), s.peer(PipelineKey.generate())):
            if intruder.channel is not None:
                intruder.send(P.Hello())
                intruder.channel.remote = os.urandom(16)
            counts = {r: _rejected(r) for r in ("no_auth", "bad_mac", "unknown_session")}
            intruder.send(P.Abort(id="slow", reason="intruder"))
            intruder.send(P.Release(handles=[handle]))
            while sum(_rejected(r) for r in counts) < sum(counts.values()) + 2:
                await asyncio.sleep(0.01)
            assert intruder.nothing_received()

        rest = [first]
        while not getattr(rest[-1], "finished", False):
            rest.append(await router.recv())
        assert s.engine.aborted == []  # the work ran to its end
        done = rest[-1]
        assert isinstance(done, P.Output) and done.finish_reason == "stop"
        assert done.usage == {"prompt_tokens": 6, "completion_tokens": 6}  # every word, not cut short
        assert shm.stats()["busy"] == 1  # the payload is still held
        assert (await s.server.connectors.get(handle))["secret"] == b"x" * 4096

        router.send(P.Release(handles=[handle]))  # the pipeline's router may
        while shm.stats()["busy"]:
            await asyncio.sleep(0.01)


async def test_replayed_messages_are_refused() -> None:
    async with _Stage() as s:
        router = s.peer(s.key)
        await router.hello()
        await router.run(_submit("once"), {"prompt": "only once"})
        hello_frames, submit_frames = router.sent

        # The same connection: the counter was used.
        before = _rejected("replay")
        router.send_frames(submit_frames)
        await _dropped("replay", before)

        # A new connection replaying the captured conversation: the Hello's session was already welcomed,
        # and the Submit belongs to a session this connection never opened.
        replayer = s.peer(None)
        before_replay, before_session = _rejected("replay"), _rejected("unknown_session")
        replayer.send_frames(hello_frames)
        replayer.send_frames(submit_frames)
        await _dropped("replay", before_replay)
        await _dropped("unknown_session", before_session)
        assert replayer.nothing_received()

        assert [r.request_id for r in s.engine.seen] == ["once"]
        # The router's connection still works after all that.
        router.send(P.Ping(nonce=7))
        pong = await router.recv()
        assert isinstance(pong, P.Pong) and pong.nonce == 7


# -- the router's side -----------------------------------------------------------------------------


def _router_rejected(reason: str, address: str) -> float:
    labels = {"pipeline": "trust", "stage": "llm", "replica": address, "reason": reason}
    return REGISTRY.get_sample_value("omnikube_protocol_messages_rejected_total", labels) or 0.0


async def test_a_router_with_another_pipelines_key_never_gets_a_replica_up(monkeypatch) -> None:
    from omni_runtime.router import client as client_module
    from omni_runtime.router.client import ReplicaClient

    monkeypatch.setattr(client_module, "HELLO_RETRY_S", 0.2)  # say why sooner than the real 5 s
    async with _Stage() as s:
        before = _rejected("bad_mac")
        replica = ReplicaClient(
            s.ctx, "trust", "llm", f"127.0.0.1:{s.server.port}", key=PipelineKey.generate(), ping_interval_s=0.05
        )
        replica.start()
        try:
            while _rejected("bad_mac") < before + 2:  # its first Hello, and the one from a new session after it
                await asyncio.sleep(0.01)
            while "pipeline's key" not in replica.reason:
                await asyncio.sleep(0.01)
            assert not replica.usable and replica.state.value == "connecting"
            with pytest.raises(ConnectionError, match="is connecting"):
                replica.submit(_submit("nope"), {"prompt": "x"}, lambda *a: None)
            with pytest.raises(ConnectionError, match="not authenticated yet"):
                replica.send(P.Abort(id="nope"))
            assert s.engine.seen == []
        finally:
            await replica.close()


async def test_the_router_drops_what_a_stage_impostor_sends() -> None:
    """A process at a stage's address without the key (it could not have the router's session either):
    its Welcome and any message it sends are dropped and counted, and no replica comes up."""
    from omni_runtime.router.client import ReplicaClient

    key = PipelineKey.generate()
    ctx = zmq.asyncio.Context()
    impostor = ctx.socket(zmq.ROUTER)
    impostor.setsockopt(zmq.LINGER, 0)
    port = impostor.bind_to_random_port("tcp://127.0.0.1")
    address = f"127.0.0.1:{port}"
    replica = ReplicaClient(ctx, "trust", "llm", address, key=key, ping_interval_s=0.05)
    replica.start()
    try:
        peer, auth, *_ = await asyncio.wait_for(impostor.recv_multipart(), 10)  # the router's Hello
        router_session = auth[1:17]
        forged = Channel(PipelineKey.generate(), "stage", remote=router_session)
        before = _router_rejected("bad_mac", address)
        await impostor.send_multipart([peer, *forged.seal(P.encode(P.Welcome(stage="llm")))])
        await impostor.send_multipart([peer, *forged.seal(P.encode(P.Pong(nonce=0, ready=True, stage="llm")))])
        while _router_rejected("bad_mac", address) < before + 2:
            await asyncio.sleep(0.01)
        # An unauthenticated Pong, old style, is dropped too.
        before = _router_rejected("no_auth", address)
        await impostor.send_multipart([peer, *P.encode(P.Pong(nonce=1, ready=True, stage="llm"))])
        while _router_rejected("no_auth", address) <= before:
            await asyncio.sleep(0.01)
        assert not replica.usable
    finally:
        await replica.close()
        ctx.destroy(0)
