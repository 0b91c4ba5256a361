"""The pod agent: PID 1 of one pod, holding the pod's namespaces and starting its containers.

The runner starts it as

    setpriv --pdeathsig KILL unshare --net --mount --ipc --uts --pid --fork --kill-child=KILL \
        --propagation slave  python -E -s -S agent.py

so it is PID 1 of a fresh PID namespace and lives in the pod's own network, mount, IPC and UTS namespaces.
It speaks JSON lines: requests on stdin, events on stdout. When it exits, for whatever reason (asked to, its
stdin closed, the runner killed), the kernel kills every process of the pod and frees its namespaces, so
nothing of the pod outlives it: no process, no mount (all of them live only in the pod's mount namespace)
and no network namespace (nothing else holds it; its veth goes with it).

Requests: {"op": "setup", ...} once, then {"op": "start", ...}, {"op": "signal", ...}, {"op": "shutdown"}.
Events: hello, ready | setup_failed, started | start_failed, exited, bye.

Standard library only: it runs with `-S` (no site-packages) for a fast start.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import sys
import traceback

import linux
from relay import relay

OLD_ROOT = "/.oldroot"


def send(event: str, **fields: object) -> None:
    os.write(1, (json.dumps({"event": event, **fields}) + "\n").encode())


# --- the pod's root file system -------------------------------------------------------------------


class RootBuilder:
    """A tmpfs root that mirrors the host's `/` entry by entry (bind mounts), so that mount points which
    do not exist on the host (`/models`, `/etc/omnikube`) can be created without touching the host."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.owned: set[str] = {"/"}  # directories on tmpfs we own (after pivot_root): mkdir is safe there

    def build(self) -> None:
        linux.mount("tmpfs", self.root, "tmpfs", linux.MS_NOSUID, "mode=755")
        for name in sorted(os.listdir("/")):
            host, target = "/" + name, os.path.join(self.root, name)
            if name == "proc":
                os.mkdir(target, 0o555)
                linux.mount("proc", target, "proc", linux.MS_NOSUID | linux.MS_NODEV)
            else:
                _mirror_entry(host, target)
        os.mkdir(os.path.join(self.root, OLD_ROOT.lstrip("/")), 0o700)
        linux.pivot_root(self.root, os.path.join(self.root, OLD_ROOT.lstrip("/")))
        os.chdir("/")
        # The bind of the host folder that holds `root` copied our own tmpfs into itself: drop that copy.
        if os.path.ismount(self.root):
            linux.umount(self.root, linux.MNT_DETACH)

    def ensure(self, path: str, is_file: bool) -> None:
        """Make `path` exist in the pod's root as an empty folder (or file) to mount onto."""
        current = "/"
        parts = [p for p in path.split("/") if p]
        for i, part in enumerate(parts):
            nxt = os.path.join(current, part)
            last = i == len(parts) - 1
            if os.path.islink(nxt):
                nxt = os.path.realpath(nxt)  # absolute links resolve inside the pod's root now
            if os.path.lexists(nxt):
                current = nxt
                continue
            if not self._is_owned(current):
                self._mirror_dir(current)
            if last and is_file:
                open(nxt, "a").close()
            else:
                os.mkdir(nxt, 0o755)
                self.owned.add(nxt)
            current = nxt

    def _is_owned(self, path: str) -> bool:
        return path in self.owned

    def _mirror_dir(self, path: str) -> None:
        """Replace the bind mount at (or above) `path` by a tmpfs holding binds of its entries."""
        source = OLD_ROOT + path
        mode = stat.S_IMODE(os.stat(source).st_mode)
        linux.mount("tmpfs", path, "tmpfs", linux.MS_NOSUID, f"mode={mode:o}")
        for name in sorted(os.listdir(source)):
            _mirror_entry(os.path.join(source, name), os.path.join(path, name))
        self.owned.add(path)

    def mount_shm(self, shm_size: int | None) -> None:
        """The pod's own /dev/shm, mounted after the mount points: making one under /dev (the
        container's /dev/termination-log) replaces /dev by a mirror of the host's, shm included."""
        if os.path.isdir("/dev/shm"):
            opts = "mode=1777" + (f",size={shm_size}" if shm_size else ",size=64m")
            linux.mount("shm", "/dev/shm", "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, opts)

    def finish(self) -> None:
        linux.umount(OLD_ROOT, linux.MNT_DETACH)
        os.rmdir(OLD_ROOT)


def _mirror_entry(host: str, target: str) -> None:
    st = os.lstat(host)
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(host), target)
    elif stat.S_ISDIR(st.st_mode):
        os.mkdir(target, stat.S_IMODE(st.st_mode))
        linux.mount(host, target, None, linux.MS_BIND | linux.MS_REC)
    elif stat.S_ISREG(st.st_mode) or stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        open(target, "a").close()
        linux.mount(host, target, None, linux.MS_BIND)
    # sockets and fifos at the top of a folder are left out


def setup(req: dict) -> None:
    if req.get("hostname"):
        linux.sethostname(req["hostname"])
    builder = RootBuilder(req["root"])
    builder.build()
    for mp in sorted(req.get("mountpoints", []), key=lambda m: m["path"].count("/")):
        builder.ensure(mp["path"], mp.get("file", False))
    builder.mount_shm(req.get("shm_size"))
    builder.finish()
    for vol in req.get("memory_volumes", []):
        opts = "mode=1777" + (f",size={vol['size']}" if vol.get("size") else "")
        linux.mount("tmpfs", vol["path"], "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, opts)


# --- containers -----------------------------------------------------------------------------------


class Agent:
    def __init__(self) -> None:
        self.containers: dict[str, int] = {}  # name -> pid (in the pod's PID namespace)
        self.pids: dict[int, str] = {}
        self.own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY)
        self.stopping = False
        self.proxies: list[asyncio.AbstractServer] = []

    def start(self, req: dict) -> None:
        name = req["name"]
        if name in self.containers:
            send("start_failed", name=name, message=f"container {name} is still running")
            return
        errr, errw = os.pipe2(os.O_CLOEXEC)
        # Each container gets a PID namespace of its own (as under a real runtime): its command is PID 1
        # there, and killing that PID 1 kills everything the container started.
        linux.unshare(linux.CLONE_NEWPID)
        try:
            pid = os.fork()
        except BaseException:
            linux.setns(self.own_pidns, linux.CLONE_NEWPID)
            raise
        if pid == 0:
            os.close(errr)
            _exec_container(req, errw)  # never returns
        linux.setns(self.own_pidns, linux.CLONE_NEWPID)
        os.close(errw)
        with os.fdopen(errr, "rb") as f:
            failure = f.read()
        if failure:
            self.pids[pid] = ""  # reaped silently
            send("start_failed", name=name, message=failure.decode(errors="replace"))
            return
        self.containers[name] = pid
        self.pids[pid] = name
        send("started", name=name, pid=pid)

    def signal(self, req: dict) -> None:
        pid = self.containers.get(req["name"])
        if pid:
            try:
                os.kill(pid, req["signal"])
            except ProcessLookupError:
                pass

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            name = self.pids.pop(pid, None)
            if name:
                self.containers.pop(name, None)
                code = os.waitstatus_to_exitcode(status)
                send(
                    "exited",
                    name=name,
                    pid=pid,
                    exit_code=code if code >= 0 else 128 - code,
                    signal=-code if code < 0 else 0,
                )

    async def proxy(self, listen_host: str, listen_port: int, unix: str) -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await relay(reader, writer, lambda: asyncio.open_unix_connection(unix))

        self.proxies.append(await asyncio.start_server(handle, listen_host, listen_port))

    def kill_all(self) -> None:
        for pid in list(self.containers.values()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _exec_container(req: dict, errw: int) -> None:
    """In the forked child (PID 1 of the container's PID namespace): mounts, log, cwd, then exec."""
    try:
        signal.set_wakeup_fd(-1)
        os.setsid()
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        linux.unshare(linux.CLONE_NEWNS)
        linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
        linux.mount("proc", "/proc", "proc", linux.MS_NOSUID | linux.MS_NODEV)
        # Every host path is opened before the first mount: a volume mounted early (an emptyDir on /tmp)
        # may cover the host path of a later mount's source (the pod folder under /tmp holds /etc/hosts and
        # the volumes) or of the log. The mounts then take their source through /proc/self/fd.
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        mounts = [(m, os.open(m["source"], os.O_PATH | os.O_CLOEXEC)) for m in req.get("mounts", [])]
        for m, fd in sorted(mounts, key=lambda mf: mf[0]["target"].rstrip("/").count("/")):
            src, dst = f"/proc/self/fd/{fd}", m["target"]
            if not os.path.lexists(dst):  # inside another volume, as runc does
                if os.path.isdir(src):
                    os.makedirs(dst, exist_ok=True)
                else:
                    os.makedirs(os.path.dirname(dst), exist_ok=True)
                    open(dst, "a").close()
            linux.mount(src, dst, None, linux.MS_BIND | linux.MS_REC)
            if m.get("readonly"):
                linux.mount(None, dst, None, linux.MS_BIND | linux.MS_REMOUNT | linux.MS_RDONLY)
        cwd = req.get("cwd") or "/"
        os.makedirs(cwd, exist_ok=True)
        os.chdir(cwd)
        for _, fd in mounts:
            os.close(fd)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        if req.get("cpus"):
            # The CPUs the runner gave the container (cpus.py); everything it starts inherits them.
            os.sched_setaffinity(0, req["cpus"])
        argv = req["argv"]
        if not argv:
            raise RuntimeError(
                "no command given: set the container's command (the host is the image; it has no ENTRYPOINT)"
            )
        try:
            os.execvpe(argv[0], argv, req["env"])
        except FileNotFoundError:
            raise RuntimeError(
                f'exec: "{argv[0]}": executable file not found in $PATH (PATH={req["env"].get("PATH", "")})'
            ) from None
    except BaseException as e:  # noqa: BLE001 - everything goes back to the runner
        msg = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
        try:
            os.write(errw, msg.encode())
        finally:
            os._exit(127)


async def main() -> None:
    loop = asyncio.get_running_loop()
    agent = Agent()
    reader = asyncio.StreamReader(limit=64 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    done = asyncio.Event()
    loop.add_signal_handler(signal.SIGCHLD, agent.reap)
    loop.add_signal_handler(signal.SIGTERM, done.set)
    send("hello")
    reading = asyncio.ensure_future(_serve(agent, reader))
    stopped = asyncio.ensure_future(done.wait())
    await asyncio.wait([reading, stopped], return_when=asyncio.FIRST_COMPLETED)
    agent.kill_all()
    deadline = loop.time() + 5
    while agent.containers and loop.time() < deadline:
        await asyncio.sleep(0.02)
        agent.reap()
    send("bye")


async def _serve(agent: Agent, reader: asyncio.StreamReader) -> None:
    while line := await reader.readline():
        req = json.loads(line)
        op = req["op"]
        if op == "setup":
            try:
                setup(req)
                for p in req.get("proxies", []):
                    await agent.proxy(p["listen_host"], p["listen_port"], p["unix"])
            except Exception as e:  # noqa: BLE001
                send("setup_failed", message=f"{e}\n{traceback.format_exc()}")
                continue
            send("ready")
        elif op == "start":
            agent.start(req)
        elif op == "signal":
            agent.signal(req)
        elif op == "shutdown":
            return


if __name__ == "__main__":
    asyncio.run(main())
