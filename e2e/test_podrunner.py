"""The pod runner: pods on its nodes are real processes with their own network and mount namespaces.

Everything Kubernetes-side is real (scheduler, EndpointSlice controller, ServiceAccount admission, token
requests); the pod runner stands in for the kubelet of `runner-node-0` and `runner-node-1`.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from clusterlib import kubectl_json
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
        pod("doomed", [{"name": "c", "image": "x", "command": ["sh", "-c", script]}], terminationGracePeriodSeconds=10),
    )
    wait_for("doomed Running", lambda: get_pod(cluster, namespace, "doomed")["status"]["phase"] == "Running")
    info = wait_for(
        "sandbox info",
        lambda: (i := podrunner.sandbox_info(namespace, "doomed")) and i["container_pids"].get("c") and i,
    )
    pids = [info["unshare_pid"], info["agent_pid"], info["container_pids"]["c"]]
    assert all(_alive(p) for p in pids) and _netns_holders(info["netns"]) and _link_exists(info["veth"])
    started = time.monotonic()
    cluster.kubectl("-n", namespace, "delete", "pod", "doomed", "--wait=true", timeout=60)
    assert time.monotonic() - started < 8  # the container ended on SIGTERM, well before the grace period
    assert "got SIGTERM" in podrunner.logs(namespace, "doomed", "c")
    assert not any(_alive(p) for p in pids)
    assert _netns_holders(info["netns"]) == []
    assert not _link_exists(info["veth"])
    assert podrunner.sandbox_info(namespace, "doomed") is None


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
