"""The `mooncake` connector in mode `store`: payloads as Mooncake Store objects, between pods (TCP or RDMA).

Every stage process joins the store as a client (contributing `global_segment_size` bytes of memory
that objects may be placed in) and talks to the pipeline's master (its own pod in a cluster). One `put` is one object,
key `omnikube/<pipeline>/<key>/<source>-><target>/<nonce>`, written straight from the tensors' memory
(`batch_put_from_multi_buffers`: header, padding, frames; no staging copy) and hard-pinned, so
the store refuses new objects when full (`PayloadTooLarge`) instead of evicting unread ones.
Objects go to the producer's own segment while it has room (a local copy; the one network
transfer happens on `get`); Mooncake falls back to other segments when it is full.
`get` reads the whole object into one fresh buffer (`get_into`) and decodes tensors as views of
it, so results own their memory and stay valid after `release`. `release` force-removes the key.

With `protocol: rdma` the buffers are registered with the transfer engine around each call
(`register_buffers`); TCP needs no registration.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import socket
import uuid
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
from omni_runtime.connectors.codec import decode_payload, encode_payload, frame_offsets
from omni_runtime.connectors.mooncake import MooncakeHandle, default_metadata_server, mooncake_module
from omni_runtime.spec.connectors import ConnectorKind, ConnectorsSpec
from omni_runtime.spec.enums import MooncakeProtocol

__all__ = ["KEY_PREFIX", "MooncakeStoreConnector"]

KEY_PREFIX = "omnikube/"
_NOT_FOUND = -704
_NO_SPACE = -200
_ERRORS = {
    -200: "no room left in the store's segments",
    -600: "invalid parameters or local buffer too small",
    -704: "object not found",
    -705: "object already exists",
    -706: "object has an active lease",
    -800: "transfer failed",
    -900: "RPC to the master failed",
}
_ZEROS = np.zeros(64, np.uint8)


class MooncakeStoreConnector(Connector):
    """Mooncake Store connector; one per process (one store client), for every mooncake edge."""

    kind: ClassVar[str] = ConnectorKind.MOONCAKE

    def __init__(
        self,
        spec: ConnectorsSpec | None = None,
        *,
        pipeline: str = "local",
        local_hostname: str = "127.0.0.1",
        master_host: str = "127.0.0.1",
        master_address: str | None = None,
        metadata_server: str | None = None,
        store: Any = None,
        register_buffers: bool | None = None,
        prefer_local_segment: bool = True,
        max_threads: int = 4,
    ) -> None:
        """`local_hostname`: this pod's address as other pods reach it. The master is found at
        `master_address` (default `<master_host>:<spec.mooncake.masterPort>`), metadata at
        `metadata_server` (default `http://<master_host>:<metadataPort>/metadata`). Pass `store` to
        share an already set-up `MooncakeDistributedStore` (it is then not closed by `close`).
        `prefer_local_segment`: place objects in this client's own segment while it has room, so a
        put is a local copy and the payload crosses the network once, on `get`."""
        mc = (spec or ConnectorsSpec()).mooncake
        self.master_address = master_address or f"{master_host}:{mc.master_port}"
        self.metadata_server = metadata_server or default_metadata_server(master_host, mc)
        self.protocol = mc.protocol
        rdma = mc.protocol is MooncakeProtocol.RDMA
        self.register_buffers = rdma if register_buffers is None else register_buffers
        self.prefix = f"{KEY_PREFIX}{_safe(pipeline)}/"
        store_module = mooncake_module("store")
        self._owns_store = store is None
        if store is None:
            _check_reachable(self.master_address, self.metadata_server)
            store = store_module.MooncakeDistributedStore()
            rc = store.setup(
                local_hostname, self.metadata_server, mc.global_segment_size, mc.local_buffer_size,
                mc.protocol.value, mc.device_name, self.master_address,
            )  # fmt: skip
            if rc != 0:
                raise ConnectorError(
                    f"could not join the Mooncake store (master {self.master_address}, metadata "
                    f"{self.metadata_server}, protocol {mc.protocol.value}, local host {local_hostname}): "
                    f"setup returned {rc}; check that the master runs and is reachable from this pod"
                    + ("" if not rdma else f" and that RDMA device {mc.device_name!r} exists")
                )
        self.store = store
        if self.register_buffers:
            store.register_buffer(_ZEROS.ctypes.data, _ZEROS.nbytes)  # padding source, for good
        self._config = store_module.ReplicateConfig()
        self._config.with_hard_pin = True
        if prefer_local_segment:
            self._config.preferred_segment = store.get_hostname()  # falls back to others when full
        self._executor = concurrent.futures.ThreadPoolExecutor(max_threads, thread_name_prefix="omnikube-mooncake")
        self._inflight: dict[str, set[concurrent.futures.Future]] = {}
        self._closed = False

    async def put(self, source_stage: str, target_stage: str, key: str, payload: Payload) -> MooncakeHandle:
        self._check_open()
        header, frames = encode_payload(payload)
        layout = [len(header), *(f.nbytes for f in frames)]
        edge = f"{_safe(source_stage)}->{_safe(target_stage)}"
        store_key = f"{self.prefix}{_safe(key)}/{edge}/{uuid.uuid4().hex[:12]}"
        handle = MooncakeHandle(
            key=key,
            source=source_stage,
            target=target_stage,
            nbytes=sum(layout),
            store_key=store_key,
            layout=layout,
        )
        await run_blocking(
            self._executor, self._put_sync, handle, header, frames, undo=lambda: self._remove_sync(store_key)
        )
        return handle

    def _put_sync(self, h: MooncakeHandle, header: bytes, frames: list[memoryview]) -> None:
        offsets, _ = frame_offsets(h.layout)
        ptrs: list[int] = []
        sizes: list[int] = []
        keep = []
        end = 0
        for offset, size, data in zip(offsets, h.layout, [memoryview(header), *frames], strict=True):
            if offset > end:
                ptrs.append(_ZEROS.ctypes.data)
                sizes.append(offset - end)
            if size:
                array = np.frombuffer(data, np.uint8)
                keep.append(array)
                ptrs.append(array.ctypes.data)
                sizes.append(size)
            end = offset + size
        with self._registered([(a.ctypes.data, a.nbytes) for a in keep]):
            rc = self.store.batch_put_from_multi_buffers([h.store_key], [ptrs], [sizes], self._config)[0]
        if rc != 0:
            self._remove_sync(h.store_key)
            if rc == _NO_SPACE:
                raise PayloadTooLarge(
                    f"mooncake put {h.store_key} ({h.nbytes / 1024**2:.1f} MiB): {_describe(rc)}; unread "
                    "payloads fill it. Raise connectors.mooncake.globalSegmentSize, add stage replicas "
                    "(each contributes a segment), or release payloads sooner"
                )
            raise ConnectorError(f"mooncake put {h.store_key} failed: {_describe(rc)}")

    async def get(self, handle: Handle) -> dict[str, Any]:
        h = self._check_handle(handle, MooncakeHandle)
        self._check_open()
        cf = self._executor.submit(self._get_sync, h)
        self._inflight.setdefault(h.store_key, set()).add(cf)
        cf.add_done_callback(lambda f: self._inflight.get(h.store_key, set()).discard(f))
        return await asyncio.shield(asyncio.wrap_future(cf))

    def _get_sync(self, h: MooncakeHandle) -> dict[str, Any]:
        offsets, total = frame_offsets(h.layout)
        buf = np.empty(total, np.uint8)
        with self._registered([(buf.ctypes.data, total)]):
            rc = self.store.get_into(h.store_key, buf.ctypes.data, total)
        if rc == _NOT_FOUND:
            raise PayloadGone(f"mooncake payload {h.key!r} ({h.source}->{h.target}): {h.store_key} is gone")
        if rc != total:
            raise ConnectorError(
                f"mooncake get {h.store_key}: expected {total} bytes, got "
                + (_describe(rc) if rc < 0 else f"{rc} bytes")
            )
        view = buf.data
        parts = [view[o : o + n] for o, n in zip(offsets, h.layout, strict=True)]
        return decode_payload(parts[0], parts[1:])

    async def release(self, handle: Handle) -> None:
        h = self._check_handle(handle, MooncakeHandle)
        pending = self._inflight.pop(h.store_key, None)
        if pending:
            await wait_settled(list(pending))
        if self._closed:
            raise ConnectorError(f"mooncake connector is closed; {h.store_key} was not removed")
        await run_blocking(self._executor, self._remove_sync, h.store_key)

    def _remove_sync(self, store_key: str) -> None:
        rc = self.store.remove(store_key, True)
        if rc not in (0, _NOT_FOUND):
            raise ConnectorError(f"mooncake remove {store_key} failed: {_describe(rc)}")

    def exists(self, handle: MooncakeHandle) -> bool:
        """Whether the store still holds the handle's object (asks the master)."""
        rc = self.store.is_exist(handle.store_key)
        if rc < 0:
            raise ConnectorError(f"mooncake is_exist {handle.store_key} failed: {_describe(rc)}")
        return rc == 1

    def sweep(self, prefix: str | None = None) -> int:
        """Remove every object whose key starts with `prefix` (default: this pipeline's); returns how many."""
        prefix = prefix or self.prefix
        if not prefix.startswith(KEY_PREFIX):
            raise ValueError(f"prefix {prefix!r} must start with {KEY_PREFIX!r}; other keys are not ours")
        rc = self.store.remove_by_regex("^" + _regex_escape(prefix), True)
        if rc < 0:
            raise ConnectorError(f"mooncake sweep of {prefix!r} failed: {_describe(rc)}")
        return rc

    def _registered(self, regions: list[tuple[int, int]]) -> _Registration:
        return _Registration(self.store, regions if self.register_buffers else [])

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectorError("mooncake connector is closed")

    def close(self) -> None:
        """Wait for running transfers, then leave the store (objects placed in this client's segment
        are lost with it; release or read them first)."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True)
        if self._owns_store:
            self.store.close()


class _Registration:
    def __init__(self, store: Any, regions: list[tuple[int, int]]) -> None:
        self.store = store
        self.regions = regions
        self.done: list[int] = []

    def __enter__(self) -> _Registration:
        for ptr, size in dict(self.regions).items():  # one registration per address
            if size == 0:
                continue
            rc = self.store.register_buffer(ptr, size)
            if rc != 0:
                self.__exit__()
                raise ConnectorError(f"mooncake register_buffer of {size} bytes failed: {_describe(rc)}")
            self.done.append(ptr)
        return self

    def __exit__(self, *exc: object) -> None:
        for ptr in self.done:
            self.store.unregister_buffer(ptr)
        self.done.clear()


def _check_reachable(master_address: str, metadata_server: str, timeout_s: float = 3.0) -> None:
    """Fail at once, naming the address, when the master does not accept connections: `setup` would
    otherwise retry inside Mooncake for about 90 s before saying only -1."""
    host, _, port = master_address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as err:
        raise ConnectorError(
            f"could not join the Mooncake store: master {master_address} is not reachable ({err}; metadata "
            f"{metadata_server}); check that the pipeline's Mooncake master runs and this pod can reach it"
        ) from None


def _describe(rc: int) -> str:
    return f"error {rc} ({_ERRORS.get(rc, 'see Mooncake ErrorCode')})"


def _safe(part: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.:-]", "_", part) or "_"


def _regex_escape(text: str) -> str:
    return re.sub(r"([\\^$.|?*+()\[\]{}-])", r"\\\1", text)
