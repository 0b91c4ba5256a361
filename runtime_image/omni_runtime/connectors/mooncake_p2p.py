"""The `mooncake` connector in mode `p2p`: the consumer reads the producer's memory with Mooncake's
transfer engine (TCP or RDMA), peer to peer.

Each stage process runs one `TransferEngine`, known to the metadata server (served by the Mooncake
master of the pipeline) as `<host>:<port>`. The producer keeps a pool of blocks (anonymous memory,
registered with the engine once, reused by size class); `put` claims a free block, bumps its
generation and copies the encoded payload in: one local copy. Only the handle (segment, block
address, generation, layout) travels. `get` reads header and payload in one transfer into a block
of the consumer's own pool and returns tensors that are **views of that block, valid until
`release`** (as with `shm`). `release` frees the receive block and writes the generation into the
producer block's `freed` word: an 8-byte remote write, or a local store when the producer is this
process. The producer reuses a block once `freed == generation`.

So one transfer per payload and no master round trip, which is what the Store costs on top (two
RPCs per put, one per get and per remove). The price: a payload lives in its producer, so it is gone
(`PayloadGone`) if the producer exits before the consumer reads it, and a handle never released keeps
a producer block busy until that process closes the connector.

Block header (64 bytes): magic at 0, generation at 8 (written by the owner on `put`), freed at 16
(written by whoever releases). A stale handle (block released and reused) fails the generation check
on `get`; a duplicate release writes an older generation, which never frees a newer use of the block.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import mmap
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from omni_runtime.connectors.base import (
    Connector,
    ConnectorError,
    Handle,
    Payload,
    PayloadGone,
    PayloadTooLarge,
    run_blocking,
    wait_settled,
)
from omni_runtime.connectors.codec import decode_payload, encode_payload, frame_offsets, size_class
from omni_runtime.connectors.mooncake import MooncakePeerHandle, default_metadata_server, mooncake_module
from omni_runtime.connectors.mooncake_master import free_port
from omni_runtime.spec.connectors import ConnectorKind, ConnectorsSpec

__all__ = ["MooncakePeerConnector"]

log = logging.getLogger(__name__)

_HDR = 64
_MAGIC = b"OMNIMCP1"
_GEN_AT = 8
_FREED_AT = 16
_WORD = struct.Struct("<Q")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_READ_SLICES = 4
_READ_SLICE_MIN = 256 * 1024
_SLICED_READ_MAX = 8 * 1024**2
_RELEASE_WORDS = 64  # source words of in-flight remote releases (more than the worker threads)


@dataclass(eq=False)
class _Block:
    """One registered buffer: a 64-byte header, then room for `capacity` payload bytes."""

    capacity: int
    mm: mmap.mmap
    array: np.ndarray
    """uint8 view of the whole block (header included)."""
    address: int
    generation: int = 0
    """Owner side: the current use. Receive side: unused."""
    busy: bool = False
    """Receive side: handed out by `get`, not yet released. Owner side: unused (see `freed`)."""

    def freed(self) -> int:
        return _WORD.unpack_from(self.mm, _FREED_AT)[0]


class _BlockPool:
    """Blocks registered with one engine, reused by size class, at most `max_bytes` in all and at
    most `idle_bytes` of them idle. `is_free` says whether a block may be claimed."""

    def __init__(self, engine: Any, is_free: Callable[[_Block], bool], max_bytes: int, idle_bytes: int) -> None:
        self.engine = engine
        self.is_free = is_free
        self.max_bytes = max_bytes
        self.idle_bytes = idle_bytes
        self.blocks: dict[int, _Block] = {}
        self.lock = threading.Lock()

    def claim(self, nbytes: int, what: str, take: Callable[[_Block], None]) -> _Block:
        """A free block with room for `nbytes` payload bytes, marked used by `take` under the lock."""
        capacity = size_class(nbytes)
        with self.lock:
            block = next((b for b in self.blocks.values() if b.capacity == capacity and self.is_free(b)), None)
            if block is None:
                self._trim_locked()
                held = sum(b.capacity for b in self.blocks.values())
                if held + capacity > self.max_bytes:
                    raise PayloadTooLarge(
                        f"mooncake p2p: {what} needs {capacity / 1024**2:.1f} MiB but {held / 1024**2:.1f} "
                        f"of {self.max_bytes / 1024**2:.1f} MiB are held by payloads not yet released; raise "
                        "connectors.mooncake.globalSegmentSize or release payloads sooner"
                    )
                block = self._create(capacity)
                self.blocks[block.address] = block
            take(block)
            return block

    def _create(self, capacity: int) -> _Block:
        mm = mmap.mmap(-1, _HDR + capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
        array = np.frombuffer(mm, np.uint8)
        address = array.ctypes.data
        rc = self.engine.register_memory(address, _HDR + capacity)
        if rc != 0:
            del array
            mm.close()
            raise ConnectorError(f"mooncake p2p: registering {capacity / 1024**2:.1f} MiB failed ({rc})")
        mm[0:8] = _MAGIC
        return _Block(capacity, mm, array, address)

    def _trim_locked(self) -> None:
        idle = [b for b in self.blocks.values() if self.is_free(b)]
        excess = sum(b.capacity for b in idle) - self.idle_bytes
        for block in sorted(idle, key=lambda b: -b.capacity):
            if excess <= 0:
                break
            excess -= block.capacity
            self._drop_locked(block)

    def _drop_locked(self, block: _Block) -> None:
        self.blocks.pop(block.address, None)
        self.engine.unregister_memory(block.address)
        block.array = np.empty(0, np.uint8)
        try:
            block.mm.close()
        except BufferError:
            pass  # views handed out by `get` still use it; it goes when they do

    def trim(self) -> None:
        with self.lock:
            self._trim_locked()

    def close(self) -> None:
        with self.lock:
            for block in list(self.blocks.values()):
                self._drop_locked(block)

    def stats(self) -> dict[str, int]:
        with self.lock:
            blocks = list(self.blocks.values())
            busy = sum(1 for b in blocks if not self.is_free(b))
        return {"blocks": len(blocks), "busy": busy, "bytes": sum(b.capacity for b in blocks)}


class MooncakePeerConnector(Connector):
    """Transfer-engine peer-to-peer connector; one per process (one engine), for every mooncake edge."""

    kind: ClassVar[str] = ConnectorKind.MOONCAKE

    def __init__(
        self,
        spec: ConnectorsSpec | None = None,
        *,
        pipeline: str = "local",
        local_hostname: str = "127.0.0.1",
        master_host: str = "127.0.0.1",
        metadata_server: str | None = None,
        port: int | None = None,
        pool_max_bytes: int = 256 * 1024**2,
        thread_min_bytes: int = 2 * 1024**2,
        max_threads: int = 4,
    ) -> None:
        """`local_hostname`: this pod's address as other pods reach it; the engine listens on `port`
        (default: a free one). Metadata at `metadata_server` (default
        `http://<master_host>:<metadataPort>/metadata`). Blocks of unreleased payloads may take up to
        `spec.mooncake.globalSegmentSize` bytes; idle blocks beyond `pool_max_bytes` (per side:
        sending and receiving) are freed. Puts and reads of `thread_min_bytes` or more run in worker
        threads (a put's copy in two); smaller ones (a read is about a millisecond over TCP) run on
        the event loop, where a thread hop would cost a good part of the call."""
        mc = (spec or ConnectorsSpec()).mooncake
        self.pipeline = pipeline
        self.metadata_server = metadata_server or default_metadata_server(master_host, mc)
        self.protocol = mc.protocol
        self.thread_min_bytes = thread_min_bytes
        engine_module = mooncake_module("engine")
        for attempt in range(3):  # a port found free may be taken before the engine binds it
            self.engine = engine_module.TransferEngine()
            self.segment = f"{local_hostname}:{port or free_port(local_hostname)}"
            rc = self.engine.initialize(self.segment, self.metadata_server, mc.protocol.value, mc.device_name)
            if rc == 0:
                break
            if port is not None or attempt == 2:
                raise ConnectorError(
                    f"could not start the Mooncake transfer engine as {self.segment} (metadata "
                    f"{self.metadata_server}, protocol {mc.protocol.value}): initialize returned {rc}; check "
                    "that the metadata server (the pipeline's Mooncake master) is reachable"
                    + ("" if not mc.device_name else f" and that RDMA device {mc.device_name!r} exists")
                )
        self._out = _BlockPool(self.engine, _owner_block_free, mc.global_segment_size, pool_max_bytes)
        self._in = _BlockPool(self.engine, lambda b: not b.busy, mc.global_segment_size, pool_max_bytes)
        self._release_src = np.zeros(_RELEASE_WORDS, np.uint64)
        self.engine.register_memory(self._release_src.ctypes.data, self._release_src.nbytes)
        self._release_slot = itertools.count()
        self._reading: dict[tuple[str, int, int], _Block] = {}
        self._inflight: dict[tuple[str, int, int], set[concurrent.futures.Future]] = {}
        self._executor = concurrent.futures.ThreadPoolExecutor(max_threads, thread_name_prefix="omnikube-mcp2p")
        self._copier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="omnikube-mcp2p-copy")
        self._closed = False

    # -- producer side -------------------------------------------------------------------------

    async def put(self, source_stage: str, target_stage: str, key: str, payload: Payload) -> MooncakePeerHandle:
        self._check_open()
        header, frames = encode_payload(payload)
        layout = [len(header), *(f.nbytes for f in frames)]
        nbytes = sum(layout)
        claims: list[tuple[_Block, int]] = []
        executor = self._executor if nbytes >= self.thread_min_bytes else None
        block, generation = await run_blocking(
            executor, self._put_sync, claims, layout, header, frames, undo=lambda: self._unclaim(claims)
        )
        return MooncakePeerHandle(
            key=key,
            source=source_stage,
            target=target_stage,
            nbytes=nbytes,
            segment=self.segment,
            address=block.address,
            generation=generation,
            layout=layout,
        )

    def _put_sync(self, claims: list, layout: list[int], header: bytes, frames: list[memoryview]) -> tuple[_Block, int]:
        offsets, total = frame_offsets(layout)
        block = self._out.claim(total, "a put", _next_generation)
        generation = block.generation
        claims.append((block, generation))
        copies = []
        for offset, size, data in zip(offsets, layout, [memoryview(header), *frames], strict=True):
            if size:
                start = _HDR + offset
                copies.append((block.array[start : start + size], np.frombuffer(data, np.uint8)))
        if total < self.thread_min_bytes:
            _copy_all(copies)
            return block, generation
        # Large: two threads copy halves (numpy releases the GIL), so the put costs half a memcpy; this
        # runs in a worker, and the helper pool is used by nothing that waits, so it cannot deadlock.
        half = total // 2
        first, second, done = [], [], 0
        for dst, src in copies:
            cut = min(max(half - done, 0), src.nbytes)
            first.append((dst[:cut], src[:cut]))
            second.append((dst[cut:], src[cut:]))
            done += src.nbytes
        helper = self._copier.submit(_copy_all, first)
        try:
            _copy_all(second)
        finally:
            helper.result()  # a put undone on failure must not race the helper's copy
        return block, generation

    def _unclaim(self, claims: list[tuple[_Block, int]]) -> None:
        for block, generation in claims:
            _WORD.pack_into(block.mm, _FREED_AT, generation)

    # -- consumer side -------------------------------------------------------------------------

    async def get(self, handle: Handle) -> dict[str, Any]:
        h = self._check_handle(handle, MooncakePeerHandle)
        self._check_open()
        if h.segment == self.segment:
            return self._get_own(h)
        ident = (h.segment, h.address, h.generation)
        if h.nbytes < self.thread_min_bytes:
            return self._get_sync(h, ident)
        cf = self._executor.submit(self._get_sync, h, ident)
        self._inflight.setdefault(ident, set()).add(cf)
        cf.add_done_callback(lambda f: self._inflight.get(ident, set()).discard(f))
        return await asyncio.shield(asyncio.wrap_future(cf))

    def _get_own(self, h: MooncakePeerHandle) -> dict[str, Any]:
        block = self._out.blocks.get(h.address)
        if block is None or block.generation != h.generation or block.freed() == h.generation:
            raise _released(h)
        return self._decode(h, block)

    def _get_sync(self, h: MooncakePeerHandle, ident: tuple[str, int, int]) -> dict[str, Any]:
        _, total = frame_offsets(h.layout)
        pool = self._in
        block = pool.claim(total, f"reading {h.key!r}", _mark_busy)
        try:
            rc = self._read(h.segment, block.address, h.address, _HDR + total)
            if rc != 0:
                raise PayloadGone(
                    f"mooncake payload {h.key!r} ({h.source}->{h.target}): reading it from {h.segment} failed "
                    f"({rc}); its producer exited or released it"
                )
            head = block.mm[0:24]
            generation, freed = _WORD.unpack_from(head, _GEN_AT)[0], _WORD.unpack_from(head, _FREED_AT)[0]
            if head[0:8] != _MAGIC or generation != h.generation or freed == h.generation:
                raise _released(h)
            payload = self._decode(h, block)
        except BaseException:
            block.busy = False
            raise
        with pool.lock:
            previous = self._reading.pop(ident, None)
            if previous is not None:  # read twice: the first copy's views stay valid until release too
                previous.busy = False
            self._reading[ident] = block
        return payload

    def _read(self, segment: str, local: int, remote: int, nbytes: int) -> int:
        """One read; below `_SLICED_READ_MAX` in up to `_READ_SLICES` parallel slices. The engine moves
        one request over one connection at a time, so a 1 MiB read in four slices takes about half as
        long over TCP; larger reads are bandwidth-bound, and slicing them gained nothing measurable."""
        slices = max(1, min(_READ_SLICES, nbytes // _READ_SLICE_MIN)) if nbytes < _SLICED_READ_MAX else 1
        if slices == 1:
            return self.engine.transfer_sync_read(segment, local, remote, nbytes)
        step = -(-nbytes // slices)
        starts = range(0, nbytes, step)
        return self.engine.batch_transfer_sync_read(
            segment, [local + o for o in starts], [remote + o for o in starts], [min(step, nbytes - o) for o in starts]
        )

    def _decode(self, h: MooncakePeerHandle, block: _Block) -> dict[str, Any]:
        offsets, _ = frame_offsets(h.layout)
        view = memoryview(block.mm)
        parts = [view[_HDR + o : _HDR + o + n] for o, n in zip(offsets, h.layout, strict=True)]
        return decode_payload(parts[0], parts[1:])

    async def release(self, handle: Handle) -> None:
        h = self._check_handle(handle, MooncakePeerHandle)
        ident = (h.segment, h.address, h.generation)
        pending = self._inflight.pop(ident, None)
        if pending:
            await wait_settled(list(pending))
        with self._in.lock:
            block = self._reading.pop(ident, None)
            if block is not None:
                block.busy = False
        if h.segment == self.segment:
            self._free_own(h)
        elif not self._closed:
            # Nobody waits for the producer to hear it: the write runs in a worker (close waits for it).
            self._executor.submit(self._free_remote, h)

    def _free_own(self, h: MooncakePeerHandle) -> None:
        block = self._out.blocks.get(h.address)
        if block is not None and block.generation == h.generation:
            _WORD.pack_into(block.mm, _FREED_AT, h.generation)

    def _free_remote(self, h: MooncakePeerHandle) -> None:
        slot = next(self._release_slot) % _RELEASE_WORDS  # one word per running worker at most
        self._release_src[slot] = h.generation
        source = self._release_src.ctypes.data + slot * 8
        try:
            rc = self.engine.transfer_sync_write(h.segment, source, h.address + _FREED_AT, 8)
        except Exception:
            log.exception("mooncake p2p: releasing %s at %s failed", h.key, h.segment)
            return
        if rc != 0:  # its producer is gone, and the payload with it: nothing is left to free
            log.info("mooncake p2p: releasing %s at %s failed (%s); its producer is gone", h.key, h.segment, rc)

    # -- lifetime ------------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Blocks this connector holds: sending (`busy`: put, not yet released) and receiving."""
        out, inn = self._out.stats(), self._in.stats()
        return {**out, "receiving": inn["busy"], "receive_bytes": inn["bytes"]}

    def trim(self) -> None:
        """Free idle blocks beyond `pool_max_bytes` now (also happens when a pool grows)."""
        self._out.trim()
        self._in.trim()

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectorError("mooncake connector is closed")

    def close(self) -> None:
        """Wait for running transfers, free every block (payloads not yet read included) and leave
        the metadata server."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True)
        self._copier.shutdown(wait=True)
        self._out.close()
        self._in.close()
        self.engine.unregister_memory(self._release_src.ctypes.data)
        # the engine's destructor removes its segment from the metadata server: drop every reference
        self._out.engine = self._in.engine = self.engine = None


def _released(h: MooncakePeerHandle) -> PayloadGone:
    return PayloadGone(f"mooncake payload {h.key!r} ({h.source}->{h.target}) was already released")


def _copy_all(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in pairs:
        if src.nbytes:
            np.copyto(dst, src)


def _next_generation(block: _Block) -> None:
    block.generation += 1
    _WORD.pack_into(block.mm, _GEN_AT, block.generation)


def _mark_busy(block: _Block) -> None:
    block.busy = True


def _owner_block_free(block: _Block) -> bool:
    return block.freed() == block.generation
