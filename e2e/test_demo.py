"""`make demo`, the README's first command, exactly as a user runs it, then `make demo-down`.

Real: everything `hack/demo.sh` starts, from this checkout, in its own `.omnikube/` (the control plane in
`.omnikube/cluster`, the pod runner with `.omnikube/podrunner.pid`), nothing copied or stubbed.

It does not get in the way of a pytest session running beside it with its own `cluster` fixture and pod
runner: that session's control plane lives in a temporary folder on ports of its own (`free_port`), its
runner nodes register with its own apiserver (node names are per cluster), and each pod runner takes its own
bridge (the first free /24, chosen under a host-wide lock). What it needs alone is this checkout's
`.omnikube/`: a demo already running from it is reused by `make demo` and stopped by `make demo-down`, so
the test refuses to start then. `make test` runs it last, in a lane of its own (hack/run_tests.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import psutil
import pytest
from clusterlib import REPO
from PIL import Image

pytestmark = [pytest.mark.demo, pytest.mark.timeout(3600)]

DIR = REPO / ".omnikube"
RUNNER_PID = DIR / "podrunner.pid"
CLUSTER_STATE = DIR / "cluster" / "state.json"
RUNNER_STATE = DIR / "podrunner" / "runner.json"
DEMO_TIMEOUT = 2400
"""Seconds for `make demo`: the control plane and tiny models are usually cached, but vLLM and SD3 load on two
loaded cores (its own `kubectl wait` allows 15 min for Ready)."""


def _make(target: str, timeout: float) -> subprocess.CompletedProcess:
    """`make <target>` in the checkout, as a user's shell would run it (none of a test session's cluster
    settings leak in)."""
    leaks = ("KUBECONFIG", "OMNIKUBE_CLUSTER_DIR", "OMNIKUBE_CLUSTER_BUILD")
    env = {k: v for k, v in os.environ.items() if k not in leaks}
    return subprocess.run(
        ["make", "--no-print-directory", target],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _runner_pid() -> int | None:
    try:
        pid = int(RUNNER_PID.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if psutil.pid_exists(pid) else None


def _demo_processes() -> dict[int, float]:
    """Every process of the demo (pid -> start time): the pod runner and what it runs (the pods' sandboxes,
    agents and containers, the operator pod included), the control plane's processes and their children."""
    roots = [pid for pid in [_runner_pid()] if pid]
    if CLUSTER_STATE.exists():
        roots += list(json.loads(CLUSTER_STATE.read_text()).get("pids", {}).values())
    found: dict[int, float] = {}
    for root in roots:
        try:
            top = psutil.Process(root)
            for proc in [top, *top.children(recursive=True)]:
                found[proc.pid] = proc.create_time()
        except psutil.NoSuchProcess:
            continue
    return found


def _alive(pid: int, created: float) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _describe(pid: int) -> str:
    try:
        return f"{pid} {' '.join(psutil.Process(pid).cmdline())[:200]}"
    except psutil.NoSuchProcess:
        return f"{pid} (gone since)"


def _net_namespace(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


def test_make_demo_answers_chat_and_image_and_demo_down_leaves_nothing_running() -> None:
    if CLUSTER_STATE.exists() or _runner_pid():
        pytest.fail(f"a demo of this checkout already runs ({DIR}): `make demo-down` first, this test would stop it")
    processes: dict[int, float] = {}
    networks: set[str] = set()
    bridge = ""
    veths: list[str] = []
    try:
        demo = _make("demo", DEMO_TIMEOUT)
        output = demo.stdout + demo.stderr
        assert demo.returncode == 0, f"make demo exited {demo.returncode}:\n{output[-6000:]}"
        chat = re.search(r"^chat \((http://[\d.]+:8000/v1/?)\): (.+)$", demo.stdout, re.M)
        image = re.search(r"^image \((http://[\d.]+:8000/v1/?)\): saved to (\S+)$", demo.stdout, re.M)
        assert chat and image, f"the chat or the image did not answer:\n{demo.stdout[-4000:]}"
        with Image.open(image.group(2)) as png:
            assert png.size == (64, 64), png.size
        # The operator really runs as a pod of the chart on the runner's node, not as a process a test started.
        state = json.loads(CLUSTER_STATE.read_text())
        kubectl = subprocess.run(
            [f"{state['bin_dir']}/kubectl", "get", "pods", "-n", "omnikube-system", "-o", "json"],
            env={**os.environ, "KUBECONFIG": str(DIR / "cluster" / "kubeconfig")}, capture_output=True, text=True,
            check=True,
        )  # fmt: skip
        operator_pods = [(p["spec"].get("nodeName"), p["status"]["phase"]) for p in json.loads(kubectl.stdout)["items"]]
        assert ("runner-node-0", "Running") in operator_pods, operator_pods
        # What runs now, to look for after the teardown (no process of the demo may outlive it).
        processes = _demo_processes()
        assert _runner_pid() in processes, "the pod runner's pid file names no running process"
        host = _net_namespace("self")
        networks = {ns for pid in processes if (ns := _net_namespace(pid)) and ns != host}
        assert networks, "no pod runs in a network namespace of its own"
        bridge = json.loads(RUNNER_STATE.read_text())["bridge"]
        listed = subprocess.run(["ip", "-o", "link", "show", "master", bridge], capture_output=True, text=True)
        veths = [line.split(":")[1].strip().split("@")[0] for line in listed.stdout.splitlines()]
        assert veths, f"no pod is attached to the bridge {bridge}"
    finally:
        down = _make("demo-down", 600)
    assert down.returncode == 0, f"make demo-down exited {down.returncode}:\n{down.stdout}{down.stderr}"

    left = [_describe(pid) for pid, created in processes.items() if _alive(pid, created)]
    assert not left, "processes of the demo outlive make demo-down:\n" + "\n".join(left)
    holders = [pid for pid in os.listdir("/proc") if pid.isdigit() and _net_namespace(pid) in networks]
    assert not holders, f"the pods' network namespaces are still held by {holders}"
    assert not _link_exists(bridge), f"the pod runner's bridge {bridge} is still there"
    assert not [v for v in veths if _link_exists(v)], f"pod veths still there: {veths}"
    assert not RUNNER_PID.exists() and not CLUSTER_STATE.exists(), "the demo's pid files are still there"
