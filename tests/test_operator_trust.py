"""Trust and posture in what the operator builds, offline: the key Secret and its mounts, the
NetworkPolicies, and how every pod and container runs. The cluster side (the operator applying them,
name collisions) is in e2e/test_operator_cluster.py."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import yaml
from servelib import template_hash

from omni_operator.api import OmniPipeline, OmniStage
from omni_operator.builders.meta import LABEL_PIPELINE
from omni_operator.builders.pipeline_objects import KEY_VERSION_ANNOTATION, build_omnistages
from omni_operator.builders.router import build_router_objects
from omni_operator.builders.stage_workload import RUNTIME_HOME, build_stage_deployment
from omni_operator.builders.trust import KEY_FILE, KEY_MOUNT, build_key_secret, build_network_policies
from omni_operator.render import PLACEHOLDER_UID, render_pipeline
from omni_runtime.cli import build_parser
from omni_runtime.registry import default_registry
from omni_runtime.spec import ROUTER_PORT, ResolvedPipeline

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_FILES = sorted((ROOT / "config" / "samples").glob("*.yaml"))
REGISTRY = default_registry()
OWNER = {
    "apiVersion": "omnikube.io/v1alpha1",
    "kind": "OmniPipeline",
    "metadata": {"name": "p", "namespace": "ns", "uid": "u-1"},
}


def render(path: Path) -> list[dict[str, Any]]:
    return render_pipeline(yaml.safe_load(path.read_text()), REGISTRY)


def mooncake_t2i() -> dict[str, Any]:
    return {
        "apiVersion": "omnikube.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": "p"},
        "spec": {
            "model": "some/model",
            "pipeline": "prompt-enhanced-t2i",
            "connectors": {"default": "mooncake"},
        },
    }


def deployments(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == "Deployment"]


ALL = [*SAMPLE_FILES, "mooncake"]


def objects_of(which: Path | str) -> list[dict[str, Any]]:
    return render_pipeline(mooncake_t2i(), REGISTRY) if which == "mooncake" else render(which)  # type: ignore[arg-type]


def test_key_secret_is_random_bytes_owned_by_the_pipeline() -> None:
    secret = build_key_secret(OWNER, b"k" * 32)
    assert secret["metadata"]["name"] == "p-key" and secret["metadata"]["namespace"] == "ns"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert base64.b64decode(secret["data"]["key"]) == b"k" * 32
    assert secret["type"] == "Opaque"


@pytest.mark.parametrize("which", ALL, ids=lambda p: getattr(p, "stem", p))
def test_render_never_contains_the_key_secret(which) -> None:
    assert not [o for o in objects_of(which) if o["kind"] == "Secret"]


@pytest.mark.parametrize("which", ALL, ids=lambda p: getattr(p, "stem", p))
def test_router_and_stage_containers_read_the_key_from_the_mounted_secret(which) -> None:
    """Every process that speaks the stage protocol gets --pipeline-key-file at the Secret's mount, and the
    command parses with the real CLI parser."""
    objects = objects_of(which)
    pipeline = next(o for o in objects if o["kind"] == "ConfigMap")["metadata"]["labels"][LABEL_PIPELINE]
    for deployment in deployments(objects):
        if deployment["metadata"]["labels"]["app.kubernetes.io/component"] == "mooncake":
            continue  # the pipeline's Mooncake master speaks no stage protocol: no key
        pod = deployment["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["pipeline-key"]["secret"]["secretName"] == f"{pipeline}-key"
        assert volumes["pipeline-key"]["secret"]["defaultMode"] == 0o440
        assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]  # so 0440 is readable
        for container in pod["containers"]:
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            assert mounts[KEY_MOUNT]["readOnly"] is True and mounts[KEY_MOUNT]["name"] == "pipeline-key"
            args = build_parser().parse_args(container["command"][1:])
            assert args.pipeline_key_file == KEY_FILE, (deployment["metadata"]["name"], container["name"])


@pytest.mark.parametrize("which", ALL, ids=lambda p: getattr(p, "stem", p))
def test_every_container_runs_restricted_with_a_read_only_root(which) -> None:
    for deployment in deployments(objects_of(which)):
        name = deployment["metadata"]["name"]
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in pod["containers"]:
            sc = container["securityContext"]
            assert sc == {
                "runAsNonRoot": True,
                "allowPrivilegeEscalation": False,
                "capabilities": {"drop": ["ALL"]},
                "readOnlyRootFilesystem": True,
                "seccompProfile": {"type": "RuntimeDefault"},
            }, (name, container["name"])
            # What a read-only root still needs writable is an emptyDir.
            writable = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
            assert "emptyDir" in writable["/tmp"], (name, container["name"])
            if container["name"] not in ("router", "mooncake-master"):
                assert "emptyDir" in writable[RUNTIME_HOME] and "emptyDir" in writable["/dev/shm"]


@pytest.mark.parametrize("which", ALL, ids=lambda p: getattr(p, "stem", p))
def test_only_the_router_gets_a_service_account_token(which) -> None:
    for deployment in deployments(objects_of(which)):
        pod = deployment["spec"]["template"]["spec"]
        if deployment["metadata"]["labels"]["app.kubernetes.io/component"] == "router":
            assert pod["serviceAccountName"].endswith("-router") and "automountServiceAccountToken" not in pod
        else:
            assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod


def test_dockerfile_creates_the_home_the_stages_mount_writable() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "useradd --uid 1000 --create-home omnikube" in dockerfile and RUNTIME_HOME == "/home/omnikube"


def test_network_policies_admit_clients_only_to_the_router_http_port() -> None:
    objects = render_pipeline(mooncake_t2i(), REGISTRY)
    policies = {o["metadata"]["name"]: o for o in objects if o["kind"] == "NetworkPolicy"}
    rendered_owner = {**OWNER, "metadata": {"name": "p", "namespace": "default", "uid": PLACEHOLDER_UID}}
    built = build_network_policies(rendered_owner, _resolved(objects))
    assert policies == {p["metadata"]["name"]: p for p in built}  # render shows what the operator applies
    assert set(policies) == {"p-pipeline", "p-router-clients", "p-stage-probes"}
    for policy in policies.values():
        assert policy["spec"]["policyTypes"] == ["Ingress"] and "egress" not in policy["spec"]

    # Every pod of the pipeline is isolated and reachable, on any port, from the pipeline's own pods:
    # stage protocol, Mooncake master/metadata (router pod) and transfer-engine ports (stage pods).
    own = policies["p-pipeline"]["spec"]
    assert own["podSelector"] == {"matchLabels": {LABEL_PIPELINE: "p"}}
    assert own["ingress"] == [{"from": [{"podSelector": {"matchLabels": {LABEL_PIPELINE: "p"}}}]}]

    # From anywhere: the router's HTTP port only (no `from`: any source; `ports`: that one port).
    clients = policies["p-router-clients"]["spec"]
    assert clients["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    assert clients["ingress"] == [{"ports": [{"protocol": "TCP", "port": ROUTER_PORT}]}]

    # Stage probe/metrics ports stay open to kubelets and Prometheus; the protocol port does not.
    probes = policies["p-stage-probes"]["spec"]
    assert probes["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "stage"
    (rule,) = probes["ingress"]
    assert "from" not in rule and [p["port"] for p in rule["ports"]] == [8101]

    # Every pod the pipeline runs is selected by the pipeline policy, so none is left open.
    for deployment in deployments(objects):
        assert deployment["spec"]["template"]["metadata"]["labels"][LABEL_PIPELINE] == "p"


def test_colocated_stages_each_keep_their_probe_port_open() -> None:
    objects = render(ROOT / "config" / "samples" / "qwen3-omni.yaml")
    probes = next(o for o in objects if o["kind"] == "NetworkPolicy" and o["metadata"]["name"].endswith("-probes"))
    ports = [p["port"] for p in probes["spec"]["ingress"][0]["ports"]]
    talker = next(o for o in deployments(objects) if len(o["spec"]["template"]["spec"]["containers"]) > 1)
    http_ports = {
        p["containerPort"]
        for c in talker["spec"]["template"]["spec"]["containers"]
        for p in c["ports"]
        if p["name"].startswith("http")
    }
    assert http_ports <= set(ports) and 8100 not in ports and 8110 not in ports


def test_a_new_key_secret_rolls_every_pod() -> None:
    """Processes read the key once, at start: a recreated Secret (new uid) must restart every pod."""
    resolved = _resolved(render_pipeline(mooncake_t2i(), REGISTRY))
    owner = {**mooncake_t2i(), "metadata": {"name": "p", "namespace": "default", "uid": "u-1"}}
    pipeline = OmniPipeline.model_validate(owner)

    def pod_hashes(version: str) -> list[str]:
        stages = build_omnistages(owner, pipeline, resolved, key_version=version)
        assert all(s["metadata"]["annotations"][KEY_VERSION_ANNOTATION] == version for s in stages)
        workloads = [
            build_stage_deployment(OmniStage.model_validate({**s, "metadata": {**s["metadata"], "uid": "s"}}))
            for s in stages
        ]
        workloads += [o for o in build_router_objects(owner, pipeline, resolved, key_version=version)]
        return [template_hash(d) for d in workloads if d["kind"] == "Deployment"]

    before, after = pod_hashes("uid-a"), pod_hashes("uid-b")
    assert len(before) == 3 and all(a != b for a, b in zip(before, after, strict=True))


def _resolved(objects: list[dict[str, Any]]) -> ResolvedPipeline:
    configmap = next(o for o in objects if o["kind"] == "ConfigMap")
    return ResolvedPipeline.model_validate_json(configmap["data"]["resolved.json"])


def test_an_object_of_someone_else_is_a_collision_and_one_of_a_deleted_predecessor_is_waited_for() -> None:
    from omni_operator.reconcile import NameCollision, TemporaryError, _check_owner

    desired = build_network_policies(OWNER, _resolved(render_pipeline(mooncake_t2i(), REGISTRY)))[0]
    ours = {"metadata": {"ownerReferences": [{"kind": "OmniPipeline", "name": "p", "uid": "u-1"}]}}
    _check_owner(ours, desired)  # ours: nothing to say

    for users in (
        {"metadata": {}},
        {"metadata": {"ownerReferences": [{"kind": "Deployment", "name": "web", "uid": "x"}]}},
    ):
        with pytest.raises(NameCollision) as collision:
            _check_owner(users, desired)
        cond = collision.value.condition()
        assert (cond.type, cond.status, cond.reason) == ("Degraded", "True", "NameCollision")
        assert "NetworkPolicy 'p-pipeline' already exists in namespace ns" in cond.message
        assert "leaves it untouched" in cond.message

    predecessor = {"metadata": {"ownerReferences": [{"kind": "OmniPipeline", "name": "p", "uid": "old"}]}}
    with pytest.raises(TemporaryError, match="still belongs to a deleted OmniPipeline p"):
        _check_owner(predecessor, desired)
