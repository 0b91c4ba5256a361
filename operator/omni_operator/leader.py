"""Leader election on a coordination.k8s.io Lease: of several operator replicas, one acts.

The holder renews the Lease every `renew_every` seconds; others take it over once it has not been
renewed for `duration` seconds. The optimistic concurrency of the apiserver (resourceVersion) makes the
takeover safe: of two replicas updating the same Lease version, one fails and stays a follower.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Awaitable, Callable

from omni_operator.kube import KubeClient, KubeError

__all__ = ["LeaderElector"]

log = logging.getLogger(__name__)

LEASE_API = "coordination.k8s.io/v1"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _fmt(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(s: str) -> dt.datetime:
    return dt.datetime.strptime(s, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.timezone.utc)


class LeaderElector:
    """Runs `on_started` when this replica becomes leader and `on_stopped` when it stops being one."""

    def __init__(
        self,
        kube: KubeClient,
        *,
        namespace: str,
        name: str,
        identity: str,
        on_started: Callable[[], Awaitable[None]],
        on_stopped: Callable[[], Awaitable[None]],
        duration: float = 15.0,
        renew_every: float = 5.0,
    ) -> None:
        self.kube, self.namespace, self.name, self.identity = kube, namespace, name, identity
        self.on_started, self.on_stopped = on_started, on_stopped
        self.duration, self.renew_every = duration, renew_every
        self.leading = False
        self._waiting_for: str | None = None
        """The holder this replica last said it waits for (said once per holder, not every round)."""

    async def run(self) -> None:
        try:
            while True:
                try:
                    acquired = await self._try_acquire_or_renew()
                except Exception as exc:  # never let the election loop die: keep trying
                    log.warning("lease %s/%s: %s", self.namespace, self.name, exc)
                    acquired = False
                if acquired and not self.leading:
                    log.info("became leader (lease %s/%s)", self.namespace, self.name)
                    try:
                        await self.on_started()
                        self.leading = True
                    except Exception as exc:  # e.g. the first listing met a 429 while caches warm up
                        log.warning("could not start leading (%s); trying again", exc)
                        await self.on_stopped()
                elif not acquired and self.leading:
                    self.leading = False
                    log.warning("lost leadership (lease %s/%s)", self.namespace, self.name)
                    await self.on_stopped()
                await asyncio.sleep(self.renew_every)
        finally:
            if self.leading:
                self.leading = False
                await self.on_stopped()
                await self._release()

    async def _try_acquire_or_renew(self) -> bool:
        now = _now()
        lease = await self.kube.get(LEASE_API, "Lease", self.name, self.namespace)
        spec = {"holderIdentity": self.identity, "leaseDurationSeconds": int(self.duration), "renewTime": _fmt(now)}
        if lease is None:
            await self.kube.create(
                {
                    "apiVersion": LEASE_API,
                    "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": {**spec, "acquireTime": _fmt(now), "leaseTransitions": 0},
                }
            )
            return True
        current = lease.get("spec", {})
        holder = current.get("holderIdentity")
        renewed = current.get("renewTime")
        expired = not renewed or (now - _parse(renewed)).total_seconds() > current.get(
            "leaseDurationSeconds", self.duration
        )
        if holder not in (self.identity, None, "") and not expired:
            if holder != self._waiting_for:
                self._waiting_for = holder
                log.info(
                    "lease %s/%s is held by %s: waiting; this replica leads once it is released or not renewed for %ss",
                    self.namespace,
                    self.name,
                    holder,
                    current.get("leaseDurationSeconds", self.duration),
                )
            return False
        self._waiting_for = None
        if holder != self.identity:
            spec["acquireTime"] = _fmt(now)
            spec["leaseTransitions"] = current.get("leaseTransitions", 0) + 1
        body = {"metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]}, "spec": spec}
        try:
            await self.kube.merge_patch(LEASE_API, "Lease", self.name, self.namespace, body)
        except KubeError as exc:
            if exc.status == 409:  # another replica won this round
                return False
            raise
        return True

    async def _release(self) -> None:
        try:
            lease = await self.kube.get(LEASE_API, "Lease", self.name, self.namespace)
            if lease and lease.get("spec", {}).get("holderIdentity") == self.identity:
                await self.kube.merge_patch(
                    LEASE_API, "Lease", self.name, self.namespace, {"spec": {"holderIdentity": "", "renewTime": None}}
                )
        except (KubeError, OSError) as exc:
            log.warning("could not release lease: %s", exc)
