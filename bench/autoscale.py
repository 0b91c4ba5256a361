"""Autoscaling under a load step: 1 -> N streaming clients on a tiny chat pipeline, with and without KEDA.

    .venv/bin/python bench/autoscale.py [--clients 16] [--before 30] [--during 150] [--after 40] [--stage-cpu 1]

In a local cluster (real control plane, the pod runner running vLLM on CPU, the real KEDA and Prometheus of
the test tier, the omnikube operator with the chart's identity), one tiny text-chat pipeline at a time:
- autoscaling on: the stage scales 1..2 through KEDA on its queue (targetQueueDepth 2);
- autoscaling off (baseline, same run): the same pipeline at a fixed single replica.
Each run: 1 client for --before seconds, then --clients clients for --during seconds, then 1 client for
--after seconds. Printed per run: p90 time to first token (client side, streaming) before, during and after
the step, failed requests, and (autoscaling on) the seconds from the step until the new replica has served
a request (its omnikube_stage_requests_total in Prometheus). The headline is the ratio of the p90 TTFT
during the step, on / off; beside it the same ratio over the part of the step after the new replica
served (the same seconds after the step in both runs).

Each stage replica is a Guaranteed pod with `--stage-cpu` whole CPUs (limits cpu and memory), so the pod
runner pins it to cores of its own as a node with the static CPU manager does (e2e/podrunner/cpus.py) and
its engine runs that many threads: the second replica adds cores, as on a real cluster. `--stage-cpu 0`
leaves the replicas unpinned (they then share every core; a second replica adds queue slots, not compute).
Other processes of the machine (the router, the clients, other people's work) are not kept off those cores.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "e2e"), str(REPO / "e2e" / "cluster")]

from benchlib import RUNNER_NODES, p90, pipeline_ready, pod_cluster  # noqa: E402
from chartlib import operator_release  # noqa: E402
from clusterlib import apply, kubectl_json, wait_for  # noqa: E402
from kedalib import Keda, chat_pipeline  # noqa: E402
from promlib import Prometheus, prometheus_binary  # noqa: E402

from localcluster import LocalCluster  # noqa: E402
from omni_runtime.tiny_models import ensure  # noqa: E402

MAX_TOKENS = 32


class Clients:
    """Streaming chat clients started and stopped over time; each request's (start, TTFT or error)."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.samples: list[tuple[float, float | None, str]] = []
        self._stops: list[threading.Event] = []
        self._threads: list[threading.Thread] = []

    def _loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            http = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=180)
            client = openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, http_client=http)
            started = time.monotonic()
            ttft: float | None = None
            try:
                stream = client.chat.completions.create(
                    model=self.model,
                    messages=[{"role": "user", "content": "Count to twenty"}],
                    max_tokens=MAX_TOKENS,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                for chunk in stream:
                    if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                        ttft = time.monotonic() - started
                self.samples.append((started, ttft, ""))
            except Exception as exc:  # noqa: BLE001 - every failure counts, whatever its kind
                self.samples.append((started, None, f"{type(exc).__name__}: {exc}"))
            finally:
                client.close()

    def set_count(self, n: int) -> None:
        while len(self._threads) < n:
            stop = threading.Event()
            thread = threading.Thread(target=self._loop, args=(stop,), daemon=True)
            self._stops.append(stop)
            self._threads.append(thread)
            thread.start()
        while len(self._threads) > n:
            self._stops.pop().set()
            self._threads.pop().join(180)


def stage_pods(cluster: LocalCluster, ns: str, name: str) -> list[dict[str, Any]]:
    items = kubectl_json(cluster, "get", "pods", "-n", ns, "-l", f"omnikube.io/pipeline={name}")["items"]
    return [p for p in items if p["metadata"]["labels"].get("omnikube.io/stage") == "llm"]


def router_url(cluster: LocalCluster, ns: str, name: str) -> str:
    items = kubectl_json(cluster, "get", "pods", "-n", ns, "-l", f"omnikube.io/pipeline={name}")["items"]
    routers = [p for p in items if "omnikube.io/stage" not in p["metadata"]["labels"] and p["status"].get("podIP")]
    return f"http://{routers[0]['status']['podIP']}:8000/v1"


def run_once(
    cluster: LocalCluster, ns: str, prometheus: Prometheus, name: str, autoscaling: bool, args: argparse.Namespace
) -> dict[str, Any]:
    resources = None
    if args.stage_cpu:
        # Guaranteed QoS (cpu and memory limits, requests default to them): whole cores of its own per replica.
        resources = {"limits": {"cpu": str(args.stage_cpu), "memory": "4Gi"}}
    scaling = None
    if autoscaling:
        scaling = {
            "minReplicas": 1,
            "maxReplicas": 2,
            "metric": "queue",
            "targetQueueDepth": 2,
            "scaleDownStabilizationSeconds": 30,
            "prometheusAddress": prometheus.url,
        }
    apply(cluster, ns, chat_pipeline(name, scaling, resources))
    wait_for(lambda: pipeline_ready(cluster, ns, name), 900, f"{name} Ready")
    first = {p["metadata"]["name"] for p in stage_pods(cluster, ns, name)}
    clients = Clients(router_url(cluster, ns, name), name)
    clients.set_count(1)
    time.sleep(args.before)
    step = time.monotonic()
    clients.set_count(args.clients)
    new_serving: float | None = None
    pods_max = len(first)
    query = f'sum by (pod) (omnikube_stage_requests_total{{namespace="{ns}",pipeline="{name}"}})'
    while time.monotonic() - step < args.during:
        if autoscaling and new_serving is None:
            served = {r["metric"].get("pod"): float(r["value"][1]) for r in prometheus.query(query)}
            if any(v > 0 for pod, v in served.items() if pod not in first):
                new_serving = time.monotonic() - step
        pods_max = max(pods_max, len(stage_pods(cluster, ns, name)))
        time.sleep(1)
    end_step = time.monotonic()
    clients.set_count(1)
    time.sleep(args.after)
    clients.set_count(0)
    cluster.kubectl("delete", "omnipipeline", name, "-n", ns, "--timeout=180s", check=False, timeout=200)

    def window(lo: float, hi: float) -> list[float]:
        return [t for s, t, err in clients.samples if lo <= s < hi and t is not None]

    return {
        "window": window,
        "step": step,
        "end_step": end_step,
        "before": p90(window(0, step)),
        "during": p90(window(step, end_step)),
        "after": p90(window(end_step, float("inf"))),
        "requests": len(clients.samples),
        "failed": [e for _, _, e in clients.samples if e],
        "new_replica_serving_s": new_serving,
        "stage_pods_max": pods_max,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--before", type=float, default=30)
    parser.add_argument("--during", type=float, default=150)
    parser.add_argument("--after", type=float, default=40)
    parser.add_argument("--off-first", action="store_true", help="run autoscaling off first, then on")
    parser.add_argument("--stage-cpu", type=int, default=1, help="whole CPUs per stage replica (0: unpinned)")
    args = parser.parse_args()
    ensure("tiny-qwen2-chat")
    started = time.monotonic()
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="omnikube-autoscale-") as tmp:
        work = Path(tmp)
        with pod_cluster(work) as cluster:
            node = kubectl_json(cluster, "get", "node", RUNNER_NODES[0])
            bridge = next(a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP")
            keda = Keda(cluster)
            (work / "prometheus").mkdir()
            prometheus = Prometheus(prometheus_binary(), work / "prometheus", host=bridge)
            try:
                keda.install()
                prometheus.start()
                with operator_release(cluster, "bench", work) as (release, _operator):
                    ns = release.apps
                    stop = prometheus.follow(lambda: kubectl_json(cluster, "get", "pods", "-n", ns)["items"])
                    try:
                        if args.off_first:  # the machine's load drifts: swap the order to see how much
                            off = run_once(cluster, ns, prometheus, "fixed", False, args)
                            on = run_once(cluster, ns, prometheus, "scaled", True, args)
                        else:
                            on = run_once(cluster, ns, prometheus, "scaled", True, args)
                            off = run_once(cluster, ns, prometheus, "fixed", False, args)
                    finally:
                        stop()
            finally:
                prometheus.stop()
                keda.uninstall()
    print("# bench/autoscale.py " + " ".join(sys.argv[1:]))
    print(
        f"# {os.cpu_count()} CPUs; load average {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end; "
        f"{time.monotonic() - started:.0f}s; step 1 -> {args.clients} streaming clients, {MAX_TOKENS} tokens each; "
        f"windows {args.before:.0f}s / {args.during:.0f}s / {args.after:.0f}s; "
        + (f"{args.stage_cpu} pinned CPU(s) per stage replica" if args.stage_cpu else "stage replicas unpinned")
    )
    print(f"{'run':<22}{'p90 TTFT before':>16}{'during':>10}{'after':>10}{'requests':>10}{'failed':>8}{'max pods':>10}")
    for label, r in (("autoscaling on (KEDA)", on), ("autoscaling off", off)):
        print(
            f"{label:<22}{r['before']:>15.2f}s{r['during']:>9.2f}s{r['after']:>9.2f}s{r['requests']:>10}"
            f"{len(r['failed']):>8}{r['stage_pods_max']:>10}"
        )
    serving = on["new_replica_serving_s"]
    print(f"step -> new replica serving: {'not within the step' if serving is None else f'{serving:.1f}s'}")
    print(f"p90 TTFT during the step, on / off: {on['during'] / off['during']:.2f}")
    if serving is not None:
        scaled_on = p90(on["window"](on["step"] + serving, on["end_step"]))
        scaled_off = p90(off["window"](off["step"] + serving, off["end_step"]))
        print(
            f"p90 TTFT from {serving:.0f}s after the step to its end (2 replicas on, 1 off): "
            f"{scaled_on:.2f}s / {scaled_off:.2f}s = {scaled_on / scaled_off:.2f}"
        )
    for r in (on, off):
        for err in r["failed"][:5]:
            print("failed:", err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
