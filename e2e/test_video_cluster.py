"""Video jobs in the cluster: the tiny Wan2.2 T2V pipeline served by the operator with two router replicas;
a job created on one router pod is polled, downloaded, listed and deleted through the other.

Real: the control plane, Helm, the operator, the pod runner running the router and stage pods as processes
in their own network namespaces, the routers finding each other through their Service's EndpointSlices
(the job id names the owner's pod IP, which the other replica forwards to), and the `openai` client.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterator

import av
import openai
import pytest
from clusterlib import apply, kubectl_json, wait_for
from podrunner.node import ON_RUNNER
from test_end_to_end import Env

from omni_runtime.tiny_models import default_cache_dir, ensure

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.models,
    pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning"),  # the client warns; the API is ours
]

PIPELINE = {
    "apiVersion": "omnikube.io/v1alpha1",
    "kind": "OmniPipeline",
    "metadata": {"name": "wan"},
    "spec": {
        "model": "tiny-wan2-2-t2v",
        "pipeline": "wan2-2-t2v",
        "servedModelName": "wan",
        "runtime": {
            "modelCache": {"hostPath": {"path": str(default_cache_dir())}, "mountPath": "/models", "readOnly": True}
        },
        "router": {**ON_RUNNER, "replicas": 2, "videos": {"ttlSeconds": 600, "maxBytes": "64Mi"}},
        "stages": [
            {
                **ON_RUNNER,
                "name": "dit",
                "samplingParams": {"num_inference_steps": 2, "height": 64, "width": 64, "num_frames": 5},
            }
        ],
    },
}


@pytest.fixture(scope="module")
def env(cluster, podrunner, shared_release) -> Iterator[Env]:
    ensure("tiny-wan2-2-t2v")
    with shared_release.module("video") as (release, operator):
        e = Env(cluster, podrunner, release, operator)
        apply(cluster, release.apps, PIPELINE)
        e.wait_ready("wan")
        yield e


def router_clients(env: Env) -> list[openai.OpenAI]:
    def ready_ips() -> list[str]:
        pods = kubectl_json(
            env.cluster,
            "get",
            "pods",
            "-n",
            env.ns,
            "-l",
            "omnikube.io/pipeline=wan,app.kubernetes.io/component=router",
        )["items"]
        return sorted(
            p["status"]["podIP"]
            for p in pods
            if p["status"].get("podIP")
            and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
        )

    def two() -> list[str] | None:
        found = ready_ips()
        return found if len(found) == 2 else None

    ips: list[str] = wait_for(two, 300, "two ready router pods")  # type: ignore[assignment]  # two() says so
    return [openai.OpenAI(base_url=f"http://{ip}:8000/v1", api_key="unused", max_retries=0, timeout=60) for ip in ips]


def test_a_job_made_on_one_router_replica_is_served_by_the_other(env: Env) -> None:
    owner, other = router_clients(env)
    job = owner.videos.create(prompt="a cat on a skateboard", size="64x64", extra_body={"num_frames": 9, "fps": 8})
    deadline = time.monotonic() + 300
    while (seen := other.videos.retrieve(job.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, seen
        time.sleep(0.5)
    assert seen.status == "completed", seen.error
    with av.open(io.BytesIO(other.videos.download_content(job.id).read())) as container:
        assert (len(list(container.decode(video=0))), float(container.streams.video[0].average_rate)) == (9, 8.0)
    assert job.id in [v.id for v in other.videos.list()]  # listing asks every replica
    assert other.videos.delete(job.id).deleted
    with pytest.raises(openai.NotFoundError):
        owner.videos.retrieve(job.id)
