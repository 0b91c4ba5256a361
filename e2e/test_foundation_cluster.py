"""The CRDs and the scheduling facts omnikube relies on, against a real control plane.

Everything here runs against a real kube-apiserver (admission, OpenAPI + CEL validation, /scale),
kube-scheduler (extended resources, taints) and kube-controller-manager (Deployments -> Pods);
KWOK stands in for the kubelets of the GPU/NPU/CPU nodes.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import yaml
from clusterlib import REPO, kubectl_json

pytestmark = pytest.mark.cluster

SAMPLES = sorted((REPO / "config" / "samples").glob("*.yaml"))


def _valid_pipeline(name: str = "valid") -> dict:
    return {
        "apiVersion": "omnikube.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": name},
        "spec": {
            "model": "Qwen/Qwen3-Omni-30B-A3B-Instruct",
            "pipeline": "qwen3-omni",
            "stages": [
                {"name": "thinker", "replicas": 1, "accelerator": {"type": "nvidia.com/gpu", "count": 2}},
                {"name": "talker", "replicas": 1, "accelerator": {"type": "nvidia.com/gpu", "count": 1}},
            ],
        },
    }


def _mutate(path: str, value: object):
    """A function that sets `value` at a dotted path (`spec.stages.0.replicas`) in a copy of a valid CR (missing
    objects on the way are made)."""

    def apply(obj: dict) -> dict:
        obj = copy.deepcopy(obj)
        *parents, last = path.split(".")
        node = obj
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
        if value is _DELETE:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
        return obj

    return apply


_DELETE = object()

# (case id, mutation, text the apiserver's message must contain: the offending field)
INVALID = [
    ("missing-model", _mutate("spec.model", _DELETE), "spec.model"),
    ("empty-model", _mutate("spec.model", ""), "spec.model"),
    ("negative-replicas", _mutate("spec.stages.0.replicas", -1), "spec.stages[0].replicas"),
    ("replicas-wrong-type", _mutate("spec.stages.0.replicas", "two"), "spec.stages[0].replicas"),
    ("max-surge-past-100", _mutate("spec.rollout.maxSurge", "150%"), "spec.rollout.maxSurge"),
    ("max-surge-words", _mutate("spec.rollout.maxSurge", "ten"), "spec.rollout.maxSurge"),
    (
        "progress-deadline-zero",
        _mutate("spec.rollout.progressDeadlineSeconds", 0),
        "spec.rollout.progressDeadlineSeconds",
    ),
    (
        "unknown-accelerator",
        _mutate("spec.stages.0.accelerator.type", "nvidia.com/gpu-typo"),
        "spec.stages[0].accelerator.type",
    ),
    ("zero-accelerators", _mutate("spec.stages.0.accelerator.count", 0), "spec.stages[0].accelerator"),
    ("duplicate-stage-names", _mutate("spec.stages.1.name", "thinker"), "spec.stages"),
    ("bad-stage-name", _mutate("spec.stages.0.name", "Thinker_1"), "spec.stages[0].name"),
    (
        "autoscaling-min-over-max",
        _mutate("spec.stages.0.autoscaling", {"minReplicas": 5, "maxReplicas": 2}),
        "spec.stages[0].autoscaling",
    ),
    ("unknown-connector", _mutate("spec.connectors", {"default": "carrier-pigeon"}), "spec.connectors.default"),
    (
        "negative-window",
        _mutate("spec.connectors", {"edges": [{"from": "thinker", "to": "talker", "window": -1}]}),
        "spec.connectors.edges[0].window",
    ),
    ("bad-service-port", _mutate("spec.router", {"service": {"port": 70000}}), "spec.router.service.port"),
    (
        "cache-pvc-and-hostpath",
        _mutate("spec.runtime", {"modelCache": {"pvc": {"claimName": "models"}, "hostPath": {"path": "/m"}}}),
        "spec.runtime.modelCache",
    ),
    ("stages-wrong-type", _mutate("spec.stages", {"name": "thinker"}), "spec.stages"),
    ("unknown-field", _mutate("spec.stages.0.gpus", 2), "gpus"),
    ("name-too-long-for-labels", _mutate("metadata.name", "p" * 64), "metadata.name"),
]


def _apply(cluster, namespace: str, obj: dict, *extra: str):
    return cluster.kubectl("apply", "-n", namespace, "-f", "-", *extra, input=json.dumps(obj), check=False)


def test_crds_are_established_with_printer_columns(cluster) -> None:
    crd = kubectl_json(cluster, "get", "crd", "omnipipelines.omnikube.io")
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]][:3] == ["Ready", "Stages", "Endpoint"]
    assert "op" in crd["spec"]["names"]["shortNames"]
    stage = kubectl_json(cluster, "get", "crd", "omnistages.omnikube.io")
    assert stage["spec"]["versions"][0]["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"


def _explain(cluster, path: str, timeout: float = 60) -> str:
    """`kubectl explain`, waiting for the CRD's schema to reach the OpenAPI document (it lags Established)."""
    deadline = time.monotonic() + timeout
    while True:
        out = cluster.kubectl("explain", path, check=False)
        if out.returncode == 0 or time.monotonic() > deadline:
            assert out.returncode == 0, out.stderr
            return out.stdout
        time.sleep(1)


def test_kubectl_explain_prints_field_descriptions(cluster) -> None:
    out = _explain(cluster, "omnipipeline.spec.stages")
    for field in ("accelerator", "replicas", "engineArgs", "colocateWith", "autoscaling"):
        assert field in out
    # Every field line is followed by its description; no field is left undocumented.
    assert "<no description>" not in out
    accel = _explain(cluster, "omnipipeline.spec.stages.accelerator.type")
    assert "nvidia.com/gpu" in accel and "huawei.com/Ascend910" in accel


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.stem for s in SAMPLES])
def test_samples_apply_and_list(cluster, namespace: str, sample: Path) -> None:
    out = cluster.kubectl("apply", "-n", namespace, "-f", str(sample))
    assert "created" in out.stdout
    name = yaml.safe_load(sample.read_text())["metadata"]["name"]
    listed = cluster.kubectl("get", "omnipipelines", "-n", namespace, "-o", "wide").stdout
    assert name in listed and "READY" in listed and "ENDPOINT" in listed
    short = cluster.kubectl("get", "op", name, "-n", namespace, "-o", "name").stdout
    assert short.strip() == f"omnipipeline.omnikube.io/{name}"


def test_valid_pipeline_is_accepted(cluster, namespace: str) -> None:
    out = _apply(cluster, namespace, _valid_pipeline())
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("case,mutate,field", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_pipeline_is_rejected_naming_the_field(cluster, namespace: str, case, mutate, field) -> None:
    obj = mutate(_valid_pipeline(case))
    out = _apply(cluster, namespace, obj)
    assert out.returncode != 0, f"{case} was accepted"
    assert field in out.stderr, out.stderr
    # Rejected at admission: nothing was stored.
    got = cluster.kubectl("get", "omnipipeline", obj["metadata"]["name"], "-n", namespace, check=False)
    assert got.returncode != 0


AUTOSCALING_LLM = {"metric": "ttft", "maxReplicas": 3}
# (case id, autoscaling of the first stage, the field the message names, words of the message)
INVALID_AUTOSCALING = [
    ("target-zero", AUTOSCALING_LLM | {"target": 0}, "spec.stages[0].autoscaling", "target: must be above 0"),
    ("target-zero-milli", AUTOSCALING_LLM | {"target": "0m"}, "spec.stages[0].autoscaling", "must be above 0"),
    ("target-zero-decimal", AUTOSCALING_LLM | {"target": "0.0"}, "spec.stages[0].autoscaling", "must be above 0"),
    ("target-negative", AUTOSCALING_LLM | {"target": -1}, "spec.stages[0].autoscaling", "must be above 0"),
    ("target-negative-string", AUTOSCALING_LLM | {"target": "-1"}, "spec.stages[0].autoscaling.target", "should match"),
    ("min-over-max", {"minReplicas": 5, "maxReplicas": 2}, "spec.stages[0].autoscaling", "must not exceed maxReplicas"),
    (
        "stabilization-negative",
        {"maxReplicas": 2, "scaleDownStabilizationSeconds": -1},
        "spec.stages[0].autoscaling.scaleDownStabilizationSeconds",
        "greater than or equal to 0",
    ),
]


@pytest.mark.parametrize(
    ("case", "autoscaling", "field", "words"), INVALID_AUTOSCALING, ids=[c[0] for c in INVALID_AUTOSCALING]
)
def test_autoscaling_that_would_misbehave_is_refused_saying_what_to_set(
    cluster, namespace: str, case, autoscaling, field, words
) -> None:
    """A target of 0 (or below) would ask for maxReplicas at any load; the apiserver refuses it with the
    CRD's message, like min over max and a negative stabilization window."""
    obj = _mutate("spec.stages.0.autoscaling", autoscaling)(_valid_pipeline(case))
    out = _apply(cluster, namespace, obj)
    assert out.returncode != 0, f"{case} was accepted"
    assert field in out.stderr and words in out.stderr, out.stderr


def test_autoscaling_targets_above_zero_are_accepted(cluster, namespace: str) -> None:
    for target in (2, "500m", "1.5", "1e-1"):  # both forms of an int-or-string pass the CEL rule
        obj = _mutate("spec.stages.0.autoscaling", AUTOSCALING_LLM | {"target": target})(_valid_pipeline("target-ok"))
        out = _apply(cluster, namespace, obj)
        assert out.returncode == 0, (target, out.stderr)


def _omnistage(name: str) -> dict:
    return {
        "apiVersion": "omnikube.io/v1alpha1",
        "kind": "OmniStage",
        "metadata": {"name": name},
        "spec": {
            "pipeline": "demo",
            "stage": "talker",
            "kind": "ar",
            "replicas": 1,
            "image": "ghcr.io/omnikube/runtime:0.1.0",
            "model": "/models/demo",
            "configMap": "demo-pipeline",
        },
    }


def test_kubectl_scale_changes_omnistage_replicas(cluster, namespace: str) -> None:
    assert _apply(cluster, namespace, _omnistage("demo-talker")).returncode == 0
    cluster.kubectl("scale", "-n", namespace, "omnistage/demo-talker", "--replicas=3")
    got = kubectl_json(cluster, "get", "omnistage", "demo-talker", "-n", namespace)
    assert got["spec"]["replicas"] == 3
    scale = json.loads(
        cluster.kubectl(
            "get", "--raw", f"/apis/omnikube.io/v1alpha1/namespaces/{namespace}/omnistages/demo-talker/scale"
        ).stdout
    )
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3


def _deployment(
    name: str, resources: dict, tolerations: list | None = None, node_selector: dict | None = None, replicas: int = 1
) -> dict:
    pod_spec: dict = {
        "containers": [
            {
                "name": "main",
                "image": "registry.invalid/none:0",
                "resources": {"limits": resources, "requests": resources},
            }
        ]
    }
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": pod_spec},
        },
    }


def _pods(cluster, namespace: str, app: str) -> list[dict]:
    return kubectl_json(cluster, "get", "pods", "-n", namespace, "-l", f"app={app}")["items"]


def _wait_pods(cluster, namespace: str, app: str, count: int, phase: str, timeout: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout
    pods: list[dict] = []
    while time.monotonic() < deadline:
        pods = _pods(cluster, namespace, app)
        if len(pods) == count and all(p["status"].get("phase") == phase for p in pods):
            return pods
        time.sleep(0.5)
    raise AssertionError(
        f"expected {count} {phase} pods for {app}, got "
        f"{[(p['metadata']['name'], p['status'].get('phase')) for p in pods]}"
    )


def test_one_gpu_deployment_runs_on_a_gpu_node(cluster, namespace: str) -> None:
    _apply(cluster, namespace, _deployment("one-gpu", {"nvidia.com/gpu": "1"}))
    (pod,) = _wait_pods(cluster, namespace, "one-gpu", 1, "Running")
    assert pod["spec"]["nodeName"] in {"gpu-node-0", "gpu-node-1"}


def test_nine_gpus_stay_pending_with_a_scheduling_event(cluster, namespace: str) -> None:
    _apply(cluster, namespace, _deployment("nine-gpus", {"nvidia.com/gpu": "9"}))
    (pod,) = _wait_pods(cluster, namespace, "nine-gpus", 1, "Pending")
    name = pod["metadata"]["name"]
    deadline = time.monotonic() + 30
    messages: list[str] = []
    while time.monotonic() < deadline and not messages:
        events = kubectl_json(
            cluster,
            "get",
            "events",
            "-n",
            namespace,
            "--field-selector",
            f"involvedObject.name={name},reason=FailedScheduling",
        )
        messages = [e["message"] for e in events["items"]]
        time.sleep(0.5)
    assert messages and "Insufficient nvidia.com/gpu" in messages[0]
    assert not _pods(cluster, namespace, "nine-gpus")[0]["spec"].get("nodeName")


def test_npu_node_only_takes_pods_that_tolerate_its_taint(cluster, namespace: str) -> None:
    npu = {"huawei.com/Ascend910": "1"}
    _apply(cluster, namespace, _deployment("npu-no-toleration", npu))
    _apply(cluster, namespace, _deployment("plain", {"cpu": "100m"}, replicas=6))
    toleration = [{"key": "huawei.com/Ascend910", "operator": "Exists", "effect": "NoSchedule"}]
    _apply(cluster, namespace, _deployment("npu-tolerated", npu, tolerations=toleration))

    (tolerated,) = _wait_pods(cluster, namespace, "npu-tolerated", 1, "Running")
    assert tolerated["spec"]["nodeName"] == "npu-node-0"
    plain = _wait_pods(cluster, namespace, "plain", 6, "Running")
    assert "npu-node-0" not in {p["spec"]["nodeName"] for p in plain}
    (untolerated,) = _wait_pods(cluster, namespace, "npu-no-toleration", 1, "Pending")
    assert not untolerated["spec"].get("nodeName")
