"""Start and stop a Mooncake master plus its HTTP metadata server (local mode and tests; in a cluster
the operator runs `mooncake_master` in a pod of its own, builders/mooncake.py).

Recipe (mooncake-transfer-engine 0.3.13):

    <site-packages>/mooncake/mooncake_master --rpc_address=HOST --rpc_port=P
        --metrics_host=HOST --metrics_port=M --enable_http_metadata_server=false --logtostderr
    python -m mooncake.http_metadata_server --host HOST --port Q

Clients then use `master_server_addr="HOST:P"` and `metadata_server="http://HOST:Q/metadata"`.
The master can serve metadata itself (`embedded_metadata=True`: `--enable_http_metadata_server=true
--http_metadata_server_port=Q`), but in 0.3.13 that server binds every interface whatever
`--http_metadata_server_host` says, so the separate Python server is the default: it honours `host`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["MooncakeMaster", "MooncakeMasterError", "find_master_binary", "free_port", "metadata_url"]


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class MooncakeMasterError(RuntimeError):
    """The master or metadata server did not start, or exited."""


def find_master_binary() -> str:
    """The real `mooncake_master` executable shipped in the `mooncake` package (not the Python shim)."""
    try:
        import mooncake
    except ImportError as e:
        raise MooncakeMasterError(
            "the 'mooncake' package is not installed; install mooncake-transfer-engine "
            "(or mooncake-transfer-engine-non-cuda on machines without CUDA)"
        ) from e
    candidate = Path(mooncake.__file__).with_name("mooncake_master")
    if candidate.is_file():
        return str(candidate)
    found = shutil.which("mooncake_master")
    if found is None:
        raise MooncakeMasterError(f"no mooncake_master binary next to {mooncake.__file__} or on PATH")
    return found


def metadata_url(host: str, port: int) -> str:
    """The URL clients reach an HTTP metadata server at."""
    return f"http://{host}:{port}/metadata"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for tests and local mode)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MooncakeMaster:
    """A running Mooncake master; use as `with` / `async with`, or call start()/stop()."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        rpc_port: int = 50051,
        metadata_port: int = 8080,
        metrics_port: int | None = None,
        embedded_metadata: bool = False,
        binary: str | None = None,
        extra_args: tuple[str, ...] = (),
        log_dir: str | None = None,
        ready_timeout: float = 30.0,
    ) -> None:
        self.host = host
        self.rpc_port = rpc_port
        self.metadata_port = metadata_port
        self.metrics_port = metrics_port if metrics_port is not None else free_port(host)
        self.embedded_metadata = embedded_metadata
        self.binary = binary
        self.extra_args = tuple(extra_args)
        self.log_dir = log_dir
        self._own_log_dir = log_dir is None
        self.ready_timeout = ready_timeout
        self.master: subprocess.Popen | None = None
        self.metadata: subprocess.Popen | None = None
        self._logs: list = []

    @property
    def master_address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return metadata_url(self.host, self.metadata_port)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in (self.master, self.metadata) if p is not None]

    def process_info(self) -> dict[str, Any]:
        """Its entry in a local run's `processes.json`."""
        return {
            "name": "mooncake master",
            "pids": self.pids,
            "master": self.master_address,
            "metadata": self.metadata_server,
            "metrics": f"http://{self.host}:{self.metrics_port}/metrics",
        }

    def master_command(self) -> list[str]:
        cmd = [
            self.binary or find_master_binary(),
            f"--rpc_address={self.host}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            "--logtostderr",
        ]
        if self.embedded_metadata:
            cmd += [
                "--enable_http_metadata_server=true",
                f"--http_metadata_server_host={self.host}",
                f"--http_metadata_server_port={self.metadata_port}",
            ]
        else:
            cmd.append("--enable_http_metadata_server=false")
        return cmd + list(self.extra_args)

    def metadata_command(self) -> list[str]:
        return [
            sys.executable, "-m", "mooncake.http_metadata_server",
            "--host", self.host, "--port", str(self.metadata_port), "--log-level", "WARNING",
        ]  # fmt: skip

    # -- sync ----------------------------------------------------------------------------------

    def start(self) -> MooncakeMaster:
        """Start the processes and return once the RPC port and the metadata server answer."""
        if self.master is not None:
            return self
        try:
            self.master = self._spawn("master", self.master_command())
            if not self.embedded_metadata:
                self.metadata = self._spawn("metadata", self.metadata_command())
            deadline = time.monotonic() + self.ready_timeout
            while not self._ready():
                self._check_alive()
                if time.monotonic() > deadline:
                    raise MooncakeMasterError(
                        f"mooncake master not ready after {self.ready_timeout:.0f}s on {self.master_address} "
                        f"(metadata {self.metadata_server}); {self._log_tail()}"
                    )
                time.sleep(0.05)
            time.sleep(0.2)  # a port already taken by someone else answers too: make sure ours still run
            self._check_alive()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop both processes (SIGTERM, then SIGKILL after `timeout`) and reap them."""
        for proc in (self.metadata, self.master):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in (self.metadata, self.master):
            if proc is None:
                continue
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for f in self._logs:
            f.close()
        self._logs.clear()
        if self._own_log_dir and self.log_dir is not None:
            shutil.rmtree(self.log_dir, ignore_errors=True)
            self.log_dir = None
        self.metadata = None
        self.master = None

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- async ---------------------------------------------------------------------------------

    async def astart(self) -> MooncakeMaster:
        return await asyncio.to_thread(self.start)

    async def astop(self) -> None:
        await asyncio.to_thread(self.stop)

    async def __aenter__(self) -> MooncakeMaster:
        return await self.astart()

    async def __aexit__(self, *exc: object) -> None:
        await self.astop()

    # -- helpers -------------------------------------------------------------------------------

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log_dir = self.log_dir or tempfile.mkdtemp(prefix="omnikube-mooncake-")
        self.log_dir = log_dir
        log = open(os.path.join(log_dir, f"{name}.log"), "ab")  # noqa: SIM115 (closed in stop)
        self._logs.append(log)
        return subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def _check_alive(self) -> None:
        for proc in (self.master, self.metadata):
            if proc is not None and proc.poll() is not None:
                raise MooncakeMasterError(
                    f"{_program(proc)} exited with code {proc.returncode} while starting (are ports "
                    f"{self.rpc_port}, {self.metadata_port}, {self.metrics_port} free?); {self._log_tail()}"
                )

    def _ready(self) -> bool:
        if not _port_open(self.host, self.rpc_port):
            return False
        try:
            _NO_PROXY.open(f"{self.metadata_server}?key=omnikube-ready-probe", timeout=1).close()
        except urllib.error.HTTPError:
            return True  # 404 for the unknown key: the server answers
        except OSError:
            return False
        return True

    def _log_tail(self) -> str:
        tails = []
        for name in ("master", "metadata"):
            path = os.path.join(self.log_dir or "", f"{name}.log")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    text = f.read()[-1500:].decode(errors="replace").strip()
                tails.append(f"{name} log ({path}): ...{text}")
        return "; ".join(tails) or "no logs"


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _program(proc: subprocess.Popen) -> str:
    """The program a process runs, for messages (`args` may be a string or a list)."""
    args = proc.args
    return str(args[0] if isinstance(args, list | tuple) else args)
