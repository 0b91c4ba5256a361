"""The pod runner's pure parts, table-driven: no cluster, no namespaces."""

from __future__ import annotations

from decimal import Decimal

import pytest

from podrunner.containers import go_duration
from podrunner.cpus import CpuManager, exclusive_cpus, guaranteed
from podrunner.downward import expand, parse_quantity
from podrunner.kubelet import LogRequest, LogRequestError, parse_log_request, tail_offset
from podrunner.status import PodFacts, build_status, pod_phase
from podrunner.volumes import keep_image_visible


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("$(A)-$(B)", "1-$(B)"),  # unknown names stay as written
        ("$$(A)", "$(A)"),  # $$ escapes
        ("$(A", "$(A"),  # unterminated
        ("cost $5 $", "cost $5 $"),  # a lone $ is literal
        ("$(A)$(A)", "11"),
    ],
)
def test_expand_follows_kubernetes(text: str, want: str) -> None:
    assert expand(text, {"A": "1"}) == want


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("8Gi", Decimal(8 * 2**30)),
        ("500m", Decimal("0.5")),
        ("2", Decimal(2)),
        ("1e3", Decimal(1000)),
        ("64Mi", Decimal(64 * 2**20)),
        ("1k", Decimal(1000)),
    ],
)
def test_parse_quantity(text: str, want: Decimal) -> None:
    assert parse_quantity(text) == want


@pytest.mark.parametrize(("seconds", "want"), [(1, "1s"), (10, "10s"), (80, "1m20s"), (300, "5m0s")])
def test_go_duration(seconds: float, want: str) -> None:
    assert go_duration(seconds) == want


def _c(state: dict, restarts: int = 0) -> dict:
    return {"name": "c", "state": state, "restartCount": restarts, "lastState": {}, "ready": False}


@pytest.mark.parametrize(
    ("containers", "done", "initialized", "want"),
    [
        ([_c({"waiting": {"reason": "ContainerCreating"}})], [False], True, "Pending"),
        ([_c({"running": {}})], [False], True, "Running"),
        ([_c({"waiting": {"reason": "CrashLoopBackOff"}}, 2)], [False], True, "Running"),
        ([_c({"terminated": {"exitCode": 0}})], [True], True, "Succeeded"),
        ([_c({"terminated": {"exitCode": 0}}), _c({"terminated": {"exitCode": 3}})], [True, True], True, "Failed"),
        ([_c({"terminated": {"exitCode": 0}}), _c({"running": {}})], [True, False], True, "Running"),
        ([_c({"waiting": {"reason": "PodInitializing"}})], [False], False, "Pending"),
    ],
)
def test_pod_phase(containers: list[dict], done: list[bool], initialized: bool, want: str) -> None:
    assert pod_phase(init_failed=False, initialized=initialized, containers=containers, done=done) == want


def test_conditions_keep_their_transition_time_until_they_flip() -> None:
    ready = {"name": "c", "ready": True, "state": {"running": {}}}
    pod = {
        "spec": {},
        "status": {
            "conditions": [
                {"type": "Ready", "status": "True", "lastTransitionTime": "T0"},
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": "S"},
                {"type": "example.com/gate", "status": "True", "lastTransitionTime": "G"},
            ]
        },
    }
    facts = PodFacts(
        host_ip="10.213.0.1",
        pod_ip="10.213.0.2",
        sandbox_ready=True,
        initialized=True,
        phase="Running",
        container_statuses=[ready],
    )
    conds = {c["type"]: c for c in build_status(pod, facts, "T1")["conditions"]}
    assert conds["Ready"] == {"type": "Ready", "status": "True", "lastTransitionTime": "T0"}
    assert conds["ContainersReady"]["lastTransitionTime"] == "T1"
    assert conds["PodScheduled"]["lastTransitionTime"] == "S" and "example.com/gate" in conds
    facts.container_statuses = [{**ready, "ready": False}]
    conds = {c["type"]: c for c in build_status(pod, facts, "T2")["conditions"]}
    assert conds["Ready"]["status"] == "False" and conds["Ready"]["lastTransitionTime"] == "T2"


def test_readiness_gates_hold_ready_back() -> None:
    pod = {"spec": {"readinessGates": [{"conditionType": "example.com/gate"}]}, "status": {"conditions": []}}
    facts = PodFacts(
        host_ip="h",
        pod_ip="p",
        sandbox_ready=True,
        initialized=True,
        phase="Running",
        container_statuses=[{"name": "c", "ready": True, "state": {"running": {}}}],
    )
    conds = {c["type"]: c for c in build_status(pod, facts, "T")["conditions"]}
    assert conds["ContainersReady"]["status"] == "True"
    assert conds["Ready"]["status"] == "False" and conds["Ready"]["reason"] == "ReadinessGatesNotReady"


def _binds(mounts: list[dict]) -> list[tuple[str, str]]:
    return [(m["source"], m["target"]) for m in mounts]


@pytest.mark.parametrize(
    ("targets", "image", "added"),
    [
        (["/tmp"], ["/tmp/clone", "/tmp/clone/.venv"], [("/tmp/clone", "/tmp/clone")]),  # the topmost path only
        (["/tmp/"], ["/tmp/clone"], [("/tmp/clone", "/tmp/clone")]),
        (["/srv", "/models"], ["/tmp/clone"], []),  # nothing of the image covered
        (["/tmp/clone"], ["/tmp/clone"], []),  # a volume on the image path itself is the user's choice
        (["/tmp/clone/data"], ["/tmp/clone"], []),  # a volume inside the image stays on top of it
        (["/tmpfoo"], ["/tmp/clone"], []),  # a prefix of the name is not a parent folder
    ],
)
def test_keep_image_visible_binds_back_covered_image_paths(
    targets: list[str], image: list[str], added: list[tuple[str, str]]
) -> None:
    mounts = [{"source": f"/vol{i}", "target": t, "readonly": False} for i, t in enumerate(targets)]
    out = keep_image_visible(mounts, image)
    assert out[: len(mounts)] == mounts and _binds(out[len(mounts) :]) == added


@pytest.mark.parametrize(
    ("target", "want"),
    [
        ("/containerLogs/ns/p/c", LogRequest("ns", "p", "c")),
        (
            "/containerLogs/ns/p/c?follow=true&tailLines=10&limitBytes=5",
            LogRequest("ns", "p", "c", follow=True, tail_lines=10, limit_bytes=5),
        ),
        ("/containerLogs/ns/p/c?previous=true&follow=true", LogRequest("ns", "p", "c", previous=True)),
        ("/containerLogs/ns/p/c?timestamps=false&stream=All", LogRequest("ns", "p", "c")),
    ],
)
def test_parse_log_request(target: str, want: LogRequest) -> None:
    assert parse_log_request(target) == want


@pytest.mark.parametrize(
    ("target", "status", "says"),
    [
        ("/containerLogs/ns/p", 404, "only /containerLogs"),
        ("/exec/ns/p/c", 404, "only /containerLogs"),
        ("/containerLogs/ns/%2E%2E/c", 400, "not a valid Kubernetes name"),
        ("/containerLogs/ns/p/c?timestamps=true", 400, "no per-line timestamps"),
        ("/containerLogs/ns/p/c?sinceSeconds=5", 400, "no per-line timestamps"),
        ("/containerLogs/ns/p/c?tailLines=-1", 400, "at least 0"),
        ("/containerLogs/ns/p/c?limitBytes=x", 400, "expected an integer"),
        ("/containerLogs/ns/p/c?follow=maybe", 400, "expected true or false"),
        ("/containerLogs/ns/p/c?stream=Stderr", 400, "only All"),
    ],
)
def test_parse_log_request_refuses(target: str, status: int, says: str) -> None:
    with pytest.raises(LogRequestError) as e:
        parse_log_request(target)
    assert e.value.status == status and says in str(e.value)


@pytest.mark.parametrize(
    ("data", "start", "lines", "want"),
    [
        (b"a\nb\nc\n", 0, 2, b"b\nc\n"),
        (b"a\nb\nc", 0, 2, b"b\nc"),  # a last line without its newline counts
        (b"a\nb\nc\n", 0, 5, b"a\nb\nc\n"),
        (b"a\nb\nc\n", 2, 5, b"b\nc\n"),  # never before the run's start
        (b"a\nb\nc\n", 0, 0, b""),
        (b"x" * 100_000 + b"\n" + b"y" * 70_000 + b"\n", 0, 1, b"y" * 70_000 + b"\n"),  # across read blocks
    ],
)
def test_tail_offset(tmp_path, data: bytes, start: int, lines: int, want: bytes) -> None:
    path = tmp_path / "log"
    path.write_bytes(data)
    assert data[tail_offset(path, start, len(data), lines) :] == want


def _pod(*containers: dict, init: tuple[dict, ...] = ()) -> dict:
    named = [{"name": f"c{i}", **c} for i, c in enumerate(containers)]
    return {"spec": {"containers": named, "initContainers": [{"name": f"i{i}", **c} for i, c in enumerate(init)]}}


def _res(limits: dict | None = None, requests: dict | None = None) -> dict:
    return {"resources": {k: v for k, v in (("limits", limits), ("requests", requests)) if v is not None}}


@pytest.mark.parametrize(
    ("pod", "is_guaranteed", "want"),
    [
        (_pod(_res({"cpu": "1", "memory": "1Gi"})), True, [1]),  # requests default to the limits
        (_pod(_res({"cpu": "2", "memory": "1Gi"}, {"cpu": "2000m", "memory": "1Gi"})), True, [2]),
        (_pod(_res({"cpu": "1500m", "memory": "1Gi"})), True, [0]),  # Guaranteed, not a whole CPU: shared pool
        (_pod(_res({"cpu": "1"})), False, [0]),  # no memory limit: Burstable
        (_pod(_res({"cpu": "2", "memory": "1Gi"}, {"cpu": "1"})), False, [0]),  # request below the limit: Burstable
        (_pod(_res({"cpu": "1", "memory": "1Gi"}), {}), False, [0, 0]),  # one container without limits: Burstable
        (_pod(_res({"cpu": "1", "memory": "1Gi"}), _res({"cpu": "250m", "memory": "64Mi"})), True, [1, 0]),
        (_pod(_res({"cpu": "1", "memory": "1Gi"}), init=({},)), False, [0]),  # an init container counts for the QoS
    ],
)
def test_exclusive_cpus_follow_the_static_policy(pod: dict, is_guaranteed: bool, want: list[int]) -> None:
    assert guaranteed(pod) is is_guaranteed
    assert [exclusive_cpus(pod, c) for c in pod["spec"]["containers"]] == want


def test_cpu_manager_hands_out_exclusive_cpus_and_keeps_the_rest_shared() -> None:
    pool = CpuManager({0, 1, 2})
    assert pool.allocate("a", "llm", 1) == {0}
    assert pool.allocate("a", "llm", 1) == {0}  # a restart keeps its CPUs
    assert pool.shared() == {1, 2}
    assert pool.allocate("b", "llm", 2) == {1, 2}
    assert pool.shared() == {0, 1, 2}  # nothing left to share: shared containers run anywhere
    assert pool.allocate("c", "llm", 1) is None  # the caller runs it on the shared pool with a warning
    pool.release("a")
    assert pool.free() == {0} and pool.allocate("c", "llm", 1) == {0}
    pool.release("b", "other")
    assert pool.free() == frozenset()
    pool.release("b", "llm")
    assert pool.shared() == {1, 2}
