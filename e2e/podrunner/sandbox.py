"""The runner's handle on one pod agent (see agent.py): spawn it, talk JSON lines, map its events to futures.

Process tree of a pod, host view:

    runner ─ unshare (host PID ns; in the pod's net/mount/IPC/UTS namespaces)
               └─ agent.py              PID 1 of the pod's PID namespace
                    ├─ container a      PID 1 of a PID namespace of its own, own mount namespace
                    └─ container b      ...

`setpriv --pdeathsig KILL` ties `unshare` to the runner thread that started it and `--kill-child` ties
the agent to `unshare`: if the runner dies, even by SIGKILL, the pod's processes die with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Process", "Sandbox", "SandboxError", "StartError"]

log = logging.getLogger("omnikube.e2e.podrunner")

AGENT = Path(__file__).resolve().parent / "agent.py"
NAMESPACES = ["--mount", "--ipc", "--uts", "--pid"]


class SandboxError(RuntimeError):
    pass


class StartError(RuntimeError):
    """The container's process could not be started (exec failed, a mount failed)."""


@dataclass
class Process:
    name: str
    pid: int  # in the pod's PID namespace
    exited: asyncio.Future = field(repr=False)  # -> exit code (128+signal when killed)


class Sandbox:
    def __init__(self, agent_log: Path, *, host_network: bool = False) -> None:
        self.agent_log = agent_log
        self.host_network = host_network
        self.proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task | None = None
        self._waiters: dict[str, asyncio.Future] = {}
        self.processes: dict[str, Process] = {}
        self.lost = asyncio.Event()

    @property
    def netns_pid(self) -> int:
        """A host PID inside the pod's network namespace (the `unshare` process)."""
        assert self.proc is not None
        return self.proc.pid

    def agent_pid(self) -> int | None:
        return _children(self.netns_pid)[0] if self.proc and _children(self.netns_pid) else None

    async def create(self, timeout: float = 30) -> None:
        argv = [
            "setpriv",
            "--pdeathsig",
            "KILL",
            "unshare",
            *NAMESPACES,
            *([] if self.host_network else ["--net"]),
            "--fork",
            "--kill-child=KILL",
            "--propagation",
            "slave",
            sys.executable,
            "-E",
            "-s",
            "-S",
            str(AGENT),
        ]
        with open(self.agent_log, "ab") as errlog:
            self.proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=errlog,
                start_new_session=True,
                limit=64 << 20,
            )
        self._reader = asyncio.create_task(self._read_events())
        await self._wait("hello", timeout)

    async def setup(self, request: dict, timeout: float = 60) -> None:
        await self._send({"op": "setup", **request})
        reply = await self._wait("setup", timeout)
        if reply["event"] != "ready":
            raise SandboxError(f"pod sandbox setup failed: {reply.get('message')}")

    async def start(
        self,
        name: str,
        *,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        log_path: str,
        mounts: list[dict],
        cpus: list[int] | None = None,
        timeout: float = 60,
    ) -> Process:
        """Start container `name`; `cpus`, when given, is the CPU affinity of its process."""
        await self._send(
            {
                "op": "start", "name": name, "argv": argv, "env": env, "cwd": cwd, "log": log_path,
                "mounts": mounts, "cpus": cpus,
            }
        )  # fmt: skip
        reply = await self._wait(f"start:{name}", timeout)
        if reply["event"] != "started":
            raise StartError(reply.get("message", "start failed"))
        return reply["process"]

    async def signal(self, name: str, sig: int) -> None:
        if name in self.processes:
            await self._send({"op": "signal", "name": name, "signal": int(sig)})

    def host_pid(self, name: str) -> int | None:
        """Host PID of container `name`'s PID 1 (for nsenter), found through NSpid of the agent's children."""
        process, agent = self.processes.get(name), self.agent_pid()
        if process is None or agent is None:
            return None
        for child in _children(agent):
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{child}/status").read_text().splitlines():
                    if line.startswith("NSpid:"):
                        ids = [int(x) for x in line.split()[1:]]
                        if len(ids) >= 2 and ids[1] == process.pid:
                            return child
        return None

    async def exec(self, name: str, argv: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
        """Run `argv` inside container `name` (its namespaces, root and working folder), like `kubectl exec`."""
        pid = self.host_pid(name)
        if pid is None:
            return 126, f"container {name} is not running"
        proc = await asyncio.create_subprocess_exec(
            "nsenter",
            "-t",
            str(pid),
            "-m",
            "-u",
            "-i",
            "-p",
            *([] if self.host_network else ["-n"]),
            "-r",
            "-w",
            "--",
            *argv,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            return -1, f"command timed out after {timeout}s"
        return proc.returncode or 0, out.decode(errors="replace")

    async def shutdown(self, timeout: float = 10) -> None:
        """Kill every container and end the agent: the pod's namespaces and mounts go with it."""
        if self.proc is None:
            return
        if self.proc.returncode is None:
            with contextlib.suppress(Exception):
                await self._send({"op": "shutdown"})
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                await self.proc.wait()
        if self._reader:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._reader, 5)

    # -- protocol --

    async def _send(self, message: dict) -> None:
        if self.proc is None or self.proc.stdin is None or self.lost.is_set():
            raise SandboxError("the pod agent is gone")
        self.proc.stdin.write((json.dumps(message) + "\n").encode())
        await self.proc.stdin.drain()

    async def _wait(self, key: str, timeout: float) -> dict:
        fut = self._waiters.setdefault(key, asyncio.get_running_loop().create_future())
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            raise SandboxError(f"the pod agent did not answer {key} in {timeout}s") from None
        finally:
            if fut.done():
                self._waiters.pop(key, None)

    def _resolve(self, key: str, event: dict) -> None:
        fut = self._waiters.setdefault(key, asyncio.get_running_loop().create_future())
        if not fut.done():
            fut.set_result(event)

    async def _read_events(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        try:
            while line := await self.proc.stdout.readline():
                event = json.loads(line)
                kind = event["event"]
                if kind in ("ready", "setup_failed"):
                    self._resolve("setup", event)
                elif kind in ("started", "start_failed"):
                    if kind == "started":  # registered here, so that an exit right after is not missed
                        process = Process(event["name"], event["pid"], asyncio.get_running_loop().create_future())
                        self.processes[event["name"]] = event["process"] = process
                    self._resolve(f"start:{event['name']}", event)
                elif kind == "exited":
                    process = self.processes.get(event["name"])
                    if process and process.pid == event["pid"]:
                        del self.processes[event["name"]]
                        if not process.exited.done():
                            process.exited.set_result(event["exit_code"])
                else:
                    self._resolve(kind, event)
        finally:
            self.lost.set()
            for process in self.processes.values():
                if not process.exited.done():
                    process.exited.set_result(137)
            self.processes.clear()
            for fut in list(self._waiters.values()):
                if not fut.done():
                    fut.set_result({"event": "lost", "message": "the pod agent exited"})


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
