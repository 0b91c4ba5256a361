"""KEDA as the test tier installs it (e2e/kedalib.py), wherever the cache holding its binaries lies.

Real: the control plane, the pod runner, KEDA's operator and metrics adapter built from the pinned module and
run from KEDA's own manifests, served through the API server's aggregation layer. The model tier's autoscaling
tests (e2e/test_autoscale_cluster.py) build on this install; this one loads no model, so it runs in the cluster
lane and a broken install fails there, minutes before the model tier would.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from clusterlib import wait_for
from kedalib import EXTERNAL_METRICS, Keda, keda_binaries

pytestmark = [pytest.mark.cluster]


@pytest.fixture
def binaries_under_tmp() -> Iterator[tuple[Path, Path]]:
    """The built binaries in a fresh folder under /tmp: where a machine whose HOME is in /tmp keeps its cache."""
    folder = Path(tempfile.mkdtemp(prefix="keda-bin-", dir="/tmp"))
    try:
        copies = []
        for binary in keda_binaries():
            copy = folder / binary.name
            try:
                os.link(binary, copy)
            except OSError:  # another file system: copy it
                shutil.copy2(binary, copy)
            copies.append(copy)
        yield copies[0], copies[1]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_keda_serves_external_metrics_from_binaries_under_a_folder_its_pods_mount_over(
    cluster, podrunner, binaries_under_tmp
) -> None:
    """KEDA's metrics adapter mounts an emptyDir on /tmp. With the binaries in a folder under /tmp, both pods still
    start them (they reach the containers through a volume of their own, not by their host path, which the
    emptyDir would hide: the adapter crash-looped with "executable file not found") and the adapter serves
    external.metrics.k8s.io through the aggregation layer; uninstalling leaves no KEDA API behind."""
    keda = Keda(cluster, binaries_under_tmp)
    try:
        keda.install(timeout=180)

        # Available comes from the aggregator's own probe; its proxy answers 503 for a moment after
        def discovery() -> dict | None:
            out = cluster.kubectl("get", "--raw", "/apis/external.metrics.k8s.io/v1beta1", check=False)
            return json.loads(out.stdout) if out.returncode == 0 else None

        served = wait_for(discovery, 60, "external.metrics.k8s.io discovery through the aggregator", keda.diagnostics)
        assert served["groupVersion"] == "external.metrics.k8s.io/v1beta1"
    finally:
        keda.uninstall()
    gone = cluster.kubectl("get", "apiservice", EXTERNAL_METRICS, check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr
