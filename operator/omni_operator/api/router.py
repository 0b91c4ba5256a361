"""The router part of an OmniPipeline (`spec.router`): its pods, its Service and the bounds on what
clients may send it. Split from omnipipeline.py, which holds the rest of the OmniPipeline schema."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any

from pydantic import Field

from omni_operator.api.base import Int, KubeModel, Quantity
from omni_operator.api.common import (
    DEFAULT_GRACE_SECONDS,
    ObjectName,
    ResourceRequirements,
    SecretKeyRef,
    Toleration,
    grace_field,
)
from omni_runtime.spec import ROUTER_PORT, RouterLimits

__all__ = [
    "MediaLimitsConfig",
    "RouterLimitsConfig",
    "RouterLivenessProbe",
    "RouterService",
    "RouterSpec",
    "RouterVideos",
    "ServiceType",
    "UnknownFields",
    "VideoLimitsConfig",
]

_LIMIT_DEFAULTS = RouterLimits()
_MEDIA_DEFAULTS = _LIMIT_DEFAULTS.media
_VIDEO_DEFAULTS = _LIMIT_DEFAULTS.videos


class ServiceType(str, Enum):
    """How the router's Service is exposed."""

    CLUSTER_IP = "ClusterIP"
    NODE_PORT = "NodePort"
    LOAD_BALANCER = "LoadBalancer"


class UnknownFields(str, Enum):
    """What the router does with a request field it does not know."""

    REJECT = "reject"
    IGNORE = "ignore"


class RouterService(KubeModel):
    """The Service in front of the router: the pipeline's OpenAI-compatible endpoint."""

    type: ServiceType = Field(ServiceType.CLUSTER_IP, description="Service type.")
    port: Int = Field(ROUTER_PORT, ge=1, le=65535, description="Service port clients connect to.")


class MediaLimitsConfig(KubeModel):
    """Bounds on the media parts (image_url, input_audio, audio_url, video_url) of one request; the
    router answers 400 naming the part that breaks one."""

    max_parts: Int = Field(_MEDIA_DEFAULTS.max_parts, ge=0, description="Media parts per request; 0 refuses media.")
    max_part_bytes: Quantity = Field(
        _MEDIA_DEFAULTS.max_part_bytes, description="Largest decoded size of one media part (e.g. 16Mi)."
    )
    max_audio_seconds: Int = Field(
        int(_MEDIA_DEFAULTS.max_audio_seconds), ge=1, description="Longest audio part, in seconds."
    )
    max_video_seconds: Int = Field(
        int(_MEDIA_DEFAULTS.max_video_seconds), ge=1, description="Longest video part, in seconds."
    )
    allowed_domains: list[Annotated[str, Field(max_length=253)]] = Field(
        default_factory=list,
        max_length=64,
        description="Hosts (and their subdomains) whose http(s) media URLs the router fetches; empty accepts "
        "only data URLs, so no request can make the router fetch an arbitrary URL (SSRF).",
    )


class VideoLimitsConfig(KubeModel):
    """Bounds on `/v1/videos` jobs; a request beyond one gets 400 (429 for the job counts) naming it."""

    max_frames: Int = Field(
        _VIDEO_DEFAULTS.max_frames, ge=1, description="Most frames one video may have (num_frames, or seconds x fps)."
    )
    max_pixels: Int = Field(
        _VIDEO_DEFAULTS.max_pixels, ge=64, description="Largest width x height of a video (1280x720 = 921600)."
    )
    max_inference_steps: Int = Field(
        _VIDEO_DEFAULTS.max_inference_steps, ge=1, description="Most denoising steps one video may ask for."
    )
    max_concurrent_jobs: Int = Field(
        _VIDEO_DEFAULTS.max_concurrent_jobs, ge=1, description="Video jobs each router replica runs at once."
    )
    max_queued_jobs: Int = Field(
        _VIDEO_DEFAULTS.max_queued_jobs,
        ge=0,
        description="Video jobs each router replica keeps waiting beyond those; more get 429.",
    )


class RouterLivenessProbe(KubeModel):
    """The router container's liveness probe (GET /livez: the process serves, whatever its stages do)."""

    period_seconds: Int = Field(
        10, ge=1, le=300, description="Seconds between two checks that the router process still answers."
    )
    failure_threshold: Int = Field(
        6,
        ge=1,
        le=100,
        description="Checks in a row that must fail before the kubelet restarts the router container; "
        "periodSeconds x failureThreshold is how long a hung router serves nothing before it is replaced.",
    )


class RouterVideos(KubeModel):
    """Where the router keeps finished videos, and for how long."""

    volume_claim: ObjectName | None = Field(
        None,
        description="PersistentVolumeClaim (in the pipeline's namespace) the router keeps finished videos on, so "
        "a restarted router still serves them; with several router replicas it must be ReadWriteMany (then every "
        "replica serves every finished video). Unset: an emptyDir per router pod, of maxBytes.",
    )
    ttl_seconds: Int = Field(
        int(_VIDEO_DEFAULTS.ttl_s), ge=1, description="Seconds a finished or failed job and its video are kept."
    )
    max_bytes: Quantity = Field(
        "10Gi", description="Most bytes of videos a router replica keeps (e.g. 10Gi); the oldest go first."
    )


class RouterLimitsConfig(KubeModel):
    """Admission limits that keep the router responsive under load."""

    max_concurrent_requests: Int = Field(
        _LIMIT_DEFAULTS.max_concurrent_requests,
        ge=1,
        description="Requests each router replica runs at once; more wait in its queue.",
    )
    max_queued_requests: Int = Field(
        _LIMIT_DEFAULTS.max_queued_requests,
        ge=0,
        description="Requests each router replica keeps waiting; beyond that it answers 429.",
    )
    request_timeout_seconds: Int = Field(
        int(_LIMIT_DEFAULTS.request_timeout_s),
        ge=1,
        description="A request still running after this many seconds fails with a timeout error.",
    )
    max_body_bytes: Int = Field(
        _LIMIT_DEFAULTS.max_body_bytes,
        ge=1024,
        description="Largest request body accepted, in bytes; larger ones get 413 before they are read. "
        "It also bounds what a stage accepts in one protocol frame.",
    )
    max_n: Int = Field(
        _LIMIT_DEFAULTS.max_n,
        ge=1,
        le=128,
        description="Most choices (chat) or images (images API) one request may ask for with `n`; more get 400.",
    )
    max_tokens: Int = Field(
        _LIMIT_DEFAULTS.max_tokens,
        ge=1,
        description="Largest `max_tokens` (or `max_completion_tokens`) a request may ask for, also inside "
        "`sampling_params_list`; larger ones get 400. The model's context length still applies.",
    )
    media: MediaLimitsConfig = Field(
        default_factory=MediaLimitsConfig, description="Count, size and duration bounds on media inputs."
    )
    videos: VideoLimitsConfig = Field(
        default_factory=VideoLimitsConfig, description="Frame, size, step and job-count bounds of /v1/videos."
    )


class RouterSpec(KubeModel):
    """The router: holds no model, owns each request and moves stage outputs between stages."""

    replicas: Int = Field(1, ge=0, description="Router pods.")
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements, description="CPU and memory of each router pod."
    )
    service: RouterService = Field(default_factory=RouterService, description="The Service clients call.")
    api_key_secret: SecretKeyRef | None = Field(
        None,
        description="Secret key holding the API key clients must send as `Authorization: Bearer <key>` on every "
        "/v1 request (401 otherwise; /health, /livez and /metrics stay open). The router reads it from a "
        "Secret volume and re-reads it when the kubelet refreshes that (within about a minute), so a "
        "rotated key takes effect without a restart. Unset accepts every request.",
    )
    limits: RouterLimitsConfig = Field(
        default_factory=RouterLimitsConfig, description="Concurrency, queue, timeout and body limits."
    )
    videos: RouterVideos = Field(
        default_factory=RouterVideos, description="Storage of finished /v1/videos jobs: volume, TTL, size cap."
    )
    unknown_fields: UnknownFields = Field(
        UnknownFields.REJECT,
        description="A request field the router does not know (say `temprature`, or another vendor's extra): "
        "`reject` answers 400 naming it, so a misspelt or unsupported field never silently does nothing; "
        "`ignore` drops it, for clients that send extras this server has no use for. Fields the router "
        "knows and cannot honour (tools, beam search, ...) get a 400 either way.",
    )
    liveness_probe: RouterLivenessProbe = Field(
        default_factory=RouterLivenessProbe,
        description="How often the router process is checked, and after how many failed checks it is restarted "
        "(raise them on nodes so busy that a live router can miss a check).",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict,
        description="Node labels a node must have to run the router pods (and the pipeline's Mooncake master).",
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        max_length=32,
        description="Taints the router pods (and the pipeline's Mooncake master) tolerate.",
    )
    affinity: dict[str, Any] = Field(
        default_factory=dict,
        description="Router pod affinity, as in a Pod spec; passed through unchanged.",
    )
    termination_grace_period_seconds: Int = grace_field(
        DEFAULT_GRACE_SECONDS,
        "router",
        " The first seconds (5 at most, a preStop sleep) it still takes new requests, while its Service's "
        "endpoints drop it.",
    )
