"""Every edge kind between real pods: mooncake `p2p` and `store`, and `shm` between colocated stages, on the
`enhancer -> dit` edge of prompt-enhanced-t2i (tiny-prompt-enhanced-t2i), with the real `openai` client
through the router pod. (Inline across pods is what test_end_to_end.py's `enhanced` pipeline runs.)

Real: the control plane, Helm, the operator holding only the chart ServiceAccount's token, the pod runner
running the router, each stage and the pipeline's Mooncake master as processes in their own network
namespaces (pod IPs on a bridge), the real Mooncake master and transfer engines, vLLM and diffusers.
Stages reach the master by its headless Service's DNS name, which the pod runner's DNS stand-in keeps in
each pod's /etc/hosts (e2e/podrunner/README.md).

One pipeline walks through the kinds (each change rolls both stages), so only one enhancer and one
diffusion stage load at a time: first with its master scaled to zero (a stage whose connector cannot
start within `connectors.startTimeoutSeconds` never turns ready; the pipeline says
Degraded/ConnectorUnavailable naming the address and that timeout), then p2p, store and shm, each
answering the same seeded request with the same image.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import psutil
import pytest
from chartlib import Release, ServiceAccountOperator
from clusterlib import apply, condition, kubectl_json, wait_for

from omni_runtime.tiny_models import default_cache_dir, ensure

pytestmark = [pytest.mark.cluster, pytest.mark.models]

NAME = "edges"
READY_TIMEOUT = 900
AR_ARGS = {"max_model_len": 512, "kv_cache_memory_bytes": 256 * 1024**2}
SIZES = {"globalSegmentSize": "64Mi", "localBufferSize": "16Mi"}
# A stage gives up on an unreachable master after this long (the default 120 s would only make step 1 wait).
CONNECTOR_START_TIMEOUT = 20


def on_runner() -> dict:
    from podrunner.node import RUNNER_LABEL

    return {
        "nodeSelector": {RUNNER_LABEL: "true"},
        "tolerations": [{"key": RUNNER_LABEL, "operator": "Exists", "effect": "NoSchedule"}],
    }


def manifest(connectors: dict, *, colocate: bool = False) -> dict:
    dit = {"name": "dit", "samplingParams": {"num_inference_steps": 2}}  # the topology's engine args serve
    if colocate:
        dit["colocateWith"] = "enhancer"
    return {
        "apiVersion": "omnikube.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": NAME},
        "spec": {
            "model": "tiny-prompt-enhanced-t2i",
            "pipeline": "prompt-enhanced-t2i",
            "servedModelName": NAME,
            "runtime": {
                "modelCache": {"hostPath": {"path": str(default_cache_dir())}, "mountPath": "/models", "readOnly": True}
            },
            "router": {**on_runner(), "limits": {"requestTimeoutSeconds": 120}},
            "connectors": {**connectors, "startTimeoutSeconds": CONNECTOR_START_TIMEOUT},
            "stages": [
                {
                    **on_runner(),
                    "name": "enhancer",
                    "engineArgs": AR_ARGS,
                    "samplingParams": {"max_tokens": 12, "ignore_eos": True},
                },
                {**on_runner(), **dit},
            ],
        },
    }


def mooncake(mode: str) -> dict:
    return {"default": "mooncake", "mooncake": {"mode": mode, **SIZES}}


class Env:
    def __init__(self, cluster, release: Release, operator: ServiceAccountOperator) -> None:
        self.cluster, self.release, self.operator = cluster, release, operator

    @property
    def ns(self) -> str:
        return self.release.apps

    def pipeline(self) -> dict:
        return kubectl_json(self.cluster, "get", "omnipipeline", NAME, "-n", self.ns)

    def pods(self, component: str | None = None) -> list[dict]:
        selector = f"omnikube.io/pipeline={NAME}" + (f",app.kubernetes.io/component={component}" if component else "")
        items = kubectl_json(self.cluster, "get", "pods", "-n", self.ns, "-l", selector)["items"]
        return [p for p in items if not p["metadata"].get("deletionTimestamp")]

    def describe(self) -> str:
        rows = [
            (p["metadata"]["name"], p["status"].get("phase"), p["status"].get("containerStatuses")) for p in self.pods()
        ]
        return (
            f"pods: {json.dumps(rows)[:4000]}\nstatus: {json.dumps(self.pipeline().get('status'))}\n"
            + self.operator.log()[-1500:]
        )

    def wait_ready(self, since: frozenset[str] | set[str] = frozenset()) -> dict:
        """Ready on its current generation, with stage pods none of which is in `since` (a roll done)."""

        def ready() -> dict | None:
            obj = self.pipeline()
            fresh = {p["metadata"]["name"] for p in self.pods("stage")}.isdisjoint(since)
            current = obj.get("status", {}).get("observedGeneration") == obj["metadata"]["generation"]
            return obj if current and fresh and condition(obj, "Ready").get("status") == "True" else None

        return wait_for(ready, READY_TIMEOUT, f"{NAME} Ready", self.describe)  # type: ignore[return-value]

    def client(self) -> openai.OpenAI:
        (router,) = [p for p in self.pods("router") if p["status"].get("podIP")]
        return openai.OpenAI(
            base_url=f"http://{router['status']['podIP']}:8000/v1", api_key="unused", max_retries=0, timeout=120
        )

    def image(self) -> str:
        result = self.client().images.generate(
            model=NAME, prompt="a red cube", size="64x64", response_format="b64_json", extra_body={"seed": 5}
        )
        return result.data[0].b64_json or ""


@pytest.fixture(scope="module")
def env(cluster, podrunner, shared_release) -> Iterator[Env]:
    ensure("tiny-prompt-enhanced-t2i")
    with shared_release.module("cx") as (release, operator):
        yield Env(cluster, release, operator)


def _advertised_hosts(env: Env) -> dict[str, str]:
    """Stage -> the --advertise-host its running process got (after the kubelet expanded $(POD_IP))."""
    found = {}
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "stage" in cmd and "--advertise-host" in cmd and "--stage" in cmd:
            try:
                environ = proc.environ()
            except (psutil.AccessDenied, psutil.NoSuchProcess):
                continue
            if environ.get("POD_NAMESPACE") == env.ns:
                found[cmd[cmd.index("--stage") + 1]] = cmd[cmd.index("--advertise-host") + 1]
    return found


def test_every_edge_kind_moves_the_same_image_between_real_pods(env: Env) -> None:
    master = f"{NAME}-mooncake"
    apply(env.cluster, env.ns, manifest(mooncake("p2p")))

    # 1. The master cannot be reached: no stage turns ready, and the pipeline says why and where.
    def master_deployment() -> dict | None:
        out = env.cluster.kubectl("get", "deployment", master, "-n", env.ns, "-o", "json", check=False)
        return json.loads(out.stdout) if out.returncode == 0 else None

    wait_for(master_deployment, 60, f"Deployment {master}", env.describe)
    env.cluster.kubectl("scale", "deployment", master, "-n", env.ns, "--replicas=0")
    for pod in env.pods("mooncake"):  # one may have started before the scale took effect
        env.cluster.kubectl("delete", "pod", pod["metadata"]["name"], "-n", env.ns, "--grace-period=0", "--wait=false")
    for pod in env.pods("stage"):  # and a stage may have reached it meanwhile: start them afresh
        env.cluster.kubectl("delete", "pod", pod["metadata"]["name"], "-n", env.ns, "--wait=false")

    def degraded() -> dict | None:
        cond = condition(env.pipeline(), "Degraded")
        return cond if cond.get("status") == "True" and cond.get("reason") == "ConnectorUnavailable" else None

    cond = wait_for(degraded, 400, "Degraded/ConnectorUnavailable", env.describe)
    assert f"{master}.{env.ns}.svc" in cond["message"], cond["message"]
    assert f"did not start in {CONNECTOR_START_TIMEOUT}s" in cond["message"], cond["message"]  # the spec's timeout
    assert condition(env.pipeline(), "Ready").get("status") == "False"

    # 2. mooncake p2p, the master back: stages in separate pods, each advertising its own pod IP.
    env.cluster.kubectl("scale", "deployment", master, "-n", env.ns, "--replicas=1")
    env.wait_ready()
    stage_pods = {p["metadata"]["labels"]["omnikube.io/stage"]: p for p in env.pods("stage")}
    assert set(stage_pods) == {"enhancer", "dit"}
    ips = {stage: pod["status"]["podIP"] for stage, pod in stage_pods.items()}
    assert ips["enhancer"] != ips["dit"]
    assert _advertised_hosts(env) == ips
    p2p = env.image()
    assert p2p
    assert "mooncake" in json.dumps(env.pipeline()["status"]["topology"]["edges"])

    # 3. mooncake store: a contract change rolls both stages; the same seed gives the same picture.
    before = {p["metadata"]["name"] for p in env.pods("stage")}
    apply(env.cluster, env.ns, manifest(mooncake("store")))
    env.wait_ready(since=before)
    assert env.image() == p2p

    # 4. shm between colocated stages: one pod, two containers, no master left.
    before = {p["metadata"]["name"] for p in env.pods("stage")}
    apply(env.cluster, env.ns, manifest({"default": "shm"}, colocate=True))
    env.wait_ready(since=before)
    (pod,) = env.pods("stage")
    assert [c["name"] for c in pod["spec"]["containers"]] == ["enhancer", "dit"]
    assert env.image() == p2p
    wait_for(lambda: master_deployment() is None, 60, f"{master} removed once no edge uses mooncake", env.describe)
