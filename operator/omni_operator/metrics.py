"""The operator's Prometheus metrics (prefix omnikube_operator_), on their own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["OperatorMetrics"]


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

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)
