"""The omnikube.io/v1alpha1 API: OmniPipeline and OmniStage as pydantic models.

The CRDs in crds/ are generated from these models (`python -m omni_operator.crdgen`); the same models
validate manifests offline (`omnikube render`) with the messages the apiserver gives at admission.
"""

from omni_operator.api.base import (
    API_VERSION,
    GROUP,
    VERSION,
    CRDInfo,
    CustomResource,
    KubeModel,
    ObjectMeta,
    PrinterColumn,
    Quantity,
    Rule,
    parse_quantity,
    quantity_bytes,
    validation_messages,
)
from omni_operator.api.common import (
    Accelerator,
    AcceleratorType,
    Autoscaling,
    AutoscalingEngine,
    AutoscalingMetric,
    Condition,
    ConditionStatus,
    EnvVar,
    ImagePullPolicy,
    ModelCache,
    ResourceRequirements,
    SecretKeyRef,
    Toleration,
)
from omni_operator.api.convert import ResolveArgs, namespace_of, resolve, resolve_args
from omni_operator.api.omnipipeline import (
    ConnectorEdge,
    ConnectorsConfig,
    OmniPipeline,
    OmniPipelineSpec,
    OmniPipelineStatus,
    PipelineStage,
    RuntimeSpec,
)
from omni_operator.api.omnistage import OmniStage, OmniStageSpec, OmniStageStatus
from omni_operator.api.router import RouterSpec

RESOURCES: tuple[type[CustomResource], ...] = (OmniPipeline, OmniStage)
"""Every kind of the API, in the order their CRDs are written."""

__all__ = [
    "API_VERSION",
    "GROUP",
    "RESOURCES",
    "VERSION",
    "Accelerator",
    "AcceleratorType",
    "Autoscaling",
    "AutoscalingEngine",
    "AutoscalingMetric",
    "CRDInfo",
    "Condition",
    "ConditionStatus",
    "ConnectorEdge",
    "ConnectorsConfig",
    "CustomResource",
    "EnvVar",
    "ImagePullPolicy",
    "KubeModel",
    "ModelCache",
    "ObjectMeta",
    "OmniPipeline",
    "OmniPipelineSpec",
    "OmniPipelineStatus",
    "OmniStage",
    "OmniStageSpec",
    "OmniStageStatus",
    "PipelineStage",
    "PrinterColumn",
    "Quantity",
    "ResolveArgs",
    "ResourceRequirements",
    "Rule",
    "RouterSpec",
    "RuntimeSpec",
    "SecretKeyRef",
    "Toleration",
    "namespace_of",
    "parse_quantity",
    "quantity_bytes",
    "resolve",
    "resolve_args",
    "validation_messages",
]
