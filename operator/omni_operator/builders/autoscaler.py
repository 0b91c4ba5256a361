"""OmniStage with `autoscaling` -> a KEDA ScaledObject (or a plain HPA) that scales it through /scale.

Every autoscaled stage scales on its queue: the router's outstanding works on the stage's replicas, per
replica (KEDA divides an AverageValue by the current replica count). Beside it each stage scales on its
own signal, chosen by `autoscaling.metric` or by its kind: the pipeline's TTFT p90 for ar stages, its
TTFP p90 for generation stages (talker, code2wav), the denoising steps waiting per replica for
diffusion stages. The HPA KEDA makes takes the largest replica count any trigger asks for.
"""

from __future__ import annotations

from typing import Any

from omni_operator.api import API_VERSION, AutoscalingEngine, AutoscalingMetric, OmniStage, parse_quantity
from omni_operator.api.common import (
    AUTOSCALING_P90_SIGNALS,
    AUTOSCALING_SIGNAL_METRICS,
    DEFAULT_AUTOSCALING_METRICS,
    DEFAULT_AUTOSCALING_TARGETS,
    Autoscaling,
)
from omni_operator.builders.meta import labels, owner_reference, with_hash
from omni_runtime.spec import StageKind

__all__ = [
    "HPA_API_VERSION",
    "HPA_POD_METRIC",
    "KEDA_API_VERSION",
    "SIGNAL_METRICS",
    "WAITING_METRIC",
    "autoscaler_queries",
    "build_stage_autoscaler",
    "default_metric",
]

KEDA_API_VERSION = "keda.sh/v1alpha1"
HPA_API_VERSION = "autoscaling/v2"
HPA_POD_METRIC = "omnikube_stage_requests_running"
"""The per-pod metric an `engine: hpa` autoscaler reads through the custom-metrics API."""
WAITING_METRIC = "omnikube_stage_requests_waiting_for_replica"
"""Requests the router holds for a stage with no replica: what KEDA activates a stage at zero on."""

SIGNAL_METRICS = AUTOSCALING_SIGNAL_METRICS
"""The runtime metric behind each signal (histograms by their base name): the CRD's table, so the
queries and the field descriptions name the same metrics."""


def default_metric(kind: StageKind) -> AutoscalingMetric:
    """The signal a stage of `kind` scales on when `autoscaling.metric` is unset."""
    return DEFAULT_AUTOSCALING_METRICS[kind]


def _number(value: Any) -> str:
    """A quantity as the plain decimal KEDA's threshold wants (`500m` -> `0.5`)."""
    text = format(parse_quantity(value).normalize(), "f")
    return text


def autoscaler_queries(stage: OmniStage, namespace: str) -> list[tuple[AutoscalingMetric, str, str, str]]:
    """(signal, PromQL, target, KEDA metricType) per trigger of an autoscaled stage: the queue first."""
    scaling = stage.spec.autoscaling
    assert scaling is not None, "only autoscaled stages have queries"
    pipeline = stage.spec.pipeline
    members = "|".join([stage.spec.stage, *stage.spec.colocated])
    router = f'namespace="{namespace}",pipeline="{pipeline}"'
    own = f'{router},stage=~"{members}"'
    queue = f"sum({SIGNAL_METRICS[AutoscalingMetric.QUEUE]}{{{own}}})"
    if scaling.min_replicas == 0:
        # At zero replicas nothing is outstanding: the requests the router holds are the demand.
        queue = f"({queue} or vector(0)) + (sum({WAITING_METRIC}{{{own}}}) or vector(0))"
    out = [(AutoscalingMetric.QUEUE, queue, str(scaling.target_queue_depth), "AverageValue")]
    metric = scaling.metric or default_metric(StageKind(stage.spec.kind))
    if metric is AutoscalingMetric.QUEUE:
        return out
    target = _number(scaling.target if scaling.target is not None else DEFAULT_AUTOSCALING_TARGETS[metric])
    name = SIGNAL_METRICS[metric]
    if metric in AUTOSCALING_P90_SIGNALS:
        window = f"{scaling.window_seconds}s"
        query = f"histogram_quantile(0.9, sum by (le) (rate({name}_bucket{{{router}}}[{window}])))"
        out.append((metric, query, target, "Value"))
    else:
        out.append((metric, f"sum({name}{{{own}}})", target, "AverageValue"))
    return out


def _meta(stage: OmniStage) -> dict[str, Any]:
    return {
        "name": stage.metadata.name,
        "namespace": stage.metadata.namespace,
        "labels": labels(stage.spec.pipeline, "autoscaler", stage.spec.stage),
        "ownerReferences": [owner_reference(stage)],
    }


def _scale_target(stage: OmniStage) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": stage.kind, "name": stage.metadata.name}


def _behavior(scaling: Autoscaling) -> dict[str, Any]:
    return {"scaleDown": {"stabilizationWindowSeconds": scaling.scale_down_stabilization_seconds}}


def build_stage_autoscaler(stage: OmniStage) -> dict[str, Any] | None:
    """The ScaledObject (engine keda) or HorizontalPodAutoscaler (engine hpa) of an OmniStage with
    autoscaling, named and owned as the stage; None for a stage without autoscaling."""
    scaling = stage.spec.autoscaling
    if scaling is None:
        return None
    if scaling.engine is AutoscalingEngine.HPA:
        return with_hash(
            {
                "apiVersion": HPA_API_VERSION,
                "kind": "HorizontalPodAutoscaler",
                "metadata": _meta(stage),
                "spec": {
                    "scaleTargetRef": _scale_target(stage),
                    "minReplicas": scaling.min_replicas,
                    "maxReplicas": scaling.max_replicas,
                    "metrics": [
                        {
                            "type": "Pods",
                            "pods": {
                                "metric": {"name": HPA_POD_METRIC},
                                "target": {"type": "AverageValue", "averageValue": str(scaling.target_queue_depth)},
                            },
                        }
                    ],
                    "behavior": _behavior(scaling),
                },
            }
        )
    triggers = [
        {
            "type": "prometheus",
            "name": signal.value.lower(),
            "metricType": metric_type,
            "metadata": {
                "serverAddress": scaling.prometheus_address,
                "query": query,
                "threshold": target,
                # No samples yet (no traffic since start) means no load, not an error.
                "ignoreNullValues": "true",
            },
        }
        for signal, query, target, metric_type in autoscaler_queries(stage, stage.metadata.namespace)
    ]
    return with_hash(
        {
            "apiVersion": KEDA_API_VERSION,
            "kind": "ScaledObject",
            "metadata": _meta(stage),
            "spec": {
                "scaleTargetRef": _scale_target(stage),
                "minReplicaCount": scaling.min_replicas,
                "maxReplicaCount": scaling.max_replicas,
                # How long KEDA waits, once idle, before it takes the stage from 1 replica to 0.
                "cooldownPeriod": scaling.scale_down_stabilization_seconds,
                **(
                    {"pollingInterval": scaling.polling_interval_seconds}
                    if scaling.polling_interval_seconds is not None
                    else {}
                ),
                "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(scaling)}},
                "triggers": triggers,
            },
        }
    )
