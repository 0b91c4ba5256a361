"""Autoscaling through the real KEDA: load on a tiny pipeline scales its stage up and back down.

Real: the control plane (kube-controller-manager's HPA controller included), KEDA's operator and metrics
adapter built from the pinned module (scalers cut to cpu, memory and prometheus; kedalib.py) and served
through the API server's aggregation layer, Prometheus scraping the router and stage pods, the omnikube
operator (chart identity) rendering the stage's ScaledObject, vLLM on CPU in pod-runner pods, and the
official `openai` client. KEDA's HPA changes the OmniStage through its `/scale` subresource; the operator
follows with the stage's Deployment. At zero replicas the router holds a request for the stage and counts it
in omnikube_stage_requests_waiting_for_replica; KEDA's operator activates the stage on it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from chartlib import ServiceAccountOperator
from clusterlib import apply, condition, kubectl_json, wait_for
from kedalib import Keda, chat_pipeline, hpa_of
from loadlib import SteadyLoad
from promlib import Prometheus, prometheus_binary

from omni_runtime.tiny_models import ensure

pytestmark = [pytest.mark.cluster, pytest.mark.models]

PIPELINE, STAGE = "auto", "llm"
SCALED = f"{PIPELINE}-{STAGE}"  # the OmniStage, and the ScaledObject named after it
STABILIZATION_S = 20  # the scale-down window, shortened from the CRD's default for the test
POLLING_S = 5  # KEDA's polling once the stage may go to zero, shortened from KEDA's 30 s for the test
HOLD_S = 420  # the router's request timeout once the stage may go to zero: above a cold vLLM load here
READY_TIMEOUT = 900  # vLLM on two shared cores loads in about a minute, slower while other stages load


def autoscaled_pipeline(prometheus_url: str) -> dict[str, Any]:
    """The chat pipeline whose one stage scales 1..2 on its queue (two works per replica)."""
    scaling = {
        "minReplicas": 1,
        "maxReplicas": 2,
        "metric": "queue",
        "targetQueueDepth": 2,
        "scaleDownStabilizationSeconds": STABILIZATION_S,
        "prometheusAddress": prometheus_url,
    }
    return chat_pipeline(PIPELINE, scaling)


@dataclass
class Env:
    cluster: Any
    ns: str
    keda: Keda
    prometheus: Prometheus
    operator: ServiceAccountOperator

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        out = self.cluster.kubectl("get", kind, name, "-n", self.ns, "-o", "json", check=False)
        return json.loads(out.stdout) if out.returncode == 0 else None

    def pods(self, component: str) -> list[dict[str, Any]]:
        selector = f"omnikube.io/pipeline={PIPELINE}"
        pods = kubectl_json(self.cluster, "get", "pods", "-n", self.ns, "-l", selector)["items"]
        return [p for p in pods if p["metadata"]["labels"].get("omnikube.io/stage", "router") == component]

    def router_url(self) -> str:
        ready = [p for p in self.pods("router") if _ready(p) and not p["metadata"].get("deletionTimestamp")]
        assert ready, "no ready router pod"
        return f"http://{ready[0]['status']['podIP']}:8000/v1"

    def stage_replicas(self) -> int:
        stage = self.get("omnistage", SCALED)
        assert stage is not None
        return int(stage["spec"]["replicas"])

    def ready_stage_pods(self) -> list[str]:
        return [
            p["metadata"]["name"] for p in self.pods(STAGE) if _ready(p) and not p["metadata"].get("deletionTimestamp")
        ]

    def served_by(self) -> dict[str, float]:
        """Works each stage pod finished, as Prometheus scraped them."""
        query = f'sum by (pod) (omnikube_stage_requests_total{{namespace="{self.ns}",stage="{STAGE}"}})'
        return {r["metric"]["pod"]: float(r["value"][1]) for r in self.prometheus.query(query)}

    def diagnostics(self) -> str:
        hpa = hpa_of(self.cluster, self.ns, SCALED)
        scaled = self.get("scaledobject", SCALED)
        return (
            f"HPA status: {json.dumps((hpa or {}).get('status'))}\n"
            f"ScaledObject status: {json.dumps((scaled or {}).get('status'))}\n"
            f"{self.keda.diagnostics()}\noperator:\n{self.operator.log()[-1500:]}"
        )


def _ready(pod: dict[str, Any]) -> bool:
    return bool(pod["status"].get("podIP")) and condition(pod, "Ready").get("status") == "True"


def _pipeline_ready(env: Env) -> bool:
    obj = env.get("omnipipeline", PIPELINE) or {}
    status = obj.get("status") or {}
    return condition(obj, "Ready").get("status") == "True" and status.get("observedGeneration") == obj.get(
        "metadata", {}
    ).get("generation")


@pytest.fixture(scope="module")
def env(cluster, podrunner, shared_release, tmp_path_factory) -> Iterator[Env]:
    ensure("tiny-qwen2-chat")
    keda = Keda(cluster)
    # Pods reach the host at the runner's bridge address (the nodes' InternalIP): KEDA's operator queries
    # Prometheus there, as a ScaledObject's serverAddress names it.
    node = kubectl_json(cluster, "get", "node", "runner-node-0")
    bridge = next(a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP")
    prometheus = Prometheus(prometheus_binary(), tmp_path_factory.mktemp("autoscale-prometheus"), host=bridge)
    stop_following: Callable[[], None] = lambda: None  # noqa: E731 - replaced once the namespace exists
    try:
        keda.install()
        prometheus.start()
        with shared_release.module("as") as (release, operator):
            e = Env(cluster, release.apps, keda, prometheus, operator)
            stop_following = prometheus.follow(
                lambda: kubectl_json(cluster, "get", "pods", "-n", release.apps)["items"]
            )
            apply(cluster, e.ns, autoscaled_pipeline(prometheus.url))
            wait_for(lambda: _pipeline_ready(e), READY_TIMEOUT, "the autoscaled pipeline Ready", e.diagnostics)
            yield e
            stop_following()
            # The pipeline goes while KEDA still runs, so KEDA removes its ScaledObject's finalizer itself.
            cluster.kubectl(
                "delete", "omnipipeline", PIPELINE, "-n", e.ns, "--wait=true", "--timeout=120s", check=False
            )
    finally:
        stop_following()
        prometheus.stop()
        keda.uninstall()


def _chat(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Count to twenty"}]
    chunks = list(
        client.chat.completions.create(
            model=PIPELINE,
            messages=messages,
            max_tokens=48,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 48, "the stream ended early"


def test_keda_scales_a_stage_up_under_load_and_back_down_failing_no_request(env: Env) -> None:
    """Six streaming clients keep about six works on a stage that targets two per replica: KEDA's HPA
    (fed by the external-metrics adapter, which asks KEDA's operator, which asks Prometheus) raises the
    OmniStage to its maxReplicas of 2 through /scale and the new replica serves. With one client left
    the queue fits one replica: after the stabilization window the stage goes back to one replica,
    draining the other. Not one request fails throughout."""
    wait_for(
        lambda: condition(env.get("scaledobject", SCALED) or {}, "Ready").get("status") == "True",
        120,
        "KEDA reconciled the ScaledObject (Ready)",
        env.diagnostics,
    )
    assert env.stage_replicas() == 1
    first = env.ready_stage_pods()
    assert len(first) == 1, first
    light = SteadyLoad(env.router_url, [_chat]).start()
    heavy = SteadyLoad(env.router_url, [_chat] * 6).start()
    try:
        wait_for(lambda: env.stage_replicas() == 2, 240, "KEDA's HPA scaling the stage to 2", env.diagnostics)
        hpa = hpa_of(env.cluster, env.ns, SCALED)
        assert hpa is not None and hpa["spec"]["scaleTargetRef"]["kind"] == "OmniStage"
        assert hpa["spec"]["metrics"][0]["type"] == "External", hpa["spec"]["metrics"]
        new = wait_for(
            lambda: [p for p in env.ready_stage_pods() if p not in first and env.served_by().get(p, 0) > 0],
            READY_TIMEOUT,
            "the new replica ready and serving",
            env.diagnostics,
        )
        assert new
    finally:
        failed_heavy = heavy.stop()
    try:
        wait_for(
            lambda: env.stage_replicas() == 1 and len(env.ready_stage_pods()) == 1 and len(env.pods(STAGE)) == 1,
            STABILIZATION_S + 240,
            "KEDA's HPA scaling the stage back to 1 after the stabilization window",
            env.diagnostics,
        )
        wait_for(lambda: _pipeline_ready(env), 120, "the pipeline Ready on one replica", env.diagnostics)
        served_before = light.ok()
        wait_for(lambda: light.ok() > served_before, 120, "the remaining replica serving", env.diagnostics)
    finally:
        failed_light = light.stop()
    failed = failed_heavy + failed_light
    outcomes = len(heavy.outcomes) + len(light.outcomes)
    assert failed == [], f"{len(failed)} of {outcomes} requests failed while the stage scaled: {failed[:10]}"


def _scale_from_zero(env: Env) -> None:
    """What a user does to let the stage go to zero when idle: minReplicas 0, KEDA polling sooner, and a
    request timeout above the stage's load time (the router holds requests that long)."""
    patch = [
        {"op": "replace", "path": "/spec/stages/0/autoscaling/minReplicas", "value": 0},
        {"op": "add", "path": "/spec/stages/0/autoscaling/pollingIntervalSeconds", "value": POLLING_S},
        {"op": "replace", "path": "/spec/router/limits/requestTimeoutSeconds", "value": HOLD_S},
    ]
    env.cluster.kubectl("patch", "omnipipeline", PIPELINE, "-n", env.ns, "--type=json", "-p", json.dumps(patch))


def test_keda_takes_an_idle_stage_to_zero_and_a_held_request_wakes_it(env: Env) -> None:
    """With minReplicas 0 the idle stage goes to zero replicas after the cooldown (KEDA's operator scales
    the OmniStage to 0 itself; its HPA cannot). The next request is held by the router, which counts it in
    omnikube_stage_requests_waiting_for_replica; KEDA's operator, querying Prometheus, sees the demand and
    activates the stage; the operator's Deployment starts a replica and, once it is ready, the held request
    is answered in full through the official `openai` client, not refused. (A request held past the request
    timeout gets 503 with Retry-After: tests/test_router_app.py covers that with a real stage server.)"""
    _scale_from_zero(env)
    wait_for(
        lambda: (env.get("scaledobject", SCALED) or {}).get("spec", {}).get("minReplicaCount") == 0,
        120,
        "the operator rendering minReplicaCount 0",
        env.diagnostics,
    )
    wait_for(
        lambda: env.stage_replicas() == 0 and not env.pods(STAGE),
        STABILIZATION_S + 300,
        "KEDA taking the idle stage to zero replicas",
        env.diagnostics,
    )
    # The router rolled to the configuration that lets the stage have no replica: only that one answers.
    wait_for(
        lambda: _pipeline_ready(env) and len(env.pods("router")) == 1 and not env.ready_stage_pods(),
        240,
        "the pipeline Ready at zero stage replicas, on the new router alone",
        env.diagnostics,
    )
    client = openai.OpenAI(base_url=env.router_url(), api_key="unused", max_retries=0, timeout=HOLD_S + 60)
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(_chat, client)
        wait_for(
            lambda: env.stage_replicas() == 1 or held.done(),
            120,
            "KEDA activating the stage on the held request",
            env.diagnostics,
        )
        assert not held.done(), f"the request ended before a replica existed: {held.exception()!r}"
        held.result(timeout=HOLD_S + 60)  # answered in full (48 tokens), once the new replica is ready
    (pod,) = env.ready_stage_pods()
    assert wait_for(lambda: env.served_by().get(pod, 0) > 0, 60, "the woken replica's work scraped", env.diagnostics)
