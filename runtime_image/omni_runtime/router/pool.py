"""Every stage's replicas, kept in step with discovery: one ReplicaClient per address.

During a roll the old replica drains (it says so, or discovery drops it) while the new one may not be
known yet: the EndpointSlice update that lists it and the SIGTERM of the old pod race. `pick` then
waits a little for the new replica instead of failing the request.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import Callable, Iterable, Mapping
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

__all__ = ["Generation", "StagePool"]

Generation = Mapping[str, str]
"""Stage -> the stage digest a request's works must run on (`spec.contract`); a generation of the pipeline.
Empty for replicas that report no contract (older stages), which then serve only with each other."""

log = logging.getLogger(__name__)

ROLL_WAIT_S = 10.0
"""How long `pick` waits for a usable replica while a stage is between replicas (one draining, or one
discovered and not answering yet), before the request fails with 503."""
ZERO_RETRY_AFTER_S = 10
"""Retry-After of a request that timed out waiting for a stage to scale up from zero (a replica loads)."""


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

    def generation(self, stages: Iterable[str]) -> Generation | None:
        """The generation a new request over `stages` runs in: of those in which every stage has a usable
        replica (a stage scaled to zero with no replica at all counts: its first replica is awaited), the one
        seen first most recently; None when there is none."""
        wanted = list(stages)
        complete = []
        for candidate in self._generations(wanted):
            if all(self._has(stage, candidate) for stage in wanted):
                complete.append(candidate)
        if not complete:
            return None
        return max(complete, key=lambda g: self._seen[frozenset(g.items())])

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

    async def pick(self, stage: str, generation: Generation | None = None) -> ReplicaClient:
        """A usable replica of `stage` for new work (least outstanding first), of `generation` when given
        and it names the stage (a stage scaled to zero when the request started may be named by none).

        While none is usable but the stage is between replicas (one draining, or one just discovered
        and not answering yet), waits up to `roll_wait_s` for one; otherwise, or after that, raises
        StageUnavailable describing every replica."""
        replicas = self.sets[stage]
        want = None if generation is None else generation.get(stage)  # a stage it does not name: any replica

        def ours(client: ReplicaClient) -> bool:
            return want is None or client.contract == want

        if stage in self.pipeline.scale_from_zero and not replicas.replicas:
            return await self._pick_after_zero(stage, ours)
        deadline: float | None = None
        while True:
            try:
                return replicas.pick(where=ours)
            except StageUnavailable:
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
        """Close draining replicas once no work of ours runs there."""
        while True:
            await asyncio.sleep(1.0)
            for replica_set in self.sets.values():
                for address, client in list(replica_set.replicas.items()):
                    if client.draining and client.outstanding == 0:
                        del replica_set.replicas[address]
                        await client.close()
