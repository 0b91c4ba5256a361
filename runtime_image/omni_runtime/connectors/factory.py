"""Pick a connector by kind: `make_connector(kind, spec, **runtime_info)`."""

from __future__ import annotations

import inspect
from typing import Any

from omni_runtime.connectors.base import Connector
from omni_runtime.spec.connectors import ConnectorsSpec
from omni_runtime.spec.enums import ConnectorKind, MooncakeMode

__all__ = ["make_connector"]


def make_connector(kind: ConnectorKind | str, spec: ConnectorsSpec | None = None, **runtime_info: Any) -> Connector:
    """Build the connector for `kind` from the pipeline's connector spec plus what only the running
    process knows (`runtime_info`): for shm `pipeline`, `owner`, `pool_max_bytes`, `copy_out`...;
    for mooncake `pipeline`, `local_hostname`, `master_host`, `metadata_server`... (mode `store` also
    `master_address`)
    Unknown keys are an error, so a typo does not silently fall back to a default."""
    try:
        kind = ConnectorKind(kind)
    except ValueError:
        allowed = ", ".join(repr(k.value) for k in ConnectorKind)
        raise ValueError(f"connector kind {kind!r} is not known; use one of {allowed}") from None
    cls: type[Connector]
    if kind is ConnectorKind.INLINE:
        from omni_runtime.connectors.inline import InlineConnector

        cls = InlineConnector
    elif kind is ConnectorKind.SHM:
        from omni_runtime.connectors.shm import ShmConnector

        cls = ShmConnector
    elif (spec or ConnectorsSpec()).mooncake.mode is MooncakeMode.STORE:
        from omni_runtime.connectors.mooncake_store import MooncakeStoreConnector

        cls = MooncakeStoreConnector
    else:
        from omni_runtime.connectors.mooncake_p2p import MooncakePeerConnector

        cls = MooncakePeerConnector
    params = inspect.signature(cls.__init__).parameters
    unknown = sorted(set(runtime_info) - {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY})
    if unknown:
        known = sorted(n for n, p in params.items() if p.kind is p.KEYWORD_ONLY)
        raise TypeError(f"make_connector({kind.value!r}): unknown runtime_info {unknown}; allowed: {known or 'none'}")
    return cls(spec or ConnectorsSpec(), **runtime_info)
