"""The pod runner's pure parts, table-driven: no cluster, no namespaces."""

from __future__ import annotations

from decimal import Decimal

import pytest

from podrunner.containers import go_duration
from podrunner.downward import expand, parse_quantity
from podrunner.status import PodFacts, build_status, pod_phase


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
