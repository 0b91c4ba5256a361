"""One chart release and one operator for the end-to-end model modules of a session.

Each model module used to install the chart and start its own operator (an interpreter importing kopf and
kubernetes_asyncio: 15-30 s of wall time on a loaded 2-core machine, and a helm install). Now the first
module that asks installs the chart once; the operator, holding only the chart ServiceAccount's token as
before, watches one apps namespace per module. kopf and the operator's resync list a fixed set of
namespaces (`omnikube operator --namespace`, repeatable; no label selector), so the namespaces are known up
front: one per entry of `MODULES`, all created at install. A module deletes its own namespace (without
waiting) when it ends, so its pods and processes go then, as with its own release before.

Modules that need an operator of their own keep one (`chartlib.ServiceAccountOperator` or a process of their own):
test_helm_chart (the chart's values and RBAC variants), test_operator_cluster (restarts and kills it).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from chartlib import Release, ServiceAccountOperator, helm
from clusterlib import REPO

__all__ = ["MODULES", "SharedRelease", "shared_release"]

MODULES = ("e2e", "as", "cx", "sp", "video", "rt", "bg")
"""The apps namespace suffix of each module sharing the release (test_end_to_end, test_autoscale_cluster,
test_connectors_cluster, test_speech_cluster, test_video_cluster, test_router_cluster, test_bagel_cluster)."""

TOKEN_DURATION = "12h"
"""The operator's ServiceAccount token outlives the whole session (a module's own was 1 h)."""


class SharedRelease:
    """The chart installed as `shared-<suffix>` in `<release>-system`, and its operator watching
    `<release>-<module>` for every module in `MODULES`."""

    def __init__(self, cluster, workdir: Path) -> None:
        self.cluster, self.workdir = cluster, workdir
        name = f"shared-{uuid.uuid4().hex[:6]}"
        self.release = Release(name=name, namespace=f"{name}-system", apps="")
        self.apps = {module: f"{name}-{module}" for module in MODULES}
        self.operator: ServiceAccountOperator | None = None

    def start(self) -> SharedRelease:
        for ns in (self.release.namespace, *self.apps.values()):
            self.cluster.kubectl("create", "namespace", ns)
        helm(self.cluster, "install", self.release.name, str(REPO / "charts" / "omnikube"),
             "--namespace", self.release.namespace, "--set", "crds.install=false")  # fmt: skip
        self.release.installed = True
        self.operator = ServiceAccountOperator(
            self.cluster, self.release, self.workdir, list(self.apps.values()), token_duration=TOKEN_DURATION
        ).start()
        return self

    def stop(self) -> None:
        if self.operator is not None:
            self.operator.stop()
        helm(self.cluster, "uninstall", self.release.name, "--namespace", self.release.namespace, check=False)
        for ns in (*self.apps.values(), self.release.namespace):
            self.cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)

    @contextlib.contextmanager
    def module(self, module: str) -> Iterator[tuple[Release, ServiceAccountOperator]]:
        """(the release with `apps` set to this module's namespace, the shared operator); on exit the
        namespace is deleted without waiting (its pods stop, its pipelines are collected)."""
        assert self.operator is not None, "start() first"
        release = Release(self.release.name, self.release.namespace, self.apps[module], installed=True)
        try:
            yield release, self.operator
        finally:
            self.cluster.kubectl("delete", "namespace", release.apps, "--wait=false", check=False)


@pytest.fixture(scope="session")
def shared_release(cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedRelease]:
    """The session's shared chart release and operator, installed when a model module first asks."""
    shared = SharedRelease(cluster, tmp_path_factory.mktemp("shared-operator"))
    try:
        yield shared.start()
    finally:
        shared.stop()
