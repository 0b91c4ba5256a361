"""The pipeline spec: every validation with its message, and resolve_pipeline's overrides."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import ValidationError

from omni_runtime.spec import (
    INPUT_PROCESSORS,
    ConnectorKind,
    ConnectorsSpec,
    EdgeOverride,
    MooncakeMasterAddress,
    PipelineSpec,
    Placement,
    PodGroups,
    ResolvedPipeline,
    SpecError,
    StageDiscovery,
    StageOverride,
    resolve_pipeline,
)


def stage(name: str, kind: str = "ar", **fields: Any) -> dict[str, Any]:
    return {"name": name, "kind": kind, **fields}


def pipeline(stages: list[dict[str, Any]], edges: list[tuple[str, str] | dict[str, Any]] = (), **fields: Any):
    """A pipeline dict; the last stage is the final output unless a stage says otherwise."""
    stages = [dict(s) for s in stages]
    if not any("final_output" in s for s in stages):
        stages[-1]["final_output"] = True
    edge_dicts = [e if isinstance(e, dict) else {"from": e[0], "to": e[1]} for e in edges]
    return {"name": "p", "stages": stages, "edges": edge_dicts, **fields}


def chain(*names: str) -> PipelineSpec:
    """a -> b -> c ..., every stage ar, the last one final."""
    edges = [(a, b) for a, b in zip(names, names[1:], strict=False)]
    return PipelineSpec.model_validate(pipeline([stage(n) for n in names], edges))


# --- topology validation ---------------------------------------------------------------------------

INVALID = [
    pytest.param(
        pipeline([stage("a"), stage("a")]),
        "stages[1].name: 'a' is used by another stage; stage names must be unique",
        id="duplicate-stage-name",
    ),
    pytest.param(
        pipeline([stage("a"), stage("b"), stage("c")], [("a", "b"), ("b", "c"), ("c", "a")]),
        "edges: the stages form a cycle (a -> b -> c -> a); remove one edge of it",
        id="cycle",
    ),
    pytest.param(
        pipeline([stage("c"), stage("a"), stage("b")], [("a", "b"), ("b", "a")]),
        "the stages form a cycle (a -> b -> a)",
        id="cycle-beside-a-free-stage",
    ),
    pytest.param(
        pipeline([stage("a"), stage("b"), stage("c")], [("a", "b"), ("b", "a"), ("b", "c")]),
        "the stages form a cycle (a -> b -> a)",
        id="cycle-with-a-branch-leaving-it",
    ),
    pytest.param(
        pipeline([stage("a"), stage("b")], [("x", "b")]),
        "edges[0].from: no stage is named 'x'; known stages are ['a', 'b']",
        id="unknown-edge-source",
    ),
    pytest.param(
        pipeline([stage("a"), stage("b")], [("a", "y")]),
        "edges[0].to: no stage is named 'y'; known stages are ['a', 'b']",
        id="unknown-edge-target",
    ),
    pytest.param(
        pipeline([stage("a")], [("a", "a")]),
        "edges[0]: stage 'a' cannot feed itself",
        id="self-edge",
    ),
    pytest.param(
        pipeline([stage("a"), stage("b")], [("a", "b"), ("a", "b")]),
        "edges[1]: the edge a -> b is declared twice",
        id="duplicate-edge",
    ),
    pytest.param(
        pipeline([stage("a", final_output=False)]),
        "stages: no stage has final_output: true, so a request would return nothing",
        id="no-final-output",
    ),
    pytest.param(
        pipeline([stage("a"), stage("b")], [{"from": "a", "to": "b", "input_processor": "magic"}]),
        f"edges[0].input_processor: 'magic' is unknown; use one of {sorted(INPUT_PROCESSORS)}",
        id="unknown-input-processor",
    ),
    pytest.param(
        pipeline([stage("a"), stage("b")], [{"from": "a", "to": "b", "connector": "carrier-pigeon"}]),
        "Input should be 'inline', 'shm' or 'mooncake'",
        id="unknown-connector-kind",
    ),
    pytest.param(
        pipeline([stage("dit", "diffusion", companions=[{"role": "cfg_text"}], output_modality="image")]),
        "stage 'dit': companions are only supported on ar stages, not diffusion",
        id="companions-on-diffusion",
    ),
    pytest.param(
        pipeline([stage("gen", "generation", companions=[{}], output_modality="audio")]),
        "companions are only supported on ar stages, not generation",
        id="companions-on-generation",
    ),
    pytest.param(
        pipeline([stage("a", output_modality="hidden")]),
        "stage 'a': a final output cannot have output_modality 'hidden'",
        id="hidden-final-output",
    ),
    pytest.param(
        {**pipeline([stage("a")]), "name": "qwen2.5-omni"},
        "String should match pattern",
        id="dotted-pipeline-name",
    ),
    pytest.param(
        pipeline([stage("Thinker")]),
        "String should match pattern",
        id="upper-case-stage-name",
    ),
    pytest.param({"name": "p", "stages": []}, "at least 1 item", id="no-stages"),
    pytest.param(
        pipeline([stage("a"), stage("b")], [{"from": "a", "to": "b", "window": -1}]),
        "greater than or equal to 0",
        id="negative-window",
    ),
    pytest.param(
        pipeline([stage("a", kind="encoder")]),
        "Input should be 'ar', 'diffusion' or 'generation'",
        id="unknown-stage-kind",
    ),
    pytest.param(
        pipeline([stage("a", gpu=1)]),
        "Extra inputs are not permitted",
        id="unknown-field",
    ),
]


@pytest.mark.parametrize(("data", "message"), INVALID)
def test_invalid_pipeline_is_rejected_with_message(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        PipelineSpec.model_validate(data)


def test_all_topology_problems_are_reported_together() -> None:
    data = pipeline(
        [stage("a", final_output=False), stage("a", final_output=False)],
        [("a", "x"), {"from": "a", "to": "a", "input_processor": "nope"}],
    )
    with pytest.raises(ValidationError) as info:
        PipelineSpec.model_validate(data)
    text = str(info.value)
    for part in (
        "stages[1].name",
        "edges[0].to",
        "edges[1]: stage 'a' cannot feed itself",
        "edges[1].input_processor",
        "no stage has final_output",
    ):
        assert part in text


def test_spec_errors_are_value_errors() -> None:
    # Callers catch ValueError for both pydantic validation and SpecError.
    assert issubclass(SpecError, ValueError)
    assert issubclass(ValidationError, ValueError)


def test_edges_accept_from_and_to_and_field_names() -> None:
    by_alias = PipelineSpec.model_validate(pipeline([stage("a"), stage("b")], [("a", "b")]))
    by_name = PipelineSpec.model_validate(
        {**pipeline([stage("a"), stage("b")]), "edges": [{"source": "a", "target": "b"}]}
    )
    assert by_alias.edges == by_name.edges
    dumped = by_alias.model_dump(by_alias=True, mode="json")
    assert dumped["edges"][0]["from"] == "a" and dumped["edges"][0]["to"] == "b"
    assert PipelineSpec.model_validate(dumped) == by_alias


def test_defaults() -> None:
    spec = PipelineSpec.model_validate(pipeline([stage("a")]))
    a = spec.stage("a")
    assert a.input_modalities == ["text"] and a.output_modality == "text"
    assert a.engine_args == {} and a.sampling_params == {} and a.companions == []
    assert spec.connectors.default is ConnectorKind.INLINE
    assert spec.edges == []


def test_companion_on_ar_stage_is_accepted() -> None:
    spec = PipelineSpec.model_validate(
        pipeline(
            [
                stage("enhancer", companions=[{"negative_prompt": "blurry"}]),
                stage("dit", "diffusion", output_modality="image"),
            ],
            [{"from": "enhancer", "to": "dit", "input_processor": "ar_text_to_prompt"}],
        )
    )
    companion = spec.stage("enhancer").companions[0]
    assert (companion.role, companion.negative_prompt) == ("cfg_text", "blurry")


def test_stage_lookup_names_the_known_stages() -> None:
    spec = chain("a", "b")
    assert spec.stage("b").name == "b"
    with pytest.raises(SpecError, match=re.escape("pipeline 'p' has no stage 'z'; its stages are ['a', 'b']")):
        spec.stage("z")


def test_edge_connector_falls_back_to_the_pipeline_default() -> None:
    spec = PipelineSpec.model_validate(
        pipeline(
            [stage("a"), stage("b"), stage("c")],
            [("a", "b"), {"from": "b", "to": "c", "connector": "mooncake"}],
            connectors={"default": "inline"},
        )
    )
    assert [spec.edge_connector(e) for e in spec.edges] == [ConnectorKind.INLINE, ConnectorKind.MOONCAKE]


# --- graph queries ---------------------------------------------------------------------------------

GRAPHS = [
    pytest.param(["a"], [], ["a"], ["a"], id="single"),
    pytest.param(["a", "b", "c"], [("a", "b"), ("b", "c")], ["a", "b", "c"], ["a"], id="chain"),
    pytest.param(["c", "b", "a"], [("a", "b"), ("b", "c")], ["a", "b", "c"], ["a"], id="chain-declared-backwards"),
    pytest.param(
        ["a", "b", "c", "d"],
        [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")],
        ["a", "b", "c", "d"],
        ["a"],
        id="diamond",
    ),
    pytest.param(
        ["a", "b", "c", "d"],
        [("a", "d"), ("b", "c")],
        ["a", "b", "c", "d"],
        ["a", "b"],
        id="ties-keep-declaration-order",
    ),
    pytest.param(["x", "y", "z"], [("y", "z"), ("x", "z")], ["x", "y", "z"], ["x", "y"], id="fan-in"),
]


@pytest.mark.parametrize(("names", "edges", "order", "entries"), GRAPHS)
def test_topological_order_and_entry_stages(names, edges, order, entries) -> None:
    spec = PipelineSpec.model_validate(pipeline([stage(n, final_output=(n == order[-1])) for n in names], edges))
    assert spec.topological_order() == order
    assert spec.entry_stages() == entries


def test_upstream_and_downstream() -> None:
    spec = chain("a", "b", "c")
    assert [(e.source, e.target) for e in spec.downstream("a")] == [("a", "b")]
    assert [(e.source, e.target) for e in spec.upstream("c")] == [("b", "c")]
    assert spec.upstream("a") == [] and spec.downstream("c") == []


# --- resolve_pipeline ------------------------------------------------------------------------------


def omni() -> PipelineSpec:
    return PipelineSpec.model_validate(
        pipeline(
            [
                stage(
                    "thinker",
                    engine_args={"gpu_memory_utilization": 0.6, "enforce_eager": True},
                    sampling_params={"temperature": 0.4, "max_tokens": 2048},
                    final_output=True,
                ),
                stage("talker", output_modality="hidden"),
                stage("code2wav", "generation", output_modality="audio", final_output=True),
            ],
            [
                {"from": "thinker", "to": "talker", "input_processor": "thinker_to_talker"},
                {"from": "talker", "to": "code2wav", "input_processor": "talker_to_code2wav", "window": 25},
            ],
            name="omni",
        )
    )


def resolve(**kwargs: Any) -> ResolvedPipeline:
    return resolve_pipeline(omni(), name="demo", model="/models/omni", **kwargs)


RESOLVE_ERRORS = [
    pytest.param(
        {"stages": [StageOverride(name="vocoder")]},
        "stages[0].name: pipeline 'omni' has no stage 'vocoder'; its stages are ['thinker', 'talker', 'code2wav']",
        id="unknown-stage",
    ),
    pytest.param(
        {"stages": [StageOverride(name="thinker"), StageOverride(name="talker", colocate_with="vocoder")]},
        "stages[1].colocateWith: 'vocoder' is not another stage of 'omni'; use one of ['thinker', 'code2wav']",
        id="colocate-with-unknown",
    ),
    pytest.param(
        {"stages": [StageOverride(name="talker", colocate_with="talker")]},
        "stages[0].colocateWith: 'talker' is not another stage of 'omni'; use one of ['thinker', 'code2wav']",
        id="colocate-with-self",
    ),
    pytest.param(
        {
            "stages": [
                StageOverride(name="talker", colocate_with="code2wav"),
                StageOverride(name="code2wav", colocate_with="talker"),
            ]
        },
        "stages: colocateWith forms a loop talker -> code2wav -> talker; break it",
        id="colocate-loop",
    ),
    pytest.param(
        {"edges": [EdgeOverride(source="thinker", target="code2wav", connector=ConnectorKind.MOONCAKE)]},
        "connectors.edges[0]: pipeline 'omni' has no edge thinker->code2wav; "
        "its edges are ['thinker->talker', 'talker->code2wav']",
        id="unknown-edge",
    ),
    pytest.param(
        {"edges": [EdgeOverride(source="talker", target="code2wav", connector=ConnectorKind.SHM)]},
        "edges[1] talker->code2wav: connector 'shm' needs both stages in one pod; set colocateWith on one "
        "of them, or use 'mooncake' or 'inline' for this edge",
        id="shm-across-pods",
    ),
    pytest.param(
        {
            "connectors": ConnectorsSpec(default=ConnectorKind.SHM),
            "stages": [StageOverride(name="code2wav", colocate_with="talker")],
        },
        "edges[0] thinker->talker: connector 'shm' needs both stages in one pod",
        id="shm-default-across-pods",
    ),
]


@pytest.mark.parametrize(("kwargs", "message"), RESOLVE_ERRORS)
def test_resolve_rejects_bad_overrides(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        resolve(**kwargs)


def test_resolve_without_overrides_keeps_the_topology() -> None:
    resolved = resolve()
    assert resolved.topology == omni()
    assert resolved.served_model_name == "/models/omni"
    assert resolved.colocation == {}
    assert [resolved.stage_group(n) for n in resolved.topology.stage_names()] == [
        "thinker",
        "talker",
        "code2wav",
    ]


def test_shm_with_colocation_is_accepted() -> None:
    resolved = resolve(
        stages=[StageOverride(name="code2wav", colocate_with="talker")],
        edges=[EdgeOverride(source="talker", target="code2wav", connector=ConnectorKind.SHM)],
    )
    assert resolved.stage_group("code2wav") == "talker"
    assert resolved.topology.edge_connector(resolved.topology.edges[1]) is ConnectorKind.SHM


def test_shm_default_with_every_stage_in_one_pod_is_accepted() -> None:
    resolved = resolve(
        connectors=ConnectorsSpec(default=ConnectorKind.SHM),
        stages=[
            StageOverride(name="talker", colocate_with="thinker"),
            StageOverride(name="code2wav", colocate_with="thinker"),
        ],
    )
    assert {resolved.stage_group(n) for n in resolved.topology.stage_names()} == {"thinker"}


def test_colocation_chains_collapse_onto_the_root_stage() -> None:
    resolved = resolve(
        stages=[
            StageOverride(name="code2wav", colocate_with="talker"),
            StageOverride(name="talker", colocate_with="thinker"),
        ]
    )
    assert resolved.colocation == {"code2wav": "thinker", "talker": "thinker"}


def test_engine_args_and_sampling_params_are_merged_not_replaced() -> None:
    topology = omni()
    resolved = resolve_pipeline(
        topology,
        name="demo",
        model="/m",
        stages=[
            StageOverride(
                name="thinker",
                engine_args={"tensor_parallel_size": 2, "enforce_eager": False},
                sampling_params={"max_tokens": 64},
            )
        ],
    )
    thinker = resolved.topology.stage("thinker")
    assert thinker.engine_args == {
        "gpu_memory_utilization": 0.6,
        "enforce_eager": False,
        "tensor_parallel_size": 2,
    }
    assert thinker.sampling_params == {"temperature": 0.4, "max_tokens": 64}
    # The registry's topology is left untouched.
    assert topology.stage("thinker").engine_args == {"gpu_memory_utilization": 0.6, "enforce_eager": True}


def test_edge_override_sets_connector_and_window() -> None:
    resolved = resolve(
        edges=[EdgeOverride.model_validate({"from": "talker", "to": "code2wav", "connector": "mooncake", "window": 50})]
    )
    edge = resolved.topology.edges[1]
    assert (edge.connector, edge.window) == (ConnectorKind.MOONCAKE, 50)
    untouched = resolve(edges=[EdgeOverride(source="talker", target="code2wav", connector=ConnectorKind.INLINE)])
    assert untouched.topology.edges[1].window == 25


def test_connectors_override_replaces_the_default() -> None:
    resolved = resolve(connectors=ConnectorsSpec(default=ConnectorKind.MOONCAKE))
    assert {resolved.topology.edge_connector(e) for e in resolved.topology.edges} == {ConnectorKind.MOONCAKE}


def test_resolved_pipeline_round_trips_through_json() -> None:
    resolved = resolve(
        served_model_name="omni",
        stages=[StageOverride(name="code2wav", colocate_with="talker")],
        edges=[EdgeOverride(source="talker", target="code2wav", connector=ConnectorKind.SHM)],
    )
    assert ResolvedPipeline.model_validate_json(resolved.model_dump_json()) == resolved
    assert ResolvedPipeline.model_validate_json(resolved.model_dump_json(by_alias=True)) == resolved


# --- placement: what the caller knows about where the processes run --------------------------------


def by_service(groups: PodGroups) -> dict[str, StageDiscovery]:
    return {
        stage: StageDiscovery(service=root, port=8100 + i)
        for root, members in groups.items()
        for i, stage in enumerate(members)
    }


def test_a_placement_completes_discovery_scale_from_zero_and_the_mooncake_master() -> None:
    asked: list[str] = []

    def master() -> MooncakeMasterAddress:
        asked.append("master")
        return MooncakeMasterAddress(host="mc.ns.svc", master_port=7001)

    connectors = ConnectorsSpec(default=ConnectorKind.MOONCAKE)
    placement = Placement(discovery=by_service, mooncake_master=master, scale_from_zero=frozenset({"talker"}))
    resolved = resolve(
        connectors=connectors, stages=[StageOverride(name="code2wav", colocate_with="talker")], placement=placement
    )
    # each stage found through its pod group, the colocated one on the group's second port
    assert {s: (d.service, d.port) for s, d in resolved.discovery.items()} == {
        "thinker": ("thinker", 8100), "talker": ("talker", 8100), "code2wav": ("talker", 8101),
    }  # fmt: skip
    assert resolved.scale_from_zero == ["talker", "code2wav"]  # the colocated stage goes to zero with its pod
    assert resolved.mooncake_master_host == "mc.ns.svc" and asked == ["master"]
    mooncake = resolved.topology.connectors.mooncake
    assert (mooncake.master_port, mooncake.metadata_port) == (7001, 8080)  # an unset port keeps the spec's
    assert connectors.mooncake.master_port == 50051  # the caller's spec is left as it was


def test_a_placement_is_not_asked_for_a_mooncake_master_no_edge_uses() -> None:
    def master() -> MooncakeMasterAddress:
        raise AssertionError("asked for a Mooncake master although no edge uses mooncake")

    resolved = resolve(placement=Placement(discovery=by_service, mooncake_master=master))
    assert resolved.mooncake_master_host is None and resolved.scale_from_zero == []
    assert resolved.topology.connectors.mooncake.master_port == 50051
