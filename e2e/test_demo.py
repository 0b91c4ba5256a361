"""`make demo` and `make demo-down`, run exactly as the README tells a new user to run them.

`make demo` is the README's first command: the control plane in `.omnikube/cluster`, the pod runner for
runner-node-0, `helm install` of the chart with the operator pod running on the runner, the chat and the
text-to-image OmniPipelines on tiny models, one chat and one image through their router pods with the
`openai` client. Then `make demo-down` must leave nothing running: no control-plane process, no pod
runner, no pod process, no bridge.

Marked `demo`: `make test` runs it in a lane of its own, last (hack/run_tests.py), because its pod runner and
control plane are the checkout's own (`.omnikube/`), not a test session's. It refuses to run (fails, naming
why) where a demo already runs in this checkout: its `make demo-down` would stop the user's demo.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
from pathlib import Path

import pytest
from clusterlib import REPO

pytestmark = [pytest.mark.demo, pytest.mark.timeout(2400)]

DEMO_DIR = REPO / ".omnikube"
STATE = DEMO_DIR / "cluster" / "state.json"
RUNNER_PID = DEMO_DIR / "podrunner.pid"


def _make(target: str, timeout: float) -> subprocess.CompletedProcess:
    # The user's environment minus a cluster the test session may point at: the demo uses its own.
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "OMNIKUBE_CLUSTER_DIR")}
    return subprocess.run(["make", target], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1].split()[0] != "Z"
    except OSError:
        return False


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().split(") ")[-1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo.extend(children.get(p, []))
    return out


def _bridges() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show", "type", "bridge"], capture_output=True, text=True, check=True)
    return {line.split(": ")[1].split("@")[0] for line in out.stdout.splitlines() if ": " in line}


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def test_make_demo_serves_a_chat_and_an_image_and_make_demo_down_leaves_nothing() -> None:
    if STATE.exists() or RUNNER_PID.exists():
        pytest.fail(f"a demo runs in this checkout ({DEMO_DIR}): `make demo-down` first; this test would stop it")
    bridges_before = _bridges()
    image = DEMO_DIR / "demo-image.png"
    image.unlink(missing_ok=True)
    demo = _make("demo", timeout=1800)
    try:
        assert demo.returncode == 0, (
            f"make demo exited {demo.returncode}:\n{demo.stdout[-6000:]}\n{demo.stderr[-4000:]}"
        )
        out = demo.stdout
        # what the README promises a user sees: both answers through the router pods, and where to go next
        chat_lines = [line for line in out.splitlines() if line.startswith("chat (http://")]
        assert chat_lines and "/v1" in chat_lines[0], out[-4000:]
        assert any(line.startswith("image (http://") for line in out.splitlines()), out[-4000:]
        assert _png_size(image) == (64, 64)
        assert "export KUBECONFIG=" in out and "make demo-down" in out
        # the operator really runs as a pod (on the runner), not as a process the test started
        state = json.loads(STATE.read_text())
        env = {**os.environ, "KUBECONFIG": str(DEMO_DIR / "cluster" / "kubeconfig")}
        kubectl = str(Path(state["bin_dir"]) / "kubectl")
        pods = json.loads(
            subprocess.run(
                [kubectl, "get", "pods", "-A", "-o", "json"], env=env, capture_output=True, text=True, check=True
            ).stdout  # fmt: skip
        )["items"]
        running = {
            (p["metadata"]["namespace"], p["spec"].get("nodeName")) for p in pods if p["status"]["phase"] == "Running"
        }
        assert ("omnikube-system", "runner-node-0") in running, running
        runner = int(RUNNER_PID.read_text())
        processes = _descendants(runner) | set(state.get("pids", {}).values())
        assert len(_descendants(runner)) > 3, "the pod runner runs no pod process"
    finally:
        down = _make("demo-down", timeout=300)
    assert down.returncode == 0, (
        f"make demo-down exited {down.returncode}:\n{down.stdout[-3000:]}\n{down.stderr[-3000:]}"
    )
    left = sorted(pid for pid in processes if _alive(pid))
    assert left == [], f"processes left after make demo-down: {left}"
    assert not RUNNER_PID.exists() and not STATE.exists()
    assert _bridges() - bridges_before == set(), "a bridge of the demo's pod runner is left"
