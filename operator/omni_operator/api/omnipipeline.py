"""OmniPipeline: which model to serve and how to deploy each of its stages.

The topology (stages, edges, engines) comes from the pipeline registry; this object only says how each
stage of it is deployed. See ARCHITECTURE.md, "The API".
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import ConfigDict, Field, ValidationInfo, field_validator

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
    quantity_bytes,
    unique_rule,
)
from omni_operator.api.common import (
    DEFAULT_IMAGE,
    MAX_STAGES,
    NAME_MAX_LENGTH,
    NAME_PATTERN,
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
from omni_operator.api.engine_args_doc import engine_args_description
from omni_operator.api.rollout import Rollout, RolloutStatus
from omni_operator.api.router import (
    RouterSpec,
)
from omni_runtime.spec import ConnectorKind, MooncakeMode, MooncakeProtocol

__all__ = [
    "ConnectorEdge",
    "ConnectorsConfig",
    "MooncakeConfig",
    "OmniPipeline",
    "OmniPipelineSpec",
    "OmniPipelineStatus",
    "PipelineStage",
    "PipelineTopology",
    "RuntimeSpec",
    "StageStatus",
]

MIN_MOONCAKE_BYTES = 16 * 1024**2
"""Smallest Mooncake segment or buffer the runtime accepts (omni_runtime.spec.MooncakeSpec)."""


class RuntimeSpec(KubeModel):
    """The runtime image and what every pod of the pipeline mounts and reads."""

    image: str = Field(
        DEFAULT_IMAGE,
        min_length=1,
        max_length=512,
        description="Runtime image of the router and stage pods (use the NPU or ROCm variant for those accelerators).",
    )
    image_pull_policy: ImagePullPolicy = Field(
        ImagePullPolicy.IF_NOT_PRESENT, description="When the kubelet pulls the image."
    )
    image_pull_secrets: list[ObjectName] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra=list_set(),
        description="Names of docker-registry Secrets used to pull the image.",
    )
    model_cache: ModelCache | None = Field(
        None,
        description="Volume holding model weights; unset gives each pod an empty folder and the model "
        "must be downloadable.",
    )
    env: list[EnvVar] = env_field()
    hf_token_secret: SecretKeyRef | None = Field(
        None,
        description="Secret key holding a Hugging Face token, exposed to the stages as HF_TOKEN. "
        "There is deliberately no field for the token itself.",
    )
    shm_size: Quantity = Field(
        "8Gi",
        description="Size of /dev/shm (a memory-backed emptyDir) in stage pods; the shm connector and "
        "the engines' worker processes use it.",
    )

    validation_rules: ClassVar[tuple[Rule, ...]] = (
        unique_env_rule(),
        unique_rule(
            "imagePullSecrets",
            "image_pull_secrets",
            message="imagePullSecrets: each Secret may be listed once; remove the repeated names",
        ),
    )


class MooncakeConfig(KubeModel):
    """Mooncake settings, used by edges whose connector is mooncake; unset fields keep the
    pipeline topology's values."""

    mode: MooncakeMode | None = Field(
        None,
        description="p2p (default): the consumer stage reads the producer's memory with the transfer "
        "engine, one transfer per payload; store: payloads are Mooncake Store objects placed by the master.",
    )
    protocol: MooncakeProtocol | None = Field(
        None, description="Transport between pods (rdma needs RDMA devices on the nodes)."
    )
    device_name: str | None = Field(
        None,
        max_length=256,
        description="RDMA device names, comma-separated (e.g. mlx5_0); leave empty for tcp.",
    )
    global_segment_size: Quantity | None = Field(
        None,
        description="Memory each stage offers for payloads (at least 16Mi), e.g. 4Gi: its store segment "
        "(store), or the most bytes of unreleased payloads it holds (p2p).",
    )
    local_buffer_size: Quantity | None = Field(
        None, description="Memory of each stage's local transfer buffer in mode store (at least 16Mi), e.g. 512Mi."
    )

    @field_validator("global_segment_size", "local_buffer_size")
    @classmethod
    def _at_least_16mi(cls, value: int | str | None, info: ValidationInfo) -> int | str | None:
        if value is not None and quantity_bytes(value) < MIN_MOONCAKE_BYTES:
            camel = "globalSegmentSize" if info.field_name == "global_segment_size" else "localBufferSize"
            raise ValueError(f"mooncake.{camel}: {value} is below the minimum 16Mi; use 16Mi or more")
        return value


class ConnectorEdge(KubeModel):
    """How one edge of the topology moves data; the edge must exist in the pipeline topology."""

    source: StageName = Field(alias="from", description="Upstream stage of the edge.")
    target: StageName = Field(alias="to", description="Downstream stage of the edge.")
    kind: ConnectorKind | None = Field(
        None,
        description="Connector of this edge (shm needs both stages in one pod, see colocateWith); "
        "unset uses connectors.default.",
    )
    window: Int | None = Field(
        None,
        ge=0,
        le=1_000_000,
        description="Stream the edge in chunks of this many items (tokens, codec codes); 0 sends the "
        "whole output at once; unset keeps the topology's value.",
    )
    first_window: Int | None = Field(
        None,
        ge=0,
        le=1_000_000,
        description="Items in the first chunk of a streamed edge, at most `window` (0: `window`); unset keeps "
        "the topology's value. A smaller first chunk starts the target sooner: on talker -> code2wav it is "
        "the codec frames of the first audio packet (Qwen3-Omni: 4; 2 starts audio about 20 ms sooner on a "
        "GPU, and leaves a longer wait for the second packet).",
    )

    validation_rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="self.from != self.to",
            message="connectors.edges: from and to must name two different stages",
            check=lambda m: m.source != m.target,
        ),
    )


class ConnectorsConfig(KubeModel):
    """How stage outputs travel between stages; unset fields keep the pipeline topology's values."""

    default: ConnectorKind | None = Field(
        None, description="Connector of every edge that names none; unset keeps the topology's."
    )
    inline_max_bytes: Quantity | None = Field(
        None, description="Largest payload the inline connector carries (e.g. 4Mi); larger ones fail."
    )
    mooncake: MooncakeConfig | None = Field(
        None, description="Mooncake settings: mode (p2p or store), protocol, sizes."
    )
    start_timeout_seconds: Int | None = Field(
        None,
        ge=1,
        le=3600,
        description="Seconds a stage keeps trying to start the connectors of its edges (e.g. while the Mooncake "
        "master starts) before its container exits and the pipeline turns Degraded with reason "
        "ConnectorUnavailable, naming the address; unset keeps the topology's (120).",
    )
    edges: list[ConnectorEdge] = Field(
        default_factory=list,
        max_length=64,
        json_schema_extra=list_map("from", "to"),
        description="Per-edge overrides, keyed by from and to.",
    )

    validation_rules: ClassVar[tuple[Rule, ...]] = (
        unique_rule(
            "edges",
            "edges",
            [("from", "source"), ("to", "target")],
            message="connectors.edges: each from/to pair may be listed once; merge the repeated entries",
        ),
    )


class PipelineStage(Placement):
    """How one stage of the topology is deployed; stages not listed run with the defaults."""

    name: StageName = Field(
        description="Stage name from the pipeline topology (RFC 1123 label: lowercase letters, digits and '-')."
    )
    replicas: Int = Field(1, ge=0, description="Pods of this stage; ignored with colocateWith or autoscaling.")
    engine_args: dict[str, Any] = Field(default_factory=dict, description=engine_args_description())
    sampling_params: dict[str, Any] = Field(
        default_factory=dict,
        description="Default sampling parameters merged over the topology's; a request may override them.",
    )
    colocate_with: StageName | None = Field(
        None,
        description="Run this stage in the pods of the named stage (then the shm connector can serve "
        "the edge between them); its own replicas and accelerator are then not used.",
    )
    autoscaling: Autoscaling | None = Field(
        None,
        description="Scale this stage on its queue and its own signal (TTFT, TTFP, RTF, denoising backlog) "
        "instead of a fixed replica count: the operator creates a KEDA ScaledObject or an HPA for it.",
    )
    shm_size: Quantity | None = Field(
        None, description="Size of /dev/shm in this stage's pods; unset uses runtime.shmSize."
    )
    termination_grace_period_seconds: Int | None = grace_field(None, "this stage's")

    validation_rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="!has(self.colocateWith) || !has(self.terminationGracePeriodSeconds)",
            message="terminationGracePeriodSeconds: a stage with colocateWith stops with the pods it shares; "
            "set it on the stage named by colocateWith",
            check=lambda m: m.colocate_with is None or m.termination_grace_period_seconds is None,
        ),
        Rule(
            cel="!has(self.colocateWith) || self.colocateWith != self.name",
            message="colocateWith: a stage cannot be colocated with itself; name another stage",
            check=lambda m: m.colocate_with != m.name,
        ),
        Rule(
            cel="!has(self.colocateWith) || !has(self.autoscaling)",
            message="autoscaling: a stage with colocateWith scales with the stage whose pods it shares; "
            "move autoscaling to that stage",
            check=lambda m: m.colocate_with is None or m.autoscaling is None,
        ),
    )


class OmniPipelineSpec(KubeModel):
    """Which model to serve and how to deploy each stage of its pipeline."""

    model: str = Field(
        min_length=1,
        max_length=512,
        description="Hugging Face model id (Qwen/Qwen3-Omni-30B-A3B-Instruct) or a path in the model "
        "cache (absolute, or relative to runtime.modelCache.mountPath).",
    )
    pipeline: Annotated[str, Field(pattern=NAME_PATTERN, max_length=NAME_MAX_LENGTH)] | None = Field(
        None,
        description="Registry name of the topology (e.g. qwen3-omni); unset resolves it from the "
        "model's config.json architectures or model_index.json _class_name.",
    )
    served_model_name: str | None = Field(
        None, min_length=1, max_length=256, description="Model id clients send; unset uses model."
    )
    runtime: RuntimeSpec = Field(
        default_factory=RuntimeSpec, description="Image, model cache, environment and secrets."
    )
    router: RouterSpec = Field(default_factory=RouterSpec, description="The router and its Service.")
    connectors: ConnectorsConfig = Field(
        default_factory=ConnectorsConfig, description="How stage outputs travel between stages."
    )
    rollout: Rollout = Field(
        default_factory=Rollout,
        description="How a change to the pipeline's contract rolls: a new generation of the stages it changes "
        "beside the old one, each request within one generation.",
    )
    stages: list[PipelineStage] = Field(
        default_factory=list,
        max_length=MAX_STAGES,
        json_schema_extra=list_map("name"),
        description="Per-stage deployment, keyed by stage name; stages of the topology not listed get "
        "one replica on CPU.",
    )

    validation_rules: ClassVar[tuple[Rule, ...]] = (
        unique_rule(
            "stages",
            "stages",
            [("name", "name")],
            message="stages: stage names must be unique; merge the entries that share a name",
        ),
    )

    @field_validator("stages")
    @classmethod
    def _name_duplicates(cls, stages: list[PipelineStage]) -> list[PipelineStage]:
        names = [s.name for s in stages]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"stages: stage names must be unique; merge the entries that share a name ({repeated})")
        return stages


class StageStatus(KubeModel):
    """Replicas of one stage."""

    name: str = Field(max_length=NAME_MAX_LENGTH, description="Stage name.")
    replicas: Int = Field(0, ge=0, description="Replicas wanted (the OmniStage's spec.replicas).")
    ready_replicas: Int = Field(0, ge=0, description="Replicas ready to serve.")


class PipelineTopology(KubeModel):
    """The topology the pipeline resolved to, for people reading the status."""

    pipeline: str = Field("", description="Registry name of the topology.")
    stages: list[str] = Field(default_factory=list, description="Stage names, upstream first.")
    edges: list[str] = Field(
        default_factory=list,
        description="Edges as 'from->to (connector)', e.g. 'thinker->talker (mooncake)'.",
    )


class OmniPipelineStatus(KubeModel):
    """What the operator observed; written by the operator only."""

    model_config = ConfigDict(extra="ignore")  # tolerate fields a newer operator writes

    observed_generation: Int | None = Field(None, ge=0, description="metadata.generation this status describes.")
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra=list_map("type"),
        description="Ready, Progressing and Degraded, each with a reason and a message saying what to do.",
    )
    stages: list[StageStatus] = Field(
        default_factory=list, json_schema_extra=list_map("name"), description="Replicas of each stage."
    )
    stages_ready: str = Field("", description="Stages with all replicas ready, over all stages (e.g. 2/3).")
    router_generation: Int | None = Field(
        None,
        ge=0,
        description="metadata.generation of the router Deployment as the operator last wrote it; a "
        "different live generation means someone edited it, and the operator restores it.",
    )
    topology: PipelineTopology | None = Field(None, description="The resolved topology.")
    endpoint: str = Field(
        "", description="In-cluster URL of the OpenAI-compatible API (http://<service>.<ns>.svc:<port>/v1)."
    )
    contract: str = Field(
        "",
        description="Digest of the pipeline's contract: everything that decides what crosses an edge (the model, "
        "the topology, each stage's kind, modalities, companions and payload-changing engine args, each edge's "
        "connector, window, first window and input processor); replicas, resources, placement, autoscaling, "
        "sampling defaults and router limits are out of it. Each stage's pods carry their stage's part as the "
        "label contract.omnikube.io/<stage>, and the router never runs one request on replicas of two contracts.",
    )
    rollout: RolloutStatus | None = Field(None, description="The rollout of the last change to the contract.")


class OmniPipeline(CustomResource):
    """A model served on Kubernetes as a pipeline of stages, each stage in its own pods, behind a
    router with an OpenAI-compatible API."""

    validation_rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="size(self.metadata.name) <= 63",
            message="metadata.name: at most 63 characters, since it becomes a label value on every object "
            "of the pipeline; choose a shorter name",
            check=lambda m: len(m.metadata.name) <= 63,
        ),
    )

    crd: ClassVar[CRDInfo] = CRDInfo(
        kind="OmniPipeline",
        plural="omnipipelines",
        short_names=("op",),
        printer_columns=(
            PrinterColumn(
                "Ready",
                '.status.conditions[?(@.type=="Ready")].status',
                description="Whether every stage and the router are ready.",
            ),
            PrinterColumn("Stages", ".status.stagesReady", description="Stages ready / stages."),
            PrinterColumn("Endpoint", ".status.endpoint", description="OpenAI-compatible API URL."),
            PrinterColumn("Serving", ".status.rollout.serving", description="Contract digest that serves requests."),
            PrinterColumn("Rollout", ".status.rollout.phase", description="Complete, Surging, RolledBack..."),
            PrinterColumn("Age", ".metadata.creationTimestamp", type="date"),
            PrinterColumn(
                "Pipeline", ".status.topology.pipeline", priority=1, description="Resolved registry topology."
            ),
            PrinterColumn("Model", ".spec.model", priority=1, description="Model served."),
            PrinterColumn("Contract", ".status.contract", priority=1, description="Digest of the pipeline contract."),
        ),
    )

    spec: OmniPipelineSpec = Field(description="What to serve and how to deploy it.")
    status: OmniPipelineStatus | None = Field(None, description="What the operator observed.")
