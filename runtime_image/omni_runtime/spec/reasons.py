"""Every reason a condition of ours can carry, spelled once: the operator's conditions, the `SpecError`s
the resolver raises and the reason a stage process exits with all name members of `Reason`.

A reason is chosen where the problem is found and travels as a `Reason`; nobody recovers it from a
message. Pure (an enum): the operator imports it, and so does everything in the runtime that reports one.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["Reason"]


class Reason(str, Enum):
    """CamelCase condition reasons (metav1.Condition.reason)."""

    # Ready / Progressing
    CREATING = "Creating"
    AVAILABLE = "Available"
    SCALED_TO_ZERO = "ScaledToZero"
    ROLLING_OUT = "RollingOut"
    WAITING_FOR_REPLICAS = "WaitingForReplicas"
    PROGRESSING = "Progressing"
    COMPLETE = "Complete"
    STALLED = "Stalled"
    AS_EXPECTED = "AsExpected"
    # Degraded: the spec is wrong (permanent; fix the OmniPipeline). Raised as `SpecError` subclasses
    # (spec/pipeline.py, registry/errors.py), each naming its member here.
    INVALID_SPEC = "InvalidSpec"
    UNKNOWN_PIPELINE = "UnknownPipeline"
    MODEL_FILES_NOT_FOUND = "ModelFilesNotFound"
    UNKNOWN_STAGE = "UnknownStage"
    UNKNOWN_EDGE = "UnknownEdge"
    NO_USABLE_CONNECTOR = "NoUsableConnector"
    INVALID_TOPOLOGY = "InvalidTopology"
    INVALID_ENGINE_ARGS = "InvalidEngineArgs"
    """A stage's engine args that its engine would refuse (an omnikube key's value, a combination, a key a
    runner does not read), found when the pipeline is resolved, before any pod starts."""
    SECRET_MISSING = "SecretMissing"
    NAME_COLLISION = "NameCollision"
    """An object the operator would create exists and is not the pipeline's; it is left alone."""
    # Degraded: the world does not let the pods run
    MODEL_CACHE_MISSING = "ModelCacheMissing"
    INSUFFICIENT_ACCELERATOR = "InsufficientAccelerator"
    UNSCHEDULABLE = "Unschedulable"
    CRASH_LOOP = "CrashLoop"
    IMAGE_PULL = "ImagePull"
    CONTAINER_CONFIG = "ContainerConfig"
    CONNECTOR_UNAVAILABLE = "ConnectorUnavailable"
    """A connector an edge of the stage needs could not start (e.g. the Mooncake master is unreachable)."""
    ENGINE_FAILED = "EngineFailed"
    """A stage's engine failed to load, failed its self-check (one tiny request, so every request would
    fail), or died while serving (a sequence-parallel rank died); the message says what to change or what
    died."""
    ROLLOUT_FAILED = "RolloutFailed"
    """The new generation of a change to the pipeline's contract never became whole (a stage of it crash-looped,
    failed its self-check, could not be scheduled, or missed rollout.progressDeadlineSeconds); the old
    generation keeps serving."""
    ROLLED_BACK = "RolledBack"
    """A stage's new generation was scaled to zero after its rollout failed (rollout.autoRollback)."""
    AUTOSCALER_UNAVAILABLE = "AutoscalerUnavailable"
    """A stage asks for a KEDA ScaledObject and the cluster has no KEDA CRDs."""
    STAGE_DEGRADED = "StageDegraded"
    """A stage reported a Degraded reason this operator version does not know."""

    def __str__(self) -> str:
        return self.value
