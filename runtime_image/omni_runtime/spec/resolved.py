"""The resolved pipeline: a registry topology with a deployment's overrides applied.

The operator writes it into a ConfigMap and the local launcher into a file; the router and every stage
server read it (`--config resolved.json`). It is the only configuration the runtime processes take.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from omni_runtime.spec.connectors import CONNECTOR_KINDS, ConnectorKind, ConnectorServer, ConnectorsSpec
from omni_runtime.spec.pipeline import NoUsableConnector, PipelineSpec, SpecError, UnknownEdge, UnknownStage
from omni_runtime.spec.placement import Placement, StageDiscovery, pod_groups

__all__ = [
    "EdgeOverride",
    "MediaLimits",
    "ResolvedPipeline",
    "RouterLimits",
    "StageOverride",
    "resolve_pipeline",
]

ROUTER_PORT = 8000
"""Port of the router's OpenAI-compatible HTTP API."""
DRAIN_TIMEOUT_S = 15.0
"""Seconds a stage or router given SIGTERM lets its running work finish, unless told otherwise (the
operator derives it from the pod's terminationGracePeriodSeconds); fits in the local launcher's stop."""


class StageOverride(BaseModel):
    """What a deployment changes on one stage of its topology."""

    model_config = ConfigDict(extra="forbid")

    name: str
    engine_args: dict[str, Any] = Field(default_factory=dict)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    colocate_with: str | None = None


class EdgeOverride(BaseModel):
    """What a deployment changes on one edge of its topology."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    source: str = Field(alias="from")
    target: str = Field(alias="to")
    connector: ConnectorKind | None = None
    window: int | None = Field(None, ge=0)
    first_window: int | None = Field(None, ge=0)


class MediaLimits(BaseModel):
    """Bounds on the media parts of one request (`image_url`, `input_audio`, `audio_url`, `video_url`),
    checked by the router before any stage sees them."""

    model_config = ConfigDict(extra="forbid")

    max_parts: int = Field(8, ge=0, description="Media parts per request, all messages together; 0 refuses media.")
    max_part_bytes: int = Field(16 * 1024**2, ge=1, description="Largest decoded size of one media part, in bytes.")
    max_audio_seconds: float = Field(600.0, gt=0, description="Longest audio part, in seconds.")
    max_video_seconds: float = Field(600.0, gt=0, description="Longest video part, in seconds.")
    allowed_domains: list[str] = Field(
        default_factory=list,
        description="Hosts (and their subdomains) whose http(s) media URLs the router fetches; empty: only "
        "data URLs are accepted, so nobody can make a pod fetch an arbitrary URL.",
    )


class VideoLimits(BaseModel):
    """Bounds on `/v1/videos` jobs and on the finished videos each router replica keeps."""

    model_config = ConfigDict(extra="forbid")

    max_frames: int = Field(241, ge=1, description="Most frames one video may have (`num_frames`, or seconds x fps).")
    max_pixels: int = Field(1280 * 720, ge=64, description="Largest width x height of a video.")
    max_inference_steps: int = Field(100, ge=1, description="Most denoising steps one video may ask for.")
    max_concurrent_jobs: int = Field(2, ge=1, description="Jobs each router replica runs at once; more wait queued.")
    max_queued_jobs: int = Field(32, ge=0, description="Jobs each replica keeps waiting; beyond that it answers 429.")
    ttl_s: float = Field(86400.0, gt=0, description="Seconds a finished (or failed) job and its video are kept.")
    max_bytes: int = Field(
        10 * 1024**3, ge=1024**2, description="Bytes of finished videos each replica keeps; the oldest go first."
    )


class RouterLimits(BaseModel):
    """Admission limits that keep the router responsive under load."""

    model_config = ConfigDict(extra="forbid")

    max_concurrent_requests: int = Field(64, ge=1, description="Requests in flight before queueing.")
    max_queued_requests: int = Field(256, ge=0, description="Requests waiting beyond that; more get 429.")
    request_timeout_s: float = Field(600.0, gt=0, description="A request still running after this fails.")
    max_body_bytes: int = Field(32 * 1024**2, ge=1024, description="Largest request body accepted.")
    max_n: int = Field(16, ge=1, le=128, description="Most choices or images (`n`) one request may ask for.")
    max_tokens: int = Field(
        32768, ge=1, description="Largest `max_tokens` / `max_completion_tokens` a request may ask of an AR stage."
    )
    media: MediaLimits = Field(default_factory=MediaLimits, description="Bounds on a request's media inputs.")
    videos: VideoLimits = Field(default_factory=VideoLimits, description="Bounds on video jobs and their storage.")
    unknown_fields: Literal["reject", "ignore"] = Field(
        "reject",
        description="A request field the router does not know: `reject` answers 400 naming it (a misspelt "
        "field never silently does nothing); `ignore` drops it (for clients that send vendor extras). "
        "Fields the router knows and refuses are refused either way.",
    )


class ResolvedPipeline(BaseModel):
    """Everything the runtime processes of one deployed pipeline need to know."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Deployment name (the OmniPipeline's name, or the local pipeline's).")
    namespace: str = ""
    model: str = Field(description="Model path inside the pod (or locally) the stages load from.")
    served_model_name: str = Field(description="Model id clients put in `model`.")
    topology: PipelineSpec
    colocation: dict[str, str] = Field(default_factory=dict, description="Stage name -> the stage whose pod it shares.")
    discovery: dict[str, StageDiscovery] = Field(default_factory=dict)
    limits: RouterLimits = Field(default_factory=RouterLimits)
    scale_from_zero: list[str] = Field(
        default_factory=list,
        description="Stages an autoscaler may take to zero replicas (and back). While one has no replica "
        "the router holds its requests (up to the request timeout, then 503 with Retry-After), counts "
        "them in omnikube_stage_requests_waiting_for_replica (what the autoscaler activates on), and its "
        "readiness does not wait for that stage.",
    )
    mooncake_master_host: str | None = Field(
        None,
        description="Host (DNS name or IP) of the pipeline's one Mooncake master and metadata server, set "
        "when an edge uses `mooncake` (ports: topology.connectors.mooncake). The operator sets the DNS name "
        "of the pipeline's `<name>-mooncake` headless Service; the local launcher its own address.",
    )

    def stage_group(self, name: str) -> str:
        """The pod group a stage runs in: its own name, or the stage it is colocated with."""
        return self.colocation.get(name, name)

    def connector_servers(self) -> list[ConnectorServer]:
        """The per-pipeline servers the connectors of its edges need (Mooncake's master when an edge uses
        `mooncake`), each once: the operator deploys them, the local launcher runs them."""
        topo = self.topology
        needed = {CONNECTOR_KINDS[topo.edge_connector(e)].server for e in topo.edges}
        return [server for server in ConnectorServer if server in needed]


def resolve_pipeline(
    topology: PipelineSpec,
    *,
    name: str,
    model: str,
    served_model_name: str | None = None,
    namespace: str = "",
    stages: Sequence[StageOverride] = (),
    edges: Sequence[EdgeOverride] = (),
    connectors: ConnectorsSpec | None = None,
    limits: RouterLimits | None = None,
    placement: Placement | None = None,
) -> ResolvedPipeline:
    """Apply a deployment's overrides to a topology and, given a `placement`, say where every process
    runs (discovery, the Mooncake master, the stages that may scale to zero): the pipeline returned is
    complete, and no caller changes it afterwards. Without a placement it has no discovery (tests that
    start stages themselves).

    Raises SpecError naming the override when it refers to a stage or edge the topology lacks, or when
    the result cannot run (for example an `shm` edge between stages in different pods).
    """
    spec = topology.model_copy(deep=True)
    if connectors is not None:
        spec.connectors = connectors.model_copy(deep=True)
    names = spec.stage_names()
    colocation: dict[str, str] = {}
    for i, override in enumerate(stages):
        if override.name not in names:
            raise UnknownStage(
                f"stages[{i}].name: pipeline {topology.name!r} has no stage {override.name!r}; its stages are {names}"
            )
        stage = spec.stage(override.name)
        stage.engine_args = {**stage.engine_args, **override.engine_args}
        stage.sampling_params = {**stage.sampling_params, **override.sampling_params}
        if override.colocate_with:
            if override.colocate_with not in names or override.colocate_with == override.name:
                raise UnknownStage(
                    f"stages[{i}].colocateWith: {override.colocate_with!r} is not another stage of "
                    f"{topology.name!r}; use one of {[n for n in names if n != override.name]}"
                )
            colocation[override.name] = override.colocate_with
    # Chains (a -> b -> c) collapse onto the root stage, which owns the pod.
    for stage_name in list(colocation):
        seen = [stage_name]
        while colocation.get(seen[-1]):
            nxt = colocation[seen[-1]]
            if nxt in seen:
                raise SpecError(f"stages: colocateWith forms a loop {' -> '.join(seen + [nxt])}; break it")
            seen.append(nxt)
        colocation[stage_name] = seen[-1]

    for i, edge_override in enumerate(edges):
        matching = [e for e in spec.edges if e.source == edge_override.source and e.target == edge_override.target]
        if not matching:
            known = [f"{e.source}->{e.target}" for e in spec.edges]
            raise UnknownEdge(
                f"connectors.edges[{i}]: pipeline {topology.name!r} has no edge "
                f"{edge_override.source}->{edge_override.target}; its edges are {known}"
            )
        if edge_override.connector is not None:
            matching[0].connector = edge_override.connector
        if edge_override.window is not None:
            matching[0].window = edge_override.window
        if edge_override.first_window is not None:
            matching[0].first_window = edge_override.first_window

    resolved = ResolvedPipeline(
        name=name,
        namespace=namespace,
        model=model,
        served_model_name=served_model_name or model,
        topology=spec,
        colocation=colocation,
        limits=limits or RouterLimits(),
    )
    _check_connectors(resolved)
    if placement is not None:
        _place(resolved, placement)
    return resolved


def _place(resolved: ResolvedPipeline, placement: Placement) -> None:
    """Discovery, the stages that may scale to zero and the Mooncake master, from where `placement` runs them."""
    groups = pod_groups(resolved.topology.topological_order(), resolved.colocation)
    resolved.discovery = dict(placement.discovery(groups))
    resolved.scale_from_zero = [
        stage for root, members in groups.items() if root in placement.scale_from_zero for stage in members
    ]
    if ConnectorServer.MOONCAKE in resolved.connector_servers():
        master = placement.mooncake_master()
        mooncake = resolved.topology.connectors.mooncake
        mooncake.master_port = master.master_port or mooncake.master_port
        mooncake.metadata_port = master.metadata_port or mooncake.metadata_port
        resolved.mooncake_master_host = master.host


def _check_connectors(resolved: ResolvedPipeline) -> None:
    spec = resolved.topology
    # Kinds that reach across pods, the last declared (the most capable) first.
    across_pods = " or ".join(repr(k.value) for k, facts in list(CONNECTOR_KINDS.items())[::-1] if not facts.one_pod)
    for i, edge in enumerate(spec.edges):
        kind = spec.edge_connector(edge)
        same_pod = resolved.stage_group(edge.source) == resolved.stage_group(edge.target)
        if CONNECTOR_KINDS[kind].one_pod and not same_pod:
            raise NoUsableConnector(
                f"edges[{i}] {edge.source}->{edge.target}: connector {kind.value!r} needs both stages in one "
                f"pod; set colocateWith on one of them, or use {across_pods} for this edge"
            )
