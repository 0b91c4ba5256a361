"""Free accelerators in the cluster, for a rollout's surge. Pure: nodes and pods in, counts out.

A contract change brings a new generation up beside the old one (`rollout`). On a cluster whose accelerators
the old generation already holds, its pods would sit Pending; the pipeline says so before it creates them,
with what to change (`RolloutPhase.WAITING_FOR_CAPACITY`). The count is an upper bound of what the scheduler
can place: every schedulable, Ready node's allocatable accelerators less what the pods bound to it ask for.
Placement constraints (nodeSelector, taints, affinity) are the scheduler's to judge; a generation they keep
off every node fails as Unschedulable as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ACCELERATORS", "AcceleratorNeed", "FreeAccelerators", "free_accelerators", "pod_accelerator"]

ACCELERATORS = ("nvidia.com/gpu", "huawei.com/Ascend910", "amd.com/gpu")
"""The extended resources a stage's `accelerator.type` names."""

_DONE = ("Succeeded", "Failed")


@dataclass(frozen=True)
class AcceleratorNeed:
    """What one replica of a pod group asks for: `count` of `resource`."""

    resource: str
    count: int


@dataclass(frozen=True)
class FreeAccelerators:
    """One accelerator resource's free units per schedulable node."""

    resource: str
    per_node: Mapping[str, int]

    def replicas(self, count: int) -> int:
        """How many pods asking `count` units each fit, node by node."""
        return sum(free // count for free in self.per_node.values()) if count > 0 else 0

    def describe(self) -> str:
        """`node a: 2, node b: 0`, for a status message."""
        if not self.per_node:
            return f"no schedulable node has {self.resource}"
        return ", ".join(f"{node}: {free}" for node, free in sorted(self.per_node.items()))


def _units(value: Any) -> int:
    """An extended resource's quantity (a whole number; anything else counts 0)."""
    try:
        return int(str(value))
    except ValueError:
        return 0


def _asks(pod: Mapping[str, Any], resource: str) -> int:
    """Units of `resource` a pod holds on its node: its containers' requests (limits where no request, as
    extended resources must have them equal), or its largest init container's, whichever is more."""
    spec = pod.get("spec") or {}

    def of(container: Mapping[str, Any]) -> int:
        res = container.get("resources") or {}
        value = (res.get("requests") or {}).get(resource, (res.get("limits") or {}).get(resource, 0))
        return _units(value)

    main = sum(of(c) for c in spec.get("containers") or [])
    init = max((of(c) for c in spec.get("initContainers") or []), default=0)
    return max(main, init)


def _schedulable(node: Mapping[str, Any]) -> bool:
    if (node.get("spec") or {}).get("unschedulable"):
        return False
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def free_accelerators(
    nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]], resource: str
) -> FreeAccelerators:
    """`resource`'s free units on each schedulable, Ready node that has any: allocatable less what the pods
    bound there and not finished ask for."""
    held: dict[str, int] = {}
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        if node and (pod.get("status") or {}).get("phase") not in _DONE:
            held[node] = held.get(node, 0) + _asks(pod, resource)
    per_node = {}
    for node in nodes:
        allocatable = _units(((node.get("status") or {}).get("allocatable") or {}).get(resource, 0))
        name = (node.get("metadata") or {}).get("name", "")
        if allocatable and _schedulable(node):
            per_node[name] = max(0, allocatable - held.get(name, 0))
    return FreeAccelerators(resource=resource, per_node=per_node)


def pod_accelerator(pod_spec: Mapping[str, Any]) -> AcceleratorNeed | None:
    """The accelerator one pod of `pod_spec` asks for (the first of ACCELERATORS it names), or None."""
    for resource in ACCELERATORS:
        count = _asks({"spec": pod_spec}, resource)
        if count:
            return AcceleratorNeed(resource=resource, count=count)
    return None
