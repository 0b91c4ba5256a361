"""OmniPipeline status from its OmniStages and router Deployment. Pure."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from omni_operator.api import validation_messages
from omni_operator.api.rollout import RolloutPhase, RolloutStatus
from omni_operator.status.conditions import Condition, get_condition
from omni_operator.status.reasons import Reason, reason_of
from omni_runtime.spec import SpecError

__all__ = ["PipelineObservation", "pipeline_conditions", "spec_problem"]


class PipelineObservation:
    """What the pipeline reconcile saw: a spec, secret or name-collision problem, its stages and router."""

    def __init__(
        self,
        *,
        spec_problem: Condition | None = None,
        secret_problem: Condition | None = None,
        collision_problem: Condition | None = None,
        stages: list[dict[str, Any]] | None = None,
        stage_names: list[str] | None = None,
        groups: dict[str, str] | None = None,
        router: dict[str, Any] | None = None,
        rollout: RolloutStatus | None = None,
        rollout_problem: Condition | None = None,
    ) -> None:
        self.spec_problem = spec_problem
        self.secret_problem = secret_problem
        self.collision_problem = collision_problem
        """An object the operator would create exists and is someone else's (NameCollision)."""
        self.stages = stages or []
        self.stage_names = stage_names or []
        self.groups = groups or {}
        self.router = router
        self.rollout = rollout
        """The rollout of the last contract change (`rollout.plan_rollout`)."""
        self.rollout_problem = rollout_problem
        """Degraded RolloutFailed: the new generation failed; the old one serves."""


def spec_problem(exc: ValidationError | SpecError) -> Condition:
    """The Degraded condition of a spec that cannot run; the reason is the error's own type (a
    `SpecError` subclass carries it), never read from the message."""
    if isinstance(exc, ValidationError):
        return Condition("Degraded", "True", Reason.INVALID_SPEC, "; ".join(validation_messages(exc)))
    return Condition("Degraded", "True", exc.reason, str(exc))


def _stage_ready(stage: dict[str, Any]) -> bool:
    status = stage.get("status") or {}
    if status.get("observedGeneration") != stage["metadata"].get("generation"):
        return False  # the stage has not yet acted on its current spec
    cond = get_condition(status.get("conditions", []), "Ready")
    return bool(cond and cond.get("status") == "True")


def _group_ready(by_root: dict[str, dict[str, Any]], groups: dict[str, str], stage: str) -> bool:
    """Whether the OmniStage of the pod group that runs `stage` is ready."""
    group = by_root.get(groups.get(stage, stage))
    return group is not None and _stage_ready(group)


def _router_ready(router: dict[str, Any] | None) -> tuple[bool, str]:
    if router is None:
        return False, "router: its Deployment is being created"
    ds = router.get("status", {})
    want = router["spec"].get("replicas", 1)
    current = ds.get("observedGeneration", 0) >= router["metadata"].get("generation", 0)
    ok = (
        current
        and ds.get("updatedReplicas", 0) == want == ds.get("replicas", 0)
        and ds.get("availableReplicas", 0) >= want
    )
    return ok, f"router: {ds.get('availableReplicas', 0)}/{want} replicas available"


def pipeline_conditions(obs: PipelineObservation) -> tuple[list[dict[str, Any]], str, list[Condition]]:
    """(per-stage status, "ready/total", [Ready, Progressing, Degraded])."""
    by_root = {s["spec"]["stage"]: s for s in obs.stages}
    per_stage = []
    ready_count = 0
    for name in obs.stage_names:
        group = by_root.get(obs.groups.get(name, name))
        desired = group["spec"].get("replicas", 1) if group else 0
        ready = (group.get("status") or {}).get("readyReplicas", 0) if group else 0
        per_stage.append({"name": name, "replicas": desired, "readyReplicas": ready})
        ready_count += _group_ready(by_root, obs.groups, name)
    stages_ready = f"{ready_count}/{len(obs.stage_names)}"
    router_ok, router_msg = _router_ready(obs.router)

    stage_problems = []
    for stage in obs.stages:
        cond = get_condition((stage.get("status") or {}).get("conditions", []), "Degraded")
        if cond and cond.get("status") == "True":
            stage_problems.append(Condition("Degraded", "True", reason_of(cond.get("reason")), cond.get("message", "")))
    problem = (
        obs.spec_problem
        or obs.secret_problem
        or obs.collision_problem
        or obs.rollout_problem
        or (stage_problems[0] if stage_problems else None)
    )
    degraded = problem or Condition("Degraded", "False", Reason.AS_EXPECTED, "")
    all_ready = router_ok and obs.stage_names and ready_count == len(obs.stage_names)
    blocking = obs.spec_problem or obs.collision_problem  # what runs may be fine, but not what was asked for
    if all_ready and blocking is None:
        ready = Condition("Ready", "True", Reason.AVAILABLE, f"router and {stages_ready} stages ready")
        progressing = Condition("Progressing", "False", Reason.COMPLETE, "every stage runs the current spec")
    else:
        waiting = [name for name in obs.stage_names if not _group_ready(by_root, obs.groups, name)]
        parts = [f"stages not ready: {', '.join(waiting)}"] if waiting else []
        if not router_ok:
            parts.append(router_msg)
        message = "; ".join(parts) or (blocking.message if blocking else "")
        reason = blocking.reason if blocking and not parts else (problem.reason if problem else Reason.PROGRESSING)
        ready = Condition("Ready", "False", reason, message)
        progressing = Condition(
            "Progressing", "False" if problem else "True", Reason.STALLED if problem else Reason.ROLLING_OUT, message
        )
    rollout = obs.rollout
    if rollout is not None and rollout.phase in (RolloutPhase.ROLLED_BACK, RolloutPhase.FAILED):
        progressing = Condition("Progressing", "False", Reason.ROLLOUT_FAILED, rollout.message)
    elif rollout is not None and rollout.phase is RolloutPhase.WAITING_FOR_CAPACITY:
        progressing = Condition("Progressing", "False", Reason.INSUFFICIENT_ACCELERATOR, rollout.message)
    elif rollout is not None and rollout.phase is not RolloutPhase.COMPLETE and not obs.spec_problem:
        moving = f"; stages moving: {', '.join(rollout.moving)}" if rollout.moving else ""
        progressing = Condition(
            "Progressing",
            "True",
            Reason.ROLLING_OUT,
            f"{rollout.phase.value}: contract {rollout.serving or '(before)'} serves, rolling to {rollout.target}"
            f"{moving}. {rollout.message}",
        )
    return per_stage, stages_ready, [ready, progressing, degraded]
