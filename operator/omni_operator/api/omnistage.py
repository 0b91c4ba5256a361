"""OmniStage: one fully resolved stage of an OmniPipeline, what its pods run.

The operator creates one per stage (or per group of colocated stages) and owns it; people and
autoscalers may change `spec.replicas` through the /scale subresource.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import ConfigDict, Field

from omni_operator.api.base import (
    CRDInfo,
    CustomResource,
    Int,
    KubeModel,
    PrinterColumn,
    Quantity,
    Rule,
    list_map,
    list_set,
)
from omni_operator.api.common import (
    DEFAULT_GRACE_SECONDS,
    MAX_STAGES,
    Autoscaling,
    Condition,
    EnvVar,
    ImagePullPolicy,
    ModelCache,
    ObjectName,
    Placement,
    SecretKeyRef,
    StageName,
    env_field,
    grace_field,
    unique_env_rule,
)
from omni_operator.api.rollout import GenerationStatus, StageRollout
from omni_runtime.spec import StageKind

__all__ = ["OmniStage", "OmniStageSpec", "OmniStageStatus"]


class OmniStageSpec(Placement):
    """The resolved stage: written by the operator from its OmniPipeline; edit the pipeline instead
    (only replicas may be changed here, through /scale, when the stage has autoscaling)."""

    pipeline: ObjectName = Field(description="Name of the owning OmniPipeline.")
    stage: StageName = Field(description="Stage name in the pipeline topology.")
    kind: StageKind = Field(
        description="Engine family: ar (vLLM), diffusion (diffusers) or generation (chunked torch module)."
    )
    replicas: Int = Field(1, ge=0, description="Pods of this stage.")
    image: str = Field(min_length=1, max_length=512, description="Runtime image of the stage pods.")
    image_pull_policy: ImagePullPolicy = Field(
        ImagePullPolicy.IF_NOT_PRESENT, description="When the kubelet pulls the image."
    )
    image_pull_secrets: list[ObjectName] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra=list_set(),
        description="Names of docker-registry Secrets used to pull the image.",
    )
    model: str = Field(min_length=1, max_length=4096, description="Model path the stage loads from.")
    config_map: ObjectName = Field(
        description="ConfigMap holding the resolved pipeline JSON (key resolved.json) the stage server reads: "
        "one per generation of the pod group, so a pod of an older generation that restarts reads what it ran."
    )
    contract: str = Field(
        "",
        max_length=64,
        description="The pod group's contract digest (over its stages' contract.omnikube.io labels): it names the "
        "generation's Deployment, so a change to it brings up a new Deployment beside the old one.",
    )
    rollout: StageRollout | None = Field(
        None, description="Set by the pipeline while a change to its contract rolls; absent otherwise."
    )
    colocated: list[StageName] = Field(
        default_factory=list,
        max_length=MAX_STAGES - 1,
        json_schema_extra=list_set(),
        description="Other stages that run in this stage's pods (their colocateWith names this stage).",
    )
    shm_size: Quantity = Field("8Gi", description="Size of /dev/shm (a memory-backed emptyDir) in the pods.")
    autoscaling: Autoscaling | None = Field(
        None,
        description="Autoscaling bounds and target; when set, the operator never overwrites replicas.",
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="Engine arguments, topology and pipeline overrides merged."
    )
    sampling_params: dict[str, Any] = Field(
        default_factory=dict, description="Default sampling parameters, topology and overrides merged."
    )
    model_cache: ModelCache | None = Field(None, description="Volume holding model weights.")
    env: list[EnvVar] = env_field()
    hf_token_secret: SecretKeyRef | None = Field(None, description="Secret key exposed to the stage as HF_TOKEN.")
    termination_grace_period_seconds: Int = grace_field(DEFAULT_GRACE_SECONDS, "the stage's")

    validation_rules: ClassVar[tuple[Rule, ...]] = (
        unique_env_rule(),
        Rule(
            cel="!has(self.colocated) || !(self.stage in self.colocated)",
            message="colocated: must list other stages, not the stage itself",
            check=lambda m: m.stage not in m.colocated,
        ),
    )


class OmniStageStatus(KubeModel):
    """What the operator observed of the stage's pods."""

    model_config = ConfigDict(extra="ignore")  # tolerate fields a newer operator writes

    observed_generation: Int | None = Field(None, ge=0, description="metadata.generation this status describes.")
    replicas: Int = Field(0, ge=0, description="Pods that exist (the /scale subresource reports it).")
    ready_replicas: Int = Field(0, ge=0, description="Pods ready to serve.")
    selector: str = Field("", description="Label selector of the stage's pods, for /scale and HPA.")
    workload_generation: Int | None = Field(
        None,
        ge=0,
        description="metadata.generation of the stage Deployment as the operator last wrote it; a "
        "different live generation means someone edited the Deployment, and the operator restores it.",
    )
    generations: list[GenerationStatus] = Field(
        default_factory=list,
        json_schema_extra=list_map("contract"),
        description="Each generation of the stage's pods that still exists, the current one first.",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra=list_map("type"),
        description="Ready, Progressing and Degraded, each with a reason and a message saying what to do.",
    )


class OmniStage(CustomResource):
    """One stage of an OmniPipeline, fully resolved: what its pods run, where, and how many.
    Owned by the pipeline; scale it with kubectl scale, an HPA or KEDA."""

    crd: ClassVar[CRDInfo] = CRDInfo(
        kind="OmniStage",
        plural="omnistages",
        short_names=("ost",),
        printer_columns=(
            PrinterColumn("Pipeline", ".spec.pipeline", description="Owning OmniPipeline."),
            PrinterColumn("Stage", ".spec.stage", description="Stage name in the topology."),
            PrinterColumn("Ready", ".status.readyReplicas", type="integer", description="Ready pods."),
            PrinterColumn("Desired", ".spec.replicas", type="integer", description="Wanted pods."),
            PrinterColumn("Age", ".metadata.creationTimestamp", type="date"),
            PrinterColumn("Kind", ".spec.kind", priority=1, description="Engine family."),
            PrinterColumn("Accelerator", ".spec.accelerator.type", priority=1, description="Device type."),
        ),
        scale=True,
    )

    spec: OmniStageSpec = Field(description="The resolved stage.")
    status: OmniStageStatus | None = Field(None, description="What the operator observed.")
