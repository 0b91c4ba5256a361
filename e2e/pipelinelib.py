"""One OmniPipeline of a shared release, as the model modules of the cluster tier meet it: its pods and their logs,
Ready on its current generation, the router pod's `openai` client, and the stage processes' metrics scraped
through the pod network."""

from __future__ import annotations

import json

import httpx
import openai
from chartlib import Release, ServiceAccountOperator
from clusterlib import condition, kubectl_json, wait_for
from prometheus_client.parser import text_string_to_metric_families

from omni_operator.resolve import stage_ports

READY_TIMEOUT = 900  # vLLM on two shared cores loads a thinker in about a minute, more under load


class PipelineEnv:
    """The release (chart + operator) and one pipeline of it, by name."""

    def __init__(self, cluster, runner, release: Release, operator: ServiceAccountOperator, name: str) -> None:
        self.cluster, self.runner, self.release, self.operator, self.name = cluster, runner, release, operator, name

    @property
    def ns(self) -> str:
        return self.release.apps

    def pipeline(self) -> dict:
        return kubectl_json(self.cluster, "get", "omnipipeline", self.name, "-n", self.ns)

    @property
    def selector(self) -> str:
        return f"omnikube.io/pipeline={self.name}"

    def objects(self, kind: str, selector: str = "") -> list[dict]:
        """The pipeline's objects of `kind` (terminating ones included), narrowed by `selector`."""
        labels = ",".join(filter(None, [self.selector, selector]))
        return kubectl_json(self.cluster, "get", kind, "-n", self.ns, "-l", labels)["items"]

    def pods(self, component: str | None = None) -> list[dict]:
        """The pipeline's pods that are not terminating (of one component if given)."""
        items = self.objects("pods", f"app.kubernetes.io/component={component}" if component else "")
        return [p for p in items if not p["metadata"].get("deletionTimestamp")]

    def stage_pod(self, stage: str) -> dict:
        (pod,) = [p for p in self.pods("stage") if p["metadata"]["labels"].get("omnikube.io/stage") == stage]
        return pod

    def describe(self) -> str:
        lines = []
        for p in self.pods():
            lines.append(f"--- {p['metadata']['name']} {p['status'].get('phase')}")
            for c in p["spec"]["containers"]:
                try:
                    log = self.runner.logs(self.ns, p["metadata"]["name"], c["name"])
                except Exception as exc:  # noqa: BLE001 - the pod may be gone already
                    log = f"<no logs: {exc}>"
                lines.append(f"[{c['name']}] {log[-1500:]}")
        status = json.dumps(self.pipeline().get("status"))[:3000]
        return "\n".join(lines) + f"\nstatus: {status}\noperator:\n{self.operator.log()[-1500:]}"

    def wait_ready(self, since: frozenset[str] | set[str] = frozenset()) -> dict:
        """Ready on its current generation, with no stage pod whose name is in `since`."""

        def ready() -> dict | None:
            obj = self.pipeline()
            pods = self.pods("stage")
            fresh = {p["metadata"]["name"] for p in pods}.isdisjoint(since)
            fresh = fresh and all(condition(p, "Ready").get("status") == "True" for p in pods)
            current = (obj.get("status") or {}).get("observedGeneration") == obj["metadata"]["generation"]
            return obj if current and fresh and condition(obj, "Ready").get("status") == "True" else None

        return wait_for(ready, READY_TIMEOUT, f"{self.name} Ready", self.describe)  # type: ignore[return-value]

    @property
    def base(self) -> str:
        (router,) = [p for p in self.pods("router") if p["status"].get("podIP")]
        return f"http://{router['status']['podIP']}:8000"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0, timeout=300)

    def stage_metric(self, name: str, **labels: str) -> float:
        """Sum of metric `name` (samples matching `labels`) over every stage process of the ready stage pods,
        scraped from each stage container's /metrics through the pod network."""
        total = 0.0
        for pod in self.pods("stage"):
            if condition(pod, "Ready").get("status") != "True":
                continue  # a replacement pod still loading has served nothing yet
            ip = pod["status"]["podIP"]
            for index, _ in enumerate(pod["spec"]["containers"]):
                with httpx.Client(trust_env=False, timeout=10) as http:
                    text = http.get(f"http://{ip}:{stage_ports(index)[1]}/metrics").text
                for family in text_string_to_metric_families(text):
                    for sample in family.samples:
                        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                            total += sample.value
        return total

    def wait_payloads_released(self) -> None:
        """Every stage's unreleased-payload gauge back at 0 (the router's releases reach the stages shortly after
        the request ends)."""
        wait_for(
            lambda: self.stage_metric("omnikube_connector_payloads_unreleased") == 0,
            60,
            "every stage's unreleased payloads at 0",
            lambda: str(self.stage_metric("omnikube_connector_payloads_unreleased")),
        )
