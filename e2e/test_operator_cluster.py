"""The operator against the real control plane: placement, convergence, idempotence, status, scaling.

Real: kube-apiserver (admission, server-side apply, audit log), kube-scheduler (GPU/NPU placement),
kube-controller-manager (Deployments, garbage collection, HPA), the operator as its own process.
KWOK plays the kubelets, so pods become Running/Ready without running containers (the pod runner of
the end-to-end tier runs them for real).
"""

from __future__ import annotations

import datetime as dt
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from clusterlib import (
    REPO,
    apply,
    condition,
    keda_crd,
    kubectl_json,
    stage_deployment,
    stop_process_group,
    wait_established,
    wait_for,
)
from prometheus_client.parser import text_string_to_metric_families

from localcluster import audit_time, free_port
from omni_operator.builders.pipeline_objects import router_name
from omni_operator.builders.trust import key_secret_name
from omni_operator.metrics import STAGE_REPLICAS_DESIRED

pytestmark = pytest.mark.cluster

OPERATOR_AGENT = "omnikube-operator/"
SAMPLES = REPO / "config" / "samples"


class OperatorProcess:
    """`omnikube operator` as a real process; its log is kept for failure messages."""

    def __init__(self, cluster, log_path: Path, identity: str) -> None:
        self.cluster, self.log_path, self.identity = cluster, log_path, identity
        self.metrics_port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> OperatorProcess:
        env = {**self.cluster.env(), "POD_NAME": self.identity, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "omni_runtime.cli",
                    "operator",
                    "--kubeconfig",
                    str(self.cluster.kubeconfig),
                    "--lease-namespace",
                    "default",
                    "--resync-seconds",
                    "600",
                    "--metrics-port",
                    str(self.metrics_port),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        stop_process_group(self.proc, sig)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """One sample of the operator's /metrics; None when it has no such sample or does not answer."""
        try:
            text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5, trust_env=False).text
        except httpx.TransportError:
            return None
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == (labels or {}):
                    return sample.value
        return None

    def wait_started(self) -> None:
        """Until the process serves /metrics: it has imported everything and its election loop runs.

        Load-bound: starting the interpreter and importing kopf and kubernetes_asyncio costs about 3 s of
        CPU, which is 15-30 s of wall time on a loaded 2-core CI machine (measured at load average 20),
        so the timeout is generous; the waits on the operator's own behaviour come after this one."""
        wait_for(
            lambda: self.metric("omnikube_operator_leader") is not None, 120, f"{self.identity} to start", self.log
        )

    def desired_replicas(self, namespace: str, pipeline: str, stage: str) -> float | None:
        """The operator's omnikube_operator_stage_replicas_desired for one stage, from its /metrics."""
        return self.metric(STAGE_REPLICAS_DESIRED, {"namespace": namespace, "pipeline": pipeline, "stage": stage})


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory) -> Iterator[OperatorProcess]:
    op = OperatorProcess(cluster, tmp_path_factory.mktemp("operator") / "operator.log", "operator-a").start()
    yield op
    op.stop()


def get(cluster, namespace: str, kind: str, name: str) -> dict | None:
    out = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def wait_ready(
    cluster, operator, namespace: str, name: str, timeout: float = 90, showing: Callable[[dict], bool] | None = None
) -> dict:
    """The pipeline once Ready for its current generation and, with `showing`, once its status shows that too.

    `observedGeneration` covers only the pipeline's own spec: a change its stages see later (an HPA
    scaling an OmniStage through /scale) reaches the pipeline's status on a later reconcile, so a status
    that is Ready for the current generation can still be the one written before that change."""

    def ready():
        obj = get(cluster, namespace, "omnipipeline", name)
        return (
            obj
            if obj
            and condition(obj, "Ready").get("status") == "True"
            and obj["status"].get("observedGeneration") == obj["metadata"]["generation"]
            and (showing is None or showing(obj["status"]))
            else None
        )

    return wait_for(
        ready,
        timeout,
        f"OmniPipeline {name} Ready",
        lambda: (
            json.dumps((get(cluster, namespace, "omnipipeline", name) or {}).get("status"), indent=1)
            + "\n"
            + operator.log()
        ),
    )


def sample(name: str) -> dict:
    return yaml.safe_load((SAMPLES / f"{name}.yaml").read_text())


def pipeline(name: str, topology: str, stages: list[dict], **spec) -> dict:
    return {
        "apiVersion": "omnikube.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": name},
        "spec": {"model": f"/models/{name}", "pipeline": topology, "stages": stages, **spec},
    }


def audit_events(cluster, offset: int = 0) -> list[dict]:
    """The audit log's events from byte `offset` on (the log only grows, so a test can read what came after
    a size it noted); a last line still being written is left for the next read."""
    with open(cluster.audit_log, "rb") as log:
        log.seek(offset)
        lines = log.read().split(b"\n")
    return [json.loads(line) for line in lines[:-1] if line.strip()]


def _by_operator(event: dict) -> bool:
    return event.get("userAgent", "").startswith(OPERATOR_AGENT)


def operator_writes(
    cluster, namespace: str, start: dt.datetime, end: dt.datetime | None = None, offset: int = 0
) -> list[str]:
    """Write requests the operator made in `namespace` received at or after `start` (and before `end`),
    compared to the microsecond of the audit log's own timestamps."""
    out = []
    for event in audit_events(cluster, offset):
        ref = event.get("objectRef", {})
        if not _by_operator(event) or ref.get("namespace") != namespace or event["verb"] in ("get", "list", "watch"):
            continue
        if audit_time(event) >= start and (end is None or audit_time(event) < end):
            out.append(f"{event['verb']} {ref.get('resource')}/{ref.get('name')}")
    return out


def touch(cluster, namespace: str, name: str, value: str) -> tuple[dt.datetime, int]:
    """Annotate OmniPipeline `name` (no spec change). Returns when the apiserver received that write (from
    its audit event) and the audit log's size before it (where later reads can start)."""
    offset = cluster.audit_log.stat().st_size
    cluster.kubectl("annotate", "--overwrite", "omnipipeline", name, "-n", namespace, f"example.com/touched={value}")

    def received() -> dt.datetime | None:
        for event in audit_events(cluster, offset):
            ref = event.get("objectRef", {})
            if (
                event["verb"] == "patch"
                and not _by_operator(event)
                and (ref.get("namespace"), ref.get("name"))
                == (
                    namespace,
                    name,
                )
            ):
                return audit_time(event)
        return None

    # In blocking mode the event is written as the response goes out: it may land just after kubectl returns.
    return wait_for(received, 30, f"the audit event of annotating {name}"), offset


def operator_read_after(cluster, namespace: str, name: str, after: dt.datetime, offset: int) -> dt.datetime:
    """When the operator first read OmniPipeline `name` after `after`: every reconcile of a pipeline starts
    with that read, so this is the start of a reconcile that saw everything before `after`."""

    def read() -> dt.datetime | None:
        for event in audit_events(cluster, offset):
            ref = event.get("objectRef", {})
            if (
                _by_operator(event)
                and event["verb"] == "get"
                and (ref.get("resource"), ref.get("namespace"), ref.get("name")) == ("omnipipelines", namespace, name)
                and audit_time(event) > after
            ):
                return audit_time(event)
        return None

    return wait_for(
        read,
        60,
        f"the operator to reconcile {name} after {after.isoformat()} (no read of it in the audit log: a cluster "
        "started before its audit policy logged OmniPipeline reads?)",
    )


def create_model_cache_pvc(cluster, namespace: str, claim: str) -> None:
    """A PersistentVolume on a host folder and a claim bound to it, as a cluster admin would provide."""
    pv = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"{namespace}-{claim}"},
        "spec": {
            "capacity": {"storage": "1Ti"},
            "accessModes": ["ReadOnlyMany", "ReadWriteMany"],
            "storageClassName": "",
            "hostPath": {"path": "/var/lib/omnikube/models"},
            "claimRef": {"namespace": namespace, "name": claim},
        },
    }
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": claim},
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "storageClassName": "",
            "volumeName": pv["metadata"]["name"],
            "resources": {"requests": {"storage": "1Ti"}},
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(pv))
    apply(cluster, namespace, pvc)


def deployments(cluster, namespace: str, pipeline_name: str) -> dict[str, dict]:
    """The pipeline's Deployments by name; a stage's by its OmniStage's name (one generation at a time)."""
    items = kubectl_json(cluster, "get", "deployments", "-n", namespace, "-l", f"omnikube.io/pipeline={pipeline_name}")[
        "items"
    ]
    out = {}
    for d in items:
        owners = [r["name"] for r in d["metadata"].get("ownerReferences", []) if r["kind"] == "OmniStage"]
        out[owners[0] if owners else d["metadata"]["name"]] = d
    return out


def template_hashes(cluster, namespace: str, pipeline_name: str) -> dict[str, str]:
    return {
        n: d["spec"]["template"]["metadata"]["annotations"]["omnikube.io/template-hash"]
        for n, d in deployments(cluster, namespace, pipeline_name).items()
    }


# --- placement and readiness ---------------------------------------------------------------------


def test_qwen3_omni_lands_on_gpu_nodes_and_becomes_ready(cluster, operator, namespace) -> None:
    obj = sample("qwen3-omni")
    cluster.kubectl("create", "secret", "generic", "hf-token", "-n", namespace, "--from-literal=token=x")
    apply(cluster, namespace, obj)
    cond = wait_for(
        lambda: (lambda c: c if c.get("status") == "True" else None)(
            condition(get(cluster, namespace, "omnipipeline", obj["metadata"]["name"]) or {}, "Degraded")
        ),
        60,
        "Degraded without the model cache PVC",
        operator.log,
    )
    assert cond["reason"] == "ModelCacheMissing" and "model-cache" in cond["message"]
    create_model_cache_pvc(cluster, namespace, "model-cache")
    ready = wait_ready(cluster, operator, namespace, obj["metadata"]["name"])
    name = obj["metadata"]["name"]
    assert ready["status"]["stagesReady"] == "3/3"
    assert ready["status"]["endpoint"] == f"http://{name}-router.{namespace}.svc:8000/v1"
    assert [s["name"] for s in ready["status"]["stages"]] == ["thinker", "talker", "code2wav"]
    # code2wav shares the talker's pods: two OmniStages, talker's pod has two containers.
    stages = kubectl_json(cluster, "get", "omnistages", "-n", namespace)["items"]
    assert sorted(s["spec"]["stage"] for s in stages) == ["talker", "thinker"]
    pods = kubectl_json(cluster, "get", "pods", "-n", namespace, "-l", "omnikube.io/pipeline=" + name)["items"]
    by_stage = {}
    for pod in pods:
        by_stage.setdefault(pod["metadata"]["labels"].get("omnikube.io/stage", "router"), []).append(pod)
    for stage, gpus in (("thinker", "2"), ("talker", "1")):
        (pod,) = by_stage[stage]
        assert pod["spec"]["nodeName"].startswith("gpu-node-")
        assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert [c["name"] for c in by_stage["talker"][0]["spec"]["containers"]] == ["talker", "code2wav"]
    # thinker->talker uses mooncake: the pipeline's one master runs in a Deployment of its own, found
    # through its headless Service; the router pod and the router Service stay free of it.
    router = get(cluster, namespace, "deployment", f"{name}-router")
    assert [c["name"] for c in router["spec"]["template"]["spec"]["containers"]] == ["router"]
    master = get(cluster, namespace, "deployment", f"{name}-mooncake")
    assert master is not None and master["spec"]["replicas"] == 1
    assert get(cluster, namespace, "service", f"{name}-mooncake")["spec"]["clusterIP"] == "None"
    assert {p["name"] for p in get(cluster, namespace, "service", f"{name}-router")["spec"]["ports"]} == {"http"}
    events = kubectl_json(
        cluster, "get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name},reason=Ready"
    )["items"]
    assert events, "a Ready event is posted on the pipeline"


def test_ascend_pipeline_lands_only_on_the_npu_node(cluster, operator, namespace) -> None:
    obj = sample("ascend-chat")
    create_model_cache_pvc(cluster, namespace, "model-cache")
    apply(cluster, namespace, obj)
    wait_ready(cluster, operator, namespace, obj["metadata"]["name"])
    pods = kubectl_json(cluster, "get", "pods", "-n", namespace, "-l", "omnikube.io/stage=llm")["items"]
    assert pods and {p["spec"]["nodeName"] for p in pods} == {"npu-node-0"}


def test_more_gpus_than_any_node_has_is_degraded_with_the_reason(cluster, operator, namespace) -> None:
    apply(
        cluster,
        namespace,
        pipeline("too-big", "text-chat", [{"name": "llm", "accelerator": {"type": "nvidia.com/gpu", "count": 9}}]),
    )

    def degraded():
        obj = get(cluster, namespace, "omnipipeline", "too-big")
        cond = condition(obj or {}, "Degraded")
        return cond if cond.get("status") == "True" else None

    cond = wait_for(degraded, 60, "Degraded", operator.log)
    assert cond["reason"] == "InsufficientAccelerator"
    assert "nvidia.com/gpu" in cond["message"] and "stage llm" in cond["message"]
    obj = get(cluster, namespace, "omnipipeline", "too-big")
    assert condition(obj, "Ready")["status"] == "False"
    events = kubectl_json(
        cluster,
        "get",
        "events",
        "-n",
        namespace,
        "--field-selector",
        "involvedObject.name=too-big,reason=InsufficientAccelerator",
    )["items"]
    assert events and events[0]["type"] == "Warning"


@pytest.mark.parametrize(
    "stages,reason,words",
    [
        ([{"name": "no-such-stage"}], "UnknownStage", ["no-such-stage", "llm"]),
    ],
    ids=["unknown-stage"],
)
def test_spec_problems_the_schema_cannot_see_are_degraded(cluster, operator, namespace, stages, reason, words) -> None:
    apply(cluster, namespace, pipeline("bad", "text-chat", stages))

    def degraded():
        cond = condition(get(cluster, namespace, "omnipipeline", "bad") or {}, "Degraded")
        return cond if cond.get("status") == "True" else None

    cond = wait_for(degraded, 30, "Degraded", operator.log)
    assert cond["reason"] == reason
    assert all(w in cond["message"] for w in words)
    assert not kubectl_json(cluster, "get", "omnistages", "-n", namespace)["items"], "nothing is created"


def test_an_invalid_engine_arg_is_degraded_and_starts_no_pod(cluster, operator, namespace) -> None:
    """An SD3 stage with `engineArgs: {quantization: fp9}` (fp8 is the only quantization): the operator reports
    it at reconcile, naming the stage and the key, and creates nothing that would start a pod (the pipeline used
    to turn Ready and its pod to exit EngineFailed)."""
    stages = [{"name": "dit", "engineArgs": {"quantization": "fp9"}}]
    apply(cluster, namespace, pipeline("sd3", "stable-diffusion-3", stages))

    def degraded():
        cond = condition(get(cluster, namespace, "omnipipeline", "sd3") or {}, "Degraded")
        return cond if cond.get("status") == "True" else None

    cond = wait_for(degraded, 30, "Degraded InvalidEngineArgs", operator.log)
    assert cond["reason"] == "InvalidEngineArgs"
    assert all(w in cond["message"] for w in ("stage 'dit'", "quantization", "'fp9'", "'fp8'")), cond["message"]
    ready = condition(get(cluster, namespace, "omnipipeline", "sd3"), "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidEngineArgs")
    for kind in ("omnistages", "deployments", "pods"):
        assert not kubectl_json(cluster, "get", kind, "-n", namespace)["items"], f"no {kind} are created"
    selector = "involvedObject.name=sd3,reason=InvalidEngineArgs"
    events = wait_for(  # the operator posts the Event after it wrote the status
        lambda: kubectl_json(cluster, "get", "events", "-n", namespace, "--field-selector", selector)["items"] or None,
        30,
        "an InvalidEngineArgs Event",
        operator.log,
    )
    assert events[0]["type"] == "Warning"


def test_unknown_pipeline_and_missing_connector_are_degraded(cluster, operator, namespace) -> None:
    apply(cluster, namespace, pipeline("nopipe", "no-such-topology", []))
    # shm between two stages in different pods cannot work.
    apply(
        cluster,
        namespace,
        pipeline(
            "noconn",
            "prompt-enhanced-t2i",
            [],
            connectors={"edges": [{"from": "enhancer", "to": "dit", "kind": "shm"}]},
        ),
    )
    # An edge the topology does not have.
    apply(
        cluster,
        namespace,
        pipeline(
            "noedge",
            "prompt-enhanced-t2i",
            [],
            connectors={"edges": [{"from": "dit", "to": "enhancer", "kind": "inline"}]},
        ),
    )
    for name, reason, word in (
        ("nopipe", "UnknownPipeline", "text-chat"),
        ("noconn", "NoUsableConnector", "shm"),
        ("noedge", "UnknownEdge", "dit->enhancer"),
    ):
        cond = wait_for(
            lambda n=name: (lambda c: c if c.get("status") == "True" else None)(
                condition(get(cluster, namespace, "omnipipeline", n) or {}, "Degraded")
            ),
            30,
            f"{name} Degraded",
            operator.log,
        )
        assert cond["reason"] == reason and word in cond["message"]


def test_missing_secret_is_degraded_until_created(cluster, operator, namespace) -> None:
    obj = pipeline(
        "needs-token", "text-chat", [{"name": "llm"}], runtime={"hfTokenSecret": {"name": "hf", "key": "token"}}
    )
    apply(cluster, namespace, obj)
    cond = wait_for(
        lambda: (lambda c: c if c.get("reason") == "SecretMissing" else None)(
            condition(get(cluster, namespace, "omnipipeline", "needs-token") or {}, "Degraded")
        ),
        30,
        "SecretMissing",
        operator.log,
    )
    assert "hf" in cond["message"] and "kubectl create secret" in cond["message"]
    cluster.kubectl("create", "secret", "generic", "hf", "-n", namespace, "--from-literal=token=x")
    wait_ready(cluster, operator, namespace, "needs-token", timeout=90)


# --- idempotence and convergence -----------------------------------------------------------------


def test_unchanged_spec_causes_no_writes(cluster, operator, namespace) -> None:
    """A touch that changes no spec is reconciled, and that reconcile writes nothing.

    The operator reconciles one key at a time: its reconcile of the touched pipeline starts with a read of it
    after the touch and has ended before the read that follows a second touch. Every write of that reconcile
    lies between the first touch and that later read; no fixed window lets a slow operator pass."""
    apply(cluster, namespace, pipeline("steady", "prompt-enhanced-t2i", [{"name": "enhancer"}, {"name": "dit"}]))
    wait_ready(cluster, operator, namespace, "steady")
    # Touch the pipeline without changing its spec: an event, and a full reconcile, but nothing to do.
    touched, offset = touch(cluster, namespace, "steady", "1")
    operator_read_after(cluster, namespace, "steady", touched, offset)
    fence, _ = touch(cluster, namespace, "steady", "2")
    done = operator_read_after(cluster, namespace, "steady", fence, offset)
    # In this namespace only: a same-named pipeline of an earlier test, its namespace being deleted, is
    # still reconciled (and refused) meanwhile.
    writes = operator_writes(cluster, namespace, touched, done, offset)
    assert writes == [], writes


def test_changing_engine_args_rolls_only_that_stage(cluster, operator, namespace) -> None:
    apply(cluster, namespace, pipeline("roll", "prompt-enhanced-t2i", [{"name": "enhancer"}, {"name": "dit"}]))
    wait_ready(cluster, operator, namespace, "roll")
    before = template_hashes(cluster, namespace, "roll")
    apply(
        cluster,
        namespace,
        pipeline(
            "roll",
            "prompt-enhanced-t2i",
            [{"name": "enhancer", "engineArgs": {"max_model_len": 1024}}, {"name": "dit"}],
        ),
    )
    wait_for(
        lambda: template_hashes(cluster, namespace, "roll")["roll-enhancer"] != before["roll-enhancer"],
        30,
        "enhancer to roll",
        operator.log,
    )
    after = template_hashes(cluster, namespace, "roll")
    assert after["roll-dit"] == before["roll-dit"]
    assert after["roll-router"] == before["roll-router"]
    ready = wait_ready(cluster, operator, namespace, "roll")
    assert ready["status"]["stagesReady"] == "2/2"
    stage = get(cluster, namespace, "omnistage", "roll-enhancer")
    assert stage["spec"]["engineArgs"]["max_model_len"] == 1024


def test_changing_replicas_changes_only_replicas(cluster, operator, namespace) -> None:
    apply(cluster, namespace, pipeline("scale", "text-chat", [{"name": "llm"}]))
    wait_ready(cluster, operator, namespace, "scale")
    before = template_hashes(cluster, namespace, "scale")
    apply(cluster, namespace, pipeline("scale", "text-chat", [{"name": "llm", "replicas": 3}]))
    wait_for(
        lambda: deployments(cluster, namespace, "scale")["scale-llm"]["spec"]["replicas"] == 3,
        30,
        "3 replicas",
        operator.log,
    )
    assert template_hashes(cluster, namespace, "scale") == before
    ready = wait_ready(cluster, operator, namespace, "scale")
    assert ready["status"]["stages"] == [{"name": "llm", "replicas": 3, "readyReplicas": 3}]


def test_stage_dropped_from_the_topology_is_removed(cluster, operator, namespace) -> None:
    apply(cluster, namespace, pipeline("shrink", "prompt-enhanced-t2i", []))
    wait_ready(cluster, operator, namespace, "shrink")
    assert get(cluster, namespace, "omnistage", "shrink-enhancer")
    apply(cluster, namespace, pipeline("shrink", "qwen-image", []))
    wait_for(
        lambda: get(cluster, namespace, "omnistage", "shrink-enhancer") is None, 30, "enhancer removed", operator.log
    )
    wait_for(
        lambda: "shrink-enhancer" not in deployments(cluster, namespace, "shrink"),
        30,
        "enhancer Deployment garbage-collected",
    )
    ready = wait_ready(cluster, operator, namespace, "shrink")
    assert ready["status"]["topology"]["stages"] == ["dit"]


def test_deleting_the_pipeline_collects_everything(cluster, operator, namespace) -> None:
    apply(cluster, namespace, pipeline("gone", "prompt-enhanced-t2i", []))
    wait_ready(cluster, operator, namespace, "gone")
    cluster.kubectl("delete", "omnipipeline", "gone", "-n", namespace)
    kinds = "omnistages,deployments,services,configmaps,serviceaccounts,roles,rolebindings,poddisruptionbudgets"

    def empty():
        out = cluster.kubectl("get", kinds, "-n", namespace, "-l", "omnikube.io/pipeline=gone", "-o", "name")
        return out.stdout.strip() == ""

    wait_for(
        empty, 60, "garbage collection", lambda: cluster.kubectl("get", kinds, "-n", namespace, "-o", "name").stdout
    )


def test_hand_deleted_omnistage_and_hand_edited_deployment_are_restored(cluster, operator, namespace) -> None:
    apply(cluster, namespace, pipeline("heal", "prompt-enhanced-t2i", []))
    wait_ready(cluster, operator, namespace, "heal")
    uid = get(cluster, namespace, "omnistage", "heal-dit")["metadata"]["uid"]
    cluster.kubectl("delete", "omnistage", "heal-dit", "-n", namespace)
    wait_for(
        lambda: (
            (get(cluster, namespace, "omnistage", "heal-dit") or {"metadata": {"uid": uid}})["metadata"]["uid"] != uid
        ),
        30,
        "OmniStage recreated",
        operator.log,
    )
    wait_ready(cluster, operator, namespace, "heal")

    cluster.kubectl(
        "patch",
        "deployment",
        stage_deployment(cluster, namespace, "heal-enhancer"),
        "-n",
        namespace,
        "--type=merge",
        "-p",
        json.dumps(
            {
                "spec": {
                    "replicas": 4,
                    "template": {"spec": {"containers": [{"name": "enhancer", "image": "example.com/hacked:1"}]}},
                }
            }
        ),
    )

    def restored():
        d = deployments(cluster, namespace, "heal")["heal-enhancer"]
        return (
            d["spec"]["replicas"] == 1
            and d["spec"]["template"]["spec"]["containers"][0]["image"] != "example.com/hacked:1"
        )

    wait_for(restored, 30, "Deployment restored", operator.log)
    wait_ready(cluster, operator, namespace, "heal")


class KubectlWatch:
    """`kubectl <args>` (a --watch), its lines read by a thread as they come."""

    def __init__(self, cluster, *args: str) -> None:
        self.proc = subprocess.Popen(
            [cluster.binary("kubectl"), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=cluster.env(),
            start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def wait_for(self, wanted: Callable[[str], bool], timeout: float, what: str) -> str:
        """The first line for which `wanted` is true, read within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if wanted(line):
                return line
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")

    def stop(self) -> list[str]:
        """Stop kubectl; the lines read and not yet taken by `wait_for`."""
        stop_process_group(self.proc)
        self._reader.join(10)  # what kubectl printed before it stopped is all read
        left = []
        while not self.lines.empty():
            left.append(self.lines.get())
        return left


def test_operator_restart_mid_reconcile_converges_without_duplicates(cluster, operator, namespace) -> None:
    """SIGKILLed while it reconciles, the restarted operator converges every pipeline without duplicates.

    The kill follows the first key Secret to appear (a reconcile's first object); right after it some
    pipeline must have that Secret but not its router Deployment (the reconcile's last object), so the
    kill is known to have landed mid-reconcile."""
    names = [f"many-{i}" for i in range(12)]
    docs = [pipeline(n, "prompt-enhanced-t2i", []) for n in names]
    keys = {key_secret_name(n): n for n in names}
    watch = KubectlWatch(cluster, "get", "secrets", "-n", namespace, "--watch", "-o", "name")
    try:
        # Once the watch prints a Secret made after it started, it sees every later one as it is made.
        cluster.kubectl("create", "secret", "generic", "watch-marker", "-n", namespace, "--from-literal=x=1")
        watch.wait_for(lambda line: line == "secret/watch-marker", 60, "the Secret watch to start")
        cluster.kubectl(
            "apply", "-n", namespace, "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs})
        )
        watch.wait_for(lambda line: line.removeprefix("secret/") in keys, 120, "a reconcile to create a key Secret")
        operator.stop(signal.SIGKILL)  # no chance to finish anything
    finally:
        watch.stop()
    secrets = set(cluster.kubectl("get", "secrets", "-n", namespace, "-o", "name").stdout.split())
    routers = set(cluster.kubectl("get", "deployments", "-n", namespace, "-o", "name").stdout.split())
    begun = [n for k, n in keys.items() if f"secret/{k}" in secrets]
    unfinished = [n for n in begun if f"deployment.apps/{router_name(n)}" not in routers]
    assert unfinished, f"the kill landed after every begun reconcile had finished: {sorted(secrets | routers)}"
    operator.start()
    operator.wait_started()  # the waits below are on reconciling, not on the interpreter starting under load
    for n in names:
        wait_ready(cluster, operator, namespace, n, timeout=120)
    stages = kubectl_json(cluster, "get", "omnistages", "-n", namespace)["items"]
    assert sorted(s["metadata"]["name"] for s in stages) == sorted(
        f"{n}-{s}" for n in names for s in ("enhancer", "dit")
    )
    deps = kubectl_json(cluster, "get", "deployments", "-n", namespace)["items"]
    assert len(deps) == len(names) * 3  # enhancer, dit, router each
    rs = kubectl_json(cluster, "get", "replicasets", "-n", namespace)["items"]
    assert len(rs) == len(names) * 3, "no Deployment rolled twice because of the restart"


# --- rollouts of a contract change ---------------------------------------------------------------


class DeploymentWatch:
    """Every write to one pipeline's Deployments, in order, as (event type, name, spec.replicas,
    status.readyReplicas): `kubectl get deployments --watch --output-watch-events` through `KubectlWatch`."""

    FORMAT = "jsonpath={.type} {.object.metadata.name} {.object.spec.replicas} {.object.status.readyReplicas}{'\\n'}"

    def __init__(self, cluster, namespace: str, pipeline_name: str) -> None:
        self.watch = KubectlWatch(
            cluster, "get", "deployments", "-n", namespace, "-l", f"omnikube.io/pipeline={pipeline_name}",
            "--watch", "--output-watch-events", "-o", self.FORMAT,
        )  # fmt: skip

    def stop(self) -> list[tuple[str, str, int, int]]:
        events = []
        for line in self.watch.stop():
            parts = line.split()
            if len(parts) >= 3:
                ready = int(parts[3]) if len(parts) > 3 and parts[3].isdigit() else 0
                events.append((parts[0], parts[1], int(parts[2]), ready))
        return events


def stage_configmaps(cluster, namespace: str, pipeline_name: str) -> set[str]:
    out = kubectl_json(cluster, "get", "configmaps", "-n", namespace, "-l",
                       f"omnikube.io/pipeline={pipeline_name},app.kubernetes.io/component=stage-config")  # fmt: skip
    return {c["metadata"]["name"] for c in out["items"]}


def rollout_phase(phase: str, target: str | None = None) -> Callable[[dict], bool]:
    """A `wait_ready(showing=...)` test: the pipeline's rollout is in `phase` (for contract `target`)."""

    def showing(status: dict) -> bool:
        rollout = status.get("rollout") or {}
        return rollout.get("phase") == phase and (target is None or rollout.get("target") == target)

    return showing


def degraded_in_phase(cluster, namespace: str, name: str, phase: str) -> Callable[[], dict | None]:
    """A `wait_for` check: the pipeline, once its rollout is in `phase` and it is Degraded; else None."""

    def check() -> dict | None:
        obj = get(cluster, namespace, "omnipipeline", name) or {}
        rollout = (obj.get("status") or {}).get("rollout") or {}
        return obj if rollout.get("phase") == phase and condition(obj, "Degraded").get("status") == "True" else None

    return check


def events_of(cluster, namespace: str, name: str, reason: str) -> list[dict]:
    return kubectl_json(
        cluster, "get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name},reason={reason}"
    )["items"]


def test_a_contract_change_brings_up_a_new_generation_beside_the_old_and_retires_it_once_whole(
    cluster, operator, namespace
) -> None:
    """A new model (in every stage's contract) under rollout.maxSurge 1: each stage's new generation comes up in
    its own Deployment beside the old one, at most 1 replica while the old serves; the old ones go only once
    every stage of the new one is ready; then the new one runs the full count, which for the autoscaled
    enhancer is what kubectl scale gave it (as KEDA would). A change outside the contract rolls in place."""
    scaling = {"engine": "hpa", "minReplicas": 1, "maxReplicas": 4}
    stages = [{"name": "enhancer", "autoscaling": scaling}, {"name": "dit", "replicas": 2}]
    spec = pipeline("gen", "prompt-enhanced-t2i", stages, rollout={"maxSurge": 1})
    apply(cluster, namespace, spec)
    first = wait_ready(cluster, operator, namespace, "gen", showing=rollout_phase("Complete"))
    cluster.kubectl("scale", "omnistage/gen-enhancer", "-n", namespace, "--replicas=3")
    wait_ready(cluster, operator, namespace, "gen", showing=lambda s: s["stages"][0]["replicas"] == 3)
    old = {n: d["metadata"]["name"] for n, d in deployments(cluster, namespace, "gen").items() if n != "gen-router"}
    old_configs = stage_configmaps(cluster, namespace, "gen")
    assert len(old_configs) == 2, old_configs
    assert first["status"]["rollout"]["serving"] == first["status"]["contract"]

    def names() -> set[str]:
        return {d["metadata"]["name"] for d in deployments(cluster, namespace, "gen").values()}

    watch = DeploymentWatch(cluster, namespace, "gen")
    try:
        time.sleep(1)  # the watch lists what exists first: let it
        apply(cluster, namespace, {**spec, "spec": {**spec["spec"], "model": "/models/gen-v2"}})
        done = wait_ready(cluster, operator, namespace, "gen", timeout=120, showing=rollout_phase("Complete"))
        wait_for(lambda: not set(old.values()) & names(), 60, "the old generation's Deployments gone", operator.log)
    finally:
        events = watch.stop()
    target = done["status"]["contract"]
    assert target != first["status"]["contract"]
    assert done["status"]["rollout"]["serving"] == target

    new = {n: d["metadata"]["name"] for n, d in deployments(cluster, namespace, "gen").items() if n != "gen-router"}
    assert set(new) == set(old) and not set(new.values()) & set(old.values()), (old, new)
    gone_at = min(i for i, e in enumerate(events) if e[0] == "DELETED" and e[1] in old.values())
    for name in new.values():
        before = [e for e in events[:gone_at] if e[1] == name]
        assert before, f"{name} came up only after the old generation went: {events}"
        assert max(e[2] for e in before) <= 1, f"{name} ran more than maxSurge beside the old generation: {events}"
        assert any(e[3] >= 1 for e in before), f"the old generation went before {name} had a ready replica: {events}"
    for stage, name in old.items():
        assert not [e for e in events if e[1] == name and e[0] == "MODIFIED" and e[2] < (3 if "enhancer" in stage
                    else 2)], f"the old {name} was scaled down while it served: {events}"  # fmt: skip
    final = deployments(cluster, namespace, "gen")
    assert final["gen-enhancer"]["spec"]["replicas"] == 3, "the new generation starts at the scaled count"
    assert final["gen-dit"]["spec"]["replicas"] == 2
    assert done["status"]["stages"] == [
        {"name": "enhancer", "replicas": 3, "readyReplicas": 3},
        {"name": "dit", "replicas": 2, "readyReplicas": 2},
    ]
    configs = wait_for(lambda: (lambda c: c if not c & old_configs else None)(stage_configmaps(cluster, namespace,
                       "gen")), 30, "the old generation's ConfigMaps removed", operator.log)  # fmt: skip
    assert len(configs) == 2
    pods = kubectl_json(cluster, "get", "pods", "-n", namespace, "-l", "omnikube.io/pipeline=gen,"
                        "app.kubernetes.io/component=stage")["items"]  # fmt: skip
    volumes = {v["configMap"]["name"] for p in pods for v in p["spec"]["volumes"] if "configMap" in v}
    assert volumes == configs, "every pod reads its own generation's ConfigMap"
    assert events_of(cluster, namespace, "gen", "RolloutStarted") and events_of(cluster, namespace, "gen",
                                                                                "RolloutComplete")  # fmt: skip
    table = cluster.kubectl("get", "omnipipeline", "gen", "-n", namespace).stdout
    assert "SERVING" in table and "ROLLOUT" in table and target in table and "Complete" in table, table

    # Outside the contract: the same Deployments, rolled in place; no rollout.
    started = len(events_of(cluster, namespace, "gen", "RolloutStarted"))
    stages[1]["replicas"] = 1
    stages[1]["samplingParams"] = {"num_inference_steps": 3}
    apply(cluster, namespace, {**spec, "spec": {**spec["spec"], "model": "/models/gen-v2", "stages": stages}})
    wait_for(lambda: deployments(cluster, namespace, "gen")["gen-dit"]["spec"]["replicas"] == 1, 30, "dit at 1")
    wait_ready(cluster, operator, namespace, "gen", showing=rollout_phase("Complete", target))
    assert {
        n: d["metadata"]["name"] for n, d in deployments(cluster, namespace, "gen").items() if n != "gen-router"
    } == new
    assert len(events_of(cluster, namespace, "gen", "RolloutStarted")) == started


def test_a_new_generation_that_cannot_run_is_rolled_back_and_the_old_one_keeps_serving(
    cluster, operator, namespace
) -> None:
    """A new model whose pods no node will take (a nodeSelector no node matches): the rollout fails, the new
    generation goes to zero replicas (autoRollback), the old one is never touched and the pipeline is Degraded
    RolloutFailed naming the stage and why; reverting the spec ends it, the old generation still serving."""
    spec = pipeline("bad", "text-chat", [{"name": "llm"}])
    apply(cluster, namespace, spec)
    first = wait_ready(cluster, operator, namespace, "bad", showing=rollout_phase("Complete"))
    old = deployments(cluster, namespace, "bad")["bad-llm"]
    nowhere = [{"name": "llm", "nodeSelector": {"omnikube.io/accelerator": "none-has-this"}}]
    apply(cluster, namespace, pipeline("bad", "text-chat", nowhere, model="/models/bad-v2"))

    obj = wait_for(
        degraded_in_phase(cluster, namespace, "bad", "RolledBack"), 90, "the rollout rolled back", operator.log
    )
    degraded, progressing = condition(obj, "Degraded"), condition(obj, "Progressing")
    assert degraded["reason"] == "RolloutFailed", degraded
    assert "stage llm" in degraded["message"] and "Unschedulable" in degraded["message"], degraded
    assert first["status"]["contract"] in degraded["message"], "it names the generation that serves"
    assert (progressing["status"], progressing["reason"]) == ("False", "RolloutFailed")
    assert obj["status"]["rollout"]["serving"] == first["status"]["contract"]
    stage = get(cluster, namespace, "omnistage", "bad-llm")
    by_contract = {g["contract"]: g for g in stage["status"]["generations"]}
    new_name = stage_deployment(cluster, namespace, "bad-llm")
    wait_for(lambda: get(cluster, namespace, "deployment", new_name)["spec"]["replicas"] == 0, 30, "new at zero")
    still = get(cluster, namespace, "deployment", old["metadata"]["name"])
    assert still["metadata"]["uid"] == old["metadata"]["uid"] and still["status"].get("readyReplicas") == 1
    assert still["metadata"]["generation"] == old["metadata"]["generation"], "the old generation was never touched"
    assert len(by_contract) == 2, stage["status"]["generations"]
    assert events_of(cluster, namespace, "bad", "RolledBack")

    apply(cluster, namespace, spec)  # revert
    done = wait_ready(
        cluster, operator, namespace, "bad", showing=rollout_phase("Complete", first["status"]["contract"])
    )
    assert condition(done, "Degraded")["status"] == "False"
    wait_for(lambda: get(cluster, namespace, "deployment", new_name) is None, 30, "the failed generation removed")
    back = get(cluster, namespace, "deployment", old["metadata"]["name"])
    assert back["metadata"]["uid"] == old["metadata"]["uid"], "the old generation served throughout"


def test_a_generation_past_its_progress_deadline_fails_and_without_auto_rollback_keeps_its_pods(
    cluster, operator, namespace
) -> None:
    """A new model whose pod is placed on a node with no kubelet (scheduled, never started: what a node that lost
    its kubelet looks like to a rollout): once rollout.progressDeadlineSeconds passes the rollout fails, Degraded
    RolloutFailed with ProgressDeadlineExceeded, the old generation serving; with autoRollback false the new
    generation keeps its replica (phase Failed), for someone to look at; turning autoRollback on (outside the
    contract) scales it to zero (phase RolledBack)."""
    node = f"silent-{namespace}"[:63]
    room = {"cpu": "8", "memory": "32Gi", "pods": "110"}
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": node, "labels": {"kubernetes.io/hostname": node, "omnikube.io/silent": "true"}},
        "status": {"capacity": room, "allocatable": room},
    }))  # fmt: skip
    try:
        rollout = {"progressDeadlineSeconds": 5, "autoRollback": False}
        spec = pipeline("late", "text-chat", [{"name": "llm"}], rollout=rollout)
        apply(cluster, namespace, spec)
        first = wait_ready(cluster, operator, namespace, "late", showing=rollout_phase("Complete"))
        old = deployments(cluster, namespace, "late")["late-llm"]
        tolerate = [{"key": f"node.kubernetes.io/{t}", "operator": "Exists"} for t in ("not-ready", "unreachable")]
        silent = [{"name": "llm", "nodeSelector": {"omnikube.io/silent": "true"}, "tolerations": tolerate}]
        apply(cluster, namespace, pipeline("late", "text-chat", silent, model="/models/late-v2", rollout=rollout))

        obj = wait_for(
            degraded_in_phase(cluster, namespace, "late", "Failed"),
            60,
            "the rollout failed at its deadline",
            operator.log,
        )
        degraded = condition(obj, "Degraded")
        assert degraded["reason"] == "RolloutFailed", degraded
        message = degraded["message"]
        assert "stage llm: ProgressDeadlineExceeded" in message, message
        assert obj["status"]["rollout"]["reason"] == "ProgressDeadlineExceeded", obj["status"]["rollout"]
        assert "progressDeadlineSeconds (5 s)" in message and "autoRollback is off" in message, message
        assert obj["status"]["rollout"]["serving"] == first["status"]["contract"] != obj["status"]["contract"]
        new_name = stage_deployment(cluster, namespace, "late-llm")
        assert new_name != old["metadata"]["name"]
        assert get(cluster, namespace, "deployment", new_name)["spec"]["replicas"] == 1, "kept for a look"
        pods = kubectl_json(cluster, "get", "pods", "-n", namespace, "-l", "omnikube.io/pipeline=late,"
                            "app.kubernetes.io/component=stage")["items"]  # fmt: skip
        waiting = [p for p in pods if p["spec"].get("nodeName") == node]
        assert len(waiting) == 1 and waiting[0]["status"].get("phase") == "Pending", waiting
        still = get(cluster, namespace, "deployment", old["metadata"]["name"])
        assert still["metadata"]["uid"] == old["metadata"]["uid"] and still["status"].get("readyReplicas") == 1

        rollout["autoRollback"] = True
        apply(cluster, namespace, pipeline("late", "text-chat", silent, model="/models/late-v2", rollout=rollout))
        obj = wait_for(
            degraded_in_phase(cluster, namespace, "late", "RolledBack"),
            60,
            "the failed generation rolled back",
            operator.log,
        )
        assert obj["status"]["rollout"]["serving"] == first["status"]["contract"]
        wait_for(lambda: get(cluster, namespace, "deployment", new_name)["spec"]["replicas"] == 0, 30, "new at zero")
    finally:
        cluster.kubectl("delete", "node", node, "--wait=false", check=False)


def test_a_surge_the_free_gpus_cannot_hold_is_reported_before_any_pod_and_max_surge_zero_gets_through(
    cluster, operator, namespace
) -> None:
    """Two replicas of 5 GPUs fill the fleet's two 8-GPU nodes past what a second generation beside them needs:
    the model change waits (phase WaitingForCapacity, Degraded InsufficientAccelerator, what it needs, what is
    free, what to change) and no Deployment or pod of the new generation is made; the old one serves on. Doing
    what the status says (maxSurge 0) gets the rollout through: the old generation goes, then the new one fits."""
    stages = [{"name": "llm", "replicas": 2, "accelerator": {"type": "nvidia.com/gpu", "count": 5}}]
    spec = pipeline("full", "text-chat", stages)
    apply(cluster, namespace, spec)
    first = wait_ready(cluster, operator, namespace, "full", showing=rollout_phase("Complete"))
    old = deployments(cluster, namespace, "full")["full-llm"]
    apply(cluster, namespace, {**spec, "spec": {**spec["spec"], "model": "/models/full-v2"}})
    waiting = rollout_phase("WaitingForCapacity")

    def waits() -> dict | None:
        obj = get(cluster, namespace, "omnipipeline", "full")
        return obj if obj and waiting(obj.get("status") or {}) else None

    obj = wait_for(waits, 60, "the rollout waiting for capacity", operator.log)
    degraded, progressing = condition(obj, "Degraded"), condition(obj, "Progressing")
    assert (degraded["status"], degraded["reason"]) == ("True", "InsufficientAccelerator"), degraded
    assert (progressing["status"], progressing["reason"]) == ("False", "InsufficientAccelerator"), progressing
    message = obj["status"]["rollout"]["message"]
    assert "stage llm needs 2 replica(s) with 5 nvidia.com/gpu" in message and "gpu-node-0: " in message, message
    assert "set it to 0" in message and first["status"]["contract"] in message, message
    assert obj["status"]["rollout"]["serving"] == first["status"]["contract"]
    assert set(deployments(cluster, namespace, "full")) == {"full-llm", "full-router"}
    assert deployments(cluster, namespace, "full")["full-llm"]["metadata"]["uid"] == old["metadata"]["uid"]
    pods = kubectl_json(cluster, "get", "pods", "-n", namespace, "-l", "omnikube.io/pipeline=full,"
                        "app.kubernetes.io/component=stage")["items"]  # fmt: skip
    generation = "omnikube.io/generation"
    assert {p["metadata"]["labels"][generation] for p in pods} == {old["metadata"]["labels"][generation]}
    assert events_of(cluster, namespace, "full", "RolloutWaitingForCapacity")

    apply(cluster, namespace, {**spec, "spec": {**spec["spec"], "model": "/models/full-v2",
                                                "rollout": {"maxSurge": 0}}})  # fmt: skip
    done = wait_ready(cluster, operator, namespace, "full", timeout=120, showing=rollout_phase("Complete"))
    assert done["status"]["rollout"]["serving"] == done["status"]["contract"] != first["status"]["contract"]
    assert condition(done, "Degraded")["status"] == "False"
    now = deployments(cluster, namespace, "full")["full-llm"]
    assert now["metadata"]["uid"] != old["metadata"]["uid"] and now["status"].get("readyReplicas") == 2


def test_max_surge_zero_stops_the_world(cluster, operator, namespace) -> None:
    """maxSurge 0: the old generation is deleted before the new one exists, and the status says so."""
    spec = pipeline("stw", "text-chat", [{"name": "llm"}], rollout={"maxSurge": 0})
    apply(cluster, namespace, spec)
    wait_ready(cluster, operator, namespace, "stw")
    old = deployments(cluster, namespace, "stw")["stw-llm"]["metadata"]["name"]
    watch = DeploymentWatch(cluster, namespace, "stw")
    try:
        time.sleep(1)
        apply(cluster, namespace, {**spec, "spec": {**spec["spec"], "model": "/models/stw-v2"}})
        # Between the two there is no Deployment of the stage at all: that is stopping the world.
        wait_for(lambda: (deployments(cluster, namespace, "stw").get("stw-llm") or {"metadata": {"name": old}})[
            "metadata"]["name"] != old, 30, "the new generation's Deployment")  # fmt: skip
        wait_ready(cluster, operator, namespace, "stw", showing=rollout_phase("Complete"))
    finally:
        events = watch.stop()
    new = deployments(cluster, namespace, "stw")["stw-llm"]["metadata"]["name"]
    deleted = next(i for i, e in enumerate(events) if e[0] == "DELETED" and e[1] == old)
    added = next(i for i, e in enumerate(events) if e[0] == "ADDED" and e[1] == new)
    assert deleted < added, events
    [event] = events_of(cluster, namespace, "stw", "RolloutStopTheWorld")
    assert "maxSurge 0" in event["message"]


# --- scaling -------------------------------------------------------------------------------------


def test_pipeline_spec_owns_replicas_without_autoscaling(cluster, operator, namespace) -> None:
    apply(cluster, namespace, pipeline("owned", "text-chat", [{"name": "llm", "replicas": 2}]))
    wait_ready(cluster, operator, namespace, "owned")
    cluster.kubectl("scale", "omnistage/owned-llm", "-n", namespace, "--replicas=5")
    wait_for(
        lambda: get(cluster, namespace, "omnistage", "owned-llm")["spec"]["replicas"] == 2,
        30,
        "replicas restored to the pipeline's 2",
        operator.log,
    )


def test_kubectl_scale_and_the_operators_hpa_drive_an_autoscaled_stage(cluster, operator, namespace) -> None:
    scaling = {"engine": "hpa", "minReplicas": 1, "maxReplicas": 4}
    apply(cluster, namespace, pipeline("auto", "text-chat", [{"name": "llm", "autoscaling": scaling}]))
    wait_ready(cluster, operator, namespace, "auto")
    hpa = wait_for(lambda: get(cluster, namespace, "hpa", "auto-llm"), 30, "the operator's HPA", operator.log)
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "omnikube.io/v1alpha1", "kind": "OmniStage",
                                             "name": "auto-llm"}  # fmt: skip
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "omnikube_stage_requests_running"
    cluster.kubectl("scale", "omnistage/auto-llm", "-n", namespace, "--replicas=3")
    wait_for(
        lambda: deployments(cluster, namespace, "auto")["auto-llm"]["spec"]["replicas"] == 3,
        30,
        "Deployment follows kubectl scale",
        operator.log,
    )
    wait_ready(cluster, operator, namespace, "auto")
    assert get(cluster, namespace, "omnistage", "auto-llm")["spec"]["replicas"] == 3, "operator kept hands off"

    # Raising minReplicas in the pipeline reaches the HPA, which scales the OmniStage through /scale
    # (no custom-metrics adapter runs here: the HPA enforces its bounds without a metric).
    scaling["minReplicas"] = 4
    apply(cluster, namespace, pipeline("auto", "text-chat", [{"name": "llm", "autoscaling": scaling}]))
    wait_for(
        lambda: get(cluster, namespace, "omnistage", "auto-llm")["spec"]["replicas"] == 4,
        60,
        "HPA scales the OmniStage",
        lambda: json.dumps(get(cluster, namespace, "hpa", "auto-llm")),
    )
    wait_for(
        lambda: deployments(cluster, namespace, "auto")["auto-llm"]["spec"]["replicas"] == 4,
        30,
        "Deployment follows the HPA",
        operator.log,
    )
    # The pipeline's status follows its stage on the reconcile after the HPA's /scale write.
    ready = wait_ready(
        cluster, operator, namespace, "auto", showing=lambda status: status["stages"][0]["replicas"] == 4
    )
    assert ready["status"]["stages"] == [{"name": "llm", "replicas": 4, "readyReplicas": 4}]
    # What the HPA asked for through /scale is what the operator exports for OmnikubeStageDown.
    wait_for(
        lambda: operator.desired_replicas(namespace, "auto", "llm") == 4,
        30,
        "the operator's desired replicas follow /scale",
        lambda: str(operator.desired_replicas(namespace, "auto", "llm")),
    )

    # Dropping autoscaling removes the HPA; the pipeline's replicas own the stage again.
    apply(cluster, namespace, pipeline("auto", "text-chat", [{"name": "llm", "replicas": 2}]))
    wait_for(lambda: get(cluster, namespace, "hpa", "auto-llm") is None, 30, "HPA removed", operator.log)
    wait_for(
        lambda: get(cluster, namespace, "omnistage", "auto-llm")["spec"]["replicas"] == 2,
        30,
        "replicas back to the pipeline's 2",
        operator.log,
    )


def degraded_reason(cluster, namespace: str, name: str) -> str | None:
    obj = get(cluster, namespace, "omnipipeline", name) or {}
    cond = condition(obj, "Degraded")
    return cond.get("reason") if cond.get("status") == "True" else None


def test_keda_missing_then_installed(cluster, operator, namespace) -> None:
    """Without KEDA's CRDs an autoscaled stage keeps serving and the pipeline is Degraded saying how to
    install KEDA; once the (real, pinned) ScaledObject CRD is installed the operator creates the
    ScaledObject without being poked, and the apiserver accepts it against KEDA's own schema."""
    crd = keda_crd()
    cluster.kubectl("delete", "-f", str(crd), "--ignore-not-found", "--wait=true")
    scaling = {"minReplicas": 1, "maxReplicas": 3, "scaleDownStabilizationSeconds": 20}
    apply(cluster, namespace, pipeline("keda", "text-chat", [{"name": "llm", "autoscaling": scaling}]))
    wait_for(
        lambda: degraded_reason(cluster, namespace, "keda") == "AutoscalerUnavailable",
        60,
        "Degraded AutoscalerUnavailable",
        operator.log,
    )
    message = condition(get(cluster, namespace, "omnipipeline", "keda"), "Degraded")["message"]
    assert "install KEDA" in message and "engine: hpa" in message, message
    stage_ready = wait_for(
        lambda: condition(get(cluster, namespace, "omnistage", "keda-llm"), "Ready").get("status") == "True",
        60,
        "the stage serves without its autoscaler",
        operator.log,
    )
    assert stage_ready
    try:
        cluster.kubectl("apply", "--server-side", "-f", str(crd))
        wait_established(cluster, ["scaledobjects.keda.sh"])
        scaled = wait_for(
            lambda: get(cluster, namespace, "scaledobject", "keda-llm"),
            90,
            "the operator creates the ScaledObject once KEDA's CRD exists",
            operator.log,
        )
        assert scaled["spec"]["scaleTargetRef"]["kind"] == "OmniStage"
        assert {t["name"] for t in scaled["spec"]["triggers"]} == {"queue", "ttft"}
        assert f'namespace="{namespace}",pipeline="keda"' in scaled["spec"]["triggers"][0]["metadata"]["query"]
        wait_for(lambda: degraded_reason(cluster, namespace, "keda") is None, 60, "Degraded clears", operator.log)
        wait_ready(cluster, operator, namespace, "keda")

        # minReplicas 0: the stage starts at zero, the pipeline is Ready (scaled to zero) and the router
        # is told which stage may have no replica.
        zero = {"minReplicas": 0, "maxReplicas": 2}
        apply(cluster, namespace, pipeline("zero", "text-chat", [{"name": "llm", "autoscaling": zero}]))
        ready = wait_ready(cluster, operator, namespace, "zero")
        assert ready["status"]["stages"][0]["replicas"] == 0
        assert get(cluster, namespace, "scaledobject", "zero-llm")["spec"]["minReplicaCount"] == 0
        config = json.loads(get(cluster, namespace, "configmap", "zero-config")["data"]["resolved.json"])
        assert config["scale_from_zero"] == ["llm"]
        assert operator.desired_replicas(namespace, "zero", "llm") == 0  # scaled to zero: not "down"

        # Switching engine replaces the ScaledObject by an HPA.
        scaling["engine"] = "hpa"
        apply(cluster, namespace, pipeline("keda", "text-chat", [{"name": "llm", "autoscaling": scaling}]))
        wait_for(lambda: get(cluster, namespace, "hpa", "keda-llm"), 30, "HPA created", operator.log)
        wait_for(
            lambda: get(cluster, namespace, "scaledobject", "keda-llm") is None,
            30,
            "ScaledObject removed",
            operator.log,
        )
    finally:
        cluster.kubectl("delete", "-f", str(crd), "--ignore-not-found", "--wait=false", check=False)


# --- leader election -----------------------------------------------------------------------------


def lease_holder(cluster) -> str | None:
    return kubectl_json(cluster, "get", "lease", "omnikube-operator", "-n", "default")["spec"].get("holderIdentity")


def test_second_operator_replica_waits_then_takes_over(cluster, operator, namespace, tmp_path) -> None:
    """A second replica, once running, waits while the first holds the Lease; the first releases it when
    stopped and the second leads and reconciles. The waits on a process starting are separate from the
    waits on the election: under load, starting the interpreter takes longer than a Lease handover."""
    second = OperatorProcess(cluster, tmp_path / "b.log", "operator-b").start()
    try:
        second.wait_started()
        wait_for(
            lambda: "held by operator-a: waiting" in second.log_path.read_text(errors="replace"),
            30,
            "operator-b to say it waits for operator-a",
            second.log,
        )
        assert lease_holder(cluster) == "operator-a"
        assert second.metric("omnikube_operator_leader") == 0, second.log()
        operator.stop()  # graceful: it releases the Lease before it exits
        assert lease_holder(cluster) in ("", "operator-b"), operator.log()
        wait_for(lambda: lease_holder(cluster) == "operator-b", 30, "operator-b to lead", second.log)
        apply(cluster, namespace, pipeline("takeover", "text-chat", []))
        wait_ready(cluster, second, namespace, "takeover")
        assert second.metric("omnikube_operator_leader") == 1
    finally:
        # operator-a waits as a follower before operator-b lets go, so the module's later tests find it leading.
        if not operator.running():
            operator.start()
            operator.wait_started()
        second.stop()
        wait_for(lambda: lease_holder(cluster) == "operator-a", 40, "operator-a to lead again", operator.log)


# --- trust and ownership -------------------------------------------------------------------------


def test_pipeline_key_is_made_once_and_network_policies_are_applied(cluster, operator, namespace) -> None:
    """The key Secret: 32 random bytes owned by the pipeline, mounted by every pod, kept across spec
    changes, never in status. The NetworkPolicies are applied as `omnikube render` shows them (the local
    cluster enforces none; the objects are what a CNI would act on)."""
    import base64

    apply(cluster, namespace, pipeline("trusted", "prompt-enhanced-t2i", [{"name": "enhancer"}, {"name": "dit"}]))
    live = wait_ready(cluster, operator, namespace, "trusted")
    uid = live["metadata"]["uid"]
    secret = get(cluster, namespace, "secret", "trusted-key")
    assert secret is not None, operator.log()
    key = base64.b64decode(secret["data"]["key"])
    assert len(key) == 32 and [r["uid"] for r in secret["metadata"]["ownerReferences"]] == [uid]
    assert secret["data"]["key"] not in json.dumps(live) and key.hex() not in operator.log()
    for name, d in deployments(cluster, namespace, "trusted").items():
        volumes = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
        assert volumes["pipeline-key"]["secret"]["secretName"] == "trusted-key", name

    policies = kubectl_json(cluster, "get", "networkpolicies", "-n", namespace, "-l", "omnikube.io/pipeline=trusted")
    by_name = {p["metadata"]["name"]: p for p in policies["items"]}
    assert set(by_name) == {"trusted-pipeline", "trusted-router-clients", "trusted-stage-probes"}
    assert all([r["uid"] for r in p["metadata"]["ownerReferences"]] == [uid] for p in by_name.values())
    assert by_name["trusted-router-clients"]["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000}]}]
    assert by_name["trusted-pipeline"]["spec"]["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": {"omnikube.io/pipeline": "trusted"}}}]}
    ]

    # A spec change rolls a stage but never touches the key.
    patch = {"spec": {"stages": [{"name": "enhancer", "engineArgs": {"max_model_len": 256}}, {"name": "dit"}]}}
    cluster.kubectl("patch", "omnipipeline", "trusted", "-n", namespace, "--type", "merge", "-p", json.dumps(patch))
    wait_for(
        lambda: (lambda o: o if o and o["status"].get("observedGeneration") == 2 else None)(
            get(cluster, namespace, "omnipipeline", "trusted")
        ),
        60,
        "the spec change observed",
        operator.log,
    )
    again = get(cluster, namespace, "secret", "trusted-key")
    assert again["metadata"]["uid"] == secret["metadata"]["uid"] and again["data"] == secret["data"]
    assert again["metadata"]["resourceVersion"] == secret["metadata"]["resourceVersion"]


def test_a_users_service_with_the_routers_name_is_left_alone_and_reported(cluster, operator, namespace) -> None:
    user_service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "clash-router", "labels": {"team": "web"}},
        "spec": {"selector": {"app": "web"}, "ports": [{"name": "web", "port": 80, "targetPort": 8080}]},
    }
    apply(cluster, namespace, user_service)
    before = get(cluster, namespace, "service", "clash-router")
    apply(cluster, namespace, pipeline("clash", "text-chat", [{"name": "llm"}]))

    def degraded():
        obj = get(cluster, namespace, "omnipipeline", "clash") or {}
        cond = condition(obj, "Degraded")
        return (obj, cond) if cond.get("reason") == "NameCollision" else None

    obj, cond = wait_for(degraded, 60, "Degraded NameCollision", operator.log)
    assert cond["status"] == "True"
    assert "Service 'clash-router'" in cond["message"] and namespace in cond["message"]
    assert condition(obj, "Ready")["status"] == "False"
    events = kubectl_json(
        cluster, "get", "events", "-n", namespace, "--field-selector", "involvedObject.name=clash,reason=NameCollision"
    )["items"]
    assert events and "clash-router" in events[0]["message"]

    # Not one field of the user's Service was written; everything else of the pipeline was built.
    after = get(cluster, namespace, "service", "clash-router")
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert after["spec"]["selector"] == {"app": "web"} and "ownerReferences" not in after["metadata"]
    assert get(cluster, namespace, "deployment", "clash-router") is not None
    assert get(cluster, namespace, "deployment", stage_deployment(cluster, namespace, "clash-llm")) is not None

    # Once the user removes it, the pipeline's own Service takes the name and the pipeline becomes Ready.
    cluster.kubectl("delete", "service", "clash-router", "-n", namespace)
    cluster.kubectl("annotate", "omnipipeline", "clash", "-n", namespace, "example.com/nudge=1")
    ready = wait_ready(cluster, operator, namespace, "clash")
    service = get(cluster, namespace, "service", "clash-router")
    assert [r["uid"] for r in service["metadata"]["ownerReferences"]] == [ready["metadata"]["uid"]]
    assert condition(ready, "Degraded")["status"] == "False"


def test_a_pipeline_deleted_and_recreated_at_once_converges_without_a_collision(cluster, operator, namespace) -> None:
    """The old pipeline's objects still exist for a moment after it is gone (garbage collection is
    asynchronous): they are waited for, not reported as a collision, and the new pipeline gets its own."""
    obj = pipeline("again", "text-chat", [{"name": "llm"}])
    apply(cluster, namespace, obj)
    first = wait_ready(cluster, operator, namespace, "again")["metadata"]["uid"]
    old_key = get(cluster, namespace, "secret", "again-key")
    cluster.kubectl("delete", "omnipipeline", "again", "-n", namespace, "--wait=false")
    apply(cluster, namespace, obj)

    def ready_again():
        live = get(cluster, namespace, "omnipipeline", "again")
        if not live or live["metadata"]["uid"] == first or condition(live, "Ready").get("status") != "True":
            return None
        secret = get(cluster, namespace, "secret", "again-key")
        return (
            live
            if secret and [r["uid"] for r in secret["metadata"]["ownerReferences"]] == [live["metadata"]["uid"]]
            else None
        )

    live = wait_for(ready_again, 120, "the recreated pipeline Ready with its own key", operator.log)
    assert get(cluster, namespace, "secret", "again-key")["data"] != old_key["data"]  # a new pipeline, a new key
    events = kubectl_json(
        cluster, "get", "events", "-n", namespace, "--field-selector", "involvedObject.name=again,reason=NameCollision"
    )["items"]
    assert events == [] and condition(live, "Degraded")["status"] == "False"
