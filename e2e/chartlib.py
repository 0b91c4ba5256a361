"""Helpers for tests of the Helm chart: the `helm` binary, a release, and the operator running with
nothing but a token of the chart's ServiceAccount (used by the chart tests and the end-to-end tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from clusterlib import stop_process_group

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

    def __init__(self, cluster, release: Release, workdir: Path, namespaces: list[str]) -> None:
        self.cluster, self.release, self.workdir, self.namespaces = cluster, release, workdir, namespaces
        self.identity = f"helm-rbac-{uuid.uuid4().hex[:4]}"
        self.kubeconfig = workdir / "sa-kubeconfig.json"
        self.log_path = workdir / f"{self.identity}.log"
        self.liveness_port, self.metrics_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None

    def write_kubeconfig(self) -> None:
        token = self.cluster.kubectl(
            "create", "token", self.release.service_account, "-n", self.release.namespace, "--duration=1h"
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
