"""Pod status as a pure function of what the runner knows, shaped as the kubelet writes it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["PodFacts", "build_status", "pod_phase"]

OWN_CONDITIONS = ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready", "PodScheduled")


@dataclass
class PodFacts:
    host_ip: str
    pod_ip: str = ""
    start_time: str = ""
    sandbox_ready: bool = False
    initialized: bool = False
    phase: str = "Pending"
    init_statuses: list[dict] = field(default_factory=list)
    container_statuses: list[dict] = field(default_factory=list)
    message: str = ""
    reason: str = ""


def pod_phase(*, init_failed: bool, initialized: bool, containers: list[dict], done: list[bool]) -> str:
    """The kubelet's phase: Pending until a container has run, Running while any runs or will restart,
    then Succeeded when every container exited 0, else Failed."""
    if init_failed:
        return "Failed"
    if not initialized:
        return "Pending"
    if containers and all(done):
        codes = [c["state"].get("terminated", {}).get("exitCode", 1) for c in containers]
        return "Succeeded" if all(code == 0 for code in codes) else "Failed"
    if any("running" in c["state"] or c.get("restartCount", 0) > 0 or c.get("lastState") for c in containers):
        return "Running"
    return "Pending"


def _condition(old: dict[str, dict], kind: str, ok: bool, now: str, reason: str = "") -> dict[str, Any]:
    status = "True" if ok else "False"
    previous = old.get(kind)
    since = (
        previous["lastTransitionTime"]
        if previous and previous.get("status") == status and previous.get("lastTransitionTime")
        else now
    )
    cond: dict[str, Any] = {"type": kind, "status": status, "lastTransitionTime": since}
    if reason and not ok:
        cond["reason"] = reason
    return cond


def build_status(pod: dict, facts: PodFacts, now: str) -> dict[str, Any]:
    spec, current = pod.get("spec", {}), pod.get("status") or {}
    old = {c["type"]: c for c in current.get("conditions") or []}
    containers = facts.container_statuses
    terminal = facts.phase in ("Succeeded", "Failed")
    containers_ready = bool(containers) and all(c["ready"] for c in containers) and not terminal
    gates = [g["conditionType"] for g in spec.get("readinessGates") or []]
    gates_ok = all(old.get(g, {}).get("status") == "True" for g in gates)
    not_ready_reason = "PodCompleted" if terminal else "ContainersNotReady"
    conditions = [
        _condition(old, "PodReadyToStartContainers", facts.sandbox_ready and not terminal, now),
        _condition(old, "Initialized", facts.initialized, now, "ContainersNotInitialized"),
        _condition(old, "ContainersReady", containers_ready, now, not_ready_reason),
        _condition(
            old,
            "Ready",
            containers_ready and gates_ok,
            now,
            not_ready_reason if not containers_ready else "ReadinessGatesNotReady",
        ),
        old.get("PodScheduled") or _condition(old, "PodScheduled", True, now),
    ]
    conditions += [c for kind, c in old.items() if kind not in OWN_CONDITIONS]
    status: dict[str, Any] = {
        "phase": facts.phase,
        "conditions": conditions,
        "hostIP": facts.host_ip,
        "hostIPs": [{"ip": facts.host_ip}],
        "containerStatuses": containers,
    }
    if facts.pod_ip:
        status["podIP"] = facts.pod_ip
        status["podIPs"] = [{"ip": facts.pod_ip}]
    if facts.start_time:
        status["startTime"] = facts.start_time
    if facts.init_statuses:
        status["initContainerStatuses"] = facts.init_statuses
    if facts.message:
        status["message"] = facts.message
    if facts.reason:
        status["reason"] = facts.reason
    return status
