"""The router's connection to one stage replica: a ZeroMQ DEALER, pings, and the works running there.

A replica is *up* while it answers pings and says it is ready. It goes *down* when its connection drops
(socket monitor) or when nothing came from it for `ping_timeout_s` (a hung process): every work
running on it is then told (`on_lost`), so the request fails at once instead of waiting for its
timeout. It comes back up by itself when it answers again (ZeroMQ reconnects).

A replica that says it is draining (a `Draining` message or `Pong.draining`: it got SIGTERM) gets no new
work, while the works it runs go on to their end.

Every connection is authenticated (`wire.auth`): the client opens it with a `Hello`, keeps to the
sessions of the stage's `Welcome`, seals what it sends and drops (and counts) any message from the
stage that does not verify. A new connection (after a drop) starts a new session.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from omni_runtime.metrics import Router as M
from omni_runtime.spec.image_bounds import ImageSizeBounds
from omni_runtime.wire import protocol as P
from omni_runtime.wire.auth import AuthError, Channel, PipelineKey

__all__ = ["ReplicaClient", "ReplicaState", "WorkSink"]

log = logging.getLogger(__name__)

HELLO_RETRY_S = 5.0
"""A `Hello` unanswered this long is sent again, from a new session (the stage may have restarted)."""
STALL_S = 2.0
"""A ping-loop wake-up this much later than due means this process was stalled: see `_ping_loop`."""

WorkSink = Callable[[P.Message | None, list[Any], str | None], None]
"""Called with (message, payload frames, None) for each message of a work, or (None, [], reason) once
when the replica is lost while the work runs."""


class ReplicaState(str, enum.Enum):
    CONNECTING = "connecting"
    """No pong yet (or the stage is still loading its engine)."""
    UP = "up"
    DOWN = "down"


class ReplicaClient:
    """One stage replica, reached at `address` (`host:port`)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        pipeline: str,
        stage: str,
        address: str,
        *,
        key: PipelineKey,
        ping_interval_s: float = 0.5,
        ping_timeout_s: float = 10.0,
        awaited: Callable[[str], int] | None = None,
    ) -> None:
        """`awaited`: given the replica's stage digest, how many of the router's running requests will still
        start work on a replica of that digest (`Ping.awaited`)."""
        self.pipeline = pipeline
        self._awaited = awaited
        self.stage = stage
        self.address = address
        self.ping_interval_s = ping_interval_s
        self.ping_timeout_s = ping_timeout_s
        self.state = ReplicaState.CONNECTING
        self.reason = "not answered yet"
        self.draining = False
        """Discovery no longer lists it: no new work; closed once its works end."""
        self.stage_draining = False
        """The replica said it is shutting down: no new work; its running works go on."""
        self.outstanding = 0
        self.rtt_s = 0.0
        self.voices: list[str] = []
        self.image_bounds: ImageSizeBounds | None = None
        """Speakers the replica's engine knows, from its latest pong."""
        self.contract = ""
        """Its stage digest, from its latest pong ("": a replica that reports none)."""
        self.generation: dict[str, str] = {}
        """The stage digests of the generation it belongs to, by stage (see `wire.protocol.Pong`)."""
        self._sinks: dict[str, WorkSink] = {}
        self._nonce = itertools.count()
        self._last_pong = 0.0
        self._key = key
        self._channel = Channel(key, "router")
        self._hello_at: float | None = None
        """When this connection's `Hello` went out (None: not yet, or the connection was reset)."""
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue messages for a replica not connected
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._sock.connect(f"tcp://{address}")
        self._tasks: list[asyncio.Task] = []
        self._labels = (pipeline, stage, address)
        self._closed = False
        self._rejected_reasons: set[str] = set()
        """Reasons of omnikube_protocol_messages_rejected series this replica has, to drop on close."""
        M.replica_up.labels(*self._labels).set(0)
        M.stage_outstanding.labels(*self._labels).set(0)

    def __repr__(self) -> str:
        return f"<replica {self.stage}@{self.address} {self.state.value} outstanding={self.outstanding}>"

    def describe(self) -> str:
        """`address state (reason)`, for error messages."""
        text = f"{self.address} {'draining' if self.draining or self.stage_draining else self.state.value}"
        return f"{text} ({self.reason})" if self.reason else text

    @property
    def answered(self) -> bool:
        """Anything came from the replica yet."""
        return self._last_pong != 0.0

    @property
    def usable(self) -> bool:
        return self.state is ReplicaState.UP and not self.draining and not self.stage_draining and not self._closed

    @property
    def finishing(self) -> bool:
        """Draining but still answering: no new request's work goes there, but a request already running in
        its generation may still start its work there (the replica waits for those: `Ping.awaited`)."""
        return self.state is ReplicaState.UP and (self.draining or self.stage_draining) and not self._closed

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._recv_loop(), name=f"recv-{self.stage}@{self.address}"),
            asyncio.create_task(self._ping_loop(), name=f"ping-{self.stage}@{self.address}"),
            asyncio.create_task(self._monitor_loop(), name=f"monitor-{self.stage}@{self.address}"),
        ]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._lose("the router stopped using this replica")
        for task in self._tasks:
            task.cancel()
        self._forget_series()
        try:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        finally:
            # Even when the close itself is cancelled (the pool stopping while its reaper closes this replica):
            # a socket left open here blocks the context's term() for ever.
            with contextlib.suppress(Exception):
                self._sock.disable_monitor()
            self._monitor.close(0)
            self._sock.close(0)

    def _forget_series(self) -> None:
        """Drop this replica's series from the router's /metrics. A gone replica (its pod IP) would
        otherwise be exported forever: one more series per pod ever seen, and a frozen value in every
        sum, average or count over the stage. Called before `close` first yields: by the time it resumes,
        discovery may have added a new client for the same address, whose series must stay."""
        M.replica_up.remove(*self._labels)
        M.stage_outstanding.remove(*self._labels)
        for reason in self._rejected_reasons:
            M.rejected.remove(*self._labels, reason)

    # -- works ---------------------------------------------------------------------------------

    def submit(self, submit: P.Submit, payload: dict[str, Any] | None, sink: WorkSink) -> None:
        """Send a work; its messages go to `sink`. Raises ConnectionError when it cannot be sent, and
        OverflowError (nothing sent) when an integer in it does not fit msgpack's 64 bits."""
        if not (self.usable or self.finishing):
            raise ConnectionError(f"stage {self.stage!r} replica {self.address} is {self.state.value}")
        self._sinks[submit.id] = sink
        self.outstanding += 1
        M.stage_outstanding.labels(*self._labels).set(self.outstanding)
        try:
            self.send(submit, payload)
        except (ConnectionError, OverflowError):
            self.finish(submit.id)
            raise

    def finish(self, work_id: str) -> None:
        """The work ended (finished, failed, aborted, lost): stop routing its messages."""
        if self._sinks.pop(work_id, None) is not None:
            self.outstanding -= 1
            M.stage_outstanding.labels(*self._labels).set(self.outstanding)

    def send(self, message: P.Message, payload: dict[str, Any] | None = None) -> None:
        if self._closed:
            raise ConnectionError(f"stage {self.stage!r} replica {self.address} is no longer used by this router")
        if not self._channel.established:
            raise ConnectionError(
                f"cannot reach stage {self.stage!r} replica {self.address}: its connection is not authenticated yet"
            )
        self._send_frames(self._channel.seal(P.encode(message, payload)))

    def _send_frames(self, frames: list[Any]) -> None:
        # NOBLOCK on an asyncio socket: the send happens now and its future is already done; with
        # IMMEDIATE it fails (EAGAIN) when the replica is not connected.
        # (pyzmq types the result an Awaitable; zmq.asyncio returns an asyncio.Future.)
        future = cast(
            "asyncio.Future[Any]", self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=len(frames) == 2)
        )
        err = future.exception() if future.done() else None
        if err is not None:
            reason = err.strerror if isinstance(err, zmq.ZMQError) else str(err)
            raise ConnectionError(f"cannot reach stage {self.stage!r} replica {self.address}: {reason}")

    def try_send(self, message: P.Message) -> bool:
        try:
            self.send(message)
        except ConnectionError:
            return False
        return True

    # -- loops ---------------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                message, rest = P.decode(await self._channel.open_async(frames))
            except AuthError as err:
                M.rejected.labels(*self._labels, err.reason).inc()
                self._rejected_reasons.add(err.reason)
                log.debug("replica %s/%s: dropped a message (%s: %s)", self.stage, self.address, err.reason, err)
                continue
            except P.ProtocolError as err:
                log.warning("replica %s/%s: %s", self.stage, self.address, err)
                continue
            self._last_pong = time.monotonic()  # any authenticated message shows the replica is alive
            if isinstance(message, P.Welcome):
                log.debug("replica %s/%s: connection authenticated", self.stage, self.address)
                if self.state is ReplicaState.CONNECTING:
                    self.reason = "its engine has not said it is ready yet"
                continue
            if isinstance(message, P.Pong):
                self._on_pong(message)
                continue
            if isinstance(message, P.Draining):
                self._on_draining(message.grace_s)
                continue
            sink = self._sinks.get(getattr(message, "id", ""))
            if sink is None:
                self._orphan(message)
                continue
            if isinstance(message, P.Failed) or (isinstance(message, P.Output) and message.finished):
                self.finish(message.id)
            try:
                sink(message, rest, None)
            except Exception:
                log.exception("replica %s/%s: handling %s failed", self.stage, self.address, message)

    def _orphan(self, message: P.Message) -> None:
        """A message for a work the router forgot (aborted): release the handles it carries."""
        if isinstance(message, P.Output) and message.handles:
            self.try_send(P.Release(handles=[i.handle for i in message.handles]))

    def _on_draining(self, grace_s: float | None) -> None:
        if not self.stage_draining:
            within = f", for up to {grace_s:g}s" if grace_s else ""
            log.info("stage %s replica %s is draining (%d work(s) of ours running%s): no new work goes there",
                     self.stage, self.address, self.outstanding, within)  # fmt: skip
            self.stage_draining = True
            # at once, not at the next tick: the count of requests that will still start there, which the
            # replica waits for, includes every one bound to its generation before this router heard
            self._ping()
        self.stage_draining = True

    def _on_pong(self, pong: P.Pong) -> None:
        if pong.draining:
            self._on_draining(None)
        else:  # a new process answers at the same address
            self.stage_draining = False
        now = time.monotonic()
        self._last_pong = now
        if pong.sent_at:
            self.rtt_s = max(0.0, now - pong.sent_at)
        self.voices = list(pong.voices)
        self.image_bounds = pong.image_bounds
        self.contract, self.generation = pong.contract, dict(pong.generation)
        if pong.ready and self.state is not ReplicaState.UP:
            log.info("stage %s replica %s is up", self.stage, self.address)
            self.state, self.reason = ReplicaState.UP, ""
            M.replica_up.labels(*self._labels).set(1)
        elif not pong.ready and self.state is ReplicaState.UP:
            # It was serving: its engine stopped (it failed, or a new one loads); not "still loading".
            self._mark(ReplicaState.CONNECTING, "it says it is not ready any more")
        elif not pong.ready and self.state is not ReplicaState.CONNECTING:
            self._mark(ReplicaState.CONNECTING, "its engine is loading")

    def _greet(self) -> None:
        """Open the connection's session with a `Hello` (a new session each time)."""
        self._channel = Channel(self._key, "router")
        try:
            self._send_frames(self._channel.seal(P.encode(P.Hello())))
        except ConnectionError:
            self._hello_at = None  # not connected yet: the next tick tries again
            return
        self._hello_at = time.monotonic()

    def _ping(self) -> None:
        awaited = self._awaited(self.contract) if self._awaited is not None else 0
        self.try_send(P.Ping(nonce=next(self._nonce), sent_at=time.monotonic(), awaited=awaited))

    async def _ping_loop(self) -> None:
        resumed = 0.0  # when this process last ran again after a stall
        while True:
            if self._channel.established:
                self._ping()
            elif self._hello_at is None or time.monotonic() - self._hello_at > HELLO_RETRY_S:
                if self._hello_at is not None:
                    self.reason = (
                        f"no authenticated answer to its hello for {HELLO_RETRY_S:.0f}s; does the stage hold "
                        "this pipeline's key?"
                    )
                self._greet()
            # Until it first answers, ping often: during a roll the old replica leaves discovery moments
            # after the new one joins, and the new one is only used once it has answered.
            unheard = self._last_pong == 0.0
            period = min(self.ping_interval_s, 0.02) if unheard else self.ping_interval_s
            asleep = time.monotonic()
            await asyncio.sleep(period)
            now = time.monotonic()
            if now - asleep > period + STALL_S:
                # This process did not run for a while (a loaded machine): no ping left meanwhile and the
                # replica's answers may be unread, so the stall does not count as the replica's silence.
                resumed = now
            silent = now - max(self._last_pong, resumed)
            if self.state is ReplicaState.UP and silent > self.ping_timeout_s:
                self._mark(ReplicaState.DOWN, f"it stopped answering pings ({silent:.1f}s without a pong)")

    async def _monitor_loop(self) -> None:
        while True:
            frames = await self._monitor.recv_multipart()
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_DISCONNECTED:  # the stage forgot that connection's session: a new one follows
                self._channel = Channel(self._key, "router")
                self._hello_at = None
            if event == zmq.EVENT_DISCONNECTED and self.state is not ReplicaState.DOWN:
                self._mark(ReplicaState.DOWN, "its connection was lost")
            elif event == zmq.EVENT_DISCONNECTED:
                self._lose("its connection was lost")

    def _mark(self, state: ReplicaState, reason: str) -> None:
        was = self.state
        self.state, self.reason = state, reason
        M.replica_up.labels(*self._labels).set(0)
        if was is ReplicaState.UP:
            log.warning("stage %s replica %s is %s: %s", self.stage, self.address, state.value, reason)
        self._lose(reason)

    def _lose(self, reason: str) -> None:
        sinks, self._sinks = self._sinks, {}
        self.outstanding = 0
        M.stage_outstanding.labels(*self._labels).set(0)
        for sink in sinks.values():
            try:
                sink(None, [], reason)
            except Exception:
                log.exception("replica %s/%s: notifying a lost work failed", self.stage, self.address)
