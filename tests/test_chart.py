"""The Helm chart without a cluster: CRDs in step with crds/, values against their schema, RBAC in step
with the code. Rendering, install, upgrade and the RBAC proof against a real apiserver are in
e2e/test_helm_chart.py."""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kopf
import pytest
import yaml

from omni_operator import handlers  # noqa: F401 - registers the kopf watches read below
from omni_operator.kube import RESOURCES
from omni_operator.render import render_pipeline
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


def test_defaults_are_the_documented_ones():
    values = _values()
    assert values["image"]["repository"] == "ghcr.io/omnikube/operator"
    assert values["image"]["tag"] == ""  # the appVersion, 0.1.0
    assert values["replicas"] == 2 and values["leaderElection"]["enabled"] is True
    assert values["watchNamespaces"] == []
    assert values["liveness"]["port"] == 8080 and values["metrics"]["port"] == 9090
    assert values["serviceMonitor"]["enabled"] is False
    assert values["crds"] == {"install": True, "keep": True}
    assert values["podSecurityContext"]["runAsNonRoot"] is True
    assert values["podSecurityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert values["securityContext"]["readOnlyRootFilesystem"] is True
    assert values["securityContext"]["capabilities"] == {"drop": ["ALL"]}


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


# --- RBAC in step with the code --------------------------------------------------------------------


def _operator_rules() -> list[dict[str, Any]]:
    """The rules of templates/rbac.yaml's "omnikube.operatorRules" block (plain YAML, no directives)."""
    text = (CHART / "templates" / "rbac.yaml").read_text()
    block = re.search(r'\{\{- define "omnikube\.operatorRules" -\}\}\n(.*?)\{\{- end \}\}', text, re.S)
    assert block, "templates/rbac.yaml has no omnikube.operatorRules block"
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
        ("apps", "deployments", "delete"),  # the Mooncake master, once no edge uses mooncake
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
