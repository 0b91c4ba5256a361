"""The connector contract: what stages exchange, the handle that travels, and the four calls.

A producer stage calls `put(source, target, key, payload)` and gets a `Handle`; only the handle
travels through the router (msgpack, a few hundred bytes at most for `shm` and `mooncake`).
The consumer stage calls `get(handle)` and then `release(handle)`. `release` is idempotent and
must be called on every path: success, failure, cancellation, and for handles never read.

This module imports neither torch nor numpy, so the router can carry handles without them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

import msgspec

from omni_runtime.spec.enums import ConnectorKind

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
]

Payload = Mapping[str, Any]
"""What stages exchange: str keys; values are torch tensors or numpy arrays (any dtype, incl. bfloat16),
bytes, str, int, float, bool, None, and lists/dicts of those. Tuples come back as lists."""

T = TypeVar("T")
log = logging.getLogger(__name__)


class ConnectorError(RuntimeError):
    """A connector could not store, find or remove a payload."""


class PayloadTooLarge(ConnectorError):
    """The payload does not fit the connector (inline size limit, store capacity)."""


class PayloadGone(ConnectorError):
    """The payload behind a handle no longer exists (released, swept, or its owner closed)."""


class Handle(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    """All that travels through the router for one payload. `kind` is the msgpack tag."""

    key: str
    """The caller's key (request id, chunk id); also part of segment names and store keys."""
    source: str
    """Producing stage."""
    target: str
    """Consuming stage."""
    nbytes: int
    """Bytes of encoded payload (msgpack header plus raw tensor frames)."""

    @property
    def kind(self) -> ConnectorKind:
        return ConnectorKind(self.__struct_config__.tag)


class InlineHandle(Handle, frozen=True, kw_only=True, tag="inline"):
    """The payload itself: msgpack header plus raw frames."""

    header: bytes
    frames: list[bytes]


class ShmHandle(Handle, frozen=True, kw_only=True, tag="shm"):
    """A block in a POSIX shared-memory segment owned by the producer's connector."""

    segment: str
    """File name under /dev/shm (`omnikube-...`)."""
    generation: int
    """Which use of the (pooled) segment this handle refers to; stale handles are detected."""
    layout: list[int]
    """Header length followed by each frame's length; offsets follow from `codec.frame_offsets`."""


class MooncakeHandle(Handle, frozen=True, kw_only=True, tag="mooncake"):
    """One object in the Mooncake Store (mooncake mode `store`)."""

    store_key: str
    layout: list[int]


class MooncakePeerHandle(Handle, frozen=True, kw_only=True, tag="mooncake-p2p"):
    """A block in the producer's memory, read with the transfer engine (mooncake mode `p2p`)."""

    segment: str
    """The producer's transfer-engine segment name (`host:port`), looked up in the metadata server."""
    address: int
    """Address of the block in the producer's process; the block starts with a 64-byte header."""
    generation: int
    """Which use of the (pooled) block this handle refers to; stale handles are detected."""
    layout: list[int]

    @property
    def kind(self) -> ConnectorKind:
        return ConnectorKind.MOONCAKE


AnyHandle = InlineHandle | ShmHandle | MooncakeHandle | MooncakePeerHandle
"""Decode target for any handle (the `kind` tag picks the class)."""

_handle_encoder = msgspec.msgpack.Encoder()
_handle_decoder = msgspec.msgpack.Decoder(AnyHandle)


def encode_handle(handle: Handle) -> bytes:
    return _handle_encoder.encode(handle)


def decode_handle(data: bytes | memoryview) -> AnyHandle:
    return _handle_decoder.decode(data)


class Connector(ABC):
    """One kind of transport between stages. Methods are coroutines; `close` is not.

    Payloads returned by `get` own their memory unless the kind says otherwise (see `ShmConnector`).
    """

    kind: ClassVar[ConnectorKind]

    @abstractmethod
    async def put(self, source_stage: str, target_stage: str, key: str, payload: Payload) -> AnyHandle:
        """Store `payload` for `target_stage`. On failure or cancellation nothing is left behind. The handle
        is one of `AnyHandle`'s classes: the only ones the wire can carry."""

    @abstractmethod
    async def get(self, handle: Handle) -> dict[str, Any]:
        """Read the payload behind `handle`. Raises `PayloadGone` if it was released or lost."""

    @abstractmethod
    async def release(self, handle: Handle) -> None:
        """Free the payload behind `handle`. Idempotent; a handle already gone is fine."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Free what this connector owns (threads, mappings, store client)."""

    def trim(self) -> None:  # noqa: B027 (optional hook)
        """Give back idle pooled memory beyond the connector's limit (pooled kinds only)."""

    def _check_handle(self, handle: Handle, cls: type[T]) -> T:
        if not isinstance(handle, cls):
            raise TypeError(
                f"{type(self).__name__} got a {handle.kind.value!r} handle for {handle.key!r}; "
                f"hand it to the connector of kind {handle.kind.value!r}"
            )
        return handle

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


async def run_blocking(
    executor: concurrent.futures.Executor | None,
    fn: Callable[..., T],
    *args: Any,
    undo: Callable[[], object] | None = None,
) -> T:
    """Run `fn(*args)` in `executor` (or right here when None) and return its result.

    If `fn` fails, or the awaiting task is cancelled while `fn` still runs in its thread, `undo()`
    runs once `fn` has stopped, before the error or cancellation reaches the caller (if a second
    cancel interrupts that wait, `undo` runs in the worker thread when `fn` returns). So a half-done
    or abandoned `put` never leaves data behind.
    """
    if executor is None:
        try:
            return fn(*args)
        except BaseException:
            if undo is not None:
                undo()
            raise
    cf = executor.submit(fn, *args)
    inner = asyncio.wrap_future(cf)
    inner.add_done_callback(_consume_exception)
    try:
        return await asyncio.shield(inner)
    except BaseException:
        if undo is None:
            raise
        if not inner.done():  # cancelled while the worker runs: let it stop, so undo sees all it did
            try:
                await asyncio.shield(inner)
            except BaseException:  # its own failure, or a second cancel: undo still follows
                pass
        if cf.done():
            _quiet(undo)
        else:
            cf.add_done_callback(lambda _f: _quiet(undo))
        raise


async def wait_settled(futures: list[concurrent.futures.Future]) -> None:
    """Wait until the given worker-thread calls have stopped, ignoring their results."""
    if futures:
        await asyncio.shield(asyncio.wait([asyncio.wrap_future(f) for f in futures]))


def _consume_exception(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def _quiet(fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception:  # cleanup after a failure must not mask the original error
        log.exception("connector cleanup failed")
