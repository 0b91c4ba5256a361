"""Prometheus metrics of the router and the stage servers, prefix `omnikube_`.

Names follow the seed's serving vocabulary: TTFT (first text token), TPOT (per output token after the
first), TTFP (first media packet: image, audio, video), E2EL (admission to the final output), RTF
(wall-clock time of a request over the seconds of audio it produced; below 1 is faster than real time).
Router metrics carry `pipeline`; per-stage ones add `stage` and `replica` (the replica's address on the
router, its own name on a stage). Each process has one registry (`REGISTRY`), served on /metrics.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = [
    "CONTENT_TYPE_LATEST",
    "REGISTRY",
    "Router",
    "Stage",
    "render",
]

REGISTRY = CollectorRegistry(auto_describe=True)
"""The process's registry (a private one: no default process/platform collectors in unit tests)."""

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_RTF = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2, 3, 5, 10, 20)
_KV_BYTES = (1e4, 1e5, 1e6, 1e7, 3e7, 1e8, 3e8, 1e9, 3e9)
"""A KV cache's size: a tiny model's few kB to HunyuanImage-3's ~90 MB and long contexts' GBs."""
_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class Router:
    """Metrics of the router process."""

    requests = Counter(
        "omnikube_requests", "HTTP requests answered, by endpoint and status code.",
        ["pipeline", "endpoint", "status"], registry=REGISTRY,
    )  # fmt: skip
    errors = Counter(
        "omnikube_request_errors", "Requests that ended in an error, by OpenAI error type.",
        ["pipeline", "endpoint", "type"], registry=REGISTRY,
    )  # fmt: skip
    queue_depth = Gauge("omnikube_queue_depth", "Requests waiting for admission.", ["pipeline"], registry=REGISTRY)
    in_flight = Gauge(
        "omnikube_requests_in_flight", "Admitted requests not finished yet.", ["pipeline"], registry=REGISTRY
    )
    ttft = Histogram(
        "omnikube_time_to_first_token_seconds", "TTFT: admission to the first text token.",
        ["pipeline"], buckets=_LATENCY, registry=REGISTRY,
    )  # fmt: skip
    tpot = Histogram(
        "omnikube_time_per_output_token_seconds", "TPOT: time per output token after the first.",
        ["pipeline"], buckets=_TOKEN, registry=REGISTRY,
    )  # fmt: skip
    ttfp = Histogram(
        "omnikube_time_to_first_packet_seconds", "TTFP: admission to the first media packet.",
        ["pipeline", "modality"], buckets=_LATENCY, registry=REGISTRY,
    )  # fmt: skip
    e2el = Histogram(
        "omnikube_e2e_request_latency_seconds", "E2EL: admission to the final output.",
        ["pipeline", "endpoint"], buckets=_LATENCY, registry=REGISTRY,
    )  # fmt: skip
    stage_outstanding = Gauge(
        "omnikube_stage_outstanding_requests", "Works the router has running on a stage replica.",
        ["pipeline", "stage", "replica"], registry=REGISTRY,
    )  # fmt: skip
    waiting_for_replica = Gauge(
        "omnikube_stage_requests_waiting_for_replica", "Requests the router holds for a stage scaled to zero "
        "until a replica is ready: the demand its autoscaler activates on.",
        ["pipeline", "stage"], registry=REGISTRY,
    )  # fmt: skip
    replica_up = Gauge(
        "omnikube_stage_replica_up", "1 while a stage replica answers pings and is ready.",
        ["pipeline", "stage", "replica"], registry=REGISTRY,
    )  # fmt: skip
    rtf = Histogram(
        "omnikube_audio_real_time_factor", "RTF: a request's wall-clock time over the audio seconds it produced.",
        ["pipeline", "endpoint"], buckets=_RTF, registry=REGISTRY,
    )  # fmt: skip
    audio_seconds = Counter(
        "omnikube_audio_seconds", "Seconds of audio sent to clients.", ["pipeline", "endpoint"], registry=REGISTRY,
    )  # fmt: skip
    rejected = Counter(
        "omnikube_protocol_messages_rejected", "Stage-protocol messages the router dropped unanswered: no "
        "valid auth frame, a bad MAC (another key), an unknown session or a replayed counter.",
        ["pipeline", "stage", "replica", "reason"], registry=REGISTRY,
    )  # fmt: skip
    video_jobs = Gauge(
        "omnikube_video_jobs", "Video jobs this router replica holds, by status.", ["pipeline", "status"],
        registry=REGISTRY,
    )  # fmt: skip
    video_jobs_finished = Counter(
        "omnikube_video_jobs_finished", "Video jobs that ended, by outcome (completed, failed, cancelled).",
        ["pipeline", "status"], registry=REGISTRY,
    )  # fmt: skip
    video_queue_depth = Gauge(
        "omnikube_video_queue_depth", "Video jobs waiting for a run slot on this router replica.", ["pipeline"],
        registry=REGISTRY,
    )  # fmt: skip
    video_e2el = Histogram(
        "omnikube_video_e2e_latency_seconds", "Video E2EL: job created to its MP4 stored.", ["pipeline"],
        buckets=_LATENCY, registry=REGISTRY,
    )  # fmt: skip
    handles_in_transit = Gauge(
        "omnikube_handles_in_transit", "Connector handles the router holds that no stage has taken yet.",
        ["pipeline"], registry=REGISTRY,
    )  # fmt: skip


class Stage:
    """Metrics of a stage server process."""

    requests = Counter(
        "omnikube_stage_requests", "Works a stage finished, by outcome.",
        ["pipeline", "stage", "replica", "status"], registry=REGISTRY,
    )  # fmt: skip
    running = Gauge(
        "omnikube_stage_requests_running", "Works running on this stage replica.",
        ["pipeline", "stage", "replica"], registry=REGISTRY,
    )  # fmt: skip
    engine_queue = Gauge(
        "omnikube_stage_engine_queue_depth", "Requests waiting inside the engine (engine-reported).",
        ["pipeline", "stage", "replica"], registry=REGISTRY,
    )  # fmt: skip
    denoising_steps_queued = Gauge(
        "omnikube_stage_denoising_steps_queued", "Denoising steps still to run for the requests waiting or "
        "running on this diffusion replica: the backlog its autoscaler reads.",
        ["pipeline", "stage", "replica"], registry=REGISTRY,
    )  # fmt: skip
    engine_stat = Gauge(
        "omnikube_stage_engine_stat", "Other gauges the engine reports, by name.",
        ["pipeline", "stage", "replica", "name"], registry=REGISTRY,
    )  # fmt: skip
    latency = Histogram(
        "omnikube_stage_latency_seconds", "Time a work spent on this stage, submit to last output.",
        ["pipeline", "stage", "replica"], buckets=_LATENCY, registry=REGISTRY,
    )  # fmt: skip
    ready = Gauge(
        "omnikube_stage_ready", "1 once the engine has loaded.", ["pipeline", "stage", "replica"],
        registry=REGISTRY,
    )  # fmt: skip
    handles_open = Gauge(
        "omnikube_stage_handles_open", "Handles this stage holds: inputs not released and outputs it "
        "created for works still running.", ["pipeline", "stage", "replica"], registry=REGISTRY,
    )  # fmt: skip
    rejected = Counter(
        "omnikube_stage_protocol_messages_rejected", "Stage-protocol messages this stage dropped unanswered: "
        "no valid auth frame, a bad MAC (a peer without this pipeline's key), an unknown session or a "
        "replayed message.", ["pipeline", "stage", "replica", "reason"], registry=REGISTRY,
    )  # fmt: skip
    connector_bytes = Counter(
        "omnikube_connector_bytes", "Payload bytes moved through connectors, by kind and operation.",
        ["pipeline", "stage", "kind", "op"], registry=REGISTRY,
    )  # fmt: skip
    connector_seconds = Histogram(
        "omnikube_connector_transfer_seconds", "Time of connector put/get calls, by kind.",
        ["pipeline", "stage", "kind", "op"], buckets=_LATENCY, registry=REGISTRY,
    )  # fmt: skip
    audio_seconds = Counter(
        "omnikube_stage_audio_seconds", "Seconds of audio this stage produced.", ["pipeline", "stage", "replica"],
        registry=REGISTRY,
    )  # fmt: skip
    ttfp = Histogram(
        "omnikube_stage_time_to_first_packet_seconds", "Time from a work's submit to its first audio output.",
        ["pipeline", "stage", "replica"], buckets=_LATENCY, registry=REGISTRY,
    )  # fmt: skip
    edge_chunks = Counter(
        "omnikube_edge_chunks", "Handles (chunks, or whole outputs) put on a downstream edge.",
        ["pipeline", "stage", "target", "connector"], registry=REGISTRY,
    )  # fmt: skip
    edge_bytes = Counter(
        "omnikube_edge_bytes", "Payload bytes put on a downstream edge.",
        ["pipeline", "stage", "target", "connector"], registry=REGISTRY,
    )  # fmt: skip
    denoise_step = Histogram(
        "omnikube_stage_denoise_step_seconds", "Time of one denoising step of a diffusion pipeline call "
        "(the whole batch's step).", ["pipeline", "stage"], buckets=_LATENCY, registry=REGISTRY,
    )  # fmt: skip
    kv_bytes = Histogram(
        "omnikube_stage_kv_cache_bytes", "Bytes of one KV cache (one role of one request) this stage received "
        "from an AR stage over an edge that hands over KV (AR -> DiT).",
        ["pipeline", "stage", "source"], buckets=_KV_BYTES, registry=REGISTRY,
    )  # fmt: skip
    kv_seconds = Histogram(
        "omnikube_stage_kv_cache_transfer_seconds", "Time to get one KV cache (one role of one request) out of "
        "the edge's connector.", ["pipeline", "stage", "source"], buckets=_LATENCY, registry=REGISTRY,
    )  # fmt: skip
    kv_companions = Histogram(
        "omnikube_stage_cfg_companions", "CFG companion contexts a request brought to this stage (0: unguided, "
        "or guidance that needs none).", ["pipeline", "stage"], buckets=(0, 1, 2, 3), registry=REGISTRY,
    )  # fmt: skip
    vae_decode = Histogram(
        "omnikube_stage_vae_decode_seconds", "Time of one VAE decode of a diffusion stage (after its denoising "
        "steps).", ["pipeline", "stage"], buckets=_LATENCY, registry=REGISTRY,
    )  # fmt: skip
    connector_unreleased = Gauge(
        "omnikube_connector_payloads_unreleased", "Payloads this stage process put that are not released "
        "yet (shm segments, mooncake p2p blocks), read when scraped.", ["pipeline", "stage", "kind"],
        registry=REGISTRY,
    )  # fmt: skip


def render() -> tuple[bytes, str]:
    """The registry in the Prometheus text format, with its content type."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
