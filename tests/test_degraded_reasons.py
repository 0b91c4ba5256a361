"""Degraded reasons are typed values raised where the problem is found, one test per reason.

Spec problems come from the real resolver (`resolve_cluster_pipeline` over the built-in registry) as
`SpecError` subclasses; pod problems from pod statuses as the API server reports them. No message is
searched for a word anywhere on the way.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from omni_operator.api import OmniPipeline
from omni_operator.render import RenderError, render_pipeline
from omni_operator.resolve import resolve_cluster_pipeline
from omni_operator.status.conditions import Condition
from omni_operator.status.pipeline_status import PipelineObservation, pipeline_conditions, spec_problem
from omni_operator.status.reasons import Reason
from omni_operator.status.stage_status import pod_problem
from omni_runtime.metrics import REGISTRY as METRICS
from omni_runtime.registry import default_registry
from omni_runtime.spec import SpecError
from omni_runtime.stage.termination import Termination

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = default_registry()


def problem_of(**spec: Any) -> Condition:
    manifest = {
        "apiVersion": "omnikube.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": "p", "namespace": "apps"},
        "spec": {"model": "some/model", "pipeline": "prompt-enhanced-t2i", **spec},
    }
    try:
        resolve_cluster_pipeline(OmniPipeline.model_validate(manifest), REGISTRY)
    except (ValidationError, SpecError) as exc:
        return spec_problem(exc)
    raise AssertionError(f"{spec} resolved without a problem")


@pytest.mark.parametrize(
    ("spec", "reason", "words"),
    [
        ({"pipeline": "no-such-pipeline"}, Reason.UNKNOWN_PIPELINE, ["no-such-pipeline"]),
        ({"stages": [{"name": "painter"}]}, Reason.UNKNOWN_STAGE, ["painter", "enhancer"]),
        (
            {"stages": [{"name": "dit", "colocateWith": "painter"}]},
            Reason.UNKNOWN_STAGE,
            ["colocateWith", "painter"],
        ),
        (
            {"connectors": {"edges": [{"from": "dit", "to": "enhancer", "kind": "mooncake"}]}},
            Reason.UNKNOWN_EDGE,
            ["dit->enhancer", "enhancer->dit"],
        ),
        (
            {"connectors": {"edges": [{"from": "enhancer", "to": "dit", "kind": "shm"}]}},
            Reason.NO_USABLE_CONNECTOR,
            ["shm", "colocateWith"],
        ),
        (
            {"stages": [{"name": "dit", "colocateWith": "enhancer"}, {"name": "enhancer", "colocateWith": "dit"}]},
            Reason.INVALID_TOPOLOGY,
            ["loop"],
        ),
        ({"stages": [{"name": "dit", "replicas": -1}]}, Reason.INVALID_SPEC, ["replicas"]),
        (
            {"pipeline": "stable-diffusion-3", "stages": [{"name": "dit", "engineArgs": {"quantization": "fp9"}}]},
            Reason.INVALID_ENGINE_ARGS,
            ["stage 'dit'", "quantization", "'fp9'", "'fp8'"],
        ),
        (
            {"pipeline": "qwen3-omni", "stages": [{"name": "code2wav", "engineArgs": {"enforce_eager": True}}]},
            Reason.INVALID_ENGINE_ARGS,
            ["stage 'code2wav'", "enforce_eager", "qwen3_omni_code2wav", "left_context"],
        ),
    ],
    ids=[
        "unknown-pipeline",
        "unknown-stage",
        "unknown-colocate",
        "unknown-edge",
        "shm-across-pods",
        "loop",
        "invalid",
        "engine-arg-value",
        "engine-arg-a-runner-does-not-read",
    ],
)
def test_each_spec_problem_has_its_own_reason(spec: dict, reason: Reason, words: list[str]) -> None:
    cond = problem_of(**spec)
    assert (cond.type, cond.status, cond.reason) == ("Degraded", "True", reason)
    for word in words:
        assert word in cond.message


def test_an_invalid_engine_arg_degrades_the_pipeline_before_anything_is_built() -> None:
    """The reconcile's own path: resolving raises, so no OmniStage, Deployment or pod is made for the pipeline
    (the cluster tier checks the same against a real API server: test_operator_cluster's
    test_an_invalid_engine_arg_is_degraded_and_starts_no_pod)."""
    manifest = {
        "apiVersion": "omnikube.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": "sd3", "namespace": "apps"},
        "spec": {
            "model": "some/model",
            "pipeline": "stable-diffusion-3",
            "stages": [{"name": "dit", "engineArgs": {"quantization": "fp9"}}],
        },
    }
    with pytest.raises(SpecError) as info:
        resolve_cluster_pipeline(OmniPipeline.model_validate(manifest), REGISTRY)
    _, _, conditions = pipeline_conditions(PipelineObservation(spec_problem=spec_problem(info.value)))
    by_type = {c.type: c for c in conditions}
    assert (by_type["Degraded"].status, by_type["Degraded"].reason) == ("True", Reason.INVALID_ENGINE_ARGS)
    assert "stage 'dit'" in by_type["Degraded"].message and "quantization" in by_type["Degraded"].message
    assert (by_type["Ready"].status, by_type["Ready"].reason) == ("False", Reason.INVALID_ENGINE_ARGS)
    with pytest.raises(RenderError, match="quantization"):
        render_pipeline(manifest, REGISTRY)  # `omnikube render` builds nothing either


def test_every_spec_error_reason_is_a_known_reason() -> None:
    def subclasses(cls: type) -> list[type]:
        return [cls, *(s for sub in cls.__subclasses__() for s in subclasses(sub))]

    import omni_runtime.registry  # noqa: F401 - its errors are SpecError subclasses too

    for cls in subclasses(SpecError):
        assert Reason(cls.reason), cls


def test_the_resolver_the_stage_and_the_operator_share_one_reason_vocabulary() -> None:
    """A reason is spelled once (spec/reasons.py): what the resolver raises and what a stage exits with are
    the operator's own `Reason` members, carried as they are, not strings that happen to match."""
    import omni_runtime.spec.reasons as spec_reasons
    from omni_runtime.registry.errors import ModelFilesNotFound, RegistryError
    from omni_runtime.spec import NoUsableConnector, UnknownEdge, UnknownStage

    assert Reason is spec_reasons.Reason
    assert SpecError.reason is Reason.INVALID_TOPOLOGY and UnknownStage.reason is Reason.UNKNOWN_STAGE
    assert UnknownEdge.reason is Reason.UNKNOWN_EDGE and NoUsableConnector.reason is Reason.NO_USABLE_CONNECTOR
    assert RegistryError.reason is Reason.UNKNOWN_PIPELINE and ModelFilesNotFound.reason is Reason.MODEL_FILES_NOT_FOUND
    told = Termination.parse(CONNECTOR_MESSAGE)
    assert told is not None and told.reason is Reason.CONNECTOR_UNAVAILABLE
    # a stage exits with a stage's reasons only: a spec reason in a termination message is not one
    assert Termination.parse('{"reason": "UnknownStage", "message": "m"}') is None
    with pytest.raises(ValidationError):
        Termination(reason=Reason.UNKNOWN_STAGE, message="m")  # type: ignore[arg-type]


def test_a_condition_refuses_a_reason_that_is_not_in_the_vocabulary() -> None:
    with pytest.raises(ValueError, match="NoSuchReason"):
        Condition("Degraded", "True", "NoSuchReason")  # type: ignore[arg-type]
    assert Condition("Degraded", "True", "UnknownEdge").reason is Reason.UNKNOWN_EDGE  # type: ignore[arg-type]


# --- pods -------------------------------------------------------------------------------------------


def pod(container: dict[str, Any], phase: str = "Running") -> dict[str, Any]:
    return {"metadata": {"name": "p-enhancer-abc"}, "status": {"phase": phase, "containerStatuses": [container]}}


def terminated(message: str, *, ready: bool = False, waiting: str = "CrashLoopBackOff") -> dict[str, Any]:
    return {
        "name": "enhancer",
        "ready": ready,
        "restartCount": 2,
        "state": {"running": {}} if ready else {"waiting": {"reason": waiting, "message": "back-off 10s"}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": message}},
    }


CONNECTOR_MESSAGE = Termination(
    reason=Reason.CONNECTOR_UNAVAILABLE,
    message="connector 'mooncake' (edges enhancer->dit) did not start in 120s (40 attempts): could not start "
    "the Mooncake transfer engine as 10.0.0.7:15000 (metadata http://p-mooncake.apps.svc:8080/metadata)",
).dumps()


def test_a_stage_that_says_its_connector_is_unavailable_is_degraded_with_that_reason_and_the_address() -> None:
    cond = pod_problem([pod(terminated(CONNECTOR_MESSAGE))], "enhancer")
    assert cond is not None and cond.reason is Reason.CONNECTOR_UNAVAILABLE
    assert "stage enhancer" in cond.message
    assert "http://p-mooncake.apps.svc:8080/metadata" in cond.message


def test_the_connector_reason_also_comes_from_a_container_that_just_exited() -> None:
    status = terminated(CONNECTOR_MESSAGE)
    status["state"] = {"terminated": status.pop("lastState")["terminated"]}
    cond = pod_problem([pod(status)], "enhancer")
    assert cond is not None and cond.reason is Reason.CONNECTOR_UNAVAILABLE


def test_a_container_that_serves_again_is_not_degraded_by_its_last_exit() -> None:
    assert pod_problem([pod(terminated(CONNECTOR_MESSAGE, ready=True))], "enhancer") is None


def test_a_stage_whose_engine_cannot_serve_says_what_to_change() -> None:
    message = (
        "stage dit: engine failed to load: stage 'dit': the self-check (one denoising step of FluxPipeline on cpu "
        "in torch.bfloat16) failed, so every request would fail: ...; set the stage's engine_args torch_dtype: float32"
    )
    told = Termination(reason=Reason.ENGINE_FAILED, message=message).dumps()
    cond = pod_problem([pod(terminated(told))], "dit")
    assert cond is not None and cond.reason is Reason.ENGINE_FAILED
    assert "every request would fail" in cond.message and "torch_dtype: float32" in cond.message


def test_a_crash_with_a_plain_log_tail_stays_a_crash_loop() -> None:
    cond = pod_problem([pod(terminated("Traceback ... ConnectorUnavailable ... mooncake"))], "enhancer")
    assert cond is not None and cond.reason is Reason.CRASH_LOOP  # words in a log never choose the reason


def test_a_termination_message_longer_than_the_kubelet_keeps_still_parses() -> None:
    text = Termination(reason=Reason.CONNECTOR_UNAVAILABLE, message="x" * 4000 + " tail").dumps()
    assert len(text.encode()) <= 4096
    told = Termination.parse(text)
    assert told is not None and told.message.endswith(" tail")
    assert Termination.parse("not json") is None and Termination.parse('{"reason": "Other"}') is None


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ('persistentvolumeclaim "models" not found', Reason.MODEL_CACHE_MISSING),
        ("0/3 nodes are available: 3 Insufficient nvidia.com/gpu.", Reason.INSUFFICIENT_ACCELERATOR),
        ("0/3 nodes are available: 3 node(s) didn't match Pod's node affinity.", Reason.UNSCHEDULABLE),
    ],
)
def test_scheduler_problems_have_their_reasons(message: str, reason: Reason) -> None:
    pending = {
        "metadata": {"name": "p-dit-abc"},
        "status": {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}],
        },
    }
    cond = pod_problem([pending], "dit")
    assert cond is not None and cond.reason is reason


@pytest.mark.parametrize(
    ("waiting", "reason"),
    [("ImagePullBackOff", Reason.IMAGE_PULL), ("CreateContainerConfigError", Reason.CONTAINER_CONFIG)],
)
def test_container_problems_have_their_reasons(waiting: str, reason: Reason) -> None:
    status = {"name": "dit", "ready": False, "state": {"waiting": {"reason": waiting, "message": "m"}}}
    cond = pod_problem([pod(status, phase="Pending")], "dit")
    assert cond is not None and cond.reason is reason


# --- pipeline ---------------------------------------------------------------------------------------


def stage(reason: str) -> dict[str, Any]:
    return {
        "metadata": {"name": "p-enhancer", "generation": 1},
        "spec": {"stage": "enhancer", "replicas": 1},
        "status": {
            "observedGeneration": 1,
            "conditions": [
                {"type": "Ready", "status": "False", "reason": "WaitingForReplicas"},
                {"type": "Degraded", "status": "True", "reason": reason, "message": "m"},
            ],
        },
    }


def pipeline_degraded(reason: str) -> Condition:
    _, _, conditions = pipeline_conditions(PipelineObservation(stages=[stage(reason)], stage_names=["enhancer"]))
    return next(c for c in conditions if c.type == "Degraded")


def test_the_pipeline_carries_a_stages_connector_reason() -> None:
    assert pipeline_degraded("ConnectorUnavailable").reason is Reason.CONNECTOR_UNAVAILABLE


def test_a_stage_reason_this_operator_does_not_know_reads_stage_degraded() -> None:
    assert pipeline_degraded("SomethingNewer").reason is Reason.STAGE_DEGRADED


# --- descriptions -----------------------------------------------------------------------------------


def test_every_metric_a_crd_description_names_exists() -> None:
    names = {m.name for m in METRICS.collect()} | {s.name for m in METRICS.collect() for s in m.samples}
    text = "\n".join(p.read_text() for p in sorted((ROOT / "crds").glob("*.yaml")))
    named = set(re.findall(r"\bomnikube_[a-z0-9_]+", text))
    assert named, "the autoscaling description should name the metric it scales on"
    assert named <= names, f"descriptions name metrics that do not exist: {sorted(named - names)}"
