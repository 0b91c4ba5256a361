"""Trust inside a pipeline: its key Secret, how pods mount it, and its NetworkPolicies. Pure.

The key (32 random bytes) authenticates every router <-> stage message (runtime `wire/auth.py`,
PROTOCOL.md). The operator creates its Secret once, owned by the OmniPipeline, and never rewrites it
while it exists; the bytes are made by the caller (`reconcile`), so these builders stay pure.

The NetworkPolicies (additive, as NetworkPolicies are) isolate every pod of the pipeline for ingress:
- from the pipeline's own pods, every port (stage protocol, Mooncake master and metadata, the transfer
  engine's ports, which it picks at run time);
- from anywhere, only the router's HTTP port (the OpenAI API) and the stages' probe/metrics ports
  (/healthz, /readyz, /metrics: kubelet probes on CNIs that police them, Prometheus).
"""

from __future__ import annotations

from typing import Any

from omni_operator.builders.meta import (
    LABEL_COMPONENT,
    LABEL_PIPELINE,
    child_name,
    labels,
    owner_reference,
    selector_labels,
    with_hash,
)
from omni_operator.resolve import group_members, stage_ports
from omni_runtime.spec import ROUTER_PORT, ResolvedPipeline

__all__ = [
    "KEY_BYTES",
    "KEY_FILE",
    "KEY_MOUNT",
    "KEY_SECRET_KEY",
    "build_key_secret",
    "build_network_policies",
    "key_secret_name",
    "key_volume",
]

KEY_BYTES = 32
"""Random bytes in a generated key (the runtime refuses keys shorter than 32 bytes)."""
KEY_SECRET_KEY = "key"
"""The data key of the pipeline's key Secret."""
KEY_MOUNT = "/var/run/omnikube/pipeline-key"
KEY_FILE = f"{KEY_MOUNT}/{KEY_SECRET_KEY}"
"""Where router and stage containers read the key (`--pipeline-key-file`)."""


def key_secret_name(pipeline: str) -> str:
    return child_name(pipeline, "key")


def build_key_secret(owner: dict[str, Any], secret: bytes) -> dict[str, Any]:
    """The pipeline's key Secret holding `secret` (base64 in `data`, as the API wants)."""
    import base64

    name = owner["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": key_secret_name(name),
            "namespace": owner["metadata"]["namespace"],
            "labels": labels(name, "key"),
            "ownerReferences": [owner_reference(owner)],
        },
        "type": "Opaque",
        "data": {KEY_SECRET_KEY: base64.b64encode(secret).decode()},
    }


def key_volume(pipeline: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(volume, mount) that put the pipeline key at KEY_FILE, readable by the pod's fsGroup only."""
    volume = {
        "name": "pipeline-key",
        "secret": {
            "secretName": key_secret_name(pipeline),
            "items": [{"key": KEY_SECRET_KEY, "path": KEY_SECRET_KEY}],
            "defaultMode": 0o440,
        },
    }
    return volume, {"name": "pipeline-key", "mountPath": KEY_MOUNT, "readOnly": True}


def build_network_policies(owner: dict[str, Any], resolved: ResolvedPipeline) -> list[dict[str, Any]]:
    """The pipeline's NetworkPolicies: its pods reach each other; clients reach the router's HTTP port."""
    name = owner["metadata"]["name"]
    namespace = owner["metadata"]["namespace"]
    own = [owner_reference(owner)]
    pipeline_pods = {"matchLabels": {LABEL_PIPELINE: name}}

    def policy(suffix: str, pod_selector: dict[str, Any], ingress: list[dict[str, Any]]) -> dict[str, Any]:
        return with_hash(
            {
                "apiVersion": "networking.k8s.io/v1",
                "kind": "NetworkPolicy",
                "metadata": {
                    "name": child_name(name, suffix),
                    "namespace": namespace,
                    "labels": labels(name, "network-policy"),
                    "ownerReferences": own,
                },
                "spec": {"podSelector": pod_selector, "policyTypes": ["Ingress"], "ingress": ingress},
            }
        )

    largest_group = max((len(m) for m in group_members(resolved).values()), default=1)
    probe_ports = [{"protocol": "TCP", "port": stage_ports(i)[1]} for i in range(largest_group)]
    return [
        policy("pipeline", pipeline_pods, [{"from": [{"podSelector": pipeline_pods}]}]),
        policy(
            "router-clients",
            {"matchLabels": selector_labels(name, "router")},
            [{"ports": [{"protocol": "TCP", "port": ROUTER_PORT}]}],
        ),
        policy(
            "stage-probes",
            {"matchLabels": {LABEL_PIPELINE: name, LABEL_COMPONENT: "stage"}},
            [{"ports": probe_ports}],
        ),
    ]
