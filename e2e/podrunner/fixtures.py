"""pytest fixtures: `podrunner` (session) runs two runner nodes against the `cluster` fixture.

Pods land on the runner's nodes only if they tolerate its taint; `on_runner(pod)` adds the toleration and
a node selector to a pod manifest (or a pod template's spec).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest

from podrunner.containers import Backoff
from podrunner.node import RUNNER_LABEL, NodeConfig
from podrunner.runner import PodRunner

__all__ = ["RUNNER_NODES", "on_runner", "podrunner"]

RUNNER_NODES = ["runner-node-0", "runner-node-1"]
# Short crash-loop back-off (the kubelet's is 10s doubling to 5 min) keeps restart tests quick.
TEST_BACKOFF = Backoff(base=1.0, cap=8.0)
# The kubelet refreshes configMap and secret volumes within about a minute; tests need not wait that long.
TEST_VOLUME_SYNC_S = 2.0


def on_runner(manifest: dict[str, Any]) -> dict[str, Any]:
    """A copy of a Pod manifest (or a pod spec) that schedules only onto the runner's nodes."""
    out = copy.deepcopy(manifest)
    spec = out["spec"] if "spec" in out and "containers" in out["spec"] else out
    spec.setdefault("tolerations", []).append({"key": RUNNER_LABEL, "operator": "Exists", "effect": "NoSchedule"})
    spec.setdefault("nodeSelector", {})[RUNNER_LABEL] = "true"
    return out


@pytest.fixture(scope="session")
def podrunner(cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodRunner]:
    """A pod runner owning `runner-node-0` (2 advertised GPUs) and `runner-node-1`, for the session."""
    nodes = [
        NodeConfig(
            "runner-node-0",
            capacity={
                "cpu": "16",
                "memory": "64Gi",
                "pods": "110",
                "ephemeral-storage": "100Gi",
                "nvidia.com/gpu": "2",
            },
        ),
        NodeConfig("runner-node-1"),
    ]
    with PodRunner(
        cluster.kubeconfig,
        nodes,
        tmp_path_factory.mktemp("podrunner"),
        backoff=TEST_BACKOFF,
        volume_sync_s=TEST_VOLUME_SYNC_S,
    ) as runner:
        yield runner
