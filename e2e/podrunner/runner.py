"""The pod runner: a minimal kubelet that runs the pods bound to its nodes as real local processes.

    python e2e/podrunner/runner.py --kubeconfig K --node runner-node-0 [--node runner-node-1] --state-dir D

`PodRunner` is the same thing as a context manager (it runs its event loop in a thread of its own), with a
small API for tests: `logs()`, `exec()`, `sandbox_info()`. See README.md beside this file for the design.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:  # run as a script: make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from podrunner.containers import Backoff  # noqa: E402
from podrunner.dns import ServiceDns  # noqa: E402
from podrunner.events import EventRecorder  # noqa: E402
from podrunner.kube import Kube  # noqa: E402
from podrunner.kubelet import KubeletServer  # noqa: E402
from podrunner.logs import log_path, read_log  # noqa: E402
from podrunner.network import Network  # noqa: E402
from podrunner.node import RUNNER_LABEL, RUNNER_TAINT, NodeConfig, NodeKeeper  # noqa: E402
from podrunner.podworker import ApiProxy, PodWorker, Services  # noqa: E402
from podrunner.relay import relay  # noqa: E402

__all__ = ["NodeConfig", "PodRunner", "RUNNER_LABEL", "RUNNER_TAINT", "main"]

log = logging.getLogger("omnikube.e2e.podrunner")

REPO = Path(__file__).resolve().parents[2]
TOOLS = ("ip", "nsenter", "unshare", "setpriv")


def default_venv_bin() -> Path | None:
    """The venv of the repository the runner comes from, else the one running it."""
    if (REPO / ".venv" / "bin").is_dir():
        return REPO / ".venv" / "bin"
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / "bin"
    return None


class PodRunner:
    def __init__(
        self,
        kubeconfig: str | Path,
        nodes: list[NodeConfig | str],
        state_dir: str | Path,
        *,
        subnet: str | None = None,
        backoff: Backoff | None = None,
        venv_bin: Path | None = None,
        api_proxy: bool = True,
        delete_nodes: bool = True,
        volume_sync_s: float = 60.0,
    ) -> None:
        self.kubeconfig = str(kubeconfig)
        self.nodes = [n if isinstance(n, NodeConfig) else NodeConfig(n) for n in nodes]
        self.state_dir = Path(state_dir).resolve()
        self.subnet = subnet
        self.backoff = backoff or Backoff()
        self.venv_bin = venv_bin or default_venv_bin()
        self.use_api_proxy = api_proxy
        self.delete_nodes = delete_nodes
        self.volume_sync_s = volume_sync_s
        self.svc: Services | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._tasks: set[asyncio.Task] = set()
        self._finished: set[str] = set()

    # -- the public API for tests --

    def log_path(self, namespace: str, pod: str, container: str) -> Path:
        return log_path(self.state_dir, namespace, pod, container)

    def logs(self, namespace: str, pod: str, container: str) -> str:
        """Everything container `container` of the pod wrote to stdout/stderr, all restarts included."""
        return read_log(self.state_dir, namespace, pod, container)

    def worker(self, namespace: str, pod: str) -> PodWorker | None:
        if self.svc is None:
            return None
        found = None
        for w in list(self.svc.workers.values()):  # the newest one, when a pod of the same name is still ending
            if w.namespace == namespace and w.name == pod:
                found = w
        return found

    def sandbox_info(self, namespace: str, pod: str) -> dict[str, Any] | None:
        """Host-side facts of a running pod: IP, veth, PIDs, network-namespace inode."""
        w = self.worker(namespace, pod)
        if w is None or w.sandbox.proc is None:
            return None
        netns_pid = w.sandbox.netns_pid
        try:
            netns = os.readlink(f"/proc/{netns_pid}/ns/net")
        except OSError:
            netns = ""
        return {
            "uid": w.uid,
            "ip": w.pod_ip,
            "veth": w.veth,
            "netns": netns,
            "unshare_pid": netns_pid,
            "agent_pid": w.sandbox.agent_pid(),
            "container_pids": {n: w.sandbox.host_pid(n) for n in list(w.sandbox.processes)},
        }

    def exec(self, namespace: str, pod: str, container: str, argv: list[str], timeout: float = 30) -> tuple[int, str]:
        """Run a command inside a running container, like `kubectl exec`: (exit code, output)."""
        w = self.worker(namespace, pod)
        if w is None or self._loop is None:
            raise LookupError(f"pod {namespace}/{pod} does not run on this runner")
        coro = w.sandbox.exec(container, argv, w.exec_env(container), timeout)
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout + 10)

    # -- in a thread: the context manager --

    def start(self, timeout: float = 120) -> PodRunner:
        ready = threading.Event()
        failure: list[BaseException] = []

        def target() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self.serve(on_ready=ready.set))
            except BaseException as e:  # noqa: BLE001 - handed to the starting thread
                failure.append(e)
                ready.set()
            finally:
                loop.close()

        self._thread = threading.Thread(target=target, name="podrunner", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            self.stop()
            raise TimeoutError(f"pod runner not ready after {timeout}s")
        if failure:
            raise RuntimeError(f"pod runner failed to start: {failure[0]}") from failure[0]
        return self

    def stop(self, timeout: float = 120) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def __enter__(self) -> PodRunner:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the runner itself --

    async def serve(self, on_ready: Callable[[], None] | None = None) -> None:
        """Run until `stop()` (or SIGTERM/SIGINT from the CLI); then kill every pod and clean up."""
        self._stop = asyncio.Event()
        missing = [t for t in TOOLS if shutil.which(t) is None]
        if missing:
            raise RuntimeError(f"missing tools {missing}: install iproute2 and util-linux")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._claim_state_dir()
        kube = await Kube.from_kubeconfig(self.kubeconfig)
        network = Network.create(self.subnet)
        self._write_state(network)
        http = httpx.AsyncClient(trust_env=False, verify=False, follow_redirects=True)
        proxy_server: asyncio.AbstractServer | None = None
        kubelet = KubeletServer(kube, [n.name for n in self.nodes], self.state_dir, self.worker)
        keepers: list[NodeKeeper] = []
        background: list[asyncio.Task] = []
        try:
            version = (await kube.request("GET", "/version")).get("gitVersion", "v0.0.0")
            proxy, proxy_server = await self._api_proxy(kube)
            self.svc = Services(
                kube=kube,
                network=network,
                http=http,
                events=EventRecorder(kube),
                state_dir=self.state_dir,
                backoff=self.backoff,
                base_env=self._base_env(),
                allocatable={n.name: dict(n.capacity) for n in self.nodes},
                api_proxy=proxy,
                api_address=kube.server_address,
                image_paths=self.image_paths(),
                volume_sync_s=self.volume_sync_s,
            )
            self.svc.dns = ServiceDns(kube, self._refresh_hosts)
            background.append(asyncio.create_task(self.svc.dns.run()))
            kubelet_port = await self._start_kubelet(kubelet, kube, str(network.gateway))
            for cfg in self.nodes:
                keeper = NodeKeeper(kube, cfg, str(network.gateway), f"{version}-podrunner", kubelet_port)
                await keeper.register()
                keepers.append(keeper)
                background.append(asyncio.create_task(keeper.heartbeat()))
                background.append(asyncio.create_task(self._watch_node(cfg.name)))
            await self._wait_nodes_schedulable(kube)
            log.info(
                "pod runner up: nodes %s on bridge %s (%s)",
                [n.name for n in self.nodes],
                network.bridge,
                network.subnet,
            )
            if on_ready:
                on_ready()
            await self._stop.wait()
        finally:
            await kubelet.close()
            await self._shutdown(background, keepers)
            if proxy_server is not None:
                proxy_server.close()
                with contextlib.suppress(Exception):
                    await proxy_server.wait_closed()
                if self.svc and self.svc.api_proxy:
                    with contextlib.suppress(OSError):
                        os.unlink(self.svc.api_proxy.unix)
            network.destroy()
            await http.aclose()
            await kube.close()
            (self.state_dir / "runner.json").unlink(missing_ok=True)
            log.info("pod runner stopped")

    async def _start_kubelet(self, kubelet: KubeletServer, kube: Kube, address: str) -> int:
        """The kubelet endpoint for `kubectl logs` on the node address; its port, or 0 when it cannot run (the
        pods still do; `kubectl logs` then fails at the API server, and this log says why)."""
        if not kube.ca:
            log.warning("the kubeconfig names no CA: no kubelet endpoint, so `kubectl logs` will not work")
            return 0
        try:
            return await kubelet.start(address, kube.ca)
        except Exception as e:  # noqa: BLE001 - logs are a convenience; the pods must run regardless
            log.warning("no kubelet endpoint, so `kubectl logs` will not work: %s", e)
            return 0

    async def _shutdown(self, background: list[asyncio.Task], keepers: list[NodeKeeper]) -> None:
        for task in background:
            task.cancel()
        if self.svc is not None:
            self.svc.stopping = True
            for w in list(self.svc.workers.values()):
                w.terminate.set()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=60)
        for task in [*background, *self._tasks]:
            task.cancel()
        await asyncio.gather(*background, *self._tasks, return_exceptions=True)
        if self.svc is not None:
            await self.svc.events.drain()
        if self.delete_nodes:
            for keeper in keepers:
                await keeper.unregister()

    async def _wait_nodes_schedulable(self, kube: Kube, timeout: float = 60) -> None:
        """Until every node is Ready and the node controller has lifted its not-ready taint."""
        deadline = asyncio.get_running_loop().time() + timeout
        pending = [n.name for n in self.nodes]
        while pending:
            for name in list(pending):
                node = await kube.get(f"/api/v1/nodes/{name}") or {}
                taints = [t["key"] for t in (node.get("spec") or {}).get("taints") or []]
                if not any(k.startswith("node.kubernetes.io/") for k in taints):
                    pending.remove(name)
            if pending:
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(f"nodes {pending} still carry node.kubernetes.io taints after {timeout}s")
                await asyncio.sleep(0.5)

    def image_paths(self) -> list[str]:
        """The host folders a container's command comes from: this repository, its venv and the interpreter.
        Volumes must not hide them (see `keep_image_visible`), wherever the checkout lives."""
        paths = {REPO, Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()}
        if self.venv_bin:
            paths.add(self.venv_bin.resolve().parent)
        return sorted(str(p) for p in paths)

    def _base_env(self) -> dict[str, str]:
        """The "image" environment: the host's PATH with the repository's venv first."""
        path = os.environ.get("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        if self.venv_bin:
            path = f"{self.venv_bin}{os.pathsep}{path}"
        env = {"PATH": path, "HOME": "/root"}
        for key in ("LANG", "LC_ALL", "TZ"):
            if key in os.environ:
                env[key] = os.environ[key]
        return env

    async def _api_proxy(self, kube: Kube) -> tuple[ApiProxy | None, asyncio.AbstractServer | None]:
        """A unix socket relaying to the API server, for the agents' listeners on the `kubernetes` Service IP."""
        if not self.use_api_proxy:
            return None, None
        svc = await kube.get("/api/v1/namespaces/default/services/kubernetes")
        if not svc or not svc["spec"].get("clusterIP"):
            log.warning("no default/kubernetes Service: pods will not reach the API server")
            return None, None
        port = int(svc["spec"]["ports"][0]["port"])
        sock = self.state_dir / "apiserver.sock"
        if len(str(sock)) > 100:  # sun_path is 108 bytes
            digest = hashlib.sha1(str(self.state_dir).encode()).hexdigest()[:12]
            sock = Path(tempfile.gettempdir()) / f"okpr-{digest}.sock"
        sock.unlink(missing_ok=True)
        host, api_port = kube.server_address

        async def to_apiserver(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await relay(reader, writer, lambda: asyncio.open_connection(host, api_port))

        server = await asyncio.start_unix_server(to_apiserver, path=str(sock))
        return ApiProxy(svc["spec"]["clusterIP"], port, str(sock)), server

    def _claim_state_dir(self) -> None:
        """One runner per state folder; clean up after a runner that died without doing so."""
        state = self.state_dir / "runner.json"
        if not state.exists():
            return
        old = json.loads(state.read_text())
        try:
            os.kill(old["pid"], 0)
            alive = old["pid"] != os.getpid()
        except ProcessLookupError:
            alive = False
        if alive:
            raise RuntimeError(f"a pod runner (pid {old['pid']}) already uses {self.state_dir}")
        Network.remove_bridge(old.get("bridge", ""))
        state.unlink()

    def _write_state(self, network: Network) -> None:
        (self.state_dir / "runner.json").write_text(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "bridge": network.bridge,
                    "subnet": str(network.subnet),
                    "nodes": [n.name for n in self.nodes],
                }
            )
        )

    # -- pods --

    async def _watch_node(self, node: str) -> None:
        assert self.svc is not None
        kube, selector = self.svc.kube, f"spec.nodeName={node}"
        while True:
            try:
                listing = await kube.request("GET", "/api/v1/pods", params={"fieldSelector": selector})
                rv = listing["metadata"]["resourceVersion"]
                present = set()
                for pod in listing["items"]:
                    present.add(pod["metadata"]["uid"])
                    self._dispatch("MODIFIED", pod)
                for w in list(self.svc.workers.values()):
                    if w.node == node and w.uid not in present:
                        w.deleted()
                while True:
                    params = {
                        "fieldSelector": selector,
                        "resourceVersion": rv,
                        "allowWatchBookmarks": "true",
                        "timeoutSeconds": "300",
                    }
                    async for kind, obj in kube.watch("/api/v1/pods", params):
                        if kind == "ERROR":
                            raise _Relist(obj.get("message", ""))
                        rv = obj["metadata"]["resourceVersion"]
                        if kind != "BOOKMARK":
                            self._dispatch(kind, obj)
            except asyncio.CancelledError:
                raise
            except _Relist:
                continue
            except Exception as e:  # noqa: BLE001 - the watch must go on
                log.warning("watch of pods on %s failed (%s); listing again", node, e)
                await asyncio.sleep(1)

    def _refresh_hosts(self) -> None:
        assert self.svc is not None
        for worker in list(self.svc.workers.values()):
            worker.write_hosts()

    def _dispatch(self, kind: str, pod: dict) -> None:
        assert self.svc is not None
        uid = pod["metadata"]["uid"]
        worker = self.svc.workers.get(uid)
        if kind == "DELETED":
            self._finished.add(uid)
            if worker:
                worker.deleted()
            return
        if worker is not None:
            worker.observe(pod)
            return
        if self.svc.stopping or uid in self._finished:
            return
        worker = PodWorker(self.svc, pod)
        self.svc.workers[uid] = worker
        task = asyncio.create_task(self._run_worker(worker))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_worker(self, worker: PodWorker) -> None:
        await worker.run()
        self._finished.add(worker.uid)


class _Relist(Exception):
    pass


def _key_values(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"{what} {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--node", action="append", required=True, help="a node to own (repeat for more)")
    parser.add_argument("--state-dir", type=Path, required=True, help="logs and pod folders live here")
    parser.add_argument("--subnet", help="bridge subnet (default: the first free /24 of 10.213.0.0/16)")
    parser.add_argument(
        "--capacity",
        action="append",
        default=[],
        metavar="RES=QTY",
        help="advertised capacity, e.g. cpu=16, memory=64Gi, nvidia.com/gpu=8",
    )
    parser.add_argument("--label", action="append", default=[], metavar="KEY=VALUE", help="extra node labels")
    parser.add_argument(
        "--no-taint", action="store_true", help=f"do not taint the nodes {RUNNER_TAINT['key']}=true:NoSchedule"
    )
    parser.add_argument("--backoff-base", type=float, default=10.0, help="crash-loop back-off start (s)")
    parser.add_argument("--backoff-cap", type=float, default=300.0, help="crash-loop back-off ceiling (s)")
    parser.add_argument(
        "--volume-sync-period",
        type=float,
        default=60.0,
        help="seconds between updates of configMap and secret volumes from their objects (the kubelet's ~60)",
    )
    parser.add_argument("--keep-nodes", action="store_true", help="leave the Node objects when stopping")
    parser.add_argument("--no-api-proxy", action="store_true", help="pods do not reach the API server")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(message)s"
    )
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    capacity = _key_values(args.capacity, "--capacity")
    nodes = [
        NodeConfig(
            name,
            labels=_key_values(args.label, "--label"),
            taints=[] if args.no_taint else [dict(RUNNER_TAINT)],
            capacity={**NodeConfig(name).capacity, **capacity},
        )
        for name in args.node
    ]
    runner = PodRunner(
        args.kubeconfig,
        nodes,
        args.state_dir,
        subnet=args.subnet,
        backoff=Backoff(args.backoff_base, args.backoff_cap),
        api_proxy=not args.no_api_proxy,
        delete_nodes=not args.keep_nodes,
        volume_sync_s=args.volume_sync_period,
    )

    async def run() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: runner._stop.set() if runner._stop else task.cancel())  # type: ignore[union-attr]
        await runner.serve(on_ready=lambda: print("pod runner ready", flush=True))

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
