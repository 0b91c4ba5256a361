"""The `inline` connector: the encoded payload rides inside the handle (small payloads only)."""

from __future__ import annotations

from typing import Any, ClassVar

from omni_runtime.connectors.base import Connector, Handle, InlineHandle, Payload, PayloadTooLarge
from omni_runtime.connectors.codec import decode_payload, encode_payload, payload_nbytes
from omni_runtime.spec.connectors import ConnectorsSpec
from omni_runtime.spec.enums import ConnectorKind

__all__ = ["InlineConnector"]


class InlineConnector(Connector):
    """Copies the payload into the handle; `release` has nothing to free."""

    kind: ClassVar[ConnectorKind] = ConnectorKind.INLINE

    def __init__(self, spec: ConnectorsSpec | None = None) -> None:
        self.max_bytes = (spec or ConnectorsSpec()).inline_max_bytes

    async def put(self, source_stage: str, target_stage: str, key: str, payload: Payload) -> InlineHandle:
        header, frames = encode_payload(payload)
        nbytes = payload_nbytes(header, frames)
        if nbytes > self.max_bytes:
            raise PayloadTooLarge(
                f"edge {source_stage}->{target_stage}, key {key!r}: payload is {_size(nbytes)}; the inline "
                f"connector carries at most {_size(self.max_bytes)} (connectors.inlineMaxBytes); use 'shm' "
                "for stages in one pod or 'mooncake' between pods for this edge, or raise the limit"
            )
        return InlineHandle(
            key=key,
            source=source_stage,
            target=target_stage,
            nbytes=nbytes,
            header=header,
            frames=[bytes(f) for f in frames],
        )

    async def get(self, handle: Handle) -> dict[str, Any]:
        h = self._check_handle(handle, InlineHandle)
        return decode_payload(h.header, h.frames)

    async def release(self, handle: Handle) -> None:
        self._check_handle(handle, InlineHandle)


def _size(n: int) -> str:
    return f"{n} bytes" if n < 1024**2 else f"{n / 1024**2:.2f} MiB ({n} bytes)"
