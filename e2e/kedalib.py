"""The real KEDA in the test tier: its operator and external-metrics adapter, built from the pinned Go module
(e2e/cluster/addons/build.sh keda, scalers cut to cpu, memory and prometheus), run as pods on the pod runner
from KEDA's own manifests (config/default of the same module).

What differs from KEDA's release manifests, and why:
- the containers run the built binaries (the pod runner's image is the host) on the runner's nodes, from a
  read-only hostPath volume at /keda-bin (a host path named directly can lie under one of the pod's own mounts);
- the admission webhooks are left out (not built; KEDA runs without them, as with its chart's
  `webhooks.enabled=false`), so the operator does not patch their configuration;
- the operator's Service is headless: the adapter dials `keda-operator.keda.svc.cluster.local:9666`, and
  without kube-proxy only a headless Service's name resolves to a pod (the runner's /etc/hosts).
Everything else is KEDA's: its CRDs and RBAC, the operator generating the TLS certificates of its gRPC
metrics service and of the adapter into the `kedaorg-certs` Secret and patching the APIService's caBundle,
and the adapter serving `v1beta1.external.metrics.k8s.io` through the API server's aggregation layer.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import yaml
from clusterlib import REPO, go_module_dir, wait_established, wait_for
from podrunner.fixtures import on_runner
from podrunner.node import ON_RUNNER

from omni_runtime.tiny_models import default_cache_dir

__all__ = ["NAMESPACE", "Keda", "chat_pipeline", "hpa_of", "keda_binaries", "keda_manifests"]

NAMESPACE = "keda"
MODULE = "github.com/kedacore/keda/v2"
EXTERNAL_METRICS = "v1beta1.external.metrics.k8s.io"
BIN_VOLUME, BIN_MOUNT = "keda-binaries", "/keda-bin"
"""The hostPath volume holding the built binaries, and where the containers see it (KEDA's image has them in /)."""
_LEFT_OUT = {
    ("Deployment", "keda-admission"),
    ("Service", "keda-admission-webhooks"),
    ("ValidatingWebhookConfiguration", "keda-admission"),
}


def keda_binaries() -> tuple[Path, Path]:
    """(operator, adapter): the cached trimmed build, built first when the cache has none (minutes, cold)."""
    out = subprocess.run(
        ["bash", str(REPO / "e2e" / "cluster" / "addons" / "build.sh"), "keda"],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    operator = Path(out.stdout.strip().splitlines()[-1])
    return operator, operator.with_name("keda-adapter")


def keda_manifests(cluster: Any, operator: Path, adapter: Path) -> list[dict[str, Any]]:
    """KEDA's config/default (kustomize, as its release does) with the changes the module docstring lists."""
    if operator.parent != adapter.parent:
        raise ValueError(f"the KEDA binaries must share a folder (one volume): {operator}, {adapter}")
    source = go_module_dir("keda", MODULE) / "config" / "default"
    docs = [d for d in yaml.safe_load_all(cluster.kubectl("kustomize", str(source)).stdout) if d]
    out = []
    for doc in docs:
        kind, name = doc["kind"], doc["metadata"]["name"]
        if (kind, name) in _LEFT_OUT:
            continue
        if kind == "Deployment":
            pod = doc["spec"]["template"]["spec"] = on_runner(doc["spec"]["template"]["spec"])
            container = pod["containers"][0]
            if name == "keda-operator":
                container["command"] = [f"{BIN_MOUNT}/{operator.name}"]
                container["args"] = [*container.get("args", []), "--enable-webhook-patching=false"]
            elif name == "keda-metrics-apiserver":
                container["command"] = [f"{BIN_MOUNT}/{adapter.name}"]
            else:
                raise AssertionError(f"KEDA's config/default has a Deployment {name} this test tier does not know")
            # The binaries reach the container through a volume of their own, as an image's files would: named
            # by their host path, they were hidden whenever that path lay under one of the pod's own mounts
            # (the adapter mounts an emptyDir on /tmp, and a cache under a HOME in /tmp vanished behind it).
            pod.setdefault("volumes", []).append(
                {"name": BIN_VOLUME, "hostPath": {"path": str(operator.parent), "type": "Directory"}}
            )
            container.setdefault("volumeMounts", []).append(
                {"name": BIN_VOLUME, "mountPath": BIN_MOUNT, "readOnly": True}
            )
        if kind == "Service" and name == "keda-operator":
            doc["spec"]["clusterIP"] = "None"
        out.append(doc)
    return out


class Keda:
    """KEDA installed into a cluster whose pod runner is up; `uninstall` takes every object away again
    (CRDs and the APIService included, so later tests see a cluster without KEDA)."""

    def __init__(self, cluster: Any, binaries: tuple[Path, Path] | None = None) -> None:
        self.cluster = cluster
        self.binaries = binaries
        """(operator, adapter) in one folder; the cached build (`keda_binaries`) when None."""
        self.objects: list[dict[str, Any]] = []

    def install(self, timeout: float = 300) -> Keda:
        operator, adapter = self.binaries or keda_binaries()
        self.objects = keda_manifests(self.cluster, operator, adapter)
        crds = [o for o in self.objects if o["kind"] == "CustomResourceDefinition"]
        rest = [o for o in self.objects if o["kind"] != "CustomResourceDefinition"]
        self._apply(crds)
        wait_established(self.cluster, [c["metadata"]["name"] for c in crds])
        self._apply(rest)
        wait_for(self._available, timeout, "KEDA's operator and metrics adapter serving", self.diagnostics)
        return self

    def _apply(self, objects: list[dict[str, Any]]) -> None:
        self.cluster.kubectl(
            "apply",
            "--server-side",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}),
        )

    def _available(self) -> bool:
        out = self.cluster.kubectl("get", "apiservice", EXTERNAL_METRICS, "-o", "json", check=False)
        if out.returncode != 0:
            return False
        conditions = json.loads(out.stdout).get("status", {}).get("conditions", [])
        return any(c["type"] == "Available" and c["status"] == "True" for c in conditions)

    def diagnostics(self) -> str:
        """The APIService's status, KEDA's pods and the tails of their logs, for a failure message."""
        api = self.cluster.kubectl("get", "apiservice", EXTERNAL_METRICS, "-o", "json", check=False).stdout
        pods = self.cluster.kubectl("get", "pods", "-n", NAMESPACE, "-o", "wide", check=False).stdout
        logs = ""
        for deployment in ("keda-operator", "keda-metrics-apiserver"):
            # A crash-looping container's current run has often printed nothing yet: the run before it says why.
            for which in ("--previous", None):
                args = ["logs", "-n", NAMESPACE, f"deploy/{deployment}", "--tail=30", *([which] if which else [])]
                text = self.cluster.kubectl(*args, check=False)
                logs += f"--- {deployment} {which or '(current)'}\n{(text.stdout or text.stderr)[-3000:]}\n"
        # How each container last ended (exit code, reason, message: a StartError or a probe kill has no log)
        # and the namespace's events say why a pod crash-loops when its log is empty.
        state = self.cluster.kubectl("get", "pods", "-n", NAMESPACE, "-o", "json", check=False)
        ended = ""
        if state.returncode == 0:
            for pod in json.loads(state.stdout)["items"]:
                for status in pod["status"].get("containerStatuses") or []:
                    ended += f"{pod['metadata']['name']}: {json.dumps(status.get('lastState'))}\n"
        events = self.cluster.kubectl("get", "events", "-n", NAMESPACE, "--sort-by=.lastTimestamp", check=False)
        return (
            f"apiservice: {api[-1500:]}\npods:\n{pods}\nlast states:\n{ended}\nevents:\n{events.stdout[-3000:]}\n{logs}"
        )

    def uninstall(self) -> None:
        """Delete what `install` applied. ScaledObjects left behind lose KEDA's finalizer first (KEDA, which
        would remove it, is going away), or their CRD could never be deleted."""
        if not self.objects:
            return
        left = self.cluster.kubectl("get", "scaledobjects.keda.sh", "-A", "-o", "json", check=False)
        if left.returncode == 0:
            for obj in json.loads(left.stdout)["items"]:
                meta = obj["metadata"]
                self.cluster.kubectl(
                    "patch", "scaledobject", meta["name"], "-n", meta["namespace"], "--type=merge",
                    "-p", '{"metadata":{"finalizers":null}}', check=False,
                )  # fmt: skip
        items = [o for o in self.objects if o["kind"] != "Namespace"]
        self.cluster.kubectl(
            "delete", "--ignore-not-found", "--wait=true", "--timeout=120s", "-f", "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}), check=False, timeout=150,
        )  # fmt: skip
        self.cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)
        self.objects = []


def hpa_of(cluster: Any, namespace: str, scaled_object: str) -> dict[str, Any] | None:
    """The HorizontalPodAutoscaler KEDA made for a ScaledObject (`keda-hpa-<name>`), or None yet."""
    out = cluster.kubectl("get", "hpa", f"keda-hpa-{scaled_object}", "-n", namespace, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


AR_ARGS = {"max_model_len": 512, "kv_cache_memory_bytes": 256 * 1024**2}


def chat_pipeline(
    name: str, autoscaling: dict[str, Any] | None, resources: dict[str, Any] | None = None
) -> dict[str, Any]:
    """text-chat on tiny Qwen2 (stage `llm`) on the pod runner; `autoscaling` for the stage, or None for a
    fixed single replica; `resources` for each stage replica. What the autoscaling test and
    bench/autoscale.py scale."""
    stage: dict[str, Any] = {**ON_RUNNER, "name": "llm", "engineArgs": AR_ARGS}
    if autoscaling is not None:
        stage["autoscaling"] = autoscaling
    if resources is not None:
        stage["resources"] = resources
    return {
        "apiVersion": "omnikube.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": name},
        "spec": {
            "model": "tiny-qwen2-chat",
            "pipeline": "text-chat",
            "servedModelName": name,
            "runtime": {
                "modelCache": {"hostPath": {"path": str(default_cache_dir())}, "mountPath": "/models", "readOnly": True}
            },
            "router": {**ON_RUNNER, "limits": {"requestTimeoutSeconds": 120}},
            "stages": [stage],
        },
    }
