"""The Helm chart without a cluster: CRDs in step with crds/, values against their schema, RBAC in step
with the code, and the operator arguments the real `helm template` renders parsed by the real `omnikube`
parser. Install, upgrade and the RBAC proof against a real apiserver are in e2e/test_helm_chart.py."""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kopf
import pytest
import yaml

from omni_operator import (
    handlers,  # noqa: F401 - registers the kopf watches read below
    runner,
)
from omni_operator.kube import RESOURCES
from omni_operator.render import render_pipeline
from omni_operator.runner import OperatorConfig
from omni_runtime.cli import build_parser
from omni_runtime.registry import load_registry

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "omnikube"
SAMPLES = ROOT / "config" / "samples"


def _load_sync_script():
    spec = importlib.util.spec_from_file_location("sync_chart_crds", ROOT / "hack" / "sync-chart-crds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- CRDs ------------------------------------------------------------------------------------------


def test_chart_crds_equal_the_generated_crds():
    problems = _load_sync_script().drift()
    assert not problems, (
        "the chart's CRDs drifted from crds/:\n" + "\n".join(problems) + "\nrun: python hack/sync-chart-crds.py"
    )


def test_chart_crds_are_small_enough_to_apply():
    for path in (CHART / "files" / "crds").glob("*.yaml"):
        # etcd's object limit is 1.5 MB and Helm's release Secret 1 MB (gzipped chart inside); stay far below.
        assert path.stat().st_size < 512 * 1024, f"{path.name}: {path.stat().st_size} bytes"


def test_crd_template_can_find_each_crds_metadata():
    # templates/crds.yaml inserts Helm's labels and the keep annotation right after this anchor and fails
    # the render otherwise; keep the generator's output in that shape.
    for path in (CHART / "files" / "crds").glob("*.yaml"):
        assert "\nmetadata:\n  labels:\n" in path.read_text(), path.name


# --- Chart.yaml and values -------------------------------------------------------------------------


def test_chart_metadata():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "omnikube"
    assert chart["version"] == "0.1.0"
    assert chart["appVersion"] == importlib.metadata.version("omnikube"), "appVersion is the operator's version"


def _values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def _validator() -> jsonschema.Draft7Validator:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def test_default_values_match_the_schema():
    errors = [e.message for e in _validator().iter_errors(_values())]
    assert not errors, errors


def _with(values: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(values)
    *parents, leaf = dotted.split(".")
    node = out
    for key in parents:
        node = node[key]
    node[leaf] = value
    return out


@pytest.mark.parametrize(
    ("dotted", "value"),
    [
        ("replicas", "two"),
        ("replicas", -1),
        ("image.pullPolicy", "Sometimes"),
        ("watchNamespaces", ["Bad_Namespace"]),
        ("watchNamespaces", ["a", "a"]),
        ("liveness.port", 70000),
        ("metrics.port", "9090"),
        ("crds.keep", "yes"),
        ("serviceMonitor.interval", "soon"),
        ("resources.requests", {"cpu": "lots"}),
        ("typo", 1),
        ("operator.workerz", 4),
        ("leaderElection.enabled", False),  # with the default 2 replicas: both would act
    ],
)
def test_schema_rejects_bad_values(dotted, value):
    bad = _with(_values(), dotted, value)
    assert list(_validator().iter_errors(bad)), f"{dotted}={value!r} should be rejected"


def test_schema_accepts_one_replica_without_leader_election():
    values = _with(_with(_values(), "leaderElection.enabled", False), "replicas", 1)
    assert not list(_validator().iter_errors(values))


def test_templates_only_read_values_that_exist():
    values = _values()
    missing = []
    for template in (CHART / "templates").iterdir():
        for path in re.findall(r"\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)", template.read_text()):
            node: Any = values
            for key in path.strip(".").split("."):
                if not isinstance(node, dict) or key not in node:
                    missing.append(f"{template.name}: .Values{path}")
                    break
                node = node[key]
    assert not missing, missing


# --- the rendered chart: `helm template`, and the operator's arguments through the real parser ------

RELEASE_NAMESPACE = "omnikube-system"


@pytest.fixture(scope="module")
def helm() -> str:
    """The helm binary of the local control plane (e2e/cluster/build.sh builds it or reuses the cached one,
    waiting for a build already running, and prints its folder)."""
    out = subprocess.run(
        ["bash", str(ROOT / "e2e" / "cluster" / "build.sh")], capture_output=True, text=True, timeout=3600
    )
    assert out.returncode == 0, f"e2e/cluster/build.sh exited {out.returncode}:\n{out.stderr[-3000:]}"
    return str(Path(out.stdout.strip().splitlines()[-1]) / "helm")


def _template(helm: str, workdir: Path, values: dict[str, Any]) -> list[dict[str, Any]]:
    """The objects `helm template` renders for the chart with `values` over values.yaml."""
    workdir.mkdir(parents=True, exist_ok=True)
    values_file = workdir / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    home = {f"HELM_{d}_HOME": str(workdir / d.lower()) for d in ("CACHE", "CONFIG", "DATA")}  # not ~/.config
    out = subprocess.run(
        [helm, "template", "rel", str(CHART), "--namespace", RELEASE_NAMESPACE, "-f", str(values_file)],
        capture_output=True, text=True, timeout=120, env={**os.environ, **home},
    )  # fmt: skip
    assert out.returncode == 0, f"helm template exited {out.returncode}:\n{out.stderr}"
    return [o for o in yaml.safe_load_all(out.stdout) if o]


def _operator_container(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the operator Deployment, its `operator` container)."""
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "operator"]
    return deployment, container


def _operator_config(
    container: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> OperatorConfig:
    """The OperatorConfig the container's command line gives: parsed by the real `omnikube` parser and
    turned into a config by the real `omnikube operator` command. Only the operator's run is replaced (it
    needs an apiserver): it records the config it is given."""
    assert container["command"] == ["omnikube", "operator"]
    (script,) = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "omnikube"]
    assert script.value == "omni_runtime.cli:main"  # the parser below is the one that command runs
    argv = [*container["command"][1:], *container["args"]]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"omnikube refuses the chart's operator arguments {argv}:\n{capsys.readouterr().err}")
    recorded: list[OperatorConfig] = []

    async def run_operator(config: OperatorConfig) -> None:
        recorded.append(config)

    monkeypatch.setattr(runner, "run_operator", run_operator)
    monkeypatch.delenv("POD_NAMESPACE", raising=False)  # the Lease's namespace must come from the arguments
    assert args.func(args) == 0
    (config,) = recorded
    return config


def _default_config() -> dict[str, Any]:
    """What the operator is given with values.yaml as it is."""
    values = _values()
    return {
        "namespaces": values["watchNamespaces"],
        "workers": values["operator"]["workers"],
        "resync_seconds": float(values["operator"]["resyncSeconds"]),
        "leader_election": values["leaderElection"]["enabled"],
        "lease_namespace": RELEASE_NAMESPACE,
        "lease_name": OperatorConfig().lease_name,
        "liveness_port": values["liveness"]["port"],
        "metrics_port": values["metrics"]["port"],
        "pipelines_dirs": [],
        "model_root": None,
        "kubeconfig": None,
        "capacity_check": values["capacityCheck"]["enabled"],
    }


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        pytest.param({}, {}, id="defaults"),
        pytest.param(
            {"replicas": 1, "leaderElection": {"enabled": False}},
            {"leader_election": False, "lease_namespace": "default"},  # no flag: OperatorConfig's own default
            id="no-leader-election",
        ),
        pytest.param(
            {"watchNamespaces": ["team-a", "team-b"]}, {"namespaces": ["team-a", "team-b"]}, id="two-namespaces"
        ),
        pytest.param(
            {"operator": {"extraArgs": ["--pipelines-dir", "/etc/omnikube/pipelines", "--model-cache=/models"]}},
            {"pipelines_dirs": [Path("/etc/omnikube/pipelines")], "model_root": Path("/models")},
            id="extra-args",  # the first two are values.yaml's own example
        ),
        pytest.param(
            {"operator": {"workers": 3, "resyncSeconds": 45}, "liveness": {"port": 8181}, "metrics": {"port": 9191}},
            {"workers": 3, "resync_seconds": 45.0, "liveness_port": 8181, "metrics_port": 9191},
            id="workers-resync-ports",
        ),
        pytest.param({"capacityCheck": {"enabled": False}}, {"capacity_check": False}, id="no-capacity-check"),
    ],
)
def test_the_operator_runs_with_the_values_the_chart_was_given(
    helm: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    values: dict[str, Any],
    expected: dict[str, Any],
) -> None:
    """The chart's operator arguments through the real parser: a flag renamed in omni_operator/cli.py (and
    every installed operator crash-looping on it) fails here; so does a value that does not arrive."""
    _, container = _operator_container(_template(helm, tmp_path, values))
    config = _operator_config(container, monkeypatch, capsys)
    want = {**_default_config(), **expected}
    assert {name: getattr(config, name) for name in want} == want, container["args"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"healthz": want["liveness_port"], "metrics": want["metrics_port"]}  # what the probe reads


def test_defaults_are_the_documented_ones(
    helm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the chart's README and values.yaml comments promise a default install, read from the real
    render of the default values: a default changed without its words (or words without the default) fails."""
    readme = (CHART / "README.md").read_text()
    objects = _template(helm, tmp_path, {})
    kinds = [o["kind"] for o in objects]
    deployment, container = _operator_container(objects)
    pod = deployment["spec"]["template"]["spec"]
    config = _operator_config(container, monkeypatch, capsys)

    # README: "kopf's `/healthz` on `liveness.port` (8080), Prometheus `/metrics` on `metrics.port` (9090, ..."
    documented = {name: int(port) for name, port in re.findall(r"`(liveness|metrics)\.port` \((\d+)", readme)}
    assert sorted(documented) == ["liveness", "metrics"], "the README no longer names the two ports"
    assert (config.liveness_port, config.metrics_port) == (documented["liveness"], documented["metrics"])
    probe = container["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz" and probe["port"] == "healthz"

    # README: "leader elected on a Lease, so extra replicas only stand by" and "a Role on the
    # `omnikube-operator` Lease in the release namespace".
    lease = re.search(r"a Role on the `([a-z0-9-]+)` Lease in the release namespace", readme)
    assert lease, "the README no longer names the Lease"
    assert deployment["spec"]["replicas"] > 1 and config.leader_election
    assert (config.lease_name, config.lease_namespace) == (lease.group(1), RELEASE_NAMESPACE)

    # values.yaml: "Namespaces whose OmniPipelines the operator serves. Empty: all namespaces, with a ClusterRole."
    assert config.namespaces == [] and "ClusterRole" in kinds

    # values.yaml: "Image tag; empty means the chart's appVersion."
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert container["image"].endswith(f":{app_version}")

    # README: "With `crds.keep` (the default) `helm uninstall` leaves them".
    crds = [o for o in objects if o["kind"] == "CustomResourceDefinition"]
    assert len(crds) == 2
    assert all(c["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep" for c in crds)

    # README: "optionally, a Prometheus Operator ServiceMonitor"; the pipelines' monitoring: "each off by default".
    assert not {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap"} & set(kinds)

    # values.yaml: "non-root (the image's user is uid 1000), RuntimeDefault seccomp" and "read-only root
    # filesystem (/tmp is an emptyDir), no capabilities".
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == 1000
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    (tmp,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert [v for v in pod["volumes"] if v["name"] == tmp["name"]][0].get("emptyDir") is not None


# --- RBAC in step with the code --------------------------------------------------------------------


def _operator_rules(block_name: str = "operatorRules") -> list[dict[str, Any]]:
    """The rules of templates/rbac.yaml's "omnikube.<block_name>" block (plain YAML, no directives)."""
    text = (CHART / "templates" / "rbac.yaml").read_text()
    block = re.search(r'\{\{- define "omnikube\.' + block_name + r'" -\}\}\n(.*?)\{\{- end \}\}', text, re.S)
    assert block, f"templates/rbac.yaml has no omnikube.{block_name} block"
    return yaml.safe_load(block.group(1))


def _grants(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def _group(api_version: str) -> str:
    return api_version.rpartition("/")[0]


def _needed() -> tuple[set[tuple[str, str, str]], list[dict[str, Any]]]:
    """(group, resource, verb) the operator's requests need, and the router Roles it creates."""
    plural = {(_group(av), kind): p for (av, kind), (p, _) in RESOURCES.items()}
    need: set[tuple[str, str, str]] = set()
    # kopf watches: a list, then a watch, per resource.
    for handler in kopf.get_default_registry()._watching.get_all_handlers():
        selector = handler.selector
        for verb in ("list", "watch"):
            need.add((selector.group, selector.plural or selector.any_name, verb))
    # What the builders make is applied (get, then a server-side apply that may create).
    registry = load_registry([])
    roles = []
    for sample in sorted(SAMPLES.glob("*.yaml")):
        for obj in render_pipeline(yaml.safe_load(sample.read_text()), registry):
            group = _group(obj["apiVersion"])
            for verb in ("get", "create", "patch"):
                need.add((group, plural[(group, obj["kind"])], verb))
            if obj["kind"] == "Role":
                roles.append(obj)
    # reconcile.py, by hand: reads, status and scale writes, the stage delete, Secrets, Events.
    need |= {
        ("omnikube.io", "omnipipelines", "get"),
        ("omnikube.io", "omnistages", "list"),
        ("omnikube.io", "omnistages", "delete"),
        ("apps", "deployments", "delete"),  # the Mooncake master unused; a stage's older generation, retired
        ("", "configmaps", "delete"),  # a generation ConfigMap no generation reads (reconcile, after a rollout)
        ("", "services", "delete"),
        ("omnikube.io", "omnipipelines/status", "patch"),
        ("omnikube.io", "omnistages/status", "patch"),
        ("omnikube.io", "omnistages/scale", "patch"),
        # blockOwnerDeletion on owner references (OwnerReferencesPermissionEnforcement).
        ("omnikube.io", "omnipipelines/finalizers", "update"),
        ("omnikube.io", "omnistages/finalizers", "update"),
        ("", "pods", "list"),
        ("", "secrets", "get"),
        ("", "secrets", "create"),  # the pipeline key Secret, created once (reconcile._ensure_key_secret)
        ("", "events", "create"),
    }
    # reconcile._ensure_autoscaler: a stage's ScaledObject or HPA (no sample autoscales), removed when unused.
    for group, plural in (("keda.sh", "scaledobjects"), ("autoscaling", "horizontalpodautoscalers")):
        need |= {(group, plural, verb) for verb in ("get", "create", "patch", "delete")}
    # RBAC escalation prevention: the operator must hold whatever the Roles it creates grant.
    for role in roles:
        need |= _grants(role["rules"])
    return need, roles


def test_operator_rules_are_exactly_what_the_code_needs():
    granted = _grants(_operator_rules())
    needed, roles = _needed()
    assert roles, "the samples should render a router Role"
    assert granted - needed == set(), f"granted but never used: {sorted(granted - needed)}"
    assert needed - granted == set(), f"used but not granted: {sorted(needed - granted)}"


async def test_the_capacity_rules_are_exactly_what_counting_free_accelerators_lists() -> None:
    """reconcile._count_free_accelerators lists nodes and every namespace's pods, nothing else, and only with
    the capacity rules (their own ClusterRole: capacityCheck.enabled)."""
    from omni_operator.api import OmniPipeline
    from omni_operator.api.rollout import GenerationStatus
    from omni_operator.reconcile import Context, _count_free_accelerators
    from omni_operator.resolve import resolve_cluster_pipeline
    from omni_operator.rollout import GroupView

    class Recording:
        def __init__(self) -> None:
            self.calls: list[tuple[str, str, str | None]] = []

        async def list(self, api_version, kind, namespace=None, label_selector=None, field_selector=None):
            self.calls.append((api_version, kind, namespace))
            return []

    live = {"apiVersion": "omnikube.io/v1alpha1", "kind": "OmniPipeline",
            "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
            "spec": {"model": "/models/m", "pipeline": "text-chat",
                     "stages": [{"name": "llm", "accelerator": {"type": "nvidia.com/gpu", "count": 2}}]}}  # fmt: skip
    pipeline = OmniPipeline.model_validate(live)
    registry = load_registry([])
    resolved = resolve_cluster_pipeline(pipeline, registry, None)
    kube = Recording()
    ctx = Context(kube=kube, registry=registry)  # type: ignore[arg-type]
    old = GenerationStatus(contract="old", deployment="p-llm-old", current=False, replicas=1, ready_replicas=1)
    view = GroupView(stage="llm", target="new", replicas=1, generations=[old])
    await _count_free_accelerators(ctx, live, pipeline, resolved, [view])
    assert view.need is not None and (view.need.resource, view.need.count) == ("nvidia.com/gpu", 2)
    listed = {(_group(av), {"Node": "nodes", "Pod": "pods"}[kind], "list") for av, kind, ns in kube.calls}
    assert all(ns is None for _, _, ns in kube.calls), "cluster-wide lists"
    assert listed == _grants(_operator_rules("capacityRules"))


def test_operator_rules_stay_narrow():
    rules = _operator_rules()
    for rule in rules:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], rule
        assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), rule
    grants = _grants(rules)
    # Secrets: read the ones a pipeline names, create its key once; never list, patch or delete any.
    assert {v for g, r, v in grants if r == "secrets"} == {"get", "create"}
    assert not {r for g, r, v in grants if r in ("nodes", "namespaces", "customresourcedefinitions", "leases")}
    known = {p for (p, _) in RESOURCES.values()}
    assert {r.split("/")[0] for g, r, v in grants} <= known, "grants on a kind the operator cannot reach"


def test_lease_rules_match_leader_election():
    text = (CHART / "templates" / "rbac.yaml").read_text()
    assert 'resources: ["leases"]\n    verbs: ["create"]' in text
    assert 'resourceNames: [{{ include "omnikube.leaseName" . | quote }}]\n    verbs: ["get", "patch"]' in text
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    from omni_operator.runner import OperatorConfig

    lease = re.search(r'define "omnikube.leaseName" -\}\}\n(.*?)\n', helpers).group(1)
    assert lease == OperatorConfig().lease_name
