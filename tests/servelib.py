"""Helpers shared by the stage, router and serve tests (the fixtures live in conftest.py; test modules
import helpers from here, since two conftest.py files exist in this repo and share a module name).

- `EchoEngine`: a tiny deterministic engine for the *fast* protocol tests only (see its docstring).
- `Serve`: a real `omnikube serve` subprocess on a local pipeline file, with helpers to read its
  processes, stage metrics and shm segments. End-to-end tests use it with the real engines on the
  tiny models (`@pytest.mark.models`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from omni_runtime.engines.base import Engine, EngineError, EngineInput, EngineOutput, InvalidRequest
from omni_runtime.spec import EdgeSpec, PipelineSpec, StageSpec
from omni_runtime.stage.settings import apply_stage_env_defaults

REPO = Path(__file__).resolve().parent.parent
SHM_DIR = Path("/dev/shm")
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))

ENGINE_ENV_ADDED = apply_stage_env_defaults()
"""Keys this test process set so that the engines its tests make in-process run as in a stage process
(`omnikube stage` applies the same defaults: on CPU, vLLM's worker inside its engine core, one vLLM import
fewer per engine). A `Serve` starts without them, as from a user's shell, so that the stage's own is tested."""

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class EchoEngine(Engine):
    """A deterministic stand-in engine for the fast protocol tests of the stage server and router.

    Why it exists: those tests check framing, routing, windows, cancellation, releases and error
    mapping in milliseconds, without loading vLLM or diffusers. End-to-end tests never use it; they
    run `omnikube serve` with the real engines on the tiny models.

    It echoes the words of its input (`prompt`, the last user message, or an upstream `text`) back
    one word per output as `{"text": "word ", "token_ids": [i]}`. Params: `delay` (seconds per
    word), `fail` (raise EngineError), `invalid` (raise InvalidRequest), `upper` (upper-case words).
    `aborted` records the ids it was asked to abort, `seen` every input it ran.
    """

    def __init__(self, pipeline, stage) -> None:
        super().__init__(pipeline, stage)
        self.aborted: list[str] = []
        self.seen: list[EngineInput] = []
        self.started = False

    async def start(self) -> None:
        self.started = True

    async def generate(self, request: EngineInput) -> AsyncIterator[EngineOutput]:
        self.seen.append(request)
        params = request.params
        if params.get("invalid"):
            raise InvalidRequest(f"echo: {params['invalid']}")
        if params.get("fail"):
            raise EngineError(f"echo: {params['fail']}")
        data = request.data
        if "messages" in data:
            text = [m["content"] for m in data["messages"] if m.get("role") == "user"][-1]
        else:
            text = data.get("prompt") or data.get("text") or ""
        words = str(text).split()
        delay = float(params.get("delay", 0))
        for i, word in enumerate(words):
            if delay:
                await asyncio.sleep(delay)
            word = word.upper() if params.get("upper") else word
            last = i == len(words) - 1
            yield EngineOutput(
                request.request_id,
                {"text": word + " ", "token_ids": [i]},
                finished=last,
                finish_reason="stop" if last else None,
                usage={"prompt_tokens": len(words), "completion_tokens": len(words)} if last else None,
            )
        if not words:
            yield EngineOutput(
                request.request_id,
                {"text": "", "token_ids": []},
                finished=True,
                finish_reason="stop",
                usage={"prompt_tokens": 0, "completion_tokens": 0},
            )

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def stop(self) -> None:
        self.started = False


class EchoTalker(EchoEngine):
    """A stand-in talker for the fast protocol tests of streamed speech hand-off (same reason as
    EchoEngine: framing, windows, voices and releases in milliseconds; the real talker runs in the
    tests/test_serve_speech.py tier).

    It takes its input in chunks (`streams_input`) and answers each upstream token id `t` with one
    codec frame `[t, t, t, t]` (numpy int64, shape (1, 4)). `chunks_seen` records the token ids of each
    chunk, `voices_seen` the `voice` parameter of each request. Param `frame_delay`: seconds per frame.
    """

    streams_input = True
    VOICES = ["chelsie", "ethan"]

    def __init__(self, pipeline, stage) -> None:
        super().__init__(pipeline, stage)
        self.chunks_seen: list[list[int]] = []
        self.voices_seen: list[str | None] = []

    def voices(self) -> list[str]:
        return list(self.VOICES)

    async def generate(self, request: EngineInput) -> AsyncIterator[EngineOutput]:
        import numpy as np

        self.seen.append(request)
        self.voices_seen.append(request.params.get("voice"))
        delay = float(request.params.get("frame_delay", 0))
        frames = 0

        async def chunks():
            yield request.data
            if request.chunks is not None:
                async for chunk in request.chunks:
                    yield chunk

        async for chunk in chunks():
            ids = [int(t) for t in chunk.get("token_ids") or []]
            self.chunks_seen.append(ids)
            for t in ids:
                if delay:
                    await asyncio.sleep(delay)
                frames += 1
                yield EngineOutput(request.request_id, {"codes": np.full((1, 4), t, dtype=np.int64)})
        yield EngineOutput(request.request_id, {}, finished=True, finish_reason="stop",
                           usage={"prompt_tokens": 0, "completion_tokens": frames})  # fmt: skip


class EchoCodec(EchoTalker):
    """A stand-in code-to-waveform stage for the same fast tests: each codec frame `[t, ...]` becomes
    `SAMPLES` float32 samples of value `(t + 1) / 1000`, one audio output per chunk it is fed.
    `chunks_seen` records the frame count of each chunk."""

    SAMPLES = 240

    def voices(self) -> list[str]:
        return []

    async def generate(self, request: EngineInput) -> AsyncIterator[EngineOutput]:
        import numpy as np

        self.seen.append(request)

        async def chunks():
            yield request.data
            if request.chunks is not None:
                async for chunk in request.chunks:
                    yield chunk

        async for chunk in chunks():
            codes = chunk.get("codes")
            if codes is None or len(codes) == 0:
                continue
            codes = np.asarray(codes)
            self.chunks_seen.append([len(codes)])
            audio = np.repeat((codes[:, 0].astype(np.float32) + 1) / 1000, self.SAMPLES)
            yield EngineOutput(request.request_id, {"audio": audio, "sample_rate": 24000})
        yield EngineOutput(request.request_id, {}, finished=True, finish_reason="stop")


# -- small shared helpers --------------------------------------------------------------------------


async def until(
    predicate: Callable[[], object], what: str | None = None, timeout: float = 5.0, interval: float = 0.02
) -> None:
    """Wait in the event loop until `predicate()` is true, polling every `interval` s; fail after `timeout` s
    with an AssertionError naming what was awaited (`what`, else the predicate's source line)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            if what is None:
                try:
                    what = inspect.getsource(predicate).strip()  # type: ignore[arg-type]
                except (OSError, TypeError):
                    what = repr(predicate)
            raise AssertionError(f"not reached within {timeout}s: {what}")
        await asyncio.sleep(interval)


def chat_topology() -> PipelineSpec:
    """One AR stage `llm` making the reply: the plain chat pipeline `echo`."""
    return PipelineSpec(name="echo", stages=[StageSpec(name="llm", kind="ar", final_output=True)])


def windowed_topology(connector: str = "shm", window: int = 2) -> PipelineSpec:
    """Two AR stages `a` -> `b` (pipeline `echo3`), their edge over `connector` with a credit `window`."""
    return PipelineSpec(
        name="echo3",
        stages=[StageSpec(name="a", kind="ar"), StageSpec(name="b", kind="ar", final_output=True)],
        edges=[EdgeSpec(**{"from": "a", "to": "b", "connector": connector, "window": window})],
    )


def template_hash(deployment: dict[str, Any]) -> str:
    """The operator's pod-template hash annotation on a rendered Deployment."""
    from omni_operator.builders.meta import TEMPLATE_HASH_ANNOTATION

    return deployment["spec"]["template"]["metadata"]["annotations"][TEMPLATE_HASH_ANNOTATION]


async def diffusion_image(engine: Engine, rid: str, prompt: str, **params: Any) -> bytes:
    """The image a diffusion `engine` makes for `prompt` under sampling `params`, checked to come as the reply's
    one output, its final one (an image request has no progress outputs: those are for video)."""
    outs = [out async for out in engine.generate(EngineInput(rid, {"prompt": prompt}, params))]
    assert len(outs) == 1 and outs[0].finished, outs
    return outs[0].data["images"][0]


# -- omnikube serve -----------------------------------------------------------------------------


def tiny_model(name: str) -> Path:
    from omni_runtime.tiny_models import ensure

    return ensure(name)


def shm_segments(pipeline: str) -> list[str]:
    """The shm segments in /dev/shm of `pipeline`, by name (the runtime's own `segment_prefix`), whatever their
    state."""
    from omni_runtime.connectors.shm import segment_prefix

    prefix = segment_prefix(pipeline)
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


def busy_shm_segments(pipeline: str) -> list[str]:
    """Segments holding a payload nobody released (state word's low bit set)."""
    busy = []
    for name in shm_segments(pipeline):
        try:
            with open(SHM_DIR / name, "rb") as f:
                head = f.read(16)
        except FileNotFoundError:
            continue
        if len(head) == 16 and int.from_bytes(head[8:16], "little") & 1:
            busy.append(name)
    return busy


def http_get(url: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with _NO_PROXY.open(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def metric_values(text: str, name: str, **labels: str) -> list[float]:
    """Values of the samples of metric `name` whose labels include `labels`."""
    out = []
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        match = re.match(rf"^{re.escape(name)}(\{{(.*)\}})?\s+(\S+)$", line)
        if not match:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            out.append(float(match.group(3)))
    return out


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Serve:
    """`omnikube serve <file>` as a subprocess; `stop()` sends SIGINT like Ctrl-C and waits."""

    def __init__(self, spec: dict[str, Any], workdir: Path, *, args: tuple[str, ...] = (),
                 ready_timeout: float = 400) -> None:  # fmt: skip
        self.spec = spec
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.file = workdir / "pipeline.yaml"
        self.file.write_text(yaml.safe_dump(spec))
        self.run_dir = workdir / "run"
        self.log = workdir / "serve.log"
        cmd = [sys.executable, "-m", "omni_runtime.cli", "serve", str(self.file), "--run-dir", str(self.run_dir),
               "--ready-timeout", str(ready_timeout), *args]  # fmt: skip
        self._log = open(self.log, "wb")  # noqa: SIM115
        # Started as nohup or a script's `&` starts it: with SIGINT ignored. `stop()` still stops it with SIGINT,
        # and every fixture's teardown checks that it exits 0 and leaves no process behind.
        env = {k: v for k, v in os.environ.items() if k not in ENGINE_ENV_ADDED}
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO, env=env, preexec_fn=_ignore_sigint
        )
        self.endpoint = self._wait_endpoint(ready_timeout + 30)
        self.base = self.endpoint.removesuffix("/v1")
        self.resolved = json.loads((self.run_dir / "resolved.json").read_text())
        self.name = self.resolved["name"]
        self.model = self.resolved["served_model_name"]

    def _wait_endpoint(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log.read_text(errors="replace")
            match = re.search(r"OpenAI endpoint: (\S+)", text)
            if match:
                return match.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"omnikube serve exited with {self.proc.returncode}:\n{text[-4000:]}\n"
                                   + self.logs_tail())  # fmt: skip
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"omnikube serve not ready in {timeout}s:\n{self.logs_tail()}")

    def logs_tail(self, n: int = 40) -> str:
        out = []
        for path in sorted(self.run_dir.glob("*.log")) if self.run_dir.exists() else []:
            lines = path.read_text(errors="replace").splitlines()[-n:]
            out.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(out)

    def processes(self) -> list[dict[str, Any]]:
        return json.loads((self.run_dir / "processes.json").read_text())

    def stage_processes(self, stage: str) -> list[dict[str, Any]]:
        return [p for p in self.processes() if p["name"].startswith(f"stage {stage}/")]

    def stage_metrics(self, stage: str) -> list[str]:
        return [http_get(p["probe"].replace("/readyz", "/metrics"))[1] for p in self.stage_processes(stage)]

    def router_metrics(self) -> str:
        return http_get(f"{self.base}/metrics")[1]

    def running(self, stage: str) -> float:
        """Works running on all replicas of `stage` that answer."""
        total = 0.0
        for p in self.stage_processes(stage):
            status, text = http_get(p["probe"].replace("/readyz", "/metrics"))
            if status == 200:
                total += sum(metric_values(text, "omnikube_stage_requests_running"))
        return total

    def handles_open(self, stage: str) -> float:
        total = 0.0
        for p in self.stage_processes(stage):
            status, text = http_get(p["probe"].replace("/readyz", "/metrics"))
            if status == 200:
                total += sum(metric_values(text, "omnikube_stage_handles_open"))
        return total

    def wait_idle(self, stages: list[str], timeout: float = 30) -> None:
        """Until every stage runs no work and holds no handle."""
        deadline = time.monotonic() + timeout
        while True:
            state = {s: (self.running(s), self.handles_open(s)) for s in stages}
            if all(r == 0 and h == 0 for r, h in state.values()):
                return
            if time.monotonic() > deadline:
                works = {s: [http_get(p["probe"])[1] for p in self.stage_processes(s)] for s in stages}
                raise AssertionError(
                    f"stages still busy after {timeout}s (running, handles): {state}; works: {works}\n"
                    + self.logs_tail(80)
                )
            time.sleep(0.2)

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def all_pids(self) -> list[int]:
        pids = [p["pid"] for p in self.processes() if p.get("pid")]
        for p in self.processes():
            pids.extend(p.get("pids") or [])
        return pids


UNRELEASED = "omnikube_connector_payloads_unreleased"


def mooncake_keys(run: Serve) -> float | None:
    """Keys the serve's Mooncake master holds (its `master_key_count`); None when the serve runs no master."""
    master = [p for p in run.processes() if p["name"] == "mooncake master"]
    if not master:
        return None
    return metric_values(http_get(master[0]["metrics"])[1], "master_key_count")[0]


def assert_nothing_held(
    run: Serve,
    stages: Sequence[str],
    *,
    kinds: Sequence[str] = (),
    master_keys: bool = False,
    no_segments: bool = False,
    idle_timeout: float = 60,
    timeout: float = 15,
) -> None:
    """Once `stages` are idle (`wait_idle`, `idle_timeout` s), wait up to `timeout` s until nothing is held:
    the stages' `omnikube_connector_payloads_unreleased` summed to 0 (in all and per connector kind), no shm
    segment of the pipeline busy, and as asked no key in the serve's Mooncake master (`master_keys`) and no shm
    segment left at all (`no_segments`: with a pool of 0 released segments are unlinked). Each of `kinds` must
    be reported by some stage process, so that a renamed or missing gauge cannot read as "nothing held"."""
    run.wait_idle(list(stages), timeout=idle_timeout)
    deadline = time.monotonic() + timeout
    while True:
        texts = [text for stage in stages for text in run.stage_metrics(stage)]
        by_kind = {kind: [v for text in texts for v in metric_values(text, UNRELEASED, kind=kind)] for kind in kinds}
        missing = [kind for kind, values in by_kind.items() if not values]
        assert not missing, f"no stage process reports {UNRELEASED} for {missing}: {by_kind}"
        held: dict[str, object] = {
            "unreleased": sum(v for text in texts for v in metric_values(text, UNRELEASED)),
            **{f"unreleased {kind}": sum(values) for kind, values in by_kind.items()},
            "busy segments": busy_shm_segments(run.name),
        }
        if master_keys:
            held["mooncake keys"] = mooncake_keys(run)
        if no_segments:
            held["segments"] = shm_segments(run.name)
        if not any(held.values()):
            return
        assert time.monotonic() < deadline, held
        time.sleep(0.2)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1].split()[0] != "Z"
    except OSError:
        return False
    return True


def process_exists(pid: int) -> bool:
    """True while `pid` exists, a zombie included (see `pid_alive` for one that counts zombies as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def listening_only_on_loopback(port: int) -> bool:
    """True if something listens on `port` and only on 127.0.0.1 (read from /proc/net/tcp*)."""
    addresses = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    addresses.add(address)
    return addresses == {"0100007F"}


def process_tree(pid: int) -> set[int]:
    """`pid` and its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().split(") ")[-1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo.extend(children.get(p, []))
    return out


# -- in-process echo cluster (fast tests) --------------------------------------------------------


class EchoCluster:
    """Stage servers with EchoEngines plus the real router app on uvicorn, all in this event loop."""

    def __init__(self, pipeline, servers, engines, base: str, server_task, uvicorn_server) -> None:
        self.pipeline = pipeline
        self.servers = servers  # stage -> [StageServer]
        self.engines = engines  # stage -> [EchoEngine]
        self.base = base
        self._task = server_task
        self._uvicorn = uvicorn_server
        self.key = None  # the PipelineKey the servers and the router share

    @property
    def app(self):
        return self._uvicorn.config.app

    @property
    def pool(self):
        return self.app.state.context.pool

    async def wait_ready(self, timeout: float = 10) -> None:
        """Until every replica of every stage is up; a replica whose engine failed to load raises its error."""
        total = sum(len(s) for s in self.servers.values())
        async with asyncio.timeout(timeout):
            while sum(1 for c in self.pool.clients() if c.usable) < total:
                for server in (s for group in self.servers.values() for s in group):
                    if server.probe()[1]["status"] in ("engine failed to load", "connector unavailable"):
                        await server.serve_forever()  # returns at once, raising why
                await asyncio.sleep(0.02)


def echo_pipeline(topology, *, limits=None, name: str = "echo"):
    """All stages in one process, like one pod: colocated, so `shm` edges are allowed."""
    from omni_runtime.spec import RouterLimits, StageOverride, resolve_pipeline

    first = topology.stages[0].name
    together = [StageOverride(name=s.name, colocate_with=first) for s in topology.stages[1:]]
    return resolve_pipeline(topology, name=name, model="/nonexistent", served_model_name=name,
                            stages=together, limits=limits or RouterLimits())  # fmt: skip


class echo_cluster:  # noqa: N801 (used as `async with echo_cluster(...)`)
    def __init__(
        self, pipeline, replicas: dict[str, int] | None = None, *, ping_timeout_s: float = 3.0, api_key_file=None,
        engines: dict[str, type] | None = None, ready_timeout: float = 10,
    ) -> None:  # fmt: skip
        """`engines`: the engine class per stage name (EchoEngine for the others); `ready_timeout`: seconds
        every replica may take to load its engine (a real one loads its model)."""
        self.pipeline = pipeline
        self.replicas = replicas or {}
        self.ping_timeout_s = ping_timeout_s
        self.api_key_file = api_key_file
        self.engine_classes = engines or {}
        self.ready_timeout = ready_timeout

    async def __aenter__(self) -> EchoCluster:
        import socket

        import uvicorn

        from omni_runtime.router.app import build_app
        from omni_runtime.router.pool import StagePool
        from omni_runtime.spec import StageDiscovery
        from omni_runtime.stage.connectors import ConnectorSettings
        from omni_runtime.stage.server import StageServer
        from omni_runtime.wire.auth import PipelineKey

        key = PipelineKey.generate()
        servers, engines = {}, {}
        for stage in self.pipeline.topology.stages:
            for i in range(self.replicas.get(stage.name, 1)):
                engine = self.engine_classes.get(stage.name, EchoEngine)(self.pipeline, stage)
                server = StageServer(
                    self.pipeline, stage.name, key=key, engine=engine, port=0, http_port=0, replica=f"r{i}",
                    connectors=ConnectorSettings(owner=f"{stage.name}-r{i}", shm_pool_bytes=0),
                )  # fmt: skip
                await server.start()
                servers.setdefault(stage.name, []).append(server)
                engines.setdefault(stage.name, []).append(engine)
            self.pipeline.discovery[stage.name] = StageDiscovery(
                static=[f"127.0.0.1:{s.port}" for s in servers[stage.name]]
            )
        pool = StagePool(self.pipeline, key=key, ping_interval_s=0.1, ping_timeout_s=self.ping_timeout_s)
        app = build_app(self.pipeline, pool, api_key_file=self.api_key_file)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        server.install_signal_handlers = lambda: None
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        self.cluster = EchoCluster(self.pipeline, servers, engines, f"http://127.0.0.1:{port}", task, server)
        self.cluster.key = key
        self._sock = sock
        try:
            await self.cluster.wait_ready(self.ready_timeout)
        except BaseException:  # a stage that never came up: stop what runs before saying why
            await self.__aexit__(None, None, None)
            raise
        return self.cluster

    async def __aexit__(self, *exc) -> None:
        self.cluster._uvicorn.should_exit = True
        await asyncio.wait_for(self.cluster._task, 10)
        self._sock.close()
        for servers in self.cluster.servers.values():
            for server in servers:
                await server.stop()


VLLM_TIMEOUT_S = 420
"""vLLM loads in 35-50 s on an idle 2-core machine; much longer when it is shared."""


def run_vllm_script(script: str, model: Path, tmp_path: Path, **env: str) -> dict:
    """Run `script` (it prints one `RESULT <json>` line) with `python script.py <model>`; return the json."""
    path = tmp_path / "run_vllm.py"
    path.write_text(textwrap.dedent(script))
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **env}
    proc = subprocess.run(
        [sys.executable, str(path), str(model)],
        capture_output=True,
        text=True,
        timeout=VLLM_TIMEOUT_S,
        env=full_env,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"vLLM subprocess failed (rc={proc.returncode}); env {env}\n"
        f"--- stderr tail ---\n{proc.stderr[-6000:]}\n--- stdout tail ---\n{proc.stdout[-2000:]}"
    )
    return json.loads(lines[-1].removeprefix("RESULT "))


# -- shared serves: one `omnikube serve` per topology for the whole session -----------------------
#
# Each vLLM start costs 35-50 s on an idle 2-core machine and far more on a loaded one, and CI time is the
# project's limit. So a topology's tiny model is served once per session by a session fixture in
# conftest.py, and every module that needs it uses that fixture. `SHARED_SERVES` is the one list of those
# fixtures: tests/test_suite_budget.py reads it and fails for a module that starts its own serve of a
# topology listed here without saying why (a module-level `OWN_SERVE = "<reason>"`).


@dataclass(frozen=True)
class SharedServe:
    """One shared serve: the session fixture that serves it and what names it in a module's source."""

    fixture: str
    """The session fixture (in `tier`/conftest.py) that yields the running serve."""
    tier: str
    """The folder whose modules it serves: "tests" (a local `omnikube serve`) or "e2e" (a pipeline in the
    cluster); a fixture of one tier cannot stand in for a serve of the other."""
    names: tuple[str, ...]
    """Identifiers and exact strings by which a module's source names this topology or its tiny model
    (fixture parameters, model folder names, the topology's name)."""


SHARED_SERVES: dict[str, SharedServe] = {
    "text-chat": SharedServe("chat_serve", "tests", ("tiny_chat_model", "tiny-qwen2-chat", "text-chat")),
}
"""Topology -> the shared serve of its tiny model (see the section comment above)."""


CHAT_MODEL = "chat"
"""Served model name of the shared text-chat serve (`chat_serve`); the conformance module gives vLLM's
own server the same name, so the two answer the same requests."""
CHAT_MAX_MODEL_LEN = 2048
"""The tiny model's max_position_embeddings: room for the drain tests' longest stream and for the
conformance test that fills the context. Prompt lengths and max_tokens in the tests derive from it."""
CHAT_KV_BYTES = 64 * 1024**2
"""KV cache per replica: 512 bytes a token for the tiny model, so ~130k tokens, far above what 4
requests in flight of CHAT_MAX_MODEL_LEN need."""
CHAT_SEED = 0
CHAT_TOOL_PARSER = "hermes"
"""Qwen2.5's tool-call format (the tiny model's template has Qwen2.5's tool section); the conformance
module's tool tests need it, and the fuzzer then reaches the tool paths too."""
CHAT_REPLICAS = 2
"""Two replicas of the stage: the replica-kill and stage-drain tests need one that keeps serving."""
CHAT_DRAIN_TIMEOUT_S = 300
"""`--drain-timeout`: far above what any request needs, however slow the machine: the drain tests check
that work finishes during a drain (test_drain.py checks what happens when the period ends first)."""
CHAT_LIMITS: dict[str, Any] = {
    "max_concurrent_requests": 4,
    "max_queued_requests": 2,
    "request_timeout_s": 300,  # the drain tests' longest stream under the heaviest load
    "max_body_bytes": 256 * 1024,
}
"""Router limits of the shared chat serve. The admission test fills exactly in flight + queued; its
429s are OpenAI-shaped 4xx, which the fuzzer accepts; the fuzzer sends one request at a time."""


def chat_serve_spec(model: Path) -> dict[str, Any]:
    """The local pipeline file of the shared text-chat serve on the tiny Qwen2 model at `model`."""
    return {
        "model": str(model),
        "name": CHAT_MODEL,
        "stages": [
            {
                "name": "llm",
                "replicas": CHAT_REPLICAS,
                "engine_args": {
                    "max_model_len": CHAT_MAX_MODEL_LEN,
                    "kv_cache_memory_bytes": CHAT_KV_BYTES,
                    "seed": CHAT_SEED,
                    "tool_call_parser": CHAT_TOOL_PARSER,
                },
            }
        ],
        "limits": CHAT_LIMITS,
    }


def answers(url: str) -> bool:
    """Whether `url` answers 200 now (False while its process is down or restarting)."""
    try:
        return http_get(url, timeout=2)[0] == 200
    except OSError:
        return False


def wait_serving(serve: Serve, stage: str, timeout: float = 600) -> None:
    """Until the router and every replica of `stage` answer and the router routes to all of them.

    Destructive tests call it first: an earlier one killed or drained a process that the launcher restarts,
    and a stage reloads its model on restart (minutes under load)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            procs = serve.stage_processes(stage)
        except ValueError:  # processes.json half rewritten by a restart
            procs = None
        if procs is not None and answers(f"{serve.base}/health") and all(answers(p["probe"]) for p in procs):
            up = metric_values(serve.router_metrics(), "omnikube_stage_replica_up", stage=stage)
            if sum(up) == len(procs):
                return
        assert time.monotonic() < deadline, f"the pipeline did not come back up in {timeout}s:\n{serve.logs_tail(40)}"
        time.sleep(0.5)


def serve_tree(serve: Serve) -> set[int]:
    """Every process of `serve` now: the launcher, its processes and their children (vLLM engine cores)."""
    tree = process_tree(serve.proc.pid)
    for pid in serve.all_pids():
        tree |= process_tree(pid)
    return tree
