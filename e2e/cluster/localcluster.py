"""A real Kubernetes control plane on 127.0.0.1, built from Go modules, for tests and demos.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler and KWOK run as local processes with
generated certificates; KWOK simulates the kubelets of a few GPU/NPU/CPU nodes. Nothing here is a mock:
admission, scheduling, garbage collection and EndpointSlices are Kubernetes' own.

    python e2e/cluster/localcluster.py up   [--dir DIR]   # start, print the kubeconfig path
    python e2e/cluster/localcluster.py down [--dir DIR]   # stop everything started from DIR
    python e2e/cluster/localcluster.py status [--dir DIR]

`LocalCluster` is the same thing as a context manager for pytest fixtures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

log = logging.getLogger("omnikube.e2e.cluster")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEFAULT_DIR = REPO / ".omnikube" / "cluster"
SERVICE_CIDR = "10.96.0.0/16"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"

# The simulated fleet: two 8-GPU nodes, one tainted 8-NPU node, one CPU-only node.
NODES: list[dict] = [
    {
        "name": "gpu-node-0",
        "labels": {"nvidia.com/gpu.product": "NVIDIA-H200", "omnikube.io/accelerator": "nvidia"},
        "extended": {"nvidia.com/gpu": "8"},
    },
    {
        "name": "gpu-node-1",
        "labels": {"nvidia.com/gpu.product": "NVIDIA-H200", "omnikube.io/accelerator": "nvidia"},
        "extended": {"nvidia.com/gpu": "8"},
    },
    {
        "name": "npu-node-0",
        "labels": {"accelerator": "huawei-Ascend910", "omnikube.io/accelerator": "ascend"},
        "extended": {"huawei.com/Ascend910": "8"},
        "taints": [{"key": "huawei.com/Ascend910", "effect": "NoSchedule"}],
    },
    {"name": "cpu-node-0", "labels": {"omnikube.io/accelerator": "none"}, "extended": {}},
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_binaries() -> Path:
    """Build (or reuse from the cache) the control-plane binaries; returns their folder."""
    out = subprocess.run(["bash", str(HERE / "build.sh")], check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


# --- certificates ---------------------------------------------------------------------------------


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _pem_key(key: rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
    )


def _cert(
    subject: x509.Name,
    key: rsa.RSAPrivateKey,
    issuer: x509.Name,
    issuer_key: rsa.RSAPrivateKey,
    *,
    ca: bool = False,
    server_names: list[str] = (),  # type: ignore[assignment]
    server_ips: list[str] = (),  # type: ignore[assignment]
    client: bool = False,
) -> x509.Certificate:
    now = dt.datetime.now(dt.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
    else:
        usages = []
        if server_names or server_ips:
            usages.append(x509.ExtendedKeyUsageOID.SERVER_AUTH)
            sans: list[x509.GeneralName] = [x509.DNSName(n) for n in server_names]
            sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in server_ips]
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        if client:
            usages.append(x509.ExtendedKeyUsageOID.CLIENT_AUTH)
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        builder = builder.add_extension(
            x509.KeyUsage(True, False, True, False, False, False, False, False, False), critical=True
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def write_pki(pki: Path) -> None:
    """CA, apiserver serving cert, admin and apiserver-to-kubelet client certs and the service-account keys."""
    pki.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca_name = _name("omnikube-local-ca")
    ca = _cert(ca_name, ca_key, ca_name, ca_key, ca=True)
    server_key = _key()
    server = _cert(
        _name("kube-apiserver"),
        server_key,
        ca_name,
        ca_key,
        server_names=[
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
        ],
        server_ips=["127.0.0.1", "10.96.0.1"],
    )
    admin_key = _key()
    admin = _cert(_name("omnikube-admin", "system:masters"), admin_key, ca_name, ca_key, client=True)
    # The API server's identity towards kubelets (the pod runner's log endpoint), as kubeadm's
    # apiserver-kubelet-client: the kubelet authorizes it with a SubjectAccessReview on nodes/proxy.
    kubelet_client_key = _key()
    kubelet_client = _cert(
        _name("kube-apiserver-kubelet-client", "system:masters"), kubelet_client_key, ca_name, ca_key, client=True
    )
    # The aggregation layer (kubeadm's front-proxy): kube-apiserver proxies requests for an APIService (KEDA's
    # external-metrics adapter) with this client cert and the user in X-Remote-* headers, which the extension
    # server trusts only from a cert of this CA. A CA of its own, so no other client can pass those headers.
    front_ca_key = _key()
    front_ca_name = _name("omnikube-front-proxy-ca")
    front_ca = _cert(front_ca_name, front_ca_key, front_ca_name, front_ca_key, ca=True)
    proxy_client_key = _key()
    proxy_client = _cert(_name("front-proxy-client"), proxy_client_key, front_ca_name, front_ca_key, client=True)
    sa_key = _key()
    files = {
        "ca.crt": ca.public_bytes(serialization.Encoding.PEM),
        "ca.key": _pem_key(ca_key),
        "apiserver.crt": server.public_bytes(serialization.Encoding.PEM),
        "apiserver.key": _pem_key(server_key),
        "admin.crt": admin.public_bytes(serialization.Encoding.PEM),
        "admin.key": _pem_key(admin_key),
        "apiserver-kubelet-client.crt": kubelet_client.public_bytes(serialization.Encoding.PEM),
        "apiserver-kubelet-client.key": _pem_key(kubelet_client_key),
        "front-proxy-ca.crt": front_ca.public_bytes(serialization.Encoding.PEM),
        "front-proxy-client.crt": proxy_client.public_bytes(serialization.Encoding.PEM),
        "front-proxy-client.key": _pem_key(proxy_client_key),
        "sa.key": _pem_key(sa_key),
        "sa.pub": sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
    }
    for name, data in files.items():
        (pki / name).write_bytes(data)
        (pki / name).chmod(0o600)


def kubeconfig_text(server: str, pki: Path) -> str:
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "omnikube-local", "cluster": {"server": server, "certificate-authority": str(pki / "ca.crt")}}
            ],
            "users": [
                {
                    "name": "admin",
                    "user": {"client-certificate": str(pki / "admin.crt"), "client-key": str(pki / "admin.key")},
                }
            ],
            "contexts": [{"name": "omnikube-local", "context": {"cluster": "omnikube-local", "user": "admin"}}],
            "current-context": "omnikube-local",
        },
        indent=2,
    )


AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
  # Writes: tests count them to prove an unchanged world causes none.
  - level: Metadata
    verbs: ["create", "update", "patch", "delete", "deletecollection"]
  # Reads of an OmniPipeline: every reconcile of one starts with one, so a test can see that the operator
  # has taken up a change before it counts the writes that followed (test_unchanged_spec_causes_no_writes).
  - level: Metadata
    verbs: ["get"]
    resources: [{group: omnikube.io, resources: ["omnipipelines"]}]
  # Lists of nodes: the operator counts free accelerators before a rollout (e2e/test_helm_chart.py checks it
  # does so with the chart's ServiceAccount).
  - level: Metadata
    verbs: ["list"]
    resources: [{group: "", resources: ["nodes"]}]
  - level: None
"""


def audit_time(event: dict) -> dt.datetime:
    """When the apiserver received the request of an audit event, to the microsecond (RFC 3339 micro, UTC).

    Never cut to whole seconds: a write in the same second as a reference time would be dropped."""
    return dt.datetime.fromisoformat(event["requestReceivedTimestamp"].replace("Z", "+00:00"))


# --- processes ------------------------------------------------------------------------------------


@dataclass
class LocalCluster:
    """Starts and stops the control plane; state lives in `workdir` (pids, logs, kubeconfig, data)."""

    workdir: Path = DEFAULT_DIR
    bin_dir: Path | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def audit_log(self) -> Path:
        return self.workdir / "logs" / "audit.log"

    @property
    def state_file(self) -> Path:
        return self.workdir / "state.json"

    def binary(self, name: str) -> str:
        assert self.bin_dir is not None
        return str(self.bin_dir / name)

    def env(self) -> dict[str, str]:
        """Environment in which kubectl and helm talk to this cluster."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        return env

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            [self.binary("kubectl"), *args],
            env=self.env(),
            input=input,
            text=True,
            capture_output=True,
            check=check,
            timeout=timeout,
        )

    # -- lifecycle --

    def up(self) -> LocalCluster:
        if self.state_file.exists():
            if self._running_pids():
                raise RuntimeError(f"a cluster is already running from {self.workdir}; run `down` first")
            self.state_file.unlink()  # left by a cluster whose processes are gone
        started = time.monotonic()
        shutil.rmtree(self.workdir / "etcd", ignore_errors=True)  # every `up` starts an empty cluster
        self.bin_dir = self.bin_dir or build_binaries()
        for sub in ("logs", "pki", "etcd"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        pki = self.workdir / "pki"
        write_pki(pki)
        (self.workdir / "audit-policy.yaml").write_text(AUDIT_POLICY)
        ports = {name: free_port() for name in ("etcd", "etcd_peer", "apiserver")}
        server = f"https://127.0.0.1:{ports['apiserver']}"
        self.kubeconfig.write_text(kubeconfig_text(server, pki))
        try:
            self._start_etcd(ports)
            self._start_apiserver(ports, pki)
            self._wait_ready(server)
            self._start_controllers(pki)
            self._write_state(server)
            self._create_nodes()
            self._wait_nodes_ready()
        except BaseException:
            self.down()
            raise
        log.info("control plane up in %.1fs at %s", time.monotonic() - started, server)
        return self

    def _spawn(self, name: str, args: list[str]) -> None:
        logf = open(self.workdir / "logs" / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        # A session of its own lets `down` kill the whole process group, children included.
        self.procs[name] = subprocess.Popen(
            args, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        logf.close()

    def _start_etcd(self, ports: dict[str, int]) -> None:
        peer = f"http://127.0.0.1:{ports['etcd_peer']}"
        self._spawn(
            "etcd",
            [
                self.binary("etcd"),
                "--name=default",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{ports['etcd']}",
                f"--advertise-client-urls=http://127.0.0.1:{ports['etcd']}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=default={peer}",
                "--unsafe-no-fsync",
                "--log-level=warn",
                "--quota-backend-bytes=4294967296",
            ],
        )

    def _start_apiserver(self, ports: dict[str, int], pki: Path) -> None:
        self._spawn(
            "kube-apiserver",
            [
                self.binary("kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{ports['etcd']}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={ports['apiserver']}",
                f"--cert-dir={pki}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                # `kubectl logs` of pods on the pod runner's nodes: the API server calls the node's kubelet
                # endpoint at its InternalIP, verifies it against the cluster CA and presents this client cert.
                f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
                f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
                f"--kubelet-certificate-authority={pki / 'ca.crt'}",
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                # The aggregation layer, for APIServices served by pods (KEDA's metrics adapter). No kube-proxy
                # routes Service IPs here, so the API server dials an endpoint's pod IP itself.
                f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
                f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
                "--enable-aggregator-routing=true",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                "--api-audiences=https://kubernetes.default.svc.cluster.local",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=RBAC",
                "--allow-privileged=true",
                f"--audit-policy-file={self.workdir / 'audit-policy.yaml'}",
                f"--audit-log-path={self.audit_log}",
                "--audit-log-format=json",
                "--audit-log-mode=blocking",
                "--endpoint-reconciler-type=none",
                "--profiling=false",
                "-v=1",
            ],
        )

    def _start_controllers(self, pki: Path) -> None:
        kc = str(self.kubeconfig)
        self._spawn(
            "kube-controller-manager",
            [
                self.binary("kube-controller-manager"),
                f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={free_port()}",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                f"--cluster-signing-cert-file={pki / 'ca.crt'}",
                f"--cluster-signing-key-file={pki / 'ca.key'}",
                "--use-service-account-credentials=true",
                "--leader-elect=false",
                # No cloud, no real kubelets: keep the controllers that act on API objects.
                "--controllers=*,-nodeipam,-cloud-node-lifecycle,-service-lb-controller,-persistentvolume-expander",
                "--concurrent-deployment-syncs=10",
                "--concurrent-replicaset-syncs=10",
                "--concurrent-gc-syncs=20",
                # The HPA controller (which KEDA's ScaledObjects drive) re-reads metrics every 15 s by default;
                # 5 s lets a test see a scale-up within a few syncs.
                "--horizontal-pod-autoscaler-sync-period=5s",
                "-v=1",
            ],
        )
        self._spawn(
            "kube-scheduler",
            [
                self.binary("kube-scheduler"),
                f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={free_port()}",
                "--leader-elect=false",
                "-v=1",
            ],
        )
        self._spawn(
            "kwok",
            [
                self.binary("kwok"),
                f"--kubeconfig={kc}",
                f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
                "--cidr=10.244.0.0/16",
                "--node-ip=10.250.0.1",
                "--node-lease-duration-seconds=40",
                f"--server-address=127.0.0.1:{free_port()}",
            ],
        )

    def _wait_ready(self, server: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            self._check_alive()
            out = self.kubectl("get", "--raw=/readyz", check=False, timeout=10)
            if out.returncode == 0 and out.stdout.strip() == "ok":
                return
            last = out.stderr.strip() or out.stdout.strip()
            time.sleep(0.5)
        raise TimeoutError(f"kube-apiserver at {server} not ready after {timeout}s: {last}")

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.workdir / "logs" / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}; log tail:\n{tail}")

    def _create_nodes(self) -> None:
        items = []
        for node in NODES:
            capacity = {"cpu": "64", "memory": "512Gi", "pods": "500", "ephemeral-storage": "1Ti", **node["extended"]}
            items.append(
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {
                        "name": node["name"],
                        "annotations": {KWOK_ANNOTATION: "fake"},
                        "labels": {
                            "kubernetes.io/hostname": node["name"],
                            "kubernetes.io/os": "linux",
                            "kubernetes.io/arch": "amd64",
                            "type": "kwok",
                            **node["labels"],
                        },
                    },
                    "spec": {"taints": node.get("taints", [])},
                    "status": {
                        "capacity": capacity,
                        "allocatable": capacity,
                        "nodeInfo": {
                            "architecture": "amd64",
                            "operatingSystem": "linux",
                            "kubeletVersion": "fake",
                            "kernelVersion": "",
                            "osImage": "",
                            "containerRuntimeVersion": "",
                            "kubeProxyVersion": "",
                            "machineID": "",
                            "systemUUID": "",
                            "bootID": "",
                        },
                    },
                }
            )
        self.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))

    def _wait_nodes_ready(self, timeout: float = 60) -> None:
        """Until KWOK reports every node Ready. Polls GETs, not `kubectl wait`: that lists from the API server's
        watch cache, which on a loaded machine can lag behind the nodes just created, and exits 1 at once."""
        names = {n["name"] for n in NODES}
        deadline = time.monotonic() + timeout
        while True:
            out = self.kubectl("get", "nodes", "-o", "json", check=False)
            ready = set()
            if out.returncode == 0:
                for node in json.loads(out.stdout)["items"]:
                    conditions = (node.get("status") or {}).get("conditions") or []
                    if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
                        ready.add(node["metadata"]["name"])
            if names <= ready:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"KWOK nodes not Ready after {timeout:.0f}s: {sorted(names - ready)}")
            time.sleep(0.5)

    def _write_state(self, server: str) -> None:
        self.state_file.write_text(
            json.dumps(
                {
                    "server": server,
                    "bin_dir": str(self.bin_dir),
                    "pids": {name: p.pid for name, p in self.procs.items()},
                }
            )
        )

    def down(self) -> None:
        """Stop every process this workdir started (also from another Python process), then forget it."""
        pids: dict[str, int] = {name: p.pid for name, p in self.procs.items()}
        if self.state_file.exists():
            pids.update(json.loads(self.state_file.read_text()).get("pids", {}))
        # Reverse start order: clients of the apiserver first, etcd last.
        for name in ["kwok", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"]:
            if name in pids:
                _stop_group(pids[name])
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()
        self.state_file.unlink(missing_ok=True)

    def _running_pids(self) -> list[int]:
        pids = json.loads(self.state_file.read_text()).get("pids", {}).values()
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        return alive

    @classmethod
    def attach(cls, workdir: Path) -> LocalCluster:
        """A handle on a cluster already started from `workdir` (e.g. by `make cluster-up`)."""
        state = json.loads((workdir / "state.json").read_text())
        return cls(workdir=workdir, bin_dir=Path(state["bin_dir"]))

    def __enter__(self) -> LocalCluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()


def _stop_group(pid: int, grace: float = 10) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)  # our own child: reap it, or its zombie keeps the group alive
        except ChildProcessError:
            pass
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["up", "down", "status", "build"])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="state folder (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cluster = LocalCluster(workdir=args.dir)
    if args.action == "build":
        print(build_binaries())
    elif args.action == "up":
        started = time.monotonic()
        cluster.up()
        # The processes run in sessions of their own and outlive this command; `down` stops them.
        print(f"cluster up in {time.monotonic() - started:.1f}s")
        print(f"export KUBECONFIG={cluster.kubeconfig}")
        print(f"export PATH={cluster.bin_dir}:$PATH")
    elif args.action == "down":
        cluster.down()
        print("cluster down")
    else:
        if not cluster.state_file.exists():
            print("no cluster running from", args.dir)
            return 1
        print(LocalCluster.attach(args.dir).kubectl("get", "nodes", "-o", "wide").stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
