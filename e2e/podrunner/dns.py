"""A minimal stand-in for cluster DNS: Service names in each pod's /etc/hosts, kept current.

The runner has no CoreDNS, so a pod that dials `<svc>.<ns>.svc` would ask the host's resolver and
fail. This watches Services and EndpointSlices and gives every pod, for each headless Service of the
cluster, one hosts line per ready endpoint address:

    10.213.7.12  mc.apps.svc.cluster.local mc.apps.svc mc.apps [mc]

(the short name only for Services of the pod's own namespace, as the pod's DNS search path would).
ClusterIP Services are left out: without kube-proxy their IPs do not route here. The pod's hosts file
is rewritten in place on every change, so the bind mounts of its containers see the new lines.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from podrunner.kube import Kube

__all__ = ["CLUSTER_DOMAIN", "ServiceDns"]

log = logging.getLogger("omnikube.e2e.podrunner")

CLUSTER_DOMAIN = "cluster.local"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


class ServiceDns:
    """Headless Services and their ready endpoint addresses, from a list+watch of each."""

    def __init__(self, kube: Kube, on_change: Callable[[], None]) -> None:
        self.kube = kube
        self.on_change = on_change
        self.headless: set[tuple[str, str]] = set()
        self.slices: dict[str, dict] = {}

    def lines(self, namespace: str) -> str:
        """The hosts lines a pod of `namespace` gets."""
        addresses: dict[tuple[str, str], list[str]] = {}
        for s in self.slices.values():
            ns = s["metadata"]["namespace"]
            svc = (s["metadata"].get("labels") or {}).get(SERVICE_NAME_LABEL)
            if svc is None or (ns, svc) not in self.headless or s.get("addressType") != "IPv4":
                continue
            for ep in s.get("endpoints") or []:
                if (ep.get("conditions") or {}).get("ready") is False:
                    continue
                for ip in ep.get("addresses") or []:
                    if ip not in addresses.setdefault((ns, svc), []):
                        addresses[(ns, svc)].append(ip)
        out = []
        for (ns, svc), ips in sorted(addresses.items()):
            names = [f"{svc}.{ns}.svc.{CLUSTER_DOMAIN}", f"{svc}.{ns}.svc", f"{svc}.{ns}"]
            if ns == namespace:
                names.append(svc)
            out += [f"{ip}\t{' '.join(names)}" for ip in ips]
        return "".join(line + "\n" for line in out)

    async def run(self) -> None:
        await asyncio.gather(
            self._watch("/api/v1/services", self._service),
            self._watch("/apis/discovery.k8s.io/v1/endpointslices", self._slice),
        )

    def _service(self, kind: str, obj: dict) -> None:
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        if kind != "DELETED" and (obj.get("spec") or {}).get("clusterIP") == "None":
            self.headless.add(key)
        else:
            self.headless.discard(key)

    def _slice(self, kind: str, obj: dict) -> None:
        uid = obj["metadata"]["uid"]
        if kind == "DELETED":
            self.slices.pop(uid, None)
        else:
            self.slices[uid] = obj

    async def _watch(self, path: str, apply: Callable[[str, dict], None]) -> None:
        while True:
            try:
                listing = await self.kube.request("GET", path)
                if path.endswith("services"):
                    self.headless.clear()
                else:
                    self.slices.clear()
                for obj in listing["items"]:
                    apply("ADDED", obj)
                self.on_change()
                rv = listing["metadata"]["resourceVersion"]
                while True:
                    params = {"resourceVersion": rv, "allowWatchBookmarks": "true", "timeoutSeconds": "300"}
                    async for kind, obj in self.kube.watch(path, params):
                        if kind == "ERROR":
                            raise _Relist(obj.get("message", ""))
                        rv = obj["metadata"]["resourceVersion"]
                        if kind != "BOOKMARK":
                            apply(kind, obj)
                            self.on_change()
            except asyncio.CancelledError:
                raise
            except _Relist:
                continue
            except Exception as e:  # noqa: BLE001 - the watch must go on
                log.warning("watch of %s failed (%s); listing again", path, e)
                await asyncio.sleep(1)


class _Relist(Exception):
    pass
