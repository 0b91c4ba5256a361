"""Connectors against the raw cost of moving the same bytes, measured in one run.

    .venv/bin/python bench/connectors.py [--sizes 1 16 64] [--repeats 30] [--warmup 3]
                                         [--dtype float32] [--kinds shm mooncake] [--torch-threads 1]

One payload `{"x": tensor}` per size (MiB). The producer stage is this process; the consumer stage is a
second process (spawned), so every connector payload really crosses a process boundary. Per size, every
variant runs once per round, in a shuffled order, so load drifting on a shared machine hits all of them;
the first `--warmup` rounds are dropped (and are the ones whose bytes are checked, by CRC, at the reader).
Times are medians; the spread is half the interquartile range.

shm, against a plain in-process copy of the same bytes:
  - baseline `dst.copy_(src)` into a preallocated tensor: THE baseline for the ratio (the stricter one:
    nothing is allocated or faulted in); `src.clone()` is printed beside it.
  - ours: producer `put` + consumer `get` (tensors are views of the segment) + `release`, each timed where
    it runs; also with `copy_out=True` (get returns owned copies: a second copy, so about half as fast).
  Target: shm (views) >= 0.7x the preallocated copy's throughput.

mooncake, against Mooncake's own TransferEngine:
  - baseline `TransferEngine.transfer_sync_read` of the same byte count from a buffer registered by an
    engine in this process into one registered by an engine in the consumer process: TCP on loopback,
    segments found through the HTTP metadata server that `MooncakeMaster` starts.
  - ours, mode p2p (the default): producer `put` (a local copy into a registered block) + consumer `get`
    (one transfer-engine read into a pooled receive block) + `release` (an 8-byte remote write).
  - ours, mode store: producer `put` (a local copy into the producer's store segment, two master RPCs) +
    consumer `get` (a master RPC and the TCP read, into a fresh buffer) + `release` (a master RPC).
  - for reference, the store's raw `put_from` + `get_into` + `remove` with registered buffers.
  Target: mooncake (the default mode, p2p) >= 0.8x the TransferEngine read's throughput.

`--torch-threads` (default 1) is set in both processes: the connectors copy on one thread per call, and on a
small shared machine torch's multi-threaded `copy_` is slower and much noisier, which would flatter the ratio.

The master, metadata server, store clients and transfer engines are started and stopped here; Mooncake
is told to advertise 127.0.0.1 (`MC_TCP_BIND_ADDRESS`). Mooncake's own log goes to stderr at ERROR level
(`MC_LOG_LEVEL`); the "metadata not found" lines at start-up are its normal first lookups.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import multiprocessing
import os
import random
import statistics
import sys
import time
import traceback
import uuid
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from omni_runtime.connectors import decode_handle, encode_handle, make_connector
from omni_runtime.connectors.mooncake_master import MooncakeMaster, free_port
from omni_runtime.connectors.shm import ShmConnector, segment_prefix, sweep_orphans
from omni_runtime.spec import ConnectorsSpec, MooncakeMode

MiB = 1024**2
SHM_TARGET = 0.7
MOONCAKE_TARGET = 0.8

LABELS = {
    "copy": "in-process dst.copy_(src), preallocated",
    "clone": "in-process src.clone()",
    "shm": "shm put+get+release, views",
    "shm-copy": "shm put+get+release, copy_out=True",
    "te": "TransferEngine read (raw, TCP)",
    "store": "store put_from+get_into+remove (raw)",
    "mooncake": "mooncake p2p put+get+release",
    "mooncake-store": "mooncake store put+get+release",
}
KIND_VARIANTS = {
    "shm": ["copy", "clone", "shm", "shm-copy"],
    "mooncake": ["te", "store", "mooncake", "mooncake-store"],
}


@dataclass
class Sample:
    calls: float
    """Seconds spent in the measured calls themselves (put + get + release, or the one copy/read)."""
    e2e: float | None = None
    """Producer's wall time from the start of put to the consumer's answer (adds the handle handoff)."""
    parts: tuple[float, ...] = ()


@dataclass
class Series:
    samples: list[Sample] = field(default_factory=list)

    def median(self) -> float:
        return statistics.median(s.calls for s in self.samples)

    def spread(self) -> float:
        if len(self.samples) < 4:
            return 0.0
        q1, _, q3 = statistics.quantiles([s.calls for s in self.samples], n=4)
        return (q3 - q1) / 2 / self.median()

    def e2e(self) -> float | None:
        values = [s.e2e for s in self.samples if s.e2e is not None]
        return statistics.median(values) if values else None

    def parts(self) -> list[float]:
        columns = list(zip(*(s.parts for s in self.samples), strict=True))
        return [statistics.median(c) for c in columns]


# -- consumer process ------------------------------------------------------------------------------


def consumer_main(conn, info: dict) -> None:
    """The consumer stage, in its own process: answers one request at a time over `conn`."""
    try:
        asyncio.run(_consumer_loop(conn, info))
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))


async def _consumer_loop(conn, info: dict) -> None:
    torch.set_num_threads(info["torch_threads"])
    with contextlib.ExitStack() as stack:
        consumers = {
            "shm": stack.enter_context(ShmConnector(pipeline=info["pipeline"], owner="consumer")),
            "shm-copy": stack.enter_context(
                ShmConnector(pipeline=info["pipeline"], owner="consumer-copy", copy_out=True)
            ),
        }
        te = store = None
        te_dst = store_dst = np.empty(0, np.uint8)
        if info["mooncake"]:
            spec = ConnectorsSpec.model_validate(info["spec"])
            p2p = make_connector("mooncake", spec, metadata_server=info["mooncake"]["metadata_server"])
            consumers["mooncake"] = stack.enter_context(p2p)
            mc = make_connector("mooncake", _store_mode(spec), **info["mooncake"])
            consumers["mooncake-store"] = stack.enter_context(mc)
            store = mc.store
            store_dst = np.zeros(info["max_bytes"], np.uint8)
            _check(store.register_buffer(store_dst.ctypes.data, store_dst.nbytes), "store register_buffer")
            stack.callback(store.unregister_buffer, store_dst.ctypes.data)
            te, _, te_dst = _engine(info["mooncake"]["metadata_server"], info["max_bytes"])
            stack.callback(te.unregister_memory, te_dst.ctypes.data)
        conn.send(("ready", None))
        while True:
            op, *args = conn.recv()
            if op == "stop":
                break
            if op == "get":
                kind, wire, crc = args
                connector, handle = consumers[kind], decode_handle(wire)
                t0 = time.perf_counter()
                got = await connector.get(handle)
                t1 = time.perf_counter()
                ok = crc is None or _crc(got["x"].view(torch.uint8).numpy()) == crc
                del got  # views of the segment must go before release
                t2 = time.perf_counter()
                await connector.release(handle)
                t3 = time.perf_counter()
                conn.send(("ok", (t1 - t0, t3 - t2), ok))
            elif op == "te_read":
                target, remote, n, crc = args
                t0 = time.perf_counter()
                rc = te.transfer_sync_read(target, te_dst.ctypes.data, remote, n)
                t1 = time.perf_counter()
                _check(rc, f"transfer_sync_read of {n} bytes from {target}")
                conn.send(("ok", (t1 - t0,), crc is None or _crc(te_dst[:n]) == crc))
            elif op == "store_get":
                key, n, crc = args
                t0 = time.perf_counter()
                rc = store.get_into(key, store_dst.ctypes.data, n)
                t1 = time.perf_counter()
                rm = store.remove(key, True)
                t2 = time.perf_counter()
                if rc != n:
                    raise RuntimeError(f"store get_into {key}: expected {n} bytes, got {rc}")
                _check(rm, f"store remove {key}")
                conn.send(("ok", (t1 - t0, t2 - t1), crc is None or _crc(store_dst[:n]) == crc))
            else:
                raise ValueError(f"consumer got unknown op {op!r}")
    # `te` goes with this frame; its destructor removes its segment from the metadata server, which the
    # producer keeps running until this process has exited.


def _engine(metadata_server: str, nbytes: int):
    """A raw TransferEngine on 127.0.0.1, its segment name, and one registered buffer of `nbytes`."""
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    name = f"127.0.0.1:{free_port()}"
    _check(engine.initialize(name, metadata_server, "tcp", ""), f"TransferEngine.initialize({name!r})")
    buf = np.zeros(nbytes, np.uint8)
    _check(engine.register_memory(buf.ctypes.data, nbytes), "TransferEngine.register_memory")
    return engine, name, buf


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} returned {rc}")


def _crc(array: np.ndarray) -> int:
    return zlib.crc32(memoryview(np.ascontiguousarray(array)).cast("B"))


# -- producer (this process) ---------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.pipeline = f"bench{uuid.uuid4().hex[:8]}"
        self.max_bytes = max(_nbytes(s, args.dtype) for s in args.sizes)
        self.stack = contextlib.ExitStack()
        self.mooncake = "mooncake" in args.kinds

    async def run(self) -> dict[float, dict[str, Series]]:
        with self.stack:
            self._start()
            return {size: await self._size(size) for size in self.args.sizes}

    def _start(self) -> None:
        stack = self.stack
        stack.callback(self._sweep)
        self.shm = stack.enter_context(ShmConnector(pipeline=self.pipeline, owner="producer"))
        info = {"pipeline": self.pipeline, "torch_threads": self.args.torch_threads, "mooncake": None}
        if self.mooncake:
            segment = max(256 * MiB, 4 * self.max_bytes)
            spec = {"mooncake": {"global_segment_size": segment, "local_buffer_size": 16 * MiB}}
            master = stack.enter_context(MooncakeMaster(rpc_port=free_port(), metadata_port=free_port()))
            mc_info = {
                "master_address": master.master_address,
                "metadata_server": master.metadata_server,
                "pipeline": self.pipeline,
            }
            info.update(mooncake=mc_info, spec=spec, max_bytes=self.max_bytes)
            cspec = ConnectorsSpec.model_validate(spec)
            self.p2p = stack.enter_context(
                make_connector("mooncake", cspec, metadata_server=master.metadata_server, pipeline=self.pipeline)
            )
            self.mc = stack.enter_context(make_connector("mooncake", _store_mode(cspec), **mc_info))
            from mooncake.store import ReplicateConfig

            self.raw_config = ReplicateConfig()
            self.raw_config.with_hard_pin = True
            self.raw_config.preferred_segment = self.mc.store.get_hostname()  # as the connector places
            self.store_src = np.zeros(self.max_bytes, np.uint8)
            _check(self.mc.store.register_buffer(self.store_src.ctypes.data, self.max_bytes), "register_buffer")
            stack.callback(self.mc.store.unregister_buffer, self.store_src.ctypes.data)
            self.te, self.te_name, self.te_src = _engine(master.metadata_server, self.max_bytes)
            stack.callback(self._drop_engine)
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_end = ctx.Pipe()
        self.child = ctx.Process(target=consumer_main, args=(child_end, info), name="bench-consumer")
        self.child.start()
        child_end.close()
        stack.callback(self._stop_child)  # runs before the master stops: the child leaves the store first
        self._reply(timeout=180)

    def _drop_engine(self) -> None:
        self.te.unregister_memory(self.te_src.ctypes.data)
        del self.te

    def _stop_child(self) -> None:
        if self.child.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("stop",))
            self.child.join(60)
        if self.child.is_alive():
            self.child.kill()
            self.child.join()
        self.conn.close()

    def _sweep(self) -> None:
        left = sweep_orphans(segment_prefix(self.pipeline), live_owners_too=True)
        if left:
            print(f"warning: removed leftover shm segments {left}", file=sys.stderr)

    def _reply(self, timeout: float = 120):
        if not self.conn.poll(timeout):
            raise RuntimeError(f"consumer process did not answer within {timeout:.0f}s")
        status, *rest = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"consumer process failed:\n{rest[0]}")
        return rest

    def _ask(self, *msg, expect_crc: bool) -> tuple[float, ...]:
        self.conn.send(msg)
        times, ok = self._reply()
        if expect_crc and not ok:
            raise RuntimeError(f"{msg[0]} {msg[1]!r}: the consumer read different bytes than were sent")
        return times

    async def _size(self, size: float) -> dict[str, Series]:
        args = self.args
        x = _payload(size, args.dtype)
        raw = x.view(torch.uint8).numpy()
        n, crc = raw.nbytes, _crc(raw)
        dst = torch.empty_like(x)
        if self.mooncake:
            self.te_src[:n] = raw
            self.store_src[:n] = raw
        variants = [v for kind in args.kinds for v in KIND_VARIANTS[kind]]
        series = {v: Series() for v in variants}
        order = random.Random(int(size * 1000))
        for rnd in range(args.warmup + args.repeats):
            check = rnd < args.warmup
            order.shuffle(variants)
            for v in variants:
                sample = await self._once(v, x, dst, n, crc if check else None)
                if not check:
                    series[v].samples.append(sample)
        return series

    async def _once(self, variant: str, x: torch.Tensor, dst: torch.Tensor, n: int, crc: int | None) -> Sample:
        check = crc is not None
        if variant == "copy":
            t0 = time.perf_counter()
            dst.copy_(x)
            return Sample(time.perf_counter() - t0)
        if variant == "clone":
            t0 = time.perf_counter()
            y = x.clone()
            t = time.perf_counter() - t0
            del y
            return Sample(t)
        if variant in ("shm", "shm-copy", "mooncake", "mooncake-store"):
            producer = {"mooncake": self.p2p, "mooncake-store": self.mc}.get(variant, self.shm)
            t0 = time.perf_counter()
            handle = await producer.put("producer", "consumer", "bench", {"x": x})
            t_put = time.perf_counter() - t0
            t_get, t_rel = self._ask("get", variant, encode_handle(handle), crc, expect_crc=check)
            e2e = time.perf_counter() - t0
            return Sample(t_put + t_get + t_rel, e2e, (t_put, t_get, t_rel))
        if variant == "te":
            t0 = time.perf_counter()
            (t_read,) = self._ask("te_read", self.te_name, self.te_src.ctypes.data, n, crc, expect_crc=check)
            return Sample(t_read, time.perf_counter() - t0, (t_read,))
        if variant == "store":
            key = f"omnikube/{self.pipeline}/raw/{uuid.uuid4().hex[:12]}"
            t0 = time.perf_counter()
            _check(self.mc.store.put_from(key, self.store_src.ctypes.data, n, self.raw_config), f"put_from {key}")
            t_put = time.perf_counter() - t0
            t_get, t_rm = self._ask("store_get", key, n, crc, expect_crc=check)
            e2e = time.perf_counter() - t0
            return Sample(t_put + t_get + t_rm, e2e, (t_put, t_get, t_rm))
        raise ValueError(variant)


def _store_mode(spec: ConnectorsSpec) -> ConnectorsSpec:
    return spec.model_copy(update={"mooncake": spec.mooncake.model_copy(update={"mode": MooncakeMode.STORE})})


def _nbytes(size: float, dtype: str) -> int:
    item = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    return int(size * MiB) // item * item


def _payload(size: float, dtype: str) -> torch.Tensor:
    numel = _nbytes(size, dtype) // torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    gen = torch.Generator().manual_seed(0)
    if dtype == "uint8":
        return torch.randint(0, 256, (numel,), dtype=torch.uint8, generator=gen)
    return torch.randn(numel, dtype=getattr(torch, dtype), generator=gen)


# -- report ----------------------------------------------------------------------------------------


def report(args: argparse.Namespace, results: dict[float, dict[str, Series]]) -> list[str]:
    lines = []
    for size, series in results.items():
        n = _nbytes(size, args.dtype)
        lines += ["", f"== {size:g} MiB ({n} bytes, {args.dtype}); medians of {args.repeats} rounds"]
        lines.append(f"  {'variant':<42} {'ms':>8} {'GiB/s':>7} {'spread':>7}  {'parts ms':<26} {'e2e ms':>7}")
        for v, s in series.items():
            med = s.median()
            parts = " + ".join(f"{p * 1e3:.2f}" for p in s.parts()) if s.samples[0].parts else ""
            e2e = s.e2e()
            note = {"copy": "  <- shm baseline", "te": "  <- mooncake baseline"}.get(v, "")
            lines.append(
                f"  {LABELS[v]:<42} {med * 1e3:8.3f} {n / med / 1024**3:7.2f} {s.spread():6.0%}  {parts:<26} "
                f"{'' if e2e is None else f'{e2e * 1e3:7.2f}'}{note}"
            )
    lines += [
        "",
        "parts: put + get + release (TransferEngine: the read); spread: half the interquartile range;",
        "e2e: producer wall time from put to the consumer's answer, incl. the handle handoff over a pipe.",
    ]
    ratios, verdicts = _ratios(args, results)
    return lines + [""] + ratios + [""] + verdicts


def _ratios(args: argparse.Namespace, results: dict[float, dict[str, Series]]) -> tuple[list[str], list[str]]:
    def r(series: dict[str, Series], ours: str, base: str) -> float:
        return series[base].median() / series[ours].median()  # throughput ratio = time ratio inverted

    cols: list[tuple[str, str, str, float | None]] = []
    if "shm" in args.kinds:
        cols += [
            ("shm/copy_", "shm", "copy", SHM_TARGET),
            ("shm/clone", "shm", "clone", None),
            ("shm copy_out/copy_", "shm-copy", "copy", None),
        ]
    if "mooncake" in args.kinds:
        cols += [
            ("mooncake/TE read", "mooncake", "te", MOONCAKE_TARGET),
            ("mooncake store/TE read", "mooncake-store", "te", None),
            ("mooncake store/store raw", "mooncake-store", "store", None),
            ("store raw/TE read", "store", "te", None),
        ]
    names = [name + (f" (>={target})" if target else "") for name, _, _, target in cols]
    widths = [max(len(name), 11) for name in names]
    head = f"  {'size':>8}  " + "  ".join(f"{name:>{w}}" for name, w in zip(names, widths, strict=True))
    lines = ["== throughput ratios, ours / baseline (same run; > 1 is faster than the baseline)", head]
    met: dict[str, list[tuple[float, bool]]] = {c[0]: [] for c in cols if c[3]}
    for size, series in results.items():
        cells = []
        for (name, ours, base, target), width in zip(cols, widths, strict=True):
            value = r(series, ours, base)
            mark = ""
            if target:
                met[name].append((size, value >= target))
                mark = " met" if value >= target else " MISSED"
            cells.append(f"{f'{value:.2f}{mark}':>{width}}")
        lines.append(f"  {f'{size:g} MiB':>8}  " + "  ".join(cells))
    verdicts = []
    for name, _ours, base, target in cols:
        if not target:
            continue
        yes = [f"{s:g}" for s, ok in met[name] if ok]
        no = [f"{s:g}" for s, ok in met[name] if not ok]
        verdicts.append(
            f"target {name} >= {target}x ({LABELS[base]}): "
            + (f"met at {', '.join(yes)} MiB" if yes else "met at no size")
            + (f"; MISSED at {', '.join(no)} MiB" if no else "")
        )
    return lines, verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 16, 64], help="payload sizes in MiB")
    parser.add_argument("--repeats", type=int, default=30, help="measured rounds per size")
    parser.add_argument("--warmup", type=int, default=3, help="rounds dropped (and byte-checked) per size")
    parser.add_argument("--dtype", choices=["float32", "uint8"], default="float32")
    parser.add_argument("--kinds", nargs="+", choices=list(KIND_VARIANTS), default=list(KIND_VARIANTS))
    parser.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads, both processes")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 1 or min(args.sizes) <= 0:
        parser.error("--repeats and --warmup must be 1 or more and --sizes positive")
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # advertise loopback, not the first NIC
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    torch.set_num_threads(args.torch_threads)

    load = os.getloadavg()[0]
    started = time.monotonic()
    results = asyncio.run(Bench(args).run())
    versions = f"torch {torch.__version__}, numpy {np.__version__}"
    if "mooncake" in args.kinds:
        versions += f", mooncake {_mooncake_version()}"
    print(f"# bench/connectors.py {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip())
    print(
        f"# {os.cpu_count()} CPUs, torch threads {args.torch_threads}, {versions}; load average "
        f"{load:.2f} at start, {os.getloadavg()[0]:.2f} at end; {time.monotonic() - started:.0f}s"
    )
    print(f"# {args.warmup} warm-up + {args.repeats} measured rounds per size, variants shuffled within a round")
    print("\n".join(report(args, results)))
    return 0


def _mooncake_version() -> str:
    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
