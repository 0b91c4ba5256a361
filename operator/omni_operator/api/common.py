"""Types both CRDs use: accelerators, placement, resources, autoscaling, model cache, secrets, conditions."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, ClassVar

from pydantic import Field, PlainValidator, WithJsonSchema

from omni_operator.api.base import (
    QUANTITY_PATTERN,
    Bool,
    Int,
    KubeModel,
    Quantity,
    Rule,
    list_map,
    parse_quantity,
    unique_rule,
)
from omni_runtime.spec import StageKind
from omni_runtime.spec.pipeline import NAME_PATTERN

__all__ = [
    "DEFAULT_GRACE_SECONDS",
    "DEFAULT_IMAGE",
    "MAX_GRACE_SECONDS",
    "DNS_SUBDOMAIN_PATTERN",
    "MAX_STAGES",
    "NAME_MAX_LENGTH",
    "NAME_PATTERN",
    "ObjectName",
    "StageName",
    "Accelerator",
    "AcceleratorType",
    "Autoscaling",
    "AutoscalingEngine",
    "AutoscalingMetric",
    "AUTOSCALING_P90_SIGNALS",
    "AUTOSCALING_SIGNAL_METRICS",
    "DEFAULT_AUTOSCALING_METRICS",
    "DEFAULT_AUTOSCALING_TARGETS",
    "DEFAULT_PROMETHEUS_ADDRESS",
    "Condition",
    "ConditionStatus",
    "EnvVar",
    "HostPathSource",
    "ImagePullPolicy",
    "ModelCache",
    "PVCSource",
    "Placement",
    "ResourceRequirements",
    "SecretKeyRef",
    "TaintEffect",
    "Toleration",
    "TolerationOperator",
    "env_field",
    "grace_field",
    "unique_env_rule",
]

DEFAULT_IMAGE = "ghcr.io/omnikube/runtime:0.1.0"
"""The runtime image a pipeline runs unless its spec names another."""
NAME_MAX_LENGTH = 40
"""Stage names become parts of object names; 40 leaves room for the pipeline name and a suffix."""
MAX_STAGES = 32
"""Most stages a pipeline may configure; bounds the cost of the CEL rules over `stages`."""
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
"""Names of Secrets, ConfigMaps and PersistentVolumeClaims (RFC 1123 subdomain)."""

StageName = Annotated[str, Field(pattern=NAME_PATTERN, min_length=1, max_length=NAME_MAX_LENGTH)]
"""A stage name as the topology spells it (RFC 1123 label)."""
ObjectName = Annotated[str, Field(pattern=DNS_SUBDOMAIN_PATTERN, min_length=1, max_length=253)]
"""The name of a Kubernetes object in the same namespace."""


class ImagePullPolicy(str, Enum):
    """When the kubelet pulls the image."""

    ALWAYS = "Always"
    IF_NOT_PRESENT = "IfNotPresent"
    NEVER = "Never"


class AcceleratorType(str, Enum):
    """The extended resource a stage's pods request, or `none` for CPU only."""

    NVIDIA_GPU = "nvidia.com/gpu"
    ASCEND_910 = "huawei.com/Ascend910"
    AMD_GPU = "amd.com/gpu"
    NONE = "none"


class TolerationOperator(str, Enum):
    """How a toleration matches a taint's value."""

    EXISTS = "Exists"
    EQUAL = "Equal"


class TaintEffect(str, Enum):
    """The taint effect a toleration matches."""

    NO_SCHEDULE = "NoSchedule"
    PREFER_NO_SCHEDULE = "PreferNoSchedule"
    NO_EXECUTE = "NoExecute"


class ConditionStatus(str, Enum):
    """Whether a condition holds."""

    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class SecretKeyRef(KubeModel):
    """One key of a Secret in the object's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="Name of the Secret.")
    key: str = Field(
        min_length=1,
        max_length=253,
        pattern=r"^[-._a-zA-Z0-9]+$",
        description="Key inside the Secret whose value is used.",
    )


class EnvVar(KubeModel):
    """An environment variable set in every container the object runs."""

    name: str = Field(
        min_length=1,
        max_length=128,
        pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$",
        description="Variable name (letters, digits, '-', '_' and '.'; not starting with a digit).",
    )
    value: str = Field("", max_length=32768, description="Variable value; empty when unset.")


class PVCSource(KubeModel):
    """A PersistentVolumeClaim holding the model cache."""

    claim_name: str = Field(
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="Name of a PersistentVolumeClaim in the pipeline's namespace.",
    )


class HostPathSource(KubeModel):
    """A folder on every node holding the model cache."""

    path: str = Field(
        min_length=1,
        max_length=4096,
        pattern=r"^/",
        description="Absolute path of the folder on the node; it must exist on every node a stage may use.",
    )


class ModelCache(KubeModel):
    """Where the stages read model weights from: a PersistentVolumeClaim or a node folder."""

    pvc: PVCSource | None = Field(None, description="Use a PersistentVolumeClaim; set this or hostPath.")
    host_path: HostPathSource | None = Field(None, description="Use a folder on the node; set this or pvc.")
    mount_path: str = Field(
        "/models",
        min_length=1,
        max_length=4096,
        pattern=r"^/",
        description="Absolute path where the cache is mounted in every container; a model given as a "
        "relative path is looked up below it.",
    )
    read_only: Bool = Field(False, description="Mount the cache read-only (the runtime then never downloads into it).")

    validation_rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="has(self.pvc) != has(self.hostPath)",
            message="modelCache: set exactly one of pvc or hostPath",
            check=lambda m: (m.pvc is None) != (m.host_path is None),
        ),
    )


class ResourceRequirements(KubeModel):
    """Compute resources of each container, as in a Pod spec (accelerators are set by `accelerator`)."""

    requests: dict[str, Quantity] = Field(
        default_factory=dict,
        description="Resources the scheduler reserves, by resource name (cpu: 4, memory: 32Gi).",
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict,
        description="Most the container may use, by resource name (memory: 64Gi).",
    )


class Accelerator(KubeModel):
    """The accelerators each replica of a stage requests."""

    type: AcceleratorType = Field(description="Device resource each replica requests from its node; none runs on CPU.")
    count: Int = Field(
        1,
        ge=0,
        le=64,
        description="Devices per replica; must be 1 or more unless type is none. Tensor-parallel "
        "engine args should match it; a diffusion stage splits its denoiser over all of them (engine arg "
        "sequence_parallel, auto by default).",
    )

    validation_rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="self.type == 'none' || !has(self.count) || self.count > 0",
            message="accelerator.count: 0 is not allowed when type is nvidia.com/gpu, "
            "huawei.com/Ascend910 or amd.com/gpu; use 1 or more, or set type to none",
            check=lambda m: m.type is AcceleratorType.NONE or m.count > 0,
        ),
    )


class Toleration(KubeModel):
    """A toleration, as in a Pod spec: lets the stage's pods run on nodes with a matching taint."""

    key: str = Field(
        "",
        max_length=316,
        description="Taint key to match; empty matches every key (then operator must be Exists).",
    )
    operator: TolerationOperator = Field(
        TolerationOperator.EQUAL,
        description="Exists matches any value of the key; Equal matches only `value`.",
    )
    value: str = Field("", max_length=63, description="Taint value to match; must be empty with Exists.")
    effect: TaintEffect | None = Field(None, description="Taint effect to match; unset matches every effect.")
    toleration_seconds: Int | None = Field(
        None,
        ge=0,
        description="With effect NoExecute: seconds the pod stays bound after the taint appears; unset means forever.",
    )

    validation_rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="!has(self.operator) || self.operator != 'Exists' || !has(self.value) || self.value == ''",
            message="tolerations.value: must be empty when operator is Exists; drop value or use Equal",
            check=lambda m: m.operator is not TolerationOperator.EXISTS or m.value == "",
        ),
        Rule(
            cel="(has(self.key) && self.key != '') || (has(self.operator) && self.operator == 'Exists')",
            message="tolerations.key: an empty key matches every taint and needs operator Exists; "
            "set key, or set operator to Exists",
            check=lambda m: m.key != "" or m.operator is TolerationOperator.EXISTS,
        ),
    )


class AutoscalingEngine(str, Enum):
    """Which autoscaler the operator creates for a stage."""

    KEDA = "keda"
    """A KEDA ScaledObject with Prometheus triggers (KEDA must be installed)."""
    HPA = "hpa"
    """A plain autoscaling/v2 HorizontalPodAutoscaler on a Pods metric (needs a custom-metrics adapter,
    e.g. prometheus-adapter, serving omnikube_stage_requests_running per pod)."""


class AutoscalingMetric(str, Enum):
    """The signal a stage scales on, beside its queue (which every autoscaled stage scales on)."""

    QUEUE = "queue"
    """Only the requests outstanding per replica (targetQueueDepth)."""
    TTFT = "ttft"
    """The pipeline's time to first token, p90 over `windowSeconds`, in seconds."""
    TTFP = "ttfp"
    """The pipeline's time to first media packet (first audio), p90 over `windowSeconds`, in seconds."""
    RTF = "rtf"
    """The pipeline's audio real-time factor (wall-clock over audio seconds), p90 over `windowSeconds`."""
    DENOISING_STEPS = "denoisingSteps"
    """Denoising steps queued or still to run per replica of a diffusion stage."""


AUTOSCALING_SIGNAL_METRICS: dict[AutoscalingMetric, str] = {
    AutoscalingMetric.QUEUE: "omnikube_stage_outstanding_requests",
    AutoscalingMetric.TTFT: "omnikube_time_to_first_token_seconds",
    AutoscalingMetric.TTFP: "omnikube_time_to_first_packet_seconds",
    AutoscalingMetric.RTF: "omnikube_audio_real_time_factor",
    AutoscalingMetric.DENOISING_STEPS: "omnikube_stage_denoising_steps_queued",
}
"""The runtime metric behind each signal (histograms by their base name): the autoscaler builder queries
them and the CRD's descriptions name them, from this one table."""

DEFAULT_AUTOSCALING_METRICS: dict[StageKind, AutoscalingMetric] = {
    StageKind.AR: AutoscalingMetric.TTFT,
    StageKind.GENERATION: AutoscalingMetric.TTFP,
    StageKind.DIFFUSION: AutoscalingMetric.DENOISING_STEPS,
}
"""`autoscaling.metric` when unset, per stage kind (the builder's choice and the CRD's words)."""

DEFAULT_AUTOSCALING_TARGETS: dict[AutoscalingMetric, str] = {
    AutoscalingMetric.TTFT: "2",
    AutoscalingMetric.TTFP: "1",
    AutoscalingMetric.RTF: "800m",
    AutoscalingMetric.DENOISING_STEPS: "200",
}
"""`autoscaling.target` when unset, per metric (queue uses targetQueueDepth)."""

_KIND_EXAMPLES = {StageKind.GENERATION: " (talker, code2wav)"}
AUTOSCALING_P90_SIGNALS = (AutoscalingMetric.TTFT, AutoscalingMetric.TTFP, AutoscalingMetric.RTF)
"""Signals the autoscaler reads as the pipeline's p90 over `windowSeconds` (a histogram); the others are
gauges summed over the stage's replicas and compared per replica."""


def _signal_words(metric: AutoscalingMetric) -> str:
    name = AUTOSCALING_SIGNAL_METRICS[metric]
    return f"p90 of {name}" if metric in AUTOSCALING_P90_SIGNALS else f"{name} per replica"


def _metric_description() -> str:
    """`autoscaling.metric`'s description, written from the tables above so the CRD cannot drift from them."""
    signals = ", ".join(
        f"{m.value} ({_signal_words(m)})" for m in AutoscalingMetric if m is not AutoscalingMetric.QUEUE
    )
    unset = ", ".join(
        f"{metric.value} for {kind.value} stages{_KIND_EXAMPLES.get(kind, '')}"
        for kind, metric in DEFAULT_AUTOSCALING_METRICS.items()
    )
    return f"The stage's own signal, scaled on beside the queue: {signals} or queue (the queue alone). Unset: {unset}."


def _target_description() -> str:
    unset = ", ".join(f"{m.value} {target}" for m, target in DEFAULT_AUTOSCALING_TARGETS.items())
    return (
        "The value of `metric` the autoscaler aims for, above 0: seconds for ttft and ttfp (500m is half a "
        f"second), a ratio for rtf, steps per replica for denoisingSteps. Unset: {unset}."
    )


TARGET_MESSAGE = (
    "autoscaling.target: must be above 0 (at 0 the autoscaler would always want maxReplicas); set it to the "
    "value to aim for, e.g. 500m for half a second of ttft or ttfp, or drop target for the metric's default"
)


def _check_target(value: Any) -> int | str:
    """A quantity above 0 (an integer or a quantity string); the message says what to set."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{value!r} is not a Kubernetes quantity; use an integer or a string like 500m or 2")
    try:
        number = parse_quantity(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a Kubernetes quantity; write it like 500m, 2 or 1.5") from None
    if number <= 0:
        raise ValueError(TARGET_MESSAGE)
    return value


AutoscalingTarget = Annotated[
    int | str,
    PlainValidator(_check_target),
    WithJsonSchema({"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN, "maxLength": 64}),
]
"""`autoscaling.target`: a quantity above 0."""

DEFAULT_PROMETHEUS_ADDRESS = "http://prometheus-operated.monitoring.svc:9090"
"""Where KEDA queries Prometheus unless `autoscaling.prometheusAddress` says otherwise (the Service the
Prometheus Operator creates for a Prometheus in namespace monitoring)."""


class Autoscaling(KubeModel):
    """Scale a stage between two bounds on its queue and its own signal; the operator then never sets its
    replicas. The operator creates a KEDA ScaledObject (or an HPA) that targets the stage's /scale."""

    engine: AutoscalingEngine = Field(
        AutoscalingEngine.KEDA,
        description="keda: a KEDA ScaledObject with Prometheus triggers (install KEDA first; without its "
        "CRDs the pipeline is Degraded with reason AutoscalerUnavailable). hpa: a plain autoscaling/v2 "
        "HorizontalPodAutoscaler on the Pods metric omnikube_stage_requests_running (needs a custom-metrics "
        "adapter such as prometheus-adapter); hpa supports only metric queue.",
    )
    min_replicas: Int = Field(
        1,
        ge=0,
        le=1000,
        description="Fewest replicas the autoscaler keeps. 0 (engine keda only) scales the stage to zero when "
        "idle for scaleDownStabilizationSeconds: the router then holds the stage's requests (up to the "
        "request timeout, then 503 with Retry-After) and counts them in "
        "omnikube_stage_requests_waiting_for_replica, on which KEDA starts a replica.",
    )
    max_replicas: Int = Field(ge=1, le=1000, description="Most replicas the autoscaler creates.")
    target_queue_depth: Int = Field(
        8,
        ge=1,
        le=10000,
        description="Requests outstanding per replica that the autoscaler aims for (router metric "
        "omnikube_stage_outstanding_requests: sent to the replica and not finished, those queued in its "
        "engine included); above it, it adds replicas. Every autoscaled stage scales on it.",
    )
    metric: AutoscalingMetric | None = Field(None, description=_metric_description())
    target: AutoscalingTarget | None = Field(None, description=_target_description())
    window_seconds: Int = Field(
        60,
        ge=15,
        le=3600,
        description=f"Window of the p90 of {', '.join(m.value for m in AUTOSCALING_P90_SIGNALS[:-1])} and "
        f"{AUTOSCALING_P90_SIGNALS[-1].value} (a PromQL rate range).",
    )
    scale_down_stabilization_seconds: Int = Field(
        300,
        ge=0,
        le=3600,
        description="Seconds the load must stay low before replicas are removed.",
    )
    polling_interval_seconds: Int | None = Field(
        None,
        ge=1,
        le=3600,
        description="Seconds between KEDA's queries of Prometheus (the ScaledObject's pollingInterval; engine "
        "keda only). It bounds how long a stage at zero replicas waits before KEDA starts one for a held "
        "request; the HPA's own sync period paces scaling between 1 and maxReplicas. Unset: KEDA's default, 30.",
    )
    prometheus_address: str = Field(
        DEFAULT_PROMETHEUS_ADDRESS,
        max_length=2048,
        pattern=r"^https?://[^\s]+$",
        description="URL of the Prometheus that scrapes the router and stages; KEDA queries it.",
    )

    validation_rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="!has(self.minReplicas) || self.minReplicas <= self.maxReplicas",
            message="autoscaling.minReplicas: must not exceed maxReplicas; lower minReplicas or raise maxReplicas",
            check=lambda m: m.min_replicas <= m.max_replicas,
        ),
        Rule(
            cel="!has(self.engine) || self.engine != 'hpa' || !has(self.metric) || self.metric == 'queue'",
            message="autoscaling.metric: engine hpa scales on the queue only; drop metric (or set it to "
            "queue), or use engine keda",
            check=lambda m: m.engine is not AutoscalingEngine.HPA or m.metric in (None, AutoscalingMetric.QUEUE),
        ),
        Rule(
            cel="!has(self.engine) || self.engine != 'hpa' || !has(self.minReplicas) || self.minReplicas >= 1",
            message="autoscaling.minReplicas: engine hpa cannot scale to zero (a HorizontalPodAutoscaler "
            "needs a feature gate for it); set minReplicas to 1 or more, or use engine keda",
            check=lambda m: m.engine is not AutoscalingEngine.HPA or m.min_replicas >= 1,
        ),
        Rule(
            cel="!has(self.engine) || self.engine != 'hpa' || !has(self.pollingIntervalSeconds)",
            message="autoscaling.pollingIntervalSeconds: sets KEDA's polling; engine hpa has none (the "
            "HorizontalPodAutoscaler syncs at the controller manager's period); drop it, or use engine keda",
            check=lambda m: m.engine is not AutoscalingEngine.HPA or m.polling_interval_seconds is None,
        ),
        Rule(
            cel="!has(self.target) || (has(self.metric) && self.metric != 'queue')",
            message="autoscaling.target: applies to metric ttft, ttfp, rtf or denoisingSteps (the queue's "
            "target is targetQueueDepth); set such a metric too, or drop target",
            check=lambda m: m.target is None or m.metric not in (None, AutoscalingMetric.QUEUE),
        ),
        Rule(
            # The schema's pattern refuses negative strings but an int-or-string's integer escapes it, and 0
            # matches it: CEL's quantity library compares both forms.
            cel="!has(self.target) || (type(self.target) == int ? int(self.target) > 0 : "
            "(isQuantity(string(self.target)) && quantity(string(self.target)).isGreaterThan(quantity('0'))))",
            message=TARGET_MESSAGE,
            check=lambda m: m.target is None or parse_quantity(m.target) > 0,
        ),
    )


class Condition(KubeModel):
    """One aspect of the object's state, as in metav1.Condition."""

    type: str = Field(min_length=1, max_length=316, description="Condition type: Ready, Progressing or Degraded.")
    status: ConditionStatus = Field(description="Whether the condition holds.")
    reason: str = Field(
        "", max_length=1024, description="One CamelCase word a program can match (e.g. NoAcceleratorNode)."
    )
    message: str = Field("", max_length=32768, description="What was observed and what to change, for a person.")
    last_transition_time: str | None = Field(
        None,
        json_schema_extra={"format": "date-time"},
        description="When status last changed (RFC 3339).",
    )
    observed_generation: Int | None = Field(
        None, ge=0, description="metadata.generation the condition was computed from."
    )


DEFAULT_GRACE_SECONDS = 120
"""Default terminationGracePeriodSeconds of stage and router pods: long enough for the requests of
most pipelines to finish during a roll; raise it for long generations."""
MAX_GRACE_SECONDS = 3600


def grace_field(default: int | None, who: str, more: str = "") -> Any:
    """The `terminationGracePeriodSeconds` field of stage and router pods, with one description."""
    unset = f" Unset: {DEFAULT_GRACE_SECONDS}." if default is None else ""
    return Field(
        default,
        ge=1,
        le=MAX_GRACE_SECONDS,
        description=f"Seconds {who} pods get to drain when they are stopped (a roll, a scale-down, an "
        "eviction): they take no new work at once, finish what they run, then exit; what still runs "
        "when the time is up fails with a retriable 503. Set it above your longest request." + more + unset,
    )


class Placement(KubeModel):
    """Scheduling fields shared by a pipeline's stage entries and OmniStages (not a CRD field itself)."""

    accelerator: Accelerator | None = Field(None, description="Accelerators each replica requests; unset runs on CPU.")
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels a node must have to run the stage's pods."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        max_length=32,
        description="Taints the stage's pods tolerate (e.g. huawei.com/Ascend910:NoSchedule).",
    )
    affinity: dict[str, Any] = Field(
        default_factory=dict,
        description="Pod affinity, as in a Pod spec (nodeAffinity, podAffinity, podAntiAffinity); "
        "passed through unchanged.",
    )
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description="CPU, memory and other requests and limits of each replica.",
    )


def unique_env_rule() -> Rule:
    """The rule that environment variable names are unique (shared by both CRDs)."""
    return unique_rule(
        "env",
        "env",
        [("name", "name")],
        message="env: variable names must be unique; keep one entry per name",
    )


def env_field() -> Any:
    """The `env` field, with the same bounds wherever it appears."""
    return Field(
        default_factory=list,
        max_length=64,
        json_schema_extra=list_map("name"),
        description="Environment variables set in every container.",
    )
