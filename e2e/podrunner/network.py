"""Pod networking: one Linux bridge on the host, a veth per pod, an address per pod.

The bridge takes the first free /24 of 10.213.0.0/16 (free: no route of the host overlaps it) and holds
`.1`, the node's address, so the host reaches every pod IP and pods reach each other across the bridge
(layer 2, no forwarding or NAT on the host). Pods get `.2`-`.254`, handed out round-robin so a freed
address is not reused at once. Inside the pod: `lo` up, `eth0` with the pod IP, default route via `.1`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import logging
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Network", "NetworkError", "POOL"]

log = logging.getLogger("omnikube.e2e.podrunner")

POOL = ipaddress.ip_network("10.213.0.0/16")
BRIDGE_PREFIX = "okpr"
VETH_PREFIX = "okv"
LOCK = Path("/run/lock") if Path("/run/lock").is_dir() else Path("/tmp")


class NetworkError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, input=input)
    if check and out.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out


async def _aip(*args: str, netns_pid: int | None = None, input: str | None = None, check: bool = True) -> str:
    argv = ["ip", *args]
    if netns_pid is not None:
        argv = ["nsenter", f"--net=/proc/{netns_pid}/ns/net", *argv]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate(input.encode() if input else None)
    if check and proc.returncode != 0:
        raise NetworkError(f"{' '.join(argv)}: {err.decode().strip()}")
    return out.decode()


def _used_networks() -> list[ipaddress.IPv4Network]:
    used = []
    for line in _ip("-4", "route", "show", "table", "all").stdout.splitlines():
        word = line.split()[0] if line.split() else ""
        if word in ("default", "broadcast", "local", "unreachable", "blackhole", "prohibit"):
            word = line.split()[1] if word != "default" and len(line.split()) > 1 else ""
        with contextlib.suppress(ValueError):
            if word:
                used.append(ipaddress.ip_network(word, strict=False))
    return used


@dataclass
class Network:
    bridge: str
    subnet: ipaddress.IPv4Network
    _next: int = 2
    _used: set[ipaddress.IPv4Address] = field(default_factory=set)

    @property
    def gateway(self) -> ipaddress.IPv4Address:
        return self.subnet.network_address + 1

    @classmethod
    def create(cls, subnet: str | None = None) -> Network:
        """Pick a free /24 (or use `subnet`) and bring up its bridge, under a host-wide lock."""
        with open(LOCK / "omnikube-podrunner.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            used = _used_networks()
            if subnet:
                chosen = ipaddress.ip_network(subnet)
                clash = [str(u) for u in used if u.overlaps(chosen) and u.prefixlen > 0]
                if clash:
                    raise NetworkError(
                        f"subnet {chosen} overlaps the host's routes {clash}; pick another "
                        f"--subnet or leave it out to take a free /24 of {POOL}"
                    )
            else:
                free = [
                    n for n in POOL.subnets(new_prefix=24) if not any(u.overlaps(n) and u.prefixlen > 0 for u in used)
                ]
                if not free:
                    raise NetworkError(f"no free /24 left in {POOL}: remove stale {BRIDGE_PREFIX}* bridges")
                chosen = free[0]
            bridge = f"{BRIDGE_PREFIX}{int(chosen.network_address) >> 8 & 0xFFFF:x}"[:15]
            net = cls(bridge, chosen)  # type: ignore[arg-type]
            _ip("link", "add", bridge, "type", "bridge")
            try:
                _ip("addr", "add", f"{net.gateway}/{chosen.prefixlen}", "dev", bridge)
                _ip("link", "set", bridge, "up")
            except NetworkError:
                _ip("link", "del", bridge, check=False)
                raise
        log.info("bridge %s up with %s/%d", bridge, net.gateway, chosen.prefixlen)
        return net

    def destroy(self) -> None:
        _ip("link", "del", self.bridge, check=False)

    @staticmethod
    def remove_bridge(name: str) -> None:
        if name.startswith(BRIDGE_PREFIX):
            _ip("link", "del", name, check=False)

    def allocate(self) -> ipaddress.IPv4Address:
        hosts = self.subnet.num_addresses - 2
        for _ in range(hosts):
            candidate = self.subnet.network_address + self._next
            self._next = self._next + 1 if self._next < hosts else 2
            if candidate != self.gateway and candidate not in self._used:
                self._used.add(candidate)
                return candidate
        raise NetworkError(f"no address left in {self.subnet} ({len(self._used)} pods hold one)")

    def release(self, ip: ipaddress.IPv4Address) -> None:
        self._used.discard(ip)

    async def attach(self, netns_pid: int, veth: str, ip: ipaddress.IPv4Address, extra_lo_addresses: list[str]) -> None:
        """Give the network namespace of `netns_pid` an `eth0` on the bridge with address `ip`."""
        await _aip("link", "del", veth, check=False)  # left by an earlier sandbox of the same pod
        await _aip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", str(netns_pid))
        await _aip("link", "set", veth, "master", self.bridge, "up")
        batch = [
            "link set lo up",
            f"addr add {ip}/{self.subnet.prefixlen} dev eth0",
            "link set eth0 up",
            f"route add default via {self.gateway}",
        ]
        batch += [f"addr add {a}/32 dev lo" for a in extra_lo_addresses]
        await _aip("-batch", "-", netns_pid=netns_pid, input="\n".join(batch) + "\n")

    async def detach(self, veth: str) -> None:
        await _aip("link", "del", veth, check=False)

    @staticmethod
    def veth_exists(veth: str) -> bool:
        return _ip("link", "show", veth, check=False).returncode == 0
