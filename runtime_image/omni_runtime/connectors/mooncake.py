"""The `mooncake` connector kind: stage outputs between pods over Mooncake (TCP or RDMA).

Two modes (`spec.connectors.mooncake.mode`), each a connector of its own module: `p2p`
(`mooncake_p2p`, the default: the consumer reads the producer's memory with the transfer engine) and
`store` (`mooncake_store`: payloads are Mooncake Store objects). Both need the pipeline's one Mooncake
master and metadata server (`ConnectorServer.MOONCAKE`): the operator deploys it
(`omni_operator.builders.mooncake`), the local launcher runs it (`mooncake_master`, through this
kind's `local_server`). This module declares the kind: both handle classes, the pick by mode, the
runtime info, the local server, and what both connectors' constructors share.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from omni_runtime.connectors.base import Connector, ConnectorError, Handle, ReleasedBy
from omni_runtime.connectors.kind import ConnectorSettings, KindDeclaration
from omni_runtime.connectors.mooncake_master import MooncakeMaster, metadata_url
from omni_runtime.spec import ConnectorServer, ResolvedPipeline
from omni_runtime.spec.connectors import ConnectorKind, ConnectorsSpec, MooncakeSpec
from omni_runtime.spec.enums import MooncakeMode

__all__ = ["KIND", "MooncakeHandle", "MooncakePeerHandle", "default_metadata_server", "mooncake_module"]


class MooncakeHandle(Handle, frozen=True, kw_only=True, tag="mooncake"):
    """One object in the Mooncake Store (mooncake mode `store`)."""

    kind: ClassVar[str] = ConnectorKind.MOONCAKE
    released_by: ClassVar[ReleasedBy] = ReleasedBy.ANY_STAGE  # any store client removes the key

    store_key: str
    layout: list[int]


class MooncakePeerHandle(Handle, frozen=True, kw_only=True, tag="mooncake-p2p"):
    """A block in the producer's memory, read with the transfer engine (mooncake mode `p2p`)."""

    kind: ClassVar[str] = ConnectorKind.MOONCAKE
    released_by: ClassVar[ReleasedBy] = ReleasedBy.ANY_STAGE  # any engine writes the block's `freed` word

    segment: str
    """The producer's transfer-engine segment name (`host:port`), looked up in the metadata server."""
    address: int
    """Address of the block in the producer's process; the block starts with a 64-byte header."""
    generation: int
    """Which use of the (pooled) block this handle refers to; stale handles are detected."""
    layout: list[int]


def mooncake_module(name: str) -> Any:
    """`mooncake.<name>` (`store`, `engine`), or a ConnectorError saying what to install."""
    try:
        return importlib.import_module(f"mooncake.{name}")
    except ImportError as e:
        raise ConnectorError(
            "connector 'mooncake' needs the mooncake package; install mooncake-transfer-engine "
            "(mooncake-transfer-engine-non-cuda without CUDA) or use 'shm'/'inline' for this edge"
        ) from e


def default_metadata_server(master_host: str, spec: MooncakeSpec) -> str:
    """The metadata server's URL when the caller names none: the master's host, the spec's port."""
    return metadata_url(master_host, spec.metadata_port)


def _connector_class(spec: ConnectorsSpec) -> Callable[..., Connector]:
    # Imported here: both modules import their handle class and helpers from this one.
    if spec.mooncake.mode is MooncakeMode.STORE:
        from omni_runtime.connectors.mooncake_store import MooncakeStoreConnector

        return MooncakeStoreConnector
    from omni_runtime.connectors.mooncake_p2p import MooncakePeerConnector

    return MooncakePeerConnector


def _runtime_info(pipeline: ResolvedPipeline, settings: ConnectorSettings) -> dict[str, Any]:
    return {
        "pipeline": pipeline.name,
        "local_hostname": settings.advertise_host,
        "master_host": pipeline.mooncake_master_host or "127.0.0.1",
    }


class _LocalMaster:
    """The pipeline's master and metadata server as local processes (`omnikube serve`)."""

    server = ConnectorServer.MOONCAKE

    def start(self, resolved: ResolvedPipeline, *, log_dir: Path) -> MooncakeMaster:
        mc = resolved.topology.connectors.mooncake
        host = resolved.mooncake_master_host or "127.0.0.1"
        return MooncakeMaster(
            host=host, rpc_port=mc.master_port, metadata_port=mc.metadata_port, log_dir=str(log_dir)
        ).start()


KIND = KindDeclaration(
    name=ConnectorKind.MOONCAKE,
    handles=(MooncakeHandle, MooncakePeerHandle),
    connector_class=_connector_class,
    runtime_info=_runtime_info,
    local_server=_LocalMaster(),
)
