"""The operator runs the connector servers a pipeline needs, asked through one generic question.

`ResolvedPipeline.connector_servers()` says which servers (a Mooncake master while an edge uses
`mooncake`); `builders.connector_servers` holds a builder for each; the reconcile step applies their
objects, and deletes its own ones once no edge needs that server (never someone else's).
"""

from __future__ import annotations

import asyncio
from typing import Any

from omni_operator.api import OmniPipeline
from omni_operator.builders.connector_servers import (
    SERVER_BUILDERS,
    build_connector_server_objects,
    unneeded_connector_server_objects,
)
from omni_operator.reconcile import Context, _ensure_connector_servers
from omni_operator.resolve import resolve_cluster_pipeline
from omni_runtime.registry import default_registry
from omni_runtime.spec import ConnectorServer

REGISTRY = default_registry()


def manifest(default: str) -> dict[str, Any]:
    return {
        "apiVersion": "omnikube.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": "p", "namespace": "ns", "uid": "u-1"},
        "spec": {"model": "some/model", "pipeline": "prompt-enhanced-t2i", "connectors": {"default": default}},
    }


class FakeKube:
    """Objects by (kind, namespace, name); what reconcile's `_ensure` and the delete path call."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.deleted: list[tuple[str, str]] = []

    async def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        return self.objects.get((kind, namespace or "", name))

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        self.objects[(obj["kind"], meta.get("namespace", ""), meta["name"])] = obj
        return obj

    async def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> bool:
        self.deleted.append((kind, name))
        return self.objects.pop((kind, namespace or "", name), None) is not None


def reconcile_servers(kube: FakeKube, default: str) -> None:
    live = manifest(default)
    pipeline = OmniPipeline.model_validate(live)
    resolved = resolve_cluster_pipeline(pipeline, REGISTRY)
    ctx = Context(kube=kube, registry=REGISTRY)  # type: ignore[arg-type]  # the calls the step makes, no cluster

    async def ensure(step: Any, desired: dict[str, Any]) -> Any:
        return await step(ctx, desired)

    asyncio.run(_ensure_connector_servers(ctx, live, pipeline, resolved, ensure))


def test_every_connector_server_has_a_builder() -> None:
    assert set(SERVER_BUILDERS) == set(ConnectorServer)


def test_the_master_is_built_only_while_an_edge_needs_it_and_its_objects_are_named_for_deletion() -> None:
    for default, built in (("mooncake", {("Deployment", "p-mooncake"), ("Service", "p-mooncake")}), ("inline", set())):
        live = manifest(default)
        pipeline = OmniPipeline.model_validate(live)
        resolved = resolve_cluster_pipeline(pipeline, REGISTRY)
        objects = build_connector_server_objects(live, pipeline, resolved)
        assert {(o["kind"], o["metadata"]["name"]) for o in objects} == built
        unneeded = {(kind, name) for _, _, kind, name in unneeded_connector_server_objects("p", resolved)}
        assert unneeded == ({("Deployment", "p-mooncake"), ("Service", "p-mooncake")} - built)
        assert resolved.mooncake_master_host == ("p-mooncake.ns.svc" if built else None)


def test_reconcile_applies_the_master_and_deletes_only_its_own_when_no_edge_needs_it() -> None:
    kube = FakeKube()
    reconcile_servers(kube, "mooncake")
    assert set(kube.objects) == {("Deployment", "ns", "p-mooncake"), ("Service", "ns", "p-mooncake")}
    foreign = {"kind": "Service", "metadata": {"name": "p-mooncake", "namespace": "ns", "ownerReferences": []}}
    kube.objects[("Service", "ns", "p-mooncake")] = foreign  # someone else's Service of that name
    reconcile_servers(kube, "inline")
    assert kube.deleted == [("Deployment", "p-mooncake")]
    assert kube.objects == {("Service", "ns", "p-mooncake"): foreign}
