"""Helpers for tests of the Helm chart: the `helm` binary, a release, and the operator running with
nothing but a token of the chart's ServiceAccount (used by the chart tests and the end-to-end tests)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from clusterlib import REPO, stop_process_group

from localcluster import free_port

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def helm(cluster, *args: str, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [cluster.binary("helm"), *args], env=cluster.env(), text=True, capture_output=True, timeout=timeout
    )
    if check and out.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} exited {out.returncode}:\n{out.stderr}{out.stdout[-2000:]}")
    return out


@dataclass
class Release:
    name: str
    namespace: str
    """The release namespace: the operator Deployment, its ServiceAccount and the Lease."""
    apps: str
    """Where the test's OmniPipeline lives."""
    installed: bool = False

    @property
    def fullname(self) -> str:
        return f"{self.name}-omnikube"

    @property
    def service_account(self) -> str:
        return self.fullname

    def require_installed(self) -> None:
        if not self.installed:
            pytest.fail("the release was not installed (see test_install)")


class ServiceAccountOperator:
    """`omnikube operator` as a local process whose only credential is a token of the chart's
    ServiceAccount: both its own client (--kubeconfig) and kopf's ($KUBECONFIG) use it."""

    def __init__(
        self,
        cluster,
        release: Release,
        workdir: Path,
        namespaces: list[str],
        token_duration: str = "1h",
        args: list[str] | None = None,
    ) -> None:
        self.cluster, self.release, self.workdir, self.namespaces = cluster, release, workdir, namespaces
        self.args = args or []
        """Flags beyond the local process's own (what a chart value adds to the Deployment's)."""
        self.token_duration = token_duration
        self.identity = f"helm-rbac-{uuid.uuid4().hex[:4]}"
        self.kubeconfig = workdir / "sa-kubeconfig.json"
        self.log_path = workdir / f"{self.identity}.log"
        self.liveness_port, self.metrics_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None

    def write_kubeconfig(self) -> None:
        token = self.cluster.kubectl(
            "create",
            "token",
            self.release.service_account,
            "-n",
            self.release.namespace,
            f"--duration={self.token_duration}",
        ).stdout.strip()
        admin = json.loads(self.cluster.kubeconfig.read_text())
        server = admin["clusters"][0]["cluster"]
        self.kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {
                            "name": "local",
                            "cluster": {
                                "server": server["server"],
                                "certificate-authority": server["certificate-authority"],
                            },
                        }
                    ],
                    "users": [{"name": "operator", "user": {"token": token}}],
                    "contexts": [
                        {
                            "name": "operator",
                            "context": {"cluster": "local", "user": "operator", "namespace": self.release.namespace},
                        }
                    ],
                    "current-context": "operator",
                }
            )
        )

    def start(self) -> ServiceAccountOperator:
        self.write_kubeconfig()
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_SERVICE_")}
        env.update(
            KUBECONFIG=str(self.kubeconfig),
            POD_NAME=self.identity,
            POD_NAMESPACE=self.release.namespace,
            PYTHONUNBUFFERED="1",
        )
        args = [
            sys.executable,
            "-m",
            "omni_runtime.cli",
            "operator",
            "--kubeconfig",
            str(self.kubeconfig),
            "--lease-namespace",
            self.release.namespace,
            "--resync-seconds",
            "600",
            "--liveness-port",
            str(self.liveness_port),
            "--metrics-port",
            str(self.metrics_port),
        ]
        for ns in self.namespaces:
            args += ["--namespace", ns]
        args += self.args
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return self

    def stop(self) -> None:
        stop_process_group(self.proc)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def get(self, path: str, port: int) -> tuple[int, str]:
        try:
            with _NO_PROXY.open(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
                return response.status, response.read().decode()
        except OSError as exc:
            return 0, str(exc)


@contextlib.contextmanager
def operator_release(cluster, prefix: str, workdir: Path) -> Iterator[tuple[Release, ServiceAccountOperator]]:
    """The chart installed as release `<prefix>-<suffix>` (CRDs left to the cluster fixture, which
    installed them) in its own namespace, with an apps namespace beside it and the operator running
    with the chart ServiceAccount's token and watching only the apps namespace. On exit the operator
    stops, the release is uninstalled and both namespaces are deleted (without waiting)."""
    suffix = uuid.uuid4().hex[:6]
    release = Release(name=f"{prefix}-{suffix}", namespace=f"{prefix}-{suffix}-system", apps=f"{prefix}-{suffix}-apps")
    for ns in (release.namespace, release.apps):
        cluster.kubectl("create", "namespace", ns)
    operator: ServiceAccountOperator | None = None
    try:
        helm(cluster, "install", release.name, str(REPO / "charts" / "omnikube"), "--namespace", release.namespace,
             "--set", "crds.install=false")  # fmt: skip
        release.installed = True
        operator = ServiceAccountOperator(cluster, release, workdir, [release.apps]).start()
        yield release, operator
    finally:
        if operator is not None:
            operator.stop()
        helm(cluster, "uninstall", release.name, "--namespace", release.namespace, check=False)
        for ns in (release.apps, release.namespace):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
