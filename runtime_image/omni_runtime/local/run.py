"""`omnikube serve`: the whole runtime as local processes, like `vllm serve`.

    omnikube serve /models/tiny-prompt-enhanced-t2i            # a model folder
    omnikube serve my-pipeline.yaml                            # a small local pipeline file (`local.spec`)

`LocalRun.prepare` resolves the pipeline (`resolve_pipeline`, placed on this machine), picks every port,
writes `resolved.json` into a run folder and lists the processes to start: one `omnikube stage` per stage
replica (each on two free ports) and `omnikube router`; `local.supervisor` starts them (and the Mooncake
master when an edge uses `mooncake`), watches and stops them. Each run generates its own pipeline key
(`pipeline.key` in the run folder, mode 0600), which the router and the stages use to authenticate every
protocol message, so no other local process can drive the stages.

A model folder selects its pipeline from `--pipeline`, else from an `omnikube_pipeline.json`
marker (`{"pipeline": name}`), else from its `config.json` / `model_index.json` (the registry).

All processes share this machine, so local mode treats it as one pod: every stage is colocated with
the first, which is what makes `shm` legal on every edge.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from omni_runtime.local.spec import LocalPipelineFile
from omni_runtime.router.settings import RouterSettings
from omni_runtime.spec import (
    DRAIN_TIMEOUT_S,
    ConnectorKind,
    ConnectorsSpec,
    MooncakeMasterAddress,
    PipelineSpec,
    Placement,
    PodGroups,
    ResolvedPipeline,
    SpecError,
    StageDiscovery,
    StageOverride,
    check_engine_args,
    resolve_pipeline,
)
from omni_runtime.stage.settings import StageSettings
from omni_runtime.wire.auth import PipelineKey

__all__ = ["LocalProcess", "LocalRun", "free_port", "topology_for"]

MARKER_FILE = "omnikube_pipeline.json"
KEY_FILE = "pipeline.key"


def topology_for(spec: LocalPipelineFile) -> PipelineSpec:
    """The registry topology the file names, else the model folder's marker names, else its config files select."""
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

    `LocalRun.prepare` picks every port up front, and the router binds only once the stages have loaded (minutes
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


@dataclass(frozen=True)
class LocalProcess:
    """One process of a local run, as it is to be started."""

    name: str
    cmd: list[str]
    log_path: Path
    probe: str
    """URL that answers 200 once the process is ready."""


@dataclass
class LocalRun:
    """A resolved local deployment: processes to start, their ports, and the run folder."""

    resolved: ResolvedPipeline
    run_dir: Path
    host: str = "127.0.0.1"
    router_port: int = 0
    replicas: dict[str, int] = field(default_factory=dict)
    stage_ports: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    shm_pool_bytes: int = 64 * 1024**2
    api_key_file: Path | None = None
    """Given to the router: every /v1 request must send this file's key as a Bearer token."""
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    """Given to every process: on stop, running requests get this long to finish (the supervisor waits for it)."""

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
        counts = {n: 1 for n in names} | {s.name: s.replicas for s in spec.stages} | (replicas or {})
        taken: set[int] = {port} if port else set()  # handed out here, bound only when their process starts

        def next_port() -> int:
            chosen = free_port(host, exclude=taken)
            taken.add(chosen)
            return chosen

        stage_ports = {n: [(next_port(), next_port()) for _ in range(counts[n])] for n in names}

        def on_this_machine(_groups: PodGroups) -> dict[str, StageDiscovery]:
            return {n: StageDiscovery(static=[f"{host}:{p}" for p, _ in stage_ports[n]]) for n in names}

        def master_here() -> MooncakeMasterAddress:  # the supervisor starts the master on this machine
            return MooncakeMasterAddress(host=host, master_port=next_port(), metadata_port=next_port())

        connectors_data = spec.connectors.model_dump(exclude={"edges"})
        if connector:
            connectors_data["default"] = ConnectorKind(connector)
        name = spec.name or topology.name
        resolved = resolve_pipeline(
            topology,
            name=name,
            model=spec.model,
            served_model_name=served_model_name or spec.served_model_name or name,
            stages=_stage_overrides(spec, names),
            edges=spec.connectors.edges,
            connectors=ConnectorsSpec.model_validate(connectors_data),
            limits=spec.limits,
            placement=Placement(discovery=on_this_machine, mooncake_master=master_here),
        )
        # omnikube's own engine args, before a process starts (vLLM's keys are checked when its stage starts)
        check_engine_args(resolved.topology)
        for stage_name, count in (replicas or {}).items():
            if stage_name not in names:
                raise SpecError(
                    f"--replicas {stage_name}={count}: pipeline {topology.name!r} has no stage {stage_name!r}; "
                    f"its stages are {names}"
                )
        if api_key_file is not None:
            from omni_runtime.router.auth import ApiKeyError, ApiKeyFile

            try:
                ApiKeyFile(api_key_file)  # refuse a bad file here, not after the stages loaded
            except ApiKeyError as err:
                raise SpecError(f"--api-key-file: {err}") from None
        run = cls(
            resolved=resolved,
            run_dir=_run_dir(run_dir, name),
            host=host,
            router_port=port or next_port(),
            replicas={n: counts[n] for n in names},
            stage_ports=stage_ports,
            shm_pool_bytes=shm_pool_bytes,
            api_key_file=Path(api_key_file).resolve() if api_key_file is not None else None,
            drain_timeout_s=drain_timeout_s,
        )
        run.config_path.write_text(resolved.model_dump_json(indent=2, by_alias=True))
        PipelineKey.write_new(run.key_path)  # a new key per run: nothing outside this run can speak to it
        return run

    @property
    def config_path(self) -> Path:
        return self.run_dir / "resolved.json"

    @property
    def key_path(self) -> Path:
        return self.run_dir / KEY_FILE

    def processes(self) -> list[LocalProcess]:
        """Every process of the run: one per stage replica, then the router (each with its command line,
        log file and readiness probe)."""
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
                    LocalProcess(
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
            LocalProcess("router", router, self.run_dir / "router.log", f"http://{self.host}:{self.router_port}/health")
        )
        return procs


def _stage_overrides(spec: LocalPipelineFile, names: list[str]) -> list[StageOverride]:
    """The file's stage overrides (the last entry of a stage wins), then local mode's placement: one host
    is one pod, so every stage shares the first one's."""
    listed = {s.name: s for s in spec.stages}.values()
    return [
        *(StageOverride(name=s.name, engine_args=s.engine_args, sampling_params=s.sampling_params) for s in listed),
        *(StageOverride(name=n, colocate_with=names[0]) for n in names[1:]),
    ]


def _run_dir(run_dir: str | Path | None, name: str) -> Path:
    if run_dir is not None:
        path = Path(run_dir)
        path.mkdir(parents=True, exist_ok=True)
        return path
    return Path(tempfile.mkdtemp(prefix=f"omnikube-{name}-"))
