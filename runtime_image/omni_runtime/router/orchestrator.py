"""Running one request over the stage DAG: submissions, handle forwarding, final outputs, cleanup.

`Orchestrator.run(request, emit)` drives one choice of one request to its end and calls `emit` with
every final output. Per request it keeps the works it started (one per stage and role), the handles
it holds for stages not started yet, and the handles it delivered. Whatever ends the run (success, a
stage failure, a lost replica, cancellation by a client disconnect or the timeout), its `finally`
aborts every work still running and asks the producer of every handle nobody took, or that went to a
replica that died, to release it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from omni_runtime.connectors import ReleasedBy
from omni_runtime.metrics import Router as M
from omni_runtime.router.client import ReplicaClient
from omni_runtime.router.contract_header import record_contracts
from omni_runtime.router.errors import BadRequest, StageLost, StageUnavailable, from_stage_failure
from omni_runtime.router.plan import PRIMARY, Plan, companion_inputs
from omni_runtime.router.pool import Generation, Reservation, StagePool
from omni_runtime.spec import ResolvedPipeline
from omni_runtime.wire import protocol as P

__all__ = ["Orchestrator", "PipelineRequest", "RunResult", "StageEvent"]

log = logging.getLogger(__name__)


@dataclass
class PipelineRequest:
    request_id: str
    plan: Plan
    entry: dict[str, dict[str, Any]]
    """Inline input of each entry stage's primary work, by stage ({"messages"} or {"prompt", ...})."""
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Request parameters per stage (merged over stage defaults by the stage)."""
    negative_prompt: str | None = None
    stream: bool = False
    choice: int = 0
    generation: Generation | None = None
    """The pipeline generation every work of this request runs in (`StagePool.choose_generation`); None: the
    run chooses one when it starts its first work."""


@dataclass
class StageEvent:
    """A final output piece for the client (`data` None on a bare finish)."""

    choice: int
    stage: str
    modality: str
    data: dict[str, Any] | None
    finished: bool = False
    finish_reason: str | None = None
    usage: dict[str, int] | None = None


@dataclass
class RunResult:
    usage: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per stage, the primary work's usage."""
    info: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per stage and role (`stage` or `stage/role`), what the stage reported it ran on."""
    contracts: dict[str, str] = field(default_factory=dict)
    """Per stage, the stage digest of the replica that ran its works (all of one generation)."""


@dataclass(eq=False)
class _Work:
    id: str
    stage: str
    role: str
    client: ReplicaClient
    final: bool
    done: bool = False
    lost: bool = False
    fed_last: bool = False
    delivered: list[tuple[P.Input, ReplicaClient]] = field(default_factory=list)


Emit = Callable[[StageEvent], Awaitable[None] | None]


class Orchestrator:
    def __init__(self, pipeline: ResolvedPipeline, pool: StagePool) -> None:
        self.pipeline = pipeline
        self.pool = pool

    async def run(self, request: PipelineRequest, emit: Emit) -> RunResult:
        return await _Run(self, request, emit).run()


class _Run:
    def __init__(self, orch: Orchestrator, request: PipelineRequest, emit: Emit) -> None:
        self.orch = orch
        self.req = request
        self.plan = request.plan
        self.emit = emit
        self.works: dict[str, dict[str, _Work]] = {}
        self.queue: asyncio.Queue = asyncio.Queue()
        self.pending: dict[str, list[tuple[P.Input, ReplicaClient]]] = {n: [] for n in self.plan.stages}
        self.result = RunResult()
        self.generation: Generation | None = request.generation
        self.reservation: Reservation | None = None
        """The stages this run has yet to start, awaited by their generation's replicas (`StagePool.reserve`)."""

    # -- main loop -----------------------------------------------------------------------------

    async def run(self) -> RunResult:
        try:
            if self.generation is not None:
                self.reservation = self.orch.pool.reserve(self.generation, self.plan.stages)
            for stage in self.plan.entry:
                await self._start_entry(stage)
            while not self._all_done():
                work, message, rest, lost = await self.queue.get()
                if lost is not None:
                    work.lost = True
                    raise StageLost(
                        f"stage {work.stage!r} replica {work.client.address} failed while running request "
                        f"{self.req.request_id}: {lost}; the request was stopped. Retry it: other replicas "
                        "take new requests"
                    )
                await self._on_message(work, message, rest)
            return self.result
        finally:
            self._cleanup()

    def _all_done(self) -> bool:
        if set(self.works) != set(self.plan.stages):
            return False
        return all(w.done for roles in self.works.values() for w in roles.values())

    async def _on_message(self, work: _Work, message: P.Message, rest: list[Any]) -> None:
        if isinstance(message, P.Failed):
            work.done = True
            raise from_stage_failure(message.kind, message.message)
        assert isinstance(message, P.Output)
        if message.info:
            key = work.stage if work.role == PRIMARY else f"{work.stage}/{work.role}"
            self.result.info[key] = dict(message.info)
        for i, item in enumerate(message.handles):
            try:
                await self._on_handle(work, item)
            except BaseException:  # the run ends here: the handles not looked at yet must not be lost
                self._release([(later, work.client) for later in message.handles[i + 1 :]])
                raise
        payload = P.payload_of(message, rest)
        if work.final and work.role == PRIMARY and (payload is not None or message.finished):
            event = StageEvent(
                choice=self.req.choice,
                stage=work.stage,
                modality=self.plan.stages[work.stage].modality.value,
                data=payload,
                finished=message.finished,
                finish_reason=message.finish_reason,
                usage=message.usage,
            )
            maybe = self.emit(event)
            if maybe is not None:
                await maybe
        if message.finished:
            work.done = True
            if work.role == PRIMARY and message.usage:
                self.result.usage[work.stage] = dict(message.usage)
            await self._after_finish(work)

    # -- starting works ------------------------------------------------------------------------

    async def _start_entry(self, stage: str) -> None:
        sp = self.plan.stages[stage]
        client = await self._pick(stage)
        entry = self.req.entry.get(stage, {})
        roles = {PRIMARY: entry}
        if len(sp.roles) > 1:
            roles.update(
                companion_inputs(self.orch.pipeline.topology, stage, entry, self.req.negative_prompt, sp.roles)
            )
        for role in sp.roles:
            self._submit(stage, role, client, inline=roles[role], inputs=[])

    async def _pick(self, stage: str) -> ReplicaClient:
        """A replica for new work, of the request's generation: never a draining one (it only finishes what it
        runs), never one whose payloads the request's other stages cannot read."""
        pool = self.orch.pool
        if self.generation is None:
            self.generation = await pool.choose_generation(self.plan.stages)
            self.reservation = pool.reserve(self.generation, self.plan.stages)
        # a generation that lost its last replica of `stage` mid-request hands the request to one that agrees
        # with it on every stage started (`StagePool.continuation`): the rest run there
        planned = self.generation
        client, self.generation = await pool.pick(
            stage, self.generation, started=set(self.works), stages=list(self.plan.stages)
        )
        if self.generation is not planned and self.generation is not None:
            record_contracts({s: self.generation.get(s, "") for s in self.plan.stages})
            if self.reservation is not None:
                self.reservation.move(self.generation)
        if self.reservation is not None:
            self.reservation.started(stage)
        self.result.contracts[stage] = client.contract
        return client

    def _work_id(self, stage: str, role: str) -> str:
        """The id of this request's work for `role` on `stage`: unique per router over time."""
        return f"{self.req.request_id}.{self.req.choice}.{stage}.{role}"

    def _submit(
        self,
        stage: str,
        role: str,
        client: ReplicaClient,
        *,
        inline: dict[str, Any] | None,
        inputs: list[tuple[P.Input, ReplicaClient]],
        more: bool = False,
    ) -> _Work:
        sp = self.plan.stages[stage]
        work_id = self._work_id(stage, role)
        work = _Work(id=work_id, stage=stage, role=role, client=client, final=sp.final and role == PRIMARY)
        self.works.setdefault(stage, {})[role] = work
        submit = P.Submit(
            id=work_id,
            request_id=self.req.request_id,
            stage=stage,
            role=role,
            data=inline is not None,
            inputs=[i for i, _ in inputs],
            input_processor=sp.input_processor,
            more_inputs=more,
            params=self.req.params.get(stage, {}),
            context={"negative_prompt": self.req.negative_prompt} if self.req.negative_prompt else {},
            final=work.final,
            stream=self.req.stream and work.final,
            edges=list(sp.edges),
            context_only=sp.context_only or sp.think,
            think=sp.think,
            companion_of=None if role == PRIMARY else self._work_id(stage, PRIMARY),
            # think mode's primary prefills after its reasoning: its companions do not wait to batch with it
            group_size=len(sp.roles) if inline is not None and not sp.think else 1,
            contract=(self.generation or {}).get(stage, ""),  # what it was planned for: a new process at the
            # replica's address (a pod IP reused by another generation) refuses it rather than misreading payloads
        )
        work.delivered.extend(inputs)
        try:
            client.submit(submit, inline, lambda m, r, lost: self.queue.put_nowait((work, m, r, lost)))
        except ConnectionError as err:
            work.lost = True
            work.done = True
            raise StageUnavailable(f"stage {stage!r}: {err}; retry shortly") from err
        except OverflowError as err:  # an unbounded integer from the request (seed, token id, kwargs...)
            work.done = True
            raise BadRequest(
                f"the request holds an integer the stages cannot take ({err}); integers must lie between "
                "-2**63 and 2**64-1; send a smaller number"
            ) from err
        return work

    # -- handles -------------------------------------------------------------------------------

    async def _on_handle(self, work: _Work, item: P.Input) -> None:
        target = item.handle.target
        sp = self.plan.stages.get(target)
        if sp is None:  # an edge this request does not use: nobody will read it
            self._release([(item, work.client)])
            return
        if sp.streamed_input:
            started = self.works.get(target, {}).get(PRIMARY)
            if started is None:
                try:
                    client = await self._pick(target)
                except StageUnavailable:  # keep the handle where cleanup finds it
                    self.pending[target].append((item, work.client))
                    self._transit(+1)
                    raise
                self._submit(target, PRIMARY, client, inline=None, inputs=[(item, work.client)], more=True)
            else:
                started.delivered.append((item, work.client))
                if not started.client.try_send(P.Feed(id=started.id, inputs=[item])):
                    started.lost = True
                    raise StageLost(f"stage {target!r} replica {started.client.address} cannot be reached")
        else:
            self.pending[target].append((item, work.client))
            self._transit(+1)

    async def _after_finish(self, work: _Work) -> None:
        """Start or close the downstream stages this work's end unblocks."""
        sp = self.plan.stages[work.stage]
        for edge in sp.edges:
            target = self.plan.stages[edge.target]
            if target.streamed_input:
                started = self.works.get(edge.target, {}).get(PRIMARY)
                if started is None:  # the producer sent no chunk: run the target on nothing
                    started = self._submit(
                        edge.target, PRIMARY, await self._pick(edge.target), inline=None, inputs=[], more=True
                    )
                if not started.fed_last:
                    started.fed_last = True
                    started.client.try_send(P.Feed(id=started.id, last=True))
                continue
            if edge.target in self.works:
                continue
            upstream_done = all(
                s in self.works and all(w.done for w in self.works[s].values()) for s in target.upstream
            )
            if upstream_done:
                client = await self._pick(edge.target)  # first: if none is usable, the handles stay pending
                inputs, self.pending[edge.target] = self.pending[edge.target], []
                self._transit(-len(inputs))
                self._submit(edge.target, PRIMARY, client, inline=None, inputs=inputs)

    def _transit(self, change: int) -> None:
        """Handles held by the router for stages not started yet (all requests together)."""
        if change:
            M.handles_in_transit.labels(self.orch.pipeline.name).inc(change)

    # -- cleanup -------------------------------------------------------------------------------

    def _cleanup(self) -> None:
        if self.reservation is not None:
            self.reservation.release()
        orphans = self._drain_queue()
        for roles in self.works.values():
            for work in roles.values():
                if not work.done and not work.lost:
                    if not work.client.try_send(P.Abort(id=work.id, reason="request ended")):
                        work.lost = True
                work.client.finish(work.id)
                if work.lost:  # its replica will not release what it was given
                    orphans.extend(work.delivered)
        for items in self.pending.values():
            orphans.extend(items)
            self._transit(-len(items))
            items.clear()
        if orphans:
            self._release(orphans)

    def _drain_queue(self) -> list[tuple[P.Input, ReplicaClient]]:
        """The handles of messages that arrived but were never handled: the run ended (cancelled, timed
        out, failed) with them still queued. Nobody else knows of them, and their producer forgot them
        once it sent them, so they are released here. A queued finish or failure marks its work done."""
        found: list[tuple[P.Input, ReplicaClient]] = []
        while not self.queue.empty():
            work, message, _rest, _lost = self.queue.get_nowait()
            if isinstance(message, P.Output):
                found.extend((item, work.client) for item in message.handles)
                work.done = work.done or message.finished
            elif isinstance(message, P.Failed):
                work.done = True
        return found

    def _release(self, items: list[tuple[P.Input, ReplicaClient]]) -> None:
        """Ask each handle's producer to release it; where the handle says any stage can (a Mooncake
        store or peer block), any live replica can when the producer is gone."""
        by_producer: dict[int, tuple[ReplicaClient, list]] = {}
        for item, producer in items:
            if item.handle.released_by is ReleasedBy.NOBODY:
                continue
            by_producer.setdefault(id(producer), (producer, []))[1].append(item.handle)
        for producer, handles in by_producer.values():
            if producer.try_send(P.Release(handles=handles)):
                continue
            movable = [h for h in handles if h.released_by is ReleasedBy.ANY_STAGE]
            if movable and any(c.usable and c.try_send(P.Release(handles=movable)) for c in self.orch.pool.clients()):
                handles = [h for h in handles if h.released_by is not ReleasedBy.ANY_STAGE]
            if handles:
                log.warning(
                    "request %s: %d handle(s) from stage %s could not be released: its replica %s is gone "
                    "(the launcher sweeps a dead process's shm segments)",
                    self.req.request_id,
                    len(handles),
                    producer.stage,
                    producer.address,
                )
