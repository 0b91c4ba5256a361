"""OmniPipeline -> its one Mooncake master: a Deployment of one replica and a headless Service.

The builder of `ConnectorServer.MOONCAKE`, reached through `builders.connector_servers` when the
resolved pipeline needs that server (`ResolvedPipeline.connector_servers()`).

Every transfer engine of a pipeline must register with the same metadata server, so the master is
one pod per pipeline (not a sidecar of each router replica), replaced with `Recreate` so two never
run at once. Stages reach it by the Service's DNS name, written into the resolved config
(`mooncakeMasterHost`); its ports stay off the client-facing router Service.
"""

from __future__ import annotations

from typing import Any

from omni_operator.api import OmniPipeline
from omni_operator.builders.meta import (
    TEMPLATE_HASH_ANNOTATION,
    content_hash,
    labels,
    owner_reference,
    selector_labels,
    with_hash,
)
from omni_operator.builders.stage_workload import container_security_context, pod_security_context
from omni_operator.resolve import connector_server_name
from omni_runtime.spec import ConnectorServer, ResolvedPipeline

__all__ = ["MOONCAKE_COMPONENT", "build_mooncake_objects"]

MOONCAKE_COMPONENT = ConnectorServer.MOONCAKE.value
METRICS_PORT = 9003


def build_mooncake_objects(
    owner: dict[str, Any], pipeline: OmniPipeline, resolved: ResolvedPipeline
) -> list[dict[str, Any]]:
    """The master's Deployment and headless Service, each with its content hash; none when the pipeline
    needs no Mooncake master."""
    if ConnectorServer.MOONCAKE not in resolved.connector_servers():
        return []
    name = owner["metadata"]["name"]
    obj_name = connector_server_name(name, ConnectorServer.MOONCAKE)
    runtime = pipeline.spec.runtime
    mc = resolved.topology.connectors.mooncake
    lbl = labels(name, MOONCAKE_COMPONENT)
    selector = selector_labels(name, MOONCAKE_COMPONENT)
    meta = {
        "name": obj_name,
        "namespace": owner["metadata"]["namespace"],
        "labels": lbl,
        "ownerReferences": [owner_reference(owner)],
    }
    probe = {"tcpSocket": {"port": "mooncake-rpc"}}
    container: dict[str, Any] = {
        "name": "mooncake-master",
        "image": runtime.image,
        "imagePullPolicy": runtime.image_pull_policy.value,
        # The embedded HTTP metadata server binds every interface, which is what a pod needs.
        "command": [
            "mooncake_master",
            "--rpc_address=0.0.0.0",
            f"--rpc_port={mc.master_port}",
            f"--metrics_port={METRICS_PORT}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_port={mc.metadata_port}",
            "--logtostderr",
        ],
        "ports": [
            {"name": "mooncake-rpc", "containerPort": mc.master_port, "protocol": "TCP"},
            {"name": "mooncake-meta", "containerPort": mc.metadata_port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        "readinessProbe": {**probe, "periodSeconds": 2, "failureThreshold": 3},
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 6},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],  # glog's files, even with --logtostderr
        "securityContext": container_security_context(),
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": selector},
            # Never two masters: engines registered with one would be unknown to the other.
            "strategy": {"type": "Recreate"},
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {"labels": lbl, "annotations": {TEMPLATE_HASH_ANNOTATION: content_hash(container)}},
                "spec": {
                    "containers": [container],
                    "volumes": [{"name": "tmp", "emptyDir": {}}],
                    "automountServiceAccountToken": False,  # it never talks to the API server
                    "enableServiceLinks": False,
                    "securityContext": pod_security_context(),
                    **_placement(pipeline),
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "clusterIP": "None",  # the name resolves to the master pod's IP: no proxy in the data path
            "selector": selector,
            "ports": [
                {"name": "mooncake-rpc", "port": mc.master_port, "targetPort": mc.master_port, "protocol": "TCP"},
                {"name": "mooncake-meta", "port": mc.metadata_port, "targetPort": mc.metadata_port, "protocol": "TCP"},
            ],
            "publishNotReadyAddresses": False,
        },
    }
    return [with_hash(deployment), with_hash(service)]


def _placement(pipeline: OmniPipeline) -> dict[str, Any]:
    """The master is small and CPU-only: it goes where the router may go."""
    router = pipeline.spec.router
    out: dict[str, Any] = {}
    if router.node_selector:
        out["nodeSelector"] = dict(router.node_selector)
    if router.tolerations:
        out["tolerations"] = [t.to_dict() for t in router.tolerations]
    return out
