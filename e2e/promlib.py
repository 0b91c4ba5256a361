"""A real Prometheus for the test tier: built from its Go module (e2e/cluster/addons/build.sh), scraping
the pod runner's pods through file_sd targets the tests write, and asked over its HTTP API.

The targets carry `namespace` and `pod` labels, as a Prometheus Operator PodMonitor gives them: the
queries of the dashboard, the alerts and the stages' autoscalers select by `namespace`.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clusterlib import REPO, stop_process_group, wait_for

from localcluster import free_port

__all__ = [
    "METRICS_PORT_NAMES",
    "Prometheus",
    "dashboard_panels",
    "dashboard_variables",
    "metric_names",
    "pod_targets",
    "prometheus_binary",
]

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
SCRAPE_INTERVAL = "1s"
METRICS_PORT_NAMES = "http(-[0-9]+)?|metrics"
"""The container ports serving /metrics, by name: the chart's PodMonitor keeps the same (a test checks)."""


def prometheus_binary() -> Path:
    """The cached Prometheus binary, built first when the cache has none (minutes, cold)."""
    out = subprocess.run(
        ["bash", str(REPO / "e2e" / "cluster" / "addons" / "build.sh"), "prometheus"],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    return Path(out.stdout.strip().splitlines()[-1])


def dashboard_panels(**variables: str) -> dict[str, list[str]]:
    """The PromQL of every panel of the chart's dashboards by title, Grafana's `$name` variables replaced by
    `variables` (e.g. namespace="ns", stage=".*", __rate_interval="1m")."""
    panels: dict[str, list[str]] = {}
    for path in sorted((REPO / "charts" / "omnikube" / "files" / "dashboards").glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            exprs = []
            for target in panel["targets"]:
                expr = target["expr"]
                # longest names first: $__rate_interval before a variable named like its prefix
                for name in sorted(variables, key=len, reverse=True):
                    expr = expr.replace(f"${name}", variables[name])
                exprs.append(expr)
            panels[panel["title"]] = exprs
    return panels


def dashboard_variables(**variables: str) -> dict[str, tuple[str, str]]:
    """Each query variable of the chart's dashboards as (PromQL selector, label): Grafana offers the values
    of `label` among the series `selector` matches (`label_values(selector, label)`)."""
    out: dict[str, tuple[str, str]] = {}
    for path in sorted((REPO / "charts" / "omnikube" / "files" / "dashboards").glob("*.json")):
        for var in json.loads(path.read_text())["templating"]["list"]:
            if var["type"] != "query":
                continue
            found = re.fullmatch(r"label_values\((.*), *(\w+)\)", var["query"]["query"])
            assert found, var["query"]
            selector = found.group(1)
            for name in sorted(variables, key=len, reverse=True):
                selector = selector.replace(f"${name}", variables[name])
            out[var["name"]] = (selector, found.group(2))
    return out


def pod_targets(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """file_sd target groups for every running pod's metrics ports (routers and stages serve /metrics on
    their ports named http, http-1...; Mooncake masters on metrics), as the chart's PodMonitor scrapes."""
    groups = []
    for pod in pods:
        ip = pod.get("status", {}).get("podIP")
        if not ip or pod["status"].get("phase") != "Running":
            continue
        for container in pod["spec"]["containers"]:
            for port in container.get("ports", []):
                if re.fullmatch(METRICS_PORT_NAMES, port.get("name", "")):
                    groups.append(
                        {
                            "targets": [f"{ip}:{port['containerPort']}"],
                            "labels": {"namespace": pod["metadata"]["namespace"], "pod": pod["metadata"]["name"]},
                        }
                    )
    return groups


class Prometheus:
    """`prometheus` as a process on a free local port, with its TSDB in `workdir`.

    Two jobs, as the chart's monitors make them: the pipelines' pods (PodMonitor) and the operator, whose
    per-stage series keep their own `namespace` (its ServiceMonitor's honorLabels). `rule_groups` (a
    PrometheusRule's spec.groups) are evaluated every scrape interval. `host` is the address it listens on:
    the loopback, or the pod runner's bridge address (the node's InternalIP) when pods must reach it, as
    KEDA's operator does for a ScaledObject's Prometheus trigger."""

    def __init__(
        self,
        binary: Path,
        workdir: Path,
        rule_groups: list[dict[str, Any]] | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.binary, self.workdir, self.rule_groups, self.host = binary, workdir, rule_groups, host
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        self.targets = workdir / "targets.json"
        self.operator_targets = workdir / "operator-targets.json"
        self.log_path = workdir / "prometheus.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Prometheus:
        self.targets.write_text("[]")
        self.operator_targets.write_text("[]")
        config: dict[str, Any] = {
            "global": {
                "scrape_interval": SCRAPE_INTERVAL,
                "scrape_timeout": SCRAPE_INTERVAL,
                "evaluation_interval": SCRAPE_INTERVAL,
            },
            "scrape_configs": [
                {
                    "job_name": "omnikube-pods",
                    "file_sd_configs": [{"files": [str(self.targets)], "refresh_interval": "1s"}],
                },
                {
                    "job_name": "omnikube-operator",
                    "honor_labels": True,
                    "file_sd_configs": [{"files": [str(self.operator_targets)], "refresh_interval": "1s"}],
                },
            ],
        }
        if self.rule_groups is not None:
            rules = self.workdir / "rules.json"  # YAML's superset: Prometheus reads JSON rule files too
            rules.write_text(json.dumps({"groups": self.rule_groups}))
            config["rule_files"] = [str(rules)]
        (self.workdir / "prometheus.yml").write_text(json.dumps(config))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    str(self.binary),
                    f"--config.file={self.workdir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={self.workdir / 'data'}",
                    f"--web.listen-address={self.host}:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_for(lambda: self._ready(), 60, "Prometheus ready", self.log)
        return self

    def _ready(self) -> bool:
        try:
            with _NO_PROXY.open(f"{self.url}/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        stop_process_group(self.proc)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def set_targets(self, groups: list[dict[str, Any]], *, operator: bool = False) -> None:
        """The pods job's file_sd target groups (`operator`: the operator job's)."""
        path = self.operator_targets if operator else self.targets
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.replace(path)  # atomic: Prometheus never reads half a file

    def follow(self, list_pods: Callable[[], list[dict[str, Any]]], period: float = 1.0) -> Callable[[], None]:
        """Keep the targets on `list_pods()`'s running pods (replicas an autoscaler adds or removes included),
        as the Prometheus Operator does for a PodMonitor; returns the function that stops following."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(period):
                try:
                    self.set_targets(pod_targets(list_pods()))
                except Exception:  # noqa: BLE001 - a failed list keeps the last targets; the next one retries
                    continue

        self.set_targets(pod_targets(list_pods()))
        thread = threading.Thread(target=loop, name="prometheus-targets", daemon=True)
        thread.start()

        def stop_following() -> None:
            stop.set()
            thread.join(10)

        return stop_following

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; the `data` of a success, else an AssertionError with Prometheus' error."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with _NO_PROXY.open(url, timeout=30) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.api("query", query=expr)["result"]

    def wait_scraped(self, count: int, timeout: float = 60) -> list[dict[str, Any]]:
        """The active targets once at least `count` are up."""

        def up() -> list[dict[str, Any]] | None:
            targets = self.api("targets")["activeTargets"]
            healthy = [t for t in targets if t["health"] == "up"]
            return targets if len(healthy) >= count else None

        found = wait_for(up, timeout, f"{count} targets up", lambda: json.dumps(self.api("targets"))[:3000])
        assert isinstance(found, list)
        return found


def metric_names(prometheus: Prometheus) -> set[str]:
    """Every series name the scraped targets declare (from their # TYPE lines, so a metric that has no
    sample yet counts too), histograms with their _bucket, _sum and _count."""
    names: set[str] = set()
    for name, entries in prometheus.api("metadata").items():
        names.add(name)
        if any(e.get("type") in ("histogram", "summary") for e in entries):
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names
