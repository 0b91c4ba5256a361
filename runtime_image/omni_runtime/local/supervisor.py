"""The processes of one local run: started, waited on until ready, restarted when they die, stopped.

`Supervisor` starts the Mooncake master when the resolved pipeline has one, then every process a
`LocalRun` lists; waits until every stage answers /readyz and the router's /health lists every replica;
restarts a process that dies (as a Deployment restarts a crashed pod; a crash loop stops everything);
and on stop SIGTERMs everything (the router first), kills what outlives the drain, and sweeps the
pipeline's /dev/shm/omnikube-* segments, so no process and no segment is left. `processes.json` in the
run folder lists every process with its pid, probe URL and log.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from omni_runtime.connectors.kind import RunningServer
from omni_runtime.connectors.registry import local_servers, sweep_leftovers
from omni_runtime.local.run import LocalProcess, LocalRun

__all__ = ["MAX_RESTARTS", "RESTART_WINDOW_S", "Supervisor"]

log = logging.getLogger(__name__)

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
MAX_RESTARTS = 5
RESTART_WINDOW_S = 300.0


@dataclass
class _Running:
    """A process of the run and what the supervisor knows of it."""

    process: LocalProcess
    popen: subprocess.Popen | None = None
    restarts: list[float] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.process.name


class Supervisor:
    """Starts, watches and stops the processes of one `LocalRun`; a context manager that stops them."""

    def __init__(self, run: LocalRun) -> None:
        self.run = run
        self.procs: list[_Running] = []
        self.servers: list[RunningServer] = []
        """The per-pipeline servers its connectors need (Mooncake's master), started before the stages."""

    def start(self, *, ready_timeout_s: float = 600.0, stop_requested: Callable[[], bool] | None = None) -> None:
        """Start every process and wait until all are ready; on failure stop what started and raise.
        `stop_requested` is polled while waiting: when it turns true, stop and raise KeyboardInterrupt."""
        run = self.run
        try:
            for server in local_servers(run.resolved):  # the resolver placed them on this machine
                self.servers.append(server.start(run.resolved, log_dir=run.run_dir))
            self.procs = [_Running(p) for p in run.processes()]
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
                "probe": p.process.probe,
                "log": str(p.process.log_path),
            }
            for p in self.procs
        ]
        info += [server.process_info() for server in self.servers]
        (self.run.run_dir / "processes.json").write_text(json.dumps(info, indent=2))

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
                if _probe(proc.process.probe):
                    waiting.remove(proc)
            if time.monotonic() > deadline:
                names = ", ".join(p.name for p in waiting) or "the router's view of the replicas"
                raise TimeoutError(f"not ready after {timeout_s:.0f}s: {names}; see their logs in {self.run.run_dir}")
            time.sleep(0.2)

    def _router_sees_all(self) -> bool:
        run = self.run
        try:
            with _NO_PROXY.open(f"http://{run.host}:{run.router_port}/health", timeout=2) as resp:
                ready = json.loads(resp.read()).get("ready_replicas", {})
        except (urllib.error.URLError, OSError, ValueError):
            return False
        return all(ready.get(stage, 0) >= count for stage, count in run.replicas.items())

    def _check_alive(self, proc: _Running) -> None:
        if proc.popen is not None and proc.popen.poll() is not None:
            log_path = proc.process.log_path
            raise RuntimeError(
                f"{proc.name} exited with code {proc.popen.returncode} while starting; "
                f"last lines of {log_path}:\n{_tail(log_path)}"
            )

    def _spawn(self, proc: _Running) -> None:
        with open(proc.process.log_path, "ab") as log_file:  # the child keeps its own descriptor
            proc.popen = subprocess.Popen(
                proc.process.cmd,
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
                log_path = proc.process.log_path
                raise RuntimeError(
                    f"{proc.name} keeps exiting (code {proc.popen.returncode}, {len(proc.restarts)} restarts "
                    f"in {RESTART_WINDOW_S:.0f}s); last lines of {log_path}:\n{_tail(log_path)}"
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
        timeout_s = self.run.drain_timeout_s + 5.0 if timeout_s is None else timeout_s
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
        while self.servers:
            self.servers.pop().stop()
        self.sweep()

    def sweep(self) -> list[str]:
        """Remove what stopped stages of this pipeline left on this machine (shm segments no live process
        owns); returns their names."""
        removed = sweep_leftovers(self.run.resolved.name)
        if removed:
            log.info("removed %d leftover(s) of stopped stages: %s", len(removed), ", ".join(removed))
        return removed

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
