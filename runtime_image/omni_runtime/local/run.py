"""`omnikube serve`: the whole runtime as local processes, like `vllm serve`.

    omnikube serve /models/tiny-prompt-enhanced-t2i            # a model folder
    omnikube serve my-pipeline.yaml                            # a small local pipeline file

It resolves the pipeline, writes `resolved.json` into a run folder, starts one `omnikube stage`
process per stage replica (each on two free ports), the Mooncake master when an edge uses
`mooncake`, and `omnikube router`; waits until every stage answers /readyz and the router /health;
prints `OpenAI endpoint: http://127.0.0.1:PORT/v1`; restarts a process that dies (as a Deployment
restarts a crashed pod; a crash loop stops everything); and on Ctrl-C / SIGTERM stops everything,
then sweeps the pipeline's /dev/shm/omnikube-* segments, so no process and no segment is left.
`processes.json` in the run folder lists every process with its pid, probe URL and log. Each run
generates its own pipeline key (`pipeline.key` in the run folder, mode 0600), which the router and the
stages use to authenticate every protocol message, so no other local process can drive the stages.

A model folder selects its pipeline from `--pipeline`, else from an `omnikube_pipeline.json`
marker (`{"pipeline": name}`), else from its `config.json` / `model_index.json` (the registry).

The local pipeline file (YAML) is an OmniPipeline spec cut down to what one machine needs; a relative
`model` is relative to the file:

    model: ./tiny-prompt-enhanced-t2i      # required
    pipeline: prompt-enhanced-t2i          # registry name; default: from the model folder
    name: demo                             # deployment name (default: the pipeline's)
    served_model_name: demo                # what clients put in `model` (default: name)
    stages:                                # per-stage overrides, all optional
      - name: enhancer
        replicas: 1
        engine_args: {max_model_len: 512}
        sampling_params: {max_tokens: 32}
    connectors:                            # ConnectorsSpec plus per-edge overrides
      default: shm                         # inline | shm | mooncake (local default: shm)
      edges:
        - {from: enhancer, to: dit, connector: mooncake, window: 0}
    limits: {max_concurrent_requests: 8, request_timeout_s: 120}   # RouterLimits

All processes share this machine, so local mode treats it as one pod: every stage is colocated with
the first, which is what makes `shm` legal on every edge.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omni_runtime.router.settings import RouterSettings
from omni_runtime.spec import (
    DRAIN_TIMEOUT_S,
    ConnectorKind,
    ConnectorsSpec,
    EdgeOverride,
    PipelineSpec,
    ResolvedPipeline,
    RouterLimits,
    SpecError,
    StageDiscovery,
    StageOverride,
    resolve_pipeline,
)
from omni_runtime.stage.settings import StageSettings
from omni_runtime.wire.auth import PipelineKey

__all__ = [
    "LocalPipelineFile",
    "LocalRun",
    "add_serve_arguments",
    "free_port",
    "load_local_spec",
    "serve_from_args",
]

log = logging.getLogger(__name__)

MARKER_FILE = "omnikube_pipeline.json"
KEY_FILE = "pipeline.key"
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
MAX_RESTARTS = 5
RESTART_WINDOW_S = 300.0


class LocalStage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    replicas: int = Field(1, ge=1, le=16)
    engine_args: dict[str, Any] = Field(default_factory=dict)
    sampling_params: dict[str, Any] = Field(default_factory=dict)


class LocalEdge(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    source: str = Field(alias="from")
    target: str = Field(alias="to")
    connector: ConnectorKind | None = None
    window: int | None = Field(None, ge=0)
    first_window: int | None = Field(None, ge=0)


class LocalConnectors(ConnectorsSpec):
    default: ConnectorKind = ConnectorKind.SHM
    edges: list[LocalEdge] = Field(default_factory=list)


class LocalPipelineFile(BaseModel):
    """The YAML `omnikube serve` accepts (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    pipeline: str | None = None
    name: str | None = None
    served_model_name: str | None = None
    stages: list[LocalStage] = Field(default_factory=list)
    connectors: LocalConnectors = Field(default_factory=LocalConnectors)
    limits: RouterLimits = Field(default_factory=RouterLimits)


def load_local_spec(target: str | Path, *, pipeline: str | None = None) -> LocalPipelineFile:
    """A local pipeline file, or one made up for a model folder (`pipeline` overrides the file's)."""
    path = Path(target).expanduser()
    if path.is_file() and path.suffix in (".yaml", ".yml", ".json"):
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            raise SpecError(f"{path}: not valid YAML: {' '.join(str(err).split())}") from err
        if not isinstance(raw, dict):
            raise SpecError(f"{path}: expected a mapping with at least `model`, found {type(raw).__name__}")
        try:
            spec = LocalPipelineFile.model_validate(raw)
        except ValidationError as err:
            from omni_runtime.registry.loader import format_validation_error

            raise SpecError(f"{path}: {format_validation_error(err)}") from err
        model = Path(spec.model).expanduser()
        if not model.is_absolute():
            model = (path.parent / model).resolve()
        spec.model = str(model)
    elif path.is_dir():
        spec = LocalPipelineFile(model=str(path.resolve()))
    else:
        raise SpecError(
            f"{target}: neither a model folder nor a pipeline file (.yaml); give the folder that holds "
            "config.json / model_index.json, or a YAML file with at least `model:`"
        )
    if pipeline:
        spec.pipeline = pipeline
    return spec


def topology_for(spec: LocalPipelineFile) -> PipelineSpec:
    from omni_runtime.registry import get_pipeline, resolve_model_pipeline

    if spec.pipeline:
        return get_pipeline(spec.pipeline)
    marker = Path(spec.model) / MARKER_FILE
    if marker.is_file():
        name = json.loads(marker.read_text(encoding="utf-8")).get("pipeline")
        if isinstance(name, str):
            return get_pipeline(name)
    return resolve_model_pipeline(spec.model)


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
"""Linux's range of ports the kernel hands to outgoing connections and to `bind(port=0)`."""
_BELOW_EPHEMERAL = 12000
"""How many ports under the ephemeral range `free_port` draws from."""


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1", exclude: Collection[int] = ()) -> int:
    """A TCP port free on `host` now, not in `exclude`, drawn from below the kernel's ephemeral range.

    The launcher picks every port up front, and its router binds only once the stages have loaded (minutes
    with vLLM). A port from the ephemeral range can meanwhile be given by the kernel to any outgoing
    connection (vLLM's own, a readiness probe's), and the router would then fail with "address already in
    use"; the kernel never hands out a port below that range by itself."""
    import random
    import socket

    low = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randrange(max(1024, low - _BELOW_EPHEMERAL), low)
        if port in exclude:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # that band is full: any port will do
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class _Proc:
    name: str
    cmd: list[str]
    log_path: Path
    probe: str
    popen: subprocess.Popen | None = None
    restarts: list[float] = field(default_factory=list)


@dataclass
class LocalRun:
    """A resolved local deployment: processes to start, their ports, and the run folder."""

    resolved: ResolvedPipeline
    run_dir: Path
    host: str = "127.0.0.1"
    router_port: int = 0
    replicas: dict[str, int] = field(default_factory=dict)
    stage_ports: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    procs: list[_Proc] = field(default_factory=list)
    mooncake: Any = None
    shm_pool_bytes: int = 64 * 1024**2
    api_key_file: Path | None = None
    """Given to the router: every /v1 request must send this file's key as a Bearer token."""
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    """Given to every process: on stop, running requests get this long to finish (`stop` waits for it)."""

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.router_port}/v1"

    @classmethod
    def prepare(
        cls,
        spec: LocalPipelineFile,
        *,
        run_dir: str | Path | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        connector: str | None = None,
        replicas: dict[str, int] | None = None,
        served_model_name: str | None = None,
        shm_pool_bytes: int = 64 * 1024**2,
        api_key_file: str | Path | None = None,
        drain_timeout_s: float = DRAIN_TIMEOUT_S,
    ) -> LocalRun:
        """Resolve the pipeline, pick ports and write `resolved.json`; starts nothing."""
        topology = topology_for(spec)
        names = topology.stage_names()
        overrides = []
        counts = {n: 1 for n in names}
        for i, stage in enumerate(spec.stages):
            if stage.name not in names:
                raise SpecError(
                    f"stages[{i}].name: pipeline {topology.name!r} has no stage {stage.name!r}; its stages are {names}"
                )
            counts[stage.name] = stage.replicas
        for name, count in (replicas or {}).items():
            if name not in names:
                raise SpecError(
                    f"--replicas {name}={count}: pipeline {topology.name!r} has no stage {name!r}; "
                    f"its stages are {names}"
                )
            counts[name] = count
        by_name = {s.name: s for s in spec.stages}
        for name in names:
            s = by_name.get(name)
            overrides.append(
                StageOverride(
                    name=name,
                    engine_args=s.engine_args if s else {},
                    sampling_params=s.sampling_params if s else {},
                    colocate_with=names[0] if name != names[0] else None,  # one host = one pod
                )
            )
        connectors_data = spec.connectors.model_dump(exclude={"edges"})
        if connector:
            connectors_data["default"] = ConnectorKind(connector)
        connectors = ConnectorsSpec.model_validate(connectors_data)
        edges = [EdgeOverride.model_validate(e.model_dump(by_alias=True)) for e in spec.connectors.edges]
        uses_mooncake = any(
            (e.connector or connectors.default) is ConnectorKind.MOONCAKE for e in _edges_after(topology, edges)
        )
        taken: set[int] = {port} if port else set()  # handed out here, bound only when their process starts

        def next_port() -> int:
            chosen = free_port(host, exclude=taken)
            taken.add(chosen)
            return chosen

        if uses_mooncake:
            connectors.mooncake.master_port = next_port()
            connectors.mooncake.metadata_port = next_port()
        name = spec.name or topology.name
        resolved = resolve_pipeline(
            topology,
            name=name,
            model=spec.model,
            served_model_name=served_model_name or spec.served_model_name or name,
            stages=overrides,
            edges=edges,
            connectors=connectors,
            limits=spec.limits,
        )
        if api_key_file is not None:
            from omni_runtime.router.auth import ApiKeyError, ApiKeyFile

            try:
                ApiKeyFile(api_key_file)  # refuse a bad file here, not after the stages loaded
            except ApiKeyError as err:
                raise SpecError(f"--api-key-file: {err}") from None
        if uses_mooncake:
            resolved.mooncake_master_host = host  # the launcher starts the master on this machine
        run = cls(resolved=resolved, run_dir=_run_dir(run_dir, name), host=host, shm_pool_bytes=shm_pool_bytes)
        run.api_key_file = Path(api_key_file).resolve() if api_key_file is not None else None
        run.drain_timeout_s = drain_timeout_s
        run.router_port = port or next_port()
        for stage_name in names:
            ports = [(next_port(), next_port()) for _ in range(counts[stage_name])]
            run.stage_ports[stage_name] = ports
            run.replicas[stage_name] = counts[stage_name]
            resolved.discovery[stage_name] = StageDiscovery(static=[f"{host}:{p}" for p, _ in ports])
        (run.run_dir / "resolved.json").write_text(resolved.model_dump_json(indent=2, by_alias=True))
        PipelineKey.write_new(run.key_path)  # a new key per run: nothing outside this run can speak to it
        return run

    @property
    def config_path(self) -> Path:
        return self.run_dir / "resolved.json"

    @property
    def key_path(self) -> Path:
        return self.run_dir / KEY_FILE

    # -- processes -----------------------------------------------------------------------------

    def _commands(self) -> list[_Proc]:
        base = [sys.executable, "-m", "omni_runtime.cli"]
        procs = []
        for stage, ports in self.stage_ports.items():
            for i, (port, http_port) in enumerate(ports):
                replica = f"r{i}"
                settings = StageSettings(
                    config=str(self.config_path),
                    stage=stage,
                    host=self.host,
                    port=port,
                    http_port=http_port,
                    replica=replica,
                    advertise_host=self.host,
                    shm_pool_bytes=self.shm_pool_bytes,
                    drain_timeout=self.drain_timeout_s,
                    pipeline_key_file=str(self.key_path),
                )
                cmd = [*base, settings.command, *settings.to_argv()]
                procs.append(
                    _Proc(
                        f"stage {stage}/{replica}",
                        cmd,
                        self.run_dir / f"stage-{stage}-{replica}.log",
                        f"http://{self.host}:{http_port}/readyz",
                    )
                )
        router_settings = RouterSettings(
            config=str(self.config_path),
            host=self.host,
            port=self.router_port,
            api_key_file=str(self.api_key_file) if self.api_key_file else None,
            drain_timeout=self.drain_timeout_s,
            pipeline_key_file=str(self.key_path),
        )
        router = [*base, router_settings.command, *router_settings.to_argv()]
        procs.append(
            _Proc("router", router, self.run_dir / "router.log", f"http://{self.host}:{self.router_port}/health")
        )
        return procs

    def start(self, *, ready_timeout_s: float = 600.0, stop_requested: Callable[[], bool] | None = None) -> None:
        """Start every process and wait until all are ready; on failure stop what started and raise.
        `stop_requested` is polled while waiting: when it turns true, stop and raise KeyboardInterrupt."""
        try:
            if any(
                self.resolved.topology.edge_connector(e) is ConnectorKind.MOONCAKE for e in self.resolved.topology.edges
            ):
                from omni_runtime.connectors.mooncake_master import MooncakeMaster

                mc = self.resolved.topology.connectors.mooncake
                self.mooncake = MooncakeMaster(
                    host=self.host,
                    rpc_port=mc.master_port,
                    metadata_port=mc.metadata_port,
                    log_dir=str(self.run_dir),
                ).start()
            self.procs = self._commands()
            for proc in self.procs:
                self._spawn(proc)
            self._write_processes()
            self.wait_ready(ready_timeout_s, stop_requested)
        except BaseException:
            self.stop()
            raise

    def _write_processes(self) -> None:
        """`processes.json` in the run folder: name, pid, probe URL and log of every process."""
        info = [
            {
                "name": p.name,
                "pid": p.popen.pid if p.popen else None,
                "probe": p.probe,
                "log": str(p.log_path),
            }
            for p in self.procs
        ]
        if self.mooncake is not None:
            mc = self.mooncake
            info.append(
                {
                    "name": "mooncake master",
                    "pids": mc.pids,
                    "master": mc.master_address,
                    "metadata": mc.metadata_server,
                    "metrics": f"http://{self.host}:{mc.metrics_port}/metrics",
                }
            )
        (self.run_dir / "processes.json").write_text(json.dumps(info, indent=2))

    def wait_ready(self, timeout_s: float, stop_requested: Callable[[], bool] | None = None) -> None:
        """Until every stage answers /readyz and the router's /health lists every replica as ready
        (KeyboardInterrupt as soon as `stop_requested()` is true)."""
        deadline = time.monotonic() + timeout_s
        waiting = list(self.procs)
        while waiting or not self._router_sees_all():
            if stop_requested is not None and stop_requested():
                raise KeyboardInterrupt
            for proc in list(waiting):
                self._check_alive(proc)
                if _probe(proc.probe):
                    waiting.remove(proc)
            if time.monotonic() > deadline:
                names = ", ".join(p.name for p in waiting) or "the router's view of the replicas"
                raise TimeoutError(f"not ready after {timeout_s:.0f}s: {names}; see their logs in {self.run_dir}")
            time.sleep(0.2)

    def _router_sees_all(self) -> bool:
        try:
            with _NO_PROXY.open(f"http://{self.host}:{self.router_port}/health", timeout=2) as resp:
                ready = json.loads(resp.read()).get("ready_replicas", {})
        except (urllib.error.URLError, OSError, ValueError):
            return False
        return all(ready.get(stage, 0) >= count for stage, count in self.replicas.items())

    def _check_alive(self, proc: _Proc) -> None:
        if proc.popen is not None and proc.popen.poll() is not None:
            raise RuntimeError(
                f"{proc.name} exited with code {proc.popen.returncode} while starting; "
                f"last lines of {proc.log_path}:\n{_tail(proc.log_path)}"
            )

    def _spawn(self, proc: _Proc) -> None:
        with open(proc.log_path, "ab") as log_file:  # the child keeps its own descriptor
            proc.popen = subprocess.Popen(
                proc.cmd,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def dead(self) -> list[str]:
        """Processes that exited on their own."""
        return [p.name for p in self.procs if p.popen is not None and p.popen.poll() is not None]

    def restart_dead(self) -> list[str]:
        """Start again every process that exited, as a Deployment restarts a crashed pod; returns
        their names. Raises RuntimeError for one that crashed `MAX_RESTARTS` times within
        `RESTART_WINDOW_S` (a crash loop), with its log tail."""
        restarted = []
        now = time.monotonic()
        for proc in self.procs:
            if proc.popen is None or proc.popen.poll() is None:
                continue
            proc.restarts = [t for t in proc.restarts if now - t < RESTART_WINDOW_S]
            if len(proc.restarts) >= MAX_RESTARTS:
                raise RuntimeError(
                    f"{proc.name} keeps exiting (code {proc.popen.returncode}, {len(proc.restarts)} restarts "
                    f"in {RESTART_WINDOW_S:.0f}s); last lines of {proc.log_path}:\n{_tail(proc.log_path)}"
                )
            log.warning("%s exited with code %s; restarting it", proc.name, proc.popen.returncode)
            _signal_group(proc.popen, signal.SIGKILL)  # whatever it left running (vLLM engine core)
            proc.popen.wait()
            self.sweep()  # the segments of the dead process (live owners keep theirs)
            proc.restarts.append(now)
            self._spawn(proc)
            restarted.append(proc.name)
        if restarted:
            self._write_processes()
        return restarted

    def pids(self) -> dict[str, int]:
        return {p.name: p.popen.pid for p in self.procs if p.popen is not None}

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM every process (the router first), SIGKILL its process group after `timeout_s` (default:
        the drain timeout plus 5 s: running requests finish first),
        stop the Mooncake master, and sweep this pipeline's shm segments."""
        timeout_s = self.drain_timeout_s + 5.0 if timeout_s is None else timeout_s
        ordered = sorted(self.procs, key=lambda p: p.name != "router")
        for proc in ordered:  # the process itself: it stops its own children (vLLM engine core) in order
            if proc.popen is not None and proc.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in ordered:
            if proc.popen is None:
                continue
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs; killing it", proc.name, timeout_s)
            _signal_group(proc.popen, signal.SIGKILL)  # its children (vLLM engine core) too
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(5)
        if self.mooncake is not None:
            self.mooncake.stop()
            self.mooncake = None
        self.sweep()

    def sweep(self) -> list[str]:
        from omni_runtime.connectors.shm import segment_prefix, sweep_orphans

        removed = sweep_orphans(segment_prefix(self.resolved.name))
        if removed:
            log.info("removed %d shm segment(s) left by stopped stages", len(removed))
        return removed

    def __enter__(self) -> LocalRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _edges_after(topology: PipelineSpec, overrides: list[EdgeOverride]) -> list[Any]:
    """The topology's edges with the connector overrides applied (for deciding on Mooncake)."""
    out = []
    for edge in topology.edges:
        override = next((o for o in overrides if o.source == edge.source and o.target == edge.target), None)
        out.append(override if override is not None and override.connector else edge)
    return out


def _run_dir(run_dir: str | Path | None, name: str) -> Path:
    if run_dir is not None:
        path = Path(run_dir)
        path.mkdir(parents=True, exist_ok=True)
        return path
    return Path(tempfile.mkdtemp(prefix=f"omnikube-{name}-"))


def _probe(url: str) -> bool:
    try:
        with _NO_PROXY.open(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _signal_group(popen: subprocess.Popen | None, sig: int) -> None:
    if popen is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, sig)


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


# -- command line --------------------------------------------------------------------------------


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", help="a model folder, or a local pipeline file (.yaml)")
    parser.add_argument("--pipeline", default=None, help="registry pipeline name (default: from the model)")
    parser.add_argument("--served-model-name", default=None, help="model id clients use")
    parser.add_argument("--host", default="127.0.0.1", help="address every process binds (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="router port (default: a free port)")
    parser.add_argument(
        "--connector",
        choices=[k.value for k in ConnectorKind],
        default=None,
        help="default connector of every edge (default: the file's, else shm)",
    )
    parser.add_argument(
        "--replicas", action="append", default=[], metavar="STAGE=N", help="replicas of a stage (repeatable)"
    )
    parser.add_argument(
        "--api-key-file",
        default=None,
        help="file holding the API key clients must send as 'Authorization: Bearer <key>' (re-read when it "
        "changes; default: no key)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=DRAIN_TIMEOUT_S,
        help=f"seconds running requests get to finish when serve stops (default {DRAIN_TIMEOUT_S:g})",
    )
    parser.add_argument("--run-dir", default=None, help="folder for resolved.json and logs (default: a temp dir)")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for readiness")
    parser.add_argument(
        "--shm-pool-bytes",
        type=int,
        default=64 * 1024**2,
        help="idle shm bytes each stage keeps for reuse (0: unlink when released)",
    )


def serve_from_args(args: argparse.Namespace) -> int:
    replicas = {}
    for item in args.replicas:
        name, _, count = item.partition("=")
        if not count.isdigit() or int(count) < 1:
            print(f"--replicas {item!r}: use STAGE=N with N >= 1", file=sys.stderr)
            return 2
        replicas[name] = int(count)
    try:
        spec = load_local_spec(args.target, pipeline=args.pipeline)
        run = LocalRun.prepare(
            spec,
            run_dir=args.run_dir,
            host=args.host,
            port=args.port,
            connector=args.connector,
            replicas=replicas,
            served_model_name=args.served_model_name,
            shm_pool_bytes=args.shm_pool_bytes,
            api_key_file=args.api_key_file,
            drain_timeout_s=args.drain_timeout,
        )
    except SpecError as err:
        print(f"omnikube serve: {err}", file=sys.stderr)
        return 2
    stop: dict[str, int | None] = {"signal": None}

    def on_signal(signum: int, _frame: object) -> None:
        # Only a flag, polled at safe points: raising from here could cut an import in half (numpy's,
        # in `sweep`), and the orderly stop that follows would then fail to import it again
        stop["signal"] = signum

    def stop_requested() -> bool:
        return stop["signal"] is not None

    # SIGINT too, explicitly: a process started in the background by a non-interactive shell (nohup, `&` in
    # a script or CI job) inherits SIGINT ignored, and Python then never calls a handler for it
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    topology = run.resolved.topology
    stages = " -> ".join(topology.topological_order())
    print(f"omnikube serve: pipeline {topology.name} ({stages}); run folder {run.run_dir}", flush=True)
    try:
        run.start(ready_timeout_s=args.ready_timeout, stop_requested=stop_requested)
        print(f"OpenAI endpoint: {run.endpoint}", flush=True)
        print(f"model: {run.resolved.served_model_name}; press Ctrl-C to stop", flush=True)
        while not stop_requested():
            for name in run.restart_dead():
                print(f"omnikube serve: {name} exited; restarted it (logs in {run.run_dir})", file=sys.stderr)
            time.sleep(0.5)  # a signal cuts it short (PEP 475 resumes it, so at most 0.5 s late)
        print("omnikube serve: stopping", flush=True)
        return 0
    except KeyboardInterrupt:  # from `start`, which polls `stop_requested`
        print("omnikube serve: stopping", flush=True)
        return 0
    except (RuntimeError, TimeoutError) as err:
        print(f"omnikube serve: {err}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the orderly stop short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        run.stop()
        print("omnikube serve: stopped", flush=True)
