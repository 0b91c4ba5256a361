"""The `inline` connector: the encoded payload rides inside the handle (small payloads only)."""

from __future__ import annotations

from typing import Any, ClassVar

from omni_runtime.connectors.base import Connector, Handle, Payload, PayloadTooLarge, ReleasedBy
from omni_runtime.connectors.codec import decode_payload, encode_payload, payload_nbytes
from omni_runtime.connectors.kind import KindDeclaration
from omni_runtime.spec.connectors import ConnectorKind, ConnectorsSpec

__all__ = ["KIND", "InlineConnector", "InlineHandle"]


class InlineHandle(Handle, frozen=True, kw_only=True, tag="inline"):
    """The payload itself: msgpack header plus raw frames."""

    kind: ClassVar[str] = ConnectorKind.INLINE
    released_by: ClassVar[ReleasedBy] = ReleasedBy.NOBODY

    header: bytes
    frames: list[bytes]


class InlineConnector(Connector):
    """Copies the payload into the handle; `release` has nothing to free."""

    kind: ClassVar[str] = ConnectorKind.INLINE

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


KIND = KindDeclaration(
    name=ConnectorKind.INLINE, handles=(InlineHandle,), connector_class=lambda _spec: InlineConnector
)
