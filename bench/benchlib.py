"""What the cluster benchmarks share: their cluster (a local control plane with omnikube's CRDs and two pod-runner
nodes whose pods run as real processes: the e2e tier's parts, e2e/cluster and e2e/podrunner), a pipeline's
readiness, and the p90 they report."""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "e2e"), str(REPO / "e2e" / "cluster")]

from clusterlib import condition  # noqa: E402
from podrunner.containers import Backoff  # noqa: E402
from podrunner.node import NodeConfig  # noqa: E402
from podrunner.runner import PodRunner  # noqa: E402

from localcluster import LocalCluster  # noqa: E402

__all__ = ["REPO", "RUNNER_NODES", "p90", "pipeline_ready", "pod_cluster"]

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


def pipeline_ready(cluster: LocalCluster, ns: str, name: str) -> bool:
    """The OmniPipeline exists and is Ready on its current spec (observedGeneration caught up)."""
    out = cluster.kubectl("get", "omnipipeline", name, "-n", ns, "-o", "json", check=False)
    if out.returncode != 0:
        return False
    obj = json.loads(out.stdout)
    return (
        condition(obj, "Ready").get("status") == "True"
        and (obj.get("status") or {}).get("observedGeneration") == obj["metadata"]["generation"]
    )


def p90(values: list[float]) -> float:
    """The 90th percentile (inclusive method); the one value, or NaN, when there are fewer than two."""
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=10, method="inclusive")[8]
