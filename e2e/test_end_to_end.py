"""End to end in the cluster: the chart's operator identity, pods that really run, real answers.

Real: the control plane, Helm, the operator (as a process holding only the chart ServiceAccount's
token), the pod runner running every stage and router pod as real processes (vLLM on CPU, diffusers)
in their own network namespaces, EndpointSlices filled by the controller-manager and watched by the
router, and the official `openai` client talking to the router pod's IP.
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest
from chartlib import Release, ServiceAccountOperator, helm
from clusterlib import REPO, apply, kubectl_json
from PIL import Image
from podrunner.node import RUNNER_LABEL

from omni_runtime.tiny_models import default_cache_dir, ensure

pytestmark = [pytest.mark.cluster, pytest.mark.models]

ON_RUNNER = {
    "nodeSelector": {RUNNER_LABEL: "true"},
    "tolerations": [{"key": RUNNER_LABEL, "operator": "Exists", "effect": "NoSchedule"}],
}
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
    pipeline(
        "t2i",
        "stable-diffusion-3",
        "tiny-sd3",
        [{"name": "dit", "engineArgs": {"torch_dtype": "float32"}, "samplingParams": {"num_inference_steps": 2}}],
    ),
    pipeline(
        "enhanced",
        "prompt-enhanced-t2i",
        "tiny-prompt-enhanced-t2i",
        [
            {"name": "enhancer", "engineArgs": AR_ARGS, "samplingParams": {"max_tokens": 12}},
            {"name": "dit", "engineArgs": {"torch_dtype": "float32"}, "samplingParams": {"num_inference_steps": 2}},
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
            time.sleep(2)
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
def env(cluster, podrunner, tmp_path_factory) -> Iterator[Env]:
    for model in ("tiny-qwen2-chat", "tiny-sd3", "tiny-prompt-enhanced-t2i"):
        ensure(model)
    suffix = uuid.uuid4().hex[:6]
    release = Release(name=f"e2e-{suffix}", namespace=f"e2e-{suffix}-system", apps=f"e2e-{suffix}-apps")
    for ns in (release.namespace, release.apps):
        cluster.kubectl("create", "namespace", ns)
    # The cluster fixture installed the CRDs already; the chart brings the operator's identity and RBAC.
    helm(
        cluster,
        "install",
        release.name,
        str(REPO / "charts" / "omnikube"),
        "--namespace",
        release.namespace,
        "--set",
        "crds.install=false",
    )
    release.installed = True
    operator = ServiceAccountOperator(cluster, release, tmp_path_factory.mktemp("e2e-operator"), [release.apps]).start()
    e = Env(cluster, podrunner, release, operator)
    try:
        apply(cluster, release.apps, {"apiVersion": "v1", "kind": "List", "items": PIPELINES})
        for p in PIPELINES:
            e.wait_ready(p["metadata"]["name"])
        yield e
    finally:
        operator.stop()
        helm(cluster, "uninstall", release.name, "--namespace", release.namespace, check=False)
        for ns in (release.apps, release.namespace):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


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
        model="t2i", prompt="a red cube", size="64x64", n=1, response_format="b64_json", extra_body={"seed": 3}
    )
    assert _png(result.data[0].b64_json).size == (64, 64)


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


def test_killed_stage_process_is_restarted_and_serves_again(env) -> None:
    (proc,) = _stage_processes(env, "chat", "llm")
    proc.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(
        c.get("restartCount", 0) > 0
        for p in kubectl_json(env.cluster, "get", "pods", "-n", env.ns, "-l", "omnikube.io/stage=llm")["items"]
        for c in p["status"].get("containerStatuses", [])
    ):
        time.sleep(1)
    env.wait_ready("chat")
    reply = env.client("chat").chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "again"}], max_tokens=4
    )
    assert reply.choices[0].message.content is not None


def test_editing_engine_args_rolls_only_that_stage(env) -> None:
    def pods() -> dict[str, str]:
        return {
            p["metadata"]["name"]: p["metadata"]["labels"].get("omnikube.io/stage", "router")
            for p in kubectl_json(env.cluster, "get", "pods", "-n", env.ns, "-l", "omnikube.io/pipeline=enhanced")[
                "items"
            ]
        }

    before = pods()
    edited = json.loads(json.dumps(PIPELINES[2]))
    edited["spec"]["stages"][0]["engineArgs"] = {**AR_ARGS, "max_model_len": 384}
    apply(env.cluster, env.ns, edited)
    client = env.client("enhanced")
    outcomes = []
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        try:
            client.images.generate(model="enhanced", prompt="a dog", size="64x64", response_format="b64_json")
            outcomes.append(200)
        except openai.APIStatusError as exc:
            outcomes.append(exc.status_code)
        except openai.APIConnectionError:
            outcomes.append(0)
        obj = env.get("omnipipeline", "enhanced")
        ready = [c for c in obj["status"]["conditions"] if c["type"] == "Ready"]
        if (
            obj["status"].get("observedGeneration") == obj["metadata"]["generation"]
            and ready[0]["status"] == "True"
            and set(pods()) != set(before)
        ):
            break
    env.wait_ready("enhanced")
    # The old enhancer pod left the EndpointSlice when it began terminating; let it finish exiting.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and sum(s == "enhancer" for s in pods().values()) > 1:
        time.sleep(1)
    after = pods()
    changed = {stage for name, stage in before.items() if name not in after}
    assert changed == {"enhancer"}, (before, after)
    assert all(code in (200, 429, 502, 503, 504) for code in outcomes), outcomes
    result = client.images.generate(model="enhanced", prompt="a dog", size="64x64", response_format="b64_json")
    assert _png(result.data[0].b64_json).size == (64, 64), "the pipeline serves after the roll"


def test_deleting_a_pipeline_leaves_no_process_or_segment(env) -> None:
    env.cluster.kubectl("delete", "omnipipeline", "t2i", "-n", env.ns)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        left = kubectl_json(env.cluster, "get", "pods", "-n", env.ns, "-l", "omnikube.io/pipeline=t2i")["items"]
        if not left and not _stage_processes(env, "t2i", "dit"):
            break
        time.sleep(1)
    assert not left and not _stage_processes(env, "t2i", "dit")
    assert not [p for p in Path("/dev/shm").glob("omnikube-t2i*")]
    assert os.path.exists("/dev/shm")


INTRUDER = r"""
import sys, time, zmq
from omni_runtime.stage import protocol as P
from omni_runtime.stage.auth import Channel, PipelineKey

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
        time.sleep(1)
    log = env.runner_logs("intruder", "intruder")
    assert phase == "Succeeded" and "answers: 0" in log, (phase, log)
    assert rejected() >= before + 4  # three unauthenticated messages and a Hello under another key
    env.cluster.kubectl("delete", "pod", "intruder", "-n", env.ns, "--wait=false")
    # The pipeline itself is unaffected.
    reply = env.client("chat").chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0
    )
    assert reply.choices[0].message.content
