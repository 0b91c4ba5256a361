"""The `shm` connector: POSIX shared memory (files under /dev/shm) between processes of one pod.

Layout. The producer's connector owns a pool of segments `/dev/shm/omnikube-<pipeline>-<owner>-p<pid>-<id>`.
Each starts with a 64-byte header (magic, a state word `generation << 1 | busy`, capacity, owner
pid); the payload (msgpack header, then each frame at a 64-byte boundary) follows. `put` claims a
free segment of the right size class (or creates one: `posix_fallocate`, so a full /dev/shm is an
error rather than a SIGBUS), bumps its generation, and copies the frames straight into its
mapping: one copy, into memory that is already mapped and faulted in.

`get` maps the segment (mappings are cached per process) and returns tensors that are **views of
the shared segment: they stay valid until `release`** and must not be used after it (the producer
reuses the segment). Consumers that keep data longer copy it (moving to a GPU does) or construct
the connector with `copy_out=True`. `release` flips the state word back to free if the handle's
generation still holds, so a second release, or one for an already reused segment, does nothing.

Files are plain `/dev/shm` files opened with `os.open` and `mmap`, not
`multiprocessing.shared_memory`, so Python's resource tracker never unlinks or warns about them.
`close()` unlinks every segment the connector created (payloads not yet read included); segments
left by a crashed process are removed by `sweep_orphans`.

A handle's segment name comes off the network, so `get` and `release` accept only names this connector
could have made for its pipeline (`omnikube-<pipeline>-<owner>-p<pid>-<16 hex>`, no path separators):
a handle naming any other file is refused before the name is joined to a path.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import errno
import mmap
import os
import re
import struct
import threading
import uuid
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
    ReleasedBy,
    run_blocking,
    wait_settled,
)
from omni_runtime.connectors.codec import decode_payload, encode_payload, frame_offsets, size_class
from omni_runtime.connectors.kind import ConnectorSettings, KindDeclaration
from omni_runtime.spec import ResolvedPipeline
from omni_runtime.spec.connectors import ConnectorKind, ConnectorsSpec

__all__ = ["KIND", "SHM_DIR", "SEGMENT_PREFIX", "ShmConnector", "ShmHandle", "segment_prefix", "sweep_orphans"]

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "omnikube-"
_MAGIC = b"OMNISHM1"
_HDR = 64  # segment header; payload starts here
_STATE_AT = 8
_WORD = struct.Struct("<Q")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_OWNER_RE = re.compile(r"-p(\d+)-[0-9a-f]{16}$")


class ShmHandle(Handle, frozen=True, kw_only=True, tag="shm"):
    """A block in a POSIX shared-memory segment owned by the producer's connector."""

    kind: ClassVar[str] = ConnectorKind.SHM
    released_by: ClassVar[ReleasedBy] = ReleasedBy.PRODUCER

    segment: str
    """File name under /dev/shm (`omnikube-...`)."""
    generation: int
    """Which use of the (pooled) segment this handle refers to; stale handles are detected."""
    layout: list[int]
    """Header length followed by each frame's length; offsets follow from `codec.frame_offsets`."""


@dataclass(eq=False)
class _Segment:
    name: str
    capacity: int
    mm: mmap.mmap
    generation: int = 0

    def state(self) -> int:
        return _WORD.unpack_from(self.mm, _STATE_AT)[0]


class ShmConnector(Connector):
    """Shared-memory connector; one per process, used for every shm edge the process has."""

    kind: ClassVar[str] = ConnectorKind.SHM

    def __init__(
        self,
        spec: ConnectorsSpec | None = None,
        *,
        pipeline: str = "local",
        owner: str = "stage",
        shm_dir: str = SHM_DIR,
        pool_max_bytes: int = 512 * 1024**2,
        copy_out: bool = False,
        thread_min_bytes: int = 32 * 1024**2,
        max_threads: int = 2,
        map_cache_size: int = 64,
    ) -> None:
        """`pool_max_bytes`: idle segment bytes kept for reuse (0: unlink segments once released and
        noticed). `copy_out`: `get` returns copies instead of views. Copies of `thread_min_bytes` or
        more run in worker threads (the copy releases the GIL, so the event loop keeps running);
        smaller ones run inline, where a thread hop would cost more than it saves."""
        self.spec = spec
        self.shm_dir = shm_dir
        self.prefix = f"{segment_prefix(pipeline, owner)}p{os.getpid()}-"
        self._valid_name = re.compile(
            rf"{re.escape(segment_prefix(pipeline))}[A-Za-z0-9_.]{{1,48}}-p[0-9]{{1,10}}-[0-9a-f]{{16}}"
        )
        self.pool_max_bytes = pool_max_bytes
        self.copy_out = copy_out
        self.thread_min_bytes = thread_min_bytes
        self._segments: dict[str, _Segment] = {}
        self._maps: collections.OrderedDict[str, tuple[mmap.mmap, int]] = collections.OrderedDict()
        self._map_cache_size = map_cache_size
        self._inflight: dict[tuple[str, int], set[concurrent.futures.Future]] = {}
        self._lock = threading.RLock()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_threads, thread_name_prefix="omnikube-shm")
        self._closed = False

    # -- producer side -------------------------------------------------------------------------

    async def put(self, source_stage: str, target_stage: str, key: str, payload: Payload) -> ShmHandle:
        header, frames = encode_payload(payload)
        layout = [len(header), *(f.nbytes for f in frames)]
        _, total = frame_offsets(layout)
        claims: list[tuple[_Segment, int]] = []
        executor = self._executor if total >= self.thread_min_bytes else None
        seg, gen = await run_blocking(
            executor, self._put_sync, claims, layout, header, frames, undo=lambda: self._unclaim(claims)
        )
        return ShmHandle(
            key=key,
            source=source_stage,
            target=target_stage,
            nbytes=sum(layout),
            segment=seg.name,
            generation=gen,
            layout=layout,
        )

    def _put_sync(
        self, claims: list, layout: list[int], header: bytes, frames: list[memoryview]
    ) -> tuple[_Segment, int]:
        offsets, total = frame_offsets(layout)
        seg, gen = self._claim(total)
        claims.append((seg, gen))
        mm = seg.mm
        for offset, size, data in zip(offsets, layout, [memoryview(header), *frames], strict=True):
            if size:
                start = _HDR + offset
                np.copyto(np.frombuffer(mm, np.uint8, size, start), np.frombuffer(data, np.uint8))
        return seg, gen

    def _claim(self, total: int) -> tuple[_Segment, int]:
        size = size_class(total)
        with self._lock:
            self._check_open()
            seg = next((s for s in self._segments.values() if s.capacity == size and not s.state() & 1), None)
            if seg is not None:
                seg.generation += 1
                _WORD.pack_into(seg.mm, _STATE_AT, seg.generation << 1 | 1)
                self._trim_locked()
                return seg, seg.generation
        seg = self._create(size)  # slow (allocates memory): outside the lock
        with self._lock:
            self._segments[seg.name] = seg
            if self._closed:
                self._drop_locked(seg)
                self._check_open()
            self._trim_locked()
        return seg, seg.generation

    def _create(self, capacity: int) -> _Segment:
        name = f"{self.prefix}{uuid.uuid4().hex[:16]}"
        path = os.path.join(self.shm_dir, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, _HDR + capacity)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise PayloadTooLarge(
                        f"{self.shm_dir} has no room for a {capacity / 1024**2:.1f} MiB segment "
                        f"({e.strerror}); give the pod more shared memory (an emptyDir with medium Memory "
                        "and a larger sizeLimit), release payloads sooner, or use 'mooncake' for this edge"
                    ) from e
                raise
            mm = mmap.mmap(fd, _HDR + capacity, flags=mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        mm[0:8] = _MAGIC
        struct.pack_into("<QQQ", mm, _STATE_AT, 1 << 1 | 1, capacity, os.getpid())
        return _Segment(name, capacity, mm, generation=1)

    def _unclaim(self, claims: list[tuple[_Segment, int]]) -> None:
        with self._lock:
            for seg, gen in claims:
                if seg.state() == gen << 1 | 1:
                    _WORD.pack_into(seg.mm, _STATE_AT, gen << 1)

    def _trim_locked(self) -> None:
        idle = [s for s in self._segments.values() if not s.state() & 1]
        excess = sum(s.capacity for s in idle) - self.pool_max_bytes
        for seg in sorted(idle, key=lambda s: -s.capacity):
            if excess <= 0:
                break
            excess -= seg.capacity
            self._drop_locked(seg)

    def _drop_locked(self, seg: _Segment) -> None:
        self._segments.pop(seg.name, None)
        _unlink(os.path.join(self.shm_dir, seg.name))
        _close_mapping(seg.mm)

    def trim(self) -> None:
        """Unlink idle segments beyond `pool_max_bytes` now (also happens on every `put`)."""
        with self._lock:
            self._trim_locked()

    def stats(self) -> dict[str, int]:
        """Segments this connector created: count, busy (put, not yet released), bytes."""
        with self._lock:
            segs = list(self._segments.values())
            busy = sum(1 for s in segs if s.state() & 1)
        return {"segments": len(segs), "busy": busy, "bytes": sum(s.capacity for s in segs)}

    # -- consumer side -------------------------------------------------------------------------

    async def get(self, handle: Handle) -> dict[str, Any]:
        h = self._check_handle(handle, ShmHandle)
        if not self.copy_out or h.nbytes < self.thread_min_bytes:
            return self._get_sync(h)  # views only: no copy worth a thread
        cf = self._executor.submit(self._get_sync, h)
        ident = (h.segment, h.generation)
        self._inflight.setdefault(ident, set()).add(cf)
        cf.add_done_callback(lambda f: self._inflight.get(ident, set()).discard(f))
        return await asyncio.shield(asyncio.wrap_future(cf))

    def _check_segment(self, h: ShmHandle) -> None:
        if not self._valid_name.fullmatch(h.segment):
            raise ConnectorError(
                f"shm handle {h.key!r} ({h.source}->{h.target}) names segment {h.segment[:120]!r}, which is not "
                f"one of this pipeline's (expected {self._valid_name.pattern}); refusing it"
            )

    def _get_sync(self, h: ShmHandle) -> dict[str, Any]:
        self._check_segment(h)
        mm = self._map(h)
        offsets, total = frame_offsets(h.layout)
        busy = h.generation << 1 | 1
        if _WORD.unpack_from(mm, _STATE_AT)[0] != busy:
            raise PayloadGone(f"shm payload {h.key!r} ({h.source}->{h.target}) was already released")
        if self.copy_out:
            buf = np.empty(total, np.uint8)
            np.copyto(buf, np.frombuffer(mm, np.uint8, total, _HDR))
            view, base = buf.data, 0
        else:
            view, base = memoryview(mm), _HDR
        parts = [view[base + o : base + o + n] for o, n in zip(offsets, h.layout, strict=True)]
        payload = decode_payload(parts[0], parts[1:])
        if _WORD.unpack_from(mm, _STATE_AT)[0] != busy:
            raise PayloadGone(f"shm payload {h.key!r} ({h.source}->{h.target}) was released while read")
        return payload

    def _map(self, h: ShmHandle) -> mmap.mmap:
        with self._lock:
            self._check_open()
            own = self._segments.get(h.segment)
            if own is not None:
                return own.mm
            cached = self._maps.get(h.segment)
            if cached is not None:
                self._maps.move_to_end(h.segment)
                return cached[0]
        path = os.path.join(self.shm_dir, h.segment)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise PayloadGone(
                f"shm payload {h.key!r} ({h.source}->{h.target}): segment {h.segment} is gone "
                "(its producer closed or it was swept)"
            ) from None
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            os.close(fd)
            raise
        if mm[0:8] != _MAGIC:
            os.close(fd)
            raise ConnectorError(f"{path} is not an omnikube shm segment")
        with self._lock:
            self._maps[h.segment] = (mm, fd)
            self._evict_maps_locked()
        return mm

    def _evict_maps_locked(self) -> None:
        for name, (_, fd) in list(self._maps.items()):
            if len(self._maps) > self._map_cache_size or os.fstat(fd).st_nlink == 0:
                del self._maps[name]
                os.close(fd)  # the mapping itself lives until no view of it is left

    async def release(self, handle: Handle) -> None:
        h = self._check_handle(handle, ShmHandle)
        self._check_segment(h)
        pending = self._inflight.pop((h.segment, h.generation), None)
        if pending:
            await wait_settled(list(pending))
        self._release_sync(h)

    def _release_sync(self, h: ShmHandle) -> None:
        busy, free = h.generation << 1 | 1, h.generation << 1
        with self._lock:
            mm = self._segments[h.segment].mm if h.segment in self._segments else None
            if mm is None and h.segment in self._maps:
                mm = self._maps[h.segment][0]
            if mm is not None:
                if _WORD.unpack_from(mm, _STATE_AT)[0] == busy:
                    _WORD.pack_into(mm, _STATE_AT, free)
                return
        try:
            fd = os.open(os.path.join(self.shm_dir, h.segment), os.O_RDWR)
        except FileNotFoundError:
            return
        try:
            if os.pread(fd, 8, _STATE_AT) == _WORD.pack(busy):
                os.pwrite(fd, _WORD.pack(free), _STATE_AT)
        finally:
            os.close(fd)

    # -- lifetime ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectorError("shm connector is closed")

    def close(self) -> None:
        """Stop workers, unlink every segment this connector created, drop cached mappings."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._executor.shutdown(wait=True)
        with self._lock:
            for seg in list(self._segments.values()):
                self._drop_locked(seg)
            for _, fd in self._maps.values():
                os.close(fd)
            self._maps.clear()


def segment_prefix(pipeline: str, owner: str | None = None) -> str:
    """Name prefix of segments for a pipeline (and one owner in it), for `sweep_orphans`."""
    prefix = f"{SEGMENT_PREFIX}{_safe(pipeline)}-"
    return prefix if owner is None else f"{prefix}{_safe(owner)}-"


def sweep_orphans(prefix: str = SEGMENT_PREFIX, *, shm_dir: str = SHM_DIR, live_owners_too: bool = False) -> list[str]:
    """Unlink leftover segments whose names start with `prefix`; returns the names removed.

    By default a segment whose owner pid (part of its name) is still alive is kept. Pids are only
    meaningful in the caller's pid namespace: sweep from the pod that owns the segments."""
    if not prefix.startswith(SEGMENT_PREFIX):
        raise ValueError(f"prefix {prefix!r} must start with {SEGMENT_PREFIX!r}; other files are not ours")
    removed = []
    for name in sorted(os.listdir(shm_dir)):
        if not name.startswith(prefix):
            continue
        match = _OWNER_RE.search(name)
        if not live_owners_too and match and _alive(int(match.group(1))):
            continue
        if _unlink(os.path.join(shm_dir, name)):
            removed.append(name)
    return removed


def _safe(part: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", part)[:48] or "_"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _close_mapping(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # views handed out by `get` in this process still use it; it goes when they do


def _runtime_info(pipeline: ResolvedPipeline, settings: ConnectorSettings) -> dict[str, Any]:
    return {"pipeline": pipeline.name, "owner": settings.owner, "pool_max_bytes": settings.shm_pool_bytes}


KIND = KindDeclaration(
    name=ConnectorKind.SHM,
    handles=(ShmHandle,),
    connector_class=lambda _spec: ShmConnector,
    runtime_info=_runtime_info,
    trim_on_tick=True,  # consumers release in other processes: the owner sees it on its next put, or on the tick
    sweep=lambda pipeline: sweep_orphans(segment_prefix(pipeline)),
)
