"""The router pod in the cluster: its API key (a Secret that rotates without a restart), its probes (a
router waits for a slow stage without being restarted), and its input bounds, with the real `openai` client.

Real: the control plane, Helm, the operator holding only the chart ServiceAccount's token, the pod runner
running the router and a diffusers stage (tiny-sd3) as processes in their own network namespaces, and
the pod runner's liveness probes and Secret-volume refresh (2 s here, about a minute on a kubelet).

The stage is slow to become ready for an honest reason: its model cache is a hostPath folder that does not
exist yet, so its pod waits in ContainerCreating (FailedMount), as on a node whose volume is not there yet;
the test makes the folder appear once the router has outlived its liveness window.
"""

from __future__ import annotations

import base64
import io
import json
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from chartlib import Release, ServiceAccountOperator
from clusterlib import apply, condition, kubectl_json, wait_for
from PIL import Image
from podrunner.node import ON_RUNNER

from omni_runtime.tiny_models import default_cache_dir, ensure

pytestmark = [pytest.mark.cluster, pytest.mark.models]

NAME = "guarded"
READY_TIMEOUT = 600


def secret(key: str) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "router-key"}, "stringData": {"token": key}}


class Env:
    def __init__(self, cluster, release: Release, operator: ServiceAccountOperator, cache: Path) -> None:
        self.cluster, self.release, self.operator, self.cache = cluster, release, operator, cache
        self.key = "first-key"

    @property
    def ns(self) -> str:
        return self.release.apps

    def make_models_appear(self) -> None:
        if not self.cache.exists():
            self.cache.symlink_to(default_cache_dir(), target_is_directory=True)

    def pods(self, component: str) -> list[dict]:
        selector = f"omnikube.io/pipeline={NAME},app.kubernetes.io/component={component}"
        return kubectl_json(self.cluster, "get", "pods", "-n", self.ns, "-l", selector)["items"]

    def router_pod(self) -> dict:
        live = [p for p in self.pods("router") if not p["metadata"].get("deletionTimestamp")]
        assert len(live) == 1, [p["metadata"]["name"] for p in live]
        return live[0]

    def describe(self) -> str:
        pods = kubectl_json(self.cluster, "get", "pods", "-n", self.ns)["items"]
        rows = [(p["metadata"]["name"], p["status"].get("phase"), p["status"].get("containerStatuses")) for p in pods]
        pipeline = kubectl_json(self.cluster, "get", "omnipipeline", NAME, "-n", self.ns)
        return (
            f"pods: {json.dumps(rows)[:3000]}\nstatus: {json.dumps(pipeline.get('status'))}\n"
            + self.operator.log()[-1500:]
        )

    def wait_ready(self) -> None:
        self.make_models_appear()

        def ready() -> bool:
            obj = kubectl_json(self.cluster, "get", "omnipipeline", NAME, "-n", self.ns)
            return condition(obj, "Ready").get("status") == "True"

        wait_for(ready, READY_TIMEOUT, f"{NAME} Ready", self.describe)

    def base(self) -> str:
        return f"http://{self.router_pod()['status']['podIP']}:8000"

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base()}/v1", api_key=key, max_retries=0, timeout=120)


def restarts(pod: dict) -> int:
    return sum(c.get("restartCount", 0) for c in pod["status"].get("containerStatuses") or [])


@pytest.fixture(scope="module")
def env(cluster, podrunner, shared_release, tmp_path_factory) -> Iterator[Env]:
    ensure("tiny-sd3")
    with shared_release.module("rt") as (release, operator):
        cache = tmp_path_factory.mktemp("rt-cache") / "models"  # appears later: see the module docstring
        e = Env(cluster, release, operator, cache)
        apply(cluster, release.apps, {"apiVersion": "v1", "kind": "List", "items": [secret(e.key), pipeline(cache)]})
        yield e


def pipeline(cache: Path) -> dict:
    """tiny-sd3 behind a router with an API key, its model cache at `cache` (absent at first)."""
    return {
        "apiVersion": "omnikube.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": NAME},
        "spec": {
            "model": "tiny-sd3",
            "pipeline": "stable-diffusion-3",
            "runtime": {"modelCache": {"hostPath": {"path": str(cache)}, "mountPath": "/models", "readOnly": True}},
            "router": {
                **ON_RUNNER,
                "apiKeySecret": {"name": "router-key", "key": "token"},
                "limits": {"requestTimeoutSeconds": 120, "maxN": 2},
                # A window of 9 s instead of the default 60 s: the test outlives it without waiting a minute.
                "livenessProbe": {"periodSeconds": 3, "failureThreshold": 3},
            },
            "stages": [
                {
                    **ON_RUNNER,
                    "name": "dit",
                    "samplingParams": {"num_inference_steps": 2},
                }
            ],
        },
    }


def test_router_outlives_a_slow_stage_without_a_restart_and_is_ready_once_the_stage_is(env) -> None:
    if env.cache.exists():
        pytest.skip("the stage's models are there already (an earlier test of this module made them appear)")

    def router_running() -> dict | None:
        pods = env.pods("router")
        running = [p for p in pods if (p["status"].get("containerStatuses") or [{}])[0].get("state", {}).get("running")]
        return running[0] if running else None

    pod = wait_for(router_running, 300, "the router pod running", env.describe)
    probe = next(c for c in pod["spec"]["containers"] if c["name"] == "router")["livenessProbe"]
    window = probe["periodSeconds"] * probe["failureThreshold"]
    # Outlive the liveness window (plus a margin) while the stage cannot start: a router whose liveness
    # followed the stages would be restarted in this time.
    deadline = time.monotonic() + window + 20
    while time.monotonic() < deadline:
        pod = env.router_pod()
        assert restarts(pod) == 0, env.describe()
        assert condition(pod, "Ready").get("status") != "True"
        time.sleep(5)
    (stage,) = env.pods("stage")
    assert condition(stage, "Ready").get("status") != "True"  # still held back: the folder is not there
    base = env.base()
    assert httpx.get(f"{base}/livez", timeout=10).status_code == 200
    health = httpx.get(f"{base}/health", timeout=10)
    assert health.status_code == 503 and "dit" in health.json()["message"]

    env.wait_ready()
    pod = wait_for(
        lambda: (p := env.router_pod()) and condition(p, "Ready").get("status") == "True" and p,
        120,
        "the router pod Ready",
        env.describe,
    )
    assert restarts(pod) == 0
    assert httpx.get(f"{env.base()}/health", timeout=10).status_code == 200


def _png_size(b64: str) -> tuple[int, int]:
    return Image.open(io.BytesIO(base64.b64decode(b64))).size


def test_the_router_pod_answers_only_with_the_api_key(env) -> None:
    env.wait_ready()
    with pytest.raises(openai.AuthenticationError) as err:
        env.client("not-the-key").images.generate(model=NAME, prompt="a red cube", size="64x64")
    assert err.value.status_code == 401 and "not valid" in err.value.body["message"]
    bare = httpx.get(f"{env.base()}/v1/models", timeout=10)
    assert bare.status_code == 401 and bare.headers["www-authenticate"].startswith("Bearer")
    result = env.client(env.key).images.generate(
        model=NAME, prompt="a red cube", size="64x64", response_format="b64_json", extra_body={"seed": 3}
    )
    assert _png_size(result.data[0].b64_json) == (64, 64)
    for open_path in ("/health", "/livez", "/metrics"):
        assert httpx.get(f"{env.base()}{open_path}", timeout=10).status_code == 200, open_path


def test_a_rotated_key_secret_is_accepted_without_restarting_the_router(env) -> None:
    env.wait_ready()
    before = env.router_pod()
    new_key = f"rotated-{uuid.uuid4().hex[:8]}"
    apply(env.cluster, env.ns, secret(new_key))

    def accepted() -> bool:
        try:
            env.client(new_key).models.list()
            return True
        except openai.AuthenticationError:
            return False

    # The runner refreshes the Secret volume within its sync period; the router re-reads the changed file.
    wait_for(accepted, 60, "the rotated key accepted", env.describe)
    old = env.key
    env.key = new_key
    with pytest.raises(openai.AuthenticationError):
        env.client(old).models.list()
    after = env.router_pod()
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    assert restarts(after) == restarts(before)


def test_inputs_past_the_pipeline_limits_are_refused_through_the_router_pod(env) -> None:
    env.wait_ready()
    client = env.client(env.key)
    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(model=NAME, prompt="a cat", size="64x64", n=3)
    assert "router.limits.maxN" in err.value.body["message"]
    long_schedule = [1.0 - i / 5000 for i in range(5000)]
    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(
            model=NAME, prompt="a cat", size="64x64", extra_body={"sampling_params_list": [{"sigmas": long_schedule}]}
        )
    assert "sigmas has 5000 entries" in err.value.body["message"]
    # Only the headers of a 64 MiB body are sent: the router answers 413 before reading any of it.
    host = env.router_pod()["status"]["podIP"]
    with socket.create_connection((host, 8000), timeout=30) as sock:
        sock.sendall(
            f"POST /v1/images/generations HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {env.key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {64 * 1024**2}\r\n\r\n".encode()
        )
        answer = b""
        while b"max_body_bytes" not in answer and (chunk := sock.recv(65536)):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413") and b"max_body_bytes" in answer, answer[:500]


def test_stage_readyz_names_no_work(env) -> None:
    env.wait_ready()
    (stage,) = env.pods("stage")
    ready = httpx.get(f"http://{stage['status']['podIP']}:8101/readyz", timeout=10)
    assert ready.status_code == 200 and "works" not in ready.json() and ready.json()["running"] == 0
