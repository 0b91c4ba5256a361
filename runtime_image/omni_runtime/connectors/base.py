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
from enum import Enum
from typing import Any, ClassVar, TypeVar

import msgspec

__all__ = [
    "Connector",
    "ConnectorError",
    "Handle",
    "Payload",
    "PayloadGone",
    "PayloadTooLarge",
    "ReleasedBy",
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


class ReleasedBy(Enum):
    """Who can free the payload behind a handle: what the router may do with a handle nobody will read."""

    NOBODY = "nobody"
    """The payload rides in the handle: there is nothing to free."""
    PRODUCER = "producer"
    """Only the producing process (the payload is in its memory, and only it can unlink it)."""
    ANY_STAGE = "any-stage"
    """Any stage process of the pipeline (a shared store, or a remote write into the producer's memory), so
    the router may hand the release to another replica when the producer is gone."""


class Handle(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    """All that travels through the router for one payload.

    Each kind's module subclasses it with a msgpack `tag` (naming the handle class on the wire) and sets
    the two class variables; `connectors.registry` builds the union the wire decodes from those classes."""

    kind: ClassVar[str]
    """The connector kind whose connector reads it (a `ConnectorKind` for the kinds edges may name)."""
    released_by: ClassVar[ReleasedBy]
    """Who can free its payload."""

    key: str
    """The caller's key (request id, chunk id); also part of segment names and store keys."""
    source: str
    """Producing stage."""
    target: str
    """Consuming stage."""
    nbytes: int
    """Bytes of encoded payload (msgpack header plus raw tensor frames)."""


class Connector(ABC):
    """One kind of transport between stages. Methods are coroutines; `close` is not.

    Payloads returned by `get` own their memory unless the kind says otherwise (see `ShmConnector`).
    """

    kind: ClassVar[str]
    """The connector kind it implements (a `ConnectorKind` for the kinds edges may name)."""

    @abstractmethod
    async def put(self, source_stage: str, target_stage: str, key: str, payload: Payload) -> Handle:
        """Store `payload` for `target_stage`. On failure or cancellation nothing is left behind. The handle
        is one of the kind's declared handle classes (`KindDeclaration.handles`): the wire carries those."""

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
                f"{type(self).__name__} got a {str(handle.kind)!r} handle for {handle.key!r}; "
                f"hand it to the connector of kind {str(handle.kind)!r}"
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
