"""Every stage's replicas, kept in step with discovery: one ReplicaClient per address.

During a roll the old replica drains (it says so, or discovery drops it) while the new one may not be
known yet: the EndpointSlice update that lists it and the SIGTERM of the old pod race. `pick` then
waits a little for the new replica instead of failing the request.

A request runs in one generation of the pipeline (`choose_generation`). While it runs, the stages it has yet
to start are counted per stage digest (`reserve`, a `Reservation`); every replica's pings carry its count
(`Ping.awaited`), and a draining replica waits for them: when a rollout deletes the old generation, the
requests that started in it still find its replicas for their later stages (`pick` takes a draining one for
them). Should one be gone all the same (killed), a request goes on in a generation that agrees on every stage
it started (`continuation`), or fails with a retriable 503.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import zmq.asyncio

from omni_runtime.metrics import Router as M
from omni_runtime.router.balancer import ReplicaSet
from omni_runtime.router.client import ReplicaClient, ReplicaState
from omni_runtime.router.discovery import Discovery, make_discovery
from omni_runtime.router.errors import StageUnavailable
from omni_runtime.spec import ResolvedPipeline, StageDiscovery
from omni_runtime.spec.image_bounds import ImageSizeBounds
from omni_runtime.wire.auth import PipelineKey

__all__ = ["Generation", "Reservation", "StagePool"]

Generation = Mapping[str, str]
"""Stage -> the stage digest a request's works must run on (`spec.contract`); a generation of the pipeline.
Empty for replicas that report no contract (older stages), which then serve only with each other."""

log = logging.getLogger(__name__)

ROLL_WAIT_S = 10.0
"""How long `pick` waits for a usable replica while a stage is between replicas (one draining, or one
discovered and not answering yet), before the request fails with 503."""
ZERO_RETRY_AFTER_S = 10
"""Retry-After of a request that timed out waiting for a stage to scale up from zero (a replica loads)."""


class Reservation:
    """The stages one running request has yet to start, each with the digest its generation gives it, counted
    in the pool's `awaited` tally until the stage starts, the request moves, or it ends (`release`)."""

    def __init__(self, tally: Counter[tuple[str, str]], generation: Generation, stages: Iterable[str]) -> None:
        self._tally = tally
        self._waiting: dict[str, str] = {}
        self._add(generation, stages)

    def _add(self, generation: Generation, stages: Iterable[str]) -> None:
        for stage in stages:
            if stage in generation:  # a stage scaled to zero when the request started: no digest to wait on
                self._waiting[stage] = generation[stage]
                self._tally[stage, generation[stage]] += 1

    def _drop(self, stage: str) -> None:
        digest = self._waiting.pop(stage, None)
        if digest is not None:
            self._tally[stage, digest] -= 1
            if self._tally[stage, digest] <= 0:
                del self._tally[stage, digest]

    def started(self, stage: str) -> None:
        """The request's work on `stage` was sent: the stage waits on it no more."""
        self._drop(stage)

    def move(self, generation: Generation) -> None:
        """The request goes on in `generation`: the stages it has yet to start wait on its digests."""
        stages = list(self._waiting)
        self.release()
        self._add(generation, stages)

    def release(self) -> None:
        """The request ended: nothing waits on it."""
        for stage in list(self._waiting):
            self._drop(stage)


class StagePool:
    """Replica sets of all stages of a pipeline; `start()` begins discovery and connections."""

    def __init__(
        self,
        pipeline: ResolvedPipeline,
        *,
        key: PipelineKey,
        api_client: Any | None = None,
        discoveries: dict[str, Discovery] | None = None,
        ping_interval_s: float = 0.5,
        ping_timeout_s: float = 10.0,
        roll_wait_s: float = ROLL_WAIT_S,
    ) -> None:
        self.pipeline = pipeline
        self.roll_wait_s = roll_wait_s
        self.key = key
        self.sets: dict[str, ReplicaSet[ReplicaClient]] = {
            name: ReplicaSet(name) for name in pipeline.topology.stage_names()
        }
        self.ping_interval_s = ping_interval_s
        self.ping_timeout_s = ping_timeout_s
        self._discoveries = discoveries or {
            name: make_discovery(pipeline.discovery.get(name, StageDiscovery()), pipeline.namespace, api_client)
            for name in self.sets
        }
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task] = []
        self._reaper: asyncio.Task | None = None
        self._seen: dict[frozenset[tuple[str, str]], int] = {}
        """When each generation was first seen (a counter): new requests go to the newest complete one."""
        self._order = itertools.count()
        self._awaited: Counter[tuple[str, str]] = Counter()
        """(stage, digest) -> running requests that will still start work on a replica of that digest."""

    def __getitem__(self, stage: str) -> ReplicaSet[ReplicaClient]:
        return self.sets[stage]

    def clients(self) -> list[ReplicaClient]:
        return [c for s in self.sets.values() for c in s.replicas.values()]

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        for name, discovery in self._discoveries.items():
            self._tasks.append(
                asyncio.create_task(discovery.run(functools.partial(self._update, name)), name=f"disc-{name}")
            )
        self._reaper = asyncio.create_task(self._reap(), name="pool-reaper")

    async def stop(self) -> None:
        tasks = [*self._tasks, *([self._reaper] if self._reaper else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # the reaper too: it may be closing a replica
        await asyncio.gather(*(c.close() for c in self.clients()), return_exceptions=True)
        if self._ctx is not None:
            # Every client closed its sockets above; linger 0 and destroy so that a socket still open by some
            # other path cannot hang the router's shutdown in term() (it did, until the reaper's close was fixed).
            self._ctx.destroy(linger=0)

    def reserve(self, generation: Generation, stages: Iterable[str]) -> Reservation:
        """Count a request that runs `stages` in `generation` as awaited by each of those stages' replicas of
        its digests, until it starts there (`Reservation`)."""
        return Reservation(self._awaited, generation, stages)

    def awaited(self, stage: str, digest: str) -> int:
        """Running requests that will still start work on a replica of `stage` with `digest` (`Ping.awaited`)."""
        return self._awaited[stage, digest]

    def generation(self, stages: Iterable[str]) -> Generation | None:
        """The generation a new request over `stages` runs in: of those in which every stage has a usable
        replica (a stage scaled to zero with no replica at all counts: its first replica is awaited), the one
        seen first most recently; None when there is none. (A `continuation` of a request that started nothing.)"""
        return self.continuation({}, (), stages)

    def _generations(self, stages: list[str]) -> list[dict[str, str]]:
        found: dict[frozenset[tuple[str, str]], dict[str, str]] = {}
        for stage in stages:
            for client in self.sets[stage].usable():
                gen = {s: client.generation[s] for s in stages if s in client.generation}
                if client.contract and len(gen) != len(stages):
                    continue  # resolved with another topology: it names none of some stage here
                key = frozenset(gen.items())
                found.setdefault(key, gen)
                self._seen.setdefault(key, next(self._order))
        if not found:  # nothing usable reports anything: stages scaled to zero, or none ready yet
            self._seen.setdefault(frozenset(), next(self._order))
            return [{}]
        return list(found.values())

    def _has(self, stage: str, generation: Generation) -> bool:
        replicas = self.sets[stage]
        if stage in self.pipeline.scale_from_zero and not replicas.replicas:
            return True
        want = generation.get(stage, "")
        return any(c.contract == want for c in replicas.usable())

    async def choose_generation(self, stages: Iterable[str]) -> Generation:
        """`generation(stages)`, waiting up to `roll_wait_s` while some stage is between replicas; then
        StageUnavailable naming the generations seen and the stages each lacks."""
        wanted = list(stages)
        deadline: float | None = None
        while True:
            found = self.generation(wanted)
            if found is not None:
                return found
            now = asyncio.get_running_loop().time()
            deadline = deadline if deadline is not None else now + self.roll_wait_s
            if now >= deadline or not any(self._between_replicas(s) for s in wanted):
                break
            await asyncio.sleep(0.02)
        for stage in wanted:
            self.sets[stage].pick()  # a stage with no usable replica at all: its own message says why
        seen = [f"{dict(g)} lacks {[s for s in wanted if not self._has(s, g)]}" for g in self._generations(wanted)]
        raise StageUnavailable(
            "no generation of the pipeline has a ready replica of every stage this request needs (a rollout "
            f"is under way, or it stopped half way): {'; '.join(seen)}. Retry shortly; a request never runs "
            "across two generations"
        )

    def continuation(
        self, generation: Generation, started: Collection[str], stages: Iterable[str]
    ) -> Generation | None:
        """Where a request of `generation` goes on when a stage it has not started has no usable replica of
        it any more (a rollout deleted the old generation's last replica while the request ran its first
        stages): of the complete generations that give every `started` stage the digest `generation` gives,
        the one seen first most recently; None when there is none.

        Coherent by the contract's construction (`spec.contract`): a stage's digest covers its own spec and
        every edge into or out of it, and a reader's covers the own spec of each stage it reads, so a started
        stage whose digest is unchanged sends what the other generation's readers expect, and reads what its
        writers send."""
        wanted = list(stages)
        fits = [
            g
            for g in self._generations(wanted)
            if all(g.get(s, "") == generation.get(s, "") for s in started)
            and all(self._has(s, g) for s in wanted if s not in started)
        ]
        if not fits:
            return None
        return max(fits, key=lambda g: self._seen[frozenset(g.items())])

    async def pick(
        self,
        stage: str,
        generation: Generation | None = None,
        *,
        started: Collection[str] = (),
        stages: Collection[str] = (),
    ) -> tuple[ReplicaClient, Generation | None]:
        """A usable replica of `stage` for new work (least outstanding first), of `generation` when given
        and it names the stage (a stage scaled to zero when the request started may be named by none), and
        the generation the request runs in from now on.

        When `generation` has no usable replica of `stage`, a request that has `started` some of its `stages`
        takes a draining replica of its generation still answering (it waits for the request: `Ping.awaited`),
        or else goes on in another generation that agrees with it on every started stage (`continuation`).
        While none of those has one but the stage is between replicas (one draining, or one just discovered and
        not answering yet), waits up to `roll_wait_s`; otherwise, or after that, raises StageUnavailable
        describing every replica."""
        replicas = self.sets[stage]

        def of(gen: Generation | None) -> Callable[[ReplicaClient], bool]:
            want = None if gen is None else gen.get(stage)  # a stage it does not name: any replica
            return lambda client: want is None or client.contract == want

        if stage in self.pipeline.scale_from_zero and not replicas.replicas:
            return await self._pick_after_zero(stage, of(generation)), generation
        deadline: float | None = None
        while True:
            try:
                return replicas.pick(where=of(generation)), generation
            except StageUnavailable:
                finishing = [c for c in replicas.replicas.values() if c.finishing and of(generation)(c)]
                if started and finishing:  # in flight: its generation's draining replica waits for it
                    return min(finishing, key=lambda c: (c.outstanding, c.address)), generation
                moved = None if generation is None or not stages else self.continuation(generation, started, stages)
                if moved is not None and moved != generation:
                    log.info(
                        "stage %s has no usable replica of the request's generation %s: it goes on in %s, "
                        "which agrees on the stages it started (%s)",
                        stage, dict(generation or {}), dict(moved), sorted(started),
                    )  # fmt: skip
                    generation = moved
                    continue
                now = asyncio.get_running_loop().time()
                deadline = deadline if deadline is not None else now + self.roll_wait_s
                if now >= deadline or not self._between_replicas(stage):
                    raise
            await asyncio.sleep(0.02)

    async def _pick_after_zero(self, stage: str, ours: Callable[[ReplicaClient], bool]) -> ReplicaClient:
        """A replica of a stage scaled to zero, once its autoscaler has started one. The wait is counted in
        omnikube_stage_requests_waiting_for_replica (KEDA activates the stage on it) and ends half a second
        before the request timeout, so the client gets a retriable 503 rather than a 504."""
        replicas = self.sets[stage]
        hold_s = max(0.1, self.pipeline.limits.request_timeout_s - 0.5)
        waiting = M.waiting_for_replica.labels(self.pipeline.name, stage)
        waiting.inc()
        try:
            async with asyncio.timeout(hold_s):
                while True:
                    try:
                        return replicas.pick(where=ours)
                    except StageUnavailable:
                        await asyncio.sleep(0.05)
        except TimeoutError:
            raise StageUnavailable(
                f"stage {stage} is scaled to zero and no replica became ready within {hold_s:g}s (the request "
                "timeout, router limit request_timeout_s); its autoscaler is starting one: retry, or raise "
                "the stage's autoscaling.minReplicas to 1 to keep one warm",
                retry_after=ZERO_RETRY_AFTER_S,
            ) from None
        finally:
            waiting.dec()

    def _between_replicas(self, stage: str) -> bool:
        for client in self.sets[stage].replicas.values():
            if client.draining or client.stage_draining:
                return True
            if client.state is ReplicaState.CONNECTING and not client.answered:
                return True
        return False

    def ready(self) -> dict[str, int]:
        """Usable replicas per stage."""
        return {name: len(s.usable()) for name, s in self.sets.items()}

    def serving(self) -> bool:
        """Whether requests can be served: every stage has a usable replica, or may be scaled to zero
        (its requests then wait for the autoscaler) and has no replica at all."""
        return all(
            n or (stage in self.pipeline.scale_from_zero and not self.sets[stage].replicas)
            for stage, n in self.ready().items()
        )

    def voices(self) -> dict[str, list[str]]:
        """The speakers each speech stage's usable replicas know (stages that report none are left out)."""
        out: dict[str, list[str]] = {}
        for name, replica_set in self.sets.items():
            names: dict[str, None] = {}
            for client in replica_set.usable():
                names.update(dict.fromkeys(getattr(client, "voices", [])))
            if names:
                out[name] = sorted(names)
        return out

    def image_bounds(self, stage: str) -> ImageSizeBounds | None:
        """The image sizes `stage`'s usable replicas say they draw (the tightest when they differ, as during a
        rollout); None when none says."""
        found = [c.image_bounds for c in self.sets[stage].usable() if c.image_bounds is not None]
        if not found:
            return None
        return ImageSizeBounds(max_side=min(b.max_side for b in found), multiple=max(b.multiple for b in found))

    async def wait_ready(self, timeout_s: float) -> None:
        """Until every stage has a usable replica (TimeoutError otherwise)."""
        async with asyncio.timeout(timeout_s):
            while not all(self.ready().values()):
                await asyncio.sleep(0.1)

    def _update(self, stage: str, addresses: set[str]) -> None:
        assert self._ctx is not None
        replicas = self.sets[stage].replicas
        for address in addresses - set(replicas):
            client = ReplicaClient(
                self._ctx, self.pipeline.name, stage, address, key=self.key,
                ping_interval_s=self.ping_interval_s, ping_timeout_s=self.ping_timeout_s,
                awaited=functools.partial(self.awaited, stage),
            )  # fmt: skip
            client.start()
            replicas[address] = client
            log.info("stage %s: replica %s added", stage, address)
        for address in set(replicas) - addresses:
            client = replicas[address]
            client.draining = True
            log.info("stage %s: replica %s removed by discovery; draining", stage, address)
        for address in addresses:
            replicas[address].draining = False

    async def _reap(self) -> None:
        """Close draining replicas once no work of ours runs there and no running request of their generation
        will still start there."""
        while True:
            await asyncio.sleep(1.0)
            for stage, replica_set in self.sets.items():
                for address, client in list(replica_set.replicas.items()):
                    if client.draining and client.outstanding == 0 and not self.awaited(stage, client.contract):
                        del replica_set.replicas[address]
                        await client.close()
