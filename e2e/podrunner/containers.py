"""One container's life inside its pod: start, probes, exit, restart with the kubelet's back-off, stop.

Back-off follows the kubelet: the first restart is immediate, the next ones wait `base`, `2*base`, ... up to
`cap` (waiting reason CrashLoopBackOff meanwhile); a container that failed more than `2*cap` after its
previous failure starts over at zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from podrunner.downward import now
from podrunner.envs import ConfigError
from podrunner.probes import ProbeSettings, run_handler
from podrunner.sandbox import Process, SandboxError, StartError
from podrunner.volumes import VolumeError

if TYPE_CHECKING:
    from pathlib import Path

    import httpx

    from podrunner.sandbox import Sandbox

__all__ = ["Backoff", "ContainerHost", "ContainerRunner", "go_duration"]

log = logging.getLogger("omnikube.e2e.podrunner")


@dataclass(frozen=True)
class Backoff:
    base: float = 10.0
    cap: float = 300.0


class ContainerHost(Protocol):
    """What a `ContainerRunner` uses of the pod it runs in (podworker.PodWorker is one): declared here so that
    this module does not import podworker.py, which imports this one."""

    pod: dict
    has_init: bool
    sandbox: Sandbox

    @property
    def http(self) -> httpx.AsyncClient: ...

    @property
    def backoff(self) -> Backoff: ...

    @property
    def pod_ip(self) -> str: ...

    def changed(self) -> None: ...

    def event(self, kind: str, reason: str, message: str) -> None: ...

    def log_path(self, container: str) -> Path: ...

    def grace_seconds(self) -> float: ...

    def exec_env(self, container: str) -> dict[str, str]: ...

    async def resolve(self, spec: dict) -> tuple[list[str], dict[str, str], str, list[dict]]: ...

    def cpus_for(self, spec: dict) -> list[int]: ...

    def termination_file(self, container: str) -> Path: ...


def go_duration(seconds: float) -> str:
    """Seconds as Go prints a time.Duration: 10s, 1m20s, 5m0s."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m}m{s}s"
    h, m = divmod(m, 60)
    return f"{h}h{m}m{s}s"


class ContainerRunner:
    def __init__(self, worker: ContainerHost, spec: dict, *, init: bool = False, sidecar: bool = False) -> None:
        self.worker = worker
        self.spec = spec
        self.name: str = spec["name"]
        self.init = init
        self.sidecar = sidecar
        self.restart_count = 0
        self.state: dict[str, Any] = {
            "waiting": {"reason": "PodInitializing" if not init and worker.has_init else "ContainerCreating"}
        }
        self.last_state: dict[str, Any] = {}
        self._last_terminated: dict[str, Any] | None = None
        self.ready = False
        self.started = False
        self.container_id = ""
        self.process: Process | None = None
        self.done = False  # ended and will not run again
        self.exit_code: int | None = None
        self._stop = asyncio.Event()
        self._kill_message = ""
        self._attempts = 0
        self._bo: float | None = None
        self._bo_updated = 0.0
        self.log_starts: list[int] = []  # offset in the log file where each run's output begins (kubectl logs)

    # -- status --

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "image": self.spec.get("image") or "host",
            "imageID": "",
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.container_id:
            out["containerID"] = f"podrunner://{self.container_id}"
        return out

    def _set(self, state: dict[str, Any]) -> None:
        self.state = state
        if "terminated" not in state:
            self.last_state = {"terminated": self._last_terminated} if self._last_terminated else {}
        self.worker.changed()

    def _waiting(self, reason: str, message: str = "") -> None:
        self.ready = self.started = False
        self._set({"waiting": {"reason": reason, **({"message": message} if message else {})}})

    def _terminated(self, code: int, reason: str, message: str, started_at: str) -> None:
        info = {
            "exitCode": code,
            "reason": reason,
            "startedAt": started_at,
            "finishedAt": now(),
            "containerID": f"podrunner://{self.container_id}",
        }
        if code >= 128 and code - 128 < 65:
            info["signal"] = code - 128
        if message:
            info["message"] = message
        self.last_state = {"terminated": self._last_terminated} if self._last_terminated else {}
        self._last_terminated = info
        self.ready = self.started = False
        self.exit_code = code
        self._set({"terminated": info})

    # -- life --

    async def run(self) -> int | None:
        """Run (and restart) the container until it will not run again or `stop` is called; its last exit code."""
        code: int | None = None
        while not self._stop.is_set():
            try:
                argv, env, cwd, mounts = await self.worker.resolve(self.spec)
            except (ConfigError, VolumeError) as e:
                self._waiting("CreateContainerConfigError", str(e))
                self.worker.event("Warning", "Failed", f"Error: {e}")
                if await self._sleep(2.0):
                    break
                continue
            code = await self._run_once(argv, env, cwd, mounts)
            if code is None or self._stop.is_set():
                break
            if not self._should_restart(code):
                self.done = True
                break
            delay = self._next_delay()
            if delay > 0:
                meta = self.worker.pod["metadata"]
                msg = (
                    f"back-off {go_duration(delay)} restarting failed container={self.name} "
                    f"pod={meta['name']}_{meta['namespace']}({meta['uid']})"
                )
                self._waiting("CrashLoopBackOff", msg)
                self.worker.event(
                    "Warning",
                    "BackOff",
                    "Back-off restarting failed container "
                    f"{self.name} in pod {meta['name']}_{meta['namespace']}({meta['uid']})",
                )
                if await self._sleep(delay):
                    break
        return code

    async def _run_once(self, argv: list[str], env: dict[str, str], cwd: str, mounts: list[dict]) -> int | None:
        self.container_id = secrets.token_hex(32)
        self._kill_message = ""
        started_at = now()
        log_file = self.worker.log_path(self.name)
        self.log_starts.append(log_file.stat().st_size if log_file.exists() else 0)
        try:
            process = await self.worker.sandbox.start(
                self.name, argv=argv, env=env, cwd=cwd, mounts=mounts, log_path=str(log_file),
                cpus=self.worker.cpus_for(self.spec),
            )  # fmt: skip
        except StartError as e:
            self._count_attempt()
            self._terminated(128, "StartError", str(e), started_at)
            self.worker.event("Warning", "Failed", f"Error: {e}")
            return 128
        except SandboxError:
            return None
        self.process = process
        self._count_attempt()
        self._set({"running": {"startedAt": started_at}})
        self.worker.event("Normal", "Started", f"Started container {self.name}")
        probing = asyncio.create_task(self._probe(process))
        try:
            code = await asyncio.shield(process.exited)
        finally:
            probing.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await probing
        self.process = None
        reason = "Completed" if code == 0 else "Error"
        self._terminated(code, reason, self._termination_message(code) or self._kill_message, started_at)
        return code

    def _termination_message(self, code: int) -> str:
        """What the container wrote to its terminationMessagePath (as the kubelet: at most 4096 bytes),
        else, with policy FallbackToLogsOnError and a failure, the end of its log (80 lines, 2048 bytes)."""
        path = self.worker.termination_file(self.name)
        try:
            with open(path, "rb") as f:
                text = f.read(4096).decode(errors="replace")
        except OSError:
            text = ""
        if text or code == 0 or self.spec.get("terminationMessagePolicy") != "FallbackToLogsOnError":
            return text
        try:
            with open(self.worker.log_path(self.name), "rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - 2048))
                tail = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(tail.splitlines()[-80:])

    def _count_attempt(self) -> None:
        """restartCount grows when the new container appears (with its state), as under the kubelet."""
        if self._attempts:
            self.restart_count += 1
        self._attempts += 1

    def _should_restart(self, code: int) -> bool:
        policy = self.worker.pod["spec"].get("restartPolicy", "Always")
        if self.sidecar:
            return True
        if self.init:
            return code != 0 and policy != "Never"
        return policy == "Always" or (policy == "OnFailure" and code != 0)

    def _next_delay(self) -> float:
        cfg: Backoff = self.worker.backoff
        t = time.monotonic()
        if self._bo is None or t - self._bo_updated > 2 * cfg.cap:
            self._bo, self._bo_updated = cfg.base, t
            return 0.0
        delay = self._bo
        self._bo, self._bo_updated = min(self._bo * 2, cfg.cap), t
        return delay

    async def _sleep(self, seconds: float) -> bool:
        """Sleep unless stopped; True when stopped."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)
        return self._stop.is_set()

    async def stop(self, grace: float) -> None:
        """No more restarts; run preStop, SIGTERM, and SIGKILL after `grace` seconds if still running."""
        self._stop.set()
        process = self.process
        if process is None or process.exited.done():
            return
        await self._kill(process, grace, run_pre_stop=True)

    async def _kill(self, process: Process, grace: float, *, run_pre_stop: bool = False) -> None:
        deadline = time.monotonic() + grace
        pre_stop = (self.spec.get("lifecycle") or {}).get("preStop")
        if run_pre_stop and pre_stop and grace > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._handler(pre_stop, grace), grace)
        with contextlib.suppress(SandboxError):
            await self.worker.sandbox.signal(self.name, signal.SIGTERM)
        remaining = max(deadline - time.monotonic(), 0.0 if grace <= 0 else 2.0 if pre_stop else 0.0)
        try:
            await asyncio.wait_for(asyncio.shield(process.exited), remaining)
        except asyncio.TimeoutError:
            with contextlib.suppress(SandboxError):
                await self.worker.sandbox.signal(self.name, signal.SIGKILL)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(process.exited), 10)

    # -- probes and hooks --

    async def _handler(self, handler: dict, timeout: float) -> tuple[bool, str]:
        async def exec_fn(argv: list[str], t: float) -> tuple[int, str]:
            return await self.worker.sandbox.exec(self.name, argv, self.worker.exec_env(self.name), t)

        return await run_handler(
            handler,
            pod_ip=self.worker.pod_ip,
            container=self.spec,
            http=self.worker.http,
            exec_fn=exec_fn,
            timeout=timeout,
        )

    async def _probe(self, process: Process) -> None:
        post_start = (self.spec.get("lifecycle") or {}).get("postStart")
        if post_start:
            ok, msg = await self._handler(post_start, 30)
            if not ok:
                self.worker.event("Warning", "FailedPostStartHook", msg)
                self._kill_message = f"PostStartHook failed: {msg}"
                await self._kill(process, self.worker.grace_seconds())
                return
        startup = self.spec.get("startupProbe")
        if startup and not await self._probe_until(startup, "Startup", process):
            return
        self.started = True
        if not self.spec.get("readinessProbe"):
            self.ready = True
        self.worker.changed()
        tasks = []
        if self.spec.get("readinessProbe"):
            tasks.append(asyncio.create_task(self._readiness(self.spec["readinessProbe"])))
        if self.spec.get("livenessProbe"):
            tasks.append(
                asyncio.create_task(self._probe_until(self.spec["livenessProbe"], "Liveness", process, forever=True))
            )
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()

    async def _probe_until(self, probe: dict, kind: str, process: Process, *, forever: bool = False) -> bool:
        """Startup: until the first success (True). Liveness (`forever`): until failureThreshold failures in a row.
        Either way, that many failures kill the container (False)."""
        cfg = ProbeSettings.of(probe)
        await asyncio.sleep(cfg.initial_delay)
        failures = 0
        while True:
            ok, msg = await self._handler(probe, cfg.timeout)
            if ok:
                failures = 0
                if not forever:
                    return True
            else:
                failures += 1
                self.worker.event("Warning", "Unhealthy", f"{kind} probe failed: {msg}")
                if failures >= cfg.failure_threshold:
                    self._kill_message = f"{kind} probe failed {failures} times: {msg}"
                    self.worker.event(
                        "Normal", "Killing", f"Container {self.name} failed {kind.lower()} probe, will be restarted"
                    )
                    grace = probe.get("terminationGracePeriodSeconds", self.worker.grace_seconds())
                    await self._kill(process, float(grace))
                    return False
            await asyncio.sleep(cfg.period)

    async def _readiness(self, probe: dict) -> None:
        cfg = ProbeSettings.of(probe)
        await asyncio.sleep(cfg.initial_delay)
        successes = failures = 0
        while True:
            ok, msg = await self._handler(probe, cfg.timeout)
            if ok:
                successes, failures = successes + 1, 0
                if not self.ready and successes >= cfg.success_threshold:
                    self.ready = True
                    self.worker.changed()
            else:
                successes, failures = 0, failures + 1
                self.worker.event("Warning", "Unhealthy", f"Readiness probe failed: {msg}")
                if self.ready and failures >= cfg.failure_threshold:
                    self.ready = False
                    self.worker.changed()
            await asyncio.sleep(cfg.period)
