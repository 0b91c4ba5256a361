"""Every reason a condition of ours can carry, as one typed vocabulary.

A reason is chosen where the problem is found and travels as a `Reason`; nobody recovers it from a
message. Spec problems found by the runtime's resolver arrive as `SpecError` subclasses whose
`reason` names one of these.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["Reason", "reason_of"]


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
    # Degraded: the spec is wrong (permanent; fix the OmniPipeline)
    INVALID_SPEC = "InvalidSpec"
    UNKNOWN_PIPELINE = "UnknownPipeline"
    MODEL_FILES_NOT_FOUND = "ModelFilesNotFound"
    UNKNOWN_STAGE = "UnknownStage"
    UNKNOWN_EDGE = "UnknownEdge"
    NO_USABLE_CONNECTOR = "NoUsableConnector"
    INVALID_TOPOLOGY = "InvalidTopology"
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
    ENGINE_FAILED = "EngineFailed"
    """A stage's engine failed to load, failed its self-check, or died while serving (a sequence-parallel
    rank died); the message says what to change or what died."""
    AUTOSCALER_UNAVAILABLE = "AutoscalerUnavailable"
    """A stage asks for a KEDA ScaledObject and the cluster has no KEDA CRDs."""
    STAGE_DEGRADED = "StageDegraded"
    """A stage reported a Degraded reason this operator version does not know."""

    def __str__(self) -> str:
        return self.value


def reason_of(text: str | None, fallback: Reason = Reason.STAGE_DEGRADED) -> Reason:
    """The `Reason` a condition read back from the API server carries (`fallback` if unknown)."""
    try:
        return Reason(text)
    except ValueError:
        return fallback
