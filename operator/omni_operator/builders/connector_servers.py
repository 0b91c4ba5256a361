"""OmniPipeline -> the per-pipeline servers its connectors need, through one builder per server.

The resolved pipeline says which servers its edges need (`ResolvedPipeline.connector_servers()`: a
Mooncake master when an edge uses `mooncake`); this module looks up each one's builder, so the
reconciler and `omnikube render` ask one question instead of naming a connector kind. Every object of a
server is named `resolve.connector_server_name(pipeline, server)`, which is how the reconciler finds what
to delete once no edge needs that server any more.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from omni_operator.api import OmniPipeline
from omni_operator.builders.mooncake import build_mooncake_objects
from omni_operator.resolve import connector_server_name
from omni_runtime.spec import ConnectorServer, ResolvedPipeline

__all__ = ["SERVER_BUILDERS", "ServerBuilder", "build_connector_server_objects", "unneeded_connector_server_objects"]


@dataclass(frozen=True)
class ServerBuilder:
    """How the operator runs one kind of connector server."""

    build: Callable[[dict[str, Any], OmniPipeline, ResolvedPipeline], list[dict[str, Any]]]
    """(owner, pipeline, resolved) -> the server's objects, each with its content hash."""
    kinds: tuple[tuple[str, str], ...]
    """(apiVersion, kind) of every object `build` makes."""


SERVER_BUILDERS: Mapping[ConnectorServer, ServerBuilder] = MappingProxyType(
    {
        ConnectorServer.MOONCAKE: ServerBuilder(build_mooncake_objects, (("apps/v1", "Deployment"), ("v1", "Service"))),
    }
)


def build_connector_server_objects(
    owner: dict[str, Any], pipeline: OmniPipeline, resolved: ResolvedPipeline
) -> list[dict[str, Any]]:
    """The objects of every connector server the resolved pipeline needs; none when it needs none."""
    return [
        obj
        for server in resolved.connector_servers()
        for obj in SERVER_BUILDERS[server].build(owner, pipeline, resolved)
    ]


def unneeded_connector_server_objects(
    pipeline: str, resolved: ResolvedPipeline
) -> list[tuple[ConnectorServer, str, str, str]]:
    """(server, apiVersion, kind, name) of the objects a server the pipeline no longer needs would have:
    the reconciler deletes those that exist and are its own."""
    needed = set(resolved.connector_servers())
    return [
        (server, api_version, kind, connector_server_name(pipeline, server))
        for server, builder in SERVER_BUILDERS.items()
        if server not in needed
        for api_version, kind in builder.kinds
    ]
