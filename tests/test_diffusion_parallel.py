"""Sequence parallelism of a diffusion stage (engine arg `sequence_parallel`), on the CPU: two ranks (the engine's
process and one worker process, gloo) give the image one process gives, on the real tiny Flux folder through
the real engine (self-check, text prompts, PNG); settings that cannot run are refused before anything loads,
and a denoiser diffusers cannot split is refused from its folder before any worker starts. A worker rank that
dies (SIGKILL, as the out-of-memory killer sends it) mid-call or between calls fails the requests at once with
an error naming the rank and its exit code and leaves the engine dead; a worker whose rank 0 dies exits; served,
the client gets a 500 naming the rank and the stage process exits 1. One rank's call raising mid-call while the
other waits in a collective (either side) fails the call at once as out of step and leaves the engine dead; the
same failure on both ranks fails only its request. The GPU figures (NCCL, two H200s) are in
bench/results-h200-diffusion-speed.txt; NCCL's abort path has not run here.

Each two-rank start spawns and loads a worker process, so the tests that leave the engine alive and in step
share one (TestTwoRanksInStep); the tests that kill a rank or put the ranks out of step come after it, each
with an engine of its own."""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import json
import logging
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import openai
import pytest
import pytest_asyncio
from servelib import REPO, Serve, diffusion_image, http_get, pid_alive, process_tree

from omni_runtime.engines.base import EngineError, EngineInput
from omni_runtime.engines.diffusion import parallel as P
from omni_runtime.engines.diffusion.engine import DiffusionEngine
from omni_runtime.registry import get_pipeline
from omni_runtime.spec import StageOverride
from omni_runtime.spec.engine_args import InvalidEngineArgs
from omni_runtime.spec.resolved import resolve_pipeline

PARAMS = {"num_inference_steps": 3, "height": 64, "width": 64, "guidance_scale": 3.5}


def _engine(
    topology: str,
    model: Path | str,
    engine_class: type[DiffusionEngine] = DiffusionEngine,
    params: dict[str, object] | None = None,
    **engine_args: object,
) -> DiffusionEngine:
    """The stage `dit` of `topology` on `model`, float32, with `engine_args` and the stage's sampling `params`."""
    engine_args = {"torch_dtype": "float32", **engine_args}
    stage = StageOverride(name="dit", engine_args=engine_args, sampling_params=params or PARAMS)
    pipeline = resolve_pipeline(get_pipeline(topology), name="t", model=str(model), stages=[stage])
    return engine_class(pipeline, pipeline.topology.stage("dit"))


class _Messages(logging.Handler):
    """Counts the log records whose message contains `text`."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.DEBUG)
        self.text, self.seen = text, 0

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.seen += 1


async def _outputs(engine: DiffusionEngine, request: EngineInput) -> list:
    return [out async for out in engine.generate(request)]


CUBE = "a red cube"  # with seed 5, the prompt of every image here


def _psnr(a: bytes, b: bytes) -> float:
    from PIL import Image

    x, y = (np.asarray(Image.open(io.BytesIO(v)), dtype=np.float64) for v in (a, b))
    mse = float(((x - y) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            0,
            r"engine_args\.sequence_parallel is 0: input should be 'auto' or input should be greater than or equal to "
            "1",
        ),
        ("two", r"engine_args\.sequence_parallel is 'two': input should be 'auto' or input should be a valid integer"),
    ],
)
def test_a_degree_that_is_not_auto_or_a_number_of_ranks_is_refused_when_the_engine_is_made(
    value: object, message: str
) -> None:
    with pytest.raises(InvalidEngineArgs, match=message) as err:
        _engine("flux", "/nonexistent/model", sequence_parallel=value)
    assert err.value.field == "sequence_parallel"
    assert not [p for p in multiprocessing.active_children() if "rank" in p.name]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"sequence_parallel": 2, "step_cache_threshold": 0.1}, r"step_cache\) and sequence_parallel=2"),
        (
            {"sequence_parallel": 2, "step_cache": {"policy": "taylorseer"}},
            r"a step cache \(step_cache_threshold or step_cache\) and sequence_parallel=2",
        ),
        ({"sequence_parallel": 2, "device": "cuda:1"}, "one rank per GPU from cuda:0.*'cuda:1'"),
        ({"sequence_parallel": 4, "device": "cuda"}, "sequence_parallel=4 needs 4 GPUs and this pod sees"),
    ],
)
async def test_settings_that_cannot_run_are_refused_before_loading(args: dict, message: str) -> None:
    engine = _engine("flux", "/nonexistent/model", **args)
    with pytest.raises(EngineError, match=message):
        await engine.start()
    assert engine.pipe is None and not [p for p in multiprocessing.active_children() if "rank" in p.name]


DIED = r"stage 'dit': sequence-parallel rank 1 \(pid {pid}\) died \(exit code -9: killed by SIGKILL"
PARALLEL_LOG = "omni_runtime.engines.diffusion.parallel"


def _worker(engine: DiffusionEngine) -> multiprocessing.Process:
    workers = [p for p in multiprocessing.active_children() if p.name == "omnikube-dit-rank1"]
    assert len(workers) == 1 and workers[0].is_alive() and engine.sequence_parallel == 2
    return workers[0]


FAIL_STEPS = 5
"""A request with this many steps fails on `_FailingRanks.fail_ranks` at its second denoising step."""


class _FailingRanks(DiffusionEngine):
    """The real engine whose denoiser raises on the ranks in `fail_ranks` at the second step of a FAIL_STEPS-step
    call, as a GPU out of memory on one rank does (a test double: a CUDA OOM cannot happen on a CPU; the rank's
    call raises and the process lives on, which is all the engine sees of it). Worker ranks get `fail_ranks` too."""

    worker_state = ("fail_ranks",)
    fail_ranks: tuple[int, ...] = ()

    def _load(self, dtype: object) -> object:
        import torch.distributed as dist

        pipe = super()._load(dtype)
        forward, scheduler = pipe.transformer.forward, pipe.scheduler

        def failing(*args: object, **kwargs: object) -> object:
            if (
                len(scheduler.timesteps) == FAIL_STEPS
                and scheduler.step_index == 1
                and dist.get_rank() in self.fail_ranks
            ):
                raise RuntimeError(f"CUDA out of memory (simulated on rank {dist.get_rank()})")
            return forward(*args, **kwargs)

        pipe.transformer.forward = failing
        return pipe


def _failing_engine(model: Path, fail_ranks: tuple[int, ...]) -> DiffusionEngine:
    engine = _engine("flux", model, _FailingRanks, sequence_parallel=2)
    assert isinstance(engine, _FailingRanks)
    engine.fail_ranks = fail_ranks
    return engine


async def _failing_image(engine: DiffusionEngine) -> bytes:
    request = EngineInput("r", {"prompt": "a red cube"}, {"seed": 5, "num_inference_steps": FAIL_STEPS})
    async for out in engine.generate(request):
        if out.finished:
            return out.data["images"][0]
    raise AssertionError("no final output")


# -- one two-rank engine for the tests that leave it alive and in step ------------------------------------
# Class-scoped (not module-scoped) so that it is stopped, and its worker rank gone, before the tests below
# start their own engines: those count the `omnikube-dit-rank1` processes alive. The tests that kill a rank
# or put the ranks out of step come after it, each on a fresh engine.


@pytest_asyncio.fixture(scope="class", loop_scope="class")
async def two_ranks(tiny_flux_model: Path) -> AsyncIterator[DiffusionEngine]:
    """A started two-rank engine, shared by the tests of TestTwoRanksInStep; stopping it stops its worker.

    It is a `_FailingRanks` failing on both ranks, so that the same-failure test needs no engine of its own:
    only a call of exactly FAIL_STEPS steps reaches the failing denoiser; every other call (the image
    checks use PARAMS' 3 steps, the abort 200) runs the real denoiser unchanged."""
    engine = _failing_engine(tiny_flux_model, (0, 1))
    await engine.start()
    worker = _worker(engine)
    try:
        yield engine
    finally:
        await asyncio.wait_for(engine.stop(), 120)
    assert not worker.is_alive(), "the worker rank outlived its engine's stop"


@pytest.mark.models
@pytest.mark.timeout(600)
@pytest.mark.asyncio(loop_scope="class")
class TestTwoRanksInStep:
    """The tests that leave the shared two-rank engine alive and in step (their order does not matter)."""

    async def test_two_cpu_ranks_give_the_image_of_one_process(
        self, two_ranks: DiffusionEngine, tiny_flux_model: Path
    ) -> None:
        one = _engine("flux", tiny_flux_model, sequence_parallel=1)
        await one.start()
        try:
            assert one.sequence_parallel == 1
            want = await diffusion_image(one, "r", CUBE, seed=5)
        finally:
            await one.stop()
        assert two_ranks.sequence_parallel == 2
        worker = _worker(two_ranks)  # the one worker rank, alive
        got = await diffusion_image(two_ranks, "r", CUBE, seed=5)
        assert await diffusion_image(two_ranks, "r", CUBE, seed=5) == got  # the next call runs on both ranks again
        assert _worker(two_ranks).pid == worker.pid
        # Ulysses only reorders the attention's work: measured 6.7e-8 latents relative error on this model.
        assert _psnr(got, want) >= 45.0

    async def test_an_aborted_call_stops_every_rank_after_the_same_step(self, two_ranks: DiffusionEngine) -> None:
        """A request aborted mid-call stops every rank after the same step (agreed over gloo), so the next
        call runs in step and gives the image it gave before the abort."""
        before = await diffusion_image(two_ranks, "r", CUBE, seed=5)
        agreed = _Messages("done on every rank")
        logger = logging.getLogger(PARALLEL_LOG)
        level = logger.level
        logger.addHandler(agreed)
        logger.setLevel(logging.DEBUG)
        try:
            long = EngineInput("long", {"prompt": "a red cube"}, {"seed": 5, "num_inference_steps": 200})
            running = asyncio.ensure_future(_outputs(two_ranks, long))
            while not agreed.seen:
                await asyncio.sleep(0.01)
            await two_ranks.abort("long")
            outs = await running
        finally:
            logger.removeHandler(agreed)
            logger.setLevel(level)
        assert outs[-1].finish_reason == "abort" and "images" not in outs[-1].data
        assert 1 <= agreed.seen < 200  # it stopped between two steps, long before its last
        assert await diffusion_image(two_ranks, "r", CUBE, seed=5) == before
        assert two_ranks.failure is None

    async def test_the_same_failure_on_every_rank_fails_only_that_request(self, two_ranks: DiffusionEngine) -> None:
        """Every rank's call raises at the same step (as a bad input does): the ranks stay in step, so the
        request fails with its own error (no rank blamed), the engine lives, and the next request gets its
        image from the same two ranks."""
        worker = _worker(two_ranks)
        with pytest.raises(EngineError) as failed:
            await asyncio.wait_for(_failing_image(two_ranks), 120)
        assert not isinstance(failed.value, P.RankDied), failed.value
        assert "the diffusion pipeline failed: CUDA out of memory (simulated on rank 0)" in str(failed.value)
        image = await asyncio.wait_for(diffusion_image(two_ranks, "r", CUBE, seed=5), 120)
        assert image.startswith(b"\x89PNG") and two_ranks.failure is None
        assert _worker(two_ranks).pid == worker.pid


@pytest.mark.models
@pytest.mark.timeout(600)
@pytest.mark.asyncio
async def test_a_denoiser_without_a_parallel_plan_is_refused_before_any_rank_starts(tiny_sd3_model: Path) -> None:
    engine = _engine("stable-diffusion-3", tiny_sd3_model, sequence_parallel=2)
    with pytest.raises(EngineError, match="SD3Transformer2DModel has no diffusers context-parallel plan.*: 1"):
        await engine.start()
    assert engine.pipe is None
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("omnikube-dit-rank")]


class _KillAfterFirstStep(logging.Handler):
    """Kills `pid` when rank 0 logs (debug) that the first denoising step finished on every rank: the
    worker dies inside the call, between two steps' collectives."""

    def __init__(self, pid: int) -> None:
        super().__init__(logging.DEBUG)
        self.pid = pid
        self.fired = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.fired and "denoising step 0 done" in record.getMessage():
            self.fired = True
            os.kill(self.pid, signal.SIGKILL)


@pytest.mark.models
@pytest.mark.timeout(600)
@pytest.mark.asyncio
@pytest.mark.parametrize("when", ["mid-call", "between calls"])
async def test_a_worker_rank_that_dies_fails_its_call_at_once_and_the_engine_is_dead(
    tiny_flux_model: Path, when: str
) -> None:
    """The request fails with the rank, its pid and exit code (not after NCCL's or gloo's timeout: the
    wait_for bounds only guard against a hang), the engine is marked dead (the stage server stops on it), the
    next request fails at once with the same error, and the engine stops without waiting for the dead rank."""
    engine = _engine("flux", tiny_flux_model, sequence_parallel=2)
    await engine.start()
    logger = logging.getLogger(PARALLEL_LOG)
    level = logger.level
    try:
        worker = _worker(engine)
        message = DIED.format(pid=worker.pid)
        if when == "mid-call":
            hook = _KillAfterFirstStep(worker.pid)
            logger.addHandler(hook)
            logger.setLevel(logging.DEBUG)
            with pytest.raises(EngineError, match=message):
                await asyncio.wait_for(diffusion_image(engine, "r", CUBE, seed=5), 120)
            assert hook.fired
        else:
            worker.kill()
        failure = await asyncio.wait_for(engine.failed(), 60)
        assert isinstance(failure, P.RankDied) and failure is engine.failure
        assert "the stage stops and restarts" in str(failure)
        with pytest.raises(EngineError, match=message):
            await asyncio.wait_for(diffusion_image(engine, "r", CUBE, seed=5), 10)
    finally:
        logger.setLevel(level)
        for handler in [h for h in logger.handlers if isinstance(h, _KillAfterFirstStep)]:
            logger.removeHandler(handler)
        await asyncio.wait_for(engine.stop(), 120)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("omnikube-dit-rank")]


@pytest.mark.models
@pytest.mark.timeout(600)
@pytest.mark.asyncio
@pytest.mark.parametrize(("fail_ranks", "behind"), [((1,), "rank 1's call failed"), ((0,), "rank(s) [1] went on")])
async def test_one_ranks_call_failing_puts_the_ranks_out_of_step_and_fails_the_call_at_once(
    tiny_flux_model: Path, fail_ranks: tuple[int, ...], behind: str
) -> None:
    """One rank's call raises mid-call while the other waits for it in a collective: the request fails within
    seconds (not after gloo's 30 or NCCL's 10 minutes: the wait_for bounds only guard against a hang) with an error
    naming the rank and its failure, the engine is dead (the stage restarts), and it stops without waiting."""
    engine = _failing_engine(tiny_flux_model, fail_ranks)
    await engine.start()
    try:
        with pytest.raises(P.RanksOutOfStep) as failed:
            await asyncio.wait_for(_failing_image(engine), 120)
        assert behind in str(failed.value) and "CUDA out of memory (simulated on rank" in str(failed.value)
        assert "out of step" in str(failed.value) and "the stage stops and restarts" in str(failed.value)
        failure = await asyncio.wait_for(engine.failed(), 60)
        assert isinstance(failure, P.RanksOutOfStep)
        with pytest.raises(P.RankDied):
            await asyncio.wait_for(diffusion_image(engine, "r", CUBE, seed=5), 10)
    finally:
        await asyncio.wait_for(engine.stop(), 120)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("omnikube-dit-rank")]


class _KillOnStart(logging.Handler):
    """Kills the worker rank as soon as rank 0 logs that it started it: it dies before joining the ranks."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.killed = 0

    def emit(self, record: logging.LogRecord) -> None:
        if not self.killed and "sequence-parallel worker ranks" in record.getMessage():
            worker = next(p for p in multiprocessing.active_children() if p.name == "omnikube-dit-rank1")
            assert worker.pid is not None
            self.killed = worker.pid
            os.kill(worker.pid, signal.SIGKILL)


@pytest.mark.models
@pytest.mark.timeout(600)
@pytest.mark.asyncio
async def test_a_worker_rank_that_dies_while_starting_fails_the_start_at_once(tiny_flux_model: Path) -> None:
    """Rank 0 joins the ranks' rendezvous (which waits up to START_TIMEOUT, 15 minutes, for every rank) only
    once every worker says it is joining: a worker that dies before that fails the start at once, naming it."""
    engine = _engine("flux", tiny_flux_model, sequence_parallel=2)
    logger = logging.getLogger(PARALLEL_LOG)
    hook, level = _KillOnStart(), logger.level
    logger.addHandler(hook)
    logger.setLevel(logging.INFO)
    try:
        with pytest.raises(EngineError, match=r"sequence-parallel rank 1 failed to start: the process \(pid \d+\) "
                           r"exited \(exit code -9: killed by SIGKILL") as failed:  # fmt: skip
            await asyncio.wait_for(engine.start(), 120)  # a hang guard: the rendezvous alone waits 15 minutes
    finally:
        logger.removeHandler(hook)
        logger.setLevel(level)
    assert f"(pid {hook.killed})" in str(failed.value) and "set engine arg sequence_parallel: 1" in str(failed.value)
    assert engine.pipe is None
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("omnikube-dit-rank")]


@pytest.mark.models
@pytest.mark.timeout(600)
@pytest.mark.asyncio
async def test_a_self_check_that_fails_on_every_rank_fails_the_start_and_leaves_no_rank(tiny_flux_model: Path) -> None:
    """Sampling params the pipeline refuses (Flux takes at most 512 text tokens) fail the self-check on both
    ranks: the start fails saying so, and the worker rank goes with it (it would hold a GPU's memory)."""
    engine = _engine("flux", tiny_flux_model, params={**PARAMS, "max_sequence_length": 600}, sequence_parallel=2)
    with pytest.raises(EngineError, match=r"the self-check .* failed, so every request would fail: .*max_sequence"):
        await engine.start()
    assert engine.pipe is None
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("omnikube-dit-rank")]


HOLD_RANK0 = """
import asyncio, json, logging, multiprocessing, sys, time
from omni_runtime.engines.base import EngineInput
from omni_runtime.engines.diffusion.engine import DiffusionEngine
from omni_runtime.registry import get_pipeline
from omni_runtime.spec import StageOverride
from omni_runtime.spec.resolved import resolve_pipeline

class Hold(logging.Handler):  # rank 0 stops inside the call, after its first step: the worker waits in a collective
    def emit(self, record):
        if "denoising step 0 done" in record.getMessage():
            workers = [p.pid for p in multiprocessing.active_children() if p.name == "omnikube-dit-rank1"]
            print("mid-call", *workers, flush=True)
            time.sleep(600)

async def main():
    args = {"torch_dtype": "float32", "sequence_parallel": 2}
    stage = StageOverride(name="dit", engine_args=args, sampling_params=json.loads(sys.argv[2]))
    pipeline = resolve_pipeline(get_pipeline("flux"), name="t", model=sys.argv[1], stages=[stage])
    engine = DiffusionEngine(pipeline, pipeline.topology.stage("dit"))
    await engine.start()
    logger = logging.getLogger("omni_runtime.engines.diffusion.parallel")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(Hold(logging.DEBUG))
    async for _ in engine.generate(EngineInput("r", {"prompt": "a red cube"}, {"seed": 5})):
        pass

asyncio.run(main())
"""


@pytest.mark.models
@pytest.mark.timeout(600)
def test_a_worker_rank_exits_when_rank_0_dies_mid_call(tiny_flux_model: Path, tmp_path: Path) -> None:
    """Rank 0 (the engine's process, here a subprocess) is killed while the worker waits in a collective of
    the same call: the worker exits on its own (no orphan holding a GPU's memory)."""
    log = tmp_path / "rank0.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLD_RANK0, str(tiny_flux_model), json.dumps(PARAMS)],
            stdout=subprocess.PIPE,
            stderr=out,
            cwd=REPO,
        )
    worker = 0
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(b"mid-call"):
                worker = int(line.split()[1])
                break
        assert worker, f"rank 0 never reached its first step: {log.read_text()[-3000:]}"
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 120  # a hang guard, not a timing assertion
        while pid_alive(worker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not pid_alive(worker), "the worker rank outlived its rank 0"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if worker and pid_alive(worker):
            os.kill(worker, signal.SIGKILL)


def _running_batch(metrics: str) -> float:
    """The diffusion engine's `running_batch` gauge (requests in the running pipeline call)."""
    for line in metrics.splitlines():
        if line.startswith("omnikube_stage_engine_stat{") and 'name="running_batch"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _spawned_children(pid: int) -> list[int]:
    """The multiprocessing workers (spawn) under `pid`, not its resource tracker."""
    found = []
    for child in process_tree(pid) - {pid}:
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            found.append(child)
    return found


@pytest.mark.models
@pytest.mark.timeout(900)
def test_served_a_worker_rank_killed_mid_request_gives_the_client_a_5xx_and_the_stage_exits_1(
    tiny_flux_model: Path, tmp_path: Path
) -> None:
    """Through `omnikube serve` and the real OpenAI client: the stage's worker rank is SIGKILLed while a
    request denoises; the client gets a 500 naming the rank and its exit code, and the stage process exits
    with code 1 (the launcher restarts it, as a Deployment restarts the pod)."""
    spec = {
        "model": str(tiny_flux_model),
        "name": "flux-sp",
        "stages": [{"name": "dit", "engine_args": {P.ARG: 2}, "sampling_params": PARAMS}],
    }
    run = Serve(spec, tmp_path)
    try:
        stage = run.stage_processes("dit")[0]
        workers = _spawned_children(stage["pid"])
        assert len(workers) == 1, workers
        api = openai.OpenAI(base_url=run.endpoint, api_key="none", max_retries=0, timeout=300)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            # Enough steps that the worker is killed inside the call, which the stage's gauge shows running.
            reply = pool.submit(api.images.generate, model="flux-sp", prompt="a red cube",
                                extra_body={"num_inference_steps": 200})  # fmt: skip
            metrics = stage["probe"].replace("/readyz", "/metrics")
            while not reply.done() and _running_batch(http_get(metrics)[1]) != 1.0:
                time.sleep(0.1)
            os.kill(workers[0], signal.SIGKILL)
            with pytest.raises(openai.InternalServerError) as failed:
                reply.result(timeout=300)
        assert re.search(DIED.format(pid=workers[0]), str(failed.value)), str(failed.value)
        deadline = time.monotonic() + 120  # a hang guard, not a timing assertion
        while "exited with code 1; restarting it" not in run.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "stage dit/" in run.log.read_text() and "exited with code 1; restarting it" in run.log.read_text()
    finally:
        code = run.stop()
    assert code == 0, run.log.read_text()[-3000:]
