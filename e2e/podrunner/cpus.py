"""Exclusive CPUs for containers of Guaranteed pods, as a kubelet with `--cpu-manager-policy=static` gives them.

A container of a pod whose QoS class is Guaranteed (every container has cpu and memory limits, and its
requests, where set, equal them) and whose CPU request is a whole number gets that many host CPUs of its
own: its process (and so everything it starts) runs with a CPU affinity of exactly those CPUs, and no other
container is given them. Every other container runs on the shared pool: the CPUs no container holds. The
assignment lasts as long as the container is known (restarts keep it); it is freed when the pod goes, or,
for an init container, when it has finished.

What differs from the kubelet, and why:
- the nodes of one runner share the host, so they share one pool (the kubelet has one per node); otherwise
  two pods on two runner nodes would be given the same host CPU;
- no CPU is reserved for the shared pool (the kubelet needs a `--reserved-cpus` set): the test machines have
  two cores, and two single-core replicas must both get one. When the shared pool is empty, shared
  containers run on every CPU of the pool (the kubelet would have refused the second exclusive assignment);
- when too few CPUs are free, the container runs on the shared pool with a warning event, where the kubelet
  would fail the pod's admission (several test sessions on one small machine must not fail each other's pods);
- containers already running on the shared pool keep the affinity they started with (the kubelet shrinks
  them when it hands CPUs out).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from podrunner.downward import parse_quantity

__all__ = ["CpuManager", "exclusive_cpus", "guaranteed"]


def _resources(container: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    resources = container.get("resources") or {}
    return resources.get("requests") or {}, resources.get("limits") or {}


def guaranteed(pod: dict[str, Any]) -> bool:
    """Whether the pod's QoS class is Guaranteed: every container (init ones included) has cpu and memory
    limits, and its cpu and memory requests, where given, equal them (Kubernetes defaults them to the limits)."""
    spec = pod.get("spec") or {}
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    for container in containers:
        requests, limits = _resources(container)
        for name in ("cpu", "memory"):
            if name not in limits:
                return False
            if name in requests and parse_quantity(requests[name]) != parse_quantity(limits[name]):
                return False
    return bool(containers)


def exclusive_cpus(pod: dict[str, Any], container: dict[str, Any]) -> int:
    """How many CPUs of its own the static policy gives `container` of `pod`: its CPU request when the pod
    is Guaranteed and that request is a whole number, else 0 (the container runs on the shared pool)."""
    if not guaranteed(pod):
        return 0
    requests, limits = _resources(container)
    cpu = parse_quantity(requests.get("cpu", limits["cpu"]))
    if cpu <= 0 or cpu != cpu.to_integral_value():
        return 0
    return int(cpu)


class CpuManager:
    """The host CPUs the runner hands out: exclusive sets by owner (pod uid, container name), and the
    shared pool of what is left."""

    def __init__(self, cpus: Iterable[int] | None = None) -> None:
        self.cpus = frozenset(os.sched_getaffinity(0) if cpus is None else cpus)
        self.assigned: dict[tuple[str, str], frozenset[int]] = {}

    def free(self) -> frozenset[int]:
        """The CPUs no container holds."""
        return self.cpus.difference(*self.assigned.values())

    def shared(self) -> frozenset[int]:
        """The shared pool: the free CPUs, or all of them when every CPU is held (see the module docstring)."""
        return self.free() or self.cpus

    def allocate(self, uid: str, container: str, count: int) -> frozenset[int] | None:
        """`count` free CPUs for the container, the same ones again on a restart; None when fewer are free.
        Lowest-numbered first, as the static policy takes whole cores in order on a machine without SMT."""
        key = (uid, container)
        if key in self.assigned:
            return self.assigned[key]
        free = sorted(self.free())
        if count > len(free):
            return None
        self.assigned[key] = frozenset(free[:count])
        return self.assigned[key]

    def release(self, uid: str, container: str | None = None) -> None:
        """Free one container's CPUs, or every container's of the pod when `container` is None."""
        for key in [k for k in self.assigned if k[0] == uid and (container is None or k[1] == container)]:
            del self.assigned[key]
