"""End to end in the cluster: the chart's operator identity, pods that really run, real answers.

Real: the control plane, Helm, the operator (as a process holding only the chart ServiceAccount's
token), the pod runner running every stage and router pod as real processes (vLLM on CPU, diffusers)
in their own network namespaces, EndpointSlices filled by the controller-manager and watched by the
router, and the official `openai` client talking to the router pod's IP.
"""

from __future__ import annotations

import base64
import copy
import io
import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import yaml
from chartlib import Release, ServiceAccountOperator, helm
from clusterlib import REPO, apply, condition, kubectl_json, wait_for
from loadlib import RouterService, SteadyLoad
from PIL import Image
from podrunner.node import ON_RUNNER
from promlib import Prometheus, metric_names, pod_targets, prometheus_binary

from omni_operator.metrics import STAGE_REPLICAS_DESIRED
from omni_operator.render import render_pipeline
from omni_runtime.registry import default_registry
from omni_runtime.tiny_models import PROMPT_ENHANCED_BROKEN, PROMPT_ENHANCED_R2, default_cache_dir, ensure

pytestmark = [pytest.mark.cluster, pytest.mark.models]

AR_ARGS = {"max_model_len": 512, "kv_cache_memory_bytes": 256 * 1024**2}
READY_TIMEOUT = 900  # vLLM on two shared cores loads in about a minute; several stages load at once


def pipeline(name: str, topology: str, model: str, stages: list[dict]) -> dict:
    return {
        "apiVersion": "omnikube.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": name},
        "spec": {
            "model": model,
            "pipeline": topology,
            "servedModelName": name,
            "runtime": {
                "modelCache": {"hostPath": {"path": str(default_cache_dir())}, "mountPath": "/models", "readOnly": True}
            },
            "router": {**ON_RUNNER, "limits": {"requestTimeoutSeconds": 120}},
            "stages": [{**ON_RUNNER, **s} for s in stages],
        },
    }


PIPELINES = [
    pipeline("chat", "text-chat", "tiny-qwen2-chat", [{"name": "llm", "engineArgs": AR_ARGS}]),
    # FLUX with the topology's own engine args (bfloat16 asked; the stage runs what the CPU has)
    pipeline("t2i", "flux", "tiny-flux", [{"name": "dit", "samplingParams": {"num_inference_steps": 2}}]),
    pipeline(
        "enhanced",
        "prompt-enhanced-t2i",
        "tiny-prompt-enhanced-t2i",
        [
            {"name": "enhancer", "engineArgs": AR_ARGS, "samplingParams": {"max_tokens": 12, "ignore_eos": True}},
            {"name": "dit", "samplingParams": {"num_inference_steps": 2}},
        ],
    ),
]


class Env:
    def __init__(self, cluster, runner, release: Release, operator: ServiceAccountOperator) -> None:
        self.cluster, self.runner, self.release, self.operator = cluster, runner, release, operator

    @property
    def ns(self) -> str:
        return self.release.apps

    def get(self, kind: str, name: str) -> dict | None:
        out = self.cluster.kubectl("get", kind, name, "-n", self.ns, "-o", "json", check=False)
        return json.loads(out.stdout) if out.returncode == 0 else None

    def wait_ready(self, name: str, timeout: float = READY_TIMEOUT) -> dict:
        deadline = time.monotonic() + timeout
        obj: dict | None = None
        while time.monotonic() < deadline:
            obj = self.get("omnipipeline", name)
            status = (obj or {}).get("status") or {}
            ready = [c for c in status.get("conditions", []) if c["type"] == "Ready"]
            if (
                ready
                and ready[0]["status"] == "True"
                and status.get("observedGeneration") == obj["metadata"]["generation"]
            ):
                return obj
            time.sleep(0.5)
        pods = kubectl_json(self.cluster, "get", "pods", "-n", self.ns)["items"]
        states = [
            (
                p["metadata"]["name"],
                p["status"].get("phase"),
                [c.get("restartCount") for c in p["status"].get("containerStatuses", [])],
            )
            for p in pods
        ]
        logs = "\n".join(
            f"--- {p['metadata']['name']}/{c['name']}\n" + self.runner_logs(p["metadata"]["name"], c["name"])[-1500:]
            for p in pods
            for c in p["spec"]["containers"]
        )
        raise AssertionError(
            f"{name} not Ready: {json.dumps((obj or {}).get('status'), indent=1)}\n"
            f"pods: {states}\n{logs}\noperator:\n{self.operator.log()[-2000:]}"
        )

    def runner_logs(self, pod: str, container: str) -> str:
        try:
            return self.runner.logs(self.ns, pod, container)
        except Exception as exc:  # the pod may be gone already
            return f"<no logs for {pod}: {exc}>"

    def router_url(self, name: str) -> str:
        pods = kubectl_json(
            self.cluster,
            "get",
            "pods",
            "-n",
            self.ns,
            "-l",
            f"omnikube.io/pipeline={name},app.kubernetes.io/component=router",
        )["items"]
        ready = [
            p
            for p in pods
            if p["status"].get("podIP")
            and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
        ]
        assert ready, f"no ready router pod for {name}"
        return f"http://{ready[0]['status']['podIP']}:8000/v1"

    def client(self, name: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.router_url(name), api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def env(cluster, podrunner, shared_release) -> Iterator[Env]:
    for model in ("tiny-qwen2-chat", "tiny-flux", "tiny-prompt-enhanced-t2i"):
        ensure(model)
    # The cluster fixture installed the CRDs already; the chart brings the operator's identity and RBAC.
    with shared_release.module("e2e") as (release, operator):
        e = Env(cluster, podrunner, release, operator)
        apply(cluster, release.apps, {"apiVersion": "v1", "kind": "List", "items": PIPELINES})
        for p in PIPELINES:
            e.wait_ready(p["metadata"]["name"])
        yield e


def _png(b64: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    image.load()
    return image


def test_chat_answers_through_the_router_pod(env) -> None:
    client = env.client("chat")
    reply = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0
    chunks = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content


def test_text_to_image_through_the_router_pod(env) -> None:
    result = env.client("t2i").images.generate(
        model="t2i", prompt="a red cube", size="80x48", n=1, response_format="b64_json", extra_body={"seed": 3}
    )
    assert _png(result.data[0].b64_json).size == (80, 48)  # tiny-flux through the router pod


def test_prompt_enhanced_text_to_image_through_the_router_pod(env) -> None:
    client = env.client("enhanced")
    first = client.images.generate(
        model="enhanced", prompt="a cat", size="64x64", response_format="b64_json", extra_body={"seed": 1}
    )
    again = client.images.generate(
        model="enhanced", prompt="a cat", size="64x64", response_format="b64_json", extra_body={"seed": 1}
    )
    assert _png(first.data[0].b64_json).size == (64, 64)
    assert first.data[0].b64_json == again.data[0].b64_json  # deterministic through both stages


# --- monitoring ------------------------------------------------------------------------------------


def _dashboard_exprs() -> list[str]:
    """Every PromQL expression of the chart's dashboards, Grafana's variables set to match everything."""
    exprs = []
    for path in sorted((REPO / "charts" / "omnikube" / "files" / "dashboards").glob("*.json")):
        board = json.loads(path.read_text())
        for var in board["templating"]["list"]:
            if var["type"] == "query":  # label_values(<selector>, label): the selector is PromQL
                exprs.append(re.fullmatch(r"label_values\((.*), *\w+\)", var["query"]["query"]).group(1))
        exprs += [t["expr"] for panel in board["panels"] for t in panel["targets"]]
    values = {"$namespace": ".*", "$pipeline": ".*", "$stage": ".*", "$__rate_interval": "1m"}
    out = []
    for expr in exprs:
        for name, value in values.items():
            expr = expr.replace(name, value)
        assert "$" not in expr, f"a dashboard variable this test does not set: {expr}"
        out.append(expr)
    return out


def _rule_exprs(env: Env) -> list[str]:
    chart = str(REPO / "charts" / "omnikube")
    sets = ["--set", "monitoring.rules.enabled=true", "--set", "serviceMonitor.enabled=true"]
    out = helm(env.cluster, "template", "omk", chart, *sets)
    rules = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "PrometheusRule"]
    return [r["expr"] for d in rules for g in d["spec"]["groups"] for r in g["rules"]]


def _autoscaler_exprs(env: Env) -> list[str]:
    """The queries of the ScaledObjects the operator would make, were every stage of these pipelines
    autoscaled (each kind's default signal), and with each signal chosen explicitly."""
    exprs = []
    for manifest in PIPELINES:
        for metric in (None, "ttft", "ttfp", "rtf", "denoisingSteps", "from zero"):
            scaled = copy.deepcopy(manifest)
            scaled["metadata"]["namespace"] = env.ns
            for stage in scaled["spec"]["stages"]:
                if metric == "from zero":
                    stage["autoscaling"] = {"minReplicas": 0, "maxReplicas": 2}
                else:
                    stage["autoscaling"] = {"maxReplicas": 2} | ({"metric": metric} if metric else {})
            for obj in render_pipeline(scaled, default_registry()):
                if obj["kind"] == "ScaledObject":
                    exprs += [t["metadata"]["query"] for t in obj["spec"]["triggers"]]
    return sorted(set(exprs))


def test_every_dashboard_alert_and_autoscaler_query_runs_on_prometheus_scraping_the_pods(env, tmp_path) -> None:
    """A real Prometheus scrapes every router and stage pod of the running pipelines (after the requests
    above); each expression must evaluate without error and name only metrics the pods export."""
    prometheus = Prometheus(prometheus_binary(), tmp_path).start()
    try:
        groups = pod_targets(kubectl_json(env.cluster, "get", "pods", "-n", env.ns)["items"])
        assert len(groups) >= 6, groups  # three routers and their stages
        prometheus.set_targets(groups)
        # The operator, as the chart's ServiceMonitor scrapes it (its pod's namespace on the target).
        address = f"127.0.0.1:{env.operator.metrics_port}"
        prometheus.set_targets([{"targets": [address], "labels": {"namespace": env.release.namespace}}], operator=True)
        prometheus.wait_scraped(len(groups) + 1)
        # The requests of the tests above are counted (a stage's outstanding gauge is set once it served).
        wait_for(
            lambda: (
                prometheus.query(f'sum(omnikube_requests_total{{namespace="{env.ns}"}})')
                and prometheus.query(f'omnikube_stage_outstanding_requests{{namespace="{env.ns}",pipeline="chat"}}')
            ),
            30,
            "router metrics scraped",
            prometheus.log,
        )
        known = metric_names(prometheus)
        assert "omnikube_stage_denoising_steps_queued" in known and "omnikube_e2e_request_latency_seconds" in known
        exprs = {"dashboard": _dashboard_exprs(), "alerts": _rule_exprs(env), "autoscalers": _autoscaler_exprs(env)}
        assert all(exprs.values()), exprs
        problems = []
        for source, items in exprs.items():
            for expr in items:
                unknown = sorted(set(re.findall(r"\bomnikube_[a-z0-9_]+", expr)) - known)
                if unknown:
                    problems.append(f"{source}: {unknown} not exported by any pod: {expr}")
                try:
                    prometheus.query(expr)
                except AssertionError as exc:
                    problems.append(f"{source}: {exc}")
        assert not problems, "\n".join(problems)
        # The chat stage's queue query (what its ScaledObject would read) sees the stage.
        queue = next(e for e in exprs["autoscalers"] if 'pipeline="chat",stage=~"llm"' in e and "outstanding" in e)
        assert prometheus.query(queue), queue
        # The operator says what each stage asks for, in the pipelines' namespace; every stage is up, so
        # OmnikubeStageDown's expression finds none (it fires on recorded series in test_helm_chart.py).
        desired = prometheus.query(f'{STAGE_REPLICAS_DESIRED}{{namespace="{env.ns}"}}')
        asked = {(r["metric"]["pipeline"], r["metric"]["stage"]): r["value"][1] for r in desired}
        assert asked == {("chat", "llm"): "1", ("t2i", "dit"): "1", ("enhanced", "enhancer"): "1",
                         ("enhanced", "dit"): "1"}, asked  # fmt: skip
        stage_down = next(e for e in exprs["alerts"] if STAGE_REPLICAS_DESIRED in e)
        assert [r for r in prometheus.query(stage_down) if r["metric"]["namespace"] == env.ns] == []
    finally:
        prometheus.stop()


def _stage_processes(env: Env, pipeline_name: str, stage: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "stage" in cmd and "--stage" in cmd and cmd[cmd.index("--stage") + 1] == stage:
            try:
                environ = proc.environ()
            except (psutil.AccessDenied, psutil.NoSuchProcess):
                continue
            if environ.get("POD_NAMESPACE") == env.ns and environ.get("POD_NAME", "").startswith(f"{pipeline_name}-"):
                found.append(proc)
    return found


def _chat(stream: bool) -> Callable[[openai.OpenAI], None]:
    def call(client: openai.OpenAI) -> None:
        messages = [{"role": "user", "content": "Count to twenty"}]
        args = {"model": "chat", "messages": messages, "max_tokens": 24, "extra_body": {"ignore_eos": True}}
        if stream:
            chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
            assert chunks[-1].usage.completion_tokens == 24, "the stream ended early"
        else:
            assert client.chat.completions.create(**args).usage.completion_tokens == 24

    return call


def _generate_image(client: openai.OpenAI) -> None:
    result = client.images.generate(model="enhanced", prompt="a dog", size="64x64", response_format="b64_json")
    assert _png(result.data[0].b64_json).size == (64, 64)


def _generate_image_noting(served: list[dict[str, str]]) -> Callable[[openai.OpenAI], None]:
    """`_generate_image` that keeps, per response, the stage digests it ran on (`x-omnikube-contract`)."""

    def call(client: openai.OpenAI) -> None:
        raw = client.images.with_raw_response.generate(
            model="enhanced", prompt="a dog", size="64x64", response_format="b64_json"
        )
        assert _png(raw.parse().data[0].b64_json).size == (64, 64)
        served.append(json.loads(raw.headers["x-omnikube-contract"]))

    return call


def _stage_deployments(env: Env, pipeline_name: str) -> dict[str, str]:
    """Stage -> the name of the Deployment of its current generation."""
    selector = f"omnikube.io/pipeline={pipeline_name},app.kubernetes.io/component=stage"
    items = kubectl_json(env.cluster, "get", "deployments", "-n", env.ns, "-l", selector)["items"]
    return {d["metadata"]["labels"]["omnikube.io/stage"]: d["metadata"]["name"] for d in items}


def _pods(env: Env, pipeline_name: str) -> dict[str, dict]:
    items = kubectl_json(env.cluster, "get", "pods", "-n", env.ns, "-l", f"omnikube.io/pipeline={pipeline_name}")
    return {p["metadata"]["name"]: p for p in items["items"]}


def _component(pod: dict) -> str:
    return pod["metadata"]["labels"].get("omnikube.io/stage", "router")


def _roll(
    env: Env, edited: dict, load: SteadyLoad, components: str | set[str]
) -> tuple[dict[str, str], dict[str, str]]:
    """Apply `edited` under `load` and wait until the pipeline is Ready again and every old pod of each of
    `components` has exited (its drain included); then (components before, after) by pod name."""
    name = edited["metadata"]["name"]
    wanted = {components} if isinstance(components, str) else components
    before = {n: _component(p) for n, p in _pods(env, name).items()}
    wait_for(lambda: load.ok() >= 4, 300, "requests succeeding before the roll")
    apply(env.cluster, env.ns, edited)
    old = {n for n, c in before.items() if c in wanted}

    def rolled() -> bool:
        now = _pods(env, name)
        new = {_component(p) for n, p in now.items() if _component(p) in wanted and n not in before}
        obj = env.get("omnipipeline", name) or {}
        status = obj.get("status") or {}
        ready = [c for c in status.get("conditions", []) if c["type"] == "Ready"]
        current = status.get("observedGeneration") == obj["metadata"]["generation"]
        return new == wanted and not (old & set(now)) and current and bool(ready) and ready[0]["status"] == "True"

    def state() -> str:
        stages = kubectl_json(env.cluster, "get", "omnistages", "-n", env.ns, "-l", f"omnikube.io/pipeline={name}")
        return "\n".join(
            [
                json.dumps((env.get("omnipipeline", name) or {}).get("status"), indent=1),
                *(json.dumps({s["metadata"]["name"]: s.get("status")}, indent=1) for s in stages["items"]),
                json.dumps({n: (_component(p), p["status"].get("phase")) for n, p in _pods(env, name).items()}),
                env.operator.log()[-3000:],
            ]
        )

    wait_for(rolled, READY_TIMEOUT, f"{name}: {sorted(wanted)} rolled and their old pods gone", state)
    done = load.ok()
    wait_for(lambda: load.ok() >= done + 4, 300, "requests succeeding after the roll")
    return before, {n: _component(p) for n, p in _pods(env, name).items()}


def _status(url: str) -> int | None:
    """The HTTP status of a GET, or None when nothing answers."""
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return None


def test_a_killed_stage_restarts_and_serves_then_its_roll_under_steady_load_fails_no_request(env) -> None:
    """The upstream (enhancer, vLLM) stage of the two-stage pipeline, SIGKILLed, is restarted in its pod and
    serves again through both stages; then, with three image clients running, one spec change rolls both
    ways at once, and not one request fails:

    - the enhancer's max_model_len (outside the contract) rolls that stage in place: the old replica drains
      (no new work, what it runs finishes), the new one takes over, in the same Deployment;
    - the dit's torch_dtype (in the contract: float32 where the topology asks bfloat16, which a CPU without
      fast bfloat16 runs as float32 anyway) brings up a new generation of the dit in a Deployment of its own
      beside the old one; the router moves new requests to it once it is ready, and the old one drains and
      goes. Every response names the stage digests it ran on (x-omnikube-contract): one enhancer digest
      throughout (its contract did not change), the dit's old one and then its new one, never a third.

    One roll for the tier: the enhancer's is the stricter case (its work feeds the dit stage through the
    router); streams through a stage draining on SIGTERM are tests/test_serve_drain.py's, streams across a
    roll are test_a_router_roll_under_steady_load_fails_no_request's."""
    (proc,) = _stage_processes(env, "enhanced", "enhancer")
    proc.send_signal(signal.SIGKILL)
    wait_for(
        lambda: any(
            c.get("restartCount", 0) > 0
            for p in _pods(env, "enhanced").values()
            if _component(p) == "enhancer"
            for c in p["status"].get("containerStatuses", [])
        ),
        60,
        "the killed enhancer container to be restarted (restartCount > 0)",
    )
    env.wait_ready("enhanced")
    # Ready as the router sees it: the pipeline's Ready condition can still be the one from before the kill (the
    # operator has not seen the pod go unready yet), and the router learns of the restarted replica only through
    # its own discovery. Its readiness endpoint says when every stage has a ready replica there.
    health = env.router_url("enhanced").removesuffix("/v1") + "/health"
    wait_for(
        lambda: _status(health) == 200, READY_TIMEOUT, "the router seeing the restarted enhancer ready (/health 200)"
    )
    _generate_image(env.client("enhanced"))  # the restarted stage serves again

    url = env.router_url("enhanced")
    served: list[dict[str, str]] = []
    noting = _generate_image_noting(served)
    load = SteadyLoad(lambda: url, [noting, noting, noting]).start()
    edited = json.loads(json.dumps(PIPELINES[2]))
    edited["spec"]["stages"][0]["engineArgs"] = {**AR_ARGS, "max_model_len": 384}
    edited["spec"]["stages"][1]["engineArgs"] = {"torch_dtype": "float32"}  # the topology asks bfloat16
    workloads = _stage_deployments(env, "enhanced")
    try:
        before, after = _roll(env, edited, load, {"enhancer", "dit"})
    finally:
        failed = load.stop()
    assert failed == [], f"{len(failed)} of {len(load.outcomes)} requests failed during the roll: {failed[:10]}"
    assert {c for n, c in before.items() if n not in after} == {"enhancer", "dit"}, (before, after)
    rolled = _stage_deployments(env, "enhanced")
    assert rolled["enhancer"] == workloads["enhancer"], "outside the contract: rolled in its own Deployment"
    assert rolled["dit"] != workloads["dit"], "in the contract: a new generation in a Deployment of its own"
    assert all(set(c) == {"enhancer", "dit"} for c in served), served[:5]
    assert len({c["enhancer"] for c in served}) == 1, "the enhancer's contract did not change"
    dits = list(dict.fromkeys(c["dit"] for c in served))
    assert len(dits) == 2, f"the dit's old digest, then its new one: {dits}"
    assert served[-1]["dit"] == dits[1] and served[0]["dit"] == dits[0]
    _generate_image(env.client("enhanced"))  # the pipeline serves after the roll


def _service(env: Env, name: str) -> RouterService:
    """The router pods of `name` as a Service would pick one."""
    return RouterService(lambda: [p for p in _pods(env, name).values() if _component(p) == "router"])


def test_a_new_model_revision_under_steady_load_keeps_each_request_whole_and_a_broken_one_leaves_it_serving(
    env,
) -> None:
    """A new revision of the model (other weights in another folder: every stage's contract changes) applied
    while three image clients run: both stages' new generation comes up beside the old one (and the router rolls,
    its config naming the model), not one request fails, and every response ran on one generation end to end
    (x-omnikube-contract: the old enhancer digest with the old dit digest, or both new ones, never a mix); the
    same seeded request draws another image after. Then a broken revision (its dit's tokenizer outgrows its text
    encoder: it loads and fails its self-check) under the same load: the rollout is rolled back (Degraded
    RolloutFailed naming the stage and the self-check, the new generation at zero replicas), the revision before
    keeps every request and none fails."""
    ensure(PROMPT_ENHANCED_R2)
    ensure(PROMPT_ENHANCED_BROKEN)

    def seeded(client: openai.OpenAI) -> str:
        kwargs = {"model": "enhanced", "prompt": "a dog", "size": "64x64", "response_format": "b64_json"}
        return client.images.generate(**kwargs, extra_body={"seed": 5}).data[0].b64_json

    first_image = seeded(env.client("enhanced"))
    live = env.get("omnipipeline", "enhanced")
    assert live is not None
    first_contract = live["status"]["contract"]

    def revision(model: str) -> dict:
        return {"apiVersion": live["apiVersion"], "kind": live["kind"], "metadata": {"name": "enhanced"},
                "spec": {**live["spec"], "model": model}}  # fmt: skip

    served: list[dict[str, str]] = []
    noting = _generate_image_noting(served)
    with _service(env, "enhanced") as url:
        load = SteadyLoad(url, [noting, noting, noting]).start()
        try:
            _roll(env, revision(PROMPT_ENHANCED_R2), load, {"enhancer", "dit", "router"})
            rolled = env.get("omnipipeline", "enhanced")
            assert rolled is not None
            new_contract = rolled["status"]["contract"]
            assert new_contract != first_contract and rolled["status"]["rollout"]["serving"] == new_contract
            after_roll = len(served)
            workloads = _stage_deployments(env, "enhanced")

            apply(env.cluster, env.ns, revision(PROMPT_ENHANCED_BROKEN))

            def rolled_back() -> dict | None:
                obj = env.get("omnipipeline", "enhanced") or {}
                phase = ((obj.get("status") or {}).get("rollout") or {}).get("phase")
                return obj if phase == "RolledBack" and condition(obj, "Degraded").get("status") == "True" else None

            failed_roll = wait_for(rolled_back, READY_TIMEOUT, "the broken revision rolled back", env.operator.log)
            done = load.ok()
            wait_for(lambda: load.ok() >= done + 4, 300, "requests succeeding after the rollback")
        finally:
            failed = load.stop()
    assert failed == [], f"{len(failed)} of {len(load.outcomes)} requests failed during the rolls: {failed[:10]}"

    # One generation per request: the digests pair up, old with old and new with new.
    ran = [(c["enhancer"], c["dit"]) for c in served]
    pairs = list(dict.fromkeys(ran))
    assert len(pairs) == 2, f"the old pair of digests, then the new one, never a mix: {pairs}"
    assert len({e for e, _ in pairs}) == 2 and len({d for _, d in pairs}) == 2, pairs
    assert ran[0] == pairs[0] and ran[-1] == pairs[1], pairs
    assert all(r == pairs[1] for r in ran[after_roll:]), "the broken revision took no request"
    assert seeded(env.client("enhanced")) != first_image, "the new revision's weights draw the seeded request"

    degraded = condition(failed_roll, "Degraded")
    assert degraded["reason"] == "RolloutFailed", degraded
    message = degraded["message"]
    assert "stage dit" in message and "EngineFailed" in message and "self-check" in message, message
    assert new_contract in message and failed_roll["status"]["rollout"]["serving"] == new_contract

    def broken() -> list[dict]:
        selector = "omnikube.io/pipeline=enhanced,app.kubernetes.io/component=stage"
        items = kubectl_json(env.cluster, "get", "deployments", "-n", env.ns, "-l", selector)["items"]
        return [d for d in items if d["metadata"]["name"] not in workloads.values()]

    assert {d["metadata"]["labels"]["omnikube.io/stage"] for d in broken()} == {"enhancer", "dit"}, "its own generation"
    wait_for(lambda: all(d["spec"]["replicas"] == 0 for d in broken()), 60, "the broken generation at zero replicas")
    for stage, name in workloads.items():
        kept = env.get("deployment", name)
        assert kept is not None and kept["status"].get("readyReplicas", 0) >= 1, f"{stage}: {name} kept serving"


def test_a_router_roll_under_steady_load_fails_no_request(env) -> None:
    """Streaming and non-streaming clients while the chat router rolls. Clients reach a router that is
    ready and not terminating, as a Service would send them: the old router keeps serving through its
    preStop sleep while they move, then finishes what it runs."""
    live = env.get("omnipipeline", "chat")
    assert live is not None
    edited = {"apiVersion": live["apiVersion"], "kind": live["kind"], "metadata": {"name": "chat"}}
    edited["spec"] = {**live["spec"], "router": {**live["spec"]["router"], "resources": {"requests": {"cpu": "10m"}}}}
    with _service(env, "chat") as url:
        load = SteadyLoad(url, [_chat(True), _chat(True), _chat(False), _chat(False)]).start()
        try:
            before, after = _roll(env, edited, load, "router")
        finally:
            failed = load.stop()
    assert failed == [], f"{len(failed)} of {len(load.outcomes)} requests failed during the roll: {failed[:10]}"
    assert {c for n, c in before.items() if n not in after} == {"router"}, (before, after)


def test_deleting_a_pipeline_leaves_no_process_or_segment(env) -> None:
    env.cluster.kubectl("delete", "omnipipeline", "t2i", "-n", env.ns)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        left = kubectl_json(env.cluster, "get", "pods", "-n", env.ns, "-l", "omnikube.io/pipeline=t2i")["items"]
        if not left and not _stage_processes(env, "t2i", "dit"):
            break
        time.sleep(0.5)
    assert not left and not _stage_processes(env, "t2i", "dit")
    assert not [p for p in Path("/dev/shm").glob("omnikube-t2i*")]
    assert os.path.exists("/dev/shm")


INTRUDER = r"""
import sys, time, zmq
from omni_runtime.wire import protocol as P
from omni_runtime.wire.auth import Channel, PipelineKey

address = sys.argv[1]
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(f"tcp://{address}")
submit = P.Submit(id="intruder.0.llm.primary", request_id="intruder", stage="llm", data=True, final=True)
sock.send_multipart(P.encode(submit, {"prompt": "let me in"}))  # an old-style, unauthenticated client
sock.send_multipart(P.encode(P.Ping(nonce=1)))
sock.send_multipart(P.encode(P.Abort(id="chat.0.llm.primary")))
other = Channel(PipelineKey.generate(), "router")  # another pipeline's key
sock.send_multipart(other.seal(P.encode(P.Hello())))
answers = 0
deadline = time.monotonic() + 5
while time.monotonic() < deadline:
    if sock.poll(200):
        sock.recv_multipart()
        answers += 1
print(f"answers: {answers}", flush=True)
sys.exit(0 if answers == 0 else 3)
"""


def test_a_pod_outside_the_pipeline_gets_nothing_from_a_stage(env) -> None:
    """A pod of the same namespace, not of the pipeline, speaks the stage protocol to a stage pod's IP:
    without the pipeline key nothing it sends is acted on or answered (the local cluster enforces no
    NetworkPolicy, so the socket is reachable; the HMAC is what refuses it)."""
    import sys
    import urllib.request

    pods = kubectl_json(
        env.cluster, "get", "pods", "-n", env.ns, "-l", "omnikube.io/pipeline=chat,app.kubernetes.io/component=stage"
    )["items"]
    ip = next(p["status"]["podIP"] for p in pods if p["status"].get("podIP"))

    def rejected() -> float:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(f"http://{ip}:8101/metrics") as r:
            text = r.read().decode()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("omnikube_stage_protocol_messages_rejected_total{")
        )

    before = rejected()
    intruder = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "intruder"},
        "spec": {
            **ON_RUNNER,
            "restartPolicy": "Never",
            "containers": [
                {"name": "intruder", "image": "python", "command": [sys.executable, "-c", INTRUDER, f"{ip}:8100"]}
            ],
        },
    }
    apply(env.cluster, env.ns, intruder)
    deadline = time.monotonic() + 120
    phase = None
    while time.monotonic() < deadline:
        phase = (env.get("pod", "intruder") or {}).get("status", {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            break
        time.sleep(0.5)
    log = env.runner_logs("intruder", "intruder")
    assert phase == "Succeeded" and "answers: 0" in log, (phase, log)
    assert rejected() >= before + 4  # three unauthenticated messages and a Hello under another key
    env.cluster.kubectl("delete", "pod", "intruder", "-n", env.ns, "--wait=false")
    # The pipeline itself is unaffected.
    reply = env.client("chat").chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0
    )
    assert reply.choices[0].message.content
