"""Connectors move stage outputs between stages; each kind is one module (`inline`, `shm`, `mooncake`).

Only handles travel through the router; see `base.Connector` for the contract, `kind.KindDeclaration`
for what a kind's module declares, and `registry` for how the kinds are found (the spec's
`CONNECTOR_KINDS` names their modules). Importing this package loads every kind's module but neither
torch nor mooncake: those load when a connector that needs them is made.
"""

from omni_runtime.connectors.base import (
    Connector,
    ConnectorError,
    Handle,
    Payload,
    PayloadGone,
    PayloadTooLarge,
    ReleasedBy,
)
from omni_runtime.connectors.kind import ConnectorSettings, KindDeclaration
from omni_runtime.connectors.registry import AnyHandle, decode_handle, encode_handle, make_connector

__all__ = [
    "AnyHandle",
    "Connector",
    "ConnectorError",
    "ConnectorSettings",
    "Handle",
    "KindDeclaration",
    "Payload",
    "PayloadGone",
    "PayloadTooLarge",
    "ReleasedBy",
    "decode_handle",
    "encode_handle",
    "make_connector",
]
