"""The operator's builders, offline: every object `omnikube render` prints for the samples, and its errors.

No cluster: `render_pipeline` runs the same resolve and build_* functions the reconcile does.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from servelib import template_hash

from omni_operator.api import OmniStage
from omni_operator.builders.meta import HASH_ANNOTATION, child_name, with_hash
from omni_operator.builders.pipeline_objects import stored_omnistage_spec
from omni_operator.builders.stage_workload import build_stage_service
from omni_operator.render import PLACEHOLDER_UID, RenderError, render_file, render_pipeline
from omni_runtime.registry import default_registry

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "config" / "samples"
SAMPLE_FILES = sorted(SAMPLES.glob("*.yaml"))
OMNIKUBE = ROOT / ".venv" / "bin" / "omnikube"

REGISTRY = default_registry()

# Objects the OmniStage owns; every other object is owned by the OmniPipeline.
STAGE_OWNED = {"Deployment", "Service"}


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((SAMPLES / name).read_text())


def render(manifest: dict[str, Any], **kwargs: Any) -> list[dict[str, Any]]:
    return render_pipeline(manifest, REGISTRY, **kwargs)


def workload_name(obj: dict[str, Any]) -> str:
    """A Deployment's name, or for a stage generation's Deployment the name of its OmniStage."""
    owners = [r["name"] for r in obj["metadata"].get("ownerReferences", []) if r["kind"] == "OmniStage"]
    return owners[0] if obj["kind"] == "Deployment" and owners else obj["metadata"]["name"]


def _is(obj: dict[str, Any], kind: str, name: str) -> bool:
    """`obj` is the `kind` called `name`, or, for a Deployment, the current generation's of OmniStage `name`."""
    if obj["kind"] != kind:
        return False
    owners = [r["name"] for r in obj["metadata"].get("ownerReferences", []) if r["kind"] == "OmniStage"]
    return obj["metadata"]["name"] == name or (kind == "Deployment" and owners == [name])


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    hits = [o for o in objects if _is(o, kind, name)]
    present = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(hits) == 1, f"{kind}/{name}: found {len(hits)} in {present}"
    return hits[0]


def containers(deployment: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}


def stage_deployments(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        o
        for o in objects
        if o["kind"] == "Deployment" and o["metadata"]["labels"]["app.kubernetes.io/component"] == "stage"
    ]


def spec_hash(obj: dict[str, Any]) -> str:
    return obj["metadata"]["annotations"][HASH_ANNOTATION]


def resolved_config(objects: list[dict[str, Any]], pipeline: str) -> dict[str, Any]:
    configmap = find(objects, "ConfigMap", f"{pipeline}-config")
    return json.loads(configmap["data"]["resolved.json"])


def minimal(pipeline: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "omnikube.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": "p"},
        "spec": {"model": "some/model", "pipeline": pipeline, **spec},
    }


@pytest.fixture(scope="module")
def qwen3() -> list[dict[str, Any]]:
    return render(load("qwen3-omni.yaml"))


# --- every sample ----------------------------------------------------------------------------------


def test_samples_exist():
    assert {p.name for p in SAMPLE_FILES} >= {
        "qwen3-omni.yaml",
        "qwen-image.yaml",
        "ascend-chat.yaml",
        "tiny-chat-cpu.yaml",
    }


@pytest.mark.parametrize("path", SAMPLE_FILES, ids=lambda p: p.stem)
def test_every_sample_object_is_labelled_owned_hashed_and_named_validly(path: Path):
    manifest = yaml.safe_load(path.read_text())
    pipeline = manifest["metadata"]["name"]
    objects = render(manifest)
    kinds = [o["kind"] for o in objects]
    # The router's, and one per pod group for its current generation.
    assert kinds.count("ConfigMap") == 1 + kinds.count("OmniStage")
    assert {
        "OmniStage",
        "Deployment",
        "Service",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "PodDisruptionBudget",
    } <= set(kinds)
    # One Deployment per pod group, plus the router, plus the Mooncake master when an edge uses it.
    mooncake = any(o["metadata"]["name"] == f"{pipeline}-mooncake" for o in objects)
    assert kinds.count("OmniStage") == kinds.count("Deployment") - 1 - mooncake
    stages = {o["metadata"]["name"] for o in objects if o["kind"] == "OmniStage"}
    for obj in objects:
        meta = obj["metadata"]
        where = f"{obj['kind']}/{meta['name']}"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "omnikube", where
        assert meta["labels"]["omnikube.io/pipeline"] == pipeline, where
        assert len(meta["name"]) <= 63, where
        assert meta["namespace"] == "default", where
        # The hash describes everything else in the object: recomputing it gives the same object.
        assert HASH_ANNOTATION in meta["annotations"], where
        assert with_hash(copy.deepcopy(obj)) == obj, where
        [ref] = meta["ownerReferences"]
        assert ref["controller"] is True and ref["blockOwnerDeletion"] is True, where
        assert ref["uid"] == PLACEHOLDER_UID, where
        if obj["kind"] in STAGE_OWNED and meta["labels"]["app.kubernetes.io/component"] == "stage":
            # A generation's Deployment is named by its OmniStage and contract; the rest by the OmniStage.
            generation = meta["labels"].get("omnikube.io/generation", "")
            assert ref["kind"] == "OmniStage", where
            assert meta["name"] == (f"{ref['name']}-{generation[:10]}" if generation else ref["name"]), where
            assert ref["name"] in stages, where
        else:
            assert (ref["kind"], ref["name"]) == ("OmniPipeline", pipeline), where


@pytest.mark.parametrize("path", SAMPLE_FILES, ids=lambda p: p.stem)
def test_no_owner_references_leaves_them_out_and_changes_nothing_else(path: Path):
    manifest = yaml.safe_load(path.read_text())
    owned = render(manifest)
    bare = render(manifest, owner_references=False)
    assert all("ownerReferences" not in o["metadata"] for o in bare)
    for with_refs, without in zip(owned, bare, strict=True):
        stripped = copy.deepcopy(with_refs)
        stripped["metadata"].pop("ownerReferences")
        # Same content; only the hash annotation (which covered the owner reference) may differ.
        stripped["metadata"]["annotations"].pop(HASH_ANNOTATION)
        other = copy.deepcopy(without)
        other["metadata"]["annotations"].pop(HASH_ANNOTATION)
        assert stripped == other


@pytest.mark.parametrize("path", SAMPLE_FILES, ids=lambda p: p.stem)
def test_render_file_is_the_yaml_of_render_pipeline(path: Path):
    text = render_file(path, REGISTRY)
    assert list(yaml.safe_load_all(text)) == render(yaml.safe_load(path.read_text()))


def test_render_file_without_a_pipeline_says_what_it_found(tmp_path: Path):
    path = tmp_path / "cm.yaml"
    path.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    with pytest.raises(RenderError, match=r"no OmniPipeline in the file.*ConfigMap"):
        render_file(path, REGISTRY)


def test_rendering_twice_is_identical():
    for path in SAMPLE_FILES:
        manifest = yaml.safe_load(path.read_text())
        first = yaml.safe_dump_all(render(manifest))
        assert yaml.safe_dump_all(render(copy.deepcopy(manifest))) == first, path.name
        assert manifest == yaml.safe_load(path.read_text()), f"{path.name}: render modified its input"


@pytest.mark.parametrize("path", SAMPLE_FILES, ids=lambda p: p.stem)
def test_every_omnistage_reads_back_into_the_spec_it_was_built_from(path: Path):
    """The OmniStage spec is built from its model and read back through it: what the stage reconcile
    reads is what the pipeline reconcile wrote, and writing it again changes nothing (no write churn)."""
    for obj in render(yaml.safe_load(path.read_text())):
        if obj["kind"] == "OmniStage":
            stage = OmniStage.model_validate(obj)
            assert stored_omnistage_spec(stage.spec) == obj["spec"], obj["metadata"]["name"]
            assert "colocated" not in obj["spec"] or obj["spec"]["colocated"], "an empty list is left out"


def test_an_owner_reference_needs_a_live_object():
    stage = OmniStage.model_validate(find(render(load("qwen3-omni.yaml")), "OmniStage", "qwen3-omni-talker"))
    stage.metadata.uid = None  # as built, before the apiserver gave it a uid
    with pytest.raises(ValueError, match="OmniStage qwen3-omni-talker has no uid: only a live object can own"):
        build_stage_service(stage)


# --- names ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("parts", "expected"),
    [
        (("p", "thinker"), "p-thinker"),
        (("p", "", "router"), "p-router"),
        (("a" * 55, "router"), "a" * 55 + "-router"),  # exactly 62: kept
        (("a" * 56, "router"), "a" * 56 + "-router"),  # exactly 63: kept
    ],
)
def test_child_name_keeps_short_names(parts: tuple[str, ...], expected: str):
    assert child_name(*parts) == expected


def test_child_name_shortens_long_names_stably_and_distinctly():
    long_a = child_name("p" * 60, "thinker")
    long_b = child_name("p" * 60, "talker")
    assert len(long_a) == len(long_b) == 63
    assert long_a == child_name("p" * 60, "thinker")  # stable across calls
    assert long_a != long_b  # two stages never collide on a shared prefix
    assert long_a.startswith("p" * 50)
    assert long_a[:54] == long_b[:54]  # the same visible prefix: only the hash tells them apart
    assert not long_a.endswith("-") and "--" not in long_a


def test_long_pipeline_names_are_shortened_everywhere_consistently():
    manifest = load("qwen3-omni.yaml")
    name = "q" * 60
    manifest["metadata"]["name"] = name
    objects = render(manifest)
    assert all(len(o["metadata"]["name"]) <= 63 for o in objects)
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    talker, router, config = child_name(name, "talker"), child_name(name, "router"), child_name(name, "config")
    assert ("Service", talker) in names and ("Deployment", router) in names and ("ConfigMap", config) in names
    # Everything that refers to a shortened name uses the same shortened name.
    resolved = json.loads(find(objects, "ConfigMap", config)["data"]["resolved.json"])
    assert resolved["discovery"]["code2wav"]["service"] == talker
    router_deploy = find(objects, "Deployment", router)
    assert router_deploy["spec"]["template"]["spec"]["serviceAccountName"] == router
    assert router_deploy["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"] == config
    assert find(objects, "RoleBinding", router)["roleRef"]["name"] == router
    mooncake = child_name(name, "mooncake")
    assert ("Deployment", mooncake) in names and ("Service", mooncake) in names
    assert resolved["mooncake_master_host"] == f"{mooncake}.default.svc"


# --- the qwen3-omni sample --------------------------------------------------------------------------


def test_qwen3_thinker_requests_two_gpus_and_limits_equal_requests(qwen3):
    thinker = containers(find(qwen3, "Deployment", "qwen3-omni-thinker"))["thinker"]
    resources = thinker["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == "2"
    assert resources["limits"]["nvidia.com/gpu"] == "2"
    assert resources["requests"]["cpu"] == "8" and resources["requests"]["memory"] == "64Gi"


def test_qwen3_talker_pod_runs_talker_and_code2wav_on_distinct_ports(qwen3):
    talker_deploy = find(qwen3, "Deployment", "qwen3-omni-talker")
    pod = containers(talker_deploy)
    assert list(pod) == ["talker", "code2wav"]
    ports = [p["containerPort"] for c in pod.values() for p in c["ports"]]
    assert len(ports) == len(set(ports)) == 4
    port_names = [p["name"] for c in pod.values() for p in c["ports"]]
    assert len(set(port_names)) == 4
    assert pod["talker"]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    code2wav_resources = pod["code2wav"].get("resources", {})
    assert not any("gpu" in key for part in code2wav_resources.values() for key in part)
    # Each container's probes hit its own HTTP port.
    code2wav_http = next(p["containerPort"] for p in pod["code2wav"]["ports"] if p["name"].startswith("http"))
    assert pod["code2wav"]["readinessProbe"]["httpGet"]["port"] == code2wav_http
    # code2wav has no Deployment of its own: it lives in the talker's pods.
    assert not [o for o in qwen3 if o["metadata"]["name"] == "qwen3-omni-code2wav"]


def test_qwen3_talker_service_is_headless_and_exposes_both_stages(qwen3):
    service = find(qwen3, "Service", "qwen3-omni-talker")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is False
    deployment = find(qwen3, "Deployment", "qwen3-omni-talker")
    container_ports = {p["containerPort"] for c in containers(deployment).values() for p in c["ports"]}
    assert {p["port"] for p in service["spec"]["ports"]} == container_ports
    assert all(p["targetPort"] == p["port"] for p in service["spec"]["ports"])
    selector = service["spec"]["selector"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()
    # The Service reaches every generation of the stage; the Deployment holds its own generation only.
    generation = {"omnikube.io/generation": deployment["metadata"]["labels"]["omnikube.io/generation"]}
    assert deployment["spec"]["selector"]["matchLabels"] == {**selector, **generation}


def test_qwen3_discovery_points_code2wav_at_the_talker_service_and_its_port(qwen3):
    discovery = resolved_config(qwen3, "qwen3-omni")["discovery"]
    code2wav_stage_port = next(
        p["containerPort"]
        for p in containers(find(qwen3, "Deployment", "qwen3-omni-talker"))["code2wav"]["ports"]
        if p["name"].startswith("stage")
    )
    assert discovery["code2wav"]["service"] == "qwen3-omni-talker"
    assert discovery["code2wav"]["namespace"] == "default"
    assert discovery["code2wav"]["port"] == code2wav_stage_port
    assert discovery["talker"]["service"] == "qwen3-omni-talker"
    assert discovery["talker"]["port"] != discovery["code2wav"]["port"]
    assert discovery["thinker"]["service"] == "qwen3-omni-thinker"
    service_ports = {p["port"] for p in find(qwen3, "Service", "qwen3-omni-talker")["spec"]["ports"]}
    assert discovery["code2wav"]["port"] in service_ports and discovery["talker"]["port"] in service_ports


@pytest.mark.parametrize(
    ("manifest", "pipeline", "mooncake"),
    [
        (load("qwen3-omni.yaml"), "qwen3-omni", True),  # thinker -> talker over mooncake
        (minimal("prompt-enhanced-t2i"), "p", False),  # the topology's default connector: inline
        (minimal("prompt-enhanced-t2i", connectors={"default": "mooncake"}), "p", True),
        (
            minimal(
                "prompt-enhanced-t2i", connectors={"edges": [{"from": "enhancer", "to": "dit", "kind": "mooncake"}]}
            ),
            "p",
            True,
        ),
    ],
    ids=["qwen3-sample", "t2i-default", "t2i-default-mooncake", "t2i-edge-mooncake"],
)
def test_a_pipeline_runs_one_mooncake_master_of_its_own_iff_an_edge_uses_mooncake(manifest, pipeline, mooncake):
    objects = render(manifest)
    router = find(objects, "Deployment", f"{pipeline}-router")
    router_service = find(objects, "Service", f"{pipeline}-router")
    # The master is never in the router pod (one per router replica would split the metadata) and its
    # ports are never on the client-facing Service.
    assert set(containers(router)) == {"router"}
    assert {p["name"] for p in router_service["spec"]["ports"]} == {"http"}
    master = [o for o in objects if o["metadata"]["name"] == f"{pipeline}-mooncake"]
    if not mooncake:
        assert master == []
        return
    deployment = find(objects, "Deployment", f"{pipeline}-mooncake")
    service = find(objects, "Service", f"{pipeline}-mooncake")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}  # never two masters at once
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert resolved_config(objects, pipeline)["mooncake_master_host"] == f"{pipeline}-mooncake.default.svc"


def test_qwen3_router_role_only_lists_and_watches_endpointslices(qwen3):
    role = find(qwen3, "Role", "qwen3-omni-router")
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    # Exactly what router/discovery.py calls: list, then watch, the EndpointSlices of its stage Services.
    assert granted == {("discovery.k8s.io", "endpointslices", "list"), ("discovery.k8s.io", "endpointslices", "watch")}
    binding = find(qwen3, "RoleBinding", "qwen3-omni-router")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "qwen3-omni-router"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "qwen3-omni-router", "namespace": "default"}]
    # No ClusterRole: the router's rights stop at its namespace.
    assert not [o for o in qwen3 if o["kind"].startswith("Cluster")]


def test_qwen3_router_pdb_allows_one_unavailable(qwen3):
    pdb = find(qwen3, "PodDisruptionBudget", "qwen3-omni-router")
    assert pdb["spec"]["maxUnavailable"] == 1
    router = find(qwen3, "Deployment", "qwen3-omni-router")
    assert pdb["spec"]["selector"]["matchLabels"] == router["spec"]["selector"]["matchLabels"]


def pod_specs(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(workload_name(o), o["spec"]["template"]["spec"]) for o in objects if o["kind"] == "Deployment"]


def test_qwen3_every_pod_runs_as_non_root_without_privilege_escalation(qwen3):
    for name, pod in pod_specs(qwen3):
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] != 0, name
        for container in pod["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, (name, container["name"])
            assert container["securityContext"]["capabilities"]["drop"] == ["ALL"], (name, container["name"])


@pytest.mark.parametrize(("override", "expected"), [(None, "16Gi"), ("2Gi", "2Gi")])
def test_dev_shm_is_a_memory_emptydir_sized_by_shm_size(override, expected):
    manifest = load("qwen3-omni.yaml")
    if override:
        manifest["spec"]["stages"][0]["shmSize"] = override  # thinker only
    objects = render(manifest)
    for stage, size in (("thinker", expected), ("talker", "16Gi")):
        _, pod = next(p for p in pod_specs(objects) if p[0] == f"qwen3-omni-{stage}")
        dshm = next(v for v in pod["volumes"] if v["name"] == "dshm")
        assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": size}, stage
        for container in pod["containers"]:
            assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"], (stage, container["name"])


def test_hf_token_only_reaches_pods_through_a_secret_key_ref(qwen3):
    text = yaml.safe_dump_all(qwen3)
    assert "secretKeyRef" in text
    stage_containers = [c for o in stage_deployments(qwen3) for c in o["spec"]["template"]["spec"]["containers"]]
    for container in stage_containers:
        [token] = [e for e in container["env"] if e["name"] == "HF_TOKEN"]
        assert "value" not in token
        assert token["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token", "optional": False}
    # The router holds no model and gets no token.
    router = containers(find(qwen3, "Deployment", "qwen3-omni-router"))["router"]
    assert "HF_TOKEN" not in {e["name"] for e in router["env"]}


def test_a_plain_hf_token_is_refused_and_never_rendered():
    secret = "hf_do_not_print_me_0123456789"
    manifest = load("qwen3-omni.yaml")
    manifest["spec"]["runtime"]["hfToken"] = secret
    with pytest.raises(RenderError) as err:
        render(manifest)
    assert "spec.runtime.hfToken" in str(err.value)
    assert secret not in str(err.value)


def test_qwen3_stage_containers_have_probes_and_downward_api_identity(qwen3):
    stage_deploys = stage_deployments(qwen3)
    assert len(stage_deploys) == 2
    for deployment in stage_deploys:
        for container in containers(deployment).values():
            where = (deployment["metadata"]["name"], container["name"])
            assert container["readinessProbe"]["httpGet"]["path"] == "/readyz", where
            assert container["livenessProbe"]["httpGet"]["path"] == "/healthz", where
            assert container["startupProbe"]["httpGet"]["path"] == "/readyz", where
            # Liveness waits for the startup probe; loading a model must get many minutes.
            startup = container["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, where
            env = {e["name"]: e for e in container["env"]}
            assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}, where
            assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}, where


def test_stage_rollout_never_drops_below_the_wanted_replicas(qwen3):
    for obj in qwen3:
        if obj["kind"] == "Deployment" and obj["metadata"]["name"] != "qwen3-omni-mooncake":
            assert obj["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0, obj["metadata"]["name"]


# --- hashes -----------------------------------------------------------------------------------------


def hashes(objects: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Deployment name -> its template and spec hashes; OmniStage name -> its spec hash."""
    out: dict[str, dict[str, str]] = {}
    for obj in objects:
        if obj["kind"] == "Deployment":
            out[workload_name(obj)] = {"template": template_hash(obj), "deployment": spec_hash(obj)}
    for obj in objects:
        if obj["kind"] == "OmniStage":
            out[obj["metadata"]["name"]]["omnistage"] = spec_hash(obj)
    return out


def test_changing_one_stages_engine_args_rolls_only_that_stage():
    before = hashes(render(load("qwen3-omni.yaml")))
    manifest = load("qwen3-omni.yaml")
    manifest["spec"]["stages"][0]["engineArgs"]["max_model_len"] = 16384  # thinker
    after = hashes(render(manifest))
    assert after["qwen3-omni-thinker"]["template"] != before["qwen3-omni-thinker"]["template"]
    assert after["qwen3-omni-thinker"]["omnistage"] != before["qwen3-omni-thinker"]["omnistage"]
    assert after["qwen3-omni-talker"] == before["qwen3-omni-talker"]
    assert after["qwen3-omni-router"]["template"] == before["qwen3-omni-router"]["template"]


def test_changing_a_colocated_stages_engine_args_rolls_its_group():
    before = hashes(render(load("qwen3-omni.yaml")))
    manifest = load("qwen3-omni.yaml")
    manifest["spec"]["stages"][2]["engineArgs"]["left_context"] = 50  # code2wav, in the talker's pods
    after = hashes(render(manifest))
    assert after["qwen3-omni-talker"]["template"] != before["qwen3-omni-talker"]["template"]
    assert after["qwen3-omni-thinker"] == before["qwen3-omni-thinker"]
    assert after["qwen3-omni-router"]["template"] == before["qwen3-omni-router"]["template"]


def test_changing_replicas_rewrites_the_deployment_without_rolling_its_pods():
    before = hashes(render(load("qwen3-omni.yaml")))
    manifest = load("qwen3-omni.yaml")
    manifest["spec"]["stages"][0]["replicas"] = 3
    objects = render(manifest)
    after = hashes(objects)
    assert find(objects, "Deployment", "qwen3-omni-thinker")["spec"]["replicas"] == 3
    assert after["qwen3-omni-thinker"]["deployment"] != before["qwen3-omni-thinker"]["deployment"]
    assert after["qwen3-omni-thinker"]["omnistage"] != before["qwen3-omni-thinker"]["omnistage"]
    assert after["qwen3-omni-thinker"]["template"] == before["qwen3-omni-thinker"]["template"]
    assert after["qwen3-omni-talker"] == before["qwen3-omni-talker"]


def test_changing_the_edge_connector_rolls_both_ends_and_the_router():
    before = hashes(render(load("qwen3-omni.yaml")))
    manifest = load("qwen3-omni.yaml")
    manifest["spec"]["connectors"]["edges"][0]["kind"] = "inline"  # thinker -> talker
    after = hashes(render(manifest))
    for name in ("qwen3-omni-thinker", "qwen3-omni-talker", "qwen3-omni-router"):
        assert after[name]["template"] != before[name]["template"], name


# --- autoscaling, Ascend ----------------------------------------------------------------------------


def test_autoscaled_stage_carries_its_bounds_and_starts_at_min_replicas():
    manifest = load("qwen3-omni.yaml")
    manifest["spec"]["stages"][0]["replicas"] = 1
    manifest["spec"]["stages"][0]["autoscaling"] = {"minReplicas": 2, "maxReplicas": 5, "targetQueueDepth": 4}
    objects = render(manifest)
    stage = find(objects, "OmniStage", "qwen3-omni-thinker")
    assert stage["spec"]["autoscaling"]["minReplicas"] == 2
    assert stage["spec"]["autoscaling"]["maxReplicas"] == 5
    assert stage["spec"]["autoscaling"]["targetQueueDepth"] == 4
    assert stage["spec"]["replicas"] == 2
    assert find(objects, "Deployment", "qwen3-omni-thinker")["spec"]["replicas"] == 2
    assert "autoscaling" not in find(objects, "OmniStage", "qwen3-omni-talker")["spec"]


def test_autoscaling_bounds_do_not_roll_pods():
    manifest = load("qwen3-omni.yaml")
    manifest["spec"]["stages"][0]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 5}
    first = hashes(render(manifest))
    manifest["spec"]["stages"][0]["autoscaling"]["maxReplicas"] = 8
    second = hashes(render(manifest))
    assert first["qwen3-omni-thinker"]["template"] == second["qwen3-omni-thinker"]["template"]
    assert first["qwen3-omni-thinker"]["omnistage"] != second["qwen3-omni-thinker"]["omnistage"]


def test_ascend_sample_tolerates_the_npu_taint_and_requests_an_npu():
    objects = render(load("ascend-chat.yaml"))
    deployment = find(objects, "Deployment", "ascend-chat-llm")
    pod = deployment["spec"]["template"]["spec"]
    tolerations = [{k: v for k, v in t.items() if v != ""} for t in pod["tolerations"]]  # value "" == unset
    assert tolerations == [{"key": "huawei.com/Ascend910", "operator": "Exists", "effect": "NoSchedule"}]
    llm = containers(deployment)["llm"]
    assert llm["resources"]["requests"]["huawei.com/Ascend910"] == "1"
    assert llm["resources"]["limits"]["huawei.com/Ascend910"] == "1"
    assert not any("nvidia" in key for part in llm["resources"].values() for key in part)
    assert llm["image"].endswith("-npu")


def test_cpu_sample_requests_no_accelerator_and_mounts_the_host_model_folder():
    objects = render(load("tiny-chat-cpu.yaml"))
    deployment = find(objects, "Deployment", "tiny-chat-llm")
    pod = deployment["spec"]["template"]["spec"]
    llm = containers(deployment)["llm"]
    assert set(llm["resources"]["requests"]) == {"cpu", "memory"}
    assert "limits" not in llm["resources"]
    assert "tolerations" not in pod
    cache = next(v for v in pod["volumes"] if v["name"] == "model-cache")
    assert cache["hostPath"]["path"] == "/var/lib/omnikube/models"
    assert {"name": "model-cache", "mountPath": "/models", "readOnly": True} in llm["volumeMounts"]


# --- errors ---------------------------------------------------------------------------------------


def with_change(change) -> dict[str, Any]:
    manifest = load("qwen3-omni.yaml")
    change(manifest["spec"])
    return manifest


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        pytest.param(
            lambda s: s["stages"].append({"name": "vocoder"}),
            [r"stages\[3\]\.name", "'vocoder'", r"\['thinker', 'talker', 'code2wav'\]"],
            id="unknown-stage",
        ),
        pytest.param(
            lambda s: s.update(pipeline="no-such-pipeline"),
            ["pipeline 'no-such-pipeline' is unknown", "qwen3-omni", "text-chat", "prompt-enhanced-t2i"],
            id="unknown-pipeline",
        ),
        pytest.param(
            lambda s: s["stages"][2].pop("colocateWith"),
            ["talker->code2wav", "'shm' needs both stages in one pod", "colocateWith"],
            id="shm-across-pods",
        ),
        pytest.param(
            lambda s: s["connectors"]["edges"].append({"from": "thinker", "to": "code2wav"}),
            [r"connectors\.edges\[2\]", "thinker->code2wav"],
            id="unknown-edge",
        ),
        pytest.param(
            lambda s: s["stages"][0].update(replicas=-1), [r"spec\.stages\[0\]\.replicas"], id="negative-replicas"
        ),
    ],
)
def test_render_errors_name_the_field(change, expected: list[str]):
    with pytest.raises(RenderError) as err:
        render(with_change(change))
    for pattern in expected:
        assert re.search(pattern, str(err.value)), (pattern, str(err.value))


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(OMNIKUBE), "render", *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_cli_render_prints_the_objects_as_yaml():
    result = run_cli("-f", str(SAMPLES / "qwen3-omni.yaml"))
    assert result.returncode == 0, result.stderr
    docs = list(yaml.safe_load_all(result.stdout))
    assert docs == render(load("qwen3-omni.yaml"))


def test_cli_render_no_owner_references():
    result = run_cli("-f", str(SAMPLES / "tiny-chat-cpu.yaml"), "--no-owner-references")
    assert result.returncode == 0, result.stderr
    docs = list(yaml.safe_load_all(result.stdout))
    assert docs and all("ownerReferences" not in d["metadata"] for d in docs)


def test_cli_render_a_bad_file_exits_1_naming_the_field(tmp_path: Path):
    manifest = load("qwen3-omni.yaml")
    manifest["spec"]["stages"][0]["name"] = "thinkr"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(manifest))
    result = run_cli("-f", str(path))
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith("error:")
    assert "OmniPipeline qwen3-omni" in result.stderr
    assert "stages[0].name" in result.stderr and "'thinkr'" in result.stderr


def test_cli_render_a_missing_file_exits_1(tmp_path: Path):
    result = run_cli("-f", str(tmp_path / "absent.yaml"))
    assert result.returncode == 1
    assert result.stderr.startswith("error:") and "absent.yaml" in result.stderr


def test_router_placement_reaches_the_router_pod_only() -> None:
    toleration = {"key": "dedicated", "operator": "Equal", "value": "routers", "effect": "NoSchedule"}
    manifest = {
        "apiVersion": "omnikube.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": "placed"},
        "spec": {
            "model": "/models/m",
            "pipeline": "text-chat",
            "router": {"nodeSelector": {"pool": "cpu"}, "tolerations": [toleration]},
        },
    }
    objects = {(o["kind"], workload_name(o)): o for o in render(manifest)}
    router = objects[("Deployment", "placed-router")]["spec"]["template"]["spec"]
    assert router["nodeSelector"] == {"pool": "cpu"}
    assert router["tolerations"] == [toleration]
    stage = objects[("Deployment", "placed-llm")]["spec"]["template"]["spec"]
    assert "nodeSelector" not in stage and "tolerations" not in stage


@pytest.mark.parametrize("value", ["12e45", "0123", "0x1F", "1_000", "on", "No", "null", "~", "", "1.5", "12:30"])
def test_rendered_yaml_quotes_strings_other_yaml_readers_would_not_read_as_strings(value: str) -> None:
    """A spec hash like `12e45` is a number to kubectl's YAML reader; render must quote it."""
    from omni_operator.render import dump_yaml

    out = dump_yaml([{"metadata": {"annotations": {"omnikube.io/spec-hash": value}}}])
    assert f"'{value}'" in out
    assert yaml.safe_load(out)["metadata"]["annotations"]["omnikube.io/spec-hash"] == value


def test_router_api_key_is_a_secret_file_the_router_command_reads_and_liveness_is_livez() -> None:
    from omni_operator.builders.router import API_KEY_FILE
    from omni_runtime.cli import build_parser

    manifest = {
        "apiVersion": "omnikube.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": "keyed"},
        "spec": {
            "model": "/models/m",
            "pipeline": "text-chat",
            "router": {"apiKeySecret": {"name": "router-key", "key": "token"}, "limits": {"maxN": 4, "maxTokens": 99}},
        },
    }
    objects = render(manifest)
    pod = find(objects, "Deployment", "keyed-router")["spec"]["template"]["spec"]
    router = containers(find(objects, "Deployment", "keyed-router"))["router"]
    # A file from a Secret volume (the kubelet refreshes it), never an env var (fixed at start).
    assert not any("secretKeyRef" in e.get("valueFrom", {}) for e in router.get("env", []))
    (volume,) = [v for v in pod["volumes"] if "secret" in v and v["name"] != "pipeline-key"]
    assert volume["secret"] == {"secretName": "router-key", "items": [{"key": "token", "path": "api-key"}]}
    (mount,) = [m for m in router["volumeMounts"] if m["name"] == volume["name"]]
    assert API_KEY_FILE == f"{mount['mountPath']}/api-key" and mount["readOnly"]
    assert "subPath" not in mount  # a subPath mount would never see a rotated key
    args = build_parser().parse_args(router["command"][1:])
    assert args.api_key_file == API_KEY_FILE
    # Liveness is the process only; readiness waits for the stages.
    assert router["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert router["readinessProbe"]["httpGet"]["path"] == "/health"
    limits = resolved_config(objects, "keyed")["limits"]
    assert (limits["max_n"], limits["max_tokens"]) == (4, 99)

    del manifest["spec"]["router"]["apiKeySecret"]
    plain = containers(find(render(manifest), "Deployment", "keyed-router"))["router"]
    assert build_parser().parse_args(plain["command"][1:]).api_key_file is None


def test_router_liveness_probe_timing_comes_from_the_spec() -> None:
    """`router.livenessProbe`: 10 s x 6 unless set; set, the router container's probe uses it."""
    probe = containers(find(render(minimal("text-chat")), "Deployment", "p-router"))["router"]["livenessProbe"]
    assert (probe["periodSeconds"], probe["failureThreshold"]) == (10, 6)
    quick = render(minimal("text-chat", router={"livenessProbe": {"periodSeconds": 3, "failureThreshold": 2}}))
    probe = containers(find(quick, "Deployment", "p-router"))["router"]["livenessProbe"]
    assert (probe["periodSeconds"], probe["failureThreshold"]) == (3, 2)
    assert probe["httpGet"]["path"] == "/livez"
    with pytest.raises(RenderError, match="periodSeconds|period_seconds"):
        render(minimal("text-chat", router={"livenessProbe": {"periodSeconds": 0}}))


# --- router.unknownFields --------------------------------------------------------------------------


def test_router_unknown_fields_reaches_the_routers_config() -> None:
    """`router.unknownFields` is what the router pod reads (its resolved config), default `reject`."""
    default = render(minimal("text-chat"))
    assert resolved_config(default, "p")["limits"]["unknown_fields"] == "reject"
    lenient = render(minimal("text-chat", router={"unknownFields": "ignore"}))
    assert resolved_config(lenient, "p")["limits"]["unknown_fields"] == "ignore"
    with pytest.raises(RenderError, match="unknownFields"):
        render(minimal("text-chat", router={"unknownFields": "sometimes"}))


# --- router.videos and router.limits.videos ---------------------------------------------------------


def test_router_videos_storage_limits_and_peers_reach_the_router() -> None:
    """Finished videos go on an emptyDir of `maxBytes` by default, on the named PVC otherwise; the TTL, the
    size cap and `limits.videos` reach the router's config; the router finds the other replicas (video job
    owners) through its own Service and advertises its pod IP."""
    from omni_operator.builders.router import VIDEOS_MOUNT
    from omni_runtime.cli import build_parser

    objects = render(minimal("wan2-2-t2v", router={"replicas": 2}))
    pod = find(objects, "Deployment", "p-router")["spec"]["template"]["spec"]
    router = containers(find(objects, "Deployment", "p-router"))["router"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "videos"]
    assert volume == {"name": "videos", "emptyDir": {"sizeLimit": "10Gi"}}
    assert {"name": "videos", "mountPath": VIDEOS_MOUNT} in router["volumeMounts"]
    args = build_parser().parse_args(router["command"][1:])
    assert (args.videos_dir, args.peers_service, args.advertise_host) == (VIDEOS_MOUNT, "p-router", "$(POD_IP)")
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in router["env"]
    videos = resolved_config(objects, "p")["limits"]["videos"]
    assert (videos["ttl_s"], videos["max_bytes"], videos["max_frames"]) == (86400.0, 10 * 1024**3, 241)

    kept = render(
        minimal(
            "wan2-2-t2v",
            router={
                "videos": {"volumeClaim": "videos-pvc", "ttlSeconds": 600, "maxBytes": "2Gi"},
                "limits": {"videos": {"maxFrames": 81, "maxPixels": 409600, "maxInferenceSteps": 30,
                                      "maxConcurrentJobs": 3, "maxQueuedJobs": 0}},
            },
        )
    )  # fmt: skip
    pod = find(kept, "Deployment", "p-router")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "videos"]
    assert volume == {"name": "videos", "persistentVolumeClaim": {"claimName": "videos-pvc"}}
    assert resolved_config(kept, "p")["limits"]["videos"] == {
        "max_frames": 81, "max_pixels": 409600, "max_inference_steps": 30, "max_concurrent_jobs": 3,
        "max_queued_jobs": 0, "ttl_s": 600.0, "max_bytes": 2 * 1024**3,
    }  # fmt: skip
    with pytest.raises(RenderError, match="volumeClaim"):
        render(minimal("wan2-2-t2v", router={"videos": {"volumeClaim": "Not_A_Name"}}))
