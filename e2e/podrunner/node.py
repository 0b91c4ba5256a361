"""The runner's Node objects: registration, Ready status and Lease heartbeats (kube-node-lease).

The node-lifecycle controller keeps a node Ready while its Lease is renewed within the grace period; the
runner renews every 10 seconds and refreshes the Ready condition's heartbeat every minute.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from dataclasses import dataclass, field

from podrunner.downward import now
from podrunner.kube import MERGE_PATCH, Kube, KubeError

__all__ = ["ON_RUNNER", "NodeConfig", "NodeKeeper", "RUNNER_LABEL", "RUNNER_TAINT"]

log = logging.getLogger("omnikube.e2e.podrunner")

RUNNER_LABEL = "omnikube.io/podrunner"
RUNNER_TAINT = {"key": RUNNER_LABEL, "value": "true", "effect": "NoSchedule"}
ON_RUNNER = {
    "nodeSelector": {RUNNER_LABEL: "true"},
    "tolerations": [{"key": RUNNER_LABEL, "operator": "Exists", "effect": "NoSchedule"}],
}
"""What a pod spec (or an OmniPipeline's router and stage entries) carries to be placed on a runner node: its
label, and a toleration of its taint."""
LEASE_SECONDS = 40
RENEW_EVERY = 10.0
STATUS_EVERY = 60.0


def _default_capacity() -> dict[str, str]:
    return {"cpu": "16", "memory": "64Gi", "pods": "110", "ephemeral-storage": "100Gi"}


@dataclass
class NodeConfig:
    """One node the runner owns. Capacity is advertised, not enforced (no cgroups)."""

    name: str
    labels: dict[str, str] = field(default_factory=dict)
    taints: list[dict] = field(default_factory=lambda: [dict(RUNNER_TAINT)])
    capacity: dict[str, str] = field(default_factory=_default_capacity)


def _micro_now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class NodeKeeper:
    def __init__(
        self, kube: Kube, config: NodeConfig, address: str, kubelet_version: str, kubelet_port: int = 0
    ) -> None:
        self.kube, self.config, self.address, self.version = kube, config, address, kubelet_version
        self.kubelet_port = kubelet_port  # where the API server reaches the runner's kubelet endpoint (logs)
        self.uid = ""

    @property
    def name(self) -> str:
        return self.config.name

    def _conditions(self, stamp: str) -> list[dict]:
        def cond(kind: str, status: str, reason: str, message: str) -> dict:
            return {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": message,
                "lastHeartbeatTime": stamp,
                "lastTransitionTime": self._since.get(kind, stamp),
            }

        return [
            cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "pod runner: not enforced"),
            cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "pod runner: not enforced"),
            cond("PIDPressure", "False", "KubeletHasSufficientPID", "pod runner: not enforced"),
            cond("Ready", "True", "KubeletReady", "omnikube pod runner is posting ready status"),
        ]

    async def register(self) -> None:
        cfg = self.config
        labels = {
            "kubernetes.io/hostname": cfg.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            RUNNER_LABEL: "true",
            "type": "podrunner",
            **cfg.labels,
        }
        path = f"/api/v1/nodes/{cfg.name}"
        existing = await self.kube.get(path)
        if existing is None:
            node = await self.kube.request(
                "POST",
                "/api/v1/nodes",
                body={
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {"name": cfg.name, "labels": labels},
                    "spec": {"taints": cfg.taints},
                },
            )
        else:
            taints = [
                t
                for t in (existing.get("spec") or {}).get("taints") or []
                if t.get("key") not in {x["key"] for x in cfg.taints}
            ] + cfg.taints
            node = await self.kube.request(
                "PATCH",
                path,
                content_type=MERGE_PATCH,
                body={"metadata": {"labels": labels}, "spec": {"taints": taints}},
            )
        self.uid = node["metadata"]["uid"]
        self._since: dict[str, str] = {}
        stamp = now()
        self._since = {c: stamp for c in ("MemoryPressure", "DiskPressure", "PIDPressure", "Ready")}
        await self.kube.request(
            "PATCH",
            f"{path}/status",
            content_type=MERGE_PATCH,
            body={
                "status": {
                    "capacity": cfg.capacity,
                    "allocatable": cfg.capacity,
                    "conditions": self._conditions(stamp),
                    "addresses": [
                        {"type": "InternalIP", "address": self.address},
                        {"type": "Hostname", "address": cfg.name},
                    ],
                    "daemonEndpoints": {"kubeletEndpoint": {"Port": self.kubelet_port}},
                    "nodeInfo": {
                        "architecture": "amd64",
                        "operatingSystem": "linux",
                        "kubeletVersion": self.version,
                        "kubeProxyVersion": "",
                        "containerRuntimeVersion": "podrunner://0.1",
                        "kernelVersion": "",
                        "osImage": "host environment",
                        "machineID": "",
                        "systemUUID": "",
                        "bootID": "",
                    },
                }
            },
        )
        await self._renew_lease()

    async def _renew_lease(self) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.name}"
        spec = {"holderIdentity": self.name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": _micro_now()}
        try:
            await self.kube.request("PATCH", path, body={"spec": spec}, content_type=MERGE_PATCH)
        except KubeError as e:
            if e.status != 404:
                raise
            await self.kube.request(
                "POST",
                "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
                body={
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {
                        "name": self.name,
                        "namespace": "kube-node-lease",
                        "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": self.name, "uid": self.uid}],
                    },
                    "spec": spec,
                },
            )

    async def heartbeat(self) -> None:
        """Renew the Lease and refresh the Ready heartbeat until cancelled."""
        last_status = asyncio.get_running_loop().time()
        while True:
            await asyncio.sleep(RENEW_EVERY)
            try:
                await self._renew_lease()
                if asyncio.get_running_loop().time() - last_status >= STATUS_EVERY:
                    await self.kube.request(
                        "PATCH",
                        f"/api/v1/nodes/{self.name}/status",
                        content_type=MERGE_PATCH,
                        body={"status": {"conditions": self._conditions(now())}},
                    )
                    last_status = asyncio.get_running_loop().time()
            except KubeError as e:
                if e.status == 404:  # someone deleted the node: register it again
                    await self.register()
                else:
                    log.warning("node %s: heartbeat failed: %s", self.name, e)

    async def unregister(self) -> None:
        for path in (
            f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.name}",
            f"/api/v1/nodes/{self.name}",
        ):
            try:
                await self.kube.request("DELETE", path)
            except KubeError as e:
                if e.status != 404:
                    log.warning("node %s: %s", self.name, e)
