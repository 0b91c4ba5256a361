"""Sequence parallelism of one diffusion stage over the GPUs its pod sees (engine arg `sequence_parallel`).

Rank 0 is the engine's own process; ranks 1..N-1 are processes started here (spawn), one per GPU, each loading
the same pipeline with the same speed options. Every pipeline call rank 0 makes (compile warm-up, self-check,
requests) is first sent to the workers, and all ranks run it together through diffusers' context parallelism
(Ulysses: each rank holds 1/N of the denoiser's sequence, and attention exchanges heads by all-to-all). Only
rank 0 decodes and returns; the workers stop at the latents.

Why one process per GPU: NCCL and diffusers' context parallelism are built around one rank per process, and
the workers' Python then never competes with the engine's event loop for the GIL. Why Ulysses: on two H200s
(NVLink) diffusers' Ulysses took 0.66x of one GPU's time at 1024x1024 eager and 0.49x with compile, NCCL being
9% of the GPU time (bench/results-h200-diffusion-speed.txt).

Engine arg `sequence_parallel`: `auto` (default) uses every GPU the process sees when there are several and
the model folder's denoiser has a diffusers context-parallel plan (Flux, Qwen-Image, Wan...), else 1; an integer
asks for exactly that many ranks (1: off). On a CPU an integer > 1 runs the ranks as CPU processes over gloo
(development and tests). Refused: the step cache with more than one rank (each rank would decide from its own
shard, and the ranks would fall out of step; `auto` then runs on one GPU), a denoiser without a context-parallel
plan (SD3), more ranks than visible GPUs, and a device that names one GPU (`cuda:1`).

Measured on two H200s through this engine (run 5 of that file): Flux-sized, 1024x1024, 28 steps, compile + FP8:
2.41 s per image vs 3.30 s on one GPU (0.73x).

A call's stop decision (every request of it aborted) is agreed by all ranks after each denoising step (one
all-reduce of one number), so all ranks stop at the same step. It goes over a gloo group on the CPU: an
all-reduce on the GPU would make each rank's CPU wait for its GPU at every step, and a compiled step's kernel
launches alone take ~42 ms of CPU on the H200 machine (a 256x256 Flux step, bench/results-h200-diffusion-speed.txt
run 11), as long as half a 1024x1024 step's GPU work: the GPU would idle while the CPU queues the next step.

A rank that dies (killed, out of memory, crashed) ends the stage, promptly and saying which rank and why: a
thread of rank 0 waits on the workers' process sentinels, and on a death it aborts the process groups (NCCL: a
collective blocked on the dead rank returns with an error instead of waiting for NCCL's watchdog; gloo raises at
once when a peer's sockets close), so the call in flight fails with `RankDied` (rank, pid, exit code) and the
engine is told (`on_death`): it fails its requests with that error, takes no more, and the stage exits non-zero
with it as its termination message (the pod restarts; the operator's Degraded reason says why). A worker that
dies between calls is seen the same way, before the next call. While starting, rank 0 joins the ranks'
rendezvous only once every worker says it is joining, so a worker that fails or dies before then fails the
start at once instead of after `START_TIMEOUT`. A worker whose rank 0 dies exits at once (a thread waits on its
parent's sentinel), so no orphan holds a GPU's memory, whether it waited for a call or sat in a collective.

A rank whose call fails while it lives (a GPU out of memory on one rank) is handled the same way once it is
clear the ranks fell out of step: each worker reports the end of every call to rank 0 (done, or failed and why).
A failure every rank reports for the same call (a bad input) fails only that call. When one rank's call failed
and another's has not ended `DEATH_WAIT_S` later, the other waits in a collective that will never complete:
the call fails with `RanksOutOfStep` naming the rank and its error, the groups are aborted, the workers ended,
and the engine is told, as for a death.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from omni_runtime.engines.base import EngineError
from omni_runtime.engines.diffusion.parallel_plan import ARG, enable_context_parallel

__all__ = ["ARG", "ParallelGroup", "ParallelPipe", "RankDied", "RanksOutOfStep"]

log = logging.getLogger(__name__)

START_TIMEOUT = datetime.timedelta(minutes=15)
"""How long the ranks wait for each other while starting (loading a large model on every GPU takes minutes)."""


DEATH_WAIT_S = 5.0
"""How long a failed call waits for the watcher to see a worker's death before it reports the failure as its
own: a dead peer's sockets close (gloo raises) a moment before its death is seen, and the death is the reason."""
PARENT_EXIT_CODE = 3
"""A worker's exit code when it exits because rank 0 (the engine's process) died."""


class _Stopped(Exception):
    """Raised on every rank between two denoising steps once rank 0 stops the call."""


class RankDied(EngineError):
    """A sequence-parallel worker rank died: the stage cannot run another call and must restart."""


class RanksOutOfStep(RankDied):
    """One rank's call failed while another went on (a GPU out of memory on one rank): the others wait in a
    collective for it, so the process groups are aborted and the stage must restart, as for a death."""


def _exit_detail(code: int | None) -> str:
    """`code` as a person reads it: a negative exit code is the signal that ended the process."""
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = " (the kernel's out-of-memory killer sends it, or someone killed it)" if -code == signal.SIGKILL else ""
        return f"exit code {code}: killed by {name}{why}"
    return f"exit code {code}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _init(rank: int, world: int, port: int, device: str) -> Any:
    """Join the ranks' process group (NCCL on GPUs, gloo on CPUs); returns the group the per-step stop decision
    goes over: a gloo group on the CPU (see the module docstring), None for the default group when that is gloo."""
    import torch
    import torch.distributed as dist

    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=START_TIMEOUT,
            device_id=torch.device("cuda", rank),
        )
        return dist.new_group(backend="gloo", timeout=START_TIMEOUT)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=START_TIMEOUT
    )
    return None


def _agree(stop: bool, group: Any) -> bool:
    """All ranks: whether any rank (in practice rank 0) stops the call after this step (over `group`, on the CPU)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if stop else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def _pack(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments for the workers: tensors on the CPU, CPU generators as their states (the same
    generator object given twice stays one generator), no callback (the workers use their own)."""
    import torch

    packed: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key == "callback_on_step_end":
            packed[key] = value is not None
        elif key == "generator" and value is not None:
            gens = value if isinstance(value, list) else [value]
            ids: dict[int, int] = {}
            states: list[Any] = []
            for g in gens:
                if id(g) not in ids:
                    ids[id(g)] = len(states)
                    states.append(g.get_state())
            packed[key] = ("generators", states, [ids[id(g)] for g in gens], isinstance(value, list))
        elif isinstance(value, torch.Tensor):
            packed[key] = value.detach().to("cpu")
        else:
            packed[key] = value
    return packed


def _unpack(packed: dict[str, Any], device: str, on_step: Callable[..., Any]) -> dict[str, Any]:
    import torch

    kwargs: dict[str, Any] = {}
    for key, value in packed.items():
        if key == "callback_on_step_end":
            if value:
                kwargs[key] = on_step
        elif key == "generator" and isinstance(value, tuple) and value[0] == "generators":
            _, states, index, as_list = value
            gens = []
            for state in states:
                g = torch.Generator("cpu")
                g.set_state(state)
                gens.append(g)
            chosen = [gens[i] for i in index]
            kwargs[key] = chosen if as_list else chosen[0]
        elif isinstance(value, torch.Tensor):
            kwargs[key] = value.to(device)
        else:
            kwargs[key] = value
    kwargs["output_type"] = "latent"  # only rank 0 decodes
    return kwargs


class ParallelGroup:
    """Rank 0's side: starts the workers, mirrors every pipeline call to them, watches them, and stops them."""

    def __init__(self, stage: str, world: int, device: str) -> None:
        self.stage = stage
        self.world = world
        self.device = "cuda:0" if device == "cuda" else device
        self._procs: list[Any] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self.death: RankDied | None = None
        """Set once a worker died: the error every call raises from then on."""
        self.on_death: Callable[[RankDied], None] | None = None
        """Called once, from the watcher thread, when a worker dies after the ranks joined."""
        self._died = threading.Event()
        self._closing = False
        self._calls = threading.Condition()
        """Guards the call counters: how many calls rank 0 started and ended, and each worker reported."""
        self._started = 0
        self._ended = 0
        self._reported: list[int] = []
        self._stop_group: Any = None

    def start(self, engine: Any, dtype_name: str) -> None:
        """Start ranks 1..N-1 (each loads the pipeline) and join the process group (blocking: call in a thread)."""
        port = _free_port()
        gpu = self.device.startswith("cuda")
        ctx = multiprocessing.get_context("spawn")
        state = {k: getattr(engine, k) for k in getattr(engine, "worker_state", ())}
        for rank in range(1, self.world):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(
                    rank,
                    self.world,
                    port,
                    type(engine),
                    engine.pipeline,
                    engine.stage,
                    state,
                    dtype_name,
                    gpu,
                    theirs,
                ),
                name=f"omnikube-{self.stage}-rank{rank}",
                daemon=True,
            )
            proc.start()
            theirs.close()
            self._procs.append(proc)
            self._conns.append(mine)
        log.info("stage %s: started %d sequence-parallel worker ranks", self.stage, self.world - 1)
        for rank in range(1, self.world):  # rank 0's rendezvous waits for every rank: only for live ones
            self._expect(rank, "joining")
        self._stop_group = _init(0, self.world, port, self.device)
        threading.Thread(target=self._watch, name=f"omnikube-{self.stage}-ranks", daemon=True).start()

    def _expect(self, rank: int, kind: str) -> None:
        """Wait for worker `rank`'s `kind` message; raises EngineError when it failed or exited instead."""
        conn, proc = self._conns[rank - 1], self._procs[rank - 1]
        got, detail = "error", ""
        try:
            multiprocessing.connection.wait([conn, proc.sentinel])
            got, detail = conn.recv() if conn.poll() else ("error", "")
        except (EOFError, OSError):
            pass
        if got == kind:
            return
        if not detail:
            proc.join(1)
            detail = f"the process (pid {proc.pid}) exited ({_exit_detail(proc.exitcode)})"
        raise EngineError(
            f"stage {self.stage!r}: sequence-parallel rank {rank} failed to start: {detail}; "
            f"check the GPU it runs on, or set engine arg {ARG}: 1"
        )

    def wait_ready(self) -> None:
        """Block until every worker has loaded its pipeline; raises EngineError with a worker's failure."""
        for rank in range(1, self.world):
            self._expect(rank, "ready")
        self._reported = [0] * (self.world - 1)
        threading.Thread(target=self._read_reports, name=f"omnikube-{self.stage}-reports", daemon=True).start()

    def _read_reports(self) -> None:
        """Rank 0's thread reading the workers' end-of-call reports (`("done" | "failed", call, detail)`). A worker
        whose call failed while rank 0's goes on leaves rank 0 waiting in a collective: after `DEATH_WAIT_S` the
        ranks are out of step, and the groups are aborted (the same failure on every rank ends rank 0's call too)."""
        ranks: dict[Any, int] = {conn: rank for rank, conn in enumerate(self._conns, start=1)}
        while ranks and not self._closing:
            for ready in multiprocessing.connection.wait(list(ranks)):
                conn: multiprocessing.connection.Connection = ready  # type: ignore[assignment]
                rank = ranks[conn]
                try:
                    kind, call, detail = conn.recv()
                except (EOFError, OSError):  # the worker exited: the sentinel watcher reports it
                    del ranks[conn]
                    continue

                def rank0_ended(call: int = call) -> bool:
                    return self._ended >= call or self.death is not None

                with self._calls:
                    self._reported[rank - 1] = call
                    self._calls.notify_all()
                    if kind != "failed":
                        continue
                    log.warning("stage %s: rank %d: call %d failed: %s", self.stage, rank, call, detail)
                    if self._calls.wait_for(rank0_ended, DEATH_WAIT_S):
                        continue  # rank 0's call ended as well (in practice: failed the same way), or a rank died
                self._out_of_step(
                    f"sequence-parallel rank {rank}'s call failed ({detail}) while rank 0's went on, so the ranks "
                    "are out of step"
                )
                return

    def _watch(self) -> None:
        """Rank 0's watcher thread: on a worker's death, abort the process groups and report it."""
        by_sentinel = {proc.sentinel: rank for rank, proc in enumerate(self._procs, start=1)}
        ended = multiprocessing.connection.wait(list(by_sentinel))
        if self._closing:
            return
        rank = by_sentinel[ended[0]]
        proc = self._procs[rank - 1]
        proc.join(1)
        self._fail(
            RankDied(
                f"stage {self.stage!r}: sequence-parallel rank {rank} (pid {proc.pid}) died "
                f"({_exit_detail(proc.exitcode)}); the call it was part of failed and the stage stops and restarts "
                f"(its log and its GPU's memory say why; {ARG}: 1 runs on one GPU)"
            )
        )

    def _out_of_step(self, what: str) -> None:
        """The ranks fell out of step: fail the group, and end the workers, so that a rank waiting for them in a
        collective returns now on any backend (gloo: their sockets close; NCCL: the abort), and their GPUs free."""
        self._fail(
            RanksOutOfStep(
                f"stage {self.stage!r}: {what}; the call failed and the stage stops and restarts (the rank's log "
                f"and its GPU's memory say why; {ARG}: 1 runs on one GPU)"
            )
        )
        for proc in self._procs:
            with contextlib.suppress(OSError, ValueError):
                proc.kill()

    def _fail(self, error: RankDied) -> None:
        """The group is dead: record why (the first reason stands), abort the process groups, tell the engine."""
        with self._calls:
            if self.death is not None:
                return
            self.death = error
            self._calls.notify_all()
        log.error("%s", error)
        self._died.set()
        self._abort()
        if self.on_death is not None:
            self.on_death(error)

    def _abort(self) -> None:
        """Abort every process group so a collective blocked on the dead rank returns with an error now."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:  # the groups are dead either way; the call in flight still fails on gloo
            log.warning("stage %s: aborting the process groups failed", self.stage, exc_info=True)

    def call(self, pipe: Any, kwargs: dict[str, Any]) -> Any:
        """One pipeline call on every rank; rank 0's result. Raises RankDied once a worker died."""
        if self.death is None:
            for rank, proc in enumerate(self._procs, start=1):
                if not proc.is_alive():  # died a moment ago: the watcher reports it too
                    self._died.wait(DEATH_WAIT_S)
                    if self.death is None:
                        raise RankDied(
                            f"stage {self.stage!r}: sequence-parallel rank {rank} has exited "
                            f"({_exit_detail(proc.exitcode)}); the stage must restart"
                        )
        if self.death is not None:
            raise self.death
        packed = _pack(kwargs)
        agreed: list[BaseException] = []
        with self._calls:
            self._started += 1
            call = self._started
        try:
            for conn in self._conns:
                conn.send(packed)
            given = kwargs.get("callback_on_step_end")
            if given is not None:
                kwargs = {**kwargs, "callback_on_step_end": self._agreeing(given, agreed)}
            return pipe(**kwargs)
        except Exception as exc:
            if exc in agreed:
                raise  # a stop every rank agreed on

            def settled() -> bool:
                return self.death is not None or min(self._reported, default=call) >= call

            # Rank 0's call failed: every worker ends it too (the same failure: a bad input), or one died (a dead
            # peer's sockets close a moment before its death is seen), or one waits for rank 0 in a collective.
            with self._calls:
                self._ended = call
                self._calls.notify_all()
                every_rank_ended = self._calls.wait_for(settled, DEATH_WAIT_S)
            if self.death is None and every_rank_ended:
                raise  # the call's own failure
            if self.death is None:
                behind = [r for r, n in enumerate(self._reported, start=1) if n < call]
                self._out_of_step(
                    f"rank 0's call failed ({type(exc).__name__}: {exc}) while rank(s) {behind} went on, so the "
                    "ranks are out of step"
                )
            assert self.death is not None
            raise self.death from exc
        finally:
            with self._calls:
                self._ended = call
                self._calls.notify_all()

    def _agreeing(self, given: Callable[..., Any], agreed: list[BaseException]) -> Callable[..., Any]:
        def on_step(p: Any, index: int, timestep: Any, tensors: dict[str, Any]) -> Any:
            error: BaseException | None = None
            out: Any = {}
            try:
                out = given(p, index, timestep, tensors)
            except Exception as exc:  # the engine's stop (or a callback failure): every rank stops here
                error = exc
            if _agree(error is not None, self._stop_group):
                agreed.append(error or _Stopped())
                raise agreed[-1]
            log.debug("stage %s: denoising step %d done on every rank", self.stage, index)
            return out

        return on_step

    def close(self) -> None:
        """Stop the workers (they finish nothing: rank 0 is not calling) and leave the process group."""
        import torch.distributed as dist

        self._closing = True
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        # Live ranks of a dead group may sit in a collective that never ends: they are stopped at once.
        deadline = time.monotonic() + (0 if self.death else 30)
        for proc in self._procs:
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


class ParallelPipe:
    """Rank 0's pipeline: attributes are the pipeline's, a call runs on every rank."""

    def __init__(self, pipe: Any, group: ParallelGroup) -> None:
        object.__setattr__(self, "_pipe", pipe)
        object.__setattr__(self, "_group", group)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)

    def __call__(self, **kwargs: Any) -> Any:
        return self._group.call(self._pipe, kwargs)


def _worker_main(
    rank: int,
    world: int,
    port: int,
    engine_class: Any,
    pipeline: Any,
    stage: Any,
    state: dict[str, Any],
    dtype_name: str,
    gpu: bool,
    conn: multiprocessing.connection.Connection,
) -> None:
    """A worker rank: load the same pipeline, then run every call rank 0 sends until it sends None."""
    import torch
    import torch.distributed as dist

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s")
    threading.Thread(target=_exit_with_parent, args=(rank,), name="omnikube-rank0-watch", daemon=True).start()
    device = f"cuda:{rank}" if gpu else "cpu"
    try:
        engine = engine_class(pipeline, stage)
        for key, value in state.items():
            setattr(engine, key, value)
        engine.device = device
        conn.send(("joining", None))
        stop_group = _init(rank, world, port, device)
        pipe = engine._load(getattr(torch, dtype_name))
        engine.accel.apply(pipe, device, lambda p: enable_context_parallel(stage.name, p, world, device))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))

    def on_step(_p: Any, _i: int, _t: Any, _tensors: dict[str, Any]) -> dict[str, Any]:
        if _agree(False, stop_group):
            raise _Stopped
        return {}

    call = 0
    while True:
        try:
            packed = conn.recv()
        except EOFError:
            break
        if packed is None:
            break
        call += 1
        report: tuple[str, int, str] = ("done", call, "")
        try:
            with torch.inference_mode():
                pipe(**_unpack(packed, device, on_step))
        except _Stopped:
            pass
        except Exception as exc:  # rank 0 decides: the same failure there (a bad input), or the ranks out of step
            log.exception("rank %d: pipeline call failed", rank)
            report = ("failed", call, f"{type(exc).__name__}: {exc}")
        try:
            conn.send(report)
        except OSError:
            break
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _exit_with_parent(rank: int) -> None:
    """A worker's thread: exit at once when rank 0's process dies, wherever the worker is (waiting for a call,
    or in a collective that will never end), so no orphan keeps its GPU's memory."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    multiprocessing.connection.wait([parent.sentinel])
    log.error("rank %d: rank 0 (pid %s) exited; exiting", rank, parent.pid)
    logging.shutdown()
    os._exit(PARENT_EXIT_CODE)
