"""How stage and router pods stop: terminationGracePeriodSeconds from the CRD reaches the pods, the
processes get a drain budget inside it (`--drain-timeout`, parsed by the real command-line parser),
and only the router has a preStop sleep (see operator/omni_operator/builders/drain.py for why)."""

from __future__ import annotations

from typing import Any

import pytest

from omni_operator.builders.drain import drain_timeout, router_pre_stop
from omni_operator.render import render_pipeline
from omni_runtime.cli import build_parser
from omni_runtime.registry import default_registry


def render(**spec: Any) -> list[dict[str, Any]]:
    manifest = {
        "apiVersion": "omnikube.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": "p"},
        "spec": {"model": "some/model", "pipeline": "prompt-enhanced-t2i", **spec},
    }
    return render_pipeline(manifest, default_registry())


def pods(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Pod spec of each Deployment, by component (`router` or the stage name)."""
    out = {}
    for o in objects:
        if o["kind"] == "Deployment":
            labels = o["metadata"]["labels"]
            out[labels.get("omnikube.io/stage", "router")] = o["spec"]["template"]["spec"]
    return out


def parsed(container: dict[str, Any]):
    return build_parser().parse_args(container["command"][1:])


def test_by_default_pods_get_120s_and_the_processes_drain_within_it() -> None:
    found = pods(render())
    for stage in ("enhancer", "dit"):
        pod = found[stage]
        assert pod["terminationGracePeriodSeconds"] == 120
        assert parsed(pod["containers"][0]).drain_timeout == 115
        assert "lifecycle" not in pod["containers"][0], "a stage pod needs no preStop hook"
    router = found["router"]
    assert router["terminationGracePeriodSeconds"] == 120
    (container,) = [c for c in router["containers"] if c["name"] == "router"]
    assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    assert parsed(container).drain_timeout == 110


def test_grace_periods_set_per_stage_and_for_the_router_reach_their_pods() -> None:
    found = pods(
        render(
            stages=[{"name": "dit", "terminationGracePeriodSeconds": 30}],
            router={"terminationGracePeriodSeconds": 600},
        )
    )
    assert found["dit"]["terminationGracePeriodSeconds"] == 30
    assert parsed(found["dit"]["containers"][0]).drain_timeout == 25
    assert found["enhancer"]["terminationGracePeriodSeconds"] == 120, "other stages keep the default"
    router = found["router"]
    assert router["terminationGracePeriodSeconds"] == 600
    assert parsed(router["containers"][0]).drain_timeout == 590


def test_a_colocated_group_stops_with_its_root_stages_grace_period() -> None:
    found = pods(
        render(
            pipeline="qwen3-omni",
            stages=[
                {"name": "talker", "terminationGracePeriodSeconds": 300},
                {"name": "code2wav", "colocateWith": "talker"},
            ],
        )
    )
    pod = found["talker"]
    assert pod["terminationGracePeriodSeconds"] == 300
    assert [parsed(c).drain_timeout for c in pod["containers"]] == [295, 295]


@pytest.mark.parametrize(
    ("grace", "pre_stop", "router_drain", "stage_drain"),
    [(1, 0, 1, 1), (4, 1, 3, 3), (8, 2, 5, 6), (30, 5, 20, 25), (120, 5, 110, 115), (3600, 5, 3590, 3595)],
)
def test_drain_budgets_leave_time_to_stop_inside_the_grace_period(grace, pre_stop, router_drain, stage_drain) -> None:
    assert router_pre_stop(grace) == pre_stop
    assert drain_timeout(grace, pre_stop) == router_drain
    assert drain_timeout(grace) == stage_drain
    assert pre_stop + router_drain <= grace and stage_drain <= grace
