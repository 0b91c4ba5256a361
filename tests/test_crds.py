"""The CRDs: generated from the API models, structural, documented, small; samples and offline validation."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from omni_operator import crdgen
from omni_operator.api import (
    RESOURCES,
    KubeModel,
    OmniPipeline,
    OmniStage,
    parse_quantity,
    quantity_bytes,
    resolve,
    resolve_args,
    validation_messages,
)
from omni_runtime.spec import (
    ConnectorKind,
    ConnectorsSpec,
    EdgeSpec,
    MooncakeProtocol,
    PipelineSpec,
    SpecError,
    StageSpec,
)
from omni_runtime.spec.engine_args import ENGINE_ARGS_MODELS

ROOT = Path(__file__).resolve().parents[1]
CRDS = ROOT / "crds"
SAMPLES = ROOT / "config" / "samples"
SAMPLE_NAMES = ["qwen3-omni.yaml", "qwen-image.yaml", "ascend-chat.yaml", "tiny-chat-cpu.yaml"]


@pytest.fixture(scope="module")
def crds() -> list[dict[str, Any]]:
    return crdgen.crds()


def _schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _walk(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if "items" in node:
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}.*")


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((SAMPLES / name).read_text())


# --- the generated files --------------------------------------------------------------------------


def test_crd_files_are_up_to_date() -> None:
    expected = crdgen.rendered()
    assert sorted(expected) == ["omnipipelines.omnikube.io.yaml", "omnistages.omnikube.io.yaml"]
    for name, text in expected.items():
        path = CRDS / name
        assert path.exists(), f"{path} is missing; run: python -m omni_operator.crdgen --out crds/"
        assert path.read_text() == text, f"{path} is stale; run: python -m omni_operator.crdgen --out crds/"
    assert crdgen.check(CRDS) == []


def test_generation_is_byte_stable(tmp_path: Path) -> None:
    """The generator run in processes with different string-hash seeds writes the same bytes: an output
    that followed a set's or a hash's order would differ between them (one process cannot show it, its
    seed is fixed; test_crd_files_are_up_to_date compares with crds/ under this process's seed only)."""
    seeds = ["1", "2", "3"]
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "omni_operator.crdgen", "--out", str(tmp_path / seed)],
            env={**os.environ, "PYTHONHASHSEED": seed},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in seeds
    ]
    for seed, run in zip(seeds, runs, strict=True):
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, f"PYTHONHASHSEED={seed}: {err}{out}"
    files = {seed: {p.name: p.read_bytes() for p in sorted((tmp_path / seed).iterdir())} for seed in seeds}
    assert sorted(files["1"]) == ["omnipipelines.omnikube.io.yaml", "omnistages.omnikube.io.yaml"]
    for seed in seeds[1:]:
        for name, text in files["1"].items():
            assert files[seed][name] == text, f"{name} differs between PYTHONHASHSEED=1 and {seed}"


def test_check_reports_a_stale_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert crdgen.main(["--out", str(tmp_path)]) == 0
    assert crdgen.main(["--out", str(tmp_path), "--check"]) == 0
    path = tmp_path / "omnistages.omnikube.io.yaml"
    path.write_text(path.read_text().replace("short", "long", 1))
    (tmp_path / "omnipipelines.omnikube.io.yaml").unlink()
    assert crdgen.main(["--out", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert "omnistages.omnikube.io.yaml is stale" in err and "+++ generated" in err
    assert "omnipipelines.omnikube.io.yaml is missing" in err
    assert "python -m omni_operator.crdgen --out" in err


def test_files_are_small() -> None:
    for name, text in crdgen.rendered().items():
        assert len(text.encode()) < 256 * 1024, f"{name} is {len(text)} bytes"


def test_multi_document_stream_parses(crds: list[dict[str, Any]]) -> None:
    assert list(yaml.safe_load_all(crdgen.crds_yaml())) == crds


# --- what the CRDs say ----------------------------------------------------------------------------


def test_names_columns_and_subresources(crds: list[dict[str, Any]]) -> None:
    pipeline, stage = crds
    assert pipeline["metadata"]["name"] == "omnipipelines.omnikube.io"
    assert pipeline["spec"]["names"]["shortNames"] == ["op"]
    assert stage["spec"]["names"]["shortNames"] == ["ost"]
    for crd in crds:
        assert crd["spec"]["group"] == "omnikube.io"
        assert crd["spec"]["scope"] == "Namespaced"
        assert crd["spec"]["names"]["categories"] == ["omnikube"]
        version = crd["spec"]["versions"][0]
        assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
        assert version["subresources"]["status"] == {}
    assert "scale" not in pipeline["spec"]["versions"][0]["subresources"]
    assert stage["spec"]["versions"][0]["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = {c["name"]: c for c in pipeline["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert columns["Ready"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["Stages"]["jsonPath"] == ".status.stagesReady"
    assert columns["Endpoint"]["jsonPath"] == ".status.endpoint"
    assert columns["Age"]["type"] == "date"
    columns = {c["name"]: c for c in stage["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert columns["Ready"]["jsonPath"] == ".status.readyReplicas"
    assert columns["Desired"]["jsonPath"] == ".spec.replicas"
    assert [c for c in columns if not columns[c].get("priority")] == [
        "Pipeline",
        "Stage",
        "Ready",
        "Desired",
        "Age",
    ]


def test_schema_carries_the_bounds(crds: list[dict[str, Any]]) -> None:
    spec = _schema(crds[0])["properties"]["spec"]
    props = spec["properties"]
    assert spec["required"] == ["model"]
    assert props["model"]["minLength"] == 1
    stages = props["stages"]
    assert stages["maxItems"] == 32
    assert stages["x-kubernetes-list-type"] == "map" and stages["x-kubernetes-list-map-keys"] == ["name"]
    stage = stages["items"]["properties"]
    assert stage["name"]["maxLength"] == 40 and stage["name"]["pattern"].startswith("^[a-z0-9]")
    assert stage["replicas"]["minimum"] == 0
    assert stage["accelerator"]["properties"]["type"]["enum"] == [
        "nvidia.com/gpu",
        "huawei.com/Ascend910",
        "amd.com/gpu",
        "none",
    ]
    assert stage["engineArgs"]["x-kubernetes-preserve-unknown-fields"] is True
    assert stage["affinity"]["x-kubernetes-preserve-unknown-fields"] is True
    assert stage["tolerations"]["items"]["properties"]["effect"]["enum"] == [
        "NoSchedule",
        "PreferNoSchedule",
        "NoExecute",
    ]
    quantity = stage["resources"]["properties"]["requests"]["additionalProperties"]
    assert quantity["x-kubernetes-int-or-string"] is True and "type" not in quantity
    service = props["router"]["properties"]["service"]["properties"]
    assert (service["port"]["minimum"], service["port"]["maximum"], service["port"]["default"]) == (
        1,
        65535,
        8000,
    )
    connectors = props["connectors"]["properties"]
    assert connectors["default"]["enum"] == [k.value for k in ConnectorKind]
    assert connectors["edges"]["items"]["properties"]["window"]["minimum"] == 0
    runtime = props["runtime"]["properties"]
    assert (
        runtime["shmSize"]["default"] == "8Gi"
        and runtime["modelCache"]["properties"]["mountPath"]["default"] == "/models"
    )
    assert "hfToken" not in runtime and set(runtime["hfTokenSecret"]["required"]) == {"name", "key"}


def test_schemas_are_structural(crds: list[dict[str, Any]]) -> None:
    forbidden = {
        "$ref",
        "$defs",
        "definitions",
        "anyOf",
        "oneOf",
        "allOf",
        "not",
        "nullable",
        "const",
        "title",
        "uniqueItems",
    }
    for crd in crds:
        root = _schema(crd)
        assert root["type"] == "object"
        assert root["properties"]["metadata"] == {"type": "object"}
        for path, node in _walk(root, crd["spec"]["names"]["kind"]):
            assert not forbidden & node.keys(), f"{path}: {sorted(forbidden & node.keys())}"
            special = node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
            assert "type" in node or special, f"{path} has no type"
            if node.get("x-kubernetes-int-or-string"):
                assert "type" not in node, f"{path}: int-or-string takes no type"
            if node.get("type") == "array":
                assert "items" in node, f"{path}: array without items"
            if node.get("type") == "object":
                assert not ("properties" in node and "additionalProperties" in node), path
            for key in ("exclusiveMinimum", "exclusiveMaximum"):
                assert isinstance(node.get(key, True), bool), f"{path}: {key} must be a boolean in OpenAPI v3.0"
            if node.get("x-kubernetes-list-type") == "map":
                item = node["items"]
                for key in node["x-kubernetes-list-map-keys"]:
                    assert key in item.get("required", []) or "default" in item["properties"][key], (
                        path,
                        key,
                    )
            for rule in node.get("x-kubernetes-validations", []):
                assert set(rule) == {"rule", "message"} and rule["message"]


def test_every_field_is_described(crds: list[dict[str, Any]]) -> None:
    for crd in crds:
        root = _schema(crd)
        for path, node in _walk(root, crd["spec"]["names"]["kind"]):
            if path.endswith(".metadata") or path.endswith("[]") or path.endswith(".*"):
                continue
            assert node.get("description", "").strip(), f"{path} has no description"

    def models(cls: type[KubeModel]) -> Iterator[type[KubeModel]]:
        for sub in cls.__subclasses__():
            yield sub
            yield from models(sub)

    for model in set(models(KubeModel)):
        if not model.__module__.startswith("omni_operator.api"):
            continue
        assert (model.__doc__ or "").strip(), f"{model.__name__} has no docstring"
        for name, field in model.model_fields.items():
            assert (field.description or "").strip(), f"{model.__name__}.{name} has no description"


def test_rules_in_the_schema_are_the_models_rules(crds: list[dict[str, Any]]) -> None:
    in_schema = {
        (r["rule"], r["message"])
        for crd in crds
        for _, node in _walk(_schema(crd), "")
        for r in node.get("x-kubernetes-validations", [])
    }
    in_models = set()
    for resource in RESOURCES:
        for _, node in _walk(crdgen.structural_schema(resource), ""):
            in_models |= {(r["rule"], r["message"]) for r in node.get("x-kubernetes-validations", [])}
    assert in_schema == in_models and len(in_schema) >= 10
    for rule, message in in_schema:
        field = message.split(":", 1)[0]
        assert field and " " not in field, f"message {message!r} should start with the field it names"
        assert "self" in rule


def _engine_args_fields() -> Iterator[tuple[str, Any]]:
    """(model.key, FieldInfo) of every key of every engine args model, nested models' keys too."""
    seen: set[type] = set()
    todo: list[type[BaseModel]] = list(ENGINE_ARGS_MODELS.values())
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, info in model.model_fields.items():
            yield f"{model.__name__}.{name}", info
            todo += [
                a for a in getattr(info.annotation, "__args__", ()) if isinstance(a, type) and issubclass(a, BaseModel)
            ]


def test_the_engine_args_text_is_written_from_every_keys_description(crds: list[dict[str, Any]]) -> None:
    pipeline = next(c for c in crds if c["spec"]["names"]["kind"] == "OmniPipeline")
    text = _schema(pipeline)["properties"]["spec"]["properties"]["stages"]["items"]["properties"]["engineArgs"]
    described = text["description"]
    for key, info in _engine_args_fields():
        assert info.description, f"{key} has no description"
        assert " ".join(info.description.split()).rstrip(".") in described, f"{key} is not in the CRD text"
        assert f"`{key.split('.')[1]}`" in described
    assert "InvalidEngineArgs" in described and "Other keys are refused" in described


# --- samples and conversion -----------------------------------------------------------------------


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_samples_parse(name: str) -> None:
    raw = _load(name)
    pipeline = OmniPipeline.model_validate(raw)
    assert pipeline.metadata.name and pipeline.spec.pipeline
    again = OmniPipeline.model_validate(pipeline.to_dict())
    assert again == pipeline


def test_sample_stage_names_and_placement() -> None:
    def stages(name: str) -> dict[str, Any]:
        return {s.name: s for s in OmniPipeline.model_validate(_load(name)).spec.stages}

    omni = stages("qwen3-omni.yaml")
    assert list(omni) == ["thinker", "talker", "code2wav"]
    assert (omni["thinker"].accelerator.type.value, omni["thinker"].accelerator.count) == (
        "nvidia.com/gpu",
        2,
    )
    assert omni["talker"].accelerator.count == 1 and omni["code2wav"].colocate_with == "talker"
    assert list(stages("qwen-image.yaml")) == ["dit"]
    llm = stages("ascend-chat.yaml")["llm"]
    assert llm.accelerator.type.value == "huawei.com/Ascend910"
    assert [(t.key, t.operator.value, t.effect.value) for t in llm.tolerations] == [
        ("huawei.com/Ascend910", "Exists", "NoSchedule")
    ]
    tiny = OmniPipeline.model_validate(_load("tiny-chat-cpu.yaml"))
    assert tiny.spec.model == "/models/tiny-qwen2-chat" and tiny.spec.runtime.model_cache.host_path
    assert tiny.spec.stages[0].accelerator is None


def test_convert_qwen3_omni_sample() -> None:
    args = resolve_args(OmniPipeline.model_validate(_load("qwen3-omni.yaml")).spec)
    assert [(s.name, s.colocate_with) for s in args.stages] == [
        ("thinker", None),
        ("talker", None),
        ("code2wav", "talker"),
    ]
    assert args.stages[0].engine_args == {
        "tensor_parallel_size": 2,
        "max_model_len": 32768,
        "gpu_memory_utilization": 0.9,
    }
    assert args.stages[1].engine_args == {"max_requests": 32}
    assert args.stages[2].engine_args == {"left_context": 25}
    assert [(e.source, e.target, e.connector, e.window) for e in args.edges] == [
        ("thinker", "talker", ConnectorKind.MOONCAKE, None),
        ("talker", "code2wav", ConnectorKind.SHM, None),
    ]
    assert args.connectors is not None
    assert args.connectors.default is ConnectorKind.MOONCAKE
    assert args.connectors.mooncake.protocol is MooncakeProtocol.TCP
    assert args.connectors.mooncake.global_segment_size == 4 * 1024**3
    assert args.connectors.mooncake.local_buffer_size == 512 * 1024**2
    assert args.limits.max_concurrent_requests == 64 and args.limits.request_timeout_s == 600.0
    assert set(args.as_kwargs()) == {"stages", "edges", "connectors", "limits"}


def _omni_topology() -> PipelineSpec:
    return PipelineSpec(
        name="qwen3-omni",
        stages=[
            StageSpec(name="thinker", kind="ar", engine_args={"max_model_len": 4096, "dtype": "bfloat16"}),
            StageSpec(name="talker", kind="ar", output_modality="hidden"),
            StageSpec(name="code2wav", kind="generation", output_modality="audio", final_output=True),
        ],
        edges=[
            EdgeSpec(source="thinker", target="talker", window=25),
            EdgeSpec(source="talker", target="code2wav", window=50),
        ],
        connectors=ConnectorsSpec(inline_max_bytes=1024**2),
    )


def test_resolve_qwen3_omni_sample_against_a_topology() -> None:
    pipeline = OmniPipeline.model_validate(_load("qwen3-omni.yaml"))
    pipeline.metadata.namespace = "ml"
    resolved = resolve(pipeline, _omni_topology(), model_path="/models/Qwen/Qwen3-Omni-30B-A3B-Instruct")
    assert (resolved.name, resolved.namespace, resolved.served_model_name) == (
        "qwen3-omni",
        "ml",
        "qwen3-omni",
    )
    assert resolved.model == "/models/Qwen/Qwen3-Omni-30B-A3B-Instruct"
    assert resolved.colocation == {"code2wav": "talker"}
    thinker = resolved.topology.stage("thinker")
    assert thinker.engine_args == {
        "max_model_len": 32768,
        "dtype": "bfloat16",
        "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.9,
    }
    edges = {(e.source, e.target): (e.connector, e.window) for e in resolved.topology.edges}
    assert edges == {
        ("thinker", "talker"): (ConnectorKind.MOONCAKE, 25),
        ("talker", "code2wav"): (ConnectorKind.SHM, 50),
    }
    # Fields the spec leaves unset keep the topology's values.
    assert resolved.topology.connectors.inline_max_bytes == 1024**2


def test_an_edges_first_window_reaches_the_resolved_topology() -> None:
    """`connectors.edges[].firstWindow` sets the first chunk the router plans and the stage cuts
    (test_router_units / test_speech_engines cover what each does with it); unset keeps the topology's."""
    raw = _load("qwen3-omni.yaml")
    raw["spec"]["connectors"] = {"edges": [{"from": "talker", "to": "code2wav", "firstWindow": 2}]}
    resolved = resolve(OmniPipeline.model_validate(raw), _omni_topology(), model_path="/models/q")
    edges = {(e.source, e.target): (e.window, e.first_window) for e in resolved.topology.edges}
    assert edges == {("thinker", "talker"): (25, 0), ("talker", "code2wav"): (50, 2)}
    raw["spec"]["connectors"] = {"edges": [{"from": "talker", "to": "code2wav", "firstWindow": -1}]}
    with pytest.raises(ValidationError, match="firstWindow"):
        OmniPipeline.model_validate(raw)


def test_connectors_left_unset_keep_the_topology() -> None:
    raw = _load("qwen3-omni.yaml")
    raw["spec"]["connectors"] = {"edges": [{"from": "thinker", "to": "talker", "window": 10}]}
    assert resolve_args(OmniPipeline.model_validate(raw).spec).connectors is None
    raw["spec"]["connectors"] = {"mooncake": {"protocol": "rdma", "deviceName": "mlx5_0"}}
    base = ConnectorsSpec(default="mooncake", inline_max_bytes=0)
    merged = resolve_args(OmniPipeline.model_validate(raw).spec, base).connectors
    assert merged.default is ConnectorKind.MOONCAKE and merged.inline_max_bytes == 0
    assert merged.mooncake.protocol is MooncakeProtocol.RDMA and merged.mooncake.device_name == "mlx5_0"
    assert merged.start_timeout_seconds == 120  # unset: the topology's


def test_connectors_start_timeout_reaches_the_resolved_pipeline() -> None:
    raw = _load("qwen3-omni.yaml")
    raw["spec"]["connectors"] = {"startTimeoutSeconds": 15}
    merged = resolve_args(OmniPipeline.model_validate(raw).spec, ConnectorsSpec(inline_max_bytes=0)).connectors
    assert merged is not None and merged.start_timeout_seconds == 15 and merged.inline_max_bytes == 0
    raw["spec"]["connectors"] = {"startTimeoutSeconds": 0}
    with pytest.raises(ValidationError, match="start_timeout_seconds|startTimeoutSeconds"):
        OmniPipeline.model_validate(raw)


def test_resolve_reports_an_unknown_stage() -> None:
    raw = _load("qwen3-omni.yaml")
    raw["spec"]["stages"].append({"name": "vocoder"})
    with pytest.raises(SpecError, match=r"stages\[3\].name: pipeline 'qwen3-omni' has no stage 'vocoder'"):
        resolve(OmniPipeline.model_validate(raw), _omni_topology())


# --- offline validation mirrors admission ---------------------------------------------------------


def _pipeline(**spec: Any) -> dict[str, Any]:
    base = {"model": "m", "stages": [{"name": "a"}]}
    return {
        "apiVersion": "omnikube.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": "p"},
        "spec": {**base, **spec},
    }


def _stage(**fields: Any) -> dict[str, Any]:
    return _pipeline(stages=[{"name": "a", **fields}])


INVALID = {
    "negative replicas": (_stage(replicas=-1), "spec.stages[0].replicas", "greater than or equal to 0"),
    "unknown accelerator": (
        _stage(accelerator={"type": "intel.com/gpu"}),
        "spec.stages[0].accelerator.type",
        "nvidia.com/gpu",
    ),
    "duplicate stage names": (
        _pipeline(stages=[{"name": "a"}, {"name": "a"}]),
        "spec.stages",
        "stage names must be unique",
    ),
    "wrong type": (_stage(replicas="2"), "spec.stages[0].replicas", "valid integer"),
    "missing model": (
        {k: v for k, v in _pipeline().items() if k != "spec"} | {"spec": {"stages": []}},
        "spec.model",
        "required",
    ),
    "empty model": (_pipeline(model=""), "spec.model", "at least 1 character"),
    "autoscaling min > max": (
        _stage(autoscaling={"minReplicas": 3, "maxReplicas": 2}),
        "spec.stages[0].autoscaling",
        "autoscaling.minReplicas: must not exceed maxReplicas",
    ),
    "autoscaling target 0": (
        _stage(autoscaling={"metric": "ttft", "target": 0, "maxReplicas": 2}),
        "spec.stages[0].autoscaling.target",
        "autoscaling.target: must be above 0",
    ),
    "autoscaling target 0m": (
        _stage(autoscaling={"metric": "ttfp", "target": "0m", "maxReplicas": 2}),
        "spec.stages[0].autoscaling.target",
        "set it to the value to aim for",
    ),
    "autoscaling target negative": (
        _stage(autoscaling={"metric": "rtf", "target": -1, "maxReplicas": 2}),
        "spec.stages[0].autoscaling.target",
        "must be above 0",
    ),
    "autoscaling stabilization negative": (
        _stage(autoscaling={"maxReplicas": 2, "scaleDownStabilizationSeconds": -1}),
        "spec.stages[0].autoscaling.scaleDownStabilizationSeconds",
        "greater than or equal to 0",
    ),
    "accelerator count 0": (
        _stage(accelerator={"type": "nvidia.com/gpu", "count": 0}),
        "spec.stages[0].accelerator",
        "accelerator.count: 0 is not allowed when type is nvidia.com/gpu",
    ),
    "bad stage name": (_stage(name="Thinker_1"), "spec.stages[0].name", "should match pattern"),
    "long stage name": (_stage(name="s" * 41), "spec.stages[0].name", "at most 40"),
    "bad connector kind": (_pipeline(connectors={"default": "nccl"}), "spec.connectors.default", "'inline'"),
    "bad service port": (_pipeline(router={"service": {"port": 70000}}), "spec.router.service.port", "65535"),
    "pvc and hostPath": (
        _pipeline(runtime={"modelCache": {"pvc": {"claimName": "c"}, "hostPath": {"path": "/m"}}}),
        "spec.runtime.modelCache",
        "modelCache: set exactly one of pvc or hostPath",
    ),
    "neither pvc nor hostPath": (
        _pipeline(runtime={"modelCache": {}}),
        "spec.runtime.modelCache",
        "exactly one of pvc or hostPath",
    ),
    "negative window": (
        _pipeline(connectors={"edges": [{"from": "a", "to": "b", "window": -1}]}),
        "spec.connectors.edges[0].window",
        "greater than or equal to 0",
    ),
    "edge to itself": (
        _pipeline(connectors={"edges": [{"from": "a", "to": "a"}]}),
        "spec.connectors.edges[0]",
        "from and to must name two different stages",
    ),
    "duplicate edge": (
        _pipeline(connectors={"edges": [{"from": "a", "to": "b"}, {"from": "a", "to": "b", "window": 2}]}),
        "spec.connectors",
        "each from/to pair may be listed once",
    ),
    "colocated with itself": (_stage(colocateWith="a"), "spec.stages[0]", "cannot be colocated with itself"),
    "autoscaling a colocated stage": (
        _stage(colocateWith="b", autoscaling={"maxReplicas": 2}),
        "spec.stages[0]",
        "move autoscaling",
    ),
    "grace period on a colocated stage": (
        _stage(colocateWith="b", terminationGracePeriodSeconds=60),
        "spec.stages[0]",
        "set it on the stage named by colocateWith",
    ),
    "zero grace period": (
        _pipeline(router={"terminationGracePeriodSeconds": 0}),
        "spec.router.terminationGracePeriodSeconds",
        "greater than or equal to 1",
    ),
    "bad quantity": (
        _stage(resources={"requests": {"memory": "2 GiB"}}),
        "spec.stages[0].resources.requests.memory",
        "not a Kubernetes quantity",
    ),
    "fractional quantity": (
        _stage(resources={"requests": {"cpu": 0.5}}),
        "spec.stages[0].resources.requests.cpu",
        "500m",
    ),
    "toleration Exists with value": (
        _stage(tolerations=[{"key": "k", "operator": "Exists", "value": "v"}]),
        "spec.stages[0].tolerations[0]",
        "tolerations.value: must be empty when operator is Exists",
    ),
    "plain token field": (_pipeline(runtime={"hfToken": "hf_x"}), "spec.runtime.hfToken", "not permitted"),
    "small mooncake segment": (
        _pipeline(connectors={"mooncake": {"globalSegmentSize": "1Mi"}}),
        "spec.connectors.mooncake.globalSegmentSize",
        "below the minimum 16Mi",
    ),
    "too many stages": (
        _pipeline(stages=[{"name": f"s{i}"} for i in range(33)]),
        "spec.stages",
        "at most 32",
    ),
    "zero concurrency": (
        _pipeline(router={"limits": {"maxConcurrentRequests": 0}}),
        "spec.router.limits.maxConcurrentRequests",
        "greater than or equal to 1",
    ),
    "max surge past 100%": (_pipeline(rollout={"maxSurge": "150%"}), "spec.rollout.maxSurge", "0% to 100%"),
    "progress deadline 0": (
        _pipeline(rollout={"progressDeadlineSeconds": 0}),
        "spec.rollout.progressDeadlineSeconds",
        "greater than or equal to 1",
    ),
    "wrong kind": ({**_pipeline(), "kind": "OmniStage"}, "", "kind: 'OmniStage' is not OmniPipeline"),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_pipelines_are_rejected_offline(case: str) -> None:
    manifest, path, fragment = INVALID[case]
    with pytest.raises(ValidationError) as caught:
        OmniPipeline.model_validate(copy.deepcopy(manifest))
    lines = validation_messages(caught.value)
    assert any(line.startswith(f"{path}: " if path else "") and fragment.lower() in line.lower() for line in lines), (
        lines
    )


def test_offline_messages_match_the_cel_messages(crds: list[dict[str, Any]]) -> None:
    cel = {
        r["message"] for crd in crds for _, n in _walk(_schema(crd), "") for r in n.get("x-kubernetes-validations", [])
    }
    for case in (
        "autoscaling min > max",
        "autoscaling target 0",
        "accelerator count 0",
        "pvc and hostPath",
        "edge to itself",
        "toleration Exists with value",
        "colocated with itself",
        "grace period on a colocated stage",
    ):
        with pytest.raises(ValidationError) as caught:
            OmniPipeline.model_validate(copy.deepcopy(INVALID[case][0]))
        messages = [line.split(": ", 1)[1] for line in validation_messages(caught.value)]
        assert any(m in cel for m in messages), (case, messages)


def test_valid_edge_cases_pass() -> None:
    OmniPipeline.model_validate(_stage(accelerator={"type": "none", "count": 0}))
    OmniPipeline.model_validate(_stage(autoscaling={"minReplicas": 2, "maxReplicas": 2}))
    OmniPipeline.model_validate(_stage(tolerations=[{"operator": "Exists"}], resources={"limits": {"cpu": 4}}))
    OmniPipeline.model_validate(_pipeline(stages=[], connectors={"edges": [{"from": "a", "to": "b", "window": 0}]}))
    stage = OmniStage.model_validate(
        {
            "apiVersion": "omnikube.io/v1alpha1",
            "kind": "OmniStage",
            "metadata": {"name": "p-talker"},
            "spec": {
                "pipeline": "p",
                "stage": "talker",
                "kind": "ar",
                "image": "i",
                "model": "/models/m",
                "configMap": "p-resolved",
                "colocated": ["code2wav"],
            },
            "status": {"replicas": 1, "readyReplicas": 1, "selector": "app=x", "someFutureField": 1},
        }
    )
    assert stage.to_dict()["spec"]["configMap"] == "p-resolved"
    with pytest.raises(ValidationError, match="colocated: must list other stages"):
        OmniStage.model_validate({**stage.to_dict(), "spec": {**stage.to_dict()["spec"], "colocated": ["talker"]}})


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("8Gi", 8 * 1024**3),
        ("512Mi", 512 * 1024**2),
        ("500m", 0.5),
        ("4", 4),
        (4, 4),
        ("1e3", 1000),
        ("1.5G", 1.5e9),
    ],
)
def test_quantities(text: int | str, value: float) -> None:
    assert float(parse_quantity(text)) == value


def test_quantity_bytes_round_up() -> None:
    assert quantity_bytes("1500m") == 2
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        parse_quantity("2 GiB")
