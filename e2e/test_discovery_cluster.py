"""The router's Kubernetes discovery against the real control plane.

The EndpointSlices are written by the real kube-controller-manager from pods that KWOK runs (their IPs
and readiness come from KWOK); the router's discovery watches them through the real apiserver.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from kubernetes_asyncio import config as kube_config

from omni_runtime.router.discovery import KubernetesDiscovery

pytestmark = pytest.mark.cluster


def _stage_objects(name: str, replicas: int) -> list[dict]:
    labels = {"app": name}
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name},
            "spec": {
                "clusterIP": "None",
                "selector": labels,
                "ports": [{"name": "stage", "port": 8100, "targetPort": 8100}],
            },
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "containers": [
                            {"name": "stage", "image": "registry.invalid/x:0", "ports": [{"containerPort": 8100}]}
                        ]
                    },
                },
            },
        },
    ]


async def _wait(changes: list[set[str]], predicate, timeout: float = 60) -> set[str]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if changes and predicate(changes[-1]):
            return changes[-1]
        await asyncio.sleep(0.2)
    raise AssertionError(f"discovery never saw the expected replicas; it saw {changes}")


async def test_discovery_follows_ready_replicas_of_a_stage_service(cluster, namespace) -> None:
    cluster.kubectl(
        "apply",
        "-n",
        namespace,
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": _stage_objects("talker", 2)}),
    )
    api = await kube_config.new_client_from_config(config_file=str(cluster.kubeconfig))
    changes: list[set[str]] = []
    discovery = KubernetesDiscovery(api, namespace, "talker", 8100, watch_timeout_s=30)
    task = asyncio.create_task(discovery.run(changes.append))
    try:
        two = await _wait(changes, lambda s: len(s) == 2)
        pods = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-l", "app=talker", "-o", "json").stdout)
        ips = {p["status"]["podIP"] for p in pods["items"]}
        assert two == {f"{ip}:8100" for ip in ips}

        await asyncio.to_thread(cluster.kubectl, "scale", "deployment/talker", "-n", namespace, "--replicas=3")
        three = await _wait(changes, lambda s: len(s) == 3)
        pods = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-l", "app=talker", "-o", "json").stdout)
        by_ip = {f"{p['status']['podIP']}:8100": p["metadata"]["name"] for p in pods["items"]}
        assert three == set(by_ip)

        # 3 -> 2: the ReplicaSet removes the pod of lowest deletion cost first, so the victim is known.
        victim_address = sorted(by_ip)[0]
        cluster.kubectl(
            "annotate", "pod", by_ip[victim_address], "-n", namespace, "controller.kubernetes.io/pod-deletion-cost=-100"
        )
        await asyncio.to_thread(cluster.kubectl, "scale", "deployment/talker", "-n", namespace, "--replicas=2")
        two = await _wait(changes, lambda s: len(s) == 2)
        assert victim_address not in two and two == set(by_ip) - {victim_address}, (victim_address, two)

        await asyncio.to_thread(cluster.kubectl, "scale", "deployment/talker", "-n", namespace, "--replicas=0")
        assert await _wait(changes, lambda s: len(s) == 0) == set()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await api.close()


async def test_discovery_of_a_service_that_does_not_exist_yet_reports_it_when_created(cluster, namespace) -> None:
    api = await kube_config.new_client_from_config(config_file=str(cluster.kubeconfig))
    changes: list[set[str]] = []
    task = asyncio.create_task(KubernetesDiscovery(api, namespace, "late", 8100).run(changes.append))
    try:
        assert await _wait(changes, lambda s: s == set(), timeout=10) == set()
        cluster.kubectl(
            "apply",
            "-n",
            namespace,
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": _stage_objects("late", 1)}),
        )
        assert len(await _wait(changes, lambda s: len(s) == 1)) == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await api.close()
