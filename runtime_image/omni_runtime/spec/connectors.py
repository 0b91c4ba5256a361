"""What the pipeline spec knows of connectors: the kinds an edge may name, each kind's registry line, and
the pipeline-wide connector settings (defaults for every edge, Mooncake's settings).

A connector kind is one module under `omni_runtime.connectors` (its handle type, its factory, its runtime
info, its local server: `connectors.registry`) plus **one registry line here**: its `ConnectorKind`
member and its `CONNECTOR_KINDS` entry, which say what the spec must know to validate a pipeline
(`one_pod`: both stages of the edge must share a pod), which per-pipeline server the kind needs
(`server`: the operator deploys it, the local launcher runs it) and which module implements it.

Why a table here rather than a check that takes a callback: the spec sits below the connectors and the
operator imports the spec but never the connectors (they need msgspec and numpy, which the operator
image does not install), yet both the operator and the runtime must refuse an `shm` edge across pods and
know that `mooncake` needs a master. A callback would have every caller of `resolve_pipeline` (the
operator included) import the connectors to pass it; facts that are plain data cost the spec nothing and
are the same for every caller. The implementing module is named by its import path (no import here), as an
entry point is: `connectors.registry` imports it and checks that it declares this kind.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

from pydantic import BaseModel, ConfigDict, Field

from omni_runtime.spec.enums import MooncakeMode, MooncakeProtocol

__all__ = [
    "CONNECTOR_KINDS",
    "ConnectorKind",
    "ConnectorKindFacts",
    "ConnectorServer",
    "ConnectorsSpec",
    "MooncakeSpec",
]


class ConnectorKind(StrEnum):
    """How a stage output travels to the next stage."""

    INLINE = "inline"
    """Payload rides inside the control message; for small payloads."""
    SHM = "shm"
    """POSIX shared memory; only between stages in one pod (colocated)."""
    MOONCAKE = "mooncake"
    """Mooncake (the pipeline's own master pod) over TCP or RDMA; between pods."""


class ConnectorServer(StrEnum):
    """A server that runs once per pipeline because some connector kind of its edges needs it.

    The value names the server's Kubernetes objects (`<pipeline>-<value>`, component label `<value>`)."""

    MOONCAKE = "mooncake"
    """Mooncake's master and its HTTP metadata server, which every transfer engine of the pipeline joins."""


@dataclass(frozen=True)
class ConnectorKindFacts:
    """What the spec, the operator and the launcher know of one connector kind without importing it."""

    implementation: str
    """Import path of the module that implements the kind (it declares `KIND`, see `connectors.registry`)."""
    one_pod: bool = False
    """Both stages of an edge of this kind must run in one pod (a `colocateWith` group)."""
    server: ConnectorServer | None = None
    """The per-pipeline server the kind needs, if any."""


CONNECTOR_KINDS: Mapping[ConnectorKind, ConnectorKindFacts] = MappingProxyType(
    {
        ConnectorKind.INLINE: ConnectorKindFacts("omni_runtime.connectors.inline"),
        ConnectorKind.SHM: ConnectorKindFacts("omni_runtime.connectors.shm", one_pod=True),
        ConnectorKind.MOONCAKE: ConnectorKindFacts("omni_runtime.connectors.mooncake", server=ConnectorServer.MOONCAKE),
    }
)
"""The registry line of every connector kind, in `ConnectorKind` order."""


class MooncakeSpec(BaseModel):
    """Mooncake settings, used when any edge has kind `mooncake`."""

    model_config = ConfigDict(extra="forbid")

    mode: MooncakeMode = Field(
        MooncakeMode.P2P,
        description="p2p: the consumer reads the producer's memory with the transfer engine (fastest); "
        "store: payloads are Mooncake Store objects placed by the master.",
    )
    protocol: MooncakeProtocol = Field(MooncakeProtocol.TCP, description="Transfer protocol between pods.")
    device_name: str = Field("", description="RDMA device names (e.g. 'mlx5_0'); empty for TCP.")
    global_segment_size: int = Field(
        512 * 1024**2,
        ge=16 * 1024**2,
        description="Bytes each stage offers for payloads: its store segment (store), or the most bytes of "
        "unreleased payloads it holds (p2p).",
    )
    local_buffer_size: int = Field(
        128 * 1024**2, ge=16 * 1024**2, description="Bytes of each stage's local transfer buffer (mode store)."
    )
    master_port: int = Field(50051, ge=1, le=65535, description="Mooncake master RPC port.")
    metadata_port: int = Field(8080, ge=1, le=65535, description="Mooncake HTTP metadata server port.")


class ConnectorsSpec(BaseModel):
    """How stage outputs move between stages unless an edge says otherwise."""

    model_config = ConfigDict(extra="forbid")

    default: ConnectorKind = Field(ConnectorKind.INLINE, description="Connector for edges that name none.")
    inline_max_bytes: int = Field(
        4 * 1024**2,
        ge=0,
        description="Largest payload the inline connector accepts; larger ones need shm or mooncake.",
    )
    mooncake: MooncakeSpec = Field(default_factory=MooncakeSpec)
    start_timeout_seconds: int = Field(
        120,
        ge=1,
        le=3600,
        description="Seconds a stage keeps trying to start the connectors of its edges (the Mooncake master may "
        "still be starting) before it exits saying which connector and address failed.",
    )
