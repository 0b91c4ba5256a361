"""Rollouts under steady load: what a user's clients see while the prompt-enhanced pipeline rolls.

    .venv/bin/python bench/rollout.py [--images 2] [--chats 1] [--before 40] [--after 20] [--max-surge 100%]

In a local cluster (real control plane, the pod runner running vLLM on CPU and diffusers, the omnikube operator
with the chart's identity), one tiny prompt-enhanced text-to-image pipeline (enhancer: vLLM, dit: diffusers) under
steady load: --images clients calling /v1/images/generations and --chats clients calling /v1/chat/completions
(the pipeline answers with the image), each back to back, through whichever router pod is ready (as a Service
would send them). Two changes, one after the other:

- outside the contract (the enhancer's max_model_len): the enhancer's Deployment rolls in place, the dit and the
  router are left alone;
- in the contract (a new model revision, tiny-prompt-enhanced-t2i-r2: other weights in another folder): every
  stage's new generation comes up beside the old one (at most --max-surge replicas each), the router moves new
  requests to it once it is whole, and the old one drains.

Printed per change: requests, failed requests (target 0) and requests whose stages ran on two generations
(`mixed`, from each response's x-omnikube-contract; target 0) while it rolled, p90 latency during the roll over p90
before it (target <= 1.5), seconds from the spec change to the first response served by the new generation (the
contract change: its x-omnikube-contract digests; outside the contract: the first response after every new pod was
ready) and until the roll ended (old pods gone), and the peak of extra stage pods per stage over its replicas
(the contract change: <= maxSurge). "During" is from the spec change until the roll ended; "moving" is its part
from the first response of the new generation on (the switch and the old generation's drain, without the new
one's model load).

On one machine the new generation loads on the cores the old one serves from, which a cluster's other GPUs and
nodes do not share. So the run first measures a baseline: a copy of the pipeline (no traffic) starts beside the
one under load, is Ready, and is deleted until its pods are gone (the same model loads and engine stops as a
roll, without a roll); each roll's p90 is then also given over the baseline's: what the rollout itself costs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "e2e"), str(REPO / "e2e" / "cluster")]

from benchlib import p90, pipeline_ready, pod_cluster  # noqa: E402
from chartlib import operator_release  # noqa: E402
from clusterlib import apply, condition, kubectl_json, wait_for  # noqa: E402
from loadlib import RouterService  # noqa: E402
from podrunner.node import ON_RUNNER  # noqa: E402

from localcluster import LocalCluster  # noqa: E402
from omni_operator.api.rollout import surge_replicas  # noqa: E402
from omni_runtime.tiny_models import PROMPT_ENHANCED_R2, default_cache_dir, ensure  # noqa: E402

NAME = "enhanced"
MODEL = "tiny-prompt-enhanced-t2i"
AR_ARGS = {"max_model_len": 512, "kv_cache_memory_bytes": 256 * 1024**2}


def manifest(max_surge: str | int) -> dict[str, Any]:
    return {
        "apiVersion": "omnikube.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": NAME},
        "spec": {
            "model": MODEL,
            "pipeline": "prompt-enhanced-t2i",
            "servedModelName": NAME,
            "runtime": {
                "modelCache": {"hostPath": {"path": str(default_cache_dir())}, "mountPath": "/models", "readOnly": True}
            },
            "rollout": {"maxSurge": max_surge},
            "router": {**ON_RUNNER, "limits": {"requestTimeoutSeconds": 180}},
            "stages": [
                {
                    **ON_RUNNER,
                    "name": "enhancer",
                    "engineArgs": AR_ARGS,
                    "samplingParams": {"max_tokens": 12, "ignore_eos": True},
                },
                {**ON_RUNNER, "name": "dit", "samplingParams": {"num_inference_steps": 2}},
            ],  # fmt: skip
        },
    }


@dataclass
class Sample:
    started: float
    seconds: float | None
    """None: it failed."""
    error: str = ""
    contract: dict[str, str] = field(default_factory=dict)
    ended: float = 0.0


class Load:
    """Image and chat clients, back to back, through the router pod a Service would pick."""

    def __init__(self, url: RouterService, images: int, chats: int) -> None:
        self.url = url
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        kinds = ["image"] * images + ["chat"] * chats
        self._threads = [threading.Thread(target=self._loop, args=(k,), daemon=True) for k in kinds]

    def _loop(self, kind: str) -> None:
        while not self._stop.is_set():
            http = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=180)
            client = openai.OpenAI(base_url=self.url(), api_key="unused", max_retries=0, http_client=http)
            started = time.monotonic()
            try:
                if kind == "image":
                    raw = client.images.with_raw_response.generate(
                        model=NAME, prompt="a dog", size="64x64", response_format="b64_json"
                    )
                    assert raw.parse().data[0].b64_json
                else:
                    raw = client.chat.completions.with_raw_response.create(
                        model=NAME, messages=[{"role": "user", "content": "draw a cat"}]
                    )
                    assert raw.parse().choices[0].message.content
                contract = json.loads(raw.headers.get("x-omnikube-contract", "{}"))
                ended = time.monotonic()
                self.samples.append(Sample(started, ended - started, contract=contract, ended=ended))
            except Exception as exc:  # noqa: BLE001 - every failure counts, whatever its kind
                self.samples.append(Sample(started, None, f"{type(exc).__name__}: {exc}", ended=time.monotonic()))
            finally:
                client.close()

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(200)


def pipeline_status(cluster: LocalCluster, ns: str) -> dict[str, Any]:
    return kubectl_json(cluster, "get", "omnipipeline", NAME, "-n", ns)


def pods(cluster: LocalCluster, ns: str) -> list[dict[str, Any]]:
    return kubectl_json(cluster, "get", "pods", "-n", ns, "-l", f"omnikube.io/pipeline={NAME}")["items"]


def stage_of(pod: dict[str, Any]) -> str:
    return pod["metadata"]["labels"].get("omnikube.io/stage", "router")


def beside(
    cluster: LocalCluster, ns: str, load: Load, spec: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    """The baseline: a copy of the pipeline under another name (no traffic) starts beside the one under load, is
    Ready, and is deleted until its pods are gone: the same model loads and engine stops as a roll, without a
    roll. What it costs the clients is what one machine's shared cores cost, not what the rollout does."""
    time.sleep(args.before)
    changed = time.monotonic()
    copy = json.loads(json.dumps(spec))
    copy["metadata"]["name"] = copy["spec"]["servedModelName"] = "beside"
    apply(cluster, ns, copy)

    wait_for(lambda: pipeline_ready(cluster, ns, "beside"), 900, "the copy Ready")
    cluster.kubectl("delete", "omnipipeline", "beside", "-n", ns, "--wait=false")
    selector = "omnikube.io/pipeline=beside"
    wait_for(lambda: not kubectl_json(cluster, "get", "pods", "-n", ns, "-l", selector)["items"], 300, "its pods gone")
    ended = time.monotonic()
    time.sleep(args.after)
    before = [s for s in load.samples if changed - args.before <= s.started < changed]
    during = [s for s in load.samples if changed <= s.started < ended]
    return {
        "requests": len(during),
        "failed": [s.error for s in during if s.seconds is None],
        "p90_before": p90([s.seconds for s in before if s.seconds is not None]),
        "p90_during": p90([s.seconds for s in during if s.seconds is not None]),
        "to_end": ended - changed,
    }


def roll(
    cluster: LocalCluster, ns: str, load: Load, spec: dict[str, Any], rolls: set[str], args: argparse.Namespace
) -> dict[str, Any]:
    """Apply `spec` under `load`; measure until every old pod of the `rolls` components is gone and the pipeline
    is Ready again, then --after seconds more."""
    before_pods = {p["metadata"]["name"]: stage_of(p) for p in pods(cluster, ns)}
    replicas = {s: sum(1 for c in before_pods.values() if c == s) for s in ("enhancer", "dit")}
    old_contract = pipeline_status(cluster, ns)["status"]["contract"]
    time.sleep(args.before)
    changed = time.monotonic()
    apply(cluster, ns, spec)
    peak = dict.fromkeys(replicas, 0)
    new_ready_at: float | None = None
    while True:
        now = pods(cluster, ns)
        for stage, count in replicas.items():
            peak[stage] = max(peak[stage], sum(1 for p in now if stage_of(p) == stage) - count)
        fresh = [p for p in now if stage_of(p) in rolls and p["metadata"]["name"] not in before_pods]
        if (
            new_ready_at is None
            and {stage_of(p) for p in fresh} == rolls
            and all(condition(p, "Ready").get("status") == "True" for p in fresh)
        ):
            new_ready_at = time.monotonic()
        old_left = [n for n, c in before_pods.items() if c in rolls and n in {p["metadata"]["name"] for p in now}]
        if not old_left and new_ready_at is not None and pipeline_ready(cluster, ns, NAME):
            break
        if time.monotonic() - changed > 1200:
            status = pipeline_status(cluster, ns).get("status")
            raise TimeoutError(f"the roll did not end in 20 minutes: {json.dumps(status)[:2000]}")
        time.sleep(1)
    ended = time.monotonic()
    time.sleep(args.after)
    new_contract = pipeline_status(cluster, ns)["status"]["contract"]
    before = [s for s in load.samples if changed - args.before <= s.started < changed]
    during = [s for s in load.samples if changed <= s.started < ended]

    def pair(s: Sample) -> tuple[str | None, str | None]:
        return s.contract.get("enhancer"), s.contract.get("dit")

    # The generations a request may run on: the one before the change or the one after the roll, never a mix.
    known = {pair(s) for s in before} | {pair(s) for s in load.samples if s.started >= ended}
    if new_contract != old_contract:
        digests = {s.contract.get("dit") for s in load.samples if s.ended < changed}
        firsts = [s.ended for s in load.samples if s.seconds is not None and s.ended >= changed
                  and s.contract.get("dit") not in digests]  # fmt: skip
    else:
        assert new_ready_at is not None
        firsts = [s.ended for s in load.samples if s.seconds is not None and s.started >= new_ready_at]
    return {
        "contract": new_contract != old_contract,
        "requests": len(during),
        "failed": [s.error for s in during if s.seconds is None],
        "failed_outside": [s.error for s in load.samples if s.seconds is None and not changed <= s.started < ended],
        "p90_before": p90([s.seconds for s in before if s.seconds is not None]),
        "p90_during": p90([s.seconds for s in during if s.seconds is not None]),
        "to_new": (min(firsts) - changed) if firsts else None,
        "p90_moving": p90([s.seconds for s in during if s.seconds is not None and firsts and s.started >= min(firsts)]),
        "to_end": ended - changed,
        "peak": peak,
        "replicas": replicas,
        "mixed": [s.contract for s in during if s.seconds is not None and pair(s) not in known],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2, help="image clients")
    parser.add_argument("--chats", type=int, default=1, help="chat clients")
    parser.add_argument("--before", type=float, default=40, help="seconds of load measured before each change")
    parser.add_argument("--after", type=float, default=20, help="seconds of load after each roll ended")
    parser.add_argument("--max-surge", default="100%", help="rollout.maxSurge (a count or a percentage)")
    args = parser.parse_args()
    surge: str | int = int(args.max_surge) if args.max_surge.isdigit() else args.max_surge
    ensure(MODEL)
    ensure(PROMPT_ENHANCED_R2)
    started = time.monotonic()
    load_start = os.getloadavg()[0]
    results: list[tuple[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="omnikube-rollout-") as tmp:
        work = Path(tmp)
        with pod_cluster(work) as cluster:
            with operator_release(cluster, "bench", work) as (release, _operator):
                ns = release.apps
                spec = manifest(surge)
                apply(cluster, ns, spec)
                wait_for(lambda: pipeline_ready(cluster, ns, NAME), 900, f"{NAME} Ready")
                routers = RouterService(lambda: [p for p in pods(cluster, ns) if stage_of(p) == "router"])
                with routers:
                    load = Load(routers, args.images, args.chats).start()
                    try:
                        base = beside(cluster, ns, load, spec, args)
                        outside = json.loads(json.dumps(spec))
                        outside["spec"]["stages"][0]["engineArgs"] = {**AR_ARGS, "max_model_len": 384}
                        results.append(("outside the contract", roll(cluster, ns, load, outside, {"enhancer"}, args)))
                        inside = json.loads(json.dumps(outside))
                        inside["spec"]["model"] = PROMPT_ENHANCED_R2
                        every = {"enhancer", "dit", "router"}
                        results.append(("in the contract", roll(cluster, ns, load, inside, every, args)))
                    finally:
                        load.stop()
    print("# bench/rollout.py " + " ".join(sys.argv[1:]))
    print(
        f"# {os.cpu_count()} CPUs; load average {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end; "
        f"{time.monotonic() - started:.0f}s; {args.images} image + {args.chats} chat clients back to back; "
        f"maxSurge {surge}; p90 before over the {args.before:.0f}s before each change"
    )
    print(
        f"{'change':<22}{'requests':>9}{'failed':>7}{'mixed':>6}{'p90 before':>11}{'during':>8}{'ratio':>7}"
        f"{'moving':>8}{'ratio':>7}"
        f"{'to new gen':>11}{'to end':>8}  peak extra pods (allowed)"
    )
    for label, r in results:
        to_new = "-" if r["to_new"] is None else f"{r['to_new']:.0f}s"
        peaks = ", ".join(
            f"{s} {r['peak'][s]}" + (f" ({surge_replicas(surge, r['replicas'][s])})" if r["contract"] else "")
            for s in r["peak"]
        )
        print(
            f"{label:<22}{r['requests']:>9}{len(r['failed']):>7}{len(r['mixed']):>6}{r['p90_before']:>10.2f}s{r['p90_during']:>7.2f}s"
            f"{r['p90_during'] / r['p90_before']:>7.2f}{r['p90_moving']:>7.2f}s"
            f"{r['p90_moving'] / r['p90_before']:>7.2f}"
            f"{to_new:>11}{r['to_end']:>7.0f}s  {peaks}"
        )
    print(
        f"{'baseline: copy beside':<22}{base['requests']:>9}{len(base['failed']):>7}{'':>6}"
        f"{base['p90_before']:>10.2f}s"
        f"{base['p90_during']:>7.2f}s{base['p90_during'] / base['p90_before']:>7.2f}{'':>26}{base['to_end']:>7.0f}s"
    )
    for label, r in results:
        print(
            f"{label}: p90 during the roll / p90 while the copy loaded and stopped beside: "
            f"{r['p90_during'] / base['p90_during']:.2f}"
        )
    for label, r in results:
        for err in (r["failed"] + r["failed_outside"])[:5]:
            print(f"failed ({label}):", err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
