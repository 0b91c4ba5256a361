"""The rollout planner (`omni_operator.rollout.plan_rollout`) and the builders it drives: what each pod group is
told at each step of a contract change, and what that does to its Deployment. Pure, no cluster (the cluster
tier, e2e/test_operator_cluster.py, runs the same choreography against a real control plane)."""

from __future__ import annotations

import datetime as dt

import pytest

from omni_operator.api import OmniStage
from omni_operator.api.rollout import GenerationStatus, Rollout, RolloutPhase, RolloutStatus, surge_replicas
from omni_operator.builders.stage_workload import build_stage_deployment, generation_deployment_name
from omni_operator.render import render_pipeline
from omni_operator.rollout import GroupView, plan_rollout
from omni_runtime.registry import default_registry

NOW = dt.datetime(2026, 12, 3, 12, 0, tzinfo=dt.timezone.utc)


def _gen(contract: str, *, ready: int, replicas: int = 1, current: bool = False, age_s: float = 5) -> GenerationStatus:
    created = (NOW - dt.timedelta(seconds=age_s)).isoformat().replace("+00:00", "Z")
    return GenerationStatus(
        contract=contract, deployment=f"d-{contract}", current=current, replicas=replicas,
        ready_replicas=ready, created=created,
    )  # fmt: skip


def _plan(groups: list[GroupView], previous: RolloutStatus | None = None, **settings):
    return plan_rollout(groups, Rollout(**settings), target="T", previous=previous, serving_before="S", now=NOW)


@pytest.mark.parametrize(
    ("surge", "replicas", "expected"),
    [("100%", 3, 3), ("25%", 3, 1), ("50%", 3, 2), ("0%", 3, 0), (1, 3, 1), (5, 3, 3), ("25%", 0, 0)],
)
def test_max_surge_is_a_count_or_a_percentage_rounded_up_never_past_the_stages_replicas(surge, replicas, expected):
    assert surge_replicas(surge, replicas) == expected


@pytest.mark.parametrize("bad", [-1, "150%", "ten", "5.5%", True])
def test_a_bad_max_surge_is_refused_saying_what_to_write(bad) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="maxSurge"):
        Rollout(max_surge=bad)


def test_one_generation_everywhere_is_complete_and_serves_the_target() -> None:
    plan = _plan([GroupView("a", "T", 2, [_gen("T", ready=2, current=True)])])
    assert plan.stages == {} and plan.status.phase is RolloutPhase.COMPLETE and plan.status.serving == "T"


def test_while_the_new_generation_comes_up_the_old_one_is_kept_and_the_new_one_bounded_by_max_surge() -> None:
    changing = GroupView("a", "T", 4, [_gen("T", ready=0, current=True), _gen("A", ready=4, replicas=4)])
    unchanged = GroupView("b", "B", 2, [_gen("B", ready=2, current=True)])
    plan = _plan([changing, unchanged], max_surge="50%")
    assert plan.status.phase is RolloutPhase.SURGING and plan.status.moving == ["a"]
    assert plan.status.serving == "S", "the contract that served before keeps serving"
    assert plan.stages["a"].keep_older and plan.stages["a"].max_replicas == 2
    assert "b" not in plan.stages, "a group whose contract did not change serves both generations untouched"
    assert plan.recheck_seconds == pytest.approx(600 - 5 + 1)


def test_before_the_stage_made_its_new_deployment_the_old_one_is_kept() -> None:
    """The pipeline applies the new spec before the stage acts on it: its status still shows only the old
    generation, and the plan must hold it, or the stage would delete what serves."""
    plan = _plan([GroupView("a", "T", 1, [_gen("A", ready=1, current=True)])])
    assert plan.stages["a"].keep_older and plan.status.phase is RolloutPhase.SURGING


def test_once_every_group_has_its_surge_ready_the_older_generations_are_released() -> None:
    a = GroupView("a", "T", 4, [_gen("T", ready=2, replicas=2, current=True), _gen("A", ready=4, replicas=4)])
    b = GroupView("b", "U", 1, [_gen("U", ready=0, current=True), _gen("B", ready=1)])
    assert _plan([a, b], max_surge="50%").stages["a"].keep_older, "b is not ready: a keeps its old one too"
    b.generations[0].ready_replicas = 1
    plan = _plan([a, b], max_surge="50%")
    assert plan.stages == {}, "whole: every group drops its older generations and runs its full count"
    assert plan.problem is None and plan.status.moving == []


def test_a_new_generation_whose_pods_cannot_run_is_rolled_back_and_stays_so_until_the_spec_changes() -> None:
    degraded = {"type": "Degraded", "status": "True", "reason": "CrashLoop", "message": "keeps crashing"}
    group = GroupView("a", "T", 2, [_gen("T", ready=0, current=True), _gen("A", ready=2, replicas=2)], degraded)
    plan = _plan([group])
    assert plan.status.phase is RolloutPhase.ROLLED_BACK and plan.stages["a"].max_replicas == 0
    assert plan.stages["a"].keep_older
    assert plan.problem is not None and plan.problem.reason == "RolloutFailed"
    assert "stage a" in plan.problem.message and "CrashLoop" in plan.problem.message and "S" in plan.problem.message
    # Scaled to zero its pods say nothing any more; the status remembers.
    quiet = GroupView("a", "T", 2, [_gen("T", ready=0, replicas=0, current=True), _gen("A", ready=2, replicas=2)])
    again = _plan([quiet], previous=plan.status)
    assert again.status.phase is RolloutPhase.ROLLED_BACK and again.stages["a"].max_replicas == 0
    assert again.status == plan.status, "the same status every reconcile (no write in steady state)"
    assert _plan([quiet], previous=again.status).status == plan.status
    assert again.status.cause == "CrashLoop: keeps crashing" and again.status.message.count("keeps crashing") == 1
    # A new target starts afresh.
    fresh = plan_rollout(
        [GroupView("a", "T2", 2, [_gen("A", ready=2, replicas=2, current=True)])],
        Rollout(), target="T2", previous=plan.status, serving_before="S", now=NOW,
    )  # fmt: skip
    assert fresh.status.phase is RolloutPhase.SURGING and fresh.problem is None


def test_without_auto_rollback_a_failed_generation_keeps_its_replicas() -> None:
    degraded = {"type": "Degraded", "status": "True", "reason": "EngineFailed", "message": "self-check failed"}
    group = GroupView("a", "T", 2, [_gen("T", ready=0, current=True), _gen("A", ready=2, replicas=2)], degraded)
    plan = _plan([group], auto_rollback=False)
    assert plan.status.phase is RolloutPhase.FAILED and plan.stages["a"].max_replicas == 2
    assert "autoRollback is off" in plan.status.message
    assert _plan([group], previous=plan.status, auto_rollback=False).status == plan.status, "steady: no write"
    # Turning autoRollback on afterwards (outside the contract: the same target) scales it to zero, same cause.
    on = _plan([group], previous=plan.status)
    assert on.status.phase is RolloutPhase.ROLLED_BACK and on.stages["a"].max_replicas == 0
    assert on.status.cause == plan.status.cause and on.status.message.count("self-check failed") == 1
    assert "scaled to zero" in on.status.message


def test_a_generation_that_misses_its_progress_deadline_fails() -> None:
    slow = GroupView("a", "T", 1, [_gen("T", ready=0, current=True, age_s=31), _gen("A", ready=1)])
    plan = _plan([slow], progress_deadline_seconds=30)
    assert plan.status.phase is RolloutPhase.ROLLED_BACK and plan.status.reason == "ProgressDeadlineExceeded"
    assert "progressDeadlineSeconds (30 s)" in plan.status.message
    assert _plan([slow], progress_deadline_seconds=60).status.phase is RolloutPhase.SURGING


def test_max_surge_zero_stops_the_world() -> None:
    plan = _plan([GroupView("a", "T", 3, [_gen("A", ready=3, replicas=3, current=True)])], max_surge=0)
    assert plan.status.phase is RolloutPhase.STOP_THE_WORLD
    assert not plan.stages["a"].keep_older and plan.stages["a"].max_replicas == 3
    assert "maxSurge 0" in plan.status.message


def _manifest(**spec) -> dict:
    return {
        "apiVersion": "omnikube.io/v1alpha1", "kind": "OmniPipeline", "metadata": {"name": "p"},
        "spec": {"model": "/models/m", "pipeline": "prompt-enhanced-t2i", **spec},
    }  # fmt: skip


def _stages(manifest: dict) -> dict[str, OmniStage]:
    out = {}
    for obj in render_pipeline(manifest, default_registry()):
        if obj["kind"] == "OmniStage":
            stage = OmniStage.model_validate(obj)
            stage.metadata.uid = "u"
            out[stage.spec.stage] = stage
    return out


def test_a_contract_change_names_a_new_deployment_and_configmap_and_a_neutral_change_neither() -> None:
    base = _stages(_manifest())
    moved = _stages(_manifest(model="/models/m2"))
    tuned = _stages(_manifest(stages=[{"name": "dit", "replicas": 3, "samplingParams": {"num_inference_steps": 2}}]))
    for name in ("enhancer", "dit"):
        assert generation_deployment_name(moved[name]) != generation_deployment_name(base[name])
        assert moved[name].spec.config_map != base[name].spec.config_map
        assert generation_deployment_name(tuned[name]) == generation_deployment_name(base[name])
        assert tuned[name].spec.config_map == base[name].spec.config_map


def test_the_pipelines_rollout_caps_the_new_deployment_without_changing_its_pods() -> None:
    stage = _stages(_manifest(stages=[{"name": "dit", "replicas": 4}]))["dit"]
    full = build_stage_deployment(stage)
    from omni_operator.api.rollout import StageRollout

    stage.spec.rollout = StageRollout(keep_older=True, max_replicas=1)
    capped = build_stage_deployment(stage)
    assert (full["spec"]["replicas"], capped["spec"]["replicas"]) == (4, 1)
    assert capped["spec"]["template"] == full["spec"]["template"], "a rollout step never rolls the pods"


# -- capacity: a new generation that would not fit is reported before any pod of it is made ------------------


def _node(name: str, gpus: int, *, ready: bool = True, cordoned: bool = False) -> dict:
    return {
        "metadata": {"name": name},
        "spec": {"unschedulable": True} if cordoned else {},
        "status": {
            "allocatable": {"nvidia.com/gpu": str(gpus), "cpu": "64"},
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def _pod(node: str | None, gpus: int, *, phase: str = "Running", limits_only: bool = False, init: int = 0) -> dict:
    res = {"limits": {"nvidia.com/gpu": str(gpus)}} if limits_only else {"requests": {"nvidia.com/gpu": str(gpus)}}
    spec: dict = {"containers": [{"name": "c", "resources": res}, {"name": "side", "resources": {}}]}
    if node:
        spec["nodeName"] = node
    if init:
        spec["initContainers"] = [{"name": "i", "resources": {"requests": {"nvidia.com/gpu": str(init)}}}]
    return {"spec": spec, "status": {"phase": phase}}


def test_free_accelerators_are_allocatable_less_what_bound_unfinished_pods_hold_on_schedulable_nodes() -> None:
    from omni_operator.capacity import free_accelerators

    nodes = [_node("a", 8), _node("b", 8), _node("down", 8, ready=False), _node("cordoned", 8, cordoned=True),
             _node("cpu", 0)]  # fmt: skip
    pods = [
        _pod("a", 3), _pod("a", 2, limits_only=True),  # requests, or limits where there is no request
        _pod("b", 1, init=6),  # an init container's ask counts when it is the larger
        _pod("b", 8, phase="Succeeded"), _pod(None, 8, phase="Pending"),  # finished, and not bound: nothing held
    ]  # fmt: skip
    free = free_accelerators(nodes, pods, "nvidia.com/gpu")
    assert dict(free.per_node) == {"a": 3, "b": 2}
    assert free.replicas(2) == 2 and free.replicas(3) == 1 and free.replicas(4) == 0
    assert free.describe() == "a: 3, b: 2"
    assert free_accelerators([], [], "nvidia.com/gpu").describe() == "no schedulable node has nvidia.com/gpu"


def _short_group(free_per_node: dict[str, int], *, made: bool = False) -> GroupView:
    from omni_operator.capacity import AcceleratorNeed, FreeAccelerators

    gens = [_gen("A", ready=2, replicas=2, current=not made)]
    if made:
        gens.insert(0, _gen("T", ready=0, replicas=2, current=True))
    return GroupView("llm", "T", 2, gens, need=AcceleratorNeed("nvidia.com/gpu", 8),
                     free=FreeAccelerators("nvidia.com/gpu", free_per_node))  # fmt: skip


def test_a_surge_the_free_accelerators_cannot_hold_waits_and_says_what_to_change() -> None:
    cpu_only = GroupView("enhancer", "U", 1, [_gen("B", ready=1, current=True)])
    plan = _plan([_short_group({"a": 8, "b": 4}), cpu_only])
    assert plan.status.phase is RolloutPhase.WAITING_FOR_CAPACITY and plan.status.moving[0] == "llm"
    llm = plan.stages["llm"]
    assert (llm.keep_older, llm.max_replicas, llm.waiting_for_capacity) == (True, 0, True), "no pod of it is made"
    assert plan.stages["enhancer"].max_replicas == 1 and not plan.stages["enhancer"].waiting_for_capacity
    message = plan.status.message
    for told in ("stage llm needs 2 replica(s) with 8 nvidia.com/gpu", "for 1", "a: 8, b: 4", "maxSurge",
                 "set it to 0 to stop the world", "S keeps serving"):  # fmt: skip
        assert told in message, (told, message)
    assert plan.problem is not None and plan.problem.reason == "InsufficientAccelerator"
    assert plan.status.reason == "InsufficientAccelerator"
    assert plan.recheck_seconds == 30.0, "nodes are not watched: it looks again"


def test_a_surge_that_fits_a_smaller_max_surge_or_stop_the_world_does_not_wait() -> None:
    assert _plan([_short_group({"a": 8, "b": 8})]).status.phase is RolloutPhase.SURGING
    plan = _plan([_short_group({"a": 8})], max_surge=1)
    assert plan.status.phase is RolloutPhase.SURGING and plan.stages["llm"].max_replicas == 1
    assert _plan([_short_group({})], max_surge=0).status.phase is RolloutPhase.STOP_THE_WORLD
    # Once its Deployment exists the scheduler's word counts (its pods' Degraded InsufficientAccelerator)
    assert _plan([_short_group({}, made=True)]).status.phase is RolloutPhase.SURGING


def test_a_waiting_generation_gets_no_deployment_and_the_stage_says_why() -> None:
    from omni_operator.api.rollout import StageRollout
    from omni_operator.status.stage_status import stage_conditions

    waiting = StageRollout(keep_older=True, max_replicas=0, waiting_for_capacity=True)
    stage = {"spec": {"stage": "llm", "replicas": 2, "rollout": waiting.to_dict()}}
    counts, (ready, progressing, degraded) = stage_conditions(stage, None, [])
    assert counts == {"replicas": 0, "readyReplicas": 0}
    assert (ready.status, ready.reason) == ("False", "InsufficientAccelerator")
    assert "older generation serves" in ready.message and progressing.status == "False"
    assert degraded.status == "False", "the pipeline's status carries the problem, once"
