"""How an OmniPipeline rolls a change to its contract, and what the pipeline tells each OmniStage meanwhile.

A change that changes what crosses an edge (`status.contract`) cannot roll stage by stage: a request could run
its thinker on the new checkpoint and its talker on the old one. Such a change brings up a new *generation* of
every stage whose contract changed beside the old one (at most `maxSurge` replicas each); the router keeps each
request within one generation and moves new requests to the new one once every stage of it has a ready replica;
then the old generation drains and goes. A change that leaves the contract alone rolls stage by stage.
"""

from __future__ import annotations

import math
import re
from enum import Enum
from typing import Annotated, Any

from pydantic import Field, PlainValidator, WithJsonSchema

from omni_operator.api.base import Bool, Int, KubeModel

__all__ = [
    "DEFAULT_MAX_SURGE",
    "GenerationStatus",
    "Rollout",
    "RolloutPhase",
    "RolloutStatus",
    "StageRollout",
    "surge_replicas",
]

_PERCENT = re.compile(r"^(0|[1-9][0-9]{0,2})%$")
DEFAULT_MAX_SURGE = "100%"
DEFAULT_PROGRESS_DEADLINE_SECONDS = 600


def _check_surge(value: Any) -> int | str:
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"maxSurge {value} is negative; use 0 or more replicas, or a percentage like 25%")
        return value
    if isinstance(value, str) and _PERCENT.match(value) and int(value[:-1]) <= 100:
        return value
    raise ValueError(f"maxSurge {value!r}: use a number of replicas (0, 1, 2...) or a percentage from 0% to 100%")


Surge = Annotated[
    int | str,
    PlainValidator(_check_surge),
    WithJsonSchema({"x-kubernetes-int-or-string": True, "pattern": r"^(100|[1-9]?[0-9])%$"}),
]
"""Replicas (an integer) or a percentage of a stage's replicas ("25%")."""


def surge_replicas(max_surge: int | str, replicas: int) -> int:
    """The replicas a stage's new generation may run beside its old one: `max_surge` as a count, or its
    percentage of `replicas` rounded up (as a Deployment's maxSurge), never more than `replicas`."""
    if isinstance(max_surge, str):
        return min(replicas, math.ceil(replicas * int(max_surge[:-1]) / 100))
    return min(replicas, max_surge)


class Rollout(KubeModel):
    """How a change to the pipeline's contract rolls (see status.contract for what is in it)."""

    max_surge: Surge = Field(
        DEFAULT_MAX_SURGE,
        description="Replicas the new generation of each stage whose contract changed may run beside the old "
        "generation, as a count or a percentage of the stage's replicas (rounded up). 100% (the default) brings "
        "the whole new generation up before the router moves to it, so capacity never drops; less brings up that "
        "many and, once every stage of the new generation has them ready, the old generation drains and the new "
        "one scales to the full count. 0 stops the world: the old generation drains first, then the new one "
        "starts, and requests meanwhile get 503 with Retry-After.",
    )
    progress_deadline_seconds: Int = Field(
        DEFAULT_PROGRESS_DEADLINE_SECONDS,
        ge=1,
        le=86400,
        description="Seconds the new generation may take to have every stage ready (loading a model counts) "
        "before the rollout is failed: the old generation keeps serving and the pipeline turns Degraded with "
        "reason RolloutFailed.",
    )
    auto_rollback: Bool = Field(
        True,
        description="When a rollout fails (a stage of the new generation crash-loops, fails its engine "
        "self-check, cannot be scheduled, or misses progressDeadlineSeconds), scale the new generation to zero "
        "so it stops holding accelerators; the old one keeps all traffic. Change the spec to try again.",
    )


class StageRollout(KubeModel):
    """Written by the pipeline while it rolls a change to its contract; absent otherwise."""

    keep_older: Bool = Field(
        description="Keep the stage's older generations serving: the pipeline's new generation is not whole yet."
    )
    max_replicas: Int = Field(
        ge=0,
        description="At most this many replicas of the stage's current generation while older ones serve "
        "(the pipeline's rollout.maxSurge; 0 after a failed rollout was rolled back, or while the cluster lacks "
        "the accelerators for it).",
    )
    waiting_for_capacity: Bool = Field(
        False,
        description="The cluster has too few free accelerators for the current generation's surge: none of its "
        "pods is made (no Deployment yet) until it has them; the pipeline looks again every 30 s and says what "
        "to change in its status.",
    )


class RolloutPhase(str, Enum):
    """Where a pipeline's rollout stands (status.rollout.phase)."""

    COMPLETE = "Complete"
    """One generation: every stage runs the current contract."""
    SURGING = "Surging"
    """The new generation comes up beside the old one, which serves every new request meanwhile."""
    STOP_THE_WORLD = "StopTheWorld"
    """maxSurge 0: the old generation drains first, then the new one starts; requests get 503 meanwhile."""
    ROLLED_BACK = "RolledBack"
    """The new generation failed and was scaled to zero; the old one serves. Change the spec to try again."""
    FAILED = "Failed"
    """The new generation failed; autoRollback is off, so it keeps its replicas; the old one serves."""
    WAITING_FOR_CAPACITY = "WaitingForCapacity"
    """The cluster lacks the free accelerators for the new generation's surge; none of its pods was made and
    the old one serves. It goes on by itself once they are free (or with a smaller maxSurge, or 0)."""


class GenerationStatus(KubeModel):
    """One generation of a stage's pods: one Deployment."""

    contract: str = Field(max_length=64, description="The pod group's contract digest (contract.omnikube.io/...).")
    deployment: str = Field(max_length=253, description="The Deployment that runs it.")
    current: Bool = Field(description="Whether it is the generation of the stage's current spec.")
    replicas: Int = Field(0, ge=0, description="Replicas its Deployment wants.")
    ready_replicas: Int = Field(0, ge=0, description="Of those, ready to serve.")
    created: str = Field("", description="When its Deployment was created (RFC 3339): when the rollout began.")


class RolloutStatus(KubeModel):
    """The pipeline's rollout: which contract serves, which is wanted, and which stages still move."""

    phase: RolloutPhase = Field(
        description="Complete, Surging, StopTheWorld, RolledBack, Failed or WaitingForCapacity."
    )
    serving: str = Field("", max_length=64, description="Contract digest of the generation that serves requests.")
    target: str = Field("", max_length=64, description="Contract digest of the spec (status.contract).")
    moving: list[str] = Field(
        default_factory=list, description="Stages whose new generation is not ready yet (or failed)."
    )
    reason: str = Field("", max_length=64, description="Why a failed rollout failed (the stage's Degraded reason).")
    cause: str = Field(
        "",
        max_length=1536,
        description="What failed the rollout, as its stage reported it (RolledBack or Failed): kept after the failed "
        "generation's pods are gone, until the spec changes.",
    )
    message: str = Field("", max_length=2048, description="What happened and what to do.")
