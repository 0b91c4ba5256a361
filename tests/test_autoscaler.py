"""A stage's autoscaler, offline: the KEDA ScaledObject or HPA `omnikube render` prints for it.

No cluster: `render_pipeline` runs the same builders the reconcile does. Against a real apiserver (KEDA
CRDs installed or absent): e2e/test_autoscale_cluster.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from omni_operator.api import API_VERSION, AutoscalingMetric
from omni_operator.api.common import DEFAULT_AUTOSCALING_TARGETS
from omni_operator.builders.autoscaler import HPA_POD_METRIC, SIGNAL_METRICS, default_metric
from omni_operator.render import RenderError, render_pipeline
from omni_operator.status.conditions import Condition
from omni_operator.status.reasons import Reason
from omni_operator.status.stage_status import stage_conditions
from omni_runtime.metrics import REGISTRY
from omni_runtime.registry import default_registry
from omni_runtime.spec import StageKind

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "config" / "samples"
REGISTRY_OF_PIPELINES = default_registry()


def sample(name: str, stage: str, autoscaling: dict[str, Any]) -> dict[str, Any]:
    """A sample manifest whose `stage` autoscales with `autoscaling`."""
    manifest = yaml.safe_load((SAMPLES / name).read_text())
    entries = manifest["spec"]["stages"]
    entry = next((s for s in entries if s["name"] == stage), None)
    if entry is None:
        entry = {"name": stage}
        entries.append(entry)
    entry["autoscaling"] = autoscaling
    return manifest


def autoscalers(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    objects = render_pipeline(manifest, REGISTRY_OF_PIPELINES)
    return {o["metadata"]["name"]: o for o in objects if o["kind"] in ("ScaledObject", "HorizontalPodAutoscaler")}


def triggers(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in obj["spec"]["triggers"]}


def test_an_ar_stage_scales_on_its_queue_and_the_pipelines_ttft_through_its_scale_subresource() -> None:
    manifest = sample(
        "tiny-chat-cpu.yaml",
        "llm",
        {"minReplicas": 2, "maxReplicas": 6, "targetQueueDepth": 3, "scaleDownStabilizationSeconds": 45},
    )
    made = autoscalers(manifest)
    assert list(made) == ["tiny-chat-llm"]
    scaled = made["tiny-chat-llm"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1" and scaled["kind"] == "ScaledObject"
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": API_VERSION, "kind": "OmniStage", "name": "tiny-chat-llm"}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 6)
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 45
    owner = scaled["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"]) == ("OmniStage", "tiny-chat-llm")
    queue, ttft = triggers(scaled)["queue"], triggers(scaled)["ttft"]
    assert queue["metricType"] == "AverageValue" and queue["metadata"]["threshold"] == "3"
    assert queue["metadata"]["query"] == (
        'sum(omnikube_stage_outstanding_requests{namespace="default",pipeline="tiny-chat",stage=~"llm"})'
    )
    assert ttft["metricType"] == "Value" and ttft["metadata"]["threshold"] == "2"
    assert "histogram_quantile(0.9," in ttft["metadata"]["query"]
    assert "omnikube_time_to_first_token_seconds_bucket" in ttft["metadata"]["query"]
    assert "[60s]" in ttft["metadata"]["query"]
    assert ttft["metadata"]["serverAddress"] == "http://prometheus-operated.monitoring.svc:9090"


def test_each_stage_kind_has_its_default_signal() -> None:
    omni = autoscalers(
        sample("qwen3-omni.yaml", "talker", {"maxReplicas": 4}) | {"metadata": {"name": "omni", "namespace": "ai"}}
    )
    talker = triggers(omni["omni-talker"])  # a generation stage; code2wav runs in its pods
    assert set(talker) == {"queue", "ttfp"}
    assert 'namespace="ai",pipeline="omni"' in talker["ttfp"]["metadata"]["query"]
    assert talker["ttfp"]["metadata"]["threshold"] == "1"
    assert 'stage=~"talker|code2wav"' in talker["queue"]["metadata"]["query"]
    image = autoscalers(sample("qwen-image.yaml", "dit", {"maxReplicas": 4}))["qwen-image-dit"]
    steps = triggers(image)["denoisingsteps"]
    assert steps["metricType"] == "AverageValue" and steps["metadata"]["threshold"] == "200"
    assert steps["metadata"]["query"].startswith("sum(omnikube_stage_denoising_steps_queued{")


def test_metric_and_target_choose_the_signal() -> None:
    manifest = sample("qwen3-omni.yaml", "talker", {"maxReplicas": 3, "metric": "rtf", "target": "500m"})
    rtf = triggers(autoscalers(manifest)["qwen3-omni-talker"])["rtf"]
    assert rtf["metadata"]["threshold"] == "0.5"
    assert "omnikube_audio_real_time_factor_bucket" in rtf["metadata"]["query"]
    queue_only = sample("qwen-image.yaml", "dit", {"maxReplicas": 2, "metric": "queue"})
    assert set(triggers(autoscalers(queue_only)["qwen-image-dit"])) == {"queue"}


def test_engine_hpa_renders_a_plain_hpa_on_a_pods_metric() -> None:
    manifest = sample("tiny-chat-cpu.yaml", "llm", {"engine": "hpa", "maxReplicas": 5, "targetQueueDepth": 4})
    hpa = autoscalers(manifest)["tiny-chat-llm"]
    assert (hpa["apiVersion"], hpa["kind"]) == ("autoscaling/v2", "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "OmniStage"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 5)
    assert hpa["spec"]["metrics"] == [
        {
            "type": "Pods",
            "pods": {"metric": {"name": HPA_POD_METRIC}, "target": {"type": "AverageValue", "averageValue": "4"}},
        }
    ]
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300


@pytest.mark.parametrize(
    ("autoscaling", "words"),
    [
        ({"engine": "hpa", "metric": "ttft", "maxReplicas": 2}, "engine hpa scales on the queue only"),
        ({"target": "2", "maxReplicas": 2}, "autoscaling.target: applies to metric"),
        ({"metric": "queue", "target": "2", "maxReplicas": 2}, "autoscaling.target: applies to metric"),
        ({"maxReplicas": 2, "prometheusAddress": "prometheus:9090"}, "prometheusAddress"),
        ({"engine": "hpa", "minReplicas": 0, "maxReplicas": 2}, "engine hpa cannot scale to zero"),
        ({"metric": "ttft", "target": "0", "maxReplicas": 2}, "autoscaling.target: must be above 0"),
        ({"engine": "hpa", "pollingIntervalSeconds": 5, "maxReplicas": 2}, "engine hpa has none"),
    ],
)
def test_settings_that_would_do_nothing_are_refused(autoscaling: dict[str, Any], words: str) -> None:
    with pytest.raises(RenderError, match=re.escape(words)):
        render_pipeline(sample("tiny-chat-cpu.yaml", "llm", autoscaling), REGISTRY_OF_PIPELINES)


def test_a_stage_without_autoscaling_gets_no_autoscaler() -> None:
    manifest = yaml.safe_load((SAMPLES / "qwen3-omni.yaml").read_text())
    assert autoscalers(manifest) == {}


def exported_names() -> set[str]:
    """Every series name the runtime's registry can export (a histogram's _bucket, _sum and _count too,
    which appear among its samples only once a label set has been observed)."""
    names = set()
    for family in REGISTRY.collect():
        names.add(family.name)
        names |= {s.name for s in family.samples}
        if family.type == "histogram":
            names |= {f"{family.name}_{suffix}" for suffix in ("bucket", "sum", "count")}
        if family.type == "counter":
            names.add(f"{family.name}_total")
    return names


def test_every_metric_a_rendered_query_names_exists_in_the_runtime() -> None:
    names = exported_names()
    assert set(SIGNAL_METRICS.values()) | {HPA_POD_METRIC} <= names
    queried = set()
    for name, stage, metric in [
        ("tiny-chat-cpu.yaml", "llm", None),
        ("qwen3-omni.yaml", "talker", None),
        ("qwen3-omni.yaml", "thinker", "rtf"),
        ("qwen-image.yaml", "dit", None),
    ]:
        scaling: dict[str, Any] = {"maxReplicas": 2} | ({"metric": metric} if metric else {})
        for obj in autoscalers(sample(name, stage, scaling)).values():
            for trigger in obj["spec"]["triggers"]:
                queried |= set(re.findall(r"\bomnikube_[a-z0-9_]+", trigger["metadata"]["query"]))
    assert len(queried) >= 5
    assert queried <= names, f"queries name metrics the runtime does not export: {sorted(queried - names)}"


def test_a_stage_without_its_autoscaler_is_degraded_yet_ready_while_its_pods_serve() -> None:
    stage = {"metadata": {"generation": 1}, "spec": {"stage": "llm", "replicas": 1}}
    deployment = {
        "metadata": {"generation": 1},
        "status": {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1,
                   "availableReplicas": 1},
    }  # fmt: skip
    missing = Condition("Degraded", "True", Reason.AUTOSCALER_UNAVAILABLE, "install KEDA")
    _, conditions = stage_conditions(stage, deployment, [], autoscaler_problem=missing)
    by_type = {c.type: c for c in conditions}
    assert by_type["Ready"].status == "True"
    assert by_type["Degraded"].status == "True" and by_type["Degraded"].reason is Reason.AUTOSCALER_UNAVAILABLE


def test_every_metric_the_readme_and_the_crds_name_exists_in_the_runtime() -> None:
    texts = [ROOT / "README.md", *sorted((ROOT / "crds").glob("*.yaml"))]
    named = {n for path in texts for n in re.findall(r"\bomnikube_[a-z0-9_]+", path.read_text())}
    assert {"omnikube_stage_denoising_steps_queued", "omnikube_time_to_first_packet_seconds"} <= named
    names = exported_names()
    assert named <= names, f"the docs name metrics the runtime does not export: {sorted(named - names)}"


def test_a_stage_that_scales_from_zero_activates_on_the_requests_the_router_holds() -> None:
    manifest = sample("qwen3-omni.yaml", "talker", {"minReplicas": 0, "maxReplicas": 2})
    objects = render_pipeline(manifest, REGISTRY_OF_PIPELINES)
    scaled = next(o for o in objects if o["kind"] == "ScaledObject")
    assert scaled["spec"]["minReplicaCount"] == 0 and scaled["spec"]["cooldownPeriod"] == 300
    assert "pollingInterval" not in scaled["spec"]  # KEDA's default, 30 s
    quick = sample("qwen3-omni.yaml", "talker", {"minReplicas": 0, "maxReplicas": 2, "pollingIntervalSeconds": 5})
    quick_scaled = next(o for o in render_pipeline(quick, REGISTRY_OF_PIPELINES) if o["kind"] == "ScaledObject")
    assert quick_scaled["spec"]["pollingInterval"] == 5  # how soon a held request starts a replica
    query = triggers(scaled)["queue"]["metadata"]["query"]
    assert "omnikube_stage_requests_waiting_for_replica" in query and "or vector(0)" in query
    stage = next(o for o in objects if o["kind"] == "OmniStage" and o["spec"]["stage"] == "talker")
    assert stage["spec"]["replicas"] == 0
    # The router learns which stages may have no replica: the talker and code2wav, which shares its pods.
    config = json.loads(next(o for o in objects if o["kind"] == "ConfigMap")["data"]["resolved.json"])
    assert sorted(config["scale_from_zero"]) == ["code2wav", "talker"]


def test_the_crd_names_the_defaults_and_metrics_the_builder_uses() -> None:
    """One table (api/common.py) serves the builder and the CRD's words: each stage kind's default signal,
    each signal's default target and metric, as `kubectl explain` shows them."""
    crd = yaml.safe_load((ROOT / "crds" / "omnistages.omnikube.io.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    fields = schema["properties"]["spec"]["properties"]["autoscaling"]["properties"]
    metric_words, target_words = fields["metric"]["description"], fields["target"]["description"]
    for kind in StageKind:
        assert f"{default_metric(kind).value} for {kind.value} stages" in metric_words
    for metric, name in SIGNAL_METRICS.items():
        if metric is AutoscalingMetric.QUEUE:
            continue
        assert f"{metric.value} {DEFAULT_AUTOSCALING_TARGETS[metric]}" in target_words
        # The words say how the builder reads the signal: the pipeline's p90 over the window, or per replica.
        query = autoscaler_queries_for(metric)
        if "histogram_quantile(0.9," in query:
            assert (
                f"{metric.value} (p90 of {name})" in metric_words
                and metric.value in fields["windowSeconds"]["description"]
            )
        else:
            assert f"{metric.value} ({name} per replica)" in metric_words and query.startswith(f"sum({name}{{")


def autoscaler_queries_for(metric: AutoscalingMetric) -> str:
    """The query of the trigger that a talker autoscaled on `metric` gets."""
    manifest = sample("qwen3-omni.yaml", "talker", {"maxReplicas": 2, "metric": metric.value})
    return triggers(autoscalers(manifest)["qwen3-omni-talker"])[metric.value.lower()]["metadata"]["query"]
