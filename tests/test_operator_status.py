"""Status, computed purely: the condition writer, an OmniStage's conditions from its Deployment and pods,
and an OmniPipeline's conditions from its OmniStages and router."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from omni_operator.metrics import STAGE_REPLICAS_DESIRED, OperatorMetrics
from omni_operator.status.conditions import Condition, get_condition, set_condition
from omni_operator.status.pipeline_status import PipelineObservation, pipeline_conditions
from omni_operator.status.stage_status import stage_conditions

T0, T1, T2 = "2024-01-01T00:00:00Z", "2024-01-01T00:05:00Z", "2024-01-01T00:10:00Z"


# --- set_condition ----------------------------------------------------------------------------------


def test_new_condition_gets_a_transition_time_and_is_a_change():
    conditions, changed = set_condition([], Condition("Ready", "False", "Creating", "wait"), 1, now=T0)
    assert changed is True
    assert conditions == [
        {
            "type": "Ready",
            "status": "False",
            "reason": "Creating",
            "message": "wait",
            "observedGeneration": 1,
            "lastTransitionTime": T0,
        }
    ]


def test_new_condition_without_now_gets_the_current_time():
    [cond], _ = set_condition([], Condition("Ready", "True", "Available"), 1)
    assert cond["lastTransitionTime"].endswith("Z") and len(cond["lastTransitionTime"]) == 20


def test_same_status_keeps_the_transition_time_even_when_the_message_changes():
    first, _ = set_condition([], Condition("Ready", "False", "RollingOut", "0/2 ready"), 1, now=T0)
    second, changed = set_condition(first, Condition("Ready", "False", "WaitingForReplicas", "1/2 ready"), 2, now=T1)
    assert changed is True
    [cond] = second
    assert cond["lastTransitionTime"] == T0
    assert (cond["reason"], cond["message"], cond["observedGeneration"]) == ("WaitingForReplicas", "1/2 ready", 2)


def test_status_flip_updates_the_transition_time():
    first, _ = set_condition([], Condition("Ready", "False", "RollingOut", "0/2 ready"), 1, now=T0)
    second, changed = set_condition(first, Condition("Ready", "True", "Available", "2/2 ready"), 1, now=T1)
    assert changed is True
    assert second[0]["lastTransitionTime"] == T1
    third, changed = set_condition(second, Condition("Ready", "False", "RollingOut", "1/2 ready"), 1, now=T2)
    assert changed is True and third[0]["lastTransitionTime"] == T2


def test_unchanged_condition_is_not_a_change_whatever_the_clock_says():
    first, _ = set_condition([], Condition("Ready", "True", "Available", "2/2 ready"), 3, now=T0)
    again, changed = set_condition(first, Condition("Ready", "True", "Available", "2/2 ready"), 3, now=T2)
    assert changed is False
    assert again == first


def test_new_generation_alone_is_a_change():
    first, _ = set_condition([], Condition("Ready", "True", "Available", "ok"), 1, now=T0)
    second, changed = set_condition(first, Condition("Ready", "True", "Available", "ok"), 2, now=T1)
    assert changed is True
    assert second[0]["observedGeneration"] == 2 and second[0]["lastTransitionTime"] == T0


def test_other_conditions_are_kept_in_place_and_the_input_is_not_modified():
    conditions = [
        {
            "type": "Ready",
            "status": "False",
            "reason": "RollingOut",
            "message": "",
            "observedGeneration": 1,
            "lastTransitionTime": T0,
        },
        {
            "type": "Degraded",
            "status": "False",
            "reason": "AsExpected",
            "message": "",
            "observedGeneration": 1,
            "lastTransitionTime": T0,
        },
    ]
    snapshot = copy.deepcopy(conditions)
    out, changed = set_condition(conditions, Condition("Ready", "True", "Available", "ok"), 2, now=T1)
    assert changed is True
    assert conditions == snapshot
    assert [c["type"] for c in out] == ["Ready", "Degraded"]
    assert out[1] == snapshot[1]
    assert get_condition(out, "Ready")["status"] == "True"
    # Adding a new type appends it, still without touching the input.
    out2, _ = set_condition(out, Condition("Progressing", "False", "Complete"), 2, now=T1)
    assert [c["type"] for c in out2] == ["Ready", "Degraded", "Progressing"]
    assert [c["type"] for c in out] == ["Ready", "Degraded"]


# --- stage_conditions -------------------------------------------------------------------------------


def omnistage(replicas: int = 2, stage: str = "thinker") -> dict[str, Any]:
    return {"metadata": {"name": f"p-{stage}", "generation": 1}, "spec": {"stage": stage, "replicas": replicas}}


def deployment(
    *,
    generation: int = 2,
    observed: int = 2,
    replicas: int = 2,
    updated: int = 2,
    ready: int = 2,
    available: int | None = None,
) -> dict[str, Any]:
    return {
        "metadata": {"name": "p-thinker", "generation": generation},
        "status": {
            "observedGeneration": observed,
            "replicas": replicas,
            "updatedReplicas": updated,
            "readyReplicas": ready,
            "availableReplicas": ready if available is None else available,
        },
    }


def pending_pod(message: str) -> dict[str, Any]:
    return {
        "metadata": {"name": "p-thinker-abc"},
        "status": {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}],
        },
    }


def waiting_pod(
    reason: str,
    message: str = "",
    *,
    restarts: int = 0,
    last: dict | None = None,
    image: str = "ghcr.io/omnikube/runtime:0.1.0",
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "name": "thinker",
        "image": image,
        "restartCount": restarts,
        "state": {"waiting": {"reason": reason, "message": message}},
    }
    if last:
        status["lastState"] = {"terminated": last}
    return {
        "metadata": {"name": "p-thinker-abc"},
        "status": {
            "phase": "Running",
            "conditions": [{"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [status],
        },
    }


def conds(conditions: list[Condition]) -> dict[str, Condition]:
    assert [c.type for c in conditions] == ["Ready", "Progressing", "Degraded"]
    return {c.type: c for c in conditions}


# (id, stage replicas, deployment, pods, Ready status, Ready reason, Degraded status, Degraded reason, in message)
STAGE_CASES = [
    ("no-deployment", 2, None, [], "False", "Creating", "False", "AsExpected", ["Deployment is being created"]),
    ("rolled-and-ready", 2, deployment(), [], "True", "Available", "False", "AsExpected", ["2/2 replicas ready"]),
    (
        "old-pods-still-serving",
        2,
        deployment(replicas=3, updated=2, ready=3),
        [],
        "False",
        "RollingOut",
        "False",
        "AsExpected",
        [],
    ),
    (
        "updated-but-old-pods-ready",
        2,
        deployment(replicas=4, updated=2, ready=2),
        [],
        "False",
        "RollingOut",
        "False",
        "AsExpected",
        [],
    ),
    (
        "generation-not-observed",
        2,
        deployment(generation=3, observed=2),
        [],
        "False",
        "RollingOut",
        "False",
        "AsExpected",
        [],
    ),
    (
        "rolled-but-not-yet-ready",
        2,
        deployment(ready=1),
        [],
        "False",
        "WaitingForReplicas",
        "False",
        "AsExpected",
        ["1/2 replicas ready"],
    ),
    (
        "ready-but-not-available",
        2,
        deployment(ready=2, available=1),
        [],
        "False",
        "WaitingForReplicas",
        "False",
        "AsExpected",
        [],
    ),
    (
        "scaled-to-zero",
        0,
        deployment(replicas=0, updated=0, ready=0),
        [],
        "True",
        "ScaledToZero",
        "False",
        "AsExpected",
        [],
    ),
    (
        "insufficient-gpu",
        2,
        deployment(ready=0),
        [
            pending_pod(
                "0/4 nodes are available: 1 Insufficient cpu, 3 Insufficient nvidia.com/gpu. preemption: "
                "0/4 nodes are available: 4 No preemption victims found for incoming pod."
            )
        ],
        "False",
        "WaitingForReplicas",
        "True",
        "InsufficientAccelerator",
        ["stage thinker", "nvidia.com/gpu", "accelerator.count"],
    ),
    (
        "insufficient-npu",
        2,
        deployment(ready=0),
        [pending_pod("0/2 nodes are available: 2 Insufficient huawei.com/Ascend910.")],
        "False",
        "WaitingForReplicas",
        "True",
        "InsufficientAccelerator",
        ["huawei.com/Ascend910"],
    ),
    (
        "pvc-missing",
        2,
        deployment(ready=0),
        [
            pending_pod(
                '0/1 nodes are available: persistentvolumeclaim "model-cache" not found. preemption: '
                "0/1 nodes are available: 1 Preemption is not helpful for scheduling."
            )
        ],
        "False",
        "WaitingForReplicas",
        "True",
        "ModelCacheMissing",
        ["model-cache", "spec.runtime.modelCache"],
    ),
    (
        "pvc-unbound",
        2,
        deployment(ready=0),
        [
            pending_pod(
                "0/1 nodes are available: pod has unbound immediate PersistentVolumeClaims. preemption: "
                "0/1 nodes are available: 1 Preemption is not helpful for scheduling."
            )
        ],
        "False",
        "WaitingForReplicas",
        "True",
        "ModelCacheMissing",
        ["spec.runtime.modelCache"],
    ),
    (
        "untolerated-taint",
        2,
        deployment(ready=0),
        [pending_pod("0/2 nodes are available: 2 node(s) had untolerated taint {huawei.com/Ascend910: }.")],
        "False",
        "WaitingForReplicas",
        "True",
        "Unschedulable",
        ["untolerated taint", "tolerations"],
    ),
    (
        "node-selector-mismatch",
        2,
        deployment(ready=0),
        [pending_pod("0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector.")],
        "False",
        "WaitingForReplicas",
        "True",
        "Unschedulable",
        ["nodeSelector"],
    ),
    (
        "insufficient-cpu-only",
        2,
        deployment(ready=0),
        [pending_pod("0/3 nodes are available: 3 Insufficient cpu.")],
        "False",
        "WaitingForReplicas",
        "True",
        "Unschedulable",
        ["Insufficient cpu", "resources"],
    ),
    (
        "crash-loop",
        2,
        deployment(ready=1),
        [
            waiting_pod(
                "CrashLoopBackOff", "back-off 5m0s", restarts=7, last={"exitCode": 1, "message": "CUDA out of memory"}
            )
        ],
        "False",
        "WaitingForReplicas",
        "True",
        "CrashLoop",
        ["7 restarts", "exit code 1", "CUDA out of memory", "kubectl logs p-thinker-abc -c thinker --previous"],
    ),
    (
        "image-pull",
        2,
        deployment(ready=0),
        [waiting_pod("ImagePullBackOff", "Back-off pulling image", image="ghcr.io/omnikube/runtime:nope")],
        "False",
        "WaitingForReplicas",
        "True",
        "ImagePull",
        ["ghcr.io/omnikube/runtime:nope", "imagePullSecrets"],
    ),
    (
        "err-image-pull",
        2,
        deployment(ready=0),
        [waiting_pod("ErrImagePull", "manifest unknown")],
        "False",
        "WaitingForReplicas",
        "True",
        "ImagePull",
        ["manifest unknown"],
    ),
    (
        "missing-secret",
        2,
        deployment(ready=0),
        [waiting_pod("CreateContainerConfigError", 'secret "hf-token" not found')],
        "False",
        "WaitingForReplicas",
        "True",
        "ContainerConfig",
        ['secret "hf-token" not found'],
    ),
    (
        "container-creating-is-fine",
        2,
        deployment(ready=0),
        [waiting_pod("ContainerCreating")],
        "False",
        "WaitingForReplicas",
        "False",
        "AsExpected",
        [],
    ),
]


@pytest.mark.parametrize(
    ("replicas", "deploy", "pods", "ready", "ready_reason", "degraded", "degraded_reason", "words"),
    [pytest.param(*case[1:], id=case[0]) for case in STAGE_CASES],
)
def test_stage_conditions(replicas, deploy, pods, ready, ready_reason, degraded, degraded_reason, words):
    counts, conditions = stage_conditions(omnistage(replicas), deploy, pods)
    by_type = conds(conditions)
    assert (by_type["Ready"].status, by_type["Ready"].reason) == (ready, ready_reason)
    assert (by_type["Degraded"].status, by_type["Degraded"].reason) == (degraded, degraded_reason)
    text = by_type["Degraded"].message + " " + by_type["Ready"].message
    for word in words:
        assert word in text, (word, text)
    if degraded == "True":
        assert by_type["Degraded"].message.startswith("stage thinker:")
        # A stuck rollout stalls rather than claims progress.
        assert (by_type["Progressing"].status, by_type["Progressing"].reason) == ("False", "Stalled")
    if ready == "True":
        assert (by_type["Progressing"].status, by_type["Progressing"].reason) == ("False", "Complete")
    if deploy is not None:
        assert counts == {"replicas": deploy["status"]["replicas"], "readyReplicas": deploy["status"]["readyReplicas"]}


def test_stage_never_ready_while_old_pods_serve_whatever_the_ready_count():
    for old in range(1, 4):
        _, conditions = stage_conditions(omnistage(2), deployment(replicas=2 + old, updated=2, ready=2 + old), [])
        assert conds(conditions)["Ready"].status == "False", old


def test_stage_without_a_deployment_reports_zero_replicas():
    counts, conditions = stage_conditions(omnistage(3), None, [])
    assert counts == {"replicas": 0, "readyReplicas": 0}
    assert conds(conditions)["Progressing"].status == "True"


# --- pipeline_conditions ----------------------------------------------------------------------------


def stage_obj(
    stage: str,
    *,
    replicas: int = 1,
    ready_replicas: int | None = None,
    ready: bool = True,
    generation: int = 1,
    observed: int | None = None,
    degraded: tuple[str, str] | None = None,
) -> dict[str, Any]:
    conditions = [{"type": "Ready", "status": "True" if ready else "False", "reason": "Available"}]
    if degraded:
        conditions.append({"type": "Degraded", "status": "True", "reason": degraded[0], "message": degraded[1]})
    return {
        "metadata": {"name": f"p-{stage}", "generation": generation},
        "spec": {"stage": stage, "replicas": replicas},
        "status": {
            "observedGeneration": generation if observed is None else observed,
            "readyReplicas": replicas if ready_replicas is None else ready_replicas,
            "conditions": conditions,
        },
    }


def router_obj(*, available: int = 1, replicas: int = 1) -> dict[str, Any]:
    return {
        "metadata": {"name": "p-router", "generation": 1},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": 1,
            "replicas": replicas,
            "updatedReplicas": replicas,
            "availableReplicas": available,
        },
    }


NAMES = ["thinker", "talker", "code2wav"]
GROUPS = {"code2wav": "talker"}


def observe(stages: list[dict[str, Any]], **kwargs: Any) -> tuple[list[dict], str, dict[str, Condition]]:
    kwargs.setdefault("router", router_obj())
    per_stage, ready, conditions = pipeline_conditions(
        PipelineObservation(stages=stages, stage_names=NAMES, groups=GROUPS, **kwargs)
    )
    return per_stage, ready, conds(conditions)


def test_all_stages_and_router_ready():
    _, ready, by_type = observe([stage_obj("thinker"), stage_obj("talker")])
    assert ready == "3/3"
    assert (by_type["Ready"].status, by_type["Ready"].reason) == ("True", "Available")
    assert "3/3" in by_type["Ready"].message
    assert (by_type["Progressing"].status, by_type["Degraded"].status) == ("False", "False")


def test_a_stage_that_has_not_observed_its_generation_is_not_ready():
    stages = [stage_obj("thinker", generation=2, observed=1), stage_obj("talker")]
    _, ready, by_type = observe(stages)
    assert ready == "2/3"
    assert by_type["Ready"].status == "False"
    assert "thinker" in by_type["Ready"].message and "talker" not in by_type["Ready"].message
    assert (by_type["Progressing"].status, by_type["Progressing"].reason) == ("True", "RollingOut")


def test_a_stage_without_status_is_not_ready():
    stage = stage_obj("thinker")
    del stage["status"]
    _, ready, by_type = observe([stage, stage_obj("talker")])
    assert ready == "2/3" and by_type["Ready"].status == "False"


def test_a_colocated_stage_follows_its_pod_group():
    _, ready, by_type = observe([stage_obj("thinker"), stage_obj("talker", ready=False)])
    assert ready == "1/3"  # talker and code2wav share the talker pods
    assert "talker, code2wav" in by_type["Ready"].message


def test_a_missing_router_or_unavailable_router_keeps_the_pipeline_not_ready():
    for router in (None, router_obj(available=0)):
        observation = PipelineObservation(
            stages=[stage_obj("thinker"), stage_obj("talker")], stage_names=NAMES, groups=GROUPS, router=router
        )
        _, ready, conditions = pipeline_conditions(observation)
        by_type = conds(conditions)
        assert ready == "3/3"
        assert by_type["Ready"].status == "False" and "router" in by_type["Ready"].message


def test_a_degraded_stage_degrades_the_pipeline_with_its_reason():
    message = "stage thinker: no node has enough free nvidia.com/gpu for a replica"
    stages = [stage_obj("thinker", ready=False, degraded=("InsufficientAccelerator", message)), stage_obj("talker")]
    _, _, by_type = observe(stages)
    assert (by_type["Degraded"].status, by_type["Degraded"].reason) == ("True", "InsufficientAccelerator")
    assert by_type["Degraded"].message == message
    assert (by_type["Ready"].status, by_type["Ready"].reason) == ("False", "InsufficientAccelerator")
    assert (by_type["Progressing"].status, by_type["Progressing"].reason) == ("False", "Stalled")


def test_a_spec_problem_degrades_the_pipeline_and_it_is_not_ready_even_with_every_stage_ready():
    problem = Condition("Degraded", "True", "InvalidSpec", "stages[3].name: pipeline 'qwen3-omni' has no stage 'x'")
    _, _, by_type = observe([stage_obj("thinker"), stage_obj("talker")], spec_problem=problem)
    assert (by_type["Degraded"].status, by_type["Degraded"].reason) == ("True", "InvalidSpec")
    assert by_type["Degraded"].message == problem.message
    assert (by_type["Ready"].status, by_type["Ready"].reason) == ("False", "InvalidSpec")
    assert problem.message in by_type["Ready"].message


def test_a_spec_problem_outranks_a_degraded_stage():
    problem = Condition("Degraded", "True", "InvalidSpec", "bad")
    stages = [stage_obj("thinker", ready=False, degraded=("CrashLoop", "crashing")), stage_obj("talker")]
    _, _, by_type = observe(stages, spec_problem=problem)
    assert by_type["Degraded"].reason == "InvalidSpec"
    assert by_type["Ready"].status == "False"


def test_per_stage_replicas_report_the_pod_groups_replicas_for_colocated_stages():
    stages = [
        stage_obj("thinker", replicas=2, ready_replicas=1, ready=False),
        stage_obj("talker", replicas=3, ready_replicas=3),
    ]
    per_stage, _, _ = observe(stages)
    assert per_stage == [
        {"name": "thinker", "replicas": 2, "readyReplicas": 1},
        {"name": "talker", "replicas": 3, "readyReplicas": 3},
        {"name": "code2wav", "replicas": 3, "readyReplicas": 3},
    ]


def test_a_stage_not_created_yet_reports_zero_and_is_waited_for():
    per_stage, ready, by_type = observe([stage_obj("thinker")])
    assert per_stage[1:] == [
        {"name": "talker", "replicas": 0, "readyReplicas": 0},
        {"name": "code2wav", "replicas": 0, "readyReplicas": 0},
    ]
    assert ready == "1/3" and by_type["Ready"].status == "False"


def test_the_operator_exports_each_stages_desired_replicas_until_the_stage_goes() -> None:
    """omnikube_operator_stage_replicas_desired, which OmnikubeStageDown compares with the replicas the
    routers see: one series per pipeline stage (a colocated stage under its group's count), following
    spec.replicas as an autoscaler changes it through /scale, removed when the OmniStage goes."""
    metrics = OperatorMetrics()

    def desired() -> dict[tuple[str, str, str], float]:
        return {
            (s.labels["namespace"], s.labels["pipeline"], s.labels["stage"]): s.value
            for family in metrics.registry.collect()
            for s in family.samples
            if s.name == STAGE_REPLICAS_DESIRED
        }

    talker = {"spec": {"pipeline": "omni", "stage": "talker", "colocated": ["code2wav"], "replicas": 2}}
    metrics.observe_stage("ai", "omni-talker", talker)
    metrics.observe_stage("ai", "omni-thinker", {"spec": {"pipeline": "omni", "stage": "thinker"}})
    assert desired() == {("ai", "omni", "talker"): 2, ("ai", "omni", "code2wav"): 2, ("ai", "omni", "thinker"): 1}
    talker["spec"]["replicas"] = 0  # scaled to zero through /scale
    metrics.observe_stage("ai", "omni-talker", talker)
    assert desired()[("ai", "omni", "code2wav")] == 0
    metrics.observe_stage("ai", "omni-talker", None)
    assert desired() == {("ai", "omni", "thinker"): 1}
    metrics.forget_stages()  # the Lease lost: the new leader exports them
    assert desired() == {}
