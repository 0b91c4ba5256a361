"""The operator's Prometheus metrics (prefix omnikube_operator_), on their own registry."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["STAGE_REPLICAS_DESIRED", "OperatorMetrics"]

STAGE_REPLICAS_DESIRED = "omnikube_operator_stage_replicas_desired"
"""Per stage, the replicas its OmniStage asks for: what OmnikubeStageDown compares with the replicas the
routers see up (a stage scaled to zero on purpose asks for none, so it is not down)."""


class OperatorMetrics:
    """Reconcile counts and durations per kind, API writes, and leadership."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reconciles = Counter(
            "omnikube_operator_reconcile",
            "Reconciles by object kind and result",
            ["kind", "result"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "omnikube_operator_reconcile_duration_seconds",
            "Reconcile duration",
            ["kind"],
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.writes = Counter(
            "omnikube_operator_api_writes", "Writes the operator made to the API", registry=self.registry
        )
        self.leader = Gauge("omnikube_operator_leader", "1 while this replica holds the Lease", registry=self.registry)
        self.queue_depth = Gauge(
            "omnikube_operator_queue_depth", "Keys waiting to be reconciled", registry=self.registry
        )
        self.stage_replicas = Gauge(
            STAGE_REPLICAS_DESIRED,
            "Replicas each OmniStage asks for (spec.replicas, which an autoscaler sets through /scale), per "
            "pipeline stage: a colocated stage reports its group's. Exported by the leader only.",
            ["namespace", "pipeline", "stage"],
            registry=self.registry,
        )
        self._stage_labels: dict[tuple[str, str], list[tuple[str, str, str]]] = {}
        """Label sets exported per OmniStage (namespace, name), to remove them when it goes."""

    def observe_stage(self, namespace: str, name: str, stage: dict[str, Any] | None) -> None:
        """Export the replicas OmniStage `namespace/name` asks for, under each pipeline stage its pods run;
        None (deleted or being deleted) removes its series."""
        wanted: list[tuple[str, str, str]] = []
        replicas = 0
        if stage is not None:
            spec = stage.get("spec") or {}
            replicas = int(spec.get("replicas", 1))  # the CRD's default
            members = [spec.get("stage", ""), *(spec.get("colocated") or [])]
            wanted = [(namespace, spec.get("pipeline", ""), member) for member in members]
        for labels in set(self._stage_labels.pop((namespace, name), [])) - set(wanted):
            self.stage_replicas.remove(*labels)
        for labels in wanted:
            self.stage_replicas.labels(*labels).set(replicas)
        if wanted:
            self._stage_labels[(namespace, name)] = wanted

    def forget_stages(self) -> None:
        """Drop every stage's series: a replica that lost the Lease no longer knows them (the leader exports)."""
        self.stage_replicas.clear()
        self._stage_labels.clear()

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)
