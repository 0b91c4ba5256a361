"""Operator at scale: N OmniPipelines (3 stage pod groups each) to all Ready, against the raw cost.

    .venv/bin/python bench/operator_scale.py [--pipelines 100] [--steady-seconds 60]

Baseline (same run, same cluster): `kubectl apply --server-side` of exactly the objects the operator
would create (pre-rendered by `omnikube render`, no owner references) and waiting for every Deployment to
be Available. Then the operator path: apply N OmniPipelines and wait until every one reports Ready.
Prints both times, the ratio (target <= 1.5), the operator's API writes, and its writes during
`--steady-seconds` of steady state after convergence (target 0; Lease renewals are leader heartbeats and
are reported separately).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "e2e" / "cluster"))

from localcluster import LocalCluster, audit_time  # noqa: E402
from omni_operator.render import dump_yaml, render_pipeline  # noqa: E402
from omni_runtime.registry import default_registry  # noqa: E402

AGENT = "omnikube-operator/"


def pipeline(name: str) -> dict:
    # qwen3-omni without colocation: thinker, talker and code2wav each get their own pods.
    return {
        "apiVersion": "omnikube.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": name},
        "spec": {
            "model": f"/models/{name}",
            "pipeline": "qwen3-omni",
            "stages": [{"name": "thinker"}, {"name": "talker"}, {"name": "code2wav"}],
        },
    }


def audit_writes(cluster: LocalCluster, since: float) -> tuple[int, int]:
    """(operator writes to managed objects, operator lease writes) after `since`."""
    writes = leases = 0
    for line in cluster.audit_log.read_text().splitlines():
        event = json.loads(line)
        if not event.get("userAgent", "").startswith(AGENT):
            continue
        # To the microsecond: cut to whole seconds, the writes in the second of `since` would be dropped.
        if audit_time(event).timestamp() < since:
            continue
        if event["verb"] in ("get", "list", "watch"):  # the audit policy logs OmniPipeline reads too
            continue
        if event.get("objectRef", {}).get("resource") == "leases":
            leases += 1
        else:
            writes += 1
    return writes, leases


def ready_count(cluster: LocalCluster, namespace: str) -> int:
    items = json.loads(cluster.kubectl("get", "omnipipelines", "-n", namespace, "-o", "json", timeout=120).stdout)[
        "items"
    ]
    count = 0
    for obj in items:
        status = obj.get("status") or {}
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", []))
        count += ready and status.get("observedGeneration") == obj["metadata"]["generation"]
    return count


def raw_apply(cluster: LocalCluster, n: int, workdir: Path) -> float:
    registry = default_registry()
    objects = []
    for i in range(n):
        doc = pipeline(f"p{i}")
        doc["metadata"]["namespace"] = "raw"
        objects += render_pipeline(doc, registry, owner_references=False)
    path = workdir / "raw.yaml"
    path.write_text(dump_yaml(objects))
    cluster.kubectl("create", "namespace", "raw")
    started = time.monotonic()
    out = cluster.kubectl("apply", "--server-side", "-f", str(path), timeout=1800, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"kubectl apply failed: {out.stderr[-2000:]}")
    cluster.kubectl(
        "wait", "--for=condition=Available", "deployment", "--all", "-n", "raw", "--timeout=1800s", timeout=1900
    )
    elapsed = time.monotonic() - started
    print(f"raw: {len(objects)} objects applied and {n * 4} Deployments available in {elapsed:.1f}s", flush=True)
    cluster.kubectl("delete", "namespace", "raw", "--wait=true", "--timeout=600s", timeout=700)
    return elapsed


def operator_apply(cluster: LocalCluster, n: int, workdir: Path, steady: float) -> tuple[float, int, int, int]:
    log = open(workdir / "operator.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "omni_runtime.cli",
            "operator",
            "--kubeconfig",
            str(cluster.kubeconfig),
            "--lease-namespace",
            "default",
            "--workers",
            "16",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=cluster.env(),
        start_new_session=True,
    )
    try:
        time.sleep(3)
        cluster.kubectl("create", "namespace", "ops")
        docs = {"apiVersion": "v1", "kind": "List", "items": [pipeline(f"p{i}") for i in range(n)]}
        since = time.time()
        started = time.monotonic()
        cluster.kubectl("apply", "--server-side", "-n", "ops", "-f", "-", input=json.dumps(docs), timeout=600)
        while (ready := ready_count(cluster, "ops")) < n:
            if proc.poll() is not None:
                raise RuntimeError(f"operator exited: {(workdir / 'operator.log').read_text()[-3000:]}")
            time.sleep(1)
        elapsed = time.monotonic() - started
        writes, _ = audit_writes(cluster, since)
        print(f"operator: {n} pipelines Ready in {elapsed:.1f}s with {writes} API writes", flush=True)
        time.sleep(5)  # let the last status events drain
        quiet_from = time.time()
        time.sleep(steady)
        steady_writes, lease_writes = audit_writes(cluster, quiet_from)
        assert ready == n
        return elapsed, writes, steady_writes, lease_writes
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipelines", type=int, default=100)
    parser.add_argument("--steady-seconds", type=float, default=60.0)
    args = parser.parse_args()
    # Turn SIGTERM into an exception so the control plane below is always stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(workdir=Path(tmp) / "cluster") as cluster:
        cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
        cluster.kubectl(
            "wait", "--for=condition=Established", "crd/omnipipelines.omnikube.io", "crd/omnistages.omnikube.io"
        )
        raw = raw_apply(cluster, args.pipelines, Path(tmp))
        op, writes, steady_writes, lease_writes = operator_apply(
            cluster, args.pipelines, Path(tmp), args.steady_seconds
        )
    print(f"\npipelines={args.pipelines}  raw={raw:.1f}s  operator={op:.1f}s  ratio={op / raw:.2f} (target <= 1.5)")
    print(
        f"operator writes to converge: {writes}; during {args.steady_seconds:.0f}s of steady state: "
        f"{steady_writes} (target 0), plus {lease_writes} leader-lease renewals"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
