"""Fixtures for the cluster tier: one real control plane per test session, a namespace per test."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "cluster"))
sys.path.insert(0, str(Path(__file__).parent))

from clusterlib import REPO, wait_established  # noqa: E402
from podrunner.fixtures import podrunner  # noqa: E402,F401 - the `podrunner` fixture (real processes for pods)
from releaselib import shared_release  # noqa: E402,F401 - one chart release + operator for the model modules

from localcluster import LocalCluster  # noqa: E402


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """The local control plane, started once for the session and stopped at its end.

    With OMNIKUBE_CLUSTER_DIR set (e.g. after `make cluster-up`) the tests use that running cluster
    instead and leave it running.
    """
    existing = os.environ.get("OMNIKUBE_CLUSTER_DIR")
    if existing:
        yield LocalCluster.attach(Path(existing))
        return
    with LocalCluster(workdir=tmp_path_factory.mktemp("cluster")) as c:
        c.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
        wait_established(c, ["omnipipelines.omnikube.io", "omnistages.omnikube.io"])
        yield c


@pytest.fixture
def namespace(cluster: LocalCluster) -> Iterator[str]:
    """A fresh namespace, deleted (without waiting) after the test."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
