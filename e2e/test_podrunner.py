"""The pod runner: pods on its nodes are real processes with their own network and mount namespaces.

Everything Kubernetes-side is real (scheduler, EndpointSlice controller, ServiceAccount admission, token
requests); the pod runner stands in for the kubelet of `runner-node-0` and `runner-node-1`.
"""

from __future__ import annotations

import ast
import json
import os
import ssl
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
from clusterlib import kubectl_json
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509 import NameAttribute
from cryptography.x509.oid import NameOID
from podrunner import NodeConfig, PodRunner
from podrunner.fixtures import RUNNER_NODES, on_runner

pytestmark = pytest.mark.cluster


def wait_for(what: str, check: Callable[[], Any], timeout: float = 30, interval: float = 0.2) -> Any:
    """Poll `check` until it returns something truthy; fail with `what` and the last value otherwise."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def apply(cluster, namespace: str, *objects: dict) -> None:
    cluster.kubectl(
        "-n",
        namespace,
        "apply",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}),
    )


def get_pod(cluster, ns: str, name: str) -> dict:
    return kubectl_json(cluster, "-n", ns, "get", "pod", name)


def condition(pod: dict, kind: str) -> str | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c["type"] == kind:
            return c["status"]
    return None


def container_status(pod: dict, name: str | None = None) -> dict:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    for s in statuses:
        if name is None or s["name"] == name:
            return s
    return {}


def pod(name: str, containers: list[dict], labels: dict | None = None, **spec: Any) -> dict:
    return on_runner(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": {"app": name, **(labels or {})}},
            "spec": {"terminationGracePeriodSeconds": 5, "containers": containers, **spec},
        }
    )


def http_server(port: int = 8080, delay: float = 0, **extra: Any) -> dict:
    """A container serving /srv (an emptyDir holding a file `name` with the pod's name) over HTTP."""
    script = f"sleep {delay}; echo $POD_NAME > /srv/name; cd /srv && exec python -u -m http.server {port}"
    return {
        "name": "web",
        "image": "python:3.11",
        "command": ["sh", "-c", script],
        "ports": [{"name": "http", "containerPort": port}],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "volumeMounts": [{"name": "srv", "mountPath": "/srv"}],
        "readinessProbe": {"httpGet": {"path": "/name", "port": "http"}, "periodSeconds": 1},
        **extra,
    }


SRV = [{"name": "srv", "emptyDir": {}}]


def test_http_pod_runs_with_its_own_ip_and_is_ready_after_its_probe(cluster, namespace, podrunner: PodRunner):
    apply(cluster, namespace, pod("web", [http_server(delay=3)], volumes=SRV))
    running = wait_for(
        "web Running with a pod IP",
        lambda: (
            (p := get_pod(cluster, namespace, "web"))["status"].get("podIP") and p["status"]["phase"] == "Running" and p
        ),
    )
    # The server sleeps 3s before listening: Running with an IP, but not Ready until the probe passes.
    assert condition(running, "Ready") == "False"
    assert container_status(running)["started"] is True and container_status(running)["ready"] is False
    assert running["spec"]["nodeName"] in RUNNER_NODES
    ip = running["status"]["podIP"]
    assert ip.startswith("10.213.") and running["status"]["hostIP"] != ip
    ready = wait_for("web Ready", lambda: condition(p := get_pod(cluster, namespace, "web"), "Ready") == "True" and p)
    assert container_status(ready)["ready"] is True
    assert {"PodScheduled", "Initialized", "ContainersReady", "Ready"} <= {
        c["type"] for c in ready["status"]["conditions"]
    }
    assert httpx.get(f"http://{ip}:8080/name", timeout=5).text.strip() == "web"
    assert "GET /name" in podrunner.logs(namespace, "web", "web")  # the probes' requests, in its log
    assert podrunner.exec(namespace, "web", "web", ["cat", "/etc/hostname"])[1].strip() == "web"


def test_pods_on_the_same_port_and_their_endpointslice(cluster, namespace, podrunner: PodRunner):
    never_ready = http_server(readinessProbe={"tcpSocket": {"port": 9999}, "periodSeconds": 1})
    apply(
        cluster,
        namespace,
        pod("a", [http_server()], volumes=SRV, nodeName="runner-node-0", labels={"svc": "web"}),
        pod("b", [http_server()], volumes=SRV, nodeName="runner-node-1", labels={"svc": "web"}),
        pod("c", [never_ready], volumes=SRV, labels={"svc": "web"}),
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web"},
            "spec": {"selector": {"svc": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]},
        },
    )
    ips = {}
    for name in "ab":
        p = wait_for(
            f"{name} Ready", lambda n=name: condition(q := get_pod(cluster, namespace, n), "Ready") == "True" and q
        )
        ips[name] = p["status"]["podIP"]
    assert ips["a"] != ips["b"]
    for name, ip in ips.items():  # both listen on 8080, each in its own network namespace
        assert httpx.get(f"http://{ip}:8080/name", timeout=5).text.strip() == name
    c_ip = wait_for("c has an IP", lambda: get_pod(cluster, namespace, "c")["status"].get("podIP"))

    def endpoints() -> dict[str, bool] | None:
        slices = kubectl_json(
            cluster, "-n", namespace, "get", "endpointslices", "-l", "kubernetes.io/service-name=web"
        )["items"]
        found = {
            a: bool(e["conditions"].get("ready"))
            for s in slices
            for e in s.get("endpoints") or []
            for a in e["addresses"]
        }
        want = {ips["a"]: True, ips["b"]: True, c_ip: False}
        return found if found == want else None

    # The controller-manager's EndpointSlice controller fills the slice from pod IPs and readiness.
    found = wait_for("EndpointSlice with a, b ready and c not ready", endpoints)
    assert sorted(ip for ip, ok in found.items() if ok) == sorted(ips.values())


def test_volumes_env_and_downward_api_inside_the_pod(cluster, namespace, podrunner: PodRunner):
    script = textwrap.dedent("""
        import json, os, pathlib, sys
        def read(p):
            return pathlib.Path(p).read_text() if os.path.exists(p) else None
        def writable(p):
            try:
                pathlib.Path(p, "probe").write_text("x")
                return True
            except OSError:
                return False
        shm = os.statvfs("/dev/shm")
        pathlib.Path("/dev/shm/from-writer").write_text("shared")
        print(json.dumps({
            "config": read("/etc/omnikube/settings.yaml"), "item": read("/etc/items/renamed/greeting"),
            "secret": read("/var/secret/password"), "config_ro": not writable("/etc/omnikube"),
            "cache_writable": writable("/cache"), "shm_bytes": shm.f_blocks * shm.f_frsize,
            "env": {k: v for k, v in os.environ.items() if k.startswith(("MY_", "CFG_", "KUBERNETES_SERVICE_H"))},
            "args": sys.argv[1:], "cwd": os.getcwd(), "token": os.path.exists(
                "/var/run/secrets/kubernetes.io/serviceaccount/token"),
            "hostname": open("/etc/hostname").read().strip(), "hosts": read("/etc/hosts"),
        }), flush=True)
    """)
    reader = "for i in $(seq 100); do [ -f /dev/shm/from-writer ] && break; sleep 0.1; done; cat /dev/shm/from-writer"
    apply(
        cluster,
        namespace,
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "cfg"},
            "data": {"settings.yaml": "answer: 42\n", "greeting": "hello", "MODE": "fast"},
        },
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "sec"}, "stringData": {"password": "s3cret"}},
        pod(
            "vols",
            [
                {
                    "name": "writer",
                    "image": "python:3.11",
                    "command": ["python", "-c", script],
                    "args": ["$(MY_POD_NAME)", "$$(MY_POD_NAME)", "$(UNDEFINED)"],
                    "workingDir": "/cache/work",
                    "env": [
                        {"name": "MY_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                        {"name": "MY_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                        {"name": "MY_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
                        {"name": "MY_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                        {"name": "MY_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                        {"name": "MY_LABEL", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
                        {"name": "MY_PASSWORD", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "password"}}},
                        {"name": "MY_GREETING", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "greeting"}}},
                        {
                            "name": "MY_MISSING",
                            "valueFrom": {"configMapKeyRef": {"name": "nope", "key": "x", "optional": True}},
                        },
                        {"name": "MY_COMPOSED", "value": "$(MY_POD_NAME).$(MY_NAMESPACE)"},
                        {
                            "name": "MY_MEMORY_MI",
                            "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}},
                        },
                    ],
                    "envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "CFG_"}],
                    "resources": {"limits": {"memory": "256Mi", "cpu": "1"}},
                    "volumeMounts": [
                        {"name": "cfg", "mountPath": "/etc/omnikube"},
                        {"name": "items", "mountPath": "/etc/items"},
                        {"name": "sec", "mountPath": "/var/secret", "readOnly": True},
                        {"name": "cache", "mountPath": "/cache"},
                        {"name": "dshm", "mountPath": "/dev/shm"},
                    ],
                },
                {
                    "name": "reader",
                    "image": "busybox",
                    "command": ["sh", "-c", reader],
                    "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
                },
            ],
            restartPolicy="Never",
            volumes=[
                {
                    "name": "cfg",
                    "configMap": {"name": "cfg", "items": [{"key": "settings.yaml", "path": "settings.yaml"}]},
                },
                {
                    "name": "items",
                    "configMap": {"name": "cfg", "items": [{"key": "greeting", "path": "renamed/greeting"}]},
                },
                {"name": "sec", "secret": {"secretName": "sec"}},
                {"name": "cache", "emptyDir": {}},
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}},
            ],
        ),
    )
    done = wait_for(
        "vols Succeeded",
        lambda: (p := get_pod(cluster, namespace, "vols"))["status"]["phase"] in ("Succeeded", "Failed") and p,
    )
    out = podrunner.logs(namespace, "vols", "writer")
    assert done["status"]["phase"] == "Succeeded", (done["status"], out, podrunner.logs(namespace, "vols", "reader"))
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["config"] == "answer: 42\n"
    assert seen["item"] == "hello"
    assert seen["secret"] == "s3cret"
    assert seen["config_ro"] is True and seen["cache_writable"] is True
    assert seen["shm_bytes"] == 64 * 1024 * 1024
    assert seen["cwd"] == "/cache/work"
    assert seen["token"] is True  # the ServiceAccount admission plugin's projected volume, with a real token
    uid, ip = done["metadata"]["uid"], done["status"]["podIP"]
    assert seen["env"] == {
        "MY_POD_NAME": "vols",
        "MY_NAMESPACE": namespace,
        "MY_UID": uid,
        "MY_POD_IP": ip,
        "MY_NODE": done["spec"]["nodeName"],
        "MY_LABEL": "vols",
        "MY_PASSWORD": "s3cret",
        "MY_GREETING": "hello",
        "MY_COMPOSED": f"vols.{namespace}",
        "MY_MEMORY_MI": "256",
        "CFG_settings.yaml": "answer: 42\n",
        "CFG_greeting": "hello",
        "CFG_MODE": "fast",
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
    }
    assert seen["args"] == ["vols", "$(MY_POD_NAME)", "$(UNDEFINED)"]
    assert seen["hostname"] == "vols" and f"{ip}\tvols" in seen["hosts"]
    # Colocated containers share the pod's /dev/shm; nothing of the pod's mounts shows on the host.
    assert podrunner.logs(namespace, "vols", "reader").strip() == "shared"
    assert not os.path.exists("/etc/omnikube") and not os.path.exists("/etc/items")


def test_secret_and_configmap_volumes_follow_their_objects(cluster, namespace, podrunner: PodRunner):
    """As with the kubelet: a changed Secret or ConfigMap reaches a running container's mounted files (no
    restart); a `subPath` mount keeps the content it started with."""
    apply(
        cluster,
        namespace,
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "rot"}, "stringData": {"key": "one"}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "rotcfg"}, "data": {"a": "1", "b": "2"}},
        pod(
            "rotating",
            [
                {
                    "name": "app",
                    "image": "busybox",
                    "command": ["sh", "-c", "exec sleep 3600"],
                    "volumeMounts": [
                        {"name": "sec", "mountPath": "/var/key", "readOnly": True},
                        {"name": "cfg", "mountPath": "/etc/cfg"},
                        {"name": "cfg", "mountPath": "/etc/pinned-a", "subPath": "a"},
                    ],
                }
            ],
            volumes=[
                {"name": "sec", "secret": {"secretName": "rot", "items": [{"key": "key", "path": "api-key"}]}},
                {"name": "cfg", "configMap": {"name": "rotcfg"}},
            ],
        ),
    )
    wait_for("rotating Running", lambda: get_pod(cluster, namespace, "rotating")["status"].get("phase") == "Running")

    def cat(path: str) -> str:
        return podrunner.exec(namespace, "rotating", "app", ["cat", path])[1]

    def listing() -> list[str]:
        return sorted(podrunner.exec(namespace, "rotating", "app", ["ls", "/etc/cfg"])[1].split())

    assert cat("/var/key/api-key") == "one" and listing() == ["a", "b"]
    apply(
        cluster,
        namespace,
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "rot"}, "stringData": {"key": "two"}},
    )
    patch = [{"op": "replace", "path": "/data/a", "value": "10"}, {"op": "remove", "path": "/data/b"}]
    cluster.kubectl("-n", namespace, "patch", "configmap", "rotcfg", "--type=json", "-p", json.dumps(patch))
    wait_for("the rotated secret in the container", lambda: cat("/var/key/api-key") == "two")
    wait_for("the configmap's new content", lambda: cat("/etc/cfg/a") == "10" and listing() == ["a"])
    assert cat("/etc/pinned-a") == "1"
    assert container_status(get_pod(cluster, namespace, "rotating"))["restartCount"] == 0


def test_init_containers_and_a_claim_on_a_host_path_volume(cluster, namespace, podrunner: PodRunner, tmp_path):
    """An init container fills a PVC (bound by the PV controller to a hostPath PV) before the app starts."""
    data = tmp_path / "pv"
    data.mkdir()
    pv_name = f"{namespace}-pv"
    apply(
        cluster,
        namespace,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": pv_name},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": "",
                "persistentVolumeReclaimPolicy": "Retain",
                "hostPath": {"path": str(data)},
            },
        },
    )
    # Once the PV controller has seen the PV, it binds the claim at once (else at its next 15s resync).
    wait_for(
        "PV Available",
        lambda: kubectl_json(cluster, "get", "pv", pv_name).get("status", {}).get("phase") == "Available",
    )
    apply(
        cluster,
        namespace,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "claim"},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": "",
                "volumeName": pv_name,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
        pod(
            "init",
            [
                {
                    "name": "app",
                    "image": "x",
                    "command": ["sh", "-c", "cat /data/made-by-init"],
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                }
            ],
            restartPolicy="OnFailure",
            initContainers=[
                {
                    "name": "fill",
                    "image": "x",
                    "command": ["sh", "-c", "echo filled > /data/made-by-init"],
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                }
            ],
            volumes=[{"name": "data", "persistentVolumeClaim": {"claimName": "claim"}}],
        ),
    )
    try:
        done = wait_for(
            "init Succeeded", lambda: (p := get_pod(cluster, namespace, "init"))["status"]["phase"] == "Succeeded" and p
        )
        init = done["status"]["initContainerStatuses"][0]
        assert init["state"]["terminated"]["reason"] == "Completed"
        assert condition(done, "Initialized") == "True"
        assert podrunner.logs(namespace, "init", "app").strip() == "filled"
        assert (data / "made-by-init").read_text() == "filled\n"  # the host folder behind the PV
    finally:
        cluster.kubectl("delete", "pv", pv_name, "--wait=false", check=False)


def test_a_failing_container_restarts_into_crash_loop_back_off(cluster, namespace, podrunner: PodRunner):
    apply(
        cluster,
        namespace,
        pod("crash", [{"name": "c", "image": "x", "command": ["sh", "-c", "echo attempt; exit 3"]}]),
        pod("once", [{"name": "c", "image": "x", "command": ["sh", "-c", "exit 4"]}], restartPolicy="Never"),
    )
    seen_backoff = wait_for(
        "CrashLoopBackOff with restartCount >= 2",
        lambda: (
            (s := container_status(get_pod(cluster, namespace, "crash"))).get("restartCount", 0) >= 2
            and s["state"].get("waiting", {}).get("reason") == "CrashLoopBackOff"
            and s
        ),
        timeout=40,
        interval=0.1,
    )
    assert seen_backoff["lastState"]["terminated"]["exitCode"] == 3
    assert seen_backoff["lastState"]["terminated"]["reason"] == "Error"
    assert "back-off" in seen_backoff["state"]["waiting"]["message"]
    assert podrunner.logs(namespace, "crash", "c").count("attempt") >= 3
    once = wait_for(
        "once Failed", lambda: (p := get_pod(cluster, namespace, "once"))["status"]["phase"] == "Failed" and p
    )
    assert container_status(once)["state"]["terminated"]["exitCode"] == 4
    assert container_status(once)["restartCount"] == 0


def test_a_failing_liveness_probe_restarts_the_container(cluster, namespace, podrunner: PodRunner):
    # Alive for ~2s (the marker in the pod's own /dev/shm), then the exec probe fails twice: restart.
    script = "touch /dev/shm/alive; echo up; sleep 2; rm /dev/shm/alive; exec sleep 1000"
    apply(
        cluster,
        namespace,
        pod(
            "sick",
            [
                {
                    "name": "c",
                    "image": "x",
                    "command": ["sh", "-c", script],
                    "livenessProbe": {
                        "exec": {"command": ["test", "-f", "/dev/shm/alive"]},
                        "periodSeconds": 1,
                        "failureThreshold": 2,
                    },
                }
            ],
            terminationGracePeriodSeconds=1,
        ),
    )
    first_ip = wait_for("sick has an IP", lambda: get_pod(cluster, namespace, "sick")["status"].get("podIP"))
    restarted = wait_for(
        "a liveness restart",
        lambda: (s := container_status(get_pod(cluster, namespace, "sick"))).get("restartCount", 0) >= 1 and s,
        timeout=30,
    )
    last = restarted["lastState"]["terminated"]
    assert last["exitCode"] == 137 and "Liveness probe failed" in last.get("message", "")  # PID 1 ignored SIGTERM
    assert get_pod(cluster, namespace, "sick")["status"]["podIP"] == first_ip  # same sandbox, same IP
    events = kubectl_json(cluster, "-n", namespace, "get", "events", "--field-selector", "involvedObject.name=sick")[
        "items"
    ]
    assert {"Unhealthy", "Killing", "Started"} <= {e["reason"] for e in events}


def _netns_holders(netns: str) -> list[int]:
    """PIDs of processes in network namespace `netns` (as /proc/PID/ns/net reads, e.g. net:[4026532])"""
    holders = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "ns" / "net") == netns:
                    holders.append(int(entry.name))
            except OSError:
                pass
    return holders


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


def test_deleting_a_pod_stops_its_processes_and_removes_its_netns(cluster, namespace, podrunner: PodRunner):
    script = 'trap "echo got SIGTERM; exit 0" TERM; sleep 1000 & while true; do sleep 0.2; done'
    apply(
        cluster,
        namespace,
        pod(
            "doomed", [{"name": "c", "image": "x", "command": ["sh", "-c", script]}], terminationGracePeriodSeconds=600
        ),
    )
    wait_for("doomed Running", lambda: get_pod(cluster, namespace, "doomed")["status"]["phase"] == "Running")
    info = wait_for(
        "sandbox info",
        lambda: (i := podrunner.sandbox_info(namespace, "doomed")) and i["container_pids"].get("c") and i,
    )
    pids = [info["unshare_pid"], info["agent_pid"], info["container_pids"]["c"]]
    assert all(_alive(p) for p in pids) and _netns_holders(info["netns"]) and _link_exists(info["veth"])
    # The grace period (600 s) is far past kubectl's 60 s: the delete returns only because the container
    # ended on SIGTERM, never because the runner killed it when the grace period ran out.
    cluster.kubectl("-n", namespace, "delete", "pod", "doomed", "--wait=true", timeout=60)
    assert "got SIGTERM" in podrunner.logs(namespace, "doomed", "c")
    assert not any(_alive(p) for p in pids)
    assert _netns_holders(info["netns"]) == []
    assert not _link_exists(info["veth"])
    # the runner forgets the sandbox just after the API server forgets the pod (CI saw it a moment late)
    wait_for("the sandbox forgotten", lambda: podrunner.sandbox_info(namespace, "doomed") is None)


def test_a_gpu_requesting_pod_schedules_onto_the_runner_gpu_node(cluster, namespace, podrunner: PodRunner):
    apply(
        cluster,
        namespace,
        pod(
            "gpu",
            [
                {
                    "name": "c",
                    "image": "x",
                    "command": ["sleep", "1000"],
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                }
            ],
        ),
    )
    p = wait_for(
        "gpu Running", lambda: (q := get_pod(cluster, namespace, "gpu"))["status"].get("phase") == "Running" and q
    )
    assert p["spec"]["nodeName"] == "runner-node-0"


def test_runner_shutdown_leaves_nothing_behind(cluster, namespace, tmp_path):
    """A runner of its own (second bridge, node `runner-cleanup-0`) is stopped with a pod still running."""
    state = tmp_path / "state"
    node = "runner-cleanup-0"
    with PodRunner(cluster.kubeconfig, [NodeConfig(node)], state) as runner:
        bridge = json.loads((state / "runner.json").read_text())["bridge"]
        assert _link_exists(bridge)
        apply(
            cluster,
            namespace,
            pod(
                "stay",
                [
                    {
                        "name": "c",
                        "image": "x",
                        "command": ["sh", "-c", "sleep 1000 & sleep 1000"],
                        "volumeMounts": [
                            {"name": "m", "mountPath": "/models"},
                            {"name": "shm", "mountPath": "/dev/shm"},
                        ],
                    }
                ],
                nodeSelector={"kubernetes.io/hostname": node},
                volumes=[{"name": "m", "emptyDir": {}}, {"name": "shm", "emptyDir": {"medium": "Memory"}}],
            ),
        )
        wait_for("stay Running", lambda: get_pod(cluster, namespace, "stay")["status"]["phase"] == "Running")
        info = wait_for(
            "sandbox info", lambda: (i := runner.sandbox_info(namespace, "stay")) and i["container_pids"].get("c") and i
        )
        pids = [info["unshare_pid"], info["agent_pid"], info["container_pids"]["c"]]
        assert all(_alive(p) for p in pids)
        # The pod's mounts exist only in its own mount namespaces, never in the host's.
        assert " /models " in _read(f"/proc/{info['container_pids']['c']}/mountinfo")
        assert str(state) not in _read("/proc/self/mountinfo") and not os.path.exists("/models")
    assert not any(_alive(p) for p in pids)
    assert _netns_holders(info["netns"]) == []
    assert not _link_exists(info["veth"]) and not _link_exists(bridge)
    mounts = [
        line
        for pid in os.listdir("/proc")
        if pid.isdigit()
        for line in _read(f"/proc/{pid}/mountinfo").splitlines()
        if str(state) in line
    ]
    assert mounts == []
    assert not os.path.exists("/models")
    assert not (state / "runner.json").exists()
    assert cluster.kubectl("get", "node", node, check=False).returncode != 0  # the Node is gone too


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def test_a_tmp_empty_dir_hides_neither_etc_hosts_nor_a_checkout_under_tmp(cluster, namespace, tmp_path):
    """A pod with an emptyDir on /tmp (the chart's operator pod has one) while the runner's state folder and the
    "image" (a checkout with its venv) live under /tmp, as in a clone under /tmp: the volume must not hide the pod's
    /etc/hosts, its log, or the interpreter the container runs. A runner of its own, whose venv is under /tmp."""
    checkout = tmp_path / "checkout"
    venv_bin = checkout / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").symlink_to(sys.executable)
    host_only = Path("/tmp") / f"okpr-host-only-{namespace}"
    host_only.write_text("the host's /tmp")
    node = "runner-tmpdir-0"
    script = textwrap.dedent(
        """
        import os, sys
        print("HOSTS", open("/etc/hosts").read().split("\\n")[-2])
        print("TMP", sorted(os.listdir("/tmp")))
        print("EXE", os.environ["PATH"].split(":")[0])
        open("/tmp/written-in-pod", "w").write("x")
        """
    )
    try:
        with PodRunner(cluster.kubeconfig, [NodeConfig(node)], tmp_path / "state", venv_bin=venv_bin) as runner:
            apply(
                cluster,
                namespace,
                pod(
                    "tmpdir",
                    [
                        {
                            "name": "c",
                            "image": "x",
                            "command": ["python", "-c", script],  # found only in the venv under /tmp
                            "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                        }
                    ],
                    restartPolicy="Never",
                    nodeSelector={"kubernetes.io/hostname": node},
                    volumes=[{"name": "tmp", "emptyDir": {}}],
                ),
            )
            done = wait_for(
                "tmpdir finished",
                lambda: (
                    (p := get_pod(cluster, namespace, "tmpdir"))["status"].get("phase") in ("Succeeded", "Failed") and p
                ),
                timeout=60,
            )
            out = runner.logs(namespace, "tmpdir", "c")
            assert done["status"]["phase"] == "Succeeded", (container_status(done), out)
            ip = done["status"]["podIP"]
            assert f"HOSTS {ip}\ttmpdir" in out  # the pod's own /etc/hosts, not the host's
            # /tmp is the emptyDir: empty but for the paths down to the image folders under /tmp (the checkout
            # here; this repository too when it lives under /tmp), which are the host's.
            image_tops = {Path(p).relative_to("/tmp").parts[0] for p in runner.image_paths() if p.startswith("/tmp/")}
            listed = next(line for line in out.splitlines() if line.startswith("TMP "))
            assert sorted(image_tops) == ast.literal_eval(listed[4:])
            assert tmp_path.relative_to("/tmp").parts[0] in image_tops and host_only.name not in listed
            assert f"EXE {venv_bin}" in out
            assert not Path("/tmp/written-in-pod").exists() and host_only.exists()
    finally:
        host_only.unlink(missing_ok=True)


# --- kubectl logs: the API server proxies pods/log to the runner's kubelet endpoint --------------------------


def _logs(cluster, namespace: str, *args: str) -> subprocess.CompletedProcess:
    return cluster.kubectl("-n", namespace, "logs", *args, check=False, timeout=60)


def test_kubectl_logs_of_a_runner_pod_with_tail_limit_and_follow(cluster, namespace, podrunner: PodRunner):
    counter = "i=0; while true; do echo tick $i; i=$((i+1)); sleep 0.2; done"
    apply(
        cluster,
        namespace,
        pod(
            "chatty",
            [
                {"name": "counter", "image": "x", "command": ["sh", "-c", counter]},
                {"name": "once", "image": "x", "command": ["sh", "-c", "echo hello from once; exec sleep 1000"]},
            ],
        ),
        pod(
            "ender",
            [{"name": "c", "image": "x", "command": ["sh", "-c", "echo start; sleep 4; echo end"]}],
            restartPolicy="Never",
        ),
    )
    wait_for("chatty Running", lambda: get_pod(cluster, namespace, "chatty")["status"].get("phase") == "Running")
    wait_for("a few ticks", lambda: "tick 3" in podrunner.logs(namespace, "chatty", "counter"))
    once = _logs(cluster, namespace, "chatty", "-c", "once")
    assert once.returncode == 0, once.stderr
    assert once.stdout == "hello from once\n"
    tail = _logs(cluster, namespace, "chatty", "-c", "counter", "--tail=2").stdout.splitlines()
    assert len(tail) == 2 and all(line.startswith("tick ") for line in tail)
    assert int(tail[1].split()[1]) == int(tail[0].split()[1]) + 1
    assert _logs(cluster, namespace, "chatty", "-c", "counter", "--limit-bytes=6").stdout == "tick 0"
    no_previous = _logs(cluster, namespace, "chatty", "-c", "counter", "--previous")
    assert no_previous.returncode != 0 and 'previous terminated container "counter"' in no_previous.stderr
    stamped = _logs(cluster, namespace, "chatty", "-c", "counter", "--timestamps")
    assert stamped.returncode != 0 and "no per-line timestamps" in stamped.stderr  # refused, not ignored
    unknown = _logs(cluster, namespace, "chatty", "-c", "nope")
    assert unknown.returncode != 0 and "nope" in unknown.stderr
    # What the endpoint does not serve says so, instead of a bare protocol error.
    for verb in (["exec", "chatty", "-c", "once", "--", "true"], ["port-forward", "chatty", "18080:8080"]):
        refused = cluster.kubectl("-n", namespace, *verb, check=False, timeout=30)
        assert refused.returncode != 0 and "serve only container logs" in refused.stderr, (verb, refused.stderr)

    # -f streams what the container writes after the call: ticks beyond the last one written before it.
    before = int(podrunner.logs(namespace, "chatty", "counter").split()[-1])
    follow = subprocess.Popen(
        [cluster.binary("kubectl"), "-n", namespace, "logs", "-f", "chatty", "-c", "counter"],
        env=cluster.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert follow.stdout is not None
        seen = -1
        deadline = time.monotonic() + 60
        while seen <= before + 5 and time.monotonic() < deadline:
            line = follow.stdout.readline()
            assert line, follow.stderr.read() if follow.stderr else "kubectl logs -f ended"
            seen = int(line.split()[1])
        assert seen > before + 5
    finally:
        follow.kill()
        follow.wait()

    # -f of a container that ends: the stream ends with it, holding everything it wrote.
    wait_for("ender started", lambda: "start" in podrunner.logs(namespace, "ender", "c"))
    ended = cluster.kubectl("-n", namespace, "logs", "-f", "ender", timeout=60)
    assert ended.stdout == "start\nend\n"


def test_kubectl_logs_previous_shows_the_run_before_a_restart(cluster, namespace, podrunner: PodRunner):
    script = "n=$(($(cat /state/n 2>/dev/null || echo 0) + 1)); echo $n > /state/n; echo run $n; sleep 3; exit 3"
    apply(
        cluster,
        namespace,
        pod(
            "crasher",
            [
                {
                    "name": "c",
                    "image": "x",
                    "command": ["sh", "-c", script],
                    "volumeMounts": [{"name": "state", "mountPath": "/state"}],
                }
            ],
            volumes=[{"name": "state", "emptyDir": {}}],
        ),
    )

    def current_and_previous() -> tuple[str, str] | None:
        status = container_status(get_pod(cluster, namespace, "crasher"))
        if status.get("restartCount", 0) < 1 or "running" not in status.get("state", {}):
            return None
        now, before = _logs(cluster, namespace, "crasher").stdout, _logs(cluster, namespace, "crasher", "-p").stdout
        return (now, before) if now.startswith("run ") and before.startswith("run ") else None

    now, before = wait_for("a restarted crasher", current_and_previous, timeout=90, interval=0.5)
    assert now.count("run ") == 1 and before.count("run ") == 1  # one run each, not the whole file
    assert int(before.split()[1]) == int(now.split()[1]) - 1


def _client_cert(pki: Path, out: Path, name: str, cn: str | None) -> tuple[Path, Path]:
    """A client certificate signed by the cluster CA for user `cn` (None: a subject without a common name)."""
    ca_cert = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(timezone.utc)
    attr = NameAttribute(NameOID.COMMON_NAME, cn) if cn else NameAttribute(NameOID.ORGANIZATION_NAME, "no-cn")
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([attr]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(hours=1))
        .add_extension(x509.ExtendedKeyUsage([x509.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    crt, pem = out / f"{name}.crt", out / f"{name}.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return crt, pem


def test_the_kubelet_endpoint_serves_only_clients_the_api_server_authorizes(cluster, namespace, podrunner, tmp_path):
    """Straight to the runner's endpoint: no client certificate, one without a user name, or one for a user
    without nodes/proxy gets nothing; the cluster admin's (system:masters), as on a real kubelet, gets the log;
    what is not a log request is refused."""
    apply(
        cluster,
        namespace,
        pod("secret-log", [{"name": "c", "image": "x", "command": ["sh", "-c", "echo s3cr3t; exec sleep 1000"]}]),
    )
    wait_for("secret-log wrote", lambda: "s3cr3t" in podrunner.logs(namespace, "secret-log", "c"))
    node = kubectl_json(cluster, "get", "node", get_pod(cluster, namespace, "secret-log")["spec"]["nodeName"])
    address = next(a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP")
    port = node["status"]["daemonEndpoints"]["kubeletEndpoint"]["Port"]
    assert port > 0
    base = f"https://{address}:{port}"
    url = f"{base}/containerLogs/{namespace}/secret-log/c"
    pki = Path(cluster.workdir) / "pki"

    def client(cert: tuple[Path, Path] | None = None) -> httpx.Client:
        ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))  # the endpoint's cert is the cluster's
        if cert:
            ctx.load_cert_chain(*cert)
        return httpx.Client(verify=ctx, timeout=10, trust_env=False)

    with pytest.raises(httpx.HTTPError):  # the TLS handshake wants a client certificate
        client().get(url).raise_for_status()
    anonymous = client(_client_cert(pki, tmp_path, "anonymous", None)).get(url)
    assert anonymous.status_code == 401 and "s3cr3t" not in anonymous.text
    denied = client(_client_cert(pki, tmp_path, "nobody", "nobody")).get(url)
    assert denied.status_code == 403 and "s3cr3t" not in denied.text and "nodes/proxy" in denied.text

    admin = client((pki / "admin.crt", pki / "admin.key"))
    got = admin.get(url)
    assert got.status_code == 200 and got.text == "s3cr3t\n"
    assert admin.post(url).status_code == 405
    missing = admin.get(f"{base}/containerLogs/{namespace}/no-such-pod/c")
    assert missing.status_code == 404 and "does not run on this node" in missing.text
    assert admin.get(f"{base}/exec/{namespace}/secret-log/c").json()["reason"] == "NotFound"
    assert admin.get(url, headers={"X-Big": "x" * (20 << 10)}).status_code == 431  # the head is bounded


def test_a_runner_without_a_cluster_ca_runs_pods_but_serves_no_logs(cluster, namespace, tmp_path, caplog):
    """A kubeconfig that names no CA (TLS unverified) gives the runner nothing to check client certificates
    against: it runs pods, advertises no kubelet port and says why in its log, rather than serve logs to anyone."""
    kubeconfig = json.loads(Path(cluster.kubeconfig).read_text())
    kubeconfig["clusters"][0]["cluster"] = {
        "server": kubeconfig["clusters"][0]["cluster"]["server"],
        "insecure-skip-tls-verify": True,
    }
    (tmp_path / "kubeconfig").write_text(json.dumps(kubeconfig))
    node = "runner-noca-0"
    with PodRunner(tmp_path / "kubeconfig", [NodeConfig(node)], tmp_path / "state") as runner:
        assert kubectl_json(cluster, "get", "node", node)["status"]["daemonEndpoints"]["kubeletEndpoint"]["Port"] == 0
        apply(
            cluster,
            namespace,
            pod(
                "noca",
                [{"name": "c", "image": "x", "command": ["sh", "-c", "echo hi; exec sleep 1000"]}],
                nodeSelector={"kubernetes.io/hostname": node},
            ),
        )
        wait_for("noca wrote", lambda: "hi" in runner.logs(namespace, "noca", "c"))
        assert _logs(cluster, namespace, "noca").returncode != 0
    assert "the kubeconfig names no CA" in caplog.text


def test_termination_messages_from_the_file_or_the_log_tail(cluster, namespace, podrunner: PodRunner):
    said = {"name": "c", "image": "x", "command": ["sh", "-c", "echo -n '{\"why\": 1}' > /dev/termination-log; exit 2"]}
    custom = {
        "name": "c",
        "image": "x",
        "command": ["sh", "-c", "echo -n done > /tmp-term/msg; exit 0"],
        "terminationMessagePath": "/tmp-term/msg",
    }
    logged = {
        "name": "c",
        "image": "x",
        "command": ["sh", "-c", "echo first; echo last words; exit 3"],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    # The pod's /dev is a mirror of the host's once /dev/termination-log exists: /dev/shm is still its own.
    shm = {"name": "c", "image": "x", "command": ["sh", "-c", "touch /dev/shm/podrunner-probe-$$ && ls /dev/shm"]}
    apply(
        cluster,
        namespace,
        pod("said", [said], restartPolicy="Never"),
        pod("custom", [custom], restartPolicy="Never"),
        pod("logged", [logged], restartPolicy="Never"),
        pod("shm", [shm], restartPolicy="Never"),
    )

    def finished(name: str) -> dict:
        return wait_for(
            f"{name} finished",
            lambda: (s := container_status(get_pod(cluster, namespace, name))).get("state", {}).get("terminated") and s,
            timeout=60,
        )["state"]["terminated"]

    assert finished("said")["message"] == '{"why": 1}'
    assert finished("custom")["message"] == "done"
    assert finished("logged")["message"].splitlines() == ["first", "last words"]
    assert finished("shm")["exitCode"] == 0
    assert not list(Path("/dev/shm").glob("podrunner-probe-*")), "the pod wrote into the host's /dev/shm"


def test_headless_service_names_resolve_in_pods_and_follow_their_endpoints(cluster, namespace, podrunner: PodRunner):
    client = {"name": "c", "image": "x", "command": ["sleep", "600"]}
    apply(cluster, namespace, pod("client", [client], terminationGracePeriodSeconds=1))
    wait_for("client running", lambda: container_status(get_pod(cluster, namespace, "client")).get("started"))

    def resolve(name: str) -> str:
        code, out = podrunner.exec(namespace, "client", "c", ["getent", "hosts", name])
        return out.split()[0] if code == 0 and out.strip() else ""

    assert resolve(f"db.{namespace}.svc") == ""  # no Service yet
    apply(
        cluster,
        namespace,
        pod("db", [http_server()], volumes=SRV, labels={"svc": "db"}),
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "db"},
            "spec": {"clusterIP": "None", "selector": {"svc": "db"}, "ports": [{"name": "http", "port": 8080}]},
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web"},
            "spec": {"selector": {"svc": "db"}, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]},
        },
    )
    db_ip = wait_for("db ready", lambda: condition(p := get_pod(cluster, namespace, "db"), "Ready") == "True" and p)[
        "status"
    ]["podIP"]
    # A running container sees the new name without a restart, under every form the search path allows.
    for name in (f"db.{namespace}.svc.cluster.local", f"db.{namespace}.svc", f"db.{namespace}", "db"):
        assert wait_for(f"{name} resolves", lambda n=name: resolve(n)) == db_ip
    code, out = podrunner.exec(
        namespace,
        "client",
        "c",
        [
            "python3",
            "-c",
            f"import urllib.request as u; print(u.urlopen('http://db.{namespace}.svc:8080/name').read().decode())",
        ],
    )
    assert code == 0 and out.strip() == "db", out
    assert resolve(f"web.{namespace}.svc") == ""  # a ClusterIP would not route here: no line for it
    cluster.kubectl("-n", namespace, "delete", "pod", "db", "--wait=false")
    wait_for("db leaves the hosts file", lambda: resolve(f"db.{namespace}.svc") == "", timeout=60)


def test_a_guaranteed_pod_with_a_whole_cpu_gets_that_cpu_to_itself(cluster, namespace, podrunner: PodRunner):
    """As under the kubelet's static CPU manager policy: in a Guaranteed pod, the container asking for one
    whole CPU runs (children included) on one host CPU no other container gets; its sidecar asking for 100m
    runs on the shared pool, the host's other CPUs. A second Guaranteed pod asking for every host CPU finds
    too few free: it runs on the shared pool, and a CPUsUnavailable warning event says why."""
    show = "python -c 'import os; print(sorted(os.sched_getaffinity(0)))'; sleep 1000"  # a child of sh
    limits = {"memory": "64Mi"}
    apply(
        cluster,
        namespace,
        pod(
            "pinned",
            [
                {
                    "name": "own",
                    "image": "x",
                    "command": ["sh", "-c", show],
                    "resources": {"limits": {**limits, "cpu": "1"}},
                },
                {
                    "name": "shared",
                    "image": "x",
                    "command": ["sh", "-c", show],
                    "resources": {"limits": {**limits, "cpu": "100m"}},
                },
            ],
        ),  # fmt: skip
    )

    def affinity(pod_name: str, container: str) -> list[int] | None:
        out = podrunner.logs(namespace, pod_name, container).strip()
        return ast.literal_eval(out) if out else None

    own = wait_for("the pinned container's affinity", lambda: affinity("pinned", "own"))
    shared = wait_for("the shared container's affinity", lambda: affinity("pinned", "shared"))
    host = sorted(os.sched_getaffinity(0))
    assert len(own) == 1 and set(own) <= set(host), (own, host)
    if len(host) > 1:
        assert shared and set(shared) <= set(host) and not set(shared) & set(own), (shared, own, host)

    greedy = {"name": "all", "image": "x", "command": ["sh", "-c", show],
              "resources": {"limits": {**limits, "cpu": str(len(host))}}}  # fmt: skip
    apply(cluster, namespace, pod("greedy", [greedy]))
    left = wait_for("the greedy container's affinity", lambda: affinity("greedy", "all"))
    assert set(left) <= set(host) and (len(host) == 1 or not set(left) & set(own)), (left, own, host)

    def warned() -> list[str]:
        selector = "involvedObject.name=greedy,reason=CPUsUnavailable"
        return [
            e["message"]
            for e in kubectl_json(cluster, "-n", namespace, "get", "events", "--field-selector", selector)["items"]
        ]

    (message,) = wait_for("a CPUsUnavailable event", warned)
    assert f"asks for {len(host)} exclusive CPU(s)" in message and "runs on the shared pool" in message, message
