"""OmniStage status from what its Deployment and pods show. Pure: observed objects in, status out."""

from __future__ import annotations

import re
from typing import Any

from omni_operator.capacity import ACCELERATORS
from omni_operator.status.conditions import Condition
from omni_operator.status.reasons import Reason
from omni_runtime.stage.termination import Termination

__all__ = ["stage_conditions", "pod_problem", "selector_string"]

_INSUFFICIENT = re.compile(r"Insufficient ([\w.-]+/[\w-]+|[\w-]+)")


def selector_string(match_labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))


def pod_problem(pods: list[dict[str, Any]], stage: str) -> Condition | None:
    """The most telling reason the stage's pods cannot serve, as a Degraded condition, or None."""
    for pod in pods:
        status = pod.get("status", {})
        for cond in status.get("conditions", []):
            if (
                cond.get("type") == "PodScheduled"
                and cond.get("status") == "False"
                and cond.get("reason") == "Unschedulable"
            ):
                message = cond.get("message", "")
                # Missing: 'persistentvolumeclaim "x" not found'; unbound: 'unbound immediate PersistentVolumeClaims'.
                if "persistentvolumeclaim" in message.lower():
                    return Condition(
                        "Degraded",
                        "True",
                        Reason.MODEL_CACHE_MISSING,
                        f"stage {stage}: its model cache volume is not available (scheduler: "
                        f"{message}); create the PersistentVolumeClaim or fix "
                        f"spec.runtime.modelCache",
                    )
                missing = [r for r in _INSUFFICIENT.findall(message) if r in ACCELERATORS]
                if missing:
                    return Condition(
                        "Degraded",
                        "True",
                        Reason.INSUFFICIENT_ACCELERATOR,
                        f"stage {stage}: no node has enough free {missing[0]} for a replica "
                        f"(scheduler: {message}); add nodes with {missing[0]}, free some, "
                        f"or lower the stage's accelerator.count",
                    )
                return Condition(
                    "Degraded",
                    "True",
                    Reason.UNSCHEDULABLE,
                    f"stage {stage}: its pods cannot be placed (scheduler: {message}); check the "
                    f"stage's nodeSelector, tolerations, affinity and resources",
                )
        for cs in status.get("containerStatuses", []) + status.get("initContainerStatuses", []):
            told = _termination(cs)
            if told is not None:
                return Condition(
                    "Degraded",
                    "True",
                    told.reason,
                    f"stage {cs.get('name', stage)}: {told.message}",
                )
            waiting = (cs.get("state") or {}).get("waiting") or {}
            reason = waiting.get("reason", "")
            if reason == "CrashLoopBackOff":
                last = (cs.get("lastState") or {}).get("terminated") or {}
                detail = f"exit code {last.get('exitCode')}" if last else "no exit code"
                if last.get("message"):
                    detail += f": {last['message'][-300:]}"
                return Condition(
                    "Degraded",
                    "True",
                    Reason.CRASH_LOOP,
                    f"stage {stage}: container {cs.get('name')} keeps crashing "
                    f"({cs.get('restartCount', 0)} restarts, {detail}); read its logs with "
                    f"kubectl logs {pod['metadata']['name']} -c {cs.get('name')} --previous",
                )
            if reason in ("ImagePullBackOff", "ErrImagePull", "InvalidImageName"):
                return Condition(
                    "Degraded",
                    "True",
                    Reason.IMAGE_PULL,
                    f"stage {stage}: image {cs.get('image')} cannot be pulled ({reason}: "
                    f"{waiting.get('message', '')}); fix runtime.image or imagePullSecrets",
                )
            if reason in ("CreateContainerConfigError", "CreateContainerError"):
                return Condition(
                    "Degraded", "True", Reason.CONTAINER_CONFIG, f"stage {stage}: {waiting.get('message', reason)}"
                )
    return None


def _termination(cs: dict[str, Any]) -> Termination | None:
    """What a not-ready container said when it last exited, when it said it in our typed form."""
    if cs.get("ready"):
        return None  # it exited once, but serves now
    for state in (cs.get("state") or {}, cs.get("lastState") or {}):
        told = Termination.parse((state.get("terminated") or {}).get("message"))
        if told is not None:
            return told
    return None


def stage_conditions(
    stage: dict[str, Any],
    deployment: dict[str, Any] | None,
    pods: list[dict[str, Any]],
    *,
    problem: Condition | None = None,
    autoscaler_problem: Condition | None = None,
) -> tuple[dict[str, int], list[Condition]]:
    """(replica counts, [Ready, Progressing, Degraded]) for an OmniStage. `problem`: a Degraded condition
    found while applying (a name collision), which outranks what the pods say. `autoscaler_problem`: the
    stage's autoscaler cannot be made; the stage is Degraded, yet its pods serve (at their last count),
    so Ready still follows them."""
    name = stage["spec"]["stage"]
    desired = stage["spec"].get("replicas", 1)
    rollout = stage["spec"].get("rollout")
    if rollout is not None and rollout.get("waitingForCapacity") and deployment is None:
        message = (
            f"stage {name}: its new generation waits for free accelerators (its pipeline's status.rollout says "
            "how many it needs); none of its pods was made, and its older generation serves"
        )
        return {"replicas": 0, "readyReplicas": 0}, [
            Condition("Ready", "False", Reason.INSUFFICIENT_ACCELERATOR, message),
            Condition("Progressing", "False", Reason.INSUFFICIENT_ACCELERATOR, message),
            problem or autoscaler_problem or Condition("Degraded", "False", Reason.AS_EXPECTED),
        ]
    if rollout is not None and rollout.get("maxReplicas", desired) == 0 < desired:
        ds = (deployment or {}).get("status", {})
        counts = {"replicas": ds.get("replicas", 0), "readyReplicas": ds.get("readyReplicas", 0)}
        message = f"stage {name}: its new generation failed and was scaled to zero; its older generation serves"
        return counts, [
            Condition("Ready", "False", Reason.ROLLED_BACK, message),
            Condition("Progressing", "False", Reason.ROLLED_BACK, message),
            problem or autoscaler_problem or Condition("Degraded", "False", Reason.AS_EXPECTED),
        ]
    if rollout is not None:
        desired = min(desired, rollout.get("maxReplicas", desired))  # the surge its pipeline allows for now
    if problem is not None:
        ds = (deployment or {}).get("status", {})
        counts = {"replicas": ds.get("replicas", 0), "readyReplicas": ds.get("readyReplicas", 0)}
        return counts, [
            Condition("Ready", "False", problem.reason, f"stage {name}: {problem.message}"),
            Condition("Progressing", "False", Reason.STALLED, f"stage {name}: {problem.message}"),
            problem,
        ]
    if deployment is None:
        counts = {"replicas": 0, "readyReplicas": 0}
        return counts, [
            Condition("Ready", "False", Reason.CREATING, f"stage {name}: its Deployment is being created"),
            Condition("Progressing", "True", Reason.CREATING, f"stage {name}: creating the Deployment"),
            autoscaler_problem or Condition("Degraded", "False", Reason.AS_EXPECTED),
        ]
    ds = deployment.get("status", {})
    current = ds.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 0)
    replicas = ds.get("replicas", 0)
    updated = ds.get("updatedReplicas", 0)
    ready = ds.get("readyReplicas", 0)
    available = ds.get("availableReplicas", 0)
    counts = {"replicas": replicas, "readyReplicas": ready}
    # Ready only when every pod runs the current template: never while old pods still serve.
    rolled = current and updated == desired and replicas == desired
    is_ready = rolled and ready >= desired and available >= desired
    problem = pod_problem(pods, name)
    degraded = problem or autoscaler_problem or Condition("Degraded", "False", Reason.AS_EXPECTED)
    if is_ready:
        ready_cond = Condition(
            "Ready",
            "True",
            Reason.SCALED_TO_ZERO if desired == 0 else Reason.AVAILABLE,
            f"stage {name}: {ready}/{desired} replicas ready",
        )
        progressing = Condition("Progressing", "False", Reason.COMPLETE, f"stage {name}: rollout complete")
    else:
        why = Reason.ROLLING_OUT if not rolled else Reason.WAITING_FOR_REPLICAS
        ready_cond = Condition(
            "Ready", "False", why, f"stage {name}: {ready}/{desired} replicas ready, {updated} updated"
        )
        progressing = Condition(
            "Progressing",
            "True" if problem is None else "False",
            why if problem is None else Reason.STALLED,
            f"stage {name}: {updated}/{desired} replicas on the current spec, {ready} ready",
        )
    return counts, [ready_cond, progressing, degraded]
