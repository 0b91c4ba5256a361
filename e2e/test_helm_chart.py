"""The Helm chart (charts/omnikube) against the real control plane.

`helm lint` with the values schema; `helm template` output validated by the apiserver (server-side dry
run); install, upgrade and uninstall of a release; and the RBAC proof: the operator runs as a local
process with nothing but a token of the chart's ServiceAccount and brings an OmniPipeline to Ready,
first with the ClusterRole (all namespaces), then, after an upgrade, with a Role in one namespace.

The tests of this module run in order on one release (the `release` fixture); the cluster fixture is
shared with other modules, so names are unique and everything is removed at the end. The CRDs, which
the cluster fixture applied with kubectl, are adopted by the release for the module and handed back
(Helm's ownership labels and annotations removed) afterwards.
"""

from __future__ import annotations

import http.server
import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import yaml
from chartlib import Release, ServiceAccountOperator, helm
from clusterlib import REPO, apply, condition, kubectl_json, stage_deployment, wait_for
from promlib import METRICS_PORT_NAMES, Prometheus, prometheus_binary

from omni_operator.metrics import STAGE_REPLICAS_DESIRED
from omni_operator.render import render_pipeline
from omni_runtime.registry import default_registry

pytestmark = pytest.mark.cluster

CHART = REPO / "charts" / "omnikube"
CRDS = {p.name.removesuffix(".yaml"): p for p in sorted((REPO / "crds").glob("*.yaml"))}
CHART_LABELS = [
    "helm.sh/chart",
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
]
HELM_ANNOTATIONS = ["meta.helm.sh/release-name", "meta.helm.sh/release-namespace", "helm.sh/resource-policy"]
FORBIDDEN_MARKS = ("Forbidden", "forbidden")
"""How a refused call shows in the operator's log: the API server's message of every 403 says the request "is
forbidden" (the operator logs it, omni_operator.kube.KubeError). Not "403": a log line's milliseconds can be
403 (`04:30:18,403 INFO ...`), which failed a green upgrade once; the audit log check below reads codes."""


# --- helpers ---------------------------------------------------------------------------------------


def template(cluster, *sets: str, name: str = "omk", namespace: str = "omk-system") -> list[dict]:
    args = [a for s in sets for a in ("--set", s)]
    out = helm(cluster, "template", name, str(CHART), "--namespace", namespace, *args)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def find(objs: list[dict], kind: str, name: str | None = None, namespace: str | None = None) -> list[dict]:
    return [
        o
        for o in objs
        if o["kind"] == kind
        and (name is None or o["metadata"]["name"] == name)
        and (namespace is None or o["metadata"].get("namespace") == namespace)
    ]


def exists(cluster, *args: str) -> bool:
    return cluster.kubectl("get", *args, "-o", "name", check=False).returncode == 0


def _set_crd_ownership(cluster, release: Release | None) -> None:
    """Mark the CRDs as the release's (Helm adopts objects carrying its ownership metadata), or, with
    None, remove what Helm and the chart added so they are as the cluster fixture applied them."""
    names = list(CRDS)
    if release is not None:
        cluster.kubectl(
            "annotate",
            "--overwrite",
            "crd",
            *names,
            f"meta.helm.sh/release-name={release.name}",
            f"meta.helm.sh/release-namespace={release.namespace}",
        )
        cluster.kubectl("label", "--overwrite", "crd", *names, "app.kubernetes.io/managed-by=Helm")
        return
    for name in names:
        crd = kubectl_json(cluster, "get", "crd", name)["metadata"]
        annotations = [f"{k}-" for k in HELM_ANNOTATIONS if k in (crd.get("annotations") or {})]
        labels = [f"{k}-" for k in CHART_LABELS if k in (crd.get("labels") or {})]
        if annotations:
            cluster.kubectl("annotate", "crd", name, *annotations, check=False)
        if labels:
            cluster.kubectl("label", "crd", name, *labels, check=False)


@pytest.fixture(scope="module")
def release(cluster) -> Iterator[Release]:
    suffix = uuid.uuid4().hex[:6]
    rel = Release(name=f"omk-{suffix}", namespace=f"omk-{suffix}-system", apps=f"omk-{suffix}-apps")
    for ns in (rel.namespace, rel.apps):
        cluster.kubectl("create", "namespace", ns)
    _set_crd_ownership(cluster, rel)
    try:
        yield rel
    finally:
        helm(cluster, "uninstall", rel.name, "--namespace", rel.namespace, "--ignore-not-found", check=False)
        _set_crd_ownership(cluster, None)
        for ns in (rel.apps, rel.namespace):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.fixture
def sa_operator(cluster, release, tmp_path) -> Iterator[Callable[[list[str]], ServiceAccountOperator]]:
    started: list[ServiceAccountOperator] = []

    def start(namespaces: list[str], args: list[str] | None = None) -> ServiceAccountOperator:
        # The apiserver builds a custom resource's watch cache on its first use and answers 429 ("storage
        # is (re)initializing") meanwhile; the operator's first listing as leader does not survive that
        # yet (reported), so let the caches fill before it starts.
        wait_for(
            lambda: cluster.kubectl("get", "omnipipelines,omnistages", "-A", check=False).returncode == 0,
            30,
            "the custom resources' storage",
        )
        op = ServiceAccountOperator(cluster, release, tmp_path, namespaces, args=args or []).start()
        started.append(op)
        return op

    yield start
    for op in started:
        op.stop()


def pipeline_ready(cluster, namespace: str, name: str) -> dict | None:
    out = cluster.kubectl("get", "omnipipeline", name, "-n", namespace, "-o", "json", check=False)
    if out.returncode != 0:
        return None
    obj = json.loads(out.stdout)
    if (
        condition(obj, "Ready").get("status") == "True"
        and obj["status"].get("observedGeneration") == obj["metadata"]["generation"]
    ):
        return obj
    return None


def refusals(log: str) -> list[str]:
    """The lines of an operator log that report a call the API server refused."""
    return [line for line in log.splitlines() if any(mark in line for mark in FORBIDDEN_MARKS)]


def test_refusals_are_read_from_the_api_servers_message_not_from_a_timestamp() -> None:
    refused = (
        "2026-12-02 04:30:18,404 WARNING omni_operator.reconcile: could not apply ConfigMap apps/p-config: "
        'POST /api/v1/namespaces/apps/configmaps: configmaps is forbidden: User "system:serviceaccount:s:o" '
        'cannot create resource "configmaps" in API group "" in the namespace "apps"'
    )
    fine = "2026-12-02 04:30:18,403 INFO omni_operator.reconcile: applying ConfigMap apps/p-config"
    assert refusals(f"{fine}\n{refused}") == [refused]


def sa_requests(cluster, release: Release, since: float) -> list[tuple[str, str, str | None, int]]:
    """(verb, resource, namespace, response code) of every request of the chart's ServiceAccount the audit log
    recorded as complete since `since` (the policy records writes, and lists of nodes)."""
    user = f"system:serviceaccount:{release.namespace}:{release.service_account}"
    found = []
    for line in cluster.audit_log.read_text().splitlines():
        event = json.loads(line)
        if event.get("user", {}).get("username") != user or event.get("stage") != "ResponseComplete":
            continue
        stamp = time.mktime(time.strptime(event["requestReceivedTimestamp"][:19], "%Y-%m-%dT%H:%M:%S"))
        if stamp - time.timezone >= since - 1:
            ref = event.get("objectRef", {})
            resource = ref.get("resource", "") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
            code = event.get("responseStatus", {}).get("code", 0)
            found.append((event["verb"], resource, ref.get("namespace"), code))
    return found


def assert_no_forbidden(
    cluster, release: Release, op: ServiceAccountOperator, since: float, *, expected: frozenset = frozenset()
) -> None:
    """Nothing the operator asked for since `since` was refused, but (verb, resource) pairs in `expected`."""
    bad = [line for line in refusals(op.log()) if not any(f'"{resource}"' in line for _, resource in expected)]
    assert not bad, "the operator was refused something the chart's RBAC should grant:\n" + "\n".join(bad[:20])
    refused = [r for r in sa_requests(cluster, release, since) if r[3] == 403 and r[:2] not in expected]
    assert not refused, f"requests refused by RBAC: {refused}"


# --- lint and template (no release) ----------------------------------------------------------------


def test_lint_passes_and_the_schema_rejects_bad_values(cluster):
    out = helm(cluster, "lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in out.stdout
    for bad, path in [
        ("replicas=two", "/replicas"),
        ("watchNamespaces[0]=Bad_NS", "/watchNamespaces/0"),
        ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
        ("leaderElection.enabled=false", "/replicas"),  # 2 replicas need the Lease
        ("metricsPort=1", "metricsPort"),
    ]:
        out = helm(cluster, "lint", str(CHART), "--set", bad, check=False)
        assert out.returncode != 0, f"helm lint accepted {bad}"
        assert path in out.stdout + out.stderr, out.stdout + out.stderr
    out = helm(cluster, "template", "x", str(CHART), "--set", "replicas=two", check=False)
    assert out.returncode != 0 and "schema" in out.stderr


def test_template_crds_are_the_generated_ones(cluster):
    objs = template(cluster)
    for name, path in CRDS.items():
        want = yaml.safe_load(path.read_text())
        [got] = find(objs, "CustomResourceDefinition", name)
        assert {k: v for k, v in got.items() if k != "metadata"} == {k: v for k, v in want.items() if k != "metadata"}
        assert got["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
        assert want["metadata"]["labels"].items() <= got["metadata"]["labels"].items()
        assert got["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    assert all(
        "annotations" not in c["metadata"]
        for c in find(template(cluster, "crds.keep=false"), "CustomResourceDefinition")
    )
    assert not find(template(cluster, "crds.install=false"), "CustomResourceDefinition")


def test_template_rbac_follows_watch_namespaces(cluster):
    objs = template(cluster)
    [role] = find(objs, "ClusterRole", "omk-omnikube")
    [binding] = find(objs, "ClusterRoleBinding", "omk-omnikube")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "omk-omnikube", "namespace": "omk-system"}]
    secrets = [r for r in role["rules"] if "secrets" in r["resources"]]
    assert secrets == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create"]}]
    [lease] = find(objs, "Role", "omk-omnikube-leader-election", "omk-system")
    assert {tuple(r["verbs"]): r.get("resourceNames") for r in lease["rules"]} == {
        ("create",): None,
        ("get", "patch"): ["omnikube-operator"],
    }
    [deployment] = find(objs, "Deployment", "omk-omnikube")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["omnikube", "operator"]
    assert "--liveness-port=8080" in container["args"] and "--metrics-port=9090" in container["args"]
    assert not [a for a in container["args"] if a.startswith("--namespace")]
    assert find(objs, "PodDisruptionBudget", "omk-omnikube")

    objs = template(cluster, "watchNamespaces={team-a,team-b}", "replicas=1")
    assert not find(objs, "ClusterRole", "omk-omnikube") and not find(objs, "ClusterRoleBinding", "omk-omnikube")
    for ns in ("team-a", "team-b"):
        [ns_role] = find(objs, "Role", "omk-omnikube", ns)
        assert ns_role["rules"] == role["rules"]
        [ns_binding] = find(objs, "RoleBinding", "omk-omnikube", ns)
        assert ns_binding["subjects"][0]["namespace"] == "omk-system"
    container = find(objs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    assert [a for a in container["args"] if a.startswith("--namespace")] == ["--namespace=team-a", "--namespace=team-b"]
    assert not find(objs, "PodDisruptionBudget"), "one replica: no PodDisruptionBudget"


def test_template_capacity_check_grants_listing_nodes_and_pods_in_either_mode(cluster):
    """capacityCheck.enabled (the default): a ClusterRole of its own to list nodes and pods, with watchNamespaces
    too (nodes belong to no namespace); off: none, and the operator is told not to count (it would be refused)."""

    def operator_args(objs: list[dict]) -> list[str]:
        [deployment] = find(objs, "Deployment")
        return deployment["spec"]["template"]["spec"]["containers"][0]["args"]

    for values in ((), ("watchNamespaces={team-a}",)):
        objs = template(cluster, *values)
        assert "--no-capacity-check" not in operator_args(objs)
        [role] = find(objs, "ClusterRole", "omk-omnikube-capacity")
        assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes", "pods"], "verbs": ["list"]}]
        [binding] = find(objs, "ClusterRoleBinding", "omk-omnikube-capacity")
        assert binding["roleRef"]["name"] == "omk-omnikube-capacity"
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "omk-omnikube", "namespace": "omk-system"}]
    objs = template(cluster, "capacityCheck.enabled=false")
    assert "--no-capacity-check" in operator_args(objs)
    assert not find(objs, "ClusterRole", "omk-omnikube-capacity")
    assert not find(objs, "ClusterRoleBinding", "omk-omnikube-capacity")


def test_template_deployment_is_locked_down(cluster):
    [deployment] = find(template(cluster), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert deployment["spec"]["replicas"] == 2
    assert container["image"] == "ghcr.io/omnikube/operator:0.1.0"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in container["env"]}
    assert env["POD_NAME"] == "metadata.name" and env["POD_NAMESPACE"] == "metadata.namespace"
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"healthz": 8080, "metrics": 9090}


def test_template_service_monitor_is_optional(cluster):
    assert not find(template(cluster), "ServiceMonitor")
    objs = template(cluster, "serviceMonitor.enabled=true", "serviceMonitor.labels.release=prom")
    [monitor] = find(objs, "ServiceMonitor", "omk-omnikube")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    [service] = find(objs, "Service", "omk-omnikube-metrics")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    assert [p["name"] for p in service["spec"]["ports"]] == ["metrics"]


def monitoring_objects(cluster, *sets: str) -> list[dict]:
    return [o for o in template(cluster, *sets) if o["kind"] in ("PrometheusRule", "PodMonitor", "ConfigMap")]


def test_template_monitoring_is_optional_and_follows_its_values(cluster):
    assert monitoring_objects(cluster) == []
    sets = [
        "monitoring.dashboards.enabled=true",
        "monitoring.dashboards.annotations.grafana_folder=omnikube",
        "monitoring.dashboards.namespace=grafana",
        "monitoring.rules.enabled=true",
        "serviceMonitor.enabled=true",
        "monitoring.rules.labels.release=prom",
        "monitoring.podMonitor.enabled=true",
    ]
    # --set makes 0.75 a string, which the schema refuses; numbers go through --set-json.
    numbers = ["monitoring.rules.ttfpSeconds=0.75", "monitoring.rules.errorRatio=0.02"]
    args = [a for s in sets for a in ("--set", s)] + [a for n in numbers for a in ("--set-json", n)]
    out = helm(cluster, "template", "omk", str(CHART), "--namespace", "omk-system", *args)
    objs = [d for d in yaml.safe_load_all(out.stdout) if d]
    [dashboard] = find(objs, "ConfigMap", "omk-omnikube-omnikube-pipelines", "grafana")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["metadata"]["annotations"] == {"grafana_folder": "omnikube"}
    board = json.loads(dashboard["data"]["omnikube-pipelines.json"])
    titles = " ".join(p["title"] for p in board["panels"])
    for words in ("Requests", "Errors", "TTFT", "TPOT", "TTFP", "E2EL", "RTF", "Queue", "Replicas",
                  "Connector bytes", "Payloads not released"):  # fmt: skip
        assert words in titles, words
    assert {v["name"] for v in board["templating"]["list"]} >= {"namespace", "pipeline", "stage"}

    [rule] = find(objs, "PrometheusRule", "omk-omnikube")
    assert rule["metadata"]["labels"]["release"] == "prom"
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(alerts) == {
        "OmnikubeStageDown",
        "OmnikubeErrorRatioHigh",
        "OmnikubeTTFPOverTarget",
        "OmnikubeE2ELOverTarget",
        "OmnikubePayloadsNotReleased",
    }
    assert alerts["OmnikubeTTFPOverTarget"]["expr"].rstrip().endswith("> 0.75")
    assert alerts["OmnikubeErrorRatioHigh"]["expr"].rstrip().endswith("> 0.02")
    assert "{{ $labels.stage }}" in alerts["OmnikubeStageDown"]["annotations"]["summary"]

    [monitor] = find(objs, "PodMonitor", "omk-omnikube-pipelines")
    assert monitor["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/managed-by": "omnikube"}
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert "port" not in endpoint and endpoint["path"] == "/metrics"
    [keep] = endpoint["relabelings"]
    assert keep["sourceLabels"] == ["__meta_kubernetes_pod_container_port_name"] and keep["action"] == "keep"
    assert keep["regex"] == METRICS_PORT_NAMES  # the e2e Prometheus scrapes what the PodMonitor keeps
    # Every process of a pipeline's pods is kept: router, stages, each colocated stage (code2wav in the
    # talker's pod, on http-1), the Mooncake master; its protocol ports are not scraped.
    manifest = yaml.safe_load((REPO / "config" / "samples" / "qwen3-omni.yaml").read_text())
    ports = {
        (o["metadata"]["name"], c["name"], p["name"])
        for o in render_pipeline(manifest, default_registry())
        if o["kind"] == "Deployment"
        for c in o["spec"]["template"]["spec"]["containers"]
        for p in c.get("ports", [])
    }
    kept = {(deployment, container) for deployment, container, name in ports if re.fullmatch(keep["regex"], name)}
    containers = {(deployment, container) for deployment, container, _ in ports}
    assert kept == containers, containers - kept
    assert any(name == "http-1" for _, container, name in ports if container == "code2wav"), ports
    assert any(not re.fullmatch(keep["regex"], name) for _, _, name in ports)
    scoped = template(cluster, "monitoring.podMonitor.enabled=true", "watchNamespaces={team-a}", "replicas=1")
    [monitor] = find(scoped, "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]}


class Exporter:
    """Recorded series served in the Prometheus text format, one page per path, which a test changes."""

    def __init__(self) -> None:
        self.pages: dict[str, str] = {}
        pages = self.pages

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                body = pages.get(self.path, "").encode()
                self.send_response(200 if self.path in pages else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def target(self, path: str, **labels: str) -> dict:
        return {"targets": [self.address], "labels": {"__metrics_path__": path, **labels}}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _desired(replicas: dict[tuple[str, str, str], int]) -> str:
    lines = [f"# TYPE {STAGE_REPLICAS_DESIRED} gauge"]
    lines += [
        f'{STAGE_REPLICAS_DESIRED}{{namespace="{ns}",pipeline="{p}",stage="{s}"}} {n}'
        for (ns, p, s), n in replicas.items()
    ]
    return "\n".join(lines) + "\n"


def _replica_up(up: dict[tuple[str, str, str], int]) -> str:
    lines = ["# TYPE omnikube_stage_replica_up gauge"]
    lines += [
        f'omnikube_stage_replica_up{{pipeline="{p}",stage="{s}",replica="{r}"}} {n}' for (p, s, r), n in up.items()
    ]
    return "\n".join(lines) + "\n"


def test_stage_down_fires_for_a_stage_without_ready_replicas_not_for_one_scaled_to_zero(cluster, tmp_path):
    """The chart's PrometheusRule evaluated by a real Prometheus (every second, `for` 1s) over recorded series
    scraped as the chart's monitors scrape them: the operator's desired replicas per stage, the routers' view
    of each replica. A stage whose replicas all went (no router series) or are down fires; a stage scaled
    to zero on purpose does not, though its router still exports its last replica at 0; once its
    autoscaler asks for a replica that does not come, it fires."""
    objs = template(cluster, "monitoring.rules.enabled=true", "serviceMonitor.enabled=true", "monitoring.rules.for=1s")
    [rule] = find(objs, "PrometheusRule")
    desired = {
        ("ai", "chat", "llm"): 1,  # its one replica is down
        ("ai", "t2i", "dit"): 0,  # scaled to zero (autoscaling minReplicas 0, no demand)
        ("ai", "omni", "thinker"): 2,  # no router has seen a replica of it
        ("ai", "omni", "talker"): 1,
        ("ai", "omni", "code2wav"): 1,  # colocated in the talker's pods
        ("team-b", "chat", "llm"): 1,  # same names, another namespace, up
    }
    exporter = Exporter()
    exporter.pages["/operator"] = _desired(desired)
    exporter.pages["/router-ai"] = _replica_up(
        {
            ("chat", "llm", "10.0.0.1:5000"): 0,
            ("t2i", "dit", "10.0.0.2:5000"): 0,
            ("omni", "talker", "10.0.0.3:5000"): 1,
            ("omni", "code2wav", "10.0.0.3:5001"): 1,
        }
    )
    exporter.pages["/router-b"] = _replica_up({("chat", "llm", "10.0.1.1:5000"): 1})
    prometheus = Prometheus(prometheus_binary(), tmp_path, rule_groups=rule["spec"]["groups"]).start()
    try:
        # The operator's namespace on the target, as a ServiceMonitor sets it; honorLabels keeps the series' own.
        prometheus.set_targets([exporter.target("/operator", namespace="omk-system")], operator=True)
        prometheus.set_targets(
            [
                exporter.target("/router-ai", namespace="ai", pod="chat-router"),
                exporter.target("/router-b", namespace="team-b", pod="chat-router"),
            ]
        )
        prometheus.wait_scraped(3)

        def alerts(state: str = "") -> set[tuple[str, str, str]]:
            selector = 'alertname="OmnikubeStageDown"' + (f',alertstate="{state}"' if state else "")
            found = prometheus.query(f"ALERTS{{{selector}}}")
            return {(a["metric"]["namespace"], a["metric"]["pipeline"], a["metric"]["stage"]) for a in found}

        down = {("ai", "chat", "llm"), ("ai", "omni", "thinker")}
        wait_for(lambda: alerts("firing") >= down, 30, "OmnikubeStageDown firing", lambda: str(alerts()))
        assert alerts() == down  # none pending either: every series was scraped together
        # The autoscaler asks for a replica of the stage at zero and none comes up: now it is down too.
        exporter.pages["/operator"] = _desired(desired | {("ai", "t2i", "dit"): 1})
        activated = down | {("ai", "t2i", "dit")}
        wait_for(lambda: alerts("firing") == activated, 30, "the activated stage down", lambda: str(alerts()))
    finally:
        prometheus.stop()
        exporter.close()


def test_schema_refuses_monitoring_values_that_would_do_nothing(cluster):
    for bad in ("monitoring.rules.errorRatio=2", "monitoring.rules.for=soon", "monitoring.dashbords.enabled=true"):
        out = helm(cluster, "template", "omk", str(CHART), "--set", bad, check=False)
        assert out.returncode != 0, bad
    # Without the operator's metrics OmnikubeStageDown could never fire: refused, saying what to set.
    out = helm(cluster, "template", "omk", str(CHART), "--set", "monitoring.rules.enabled=true", check=False)
    assert out.returncode != 0 and "set serviceMonitor.enabled=true" in out.stderr, out.stderr


def test_template_passes_server_side_validation(cluster, release):
    # The apiserver checks every object against its OpenAPI schema (strict field validation: unknown
    # fields fail), with a client-side and a server-side apply; nothing is stored.
    for sets in ([], [f"watchNamespaces={{{release.apps}}}", "replicas=1"]):
        args = [a for s in sets for a in ("--set", s)]
        manifest = helm(cluster, "template", release.name, str(CHART), "--namespace", release.namespace, *args).stdout
        for mode in (["--dry-run=server"], ["--server-side", "--dry-run=server"]):
            out = cluster.kubectl("apply", *mode, "--validate=strict", "-f", "-", input=manifest, check=False)
            assert out.returncode == 0, f"{sets} {mode}:\n{out.stderr}"
            assert "deployment.apps/" in out.stdout and "customresourcedefinition" in out.stdout


# --- the release -----------------------------------------------------------------------------------


def test_install(cluster, release):
    helm(cluster, "install", release.name, str(CHART), "--namespace", release.namespace, "--wait", "--timeout", "120s")
    release.installed = True
    deployment = kubectl_json(cluster, "get", "deployment", release.fullname, "-n", release.namespace)
    assert deployment["spec"]["replicas"] == 2
    # KWOK plays the kubelet: both operator pods get Running and Ready.
    wait_for(
        lambda: (
            kubectl_json(cluster, "get", "deployment", release.fullname, "-n", release.namespace)["status"].get(
                "readyReplicas"
            )
            == 2
        ),
        60,
        "2 ready operator pods",
    )
    pods = kubectl_json(
        cluster,
        "get",
        "pods",
        "-n",
        release.namespace,
        "-l",
        f"app.kubernetes.io/instance={release.name},app.kubernetes.io/component=operator",
    )["items"]
    assert [p["status"]["phase"] for p in pods] == ["Running", "Running"]
    assert {p["spec"]["serviceAccountName"] for p in pods} == {release.service_account}
    for name in CRDS:
        crd = kubectl_json(cluster, "get", "crd", name)
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        assert crd["metadata"]["annotations"]["meta.helm.sh/release-name"] == release.name
        assert condition(crd, "Established").get("status") == "True"
    for args in (
        ["clusterrole", release.fullname],
        ["clusterrolebinding", release.fullname],
        ["role", f"{release.fullname}-leader-election", "-n", release.namespace],
        ["serviceaccount", release.service_account, "-n", release.namespace],
        ["poddisruptionbudget", release.fullname, "-n", release.namespace],
        ["service", f"{release.fullname}-metrics", "-n", release.namespace],
    ):
        assert exists(cluster, *args), args


def test_chart_rbac_is_all_the_operator_needs(cluster, release, sa_operator):
    release.require_installed()
    since = time.time()
    op = sa_operator([])  # all namespaces: the ClusterRole
    # The token really is the ServiceAccount's: it may not read what the chart does not grant.
    denied = cluster.kubectl("--kubeconfig", str(op.kubeconfig), "get", "namespaces", check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower()
    cluster.kubectl("create", "secret", "generic", "hf-token", "-n", release.apps, "--from-literal=token=x")
    pipeline = {
        "apiVersion": "omnikube.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": "helm-rbac"},
        "spec": {
            "model": "/models/x",
            "pipeline": "text-chat",
            "runtime": {"hfTokenSecret": {"name": "hf-token", "key": "token"}},  # exercises get secrets
            "stages": [{"name": "llm", "replicas": 1, "accelerator": {"type": "nvidia.com/gpu", "count": 1}}],
        },
    }
    apply(cluster, release.apps, pipeline)
    ready = wait_for(
        lambda: pipeline_ready(cluster, release.apps, "helm-rbac"), 90, "OmniPipeline Ready", lambda: op.log()[-4000:]
    )
    assert ready["status"]["stagesReady"] == "1/1"
    # Everything the operator made exists: OmniStage (apply + /scale), its Deployment and Service, the
    # router with its ServiceAccount, Role (escalation check passed), RoleBinding, PDB; a Ready Event.
    for args in (
        ["omnistage", "helm-rbac-llm"],
        ["deployment", stage_deployment(cluster, release.apps, "helm-rbac-llm")],
        ["service", "helm-rbac-llm"],
        ["deployment", "helm-rbac-router"],
        ["role", "helm-rbac-router"],
        ["rolebinding", "helm-rbac-router"],
        ["serviceaccount", "helm-rbac-router"],
        ["poddisruptionbudget", "helm-rbac-router"],
        ["secret", "helm-rbac-key"],
        ["networkpolicy", "helm-rbac-pipeline"],
    ):
        assert exists(cluster, *args, "-n", release.apps), args
    events = kubectl_json(
        cluster, "get", "events", "-n", release.apps, "--field-selector", "involvedObject.name=helm-rbac,reason=Ready"
    )["items"]
    assert events, "the operator posted the Ready Event"
    lease = kubectl_json(cluster, "get", "lease", "omnikube-operator", "-n", release.namespace)
    assert lease["spec"]["holderIdentity"] == op.identity
    status, _ = op.get("/healthz", op.liveness_port)
    assert status == 200, "the liveness endpoint the chart probes answers"
    status, body = op.get("/metrics", op.metrics_port)
    assert status == 200 and "omnikube_" in body, "the metrics endpoint the Service points at answers"
    # A contract change of a GPU stage: before it makes the new generation the operator counts the free GPUs,
    # listing nodes and every namespace's pods (capacityCheck.enabled), with the ServiceAccount's token.
    first = ready["status"]["contract"]
    apply(cluster, release.apps, {**pipeline, "spec": {**pipeline["spec"], "model": "/models/x2"}})
    rolled = wait_for(
        lambda: (lambda o: o if o and o["status"]["rollout"]["phase"] == "Complete" and o["status"]["contract"] != first
                 else None)(pipeline_ready(cluster, release.apps, "helm-rbac")),
        90, "the GPU stage rolled to its new generation", lambda: op.log()[-4000:],
    )  # fmt: skip
    assert rolled["status"]["rollout"]["serving"] == rolled["status"]["contract"]
    listed = {(r[1], r[2]) for r in sa_requests(cluster, release, since) if r[0] == "list"}
    assert ("nodes", None) in listed, "the free GPUs were counted (the audit policy records lists of nodes)"
    op.stop()
    assert_no_forbidden(cluster, release, op, since)


def test_upgrade_changes_deployment_and_rbac(cluster, release, sa_operator):
    release.require_installed()
    helm(
        cluster,
        "upgrade",
        release.name,
        str(CHART),
        "--namespace",
        release.namespace,
        "--wait",
        "--timeout",
        "120s",
        "--set",
        "replicas=1",
        "--set",
        f"watchNamespaces={{{release.apps}}}",
        "--set",
        "capacityCheck.enabled=false",
    )
    deployment = kubectl_json(cluster, "get", "deployment", release.fullname, "-n", release.namespace)
    assert deployment["spec"]["replicas"] == 1
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--namespace={release.apps}" in args
    assert "--no-capacity-check" in args
    assert not exists(cluster, "clusterrole", f"{release.fullname}-capacity")
    assert not exists(cluster, "clusterrole", release.fullname)
    assert not exists(cluster, "clusterrolebinding", release.fullname)
    assert not exists(cluster, "poddisruptionbudget", release.fullname, "-n", release.namespace)
    assert exists(cluster, "role", release.fullname, "-n", release.apps)
    assert exists(cluster, "rolebinding", release.fullname, "-n", release.apps)

    # The Role in the watched namespace is enough too; switching the topology also exercises the
    # delete of an OmniStage whose stage left it.
    since = time.time()
    op = sa_operator([release.apps], ["--no-capacity-check"])  # what the chart's Deployment runs now
    gpu = {"type": "nvidia.com/gpu", "count": 1}
    cluster.kubectl(
        "patch",
        "omnipipeline",
        "helm-rbac",
        "-n",
        release.apps,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"pipeline": "qwen-image", "stages": [{"name": "dit", "accelerator": gpu}]}}),
    )
    ready = wait_for(
        lambda: pipeline_ready(cluster, release.apps, "helm-rbac"),
        90,
        "OmniPipeline Ready again",
        lambda: op.log()[-4000:],
    )
    assert ready["status"]["topology"]["stages"] == ["dit"]
    wait_for(
        lambda: not exists(cluster, "omnistage", "helm-rbac-llm", "-n", release.apps),
        30,
        "the llm OmniStage deleted",
        lambda: op.log()[-4000:],
    )
    # capacityCheck off: a contract change of the GPU stage rolls without counting free accelerators.
    roll_to(cluster, release, "/models/x3", op)
    assert not [r for r in sa_requests(cluster, release, since) if r[:2] == ("list", "nodes")], "nodes were listed"
    op.stop()
    assert_no_forbidden(cluster, release, op, since)

    # An operator that would count (no --no-capacity-check) without the chart's capacity ClusterRole: refused once,
    # it says so and what to set, stops counting, and the rollout goes on as with the check off.
    since = time.time()
    op = sa_operator([release.apps])
    roll_to(cluster, release, "/models/x4", op)
    roll_to(cluster, release, "/models/x5", op)
    refused = [r for r in sa_requests(cluster, release, since) if r[3] == 403]
    assert refused == [("list", "nodes", None, 403)], refused
    [warning] = [line for line in op.log().splitlines() if "not counting free accelerators" in line]
    assert "capacityCheck.enabled" in warning, warning
    op.stop()
    assert_no_forbidden(cluster, release, op, since, expected=frozenset({("list", "nodes")}))


def roll_to(cluster, release: Release, model: str, op: ServiceAccountOperator) -> dict:
    """Change helm-rbac's model (its contract) and wait until the new generation serves."""
    first = kubectl_json(cluster, "get", "omnipipeline", "helm-rbac", "-n", release.apps)["status"]["contract"]
    patch = json.dumps({"spec": {"model": model}})
    cluster.kubectl("patch", "omnipipeline", "helm-rbac", "-n", release.apps, "--type=merge", "-p", patch)
    return wait_for(
        lambda: (lambda o: o if o and o["status"]["rollout"]["phase"] == "Complete" and o["status"]["contract"] != first
                 else None)(pipeline_ready(cluster, release.apps, "helm-rbac")),
        90, f"helm-rbac rolled to {model}", lambda: op.log()[-4000:],
    )  # fmt: skip


def test_uninstall_keeps_crds_and_pipelines(cluster, release):
    release.require_installed()
    out = helm(cluster, "uninstall", release.name, "--namespace", release.namespace, "--wait", "--timeout", "120s")
    release.installed = False
    assert "kept due to the resource policy" in out.stdout + out.stderr
    selector = f"app.kubernetes.io/instance={release.name}"
    for kinds, ns in (
        ("deployments,serviceaccounts,services,roles,rolebindings,poddisruptionbudgets", release.namespace),
        ("roles,rolebindings", release.apps),
    ):
        left = cluster.kubectl("get", kinds, "-n", ns, "-l", selector, "-o", "name").stdout.split()
        assert not left, f"left behind in {ns}: {left}"
    left = cluster.kubectl("get", "clusterroles,clusterrolebindings", "-l", selector, "-o", "name").stdout.split()
    assert not left, left
    for name in CRDS:
        assert exists(cluster, "crd", name), f"crds.keep: {name} must survive uninstall"
    assert exists(cluster, "omnipipeline", "helm-rbac", "-n", release.apps), "users' pipelines survive uninstall"
