"""Connector configuration: defaults for every edge plus Mooncake settings."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from omni_runtime.spec.enums import ConnectorKind, MooncakeMode, MooncakeProtocol

__all__ = ["ConnectorsSpec", "MooncakeSpec"]


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
