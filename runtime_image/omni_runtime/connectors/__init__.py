"""Connectors move stage outputs between stages: `inline`, `shm`, `mooncake`.

Only handles travel through the router; see `base.Connector` for the contract. Kinds are imported
lazily by `make_connector`, so importing this package loads neither torch nor mooncake.
"""

from omni_runtime.connectors.base import (
    AnyHandle,
    Connector,
    ConnectorError,
    Handle,
    InlineHandle,
    MooncakeHandle,
    MooncakePeerHandle,
    Payload,
    PayloadGone,
    PayloadTooLarge,
    ShmHandle,
    decode_handle,
    encode_handle,
)
from omni_runtime.connectors.factory import make_connector

__all__ = [
    "AnyHandle",
    "Connector",
    "ConnectorError",
    "Handle",
    "InlineHandle",
    "MooncakeHandle",
    "MooncakePeerHandle",
    "Payload",
    "PayloadGone",
    "PayloadTooLarge",
    "ShmHandle",
    "decode_handle",
    "encode_handle",
    "make_connector",
]
