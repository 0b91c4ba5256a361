"""The pipeline's rollout of a contract change, planned from what its OmniStages report. Pure.

Each pod group (an OmniStage) runs one Deployment per generation: one per contract digest of the group
(`builders.pipeline_objects.group_contract`). A change to a group's contract makes a new one beside the old;
a change elsewhere leaves the group's pods alone, so they serve both generations. The pipeline decides, each
reconcile, what every group does with its older generations (`StageRollout`):

- **Surging**: some group still runs an older generation and its new one is not ready: older ones keep
  serving (the router keeps every new request on the complete generation, `router.pool`), the new one runs
  at most `rollout.maxSurge` replicas.
- **whole**: every group's new generation has its surge replicas ready: the pipeline stops holding the older
  ones, each group drains them (the stage processes finish their in-flight work on SIGTERM) and scales the
  new one to its full count; then **Complete**.
- **RolledBack / Failed**: a group's new generation failed (a pod problem the stage reports as Degraded, or
  `progressDeadlineSeconds` passed since its Deployment was made): older generations keep all traffic; with
  `autoRollback` the new one goes to zero replicas. It stays so until the spec changes again (the status
  remembers the failed target).
- **StopTheWorld**: `maxSurge` 0: older generations go at once and the new one starts at full count.
- **WaitingForCapacity**: before a group's new generation has a Deployment, the cluster has too few free
  accelerators for its surge (`capacity`): none of its pods is made, older generations serve, the status
  says what it needs and what to change, and the pipeline looks again every CAPACITY_RECHECK_S.

Nothing here is stored outside the pipeline's status: no annotations, no finalizers.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from omni_operator.api.rollout import (
    GenerationStatus,
    Rollout,
    RolloutPhase,
    RolloutStatus,
    StageRollout,
    surge_replicas,
)
from omni_operator.capacity import AcceleratorNeed, FreeAccelerators
from omni_operator.status.conditions import Condition, get_condition
from omni_operator.status.reasons import Reason, reason_of

__all__ = ["CAPACITY_RECHECK_S", "GroupView", "RolloutPlan", "plan_rollout"]

CAPACITY_RECHECK_S = 30.0
"""How often a rollout waiting for free accelerators looks again (nodes and other namespaces' pods are not
watched)."""


@dataclass
class GroupView:
    """One pod group as the pipeline sees it: the contract its spec wants and what its OmniStage reports."""

    stage: str
    """The group's root stage (its OmniStage)."""
    target: str
    """The group's contract digest under the pipeline's current spec."""
    replicas: int
    """The group's wanted replicas: the live OmniStage's spec.replicas (an autoscaler may have set it)."""
    generations: list[GenerationStatus] = field(default_factory=list)
    """Its generations as its OmniStage last reported them."""
    degraded: dict[str, str] | None = None
    """Its OmniStage's Degraded condition when True (it is about its current generation's pods)."""
    need: AcceleratorNeed | None = None
    """The accelerator one replica of the group asks for; None: none."""
    free: FreeAccelerators | None = None
    """That accelerator's free units in the cluster, where counted (a new generation not made yet)."""

    @property
    def older(self) -> list[GenerationStatus]:
        return [g for g in self.generations if g.contract != self.target]

    @property
    def new(self) -> GenerationStatus | None:
        return next((g for g in self.generations if g.contract == self.target), None)


@dataclass
class RolloutPlan:
    """What the pipeline tells its groups, and what its status says."""

    stages: dict[str, StageRollout]
    """By root stage; a group not named keeps no older generation and runs its full count."""
    status: RolloutStatus
    problem: Condition | None = None
    """Degraded, reason RolloutFailed, when the new generation failed."""
    recheck_seconds: float | None = None
    """When to look again though nothing changes: the progress deadline of a generation still coming up."""


def _created(generation: GenerationStatus) -> dt.datetime | None:
    try:
        return dt.datetime.fromisoformat(generation.created.replace("Z", "+00:00"))
    except ValueError:
        return None


def plan_rollout(
    groups: list[GroupView],
    settings: Rollout,
    *,
    target: str,
    previous: RolloutStatus | None,
    serving_before: str,
    now: dt.datetime,
) -> RolloutPlan:
    """The plan for this reconcile. `target`: the pipeline's contract digest under its spec; `previous`: the
    rollout status written last time (None before the first); `serving_before`: the contract that served
    before, where `previous` does not say (the status.contract of a pipeline made before rollouts existed)."""
    changing = [g for g in groups if g.older]
    serving = previous.serving if previous is not None and previous.serving else serving_before
    if not changing:
        return RolloutPlan(stages={}, status=RolloutStatus(phase=RolloutPhase.COMPLETE, serving=target, target=target))
    surge = {g.stage: surge_replicas(settings.max_surge, g.replicas) for g in changing}
    # What must be ready before the older generations go: the surge (never more than the replicas), or with
    # no surge at all (stop the world) the full count.
    needed = {g.stage: surge[g.stage] or g.replicas for g in changing}

    def ready(g: GroupView) -> bool:
        new = g.new
        return needed[g.stage] == 0 or (new is not None and new.ready_replicas >= needed[g.stage])

    moving = [g.stage for g in changing if not ready(g)]
    status = RolloutStatus(phase=RolloutPhase.SURGING, serving=serving, target=target, moving=moving)
    if settings.max_surge in (0, "0%"):
        # Stop the world: nothing to keep, so older generations go now and the new one starts at full count.
        status.phase = RolloutPhase.STOP_THE_WORLD
        status.message = (
            f"maxSurge 0: stages {[g.stage for g in changing]} drain their old generation before the new one "
            f"({target}) starts; requests get 503 with Retry-After until it is ready"
        )
        return RolloutPlan(
            stages={g.stage: StageRollout(keep_older=False, max_replicas=g.replicas) for g in changing}, status=status
        )
    failure = _failure(changing, moving, settings, previous, target, now)
    if failure is not None and moving:
        stage, reason, cause = failure
        rolled_back = settings.auto_rollback
        status.phase = RolloutPhase.ROLLED_BACK if rolled_back else RolloutPhase.FAILED
        status.reason, status.moving = reason, [stage] + [s for s in moving if s != stage]
        status.cause = cause[:1536]
        then = (
            "its new generation was scaled to zero (rollout.autoRollback)"
            if rolled_back
            else "its new generation keeps its replicas (rollout.autoRollback is off)"
        )
        status.message = (
            f"the rollout to contract {target} failed: stage {stage}: {status.cause}. The generation of contract "
            f"{serving or '(before)'} keeps serving every request; {then}. Fix the cause and change the spec to "
            "try again, or revert the change"
        )[:2048]
        problem = Condition("Degraded", "True", Reason.ROLLOUT_FAILED, status.message)
        return RolloutPlan(
            stages={
                g.stage: StageRollout(keep_older=True, max_replicas=0 if rolled_back else surge[g.stage])
                for g in changing
            },
            status=status,
            problem=problem,
        )
    short = [g for g in changing if _short(g, surge[g.stage])]
    if short:
        return _waiting_for_capacity(changing, short, surge, status)
    if not moving:
        # Whole: every group drops its older generations and scales the new one to its full count.
        status.message = f"the generation of contract {target} is ready; older generations drain"
        return RolloutPlan(stages={}, status=status)
    status.message = (
        f"contract {serving or '(before)'} serves while the generation of {target} comes up beside it "
        f"(at most {settings.max_surge} per stage); stages still moving: {', '.join(moving)}"
    )
    return RolloutPlan(
        stages={g.stage: StageRollout(keep_older=True, max_replicas=surge[g.stage]) for g in changing},
        status=status,
        recheck_seconds=_until_deadline(changing, moving, settings, now),
    )


def _short(g: GroupView, surge: int) -> bool:
    """The group's new generation, not made yet, would not fit in the cluster's free accelerators."""
    if g.new is not None or g.need is None or g.free is None:
        return False
    return g.free.replicas(g.need.count) < surge


def _waiting_for_capacity(
    changing: list[GroupView], short: list[GroupView], surge: dict[str, int], status: RolloutStatus
) -> RolloutPlan:
    parts = []
    for g in short:
        assert g.need is not None and g.free is not None
        parts.append(
            f"stage {g.stage} needs {surge[g.stage]} replica(s) with {g.need.count} {g.need.resource} each beside "
            f"the generation serving, and the cluster has free {g.need.resource} for "
            f"{g.free.replicas(g.need.count)} (free per node: {g.free.describe()})"
        )
    status.phase = RolloutPhase.WAITING_FOR_CAPACITY
    status.reason = Reason.INSUFFICIENT_ACCELERATOR.value
    status.moving = [g.stage for g in short] + [s for s in status.moving if s not in {g.stage for g in short}]
    status.message = (
        f"the rollout to contract {status.target} waits: {'; '.join(parts)}. None of its pods was made; contract "
        f"{status.serving or '(before)'} keeps serving. Free or add accelerators (it goes on by itself), lower "
        "rollout.maxSurge, or set it to 0 to stop the world (the old generation drains first, then the new one "
        "starts; requests get 503 meanwhile)"
    )[:2048]
    waiting = {g.stage for g in short}
    return RolloutPlan(
        stages={
            g.stage: StageRollout(
                keep_older=True,
                max_replicas=0 if g.stage in waiting else surge[g.stage],
                waiting_for_capacity=g.stage in waiting,
            )
            for g in changing
        },
        status=status,
        problem=Condition("Degraded", "True", Reason.INSUFFICIENT_ACCELERATOR, status.message),
        recheck_seconds=CAPACITY_RECHECK_S,
    )


def _failure(
    changing: list[GroupView],
    moving: list[str],
    settings: Rollout,
    previous: RolloutStatus | None,
    target: str,
    now: dt.datetime,
) -> tuple[str, str, str] | None:
    """(stage, reason, cause) of the first failed group of the new generation, or None."""
    if (
        previous is not None
        and previous.target == target
        and previous.phase in (RolloutPhase.ROLLED_BACK, RolloutPhase.FAILED)
    ):
        # Sticky: a rolled-back generation has no pods left to show why; the spec must change to try again. The
        # cause as first told (not the message, which wraps it: wrapping again would grow it every reconcile).
        stage = (previous.moving or ["?"])[0]
        return stage, previous.reason or Reason.ROLLOUT_FAILED.value, previous.cause or previous.message
    for g in changing:
        if g.stage not in moving:
            continue
        if g.degraded is not None:
            reason = reason_of(g.degraded.get("reason")).value
            return g.stage, reason, f"{reason}: {g.degraded.get('message', '')}"
        new = g.new
        created = _created(new) if new is not None else None
        if created is not None and (now - created).total_seconds() > settings.progress_deadline_seconds:
            return (
                g.stage,
                "ProgressDeadlineExceeded",
                f"ProgressDeadlineExceeded: its new generation had {new.ready_replicas if new else 0} ready "
                f"replicas after rollout.progressDeadlineSeconds ({settings.progress_deadline_seconds} s); raise it "
                "if loading the model takes longer",
            )
    return None


def _until_deadline(changing: list[GroupView], moving: list[str], settings: Rollout, now: dt.datetime) -> float | None:
    waits = []
    for g in changing:
        new = g.new
        created = _created(new) if g.stage in moving and new is not None else None
        if created is not None:
            waits.append(settings.progress_deadline_seconds - (now - created).total_seconds() + 1)
    return max(1.0, min(waits)) if waits else None


def degraded_of(conditions: list[dict]) -> dict[str, str] | None:
    """A stage's Degraded condition when True."""
    cond = get_condition(conditions, "Degraded")
    return cond if cond and cond.get("status") == "True" else None
