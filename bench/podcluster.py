"""The benchmarks' cluster: a local control plane with omnikube's CRDs and two pod-runner nodes whose pods run
as real processes (the e2e tier's parts, e2e/cluster and e2e/podrunner)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "e2e"), str(REPO / "e2e" / "cluster")]

from podrunner.containers import Backoff  # noqa: E402
from podrunner.node import NodeConfig  # noqa: E402
from podrunner.runner import PodRunner  # noqa: E402

from localcluster import LocalCluster  # noqa: E402

__all__ = ["REPO", "RUNNER_NODES", "pod_cluster"]

RUNNER_NODES = ("runner-node-0", "runner-node-1")


@contextlib.contextmanager
def pod_cluster(work: Path) -> Iterator[LocalCluster]:
    """The cluster under `work`, its CRDs established and RUNNER_NODES running pods, until the block ends."""
    with LocalCluster(workdir=work / "cluster") as cluster:
        cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
        cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/omnistages.omnikube.io")
        nodes = [NodeConfig(name) for name in RUNNER_NODES]
        with PodRunner(cluster.kubeconfig, nodes, work / "runner", backoff=Backoff(1.0, 8.0), volume_sync_s=2.0):
            yield cluster
