"""Connectors: codec exactness, and put/get/release through inline, shm and real Mooncake.

The Mooncake tests start a real `mooncake_master` (and its HTTP metadata server) on free
127.0.0.1 ports for this module and talk to it through real store clients (mode `store`) and real
transfer engines (mode `p2p`, the default).
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import os
import random
import socket
import uuid

import msgspec
import numpy as np
import pytest
import torch
from servelib import process_exists, shm_segments

from omni_runtime.connectors import (
    Connector,
    ConnectorError,
    PayloadGone,
    PayloadTooLarge,
    decode_handle,
    encode_handle,
    make_connector,
)
from omni_runtime.connectors.codec import decode_payload, encode_payload
from omni_runtime.connectors.inline import InlineHandle
from omni_runtime.connectors.mooncake_master import MooncakeMaster, free_port
from omni_runtime.connectors.shm import SHM_DIR, ShmConnector, ShmHandle, segment_prefix, sweep_orphans
from omni_runtime.spec import ConnectorKind, ConnectorsSpec

pytestmark = pytest.mark.timeout(180)

RUN = uuid.uuid4().hex[:8]  # segment names of this run only: other runs may share /dev/shm
PIPE = f"test{RUN}"
MOONCAKE_SPEC = {"mooncake": {"global_segment_size": 64 * 1024**2, "local_buffer_size": 16 * 1024**2}}
STORE_SPEC = {"mooncake": {**MOONCAKE_SPEC["mooncake"], "mode": "store"}}


def mixed_payload() -> dict:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "f32": torch.randn(3, 5),
        "f16": torch.randn(7, dtype=torch.float16),
        "bf16": torch.randn(2, 3, 4, dtype=torch.bfloat16),
        "f64": torch.tensor([math.pi, -0.0, float("inf")], dtype=torch.float64),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "i64": torch.tensor([2**62, -(2**62)], dtype=torch.int64),
        "u8": torch.arange(256, dtype=torch.uint8),
        "mask": torch.tensor([[True, False], [False, True]]),
        "c64": torch.randn(3, dtype=torch.complex64),
        "scalar": torch.tensor(7, dtype=torch.int32),
        "empty": torch.empty(0, 5, dtype=torch.bfloat16),
        "transposed": base.t(),  # non-contiguous
        "strided": base[:, ::2],
        "np_f32": np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32),
        "np_fortran": np.asfortranarray(np.arange(12, dtype=np.int16).reshape(3, 4)),
        "np_scalar": np.float64(2.5),
        "np_empty": np.zeros((0, 2), dtype=np.uint16),
        "text": "héllo wörld ✓",
        "blob": b"\x00\x01binary\xff",
        "big_blob": os.urandom(100_000),  # travels as a frame
        "count": 2**63 - 1,
        "neg": -(2**63),
        "ratio": 0.1,
        "flag": True,
        "nothing": None,
        "nested": [1, [2.5, "three", [None, False]], {"ids": [1, 2], "t": torch.ones(2, dtype=torch.int16)}],
        "meta": {"sampling": {"temperature": 0.7, "stop": ["</s>"]}, "tokens": list(range(50))},
    }


def assert_same(expected, actual, path="payload"):
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert torch.equal(actual, expected), path
    elif isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray) and actual.dtype == expected.dtype, path
        np.testing.assert_array_equal(actual, expected, err_msg=path)
    elif isinstance(expected, np.generic):
        assert type(actual) is type(expected) and actual == expected, path
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), path
        for k in expected:
            assert_same(expected[k], actual[k], f"{path}.{k}")
    elif isinstance(expected, list | tuple):
        assert isinstance(actual, list) and len(actual) == len(expected), path
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            assert_same(e, a, f"{path}[{i}]")
    else:
        assert type(actual) is type(expected) and actual == expected, path


# -- codec ---------------------------------------------------------------------------------------


def test_codec_round_trip_is_exact_and_zero_copy():
    payload = mixed_payload()
    header, frames = encode_payload(payload)
    assert isinstance(header, bytes) and all(isinstance(f, memoryview) for f in frames)
    # contiguous CPU tensors are not copied: the frame is the tensor's memory
    f32 = payload["f32"]
    assert any(np.frombuffer(f, np.uint8).ctypes.data == f32.data_ptr() for f in frames if f.nbytes)

    writable = [bytearray(f) for f in frames]
    decoded = decode_payload(header, [memoryview(w) for w in writable])
    assert_same(payload, decoded)
    # tensors are views of the frames handed to decode (no copy) and writable
    t = decoded["f32"]
    owner = next(w for w in writable if len(w) == f32.nbytes and bytes(w) == f32.numpy().tobytes())
    assert t.data_ptr() == np.frombuffer(owner, np.uint8).ctypes.data
    t.add_(1)

    # read-only frames (bytes) are copied so results are still writable
    decoded = decode_payload(header, [bytes(f) for f in frames])
    assert_same(payload, decoded)
    decoded["bf16"].mul_(2)
    assert decoded["np_f32"].flags.writeable


def test_codec_rejects_unsupported_values():
    with pytest.raises(TypeError, match="not supported; use tensors"):
        encode_payload({"x": object()})
    with pytest.raises(TypeError, match="mapping"):
        encode_payload([1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dtype object"):
        encode_payload({"x": np.array([object()])})


def test_handles_are_msgpack_structs():
    h = ShmHandle(key="r", source="a", target="b", nbytes=10, segment="omnikube-x", generation=3, layout=[10])
    assert h.kind is ConnectorKind.SHM
    wire = msgspec.msgpack.encode({"handle": h})
    assert decode_handle(msgspec.msgpack.encode(msgspec.msgpack.decode(wire)["handle"])) == h
    i = InlineHandle(key="r", source="a", target="b", nbytes=1, header=b"\x80", frames=[])
    assert decode_handle(encode_handle(i)) == i


# -- fixtures ------------------------------------------------------------------------------------


def store_info(master: MooncakeMaster) -> dict:
    return {"master_address": master.master_address, "metadata_server": master.metadata_server, "pipeline": PIPE}


def p2p_info(master: MooncakeMaster) -> dict:
    return {"metadata_server": master.metadata_server, "pipeline": PIPE}


@pytest.fixture(scope="module")
def mooncake_store_pair(mooncake_master):
    """Two store clients (mode store): a producer stage and a consumer stage."""
    spec = ConnectorsSpec.model_validate(STORE_SPEC)
    producer = make_connector("mooncake", spec, **store_info(mooncake_master))
    consumer = make_connector("mooncake", spec, **store_info(mooncake_master))
    assert type(producer).__name__ == "MooncakeStoreConnector"
    yield producer, consumer
    consumer.close()
    producer.close()


@pytest.fixture
def mooncake_p2p_pair(mooncake_master):
    """Two transfer engines (mode p2p, the default): a producer stage and a consumer stage."""
    spec = ConnectorsSpec.model_validate(MOONCAKE_SPEC)
    producer = make_connector("mooncake", spec, **p2p_info(mooncake_master))
    consumer = make_connector("mooncake", spec, **p2p_info(mooncake_master))
    assert type(producer).__name__ == "MooncakePeerConnector"
    yield producer, consumer
    consumer.close()
    producer.close()


async def p2p_settled(producer, timeout: float = 10.0) -> dict:
    """The producer's block stats once no block is busy (remote releases land asynchronously)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while producer.stats()["busy"] and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    return producer.stats()


@pytest.fixture
def shm_pair():
    spec = ConnectorsSpec()
    producer = ShmConnector(spec, pipeline=PIPE, owner="producer")
    consumer = ShmConnector(spec, pipeline=PIPE, owner="consumer")
    yield producer, consumer
    consumer.close()
    producer.close()
    assert shm_segments(PIPE) == []


@pytest.fixture(params=["inline", "shm", "mooncake_p2p", "mooncake_store"])
def pair(request) -> tuple[Connector, Connector]:
    if request.param == "inline":
        c = make_connector("inline", ConnectorsSpec())
        return c, c
    return request.getfixturevalue(f"{request.param}_pair")


def zeros_mib(n: int) -> torch.Tensor:
    return torch.zeros(n * 1024**2, dtype=torch.uint8)


# -- every kind ----------------------------------------------------------------------------------


async def test_round_trip_mixed_payload(pair):
    producer, consumer = pair
    payload = mixed_payload()
    handle = await producer.put("thinker", "talker", "req-1", payload)
    assert handle.kind is producer.kind and handle.key == "req-1"
    assert (handle.source, handle.target) == ("thinker", "talker")
    travelled = decode_handle(encode_handle(handle))  # all that crosses the router
    assert travelled == handle
    got = await consumer.get(travelled)
    assert_same(payload, got)
    await consumer.release(travelled)
    if producer.kind is not ConnectorKind.INLINE:
        assert len(encode_handle(handle)) < 512


async def test_release_is_idempotent(pair):
    producer, consumer = pair
    read = await producer.put("a", "b", "read", {"x": torch.arange(10)})
    unread = await producer.put("a", "b", "unread", {"x": torch.arange(10)})
    await consumer.get(read)
    for h in (read, read, unread, unread):
        await consumer.release(h)
    await producer.release(read)  # the producer side may release too
    if producer.kind is not ConnectorKind.INLINE:
        with pytest.raises(PayloadGone):
            await consumer.get(read)


def test_inline_refuses_large_payloads():
    c = make_connector("inline", ConnectorsSpec(inline_max_bytes=1024))
    with pytest.raises(PayloadTooLarge, match=r"at most 1024 bytes.*use 'shm'.*'mooncake'"):
        asyncio.run(c.put("a", "b", "k", {"x": torch.zeros(1024, dtype=torch.uint8)}))
    asyncio.run(c.put("a", "b", "k", {"x": torch.zeros(100, dtype=torch.uint8)}))


def test_factory_rejects_unknown_kind_and_runtime_info():
    with pytest.raises(ValueError, match="'inline', 'shm', 'mooncake'"):
        make_connector("carrier-pigeon", ConnectorsSpec())
    with pytest.raises(TypeError, match="unknown runtime_info.*pipelin"):
        make_connector("shm", ConnectorsSpec(), pipelin="typo")
    with pytest.raises(TypeError, match="'shm' handle"):
        asyncio.run(make_connector("inline").release(ShmHandle(
            key="k", source="a", target="b", nbytes=0, segment="s", generation=1, layout=[0]
        )))  # fmt: skip


async def churn(producer: Connector, consumer: Connector, ops: int = 200, seed: int = 7) -> list:
    """Mixed traffic: read and released, abandoned after put, get cancelled, put cancelled."""
    rng = random.Random(seed)
    handles = []
    for i in range(ops):
        big = rng.random() < 0.15
        payload = {
            "hidden": torch.randn(512 * 1024 if big else rng.randint(0, 300)),  # 2 MiB goes through threads
            "ids": [rng.randint(0, 1000) for _ in range(rng.randint(0, 20))],
            "i": i,
        }
        mode = rng.choice(["read", "read", "abandon", "cancel_get", "cancel_put"])
        if mode == "cancel_put":
            task = asyncio.create_task(producer.put("a", "b", f"req-{i}", payload))
            if rng.random() < 0.7:
                await asyncio.sleep(0)  # let it start (else it is cancelled before it runs)
            task.cancel()
            try:
                handles.append(await task)  # finished before the cancel landed: release it
            except asyncio.CancelledError:
                continue
            await consumer.release(handles[-1])
            continue
        h = await producer.put("a", "b", f"req-{i}", payload)
        handles.append(h)
        try:
            if mode == "read":
                got = await consumer.get(h)
                assert got["i"] == i and torch.equal(got["hidden"], payload["hidden"])
            elif mode == "cancel_get":
                task = asyncio.create_task(consumer.get(h))
                if rng.random() < 0.7:
                    await asyncio.sleep(0)  # shm and inline gets finish in this first step; mooncake's do not
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        finally:
            await consumer.release(h)
    return handles


async def test_shm_leaves_nothing_after_churn():
    producer = ShmConnector(pipeline=f"churn{RUN}", owner="producer", pool_max_bytes=4 * 1024**2)
    consumer = ShmConnector(pipeline=f"churn{RUN}", owner="consumer")
    try:
        handles = await churn(producer, consumer)
        assert handles
        assert producer.stats()["busy"] == 0
        assert producer.stats()["bytes"] <= 4 * 1024**2 + 4 * 1024**2  # pool cap plus the last claim
        for h in handles[:5]:
            with pytest.raises(PayloadGone):
                await consumer.get(h)
    finally:
        consumer.close()
        producer.close()
    assert shm_segments(f"churn{RUN}") == []


async def test_mooncake_store_leaves_nothing_after_churn(mooncake_store_pair):
    producer, consumer = mooncake_store_pair
    handles = await churn(producer, consumer, ops=200, seed=11)
    assert handles
    assert not any(consumer.exists(h) for h in handles)
    # keys of cancelled puts are unknown to the test: nothing may remain under the pipeline prefix
    assert consumer.sweep() == 0


async def test_mooncake_p2p_leaves_nothing_after_churn(mooncake_p2p_pair):
    producer, consumer = mooncake_p2p_pair
    handles = await churn(producer, consumer, ops=200, seed=11)
    assert handles
    stats = await p2p_settled(producer)
    assert stats["busy"] == 0, stats  # every block the producer lent out came back
    assert consumer.stats()["receiving"] == 0
    assert stats["bytes"] <= 256 * 1024**2
    for h in handles[:5]:
        with pytest.raises(PayloadGone):
            await consumer.get(h)


async def test_shm_failed_or_cancelled_put_leaves_nothing(shm_pair):
    producer, _ = shm_pair

    class Failing(ShmConnector):
        def _put_sync(self, *args):
            super()._put_sync(*args)
            raise OSError("disk on fire")

    failing = Failing(pipeline=PIPE, owner="failing")
    try:
        with pytest.raises(OSError, match="on fire"):
            await failing.put("a", "b", "k", {"x": torch.zeros(3 * 1024**2, dtype=torch.uint8)})
        assert failing.stats()["busy"] == 0
    finally:
        failing.close()

    task = asyncio.create_task(producer.put("a", "b", "k", {"x": zeros_mib(32)}))
    await asyncio.sleep(0)  # the copy has started in a worker thread
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert producer.stats()["busy"] == 0


async def test_mooncake_store_cancelled_put_leaves_nothing(mooncake_store_pair):
    producer, consumer = mooncake_store_pair
    task = asyncio.create_task(producer.put("a", "b", "k", {"x": zeros_mib(24)}))
    await asyncio.sleep(0)  # the transfer has started in a worker thread
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert consumer.sweep() == 0


async def test_mooncake_store_full_is_an_error_not_an_eviction(mooncake_store_pair):
    producer, consumer = mooncake_store_pair
    chunk = {"x": torch.zeros(20 * 1024**2, dtype=torch.uint8)}
    handles = []
    try:
        with pytest.raises(PayloadTooLarge, match="globalSegmentSize"):
            for i in range(10):  # two clients x 64 MiB of segments
                handles.append(await producer.put("a", "b", f"fill-{i}", chunk))
        assert handles and all(consumer.exists(h) for h in handles)  # nothing was evicted
    finally:
        for h in handles:
            await consumer.release(h)
    assert consumer.sweep() == 0


async def test_shm_stale_release_does_not_free_a_reused_segment():
    producer = ShmConnector(pipeline=PIPE, owner="stale", pool_max_bytes=1024**2)
    try:
        first = await producer.put("a", "b", "one", {"x": torch.arange(100)})
        await producer.release(first)
        second = await producer.put("a", "b", "two", {"x": torch.arange(100) * 2})
        assert second.segment == first.segment and second.generation == first.generation + 1
        await producer.release(first)  # stale: must not free `second`
        got = await producer.get(second)
        assert torch.equal(got["x"], torch.arange(100) * 2)
        await producer.release(second)
    finally:
        producer.close()


async def test_shm_refuses_handles_naming_files_outside_the_pipeline(tmp_path):
    """A Release (or a get) names its segment by a string off the network: a hostile name reaches no file."""
    import msgspec

    victim_dir = tmp_path / "shm"
    victim_dir.mkdir()
    # A file whose state word looks like a busy payload of generation 1: an unchecked release would free it.
    victim = tmp_path / "victim"
    victim.write_bytes(b"OMNISHM1" + (3).to_bytes(8, "little") + bytes(48))
    other = victim_dir / f"{segment_prefix('another-pipeline', 'x')}p1-{'a' * 16}"
    other.write_bytes(victim.read_bytes())
    conn = ShmConnector(pipeline=PIPE, owner="guard", shm_dir=str(victim_dir))
    real = await conn.put("a", "b", "real", {"x": torch.arange(4)})
    hostile = [
        "../victim",
        str(victim),
        other.name,  # a well-formed name of another pipeline
        f"{segment_prefix(PIPE, 'x')}p1-{'a' * 16}/../../victim",
        f"{segment_prefix(PIPE, 'x')}p1-{'A' * 16}",
        "",
    ]
    try:
        for name in hostile:
            handle = msgspec.structs.replace(real, segment=name)
            with pytest.raises(ConnectorError, match="not one of this pipeline's"):
                await conn.release(handle)
            with pytest.raises(ConnectorError, match="not one of this pipeline's"):
                await conn.get(handle)
        assert victim.read_bytes()[8:16] == (3).to_bytes(8, "little")  # untouched
        assert other.read_bytes()[8:16] == (3).to_bytes(8, "little")
        assert torch.equal((await conn.get(real))["x"], torch.arange(4))  # its own names still work
        await conn.release(real)
    finally:
        conn.close()


def test_sweep_orphans_removes_dead_owners_only():
    dead_pid = 4_000_000  # above pid_max: never alive
    pipeline = f"sweep{RUN}"
    dead = f"{segment_prefix(pipeline, 'x')}p{dead_pid}-{'0' * 16}"
    live = f"{segment_prefix(pipeline, 'x')}p{os.getpid()}-{'1' * 16}"
    for name in (dead, live):
        open(os.path.join(SHM_DIR, name), "wb").close()
    try:
        assert sweep_orphans(segment_prefix(pipeline)) == [dead]
        assert shm_segments(pipeline) == [live]
        assert sweep_orphans(segment_prefix(pipeline), live_owners_too=True) == [live]
        with pytest.raises(ValueError, match="must start with 'omnikube-'"):
            sweep_orphans("")
    finally:
        for name in (dead, live):
            if os.path.exists(os.path.join(SHM_DIR, name)):
                os.unlink(os.path.join(SHM_DIR, name))


# -- across processes ----------------------------------------------------------------------------


def _read_in_child(kind: str, runtime_info: dict, spec: dict, wire: bytes, expected: bytes, out) -> None:
    async def main():
        connector = make_connector(kind, ConnectorsSpec.model_validate(spec), **runtime_info)
        try:
            handle = decode_handle(wire)
            got = await connector.get(handle)
            result = {
                "same": got["x"].numpy().tobytes() == expected and got["text"] == "from parent",
                "dtype": str(got["bf"].dtype),
            }
            await connector.release(handle)
            return result
        finally:
            connector.close()

    try:
        out.put(asyncio.run(main()))
    except BaseException as e:  # report, so the parent shows why
        out.put({"error": repr(e)})


def run_reader_process(kind: str, runtime_info: dict, spec: dict, handle, x: torch.Tensor) -> dict:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    args = (kind, runtime_info, spec, encode_handle(handle), x.numpy().tobytes(), out)
    child = ctx.Process(target=_read_in_child, args=args)
    child.start()
    try:
        result = out.get(timeout=120)
    finally:
        child.join(30)
    assert child.exitcode == 0
    return result


async def test_shm_between_two_processes(shm_pair):
    producer, _ = shm_pair
    x = torch.randn(2 * 1024**2)
    handle = await producer.put("a", "b", "xproc", {"x": x, "text": "from parent", "bf": x[:8].bfloat16()})
    result = await asyncio.to_thread(run_reader_process, "shm", {"pipeline": PIPE, "owner": "child"}, {}, handle, x)
    assert result == {"same": True, "dtype": "torch.bfloat16"}
    assert producer.stats()["busy"] == 0  # the child's release reached the producer's segment


async def test_mooncake_store_between_two_processes(mooncake_store_pair, mooncake_master):
    producer, consumer = mooncake_store_pair
    x = torch.randn(1024**2)
    handle = await producer.put("a", "b", "xproc", {"x": x, "text": "from parent", "bf": x[:8].bfloat16()})
    info = store_info(mooncake_master)
    result = await asyncio.to_thread(run_reader_process, "mooncake", info, STORE_SPEC, handle, x)
    assert result == {"same": True, "dtype": "torch.bfloat16"}
    assert not consumer.exists(handle)


@pytest.mark.parametrize("mib", [1, 5])  # one read, and a read in parallel slices through a worker thread
async def test_mooncake_p2p_between_two_processes(mooncake_p2p_pair, mooncake_master, mib):
    producer, _ = mooncake_p2p_pair
    x = torch.randn(mib * 1024**2 // 4)
    handle = await producer.put("a", "b", "xproc", {"x": x, "text": "from parent", "bf": x[:8].bfloat16()})
    assert producer.stats()["busy"] == 1
    info = p2p_info(mooncake_master)
    result = await asyncio.to_thread(run_reader_process, "mooncake", info, MOONCAKE_SPEC, handle, x)
    assert result == {"same": True, "dtype": "torch.bfloat16"}
    assert producer.stats()["busy"] == 0  # the child's release reached the producer's block before it exited


async def test_mooncake_p2p_stale_release_does_not_free_a_reused_block(
    mooncake_master, mooncake_p2p_pair, caplog: pytest.LogCaptureFixture
):
    """A consumer's release of a remote block is a write its worker threads make later (nobody waits for
    it); closing the consumer waits for them. So once the consumer is closed, the stale release has
    reached the producer's block (and no "releasing ... failed" was logged: the write went through), and
    the producer's count is the one the stale release leaves. Another consumer then reads the blocks."""
    caplog.set_level(logging.INFO, logger="omni_runtime.connectors.mooncake_p2p")
    producer, consumer = mooncake_p2p_pair
    first = await producer.put("a", "b", "one", {"x": torch.arange(100)})
    await consumer.release(first)
    await p2p_settled(producer)
    second = await producer.put("a", "b", "two", {"x": torch.arange(100) * 2})
    assert (second.address, second.generation) == (first.address, first.generation + 1)
    await consumer.release(first)  # stale: must not free `second`
    consumer.close()  # waits for its release writes
    assert [r.getMessage() for r in caplog.records if "releasing" in r.getMessage()] == []
    assert producer.stats()["busy"] == 1
    reader = make_connector("mooncake", ConnectorsSpec.model_validate(MOONCAKE_SPEC), **p2p_info(mooncake_master))
    try:
        with pytest.raises(PayloadGone, match="already released"):
            await reader.get(first)
        got = await reader.get(second)
        assert torch.equal(got["x"], torch.arange(100) * 2)
        await reader.release(second)
        assert (await p2p_settled(producer))["busy"] == 0
    finally:
        reader.close()


async def test_mooncake_p2p_full_is_an_error_not_an_eviction(mooncake_p2p_pair):
    producer, consumer = mooncake_p2p_pair
    # a pattern, not zeros: the put copies large payloads in two halves on two threads
    chunk = {"x": (torch.arange(20 * 1024**2) % 251).to(torch.uint8)}
    handles = []
    try:
        with pytest.raises(PayloadTooLarge, match="globalSegmentSize"):
            for i in range(5):  # 64 MiB for unreleased payloads
                handles.append(await producer.put("a", "b", f"fill-{i}", chunk))
        assert len(handles) == 2  # 24 MiB blocks (20 MiB rounded to its size class) in 64 MiB
        for h in handles:  # nothing was evicted to make room
            got = await consumer.get(h)
            assert torch.equal(got["x"], chunk["x"])
    finally:
        for h in handles:
            await consumer.release(h)
    assert (await p2p_settled(producer))["busy"] == 0
    await consumer.release(await producer.put("a", "b", "after", chunk))  # room again


async def test_mooncake_p2p_failed_put_leaves_nothing(mooncake_p2p_pair):
    producer, _ = mooncake_p2p_pair

    def failing_copy(*args):
        raise OSError("memory on fire")

    original = producer._put_sync

    def put_then_fail(claims, *args):
        original(claims, *args)
        failing_copy()

    producer._put_sync = put_then_fail
    try:
        with pytest.raises(OSError, match="on fire"):
            await producer.put("a", "b", "k", {"x": zeros_mib(3)})
    finally:
        del producer._put_sync
    assert producer.stats()["busy"] == 0


async def test_mooncake_p2p_payload_of_a_gone_producer_is_payload_gone(mooncake_master):
    spec = ConnectorsSpec.model_validate(MOONCAKE_SPEC)
    producer = make_connector("mooncake", spec, **p2p_info(mooncake_master))
    consumer = make_connector("mooncake", spec, **p2p_info(mooncake_master))
    try:
        handle = await producer.put("a", "b", "orphan", {"x": torch.arange(1000)})
        producer.close()
        with pytest.raises(PayloadGone, match=f"reading it from {handle.segment} failed.*producer exited"):
            await consumer.get(handle)
        await consumer.release(handle)  # nothing left to free: not an error
        assert consumer.stats()["receiving"] == 0
    finally:
        consumer.close()
        producer.close()


def test_mooncake_p2p_unreachable_metadata_server_is_a_clear_error():
    spec = ConnectorsSpec.model_validate(MOONCAKE_SPEC)
    dead = f"http://127.0.0.1:{free_port()}/metadata"
    with pytest.raises(ConnectorError, match="could not start the Mooncake transfer engine.*metadata server"):
        make_connector("mooncake", spec, metadata_server=dead, port=free_port())


def test_master_process_is_gone_after_stop():
    master = MooncakeMaster(rpc_port=free_port(), metadata_port=free_port())
    with master:
        pids = master.pids
        assert len(pids) == 2 and all(process_exists(p) for p in pids)
        rpc_port = master.rpc_port
    assert not any(process_exists(p) for p in pids)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", rpc_port), timeout=1)


async def test_a_bagel_kv_payload_crosses_every_kind_intact(pair):
    """What BAGEL's thinker -> dit edge carries (`BagelContexts`: a bfloat16 KV cache per role, with its header)
    arrives through each connector kind as the dit checks it: exact, and accepted by `check_kv_payload`."""
    from omni_runtime.processors.kv_cache import BagelContexts, check_kv_payload, kv_expectation, make_kv_payload

    producer, consumer = pair
    config = {"architectures": ["BagelForConditionalGeneration"], "llm_config": {
        "num_hidden_layers": 2, "num_key_value_heads": 2, "num_attention_heads": 4, "hidden_size": 128}}  # fmt: skip
    expected = kv_expectation(config, dtype="bfloat16")
    contexts = {}
    for role, tokens in (("primary", 9), ("cfg_text", 2)):
        keys, values = (torch.randn(tokens, 2, 2, 32).bfloat16() for _ in range(2))
        contexts[role] = make_kv_payload(keys, values, model=expected.model, positions=list(range(tokens)))
    handle = await producer.put("thinker", "dit", "req-kv", dict(BagelContexts(contexts=contexts)))
    got = await consumer.get(decode_handle(encode_handle(handle)))
    for role, sent in contexts.items():
        received = got["contexts"][role]
        check_kv_payload(received, expected, role=role, edge="thinker->dit")
        assert torch.equal(torch.as_tensor(received["keys"]), sent["keys"])
        assert torch.equal(torch.as_tensor(received["values"]), sent["values"])
        assert received["positions"] == sent["positions"] and received["next_position"] == sent["next_position"]
    await consumer.release(handle)
