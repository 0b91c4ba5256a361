"""The stage server: one engine behind a ZeroMQ ROUTER socket, plus /healthz, /readyz, /metrics.

It holds the sockets and the routers' authenticated channels, dispatches their messages, drains, and
keeps house (router silence, engine stats, connector trim). Every accepted `Submit` becomes a work that
`stage.work.WorkRunner` runs in a task of its own (inputs, engine, outputs, releases); `Abort` cancels
that task. See wire/PROTOCOL.md.

Shutting down is a drain (`drain()`, on SIGTERM): the replica tells its routers it is draining, keeps
running the works it has (their feeds included) until they end and the payloads it put are released, takes
the works of requests its routers already run in its generation and have yet to start here (`Ping.awaited`:
a rollout's old generation finishes its in-flight requests), then stops; what still runs when the grace
period ends fails `unavailable`, which the client sees as a retriable 503.

Only the pipeline's own router is heard: every message must carry a valid auth frame (`wire.auth`);
anything else is dropped unanswered and counted in `omnikube_stage_protocol_messages_rejected`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from typing import Any

import zmq
import zmq.asyncio

from omni_runtime.connectors import Handle
from omni_runtime.engines.base import Engine, EngineError
from omni_runtime.metrics import Stage as M
from omni_runtime.processors.kv_cache import KV_PAYLOAD_VERSION
from omni_runtime.spec import ResolvedPipeline
from omni_runtime.spec.contract import model_identity, pipeline_contract, stage_digests
from omni_runtime.stage.connectors import ConnectorSet, ConnectorSettings, ConnectorUnavailable
from omni_runtime.stage.work import Work, WorkRunner
from omni_runtime.wire import protocol as P
from omni_runtime.wire.auth import NO_SESSION, AuthError, Channel, HelloLedger, PipelineKey, open_hello

__all__ = ["StageServer", "max_message_bytes"]

log = logging.getLogger(__name__)

PEER_TIMEOUT_S = 15.0
"""Works of a router that has sent nothing (not even a ping) for this long are aborted."""
HOUSEKEEPING_S = 1.0
"""Period of the housekeeping tick (router silence, peers to forget, engine stats, connector trim)."""
STALL_S = 2.0
"""A housekeeping tick this much later than due means this process was stalled: see `_housekeeping`."""
DRAIN_POLL_S = 0.05
DRAIN_SETTLE_S = 0.25
"""A drain ends only after the replica stayed idle this long: a submit a router sent before it heard
of the drain is still on the wire for about one round trip."""
AWAITED_FRESH_S = 2.0
"""A router's `Ping.awaited` holds a drain only while that router keeps pinging (every 0.5 s): one silent this
long (gone, or done with this replica) holds nothing."""
LINGER_MS = 2000
"""How long closing the socket may take to deliver the last messages (the final outputs of a drain)."""
MAX_CHANNELS = 256
"""Authenticated router connections kept at once; past it the longest-silent one without works goes."""

_HEADER_SLACK = 1024**2


def max_message_bytes(pipeline: ResolvedPipeline) -> int:
    """The largest frame the stage socket accepts (ZMQ_MAXMSGSIZE: a peer that sends a larger one is
    disconnected before the frame is buffered whole). A frame holds a request's own input, which the
    router took from a body of at most `limits.max_body_bytes` plus the media it fetched itself (only from
    `limits.media.allowed_domains`, each part at most `max_part_bytes`, passed on base64-encoded), or a
    header whose inline handles are each at most `connectors.inline_max_bytes`, one per edge and role; the
    bound is the sum of these plus slack."""
    limits, topology = pipeline.limits, pipeline.topology
    roles = 1 + max((len(s.companions) for s in topology.stages), default=0)
    inline = topology.connectors.inline_max_bytes * max(1, len(topology.edges)) * roles
    media = limits.media
    fetched = media.max_parts * (media.max_part_bytes * 4 // 3 + 4) if media.allowed_domains else 0
    return limits.max_body_bytes + fetched + inline + _HEADER_SLACK


RUNTIME_VERSIONS = {"wire": P.PROTOCOL_VERSION, "kv_payload": KV_PAYLOAD_VERSION}
"""The versions of this code's payload layouts, in every stage digest: replicas of two images whose layouts
differ are two generations, which the router never mixes in one request."""


class StageServer:
    """Serves one stage of `pipeline` on `host:port` (protocol) and `host:http_port` (probes)."""

    def __init__(
        self,
        pipeline: ResolvedPipeline,
        stage: str,
        *,
        key: PipelineKey,
        engine: Engine | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        http_port: int | None = 0,
        replica: str = "0",
        connectors: ConnectorSettings | None = None,
        peer_timeout_s: float = PEER_TIMEOUT_S,
    ) -> None:
        """`key`: the pipeline's key; only routers holding it are heard. `engine=None` loads the stage's
        engine with `engines.factory.make_engine`. `port=0` binds a free port (see `self.port` after
        `start`); `http_port=None` serves no HTTP."""
        self.pipeline = pipeline
        self.spec = pipeline.topology.stage(stage)
        self.stage = stage
        self.engine = engine
        self.key = key
        self.host = host
        self.port = port
        self.http_port = http_port
        self.replica = replica
        self.peer_timeout_s = peer_timeout_s
        self.connectors = ConnectorSet(pipeline, stage, connectors or ConnectorSettings(owner=f"{stage}-{replica}"))
        contract = pipeline_contract(pipeline)
        self.spec_contract = contract.stages[stage].digest
        """This stage's spec digest (its pod's `contract.omnikube.io/<stage>` label)."""
        self.generation = stage_digests(contract, identity=model_identity(pipeline.model), runtime=RUNTIME_VERSIONS)
        """Every stage's digest in this replica's generation (its model folder and code versions included)."""
        self.contract = self.generation[stage]
        """This stage's digest: a work planned for another is refused."""
        self.ready = False
        self.draining = False
        """Shutting down: routers are told to send no new work; running works go on."""
        self._labels = (pipeline.name, stage, replica)
        self._runner = WorkRunner(
            pipeline, stage, connectors=self.connectors, engine=lambda: self.engine, send=self._send,
            labels=self._labels,
        )  # fmt: skip
        self.works = self._runner.works
        """The works running here, by work id (`work.Work`)."""
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._send_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []
        self._peers: dict[bytes, float] = {}
        """When each authenticated router connection was last heard from."""
        self._awaited_by: dict[bytes, tuple[int, float]] = {}
        """Each router connection's latest `Ping.awaited` and when it came."""
        self._drain_began: float | None = None
        self._channels: dict[bytes, Channel] = {}
        self._hellos = HelloLedger()
        self._rejections = _RejectionLog(stage)
        self._http: Any = None
        self._stopped = asyncio.Event()
        self._load_error: BaseException | None = None
        self.engine_failure: EngineError | None = None
        """Why the engine died while serving (see `serve_forever`); None while it lives."""
        self._phase = "starting"
        self._closing = False

    # -- lifetime ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the sockets and serve probes at once; load the engine in the background."""
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes(self.pipeline))
        if self.port:
            sock.bind(f"tcp://{self.host}:{self.port}")
        else:
            self.port = sock.bind_to_random_port(f"tcp://{self.host}")
        self._sock = sock
        M.ready.labels(*self._labels).set(0)
        if self.http_port is not None:
            from omni_runtime.stage.http import start_http

            self._http = await start_http(self.stage, self.probe, self.host, self.http_port)
            self.http_port = self._http.port
        self._tasks = [
            asyncio.create_task(self._recv_loop(), name="stage-recv"),
            asyncio.create_task(self._housekeeping(), name="stage-housekeeping"),
            asyncio.create_task(self._load(), name="stage-load"),
        ]
        log.info(
            "stage %s (replica %s) of %s: protocol on tcp://%s:%d (pipeline key %s), probes on http://%s:%s",
            self.stage, self.replica, self.pipeline.name, self.host, self.port, self.key.fingerprint, self.host,
            self.http_port,
        )  # fmt: skip

    async def _load(self) -> None:
        try:
            # Connectors first: a stage whose edges cannot move data must never be ready, and the
            # model is not worth loading while they cannot.
            self._phase = "connectors starting"
            await self.connectors.start()
            self._phase = "engine loading"
            if self.engine is None:
                from omni_runtime.engines.factory import make_engine

                self.engine = make_engine(self.pipeline, self.stage)
            started = time.perf_counter()
            await self.engine.start()
            self.ready = True
            M.ready.labels(*self._labels).set(1)
            log.info("stage %s: engine ready in %.1fs", self.stage, time.perf_counter() - started)
            self._tasks.append(asyncio.create_task(self._watch_engine(self.engine), name="stage-engine-watch"))
        except BaseException as err:
            self._load_error = err
            if isinstance(err, ConnectorUnavailable):
                self._phase = "connector unavailable"
                log.error("stage %s: %s", self.stage, err)
            else:
                self._phase = "engine failed to load"
                log.exception("stage %s: the engine failed to load", self.stage)
            self._stopped.set()
            if not isinstance(err, Exception):
                raise

    async def _watch_engine(self, engine: Engine) -> None:
        """Once the engine says it died while serving (`Engine.fail`), take no more work and end
        `serve_forever` with its error."""
        error = await engine.failed()
        # The running works hear why first: a router that sees readiness drop before a work's own failure
        # would fail it with a generic "replica not ready" and the client would never learn the cause.
        # The works' tasks still end by themselves (their engine call raises the same error).
        for work in list(self.works.values()):
            if not work.closing:
                await self._runner.fail(work, "engine_error", self._runner.engine_failure_text(error))
        self.ready = False
        M.ready.labels(*self._labels).set(0)
        self._phase = "engine failed"
        self.engine_failure = error
        log.error("stage %s: the engine failed while serving, stopping: %s", self.stage, error)
        self._stopped.set()

    async def serve_forever(self) -> None:
        """Run until `stop()` is called, the engine fails to load (then raise its error), or the engine fails
        while serving (then raise `engine_failure`)."""
        await self._stopped.wait()
        if self.engine_failure is not None:
            raise self.engine_failure
        if isinstance(self._load_error, ConnectorUnavailable):
            raise self._load_error
        if self._load_error is not None:
            raise RuntimeError(f"stage {self.stage}: engine failed to load: {self._load_error}")

    async def drain(self, timeout_s: float) -> bool:
        """Stop taking new work and finish what runs, within `timeout_s` seconds.

        Readiness turns false and every router heard from lately gets a `Draining` message, so it sends
        no new work here; works already running go on (feeds, aborts and releases for them are served)
        until they end and nobody holds a payload this replica put any more (a consumer may still read
        it). Works still running at the deadline fail `unavailable` (a retriable 503 for the client).
        True when everything ended in time. Call `stop()` afterwards."""
        if not self.draining:
            self.draining = True
            self._drain_began = time.monotonic()
            M.ready.labels(*self._labels).set(0)
            now = time.monotonic()
            routers = [p for p, seen in self._peers.items() if now - seen <= self.peer_timeout_s]
            log.info(
                "stage %s: draining (up to %.0fs): %d work(s) running, %d payload(s) unreleased, telling %d router(s)",
                self.stage, timeout_s, len(self.works), self.connectors.unreleased(), len(routers),
            )  # fmt: skip
            for peer in routers:
                await self._send(peer, P.Draining(stage=self.stage, grace_s=timeout_s))
        deadline = time.monotonic() + timeout_s
        idle_since: float | None = None
        said_awaited = False
        while True:
            now = time.monotonic()
            awaited = self.awaited()
            idle = not self.works and self.connectors.unreleased() == 0 and not awaited
            if awaited and not self.works and not said_awaited:
                said_awaited = True
                log.info("stage %s: draining, and waiting for %d request(s) of its generation that routers are "
                         "still running to start their work here", self.stage, awaited)  # fmt: skip
            idle_since = (idle_since or now) if idle else None
            if idle_since is not None and now - idle_since >= min(DRAIN_SETTLE_S, timeout_s):
                log.info("stage %s: drained: every work finished and every payload was released", self.stage)
                return True
            if now >= deadline:
                break
            await asyncio.sleep(DRAIN_POLL_S)
        left, payloads = len(self.works), self.connectors.unreleased()
        log.warning(
            "stage %s: the drain period of %.0fs ended with %d work(s) running and %d payload(s) unreleased",
            self.stage, timeout_s, left, payloads,
        )  # fmt: skip
        await self._fail_running(
            f"stage {self.stage} replica {self.replica} shut down before this work finished: its drain period "
            f"of {timeout_s:g}s ended (terminationGracePeriodSeconds of the stage); retry the request, other "
            "replicas take it"
        )
        return False

    async def _fail_running(self, message: str) -> None:
        """Fail every running work `unavailable` (the client gets a retriable 503), then stop it."""
        tasks: list[asyncio.Task] = []
        for work in list(self.works.values()):
            if work.task is None:
                continue
            tasks.append(work.task)
            if not work.closing:
                await self._runner.fail(work, "unavailable", message)
                work.task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def phase(self) -> str:
        """What the stage is doing before it is ready (for /readyz): starting connectors, loading the
        engine, or why it gave up."""
        return "ready" if self.ready else self._phase

    def probe(self) -> tuple[int, dict[str, Any]]:
        """/readyz: its HTTP status and JSON body. 503 while draining (the pod leaves the Service's ready
        endpoints at once) and before the engine is ready (the body says `phase`); 200 once ready. Counts
        only: the probe port is unauthenticated, and a work id is what abort/feed messages name."""
        if self.draining:
            return 503, {"status": "draining", "stage": self.stage, "running": len(self.works)}
        if self.ready:
            phases = collections.Counter(w.phase for w in list(self.works.values()))
            return 200, {
                "status": "ready",
                "stage": self.stage,
                "running": sum(phases.values()),
                "phases": dict(phases),
            }
        return 503, {"status": self.phase, "stage": self.stage}

    async def stop(self) -> None:
        """Abort every work, stop the engine, close connectors (unlinking this process's shm). The
        routers see the replica go away (502 for its works); `drain()` first lets the works finish."""
        if self._closing:
            return
        self._closing = True
        self._stopped.set()
        for work in list(self.works.values()):
            if work.task is not None:
                work.task.cancel()
        await asyncio.gather(*(w.task for w in list(self.works.values()) if w.task), return_exceptions=True)
        await asyncio.gather(*list(self._runner.closers), return_exceptions=True)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._http is not None:
            await self._http.stop()
        if self.engine is not None and self.ready:
            with contextlib.suppress(Exception):
                await self.engine.stop()
        self.connectors.close()
        if self._sock is not None:
            # Linger: the last outputs and failures sent above must reach the routers.
            self._sock.close(linger=LINGER_MS)
        if self._ctx is not None:
            self._ctx.term()

    # -- receiving -----------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            peer, body = frames[0].bytes, frames[1:]
            try:
                opened = await self._open(peer, body)
                if opened is None:
                    continue
                message, rest = opened
                self._peers[peer] = time.monotonic()
                await self._dispatch(peer, message, rest)
            except P.ProtocolError as err:
                log.warning("stage %s: dropping a message: %s", self.stage, err)
            except Exception:
                log.exception("stage %s: handling a message failed", self.stage)

    async def _open(self, peer: bytes, body: list[Any]) -> tuple[P.Message, list[Any]] | None:
        """The message when it is authenticated for its connection; None (dropped, counted) otherwise.
        A connection's first message must be a `Hello` from a router session never seen before."""
        channel = self._channels.get(peer)
        try:
            if channel is not None and not _opens_connection(body):
                return P.decode(await channel.open_async(body))
            fresh, rest = open_hello(self.key, body)
            message, payload = P.decode(rest)
            if not isinstance(message, P.Hello):
                raise AuthError("unknown_session", f"a {type(message).__name__} before the connection's Hello")
            if not self._hellos.first_time(fresh.remote):
                raise AuthError("replay", "a Hello from a router session this stage has already welcomed")
        except AuthError as err:
            M.rejected.labels(*self._labels, err.reason).inc()
            self._rejections.note(err)
            return None
        self._channels[peer] = fresh
        self._trim_channels()
        return message, payload

    def _trim_channels(self) -> None:
        while len(self._channels) > MAX_CHANNELS:
            busy = {w.peer for w in self.works.values()}
            idle = [p for p in self._channels if p not in busy] or list(self._channels)
            oldest = min(idle, key=lambda p: self._peers.get(p, 0.0))
            self._forget_peer(oldest)

    def _forget_peer(self, peer: bytes) -> None:
        self._channels.pop(peer, None)
        self._peers.pop(peer, None)
        self._awaited_by.pop(peer, None)

    def awaited(self) -> int:
        """Requests the routers still running them will start here (`Ping.awaited`), by the routers' latest
        pings. While draining, a router not heard from since the drain began counts 1: it may have bound one
        before it heard (its answer to `Draining` comes at once)."""
        now = time.monotonic()
        began = self._drain_began if self._drain_began is not None else 0.0
        total = 0
        for count, at in self._awaited_by.values():
            if now - at <= AWAITED_FRESH_S:
                total += count if at >= began else 1
        return total

    async def _dispatch(self, peer: bytes, message: P.Message, rest: list[Any]) -> None:
        if isinstance(message, P.Hello):
            await self._send(peer, P.Welcome(stage=self.stage))
        elif isinstance(message, P.Ping):
            self._awaited_by[peer] = (message.awaited, time.monotonic())
            running = len(self.works)
            engine = self.engine if self.ready else None
            voices = engine.voices() if engine is not None else []
            bounds = engine.image_bounds() if engine is not None else None
            pong = P.Pong(
                nonce=message.nonce, sent_at=message.sent_at, ready=self.ready, stage=self.stage,
                running=running, voices=voices, draining=self.draining, image_bounds=bounds,
                contract=self.contract, generation=self.generation, spec_contract=self.spec_contract,
            )  # fmt: skip
            await self._send(peer, pong)
        elif isinstance(message, P.Submit):
            await self._on_submit(peer, message, rest)
        elif isinstance(message, P.Feed):
            work = self.works.get(message.id)
            if work is None:  # finished or aborted meanwhile: nobody will read these
                await self._runner.release_all([i.handle for i in message.inputs])
            else:
                work.held.extend(i.handle for i in message.inputs)
                self._runner.count_handles()
                work.feed.put_nowait(message)
        elif isinstance(message, P.Abort):
            work = self.works.get(message.id)
            if work is not None and work.task is not None and not work.closing:
                log.info("stage %s: aborting %s (%s)", self.stage, message.id, message.reason or "router")
                work.task.cancel()
        elif isinstance(message, P.Release):
            await self._runner.release_all(message.handles)
        else:
            raise P.ProtocolError(f"a stage does not accept {type(message).__name__} messages")

    async def _on_submit(self, peer: bytes, submit: P.Submit, rest: list[Any]) -> None:
        handles: list[Handle] = [i.handle for i in submit.inputs]
        if submit.id in self.works:
            await self._runner.release_all(handles)
            await self._send(peer, P.Failed(id=submit.id, kind="protocol_error", message="duplicate work id"))
            return
        if submit.contract and submit.contract != self.contract:  # defence in depth: the router never plans it
            await self._runner.release_all(handles)
            msg = (
                f"stage {self.stage} replica {self.replica} serves contract {self.contract}, but the work was "
                f"planned for contract {submit.contract} (another generation of the pipeline, whose payloads "
                "this replica cannot read); refused. Retry it: the router keeps a request within one generation"
            )
            await self._send(peer, P.Failed(id=submit.id, kind="unavailable", message=msg))
            return
        if not self.ready:
            await self._runner.release_all(handles)
            msg = f"stage {self.stage} replica {self.replica} is still loading its engine; retry shortly"
            await self._send(peer, P.Failed(id=submit.id, kind="unavailable", message=msg))
            return
        if self.draining:  # sent before that router heard of the drain: run it, the drain waits for it
            log.info("stage %s: draining, but running %s (its router had not heard yet)", self.stage, submit.id)
        work = Work(submit=submit, peer=peer, held=handles)
        try:
            inline = P.payload_of(submit, rest)
        except Exception as err:
            await self._runner.release_all(handles)
            await self._send(peer, P.Failed(id=submit.id, kind="protocol_error", message=str(err)))
            return
        self._runner.start(work, inline)

    # -- sending -------------------------------------------------------------------------------

    async def _send(self, peer: bytes, message: P.Message, payload: dict[str, Any] | None = None) -> None:
        assert self._sock is not None
        frames = P.encode(message, payload)
        async with self._send_lock:  # counters must leave in the order they were sealed
            channel = self._channels.get(peer)
            if channel is None:  # the router's connection was forgotten (silent too long): nobody to tell
                log.debug("stage %s: no connection to send %s on", self.stage, type(message).__name__)
                return
            sealed = await channel.seal_async(frames)
            try:
                await self._sock.send_multipart([peer, *sealed], copy=len(sealed) == 2)
            except zmq.ZMQError as err:  # the router went away (ROUTER_MANDATORY: unroutable)
                level = logging.DEBUG if isinstance(message, P.Pong) else logging.WARNING
                log.log(level, "stage %s: cannot send %s to a router: %s", self.stage, type(message).__name__, err)

    # -- housekeeping --------------------------------------------------------------------------

    async def _housekeeping(self) -> None:
        tick = time.monotonic()
        resumed = 0.0  # when this process last ran again after a stall
        while True:
            await asyncio.sleep(HOUSEKEEPING_S)
            now, last = time.monotonic(), tick
            tick = now
            if now - last > HOUSEKEEPING_S + STALL_S:
                # This process did not run for a while (a loaded machine, a long call on the event loop).
                # What routers sent meanwhile is still unread, and on a stalled machine they did not run
                # either: the stall does not count as their silence.
                log.info("stage %s: housekeeping ran %.1fs late", self.stage, now - last - HOUSEKEEPING_S)
                resumed = now
            busy = {w.peer for w in self.works.values()}
            for peer, seen in list(self._peers.items()):
                if now - max(seen, resumed) > self.peer_timeout_s and peer not in busy:
                    self._forget_peer(peer)
            for work in list(self.works.values()):
                seen = max(self._peers.get(work.peer, now), resumed)
                if now - seen > self.peer_timeout_s and work.task is not None and not work.closing:
                    log.warning("stage %s: router silent for %.0fs; aborting %s", self.stage,
                                now - seen, work.id)  # fmt: skip
                    work.stopped_because = (
                        f"stage {self.stage} replica {self.replica} stopped work {work.id}: its router sent "
                        f"nothing for {now - seen:.0f}s (more than {self.peer_timeout_s:g}s, not even a ping); "
                        "retry the request"
                    )
                    work.task.cancel()
            if self.engine is not None and self.ready:
                self._engine_stats(self.engine)
            self.connectors.trim()

    def _engine_stats(self, engine: Engine) -> None:
        try:
            stats = engine.stats()
        except Exception:
            return
        for name, value in stats.items():
            if name in ("queue_depth", "waiting", "num_waiting"):
                M.engine_queue.labels(*self._labels).set(value)
            elif name == "denoising_steps_queued":
                M.denoising_steps_queued.labels(*self._labels).set(value)
            else:
                M.engine_stat.labels(*self._labels, name).set(value)


def _opens_connection(body: list[Any]) -> bool:
    """Whether a message is addressed to no session yet (a router's `Hello`)."""
    if not body:
        return False
    frame = body[0]
    raw = frame.buffer if hasattr(frame, "buffer") else frame
    view = memoryview(raw)
    return view.nbytes > 33 and bytes(view[17:33]) == NO_SESSION


class _RejectionLog:
    """Says at WARNING, at most every 10 s, that messages were dropped and why (a flood stays one line)."""

    def __init__(self, stage: str, every_s: float = 10.0) -> None:
        self.stage = stage
        self.every_s = every_s
        self._last = -every_s
        self._quiet = 0

    def note(self, err: AuthError) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            self._quiet += 1
            return
        more = f" ({self._quiet} more dropped since the last report)" if self._quiet else ""
        log.warning(
            "stage %s: dropped an unauthenticated protocol message (%s: %s)%s; only this pipeline's router, "
            "holding its key, is answered", self.stage, err.reason, err, more,
        )  # fmt: skip
        self._last, self._quiet = now, 0
