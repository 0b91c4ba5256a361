"""The pipeline spec: the typed contract between the registry, the operator and the runtime.

Pure pydantic; importing it never loads torch or an engine.
"""

from omni_runtime.spec.connectors import (
    CONNECTOR_KINDS,
    ConnectorKind,
    ConnectorKindFacts,
    ConnectorServer,
    ConnectorsSpec,
    MooncakeSpec,
)
from omni_runtime.spec.engine_args import (
    ENGINE_ARGS_MODELS,
    EngineArgs,
    InvalidEngineArgs,
    check_engine_args,
    engine_args_for,
)
from omni_runtime.spec.enums import (
    INPUT_PROCESSORS,
    Modality,
    MooncakeMode,
    MooncakeProtocol,
    StageKind,
)
from omni_runtime.spec.pipeline import (
    CompanionSpec,
    EdgeSpec,
    ModelMatch,
    NoUsableConnector,
    PipelineSpec,
    SpecError,
    StageSpec,
    UnknownEdge,
    UnknownStage,
)
from omni_runtime.spec.placement import (
    STAGE_HTTP_PORT,
    STAGE_PORT,
    MooncakeMasterAddress,
    Placement,
    PodGroups,
    StageDiscovery,
    pod_groups,
)
from omni_runtime.spec.resolved import (
    DRAIN_TIMEOUT_S,
    ROUTER_PORT,
    EdgeOverride,
    MediaLimits,
    ResolvedPipeline,
    RouterLimits,
    StageOverride,
    VideoLimits,
    resolve_pipeline,
)

__all__ = [
    "CONNECTOR_KINDS",
    "DRAIN_TIMEOUT_S",
    "ENGINE_ARGS_MODELS",
    "INPUT_PROCESSORS",
    "ROUTER_PORT",
    "STAGE_HTTP_PORT",
    "STAGE_PORT",
    "CompanionSpec",
    "ConnectorKind",
    "ConnectorKindFacts",
    "ConnectorServer",
    "ConnectorsSpec",
    "EdgeOverride",
    "EdgeSpec",
    "EngineArgs",
    "InvalidEngineArgs",
    "Modality",
    "ModelMatch",
    "MooncakeMode",
    "MooncakeProtocol",
    "MooncakeMasterAddress",
    "MooncakeSpec",
    "NoUsableConnector",
    "PipelineSpec",
    "Placement",
    "PodGroups",
    "ResolvedPipeline",
    "MediaLimits",
    "VideoLimits",
    "RouterLimits",
    "SpecError",
    "StageDiscovery",
    "StageKind",
    "StageOverride",
    "StageSpec",
    "UnknownEdge",
    "UnknownStage",
    "check_engine_args",
    "engine_args_for",
    "pod_groups",
    "resolve_pipeline",
]
