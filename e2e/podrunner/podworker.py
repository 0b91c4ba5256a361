"""One pod's life on a runner node: sandbox, init containers, containers, status, termination, deletion."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from podrunner.containers import Backoff, ContainerRunner
from podrunner.cpus import CpuManager, exclusive_cpus
from podrunner.dns import ServiceDns
from podrunner.downward import now
from podrunner.envs import ObjectCache, container_env, expand_command
from podrunner.events import EventRecorder
from podrunner.kube import MERGE_PATCH, Kube, KubeError
from podrunner.network import VETH_PREFIX, Network, NetworkError
from podrunner.sandbox import Sandbox, SandboxError
from podrunner.status import PodFacts, build_status, pod_phase
from podrunner.volumes import (
    Volume,
    VolumeError,
    container_mounts,
    keep_image_visible,
    prepare_volumes,
    refresh_volumes,
)

__all__ = ["ApiProxy", "PodWorker", "Services"]

log = logging.getLogger("omnikube.e2e.podrunner")


@dataclass
class ApiProxy:
    """Pods reach the API server at `cluster_ip:port` (the `kubernetes` Service), relayed by their agent
    through `unix` to the runner and on to the API server on the host's loopback."""

    cluster_ip: str
    port: int
    unix: str


@dataclass
class Services:
    kube: Kube
    network: Network
    http: httpx.AsyncClient
    events: EventRecorder
    state_dir: Path
    backoff: Backoff
    base_env: dict[str, str]
    allocatable: dict[str, dict[str, str]]  # node -> allocatable
    dns: ServiceDns | None = None
    api_proxy: ApiProxy | None = None
    api_address: tuple[str, int] = ("127.0.0.1", 443)
    image_paths: list[str] = field(default_factory=list)  # host folders that are "the image" (repo, venv)
    stopping: bool = False
    workers: dict[str, PodWorker] = field(default_factory=dict)
    volume_sync_s: float = 60.0
    """How often configMap and secret volumes are brought up to date (the kubelet's sync period is ~1 min)."""
    cpus: CpuManager = field(default_factory=CpuManager)
    """The host CPUs, handed out as the static CPU manager policy does (cpus.py); shared by the runner's nodes."""


def pod_dir(state_dir: Path, namespace: str, name: str) -> Path:
    return state_dir / "pods" / f"{namespace}_{name}"


def _hosts_file(ip: str, hostname: str, services: str = "") -> str:
    """The kubelet's hosts file, with `services` (dns.py's lines) before the pod's own line, which stays last."""
    return (
        "# Kubernetes-managed hosts file (omnikube pod runner).\n127.0.0.1\tlocalhost\n"
        "::1\tlocalhost ip6-localhost ip6-loopback\nfe00::0\tip6-localnet\nfe00::0\tip6-mcastprefix\n"
        f"{services}{ip}\t{hostname}\n"
    )


# The pod's /etc/resolv.conf under dnsPolicy ClusterFirst (the default). No cluster DNS server runs here:
# Service names come from /etc/hosts (dns.py). The host's resolver is not reachable from a pod's network,
# so a lookup of any other name would wait out its timeouts (seconds per name); a nameserver on the pod's
# own loopback, where nothing listens, refuses at once, so such a lookup fails at once, as it does when
# CoreDNS answers NXDOMAIN.
RESOLV_CONF = "# Pod resolver (omnikube pod runner): Service names are in /etc/hosts.\nnameserver 127.0.0.1\n"


class PodWorker:
    def __init__(self, svc: Services, pod: dict) -> None:
        self.svc = svc
        self.pod = pod
        meta = pod["metadata"]
        self.uid, self.namespace, self.name = meta["uid"], meta["namespace"], meta["name"]
        self.node: str = pod["spec"]["nodeName"]
        self.dir = pod_dir(svc.state_dir, self.namespace, self.name)
        self.sandbox_dir = self.dir / f".sandbox-{self.uid[:8]}"
        self.host_network = bool(pod["spec"].get("hostNetwork"))
        # The stand-in resolver (RESOLV_CONF) unless dnsPolicy is Default or the pod is on the host's network
        # (whose resolver answers from there).
        self.cluster_dns = not self.host_network and pod["spec"].get("dnsPolicy") != "Default"
        self.sandbox: Sandbox = Sandbox(self.dir / "agent.log", host_network=self.host_network)
        self.ip: ipaddress.IPv4Address | None = None
        self.veth = VETH_PREFIX + hashlib.sha1(self.uid.encode()).hexdigest()[:8]
        self.volumes: dict[str, Volume] = {}
        self.terminate = asyncio.Event()
        self.gone = False
        self.sandbox_ready = False
        self.initialized = False
        self.init_failed = False
        self.start_time = ""
        self.message = ""
        self._envs: dict[str, dict[str, str]] = {}
        self._dirty = asyncio.Event()
        self._last_written: dict | None = None
        self._frozen = False  # finished under an earlier runner: leave its status alone
        self._torn_down = False
        self._attached = False
        inits = pod["spec"].get("initContainers") or []
        self.has_init = bool(inits)
        self.init_runners = [
            ContainerRunner(self, c, init=True, sidecar=c.get("restartPolicy") == "Always") for c in inits
        ]
        self.runners = [ContainerRunner(self, c) for c in pod["spec"]["containers"]]

    # -- what ContainerRunner uses --

    @property
    def http(self) -> httpx.AsyncClient:
        return self.svc.http

    @property
    def backoff(self) -> Backoff:
        return self.svc.backoff

    @property
    def pod_ip(self) -> str:
        return str(self.ip) if self.ip else ""

    @property
    def host_ip(self) -> str:
        return str(self.svc.network.gateway)

    def changed(self) -> None:
        self._dirty.set()

    def event(self, kind: str, reason: str, message: str) -> None:
        if not self.svc.stopping:
            self.svc.events.record(self.pod, self.node, kind, reason, message)

    def container_runner(self, name: str) -> ContainerRunner | None:
        """The runner of container `name` (init containers included), or None when the pod has no such container."""
        return next((r for r in [*self.init_runners, *self.runners] if r.name == name), None)

    def log_path(self, container: str) -> Path:
        return self.dir / f"{container}.log"

    def grace_seconds(self) -> float:
        meta, spec = self.pod["metadata"], self.pod["spec"]
        grace = meta.get("deletionGracePeriodSeconds")
        return float(grace if grace is not None else spec.get("terminationGracePeriodSeconds", 30))

    def exec_env(self, container: str) -> dict[str, str]:
        return self._envs.get(container) or dict(self.svc.base_env)

    async def resolve(self, spec: dict) -> tuple[list[str], dict[str, str], str, list[dict]]:
        cache = ObjectCache(self.svc.kube, self.namespace)
        env = await container_env(
            cache,
            self.pod,
            spec,
            base=self._base_env(),
            pod_ip=self.pod_ip,
            host_ip=self.host_ip,
            node_allocatable=self.svc.allocatable.get(self.node, {}),
        )
        self._envs[spec["name"]] = env
        termination = self.termination_file(spec["name"])
        termination.write_bytes(b"")  # each run of the container starts with an empty message
        mounts = keep_image_visible(
            [
                {"source": str(self.sandbox_dir / "hosts"), "target": "/etc/hosts", "readonly": False},
                {"source": str(self.sandbox_dir / "hostname"), "target": "/etc/hostname", "readonly": False},
                *(
                    [{"source": str(self.sandbox_dir / "resolv.conf"), "target": "/etc/resolv.conf", "readonly": True}]
                    if self.cluster_dns
                    else []
                ),
                {"source": str(termination), "target": _termination_path(spec), "readonly": False},
                *container_mounts(spec, self.volumes, env),
            ],
            self.svc.image_paths,
        )
        return expand_command(spec, env), env, spec.get("workingDir") or "/", mounts

    def cpus_for(self, spec: dict) -> list[int]:
        """The CPUs container `spec` runs on: its own (static CPU manager policy, cpus.py) or the shared pool."""
        pool = self.svc.cpus
        count = exclusive_cpus(self.pod, spec)
        if count:
            own = pool.allocate(self.uid, spec["name"], count)
            if own is not None:
                return sorted(own)
            self.event(
                "Warning", "CPUsUnavailable",
                f"container {spec['name']} asks for {count} exclusive CPU(s) (Guaranteed pod, whole CPU request) "
                f"and {len(pool.free())} of the host's {len(pool.cpus)} are free: "
                "it runs on the shared pool; lower its CPU request or stop other Guaranteed pods",
            )  # fmt: skip
        return sorted(pool.shared())

    def write_hosts(self) -> None:
        """The pod's /etc/hosts: the Services cluster DNS would resolve (dns.py), then itself. Written in
        place, so containers that bind-mounted it see the change."""
        path = self.sandbox_dir / "hosts"
        if not self.sandbox_dir.is_dir() or self.ip is None:
            return
        services = self.svc.dns.lines(self.namespace) if self.svc.dns is not None else ""
        text = _hosts_file(self.pod_ip, self._hostname(), services)
        with contextlib.suppress(OSError), open(path, "w") as f:
            f.write(text)

    def termination_file(self, container: str) -> Path:
        """The host file bind-mounted at the container's terminationMessagePath."""
        return self.sandbox_dir / f"termination-{container}"

    def _hostname(self) -> str:
        spec = self.pod["spec"]
        return (spec.get("hostname") or self.name)[:63]

    def _base_env(self) -> dict[str, str]:
        env = dict(self.svc.base_env)
        env["HOSTNAME"] = self._hostname()
        if self.svc.api_proxy and not self.host_network:
            host, port = self.svc.api_proxy.cluster_ip, self.svc.api_proxy.port
        else:
            host, port = self.svc.api_address
        env.update(
            {
                "KUBERNETES_SERVICE_HOST": host,
                "KUBERNETES_SERVICE_PORT": str(port),
                "KUBERNETES_SERVICE_PORT_HTTPS": str(port),
                "KUBERNETES_PORT": f"tcp://{host}:{port}",
                f"KUBERNETES_PORT_{port}_TCP": f"tcp://{host}:{port}",
                f"KUBERNETES_PORT_{port}_TCP_PROTO": "tcp",
                f"KUBERNETES_PORT_{port}_TCP_PORT": str(port),
                f"KUBERNETES_PORT_{port}_TCP_ADDR": host,
            }
        )
        return env

    # -- watch input --

    def observe(self, pod: dict) -> None:
        if _rv(pod) >= _rv(self.pod):
            self.pod = pod
        if pod["metadata"].get("deletionTimestamp"):
            self.terminate.set()
        self.changed()

    def deleted(self) -> None:
        self.gone = True
        self.terminate.set()

    # -- life --

    async def run(self) -> None:
        writer = asyncio.create_task(self._status_writer())
        try:
            await self._run()
        except Exception:  # noqa: BLE001 - one pod's failure must not stop the runner
            log.exception("pod %s/%s: unexpected error", self.namespace, self.name)
        finally:
            await self._teardown()
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer
            self.svc.workers.pop(self.uid, None)

    async def _run(self) -> None:
        phase = (self.pod.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed") and not self.terminate.is_set():
            self._frozen = True
            await self.terminate.wait()
        elif not self.terminate.is_set():
            self.start_time = now()
            self.changed()
            live = asyncio.create_task(self._live())
            stop = asyncio.create_task(self.terminate.wait())
            await asyncio.wait({live, stop}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if live.done():
                live.result()
                await self._teardown()  # a finished pod keeps its status, not its sandbox
                await self.terminate.wait()
            else:
                grace = 2.0 if self.gone or self.svc.stopping else self.grace_seconds()
                if not self.gone and not self.svc.stopping:
                    self.event("Normal", "Killing", "Stopping pod")
                await asyncio.gather(*(r.stop(grace) for r in [*self.runners, *self.init_runners]))
                live.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await live
        await self._teardown()
        if self.gone or self.svc.stopping:
            return
        if not self._frozen:
            await self._flush(final=True)
        with contextlib.suppress(KubeError):
            await self.svc.kube.request(
                "DELETE",
                f"/api/v1/namespaces/{self.namespace}/pods/{self.name}",
                body={
                    "apiVersion": "v1",
                    "kind": "DeleteOptions",
                    "gracePeriodSeconds": 0,
                    "preconditions": {"uid": self.uid},
                },
            )
        log.info("pod %s/%s deleted", self.namespace, self.name)

    async def _live(self) -> None:
        await self._create_sandbox()
        sync = asyncio.create_task(self._sync_volumes(), name=f"volumes-{self.name}")
        try:
            await self._run_containers()
        finally:
            sync.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sync

    async def _sync_volumes(self) -> None:
        """Every sync period, rewrite configMap and secret volumes whose objects changed, as the kubelet does."""
        while True:
            await asyncio.sleep(self.svc.volume_sync_s)
            try:
                changed = await refresh_volumes(ObjectCache(self.svc.kube, self.namespace), self.pod, self.volumes)
            except Exception as e:  # noqa: BLE001 - the API server may be busy; try again next period
                log.debug("pod %s/%s: volume sync failed: %s", self.namespace, self.name, e)
                continue
            if changed:
                log.info("pod %s/%s: volumes updated: %s", self.namespace, self.name, ", ".join(changed))

    async def _run_containers(self) -> None:
        sidecars = []
        for runner in self.init_runners:
            if runner.sidecar:
                sidecars.append(asyncio.create_task(runner.run()))
                while not runner.started and not runner.done:
                    await asyncio.sleep(0.1)
                continue
            code = await runner.run()
            self.svc.cpus.release(self.uid, runner.name)  # as the kubelet: an init container's CPUs are reused
            if code != 0:
                self.init_failed = True
                self.changed()
                return
        self.initialized = True
        for runner in self.runners:
            runner._waiting("ContainerCreating")
        await asyncio.gather(*(r.run() for r in self.runners))
        if self.sandbox.lost.is_set() and not self.terminate.is_set():
            self.message = "the pod's sandbox (its agent) exited unexpectedly; see agent.log in the pod folder"
            for runner in self.runners:
                runner.done = True
        for runner in self.init_runners:
            if runner.sidecar:
                await runner.stop(self.grace_seconds())
        await asyncio.gather(*sidecars, return_exceptions=True)
        self.changed()

    async def _create_sandbox(self) -> None:
        self.sandbox_dir.mkdir(parents=True, exist_ok=True)
        net = self.svc.network
        self.ip = net.gateway if self.host_network else net.allocate()
        while True:
            try:
                self.volumes = await prepare_volumes(
                    self.svc.kube,
                    ObjectCache(self.svc.kube, self.namespace),
                    self.pod,
                    self.sandbox_dir,
                    pod_ip=self.pod_ip,
                    host_ip=self.host_ip,
                    allocatable=self.svc.allocatable.get(self.node, {}),
                )
                break
            except VolumeError as e:
                self.event("Warning", "FailedMount", f"MountVolume.SetUp failed: {e}")
                for runner in [*self.init_runners, *self.runners]:
                    runner._waiting("ContainerCreating", str(e))
                await asyncio.sleep(2.0)
        hostname = self._hostname()
        self.write_hosts()
        (self.sandbox_dir / "hostname").write_text(hostname + "\n")
        if self.cluster_dns:
            (self.sandbox_dir / "resolv.conf").write_text(RESOLV_CONF)
        (self.sandbox_dir / "rootfs").mkdir(exist_ok=True)
        delay = 1.0
        while True:
            try:
                await self._start_sandbox(hostname)
                break
            except (SandboxError, NetworkError, OSError) as e:
                # As the kubelet does: report, throw the half-made sandbox away, try again later.
                self.event("Warning", "FailedCreatePodSandBox", f"Failed to create pod sandbox: {e}")
                await self.sandbox.shutdown()
                if self._attached:
                    await net.detach(self.veth)
                    self._attached = False
                self.sandbox = Sandbox(self.dir / "agent.log", host_network=self.host_network)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
        self.sandbox_ready = True
        self.changed()

    async def _start_sandbox(self, hostname: str) -> None:
        await self.sandbox.create()
        proxy = self.svc.api_proxy if not self.host_network else None
        if not self.host_network:
            self._attached = True
            await self.svc.network.attach(
                self.sandbox.netns_pid, self.veth, self.ip, [proxy.cluster_ip] if proxy else []
            )
        await self.sandbox.setup(
            {
                "hostname": None if self.host_network else hostname,
                "root": str(self.sandbox_dir / "rootfs"),
                "mountpoints": self._mountpoints(),
                "memory_volumes": [{"path": v.path, "size": v.size} for v in self.volumes.values() if v.memory],
                "proxies": [{"listen_host": proxy.cluster_ip, "listen_port": proxy.port, "unix": proxy.unix}]
                if proxy
                else [],
            }
        )

    def _mountpoints(self) -> list[dict[str, Any]]:
        points: dict[str, bool] = {}
        for spec in [*(self.pod["spec"].get("initContainers") or []), *self.pod["spec"]["containers"]]:
            points.setdefault(_termination_path(spec), True)
            with contextlib.suppress(VolumeError):
                for m in container_mounts(spec, self.volumes, {}):
                    points.setdefault(m["target"], Path(m["source"]).is_file())
        return [{"path": p, "file": f} for p, f in points.items()]

    async def _teardown(self) -> None:
        """Idempotent: end the agent (and with it every process, mount and namespace of the pod), remove the
        veth, free the IP for reuse (status keeps showing it) and delete the sandbox folder (logs stay)."""
        if self._torn_down:
            return
        self._torn_down = True
        await self.sandbox.shutdown()
        self.svc.cpus.release(self.uid)
        if self._attached:
            await self.svc.network.detach(self.veth)
        if self.ip is not None and not self.host_network:
            self.svc.network.release(self.ip)
        shutil.rmtree(self.sandbox_dir, ignore_errors=True)
        self.sandbox_ready = False
        self.changed()

    # -- status --

    def facts(self, *, final: bool = False) -> PodFacts:
        containers = [r.status() for r in self.runners]
        done = [r.done or final for r in self.runners]
        phase = pod_phase(init_failed=self.init_failed, initialized=self.initialized, containers=containers, done=done)
        return PodFacts(
            host_ip=self.host_ip,
            pod_ip=self.pod_ip if self.ip else "",
            start_time=self.start_time,
            sandbox_ready=self.sandbox_ready,
            initialized=self.initialized,
            phase=phase,
            init_statuses=[r.status() for r in self.init_runners],
            container_statuses=containers,
            message=self.message,
        )

    async def _status_writer(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            await self._flush()
            await asyncio.sleep(0.05)

    async def _flush(self, *, final: bool = False) -> None:
        if self.gone or self._frozen or self.svc.stopping:
            return
        status = build_status(self.pod, self.facts(final=final), now())
        if status == self._last_written:
            return
        try:
            result = await self.svc.kube.request(
                "PATCH",
                f"/api/v1/namespaces/{self.namespace}/pods/{self.name}/status",
                body={"status": status},
                content_type=MERGE_PATCH,
            )
        except KubeError as e:
            if e.status == 404:
                self.deleted()
                return
            log.warning("pod %s/%s: status not written: %s", self.namespace, self.name, e)
            asyncio.get_running_loop().call_later(1.0, self._dirty.set)
            return
        self._last_written = status
        if _rv(result) >= _rv(self.pod):
            self.pod = result


def _termination_path(spec: dict) -> str:
    """Where the container writes why it ended (the API server defaults it to /dev/termination-log)."""
    return spec.get("terminationMessagePath") or "/dev/termination-log"


def _rv(obj: dict) -> int:
    try:
        return int(obj["metadata"].get("resourceVersion", 0))
    except (TypeError, ValueError):
        return 0
