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
