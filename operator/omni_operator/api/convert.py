"""OmniPipeline spec -> the arguments of `omni_runtime.spec.resolve_pipeline`. Pure functions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omni_operator.api.base import quantity_bytes
from omni_operator.api.omnipipeline import ConnectorsConfig, OmniPipeline, OmniPipelineSpec, PipelineStage
from omni_operator.api.router import RouterLimitsConfig, RouterVideos
from omni_runtime.spec import (
    ConnectorsSpec,
    EdgeOverride,
    MediaLimits,
    PipelineSpec,
    Placement,
    ResolvedPipeline,
    RouterLimits,
    StageOverride,
    VideoLimits,
    resolve_pipeline,
)

__all__ = [
    "ResolveArgs",
    "connectors_spec",
    "edge_overrides",
    "namespace_of",
    "resolve",
    "resolve_args",
    "router_limits",
    "stage_overrides",
]


@dataclass(frozen=True)
class ResolveArgs:
    """The deployment-specific keyword arguments of `resolve_pipeline`."""

    stages: list[StageOverride] = field(default_factory=list)
    edges: list[EdgeOverride] = field(default_factory=list)
    connectors: ConnectorsSpec | None = None
    """None keeps the topology's connectors as they are."""
    limits: RouterLimits = field(default_factory=RouterLimits)

    def as_kwargs(self) -> dict[str, Any]:
        return {
            "stages": self.stages,
            "edges": self.edges,
            "connectors": self.connectors,
            "limits": self.limits,
        }


def stage_overrides(stages: list[PipelineStage]) -> list[StageOverride]:
    """One StageOverride per listed stage: engine args, sampling params, colocation."""
    return [
        StageOverride(
            name=s.name,
            engine_args=dict(s.engine_args),
            sampling_params=dict(s.sampling_params),
            colocate_with=s.colocate_with,
        )
        for s in stages
    ]


def edge_overrides(connectors: ConnectorsConfig) -> list[EdgeOverride]:
    """One EdgeOverride per `connectors.edges` entry."""
    return [
        EdgeOverride(source=e.source, target=e.target, connector=e.kind, window=e.window, first_window=e.first_window)
        for e in connectors.edges
    ]


def connectors_spec(connectors: ConnectorsConfig, base: ConnectorsSpec | None = None) -> ConnectorsSpec | None:
    """The pipeline-wide connector settings with the spec's fields laid over `base` (the topology's).

    None when the spec sets none of them, so the topology's own settings stand untouched.
    """
    mooncake = connectors.mooncake
    mooncake_set = mooncake is not None and bool(mooncake.model_fields_set)
    if (
        connectors.default is None
        and connectors.inline_max_bytes is None
        and connectors.start_timeout_seconds is None
        and not mooncake_set
    ):
        return None
    merged = (base or ConnectorsSpec()).model_dump()
    if connectors.default is not None:
        merged["default"] = connectors.default
    if connectors.inline_max_bytes is not None:
        merged["inline_max_bytes"] = quantity_bytes(connectors.inline_max_bytes)
    if connectors.start_timeout_seconds is not None:
        merged["start_timeout_seconds"] = connectors.start_timeout_seconds
    if mooncake is not None:
        given = {
            "mode": mooncake.mode,
            "protocol": mooncake.protocol,
            "device_name": mooncake.device_name,
            "global_segment_size": _bytes_or_none(mooncake.global_segment_size),
            "local_buffer_size": _bytes_or_none(mooncake.local_buffer_size),
        }
        merged["mooncake"].update({k: v for k, v in given.items() if v is not None})
    return ConnectorsSpec.model_validate(merged)


def router_limits(
    limits: RouterLimitsConfig, unknown_fields: str = "reject", videos: RouterVideos | None = None
) -> RouterLimits:
    """The runtime's limits from the CRD's `router.limits`, with `router.unknownFields` and the TTL and size
    cap of `router.videos`."""
    videos = videos or RouterVideos()
    return RouterLimits(
        unknown_fields="ignore" if unknown_fields == "ignore" else "reject",
        max_concurrent_requests=limits.max_concurrent_requests,
        max_queued_requests=limits.max_queued_requests,
        request_timeout_s=float(limits.request_timeout_seconds),
        max_body_bytes=limits.max_body_bytes,
        max_n=limits.max_n,
        max_tokens=limits.max_tokens,
        media=MediaLimits(
            max_parts=limits.media.max_parts,
            max_part_bytes=quantity_bytes(limits.media.max_part_bytes),
            max_audio_seconds=float(limits.media.max_audio_seconds),
            max_video_seconds=float(limits.media.max_video_seconds),
            allowed_domains=list(limits.media.allowed_domains),
        ),
        videos=VideoLimits(
            max_frames=limits.videos.max_frames,
            max_pixels=limits.videos.max_pixels,
            max_inference_steps=limits.videos.max_inference_steps,
            max_concurrent_jobs=limits.videos.max_concurrent_jobs,
            max_queued_jobs=limits.videos.max_queued_jobs,
            ttl_s=float(videos.ttl_seconds),
            max_bytes=quantity_bytes(videos.max_bytes),
        ),
    )


def resolve_args(spec: OmniPipelineSpec, topology_connectors: ConnectorsSpec | None = None) -> ResolveArgs:
    """Everything `resolve_pipeline` needs from the spec besides names and the model path.

    `topology_connectors` are the registry topology's connector settings, which the spec's partial
    `connectors` fields are laid over (resolve_pipeline replaces connectors as a whole).
    """
    return ResolveArgs(
        stages=stage_overrides(spec.stages),
        edges=edge_overrides(spec.connectors),
        connectors=connectors_spec(spec.connectors, topology_connectors),
        limits=router_limits(spec.router.limits, spec.router.unknown_fields.value, spec.router.videos),
    )


def namespace_of(pipeline: OmniPipeline) -> str:
    """The namespace the pipeline lives in: its own, or `default` (kubectl's) when its manifest names none."""
    return pipeline.metadata.namespace or "default"


def resolve(
    pipeline: OmniPipeline,
    topology: PipelineSpec,
    *,
    model_path: str | None = None,
    placement: Placement | None = None,
) -> ResolvedPipeline:
    """Resolve `pipeline` against its registry `topology`, placed by `placement` (None: no discovery).

    `model_path` is where the pods find the model (default: spec.model as written). Raises
    omni_runtime.spec.SpecError naming the field when the spec refers to a stage or edge the topology
    lacks, or asks for a connector the placement cannot serve.
    """
    spec = pipeline.spec
    return resolve_pipeline(
        topology,
        name=pipeline.metadata.name,
        namespace=namespace_of(pipeline),
        model=model_path or spec.model,
        served_model_name=spec.served_model_name or spec.model,
        placement=placement,
        **resolve_args(spec, topology.connectors).as_kwargs(),
    )


def _bytes_or_none(value: int | str | None) -> int | None:
    return None if value is None else quantity_bytes(value)
