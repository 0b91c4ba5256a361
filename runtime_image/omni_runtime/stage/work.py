"""The life of one work on a stage replica: from its `Submit` to its last output, failure or abort.

A work gets its input handles, runs the edge's input processor and the engine (once for the whole input,
once per chunk of a windowed edge, or once fed chunk by chunk when the engine `streams_input`), sends
final outputs inline and downstream outputs as handles it `put`s, and releases every input handle it was
given, whatever happens. When it is aborted or fails, the engine run is aborted and the handles it created
that the router has not seen taken are released too. See wire/PROTOCOL.md ("Handles: who releases what").

`WorkRunner` holds no socket: the stage server hands it a `Send` and dispatches to it (`server.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from omni_runtime.connectors import ConnectorError, Handle
from omni_runtime.engines.base import Engine, EngineInput, EngineOutput, InvalidRequest, chunk_request_id
from omni_runtime.metrics import Stage as M
from omni_runtime.processors import ProcessorError
from omni_runtime.spec import CONTEXT_ONLY_PROCESSORS, ResolvedPipeline
from omni_runtime.stage.connectors import ConnectorSet
from omni_runtime.stage.inputs import owned, process_inputs
from omni_runtime.stage.outputs import client_fields, count_items, merge, summarize
from omni_runtime.wire import protocol as P
from omni_runtime.wire.audio import audio_seconds

__all__ = ["Outcome", "Send", "Work", "WorkRunner"]

log = logging.getLogger(__name__)


class Outcome(str, Enum):
    """How a work ended: decides its cleanup, and is the `status` label of `omnikube_stage_requests`."""

    OK = "ok"
    ABORTED = "aborted"
    """Its router aborted it, or this stage stopped it (`Work.stopped_because`)."""
    INVALID_REQUEST = "invalid_request"
    CONNECTOR_ERROR = "connector_error"
    ENGINE_ERROR = "engine_error"


class Send(Protocol):
    """Sends `message` (and its payload, if any) to the router connection `peer`; a gone router is no error."""

    async def __call__(self, peer: bytes, message: P.Message, payload: dict[str, Any] | None = None) -> None: ...


@dataclass(eq=False)
class Work:
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


class WorkRunner:
    """Runs the works of one stage replica (`works`, by work id) on its engine and connectors."""

    def __init__(
        self,
        pipeline: ResolvedPipeline,
        stage: str,
        *,
        connectors: ConnectorSet,
        engine: Callable[[], Engine | None],
        send: Send,
        labels: tuple[str, str, str],
    ) -> None:
        """`engine()`: the stage's engine once loaded (works are started only then); `send`: to a router
        connection; `labels`: the stage metrics' (pipeline, stage, replica)."""
        self.pipeline = pipeline
        self.spec = pipeline.topology.stage(stage)
        self.stage = stage
        self.connectors = connectors
        self._current_engine = engine
        self._send = send
        self._labels = labels
        self.works: dict[str, Work] = {}
        self.closers: set[asyncio.Task] = set()
        """Cleanups of works aborted before they started (see `_after_task`)."""

    @property
    def _engine(self) -> Engine:
        """The loaded engine; works are started only once it has loaded."""
        engine = self._current_engine()
        if engine is None:
            raise RuntimeError(f"stage {self.stage}: the engine is not loaded yet")
        return engine

    def start(self, work: Work, inline: dict[str, Any] | None) -> None:
        """Run `work` (its `Submit` accepted, `inline` its own payload) in a task of its own."""
        self.works[work.id] = work
        M.running.labels(*self._labels).set(len(self.works))
        self.count_handles()
        work.task = asyncio.create_task(self._run(work, inline), name=f"work-{work.id}")
        work.task.add_done_callback(lambda _task: self._after_task(work))

    # -- running a work ------------------------------------------------------------------------

    async def _run(self, work: Work, inline: dict[str, Any] | None) -> None:
        status = Outcome.OK
        try:
            await self._execute(work, inline)
        except asyncio.CancelledError:
            status = Outcome.ABORTED
        except InvalidRequest as err:
            status = Outcome.INVALID_REQUEST
            await self.fail(work, "invalid_request", str(err))
        except ConnectorError as err:
            status = Outcome.CONNECTOR_ERROR
            await self.fail(work, "connector_error", f"stage {self.stage}: {err}")
        except ProcessorError as err:
            status = Outcome.ENGINE_ERROR
            await self.fail(work, "engine_error", f"stage {self.stage}: {err}")
        except Exception as err:
            status = Outcome.ENGINE_ERROR
            log.exception("stage %s: work %s failed", self.stage, work.id)
            await self.fail(work, "engine_error", self.engine_failure_text(err))
        finally:
            # No abort may interrupt the cleanup: it runs shielded, to its end, whatever happens here.
            work.closing = True
            await asyncio.shield(self._close_work(work, status))

    def _after_task(self, work: Work) -> None:
        """Close a work whose task ended without running `_run`: a task cancelled before its first step
        never runs its body, `finally` included. That happens when an Abort is read right behind its
        Submit (both arrive in one burst and are dispatched before the new task gets a turn)."""
        if work.closing or self.works.get(work.id) is not work:
            return
        work.closing = True
        closer = asyncio.create_task(self._close_work(work, Outcome.ABORTED), name=f"close-{work.id}")
        self.closers.add(closer)
        closer.add_done_callback(self.closers.discard)

    async def _close_work(self, work: Work, status: Outcome) -> None:
        """Abort the engine and release created handles unless the work finished; then release every
        input handle it holds (chunks fed after it stopped reading included) and forget it. A work this
        stage stopped on its own is failed to its router first, which otherwise waits for it until its
        request times out."""
        if status is Outcome.ABORTED and work.stopped_because is not None:
            await self.fail(work, "unavailable", work.stopped_because)
        work.phase = "releasing"
        if status is not Outcome.OK:
            await self._abort_engine(work)
            await self.release_all(work.created)
            work.created.clear()
        await self.release_all(work.held)
        work.held.clear()
        while not work.feed.empty():
            feed = work.feed.get_nowait()
            await self.release_all([i.handle for i in feed.inputs])
        self.works.pop(work.id, None)
        M.running.labels(*self._labels).set(len(self.works))
        M.requests.labels(*self._labels, status.value).inc()
        M.latency.labels(*self._labels).observe(time.perf_counter() - work.started)
        self.count_handles()

    async def _execute(self, work: Work, inline: dict[str, Any] | None) -> None:
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

    async def _run_chunked(self, work: Work, inline, params, edges: _EdgeBuffers, acc: _FinalAcc) -> None:
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
            engine_id = work.id if not s.more_inputs else chunk_request_id(work.id, chunk_index)
            request = EngineInput(
                request_id=engine_id,
                data=data,
                params=chunk_params,
                role=s.role,
                companion_of=s.companion_of,
                group_size=s.group_size,
                context_only=s.context_only,
                think=s.think,
            )
            await self._engine_run(work, request, edges, acc, ends_work=is_last)
            work.phase = "outputs"
            if s.more_inputs:  # a chunk is done with once its engine run is; whole inputs at the end,
                await self._release_inputs(work, inputs)  # after their outputs are put (shm payloads are views)
            chunk_index += 1

    async def _run_streamed(self, work: Work, inline, params, edges: _EdgeBuffers, acc: _FinalAcc) -> None:
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

        request = EngineInput(
            request_id=work.id,
            data=data,
            params=dict(params),
            role=s.role,
            chunks=rest(),
            companion_of=s.companion_of,
            group_size=s.group_size,
            context_only=s.context_only,
            think=s.think,
        )
        await self._engine_run(work, request, edges, acc, ends_work=True)

    async def _take(self, work: Work, inline: dict[str, Any] | None, inputs: list[P.Input]) -> dict[str, Any]:
        """A chunk's engine input, owned (copied out of connector memory), its handles released."""
        data = owned(await self._prepare(work, inline, inputs))
        await self._release_inputs(work, inputs)
        return data

    async def _release_inputs(self, work: Work, inputs: list[P.Input]) -> None:
        """Release the handles of a chunk the work is done with, and stop holding them."""
        if not inputs:
            return
        done = [i.handle for i in inputs]
        await self.release_all(done)
        work.held = [h for h in work.held if h not in done]
        self.count_handles()

    async def _engine_run(
        self, work: Work, request: EngineInput, edges: _EdgeBuffers, acc: _FinalAcc, *, ends_work: bool
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

    def _count_audio(self, work: Work, data: dict[str, Any]) -> None:
        seconds = audio_seconds(data)
        if seconds:
            if not work.audio_seen:
                work.audio_seen = True
                M.ttfp.labels(*self._labels).observe(time.perf_counter() - work.started)
            M.audio_seconds.labels(*self._labels).inc(seconds)

    async def _chunks(self, work: Work):
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

    async def _prepare(self, work: Work, inline: dict[str, Any] | None, inputs: list[P.Input]) -> dict[str, Any]:
        s = work.submit
        if not inputs:
            return dict(inline or {})
        kv_edge = s.input_processor in CONTEXT_ONLY_PROCESSORS
        loaded = []
        for item in inputs:
            started = time.perf_counter()
            loaded.append((item, await self.connectors.get(item.handle)))
            if kv_edge:  # an AR stage's KV cache (one role): the hand-off's own bytes and seconds
                labels = (self.pipeline.name, self.stage, item.source)
                M.kv_seconds.labels(*labels).observe(time.perf_counter() - started)
                M.kv_bytes.labels(*labels).observe(item.handle.nbytes)
        data = process_inputs(
            s.input_processor,
            loaded,
            self.pipeline.topology,
            request_id=s.request_id,
            request=s.context,
            target=self.stage,
        )
        if inline:
            data = {**inline, **data}
        return data

    async def _put(self, work: Work, edge: P.EdgeOut, data: dict[str, Any], last: bool) -> None:
        key = f"{work.submit.request_id}.{work.submit.role}.{work.seq}"
        handle = await self.connectors.put(edge.connector, edge.target, key, data)
        work.created.append(handle)
        edge_labels = (self.pipeline.name, self.stage, edge.target, edge.connector)
        M.edge_chunks.labels(*edge_labels).inc()
        M.edge_bytes.labels(*edge_labels).inc(handle.nbytes)
        self.count_handles()
        item = P.Input(source=self.stage, role=work.submit.role, seq=work.seq, last=last, handle=handle)
        await self._send(work.peer, P.Output(id=work.id, seq=self._seq(work), handles=[item]))

    async def _send_final(self, work: Work, data: dict[str, Any]) -> None:
        await self._send(work.peer, P.Output(id=work.id, seq=self._seq(work), data=True), data)

    def _seq(self, work: Work) -> int:
        work.seq += 1
        return work.seq - 1

    # -- failing, aborting, releasing ----------------------------------------------------------

    def engine_failure_text(self, err: BaseException) -> str:
        """What the client reads when the engine raised `err` while running its work (or died under it)."""
        return f"stage {self.stage}: {type(err).__name__}: {err}"

    async def fail(self, work: Work, kind: P.ErrorKind, message: str) -> None:
        """Tell the work's router that it failed (once; later calls send nothing)."""
        if work.failure_sent:
            return
        work.failure_sent = True
        with contextlib.suppress(Exception):
            await self._send(work.peer, P.Failed(id=work.id, kind=kind, message=message))

    async def _abort_engine(self, work: Work) -> None:
        engine_id = work.running_engine_id
        engine = self._current_engine()
        if engine_id is not None and engine is not None:
            try:
                await asyncio.shield(engine.abort(engine_id))
            except Exception:
                log.exception("stage %s: engine abort of %s failed", self.stage, engine_id)

    async def release_all(self, handles: Sequence[Handle]) -> None:
        """Release each handle with its connector; a handle whose payload is gone already is only logged."""
        for handle in list(handles):
            try:
                await asyncio.shield(self.connectors.release(handle))
            except asyncio.CancelledError:
                raise
            except Exception as err:  # the payload's owner may be gone; nothing is left to free
                log.warning("stage %s: releasing %s handle %s failed: %s", self.stage,
                            handle.kind, handle.key, err)  # fmt: skip

    def count_handles(self) -> None:
        """Set the open-handles gauge: what the works hold and what they created."""
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
