"""The stage server: one engine behind a ZeroMQ ROUTER socket, plus /healthz, /readyz, /metrics.

Every `Submit` becomes a task that gets its input handles, runs the edge's input processor and the
engine, sends final outputs inline and downstream outputs as handles it `put`s, and releases every
input handle it was given, whatever happens. `Abort` cancels that task; the handles the work created
and the router has not seen taken are released too. See wire/PROTOCOL.md.

Shutting down is a drain (`drain()`, on SIGTERM): the replica tells its routers it is draining, keeps
running the works it has (their feeds included) until they end and the payloads it put are released,
then stops; what still runs when the grace period ends fails `unavailable`, which the client sees as a
retriable 503.

Only the pipeline's own router is heard: every message must carry a valid auth frame (`wire.auth`);
anything else is dropped unanswered and counted in `omnikube_stage_protocol_messages_rejected`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from omni_runtime.connectors import ConnectorError, Handle
from omni_runtime.engines.base import Engine, EngineError, EngineInput, EngineOutput, InvalidRequest
from omni_runtime.metrics import Stage as M
from omni_runtime.processors import ProcessorError
from omni_runtime.spec import ResolvedPipeline
from omni_runtime.stage.connectors import ConnectorSet, ConnectorSettings, ConnectorUnavailable
from omni_runtime.stage.inputs import owned, process_inputs
from omni_runtime.stage.outputs import client_fields, count_items, merge, summarize
from omni_runtime.wire import protocol as P
from omni_runtime.wire.audio import audio_seconds
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


@dataclass(eq=False)
class _Work:
    submit: P.Submit
    peer: bytes
    started: float = field(default_factory=time.perf_counter)
    task: asyncio.Task | None = None
    feed: asyncio.Queue = field(default_factory=asyncio.Queue)
    held: list[Handle] = field(default_factory=list)
    """Input handles received and not yet released."""
    created: list[Handle] = field(default_factory=list)
    """Handles this work `put` (released on abort)."""
    seq: int = 0
    running_engine_id: str | None = None
    closing: bool = False
    """Past its last output or failure: an abort no longer cancels it."""
    audio_seen: bool = False
    phase: str = "queued"
    """Where the work is (inputs, engine, outputs, aborting...), for /readyz and debugging."""
    stopped_because: str | None = None
    """Why this stage stopped the work on its own (no router asked): the router is told, with this."""
    failure_sent: bool = False
    """Its router was sent a `Failed` for it: it hears of a work's failure once."""

    @property
    def id(self) -> str:
        return self.submit.id


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
        self.ready = False
        self.draining = False
        """Shutting down: routers are told to send no new work; running works go on."""
        self.works: dict[str, _Work] = {}
        self._labels = (pipeline.name, stage, replica)
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._send_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []
        self._closers: set[asyncio.Task] = set()
        """Cleanups of works aborted before they started (see `_after_task`)."""
        self._peers: dict[bytes, float] = {}
        """When each authenticated router connection was last heard from."""
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

    @property
    def _engine(self) -> Engine:
        """The loaded engine; works are accepted only once it has loaded."""
        if self.engine is None:
            raise RuntimeError(f"stage {self.stage}: the engine is not loaded yet")
        return self.engine

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
                await self._fail(work, "engine_error", self._engine_failure_text(error))
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
        while True:
            now = time.monotonic()
            idle = not self.works and self.connectors.unreleased() == 0
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
                await self._fail(work, "unavailable", message)
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
        await asyncio.gather(*list(self._closers), return_exceptions=True)
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

    async def _dispatch(self, peer: bytes, message: P.Message, rest: list[Any]) -> None:
        if isinstance(message, P.Hello):
            await self._send(peer, P.Welcome(stage=self.stage))
        elif isinstance(message, P.Ping):
            running = len(self.works)
            voices = self.engine.voices() if self.ready and self.engine is not None else []
            pong = P.Pong(
                nonce=message.nonce, sent_at=message.sent_at, ready=self.ready, stage=self.stage,
                running=running, voices=voices, draining=self.draining,
            )  # fmt: skip
            await self._send(peer, pong)
        elif isinstance(message, P.Submit):
            await self._on_submit(peer, message, rest)
        elif isinstance(message, P.Feed):
            work = self.works.get(message.id)
            if work is None:  # finished or aborted meanwhile: nobody will read these
                await self._release_all([i.handle for i in message.inputs])
            else:
                work.held.extend(i.handle for i in message.inputs)
                self._count_handles()
                work.feed.put_nowait(message)
        elif isinstance(message, P.Abort):
            work = self.works.get(message.id)
            if work is not None and work.task is not None and not work.closing:
                log.info("stage %s: aborting %s (%s)", self.stage, message.id, message.reason or "router")
                work.task.cancel()
        elif isinstance(message, P.Release):
            await self._release_all(message.handles)
        else:
            raise P.ProtocolError(f"a stage does not accept {type(message).__name__} messages")

    async def _on_submit(self, peer: bytes, submit: P.Submit, rest: list[Any]) -> None:
        handles: list[Handle] = [i.handle for i in submit.inputs]
        if submit.id in self.works:
            await self._release_all(handles)
            await self._send(peer, P.Failed(id=submit.id, kind="protocol_error", message="duplicate work id"))
            return
        if not self.ready:
            await self._release_all(handles)
            msg = f"stage {self.stage} replica {self.replica} is still loading its engine; retry shortly"
            await self._send(peer, P.Failed(id=submit.id, kind="unavailable", message=msg))
            return
        if self.draining:  # sent before that router heard of the drain: run it, the drain waits for it
            log.info("stage %s: draining, but running %s (its router had not heard yet)", self.stage, submit.id)
        work = _Work(submit=submit, peer=peer, held=handles)
        try:
            inline = P.payload_of(submit, rest)
        except Exception as err:
            await self._release_all(handles)
            await self._send(peer, P.Failed(id=submit.id, kind="protocol_error", message=str(err)))
            return
        self.works[submit.id] = work
        M.running.labels(*self._labels).set(len(self.works))
        self._count_handles()
        work.task = asyncio.create_task(self._run(work, inline), name=f"work-{submit.id}")
        work.task.add_done_callback(lambda _task: self._after_task(work))

    # -- running a work ------------------------------------------------------------------------

    async def _run(self, work: _Work, inline: dict[str, Any] | None) -> None:
        status = "ok"
        try:
            await self._execute(work, inline)
        except asyncio.CancelledError:
            status = "aborted"
        except InvalidRequest as err:
            status = "invalid_request"
            await self._fail(work, "invalid_request", str(err))
        except ConnectorError as err:
            status = "connector_error"
            await self._fail(work, "connector_error", f"stage {self.stage}: {err}")
        except ProcessorError as err:
            status = "engine_error"
            await self._fail(work, "engine_error", f"stage {self.stage}: {err}")
        except Exception as err:
            status = "engine_error"
            log.exception("stage %s: work %s failed", self.stage, work.id)
            await self._fail(work, "engine_error", self._engine_failure_text(err))
        finally:
            # No abort may interrupt the cleanup: it runs shielded, to its end, whatever happens here.
            work.closing = True
            await asyncio.shield(self._close_work(work, status))

    def _after_task(self, work: _Work) -> None:
        """Close a work whose task ended without running `_run`: a task cancelled before its first step
        never runs its body, `finally` included. That happens when an Abort is read right behind its
        Submit (both arrive in one burst and are dispatched before the new task gets a turn)."""
        if work.closing or self.works.get(work.id) is not work:
            return
        work.closing = True
        closer = asyncio.create_task(self._close_work(work, "aborted"), name=f"close-{work.id}")
        self._closers.add(closer)
        closer.add_done_callback(self._closers.discard)

    async def _close_work(self, work: _Work, status: str) -> None:
        """Abort the engine and release created handles unless the work finished; then release every
        input handle it holds (chunks fed after it stopped reading included) and forget it. A work this
        stage stopped on its own is failed to its router first, which otherwise waits for it until its
        request times out."""
        if status == "aborted" and work.stopped_because is not None:
            await self._fail(work, "unavailable", work.stopped_because)
        work.phase = "releasing"
        if status != "ok":
            await self._abort_engine(work)
            await self._release_all(work.created)
            work.created.clear()
        await self._release_all(work.held)
        work.held.clear()
        while not work.feed.empty():
            feed = work.feed.get_nowait()
            await self._release_all([i.handle for i in feed.inputs])
        self.works.pop(work.id, None)
        M.running.labels(*self._labels).set(len(self.works))
        M.requests.labels(*self._labels, status).inc()
        M.latency.labels(*self._labels).observe(time.perf_counter() - work.started)
        self._count_handles()

    async def _execute(self, work: _Work, inline: dict[str, Any] | None) -> None:
        s = work.submit
        params = {**self.spec.sampling_params, **s.params}
        edges = _EdgeBuffers(s.edges)
        put = lambda e, d, last: self._put(work, e, d, last)  # noqa: E731
        acc = _FinalAcc()
        if s.more_inputs and self._engine.streams_input:
            await self._run_streamed(work, inline, params, edges, acc)
        else:
            await self._run_chunked(work, inline, params, edges, acc)
        await edges.flush(put)
        last = acc.last
        with_data = s.final and not s.stream and acc.data is not None
        done_msg = P.Output(
            id=work.id, seq=self._seq(work), data=with_data, finished=True,
            finish_reason=last.finish_reason if last else None, usage=last.usage if last else None,
        )  # fmt: skip
        await self._send(work.peer, done_msg, acc.data if with_data else None)
        work.created.clear()  # the router now owns them (it releases what nobody consumes)

    async def _run_chunked(self, work: _Work, inline, params, edges: _EdgeBuffers, acc: _FinalAcc) -> None:
        """One engine run for the whole input, or one per chunk of a windowed edge."""
        s = work.submit
        chunk_index = 0
        info_sent = False
        async for inputs, is_last in self._chunks(work):
            work.phase = "inputs"
            data = await self._prepare(work, inline, inputs)
            if not info_sent and summarize(data):
                await self._send(work.peer, P.Output(id=work.id, seq=self._seq(work), info=summarize(data)))
            info_sent = True
            chunk_params = dict(params)
            if s.more_inputs:
                chunk_params.update(chunk_index=chunk_index, last_chunk=is_last)
            engine_id = work.id if not s.more_inputs else f"{work.id}#{chunk_index}"
            request = EngineInput(request_id=engine_id, data=data, params=chunk_params, role=s.role)
            await self._engine_run(work, request, edges, acc, ends_work=is_last)
            work.phase = "outputs"
            if s.more_inputs:  # a chunk is done with once its engine run is; whole inputs at the end,
                done = [i.handle for i in inputs]  # after their outputs are put (shm payloads are views)
                await self._release_all(done)
                work.held = [h for h in work.held if h not in done]
                self._count_handles()
            chunk_index += 1

    async def _run_streamed(self, work: _Work, inline, params, edges: _EdgeBuffers, acc: _FinalAcc) -> None:
        """One engine run fed chunk by chunk (`Engine.streams_input`): the first chunk is its `data`,
        the rest arrive through `EngineInput.chunks` while it runs. Each chunk is copied out of its
        payload and released as soon as it is read, so the producer's memory is not held while the
        engine runs on."""
        s = work.submit
        chunks = self._chunks(work)
        work.phase = "inputs"
        first = await anext(chunks, None)
        data = await self._take(work, inline, first[0] if first else [])
        if summarize(data):
            await self._send(work.peer, P.Output(id=work.id, seq=self._seq(work), info=summarize(data)))

        async def rest():
            async for inputs, _ in chunks:
                yield await self._take(work, None, inputs)

        request = EngineInput(request_id=work.id, data=data, params=dict(params), role=s.role, chunks=rest())
        await self._engine_run(work, request, edges, acc, ends_work=True)

    async def _take(self, work: _Work, inline: dict[str, Any] | None, inputs: list[P.Input]) -> dict[str, Any]:
        """A chunk's engine input, owned (copied out of connector memory), its handles released."""
        data = owned(await self._prepare(work, inline, inputs))
        if inputs:
            done = [i.handle for i in inputs]
            await self._release_all(done)
            work.held = [h for h in work.held if h not in done]
            self._count_handles()
        return data

    async def _engine_run(
        self, work: _Work, request: EngineInput, edges: _EdgeBuffers, acc: _FinalAcc, *, ends_work: bool
    ) -> None:
        s = work.submit
        put = lambda e, d, last: self._put(work, e, d, last)  # noqa: E731
        work.running_engine_id = request.request_id
        work.phase = "engine"
        async for out in self._engine.generate(request):
            acc.last = out
            self._count_audio(work, out.data)
            if s.final:
                piece = client_fields(out.data)  # the downstream-only rows stay off the router's edge
                if s.stream:
                    await self._send_final(work, piece)
                else:
                    acc.data = merge(acc.data, piece)
            await edges.add(out.data, put, finished=out.finished and ends_work)
        work.running_engine_id = None

    def _count_audio(self, work: _Work, data: dict[str, Any]) -> None:
        seconds = audio_seconds(data)
        if seconds:
            if not work.audio_seen:
                work.audio_seen = True
                M.ttfp.labels(*self._labels).observe(time.perf_counter() - work.started)
            M.audio_seconds.labels(*self._labels).inc(seconds)

    async def _chunks(self, work: _Work):
        """(inputs, is last) per engine run: one run, or one per chunk of a windowed edge."""
        s = work.submit
        if not s.more_inputs:
            yield list(s.inputs), True
            return
        pending = list(s.inputs)
        last = False
        while True:
            if not pending and not last:
                feed: P.Feed = await work.feed.get()
                pending.extend(feed.inputs)
                last = feed.last
                if not pending and not last:
                    continue
            if not pending and last:
                return
            # one engine run per chunk, in chunk order
            pending.sort(key=lambda i: i.seq)
            chunk = pending.pop(0)
            yield [chunk], chunk.last or (last and not pending)

    async def _prepare(self, work: _Work, inline: dict[str, Any] | None, inputs: list[P.Input]) -> dict[str, Any]:
        s = work.submit
        if not inputs:
            return dict(inline or {})
        loaded = [(item, await self.connectors.get(item.handle)) for item in inputs]
        data = process_inputs(
            s.input_processor, loaded, self.pipeline.topology, request_id=s.request_id, request=s.context
        )
        if inline:
            data = {**inline, **data}
        return data

    async def _put(self, work: _Work, edge: P.EdgeOut, data: dict[str, Any], last: bool) -> None:
        key = f"{work.submit.request_id}.{work.submit.role}.{work.seq}"
        handle = await self.connectors.put(edge.connector, edge.target, key, data)
        work.created.append(handle)
        edge_labels = (self.pipeline.name, self.stage, edge.target, edge.connector)
        M.edge_chunks.labels(*edge_labels).inc()
        M.edge_bytes.labels(*edge_labels).inc(handle.nbytes)
        self._count_handles()
        item = P.Input(source=self.stage, role=work.submit.role, seq=work.seq, last=last, handle=handle)
        await self._send(work.peer, P.Output(id=work.id, seq=self._seq(work), handles=[item]))

    async def _send_final(self, work: _Work, data: dict[str, Any]) -> None:
        await self._send(work.peer, P.Output(id=work.id, seq=self._seq(work), data=True), data)

    def _engine_failure_text(self, err: BaseException) -> str:
        """What the client reads when the engine raised `err` while running its work (or died under it)."""
        return f"stage {self.stage}: {type(err).__name__}: {err}"

    async def _fail(self, work: _Work, kind: P.ErrorKind, message: str) -> None:
        if work.failure_sent:
            return
        work.failure_sent = True
        with contextlib.suppress(Exception):
            await self._send(work.peer, P.Failed(id=work.id, kind=kind, message=message))

    async def _abort_engine(self, work: _Work) -> None:
        engine_id = work.running_engine_id
        if engine_id is not None and self.engine is not None:
            try:
                await asyncio.shield(self.engine.abort(engine_id))
            except Exception:
                log.exception("stage %s: engine abort of %s failed", self.stage, engine_id)

    async def _release_all(self, handles: Sequence[Handle]) -> None:
        for handle in list(handles):
            try:
                await asyncio.shield(self.connectors.release(handle))
            except asyncio.CancelledError:
                raise
            except Exception as err:  # the payload's owner may be gone; nothing is left to free
                log.warning("stage %s: releasing %s handle %s failed: %s", self.stage,
                            handle.kind.value, handle.key, err)  # fmt: skip

    # -- sending -------------------------------------------------------------------------------

    def _seq(self, work: _Work) -> int:
        work.seq += 1
        return work.seq - 1

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

    def _count_handles(self) -> None:
        n = sum(len(w.held) + len(w.created) for w in self.works.values())
        M.handles_open.labels(*self._labels).set(n)


_Put = Callable[[P.EdgeOut, dict[str, Any], bool], Awaitable[None]]
"""Puts one edge's payload (`last` marks the edge's last handle) and tells the router."""


@dataclass
class _FinalAcc:
    """A work's final output folded so far (non-streaming final stages) and its last engine output."""

    data: dict[str, Any] | None = None
    last: EngineOutput | None = None


class _EdgeBuffers:
    """Per downstream edge: the output folded so far, put as a handle every `window` items.

    A chunk goes out as soon as it holds `window` items (`first_window` for the first one, when set),
    so a per-step edge hands each step on at once; the piece that ends the work goes out marked `last`.
    When the last chunk went out before the work ended, `flush` puts an empty one marked `last`, so
    the target always learns the end from the producer. Window 0 puts the whole output once, at the end.
    """

    def __init__(self, edges: list[P.EdgeOut]) -> None:
        self.edges = edges
        self.acc: dict[str, dict[str, Any] | None] = {e.target: None for e in edges}
        self.puts = {e.target: 0 for e in edges}
        self.closed: set[str] = set()

    async def add(self, piece: dict[str, Any], put: _Put, *, finished: bool = False) -> None:
        for edge in self.edges:
            t = edge.target
            if t in self.closed:
                continue
            data = self.acc[t] = merge(self.acc[t], piece)
            size = edge.first_window if edge.first_window and not self.puts[t] else edge.window
            if edge.window > 0 and (finished or count_items(data) >= size):
                self.acc[t] = None
                await put(edge, data, finished)
                self.puts[t] += 1
                if finished:
                    self.closed.add(t)

    async def flush(self, put: _Put) -> None:
        """Put what is left, marked `last`; every edge gets at least one handle."""
        for edge in self.edges:
            t = edge.target
            if t not in self.closed:
                await put(edge, self.acc[t] or {}, True)
                self.closed.add(t)
            self.acc[t] = None


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
