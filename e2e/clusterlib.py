"""Helpers the cluster-tier tests share (kept out of conftest.py, whose module name tests/ also uses)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def kubectl_json(cluster: Any, *args: str) -> dict:
    """`kubectl <args> -o json`, parsed."""
    return json.loads(cluster.kubectl(*args, "-o", "json").stdout)


def wait_for(
    predicate: Callable[[], object],
    timeout: float = 60,
    what: str = "condition",
    on_fail: Callable[[], str] = lambda: "",
) -> object:
    """Poll `predicate` until it returns something truthy; fail naming `what` (and `on_fail()`'s text)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{on_fail()}")


def condition(obj: dict, type_: str) -> dict:
    """The status condition of that type, or {}."""
    # A just-created object may carry `conditions: null` (a CRD before its controller has looked at it).
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def wait_established(cluster: Any, crds: list[str], timeout: float = 120) -> None:
    """Until every named CustomResourceDefinition says Established.

    Why not `kubectl wait --for=condition=Established` right after the apply: it lists from the API server's watch
    cache, which on a loaded machine can lag behind the create just answered, and then exits 1 at once with "no
    matching resources found" (a warm run lost both KEDA autoscaling tests so, 3 s after the CRDs were created).
    A GET by name reads etcd itself, so each poll sees the CRD once it exists."""

    def established() -> bool:
        for name in crds:
            out = cluster.kubectl("get", "crd", name, "-o", "json", check=False)
            if out.returncode != 0 or condition(json.loads(out.stdout), "Established").get("status") != "True":
                return False
        return True

    wait_for(established, timeout, f"the CRDs Established: {', '.join(crds)}")


def apply(cluster: Any, namespace: str, obj: dict) -> None:
    """`kubectl apply` one object (or a v1 List) into `namespace`."""
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(obj))


def stop_process_group(proc: subprocess.Popen | None, sig: int = signal.SIGTERM, timeout: float = 15) -> None:
    """Send `sig` to a process started with `start_new_session=True` and its children; SIGKILL the
    group if it has not exited within `timeout` seconds."""
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


ADDONS = REPO / "e2e" / "cluster" / "addons"


def go_module_dir(addon: str, module: str) -> Path:
    """The source folder of `module` at the version e2e/cluster/addons/<addon>/go.mod pins, fetched
    through the Go module proxy into the module cache (a no-op once there)."""
    pins = (ADDONS / addon / "go.mod").read_text().split()
    version = pins[pins.index(module) + 1]
    out = subprocess.run(
        ["go", "mod", "download", "-json", f"{module}@{version}"], check=True, capture_output=True, text=True
    )
    return Path(json.loads(out.stdout)["Dir"])


def keda_crd(name: str = "keda.sh_scaledobjects.yaml") -> Path:
    """A CRD of KEDA as its release ships it (config/crd/bases of the pinned github.com/kedacore/keda/v2)."""
    return go_module_dir("keda", "github.com/kedacore/keda/v2") / "config" / "crd" / "bases" / name


def stage_deployment(cluster: Any, namespace: str, omnistage: str) -> str:
    """The name of the Deployment that runs an OmniStage's current generation (named by its contract)."""
    from omni_operator.api import OmniStage
    from omni_operator.builders.stage_workload import generation_deployment_name

    live = kubectl_json(cluster, "get", "omnistage", omnistage, "-n", namespace)
    return generation_deployment_name(OmniStage.model_validate(live))
