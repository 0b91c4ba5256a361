"""The runner's kubelet endpoint: what `kubectl logs` (`-f`, `-c`, `--previous`, `--tail`, `--limit-bytes`) needs.

kube-apiserver serves `pods/log` by calling the pod's node at `GET /containerLogs/{namespace}/{pod}/{container}`,
on the node's address (`--kubelet-preferred-address-types`) and `status.daemonEndpoints.kubeletEndpoint.Port`,
over TLS, presenting its kubelet client certificate (`--kubelet-client-certificate`) and checking ours against
`--kubelet-certificate-authority`. The runner answers as a kubelet does:

- **Serving certificate**: requested through the CSR API (signer `kubernetes.io/kubelet-serving`, subject
  `system:node:<node>`, the bridge address and the node names as SANs), approved by the runner and signed by
  kube-controller-manager with the cluster CA. The runner never sees a CA key.
- **Who may read**: a client certificate signed by the cluster CA (the kubeconfig's CA, the kubelet's
  `--client-ca-file`) is required by the TLS handshake; then a SubjectAccessReview asks the API server whether
  that user may `get nodes/proxy` on the node, as the kubelet's webhook authorizer does. Anything else gets 401
  or 403 and no byte of a log.

The log file of a container holds every run (`logs.py`); each run's start offset is kept by its
`ContainerRunner`, so the current run and the previous one (`--previous`) can be cut out of it. There are no
per-line timestamps, so `timestamps`, `sinceSeconds` and `sinceTime` are refused (400), not ignored.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import json
import logging
import os
import re
import secrets
import ssl
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, unquote, urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from podrunner.kube import Kube, KubeError
from podrunner.logs import log_path

if TYPE_CHECKING:
    from podrunner.podworker import PodWorker

__all__ = ["KubeletServer", "LogRequest", "LogRequestError", "parse_log_request", "request_serving_cert"]

log = logging.getLogger("omnikube.e2e.podrunner")

SIGNER = "kubernetes.io/kubelet-serving"
MAX_HEAD = 16 << 10  # request line + headers
CHUNK = 64 << 10
FOLLOW_POLL = 0.2  # seconds between looks at a followed log file
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


class LogRequestError(ValueError):
    """A request the endpoint refuses: `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class LogRequest:
    namespace: str
    pod: str
    container: str
    follow: bool = False
    previous: bool = False
    tail_lines: int | None = None
    limit_bytes: int | None = None


def _flag(query: dict[str, list[str]], name: str) -> bool:
    value = (query.get(name) or ["false"])[-1].lower()
    if value not in ("true", "false", "1", "0", ""):
        raise LogRequestError(400, f"{name}={value!r}: expected true or false")
    return value in ("true", "1")


def _count(query: dict[str, list[str]], name: str, minimum: int) -> int | None:
    if name not in query:
        return None
    raw = query[name][-1]
    try:
        value = int(raw)
    except ValueError:
        raise LogRequestError(400, f"{name}={raw!r}: expected an integer") from None
    if value < minimum:
        raise LogRequestError(400, f"{name}={value}: must be at least {minimum}")
    return value


def parse_log_request(target: str) -> LogRequest:
    """The request line's target (`/containerLogs/ns/pod/container?query`) as a LogRequest, or LogRequestError."""
    url = urlsplit(target)
    parts = [unquote(p) for p in url.path.split("/")]
    if len(parts) != 5 or parts[0] != "" or parts[1] != "containerLogs":
        raise LogRequestError(
            404, f"{url.path!r}: this endpoint serves only /containerLogs/<namespace>/<pod>/<container>"
        )
    namespace, pod, container = parts[2:]
    for what, value in (("namespace", namespace), ("pod", pod), ("container", container)):
        if not _NAME.match(value):
            raise LogRequestError(400, f"{what} {value!r} is not a valid Kubernetes name")
    query = parse_qs(url.query, keep_blank_values=True)
    for name in ("timestamps",):
        if _flag(query, name):
            raise LogRequestError(
                400, "timestamps=true: the pod runner keeps no per-line timestamps; drop --timestamps"
            )
    for name in ("sinceSeconds", "sinceTime"):
        if name in query:
            raise LogRequestError(
                400, f"{name}: the pod runner keeps no per-line timestamps; use --tail or --limit-bytes instead"
            )
    stream = (query.get("stream") or ["All"])[-1]
    if stream != "All":
        raise LogRequestError(400, f"stream={stream!r}: stdout and stderr share one log here; only All is served")
    previous = _flag(query, "previous")
    return LogRequest(
        namespace,
        pod,
        container,
        follow=_flag(query, "follow") and not previous,
        previous=previous,
        tail_lines=_count(query, "tailLines", 0),
        limit_bytes=_count(query, "limitBytes", 1),
    )


def tail_offset(path: Path, start: int, end: int, lines: int) -> int:
    """Offset in [start, end] where the last `lines` lines of that slice of the file begin (reads backwards)."""
    if lines == 0:
        return end
    with open(path, "rb") as f:
        pos, seen = end, 0
        # A final line without its newline still counts as a line; a trailing newline does not start one.
        f.seek(max(end - 1, start))
        skip_last = end > start and f.read(1) == b"\n"
        while pos > start:
            size = min(CHUNK, pos - start)
            pos -= size
            f.seek(pos)
            block = f.read(size)
            limit = len(block) - (1 if skip_last and pos + size == end else 0)
            idx = limit
            while True:
                idx = block.rfind(b"\n", 0, idx)
                if idx < 0:
                    break
                seen += 1
                if seen == lines:
                    return pos + idx + 1
        return start


# --- the serving certificate ------------------------------------------------------------------------


async def request_serving_cert(
    kube: Kube, node: str, names: list[str], ips: list[str], timeout: float = 60
) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) for the kubelet endpoint, signed by the cluster's kubelet-serving signer."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:nodes"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"system:node:{node}"),
        ]
    )
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in names]
    sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(subject)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .sign(key, hashes.SHA256())
    )
    name = f"podrunner-serving-{node}-{secrets.token_hex(4)}"
    path = f"/apis/certificates.k8s.io/v1/certificatesigningrequests/{name}"
    obj = await kube.request(
        "POST",
        "/apis/certificates.k8s.io/v1/certificatesigningrequests",
        body={
            "apiVersion": "certificates.k8s.io/v1",
            "kind": "CertificateSigningRequest",
            "metadata": {"name": name},
            "spec": {
                "request": base64.b64encode(csr.public_bytes(serialization.Encoding.PEM)).decode(),
                "signerName": SIGNER,
                "usages": ["digital signature", "server auth"],
            },
        },
    )
    try:
        obj.setdefault("status", {})["conditions"] = [
            {
                "type": "Approved",
                "status": "True",
                "reason": "PodRunnerServingCert",
                "message": "the omnikube pod runner approves the serving certificate of its own kubelet endpoint",
            }
        ]
        await kube.request("PUT", f"{path}/approval", body=obj)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            obj = await kube.request("GET", path)
            status = obj.get("status") or {}
            if status.get("certificate"):
                cert = base64.b64decode(status["certificate"])
                break
            failed = [c for c in status.get("conditions") or [] if c.get("type") in ("Denied", "Failed")]
            if failed:
                raise KubeError(0, f"CSR {name} for the kubelet endpoint: {failed[0].get('message', failed[0])}")
            if loop.time() > deadline:
                raise KubeError(
                    0,
                    f"CSR {name} ({SIGNER}) was approved but not signed within {timeout}s: is kube-controller-manager "
                    "running with --cluster-signing-cert-file/--cluster-signing-key-file?",
                )
            await asyncio.sleep(0.2)
    finally:
        with contextlib.suppress(KubeError):
            await kube.request("DELETE", path)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert, key_pem


# --- the server ---------------------------------------------------------------------------------------


def _subject(peercert: dict) -> tuple[str, list[str]]:
    """(common name, organizations) of a peer certificate as ssl's getpeercert() describes it."""
    user, groups = "", []
    for rdn in peercert.get("subject") or ():
        for key, value in rdn:
            if key == "commonName":
                user = value
            elif key == "organizationName":
                groups.append(value)
    return user, groups


class KubeletServer:
    """TLS on the node address; only `GET /containerLogs/...` from users the API server authorizes."""

    def __init__(
        self,
        kube: Kube,
        nodes: list[str],
        state_dir: Path,
        find_worker: Callable[[str, str], PodWorker | None],
    ) -> None:
        self.kube, self.nodes, self.state_dir, self.find_worker = kube, nodes, state_dir, find_worker
        self.port = 0
        self._server: asyncio.AbstractServer | None = None
        self._handlers: set[asyncio.Task] = set()

    async def start(self, host: str, client_ca: bytes) -> int:
        """Request the serving certificate, listen on `host`, return the port."""
        cert, key = await request_serving_cert(self.kube, self.nodes[0], self.nodes, [host])
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        # ssl loads a key only from a file: a private temporary one, removed once loaded.
        with tempfile.TemporaryDirectory(prefix="okpr-kubelet-") as tmp:
            cert_file, key_file = Path(tmp) / "tls.crt", Path(tmp) / "tls.key"
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(key)
            cert_file.write_bytes(cert)
            ctx.load_cert_chain(cert_file, key_file)
        ctx.load_verify_locations(cadata=client_ca.decode())
        ctx.verify_mode = ssl.CERT_REQUIRED
        self._server = await asyncio.start_server(self._accept, host, 0, ssl=ctx, limit=MAX_HEAD)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("kubelet endpoint (container logs) on https://%s:%d", host, self.port)
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self._handle(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        except Exception:  # noqa: BLE001 - one bad request must not stop the endpoint
            log.exception("kubelet endpoint: request failed")
        finally:
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 2)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        except (asyncio.LimitOverrunError, asyncio.TimeoutError):
            await _reply(writer, 431, f"request head over {MAX_HEAD} bytes or not complete in 30s")
            return
        line = head.split(b"\r\n", 1)[0].decode("latin-1")
        method, _, rest = line.partition(" ")
        target = rest.rpartition(" ")[0]
        user, groups = _subject(writer.get_extra_info("peercert") or {})
        if not user:
            await _reply(writer, 401, "a client certificate with a common name is required")
            return
        path = urlsplit(target).path
        if not path.startswith("/containerLogs/"):
            # As a Kubernetes Status, so that kubectl exec/attach/port-forward print the message.
            await _reply(
                writer,
                404,
                f"{path}: the omnikube pod runner's nodes serve only container logs (kubectl logs); kubectl exec, "
                "attach and port-forward do not work there. Reach a pod by its IP from this host instead.",
                as_status=True,
            )
            return
        if method != "GET":
            await _reply(writer, 405, f"{method}: only GET is served")
            return
        try:
            req = parse_log_request(target)
        except LogRequestError as e:
            await _reply(writer, e.status, str(e))
            return
        worker = self.find_worker(req.namespace, req.pod)
        node = worker.node if worker is not None else self.nodes[0]
        if not await self._authorized(user, groups, node):
            await _reply(writer, 403, f'user "{user}" may not get nodes/proxy on node {node}; log not served')
            return
        if worker is None or worker.node not in self.nodes:
            await _reply(writer, 404, f'pod "{req.pod}" in namespace "{req.namespace}" does not run on this node')
            return
        await self._serve_log(req, worker, reader, writer)

    async def _authorized(self, user: str, groups: list[str], node: str) -> bool:
        """As the kubelet's webhook authorizer: may `user` get nodes/proxy (containerLogs) on `node`?"""
        try:
            review = await self.kube.request(
                "POST",
                "/apis/authorization.k8s.io/v1/subjectaccessreviews",
                body={
                    "apiVersion": "authorization.k8s.io/v1",
                    "kind": "SubjectAccessReview",
                    "spec": {
                        "user": user,
                        "groups": groups,
                        "resourceAttributes": {
                            "verb": "get",
                            "resource": "nodes",
                            "subresource": "proxy",
                            "name": node,
                        },
                    },
                },
            )
        except KubeError as e:
            log.warning("kubelet endpoint: SubjectAccessReview for %s failed: %s", user, e)
            return False
        return bool((review.get("status") or {}).get("allowed"))

    async def _serve_log(
        self, req: LogRequest, worker: PodWorker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        runner = worker.container_runner(req.container)
        if runner is None:
            await _reply(writer, 400, f'container "{req.container}" is not valid for pod "{req.pod}"')
            return
        path = log_path(self.state_dir, req.namespace, req.pod, req.container)
        starts = list(runner.log_starts)
        if req.previous:
            if len(starts) < 2:
                await _reply(
                    writer, 400, f'previous terminated container "{req.container}" in pod "{req.pod}" not found'
                )
                return
            start, end = starts[-2], starts[-1]
        else:
            if not starts:
                reason = (runner.state.get("waiting") or {}).get("reason", "ContainerCreating")
                await _reply(
                    writer, 400, f'container "{req.container}" in pod "{req.pod}" is waiting to start: {reason}'
                )
                return
            start, end = starts[-1], _size(path)
        run = len(starts)  # runner.log_starts[run] appears when the next run starts
        if req.tail_lines is not None:
            start = await asyncio.to_thread(tail_offset, path, start, end, req.tail_lines)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n")
        pos, budget = start, req.limit_bytes
        peer_gone = asyncio.ensure_future(reader.read(1))  # the API server hangs up when the user stops
        try:
            while True:
                pos, budget = await _copy(path, pos, end, budget, writer)
                if budget == 0 or not req.follow or peer_gone.done():
                    return
                # Follow this run until it ends (then send what it wrote last) or the next run begins.
                if len(runner.log_starts) > run:
                    await _copy(path, pos, runner.log_starts[run], budget, writer)
                    return
                if runner.process is None:
                    await _copy(path, pos, _size(path), budget, writer)
                    return
                await asyncio.sleep(FOLLOW_POLL)
                end = _size(path)
        finally:
            peer_gone.cancel()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


async def _copy(
    path: Path, pos: int, end: int, budget: int | None, writer: asyncio.StreamWriter
) -> tuple[int, int | None]:
    """Send bytes [pos, end) of the file (at most `budget`); the new position and what is left of the budget."""
    if pos >= end:
        return pos, budget
    with open(path, "rb") as f:
        f.seek(pos)
        while pos < end and budget != 0:
            want = min(CHUNK, end - pos, budget if budget is not None else CHUNK)
            data = f.read(want)
            if not data:
                break
            writer.write(data)
            await writer.drain()
            pos += len(data)
            if budget is not None:
                budget -= len(data)
    return pos, budget


async def _reply(writer: asyncio.StreamWriter, status: int, message: str, *, as_status: bool = False) -> None:
    """An error answer: plain text (the API server wraps it for `kubectl logs`) or a Kubernetes Status."""
    reasons = {
        400: "Bad Request",
        401: "Unauthorized",
        403: "Forbidden",
        404: "Not Found",
        405: "Method Not Allowed",
        431: "Request Header Fields Too Large",
    }
    reason = reasons.get(status, "Error")
    if as_status:
        body = json.dumps(
            {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": message,
                "reason": reason.replace(" ", ""),
                "code": status,
            }
        ).encode()
        kind = "application/json"
    else:
        body, kind = (message + "\n").encode(), "text/plain; charset=utf-8"
    writer.write(
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n".encode()
        + body
    )
    await writer.drain()
