"""`omnikube operator`: kopf watches, a work queue reconciles, a Lease elects the one replica that acts."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import kopf

from omni_operator import handlers  # noqa: F401 - registers the kopf triggers
from omni_operator.api import API_VERSION
from omni_operator.handlers import PIPELINE, STAGE, Key
from omni_operator.kube import KubeClient, KubeError
from omni_operator.leader import LeaderElector
from omni_operator.metrics import OperatorMetrics
from omni_operator.reconcile import Context, reconcile_pipeline, reconcile_stage
from omni_operator.workqueue import WorkQueue
from omni_runtime.registry import load_registry

__all__ = ["OperatorConfig", "run_operator"]

log = logging.getLogger(__name__)


@dataclass
class OperatorConfig:
    """How the operator runs; `omnikube operator --help` lists the same as flags."""

    namespaces: list[str] = field(default_factory=list)
    """Namespaces to watch; empty watches all."""
    kubeconfig: str | None = None
    model_root: Path | None = None
    """A model cache the operator can read, to pick a pipeline from a model's config files."""
    pipelines_dirs: list[Path] = field(default_factory=list)
    workers: int = 8
    resync_seconds: float = 300.0
    leader_election: bool = True
    lease_namespace: str = field(default_factory=lambda: os.environ.get("POD_NAMESPACE", "default"))
    lease_name: str = "omnikube-operator"
    identity: str = field(default_factory=lambda: os.environ.get("POD_NAME") or socket.gethostname())
    liveness_port: int | None = None
    metrics_port: int | None = None
    capacity_check: bool = True
    """Count free accelerators before a rollout makes a new generation (lists nodes and every namespace's pods)."""


async def _list_all(kube: KubeClient, namespaces: list[str]) -> list[Key]:
    keys: list[Key] = []
    scopes: list[str | None] = [*namespaces] or [None]  # None: every namespace
    for ns in scopes:
        for kind, tag in (("OmniPipeline", PIPELINE), ("OmniStage", STAGE)):
            for obj in await kube.list(API_VERSION, kind, ns):
                keys.append((tag, obj["metadata"]["namespace"], obj["metadata"]["name"]))
    return keys


async def run_operator(config: OperatorConfig) -> None:
    if config.kubeconfig:
        # kopf's own login reads $KUBECONFIG: point it at the same file our client uses.
        os.environ["KUBECONFIG"] = config.kubeconfig
    kube = await KubeClient.from_environment(config.kubeconfig)
    metrics = OperatorMetrics()
    ctx = Context(
        kube=kube,
        registry=load_registry(config.pipelines_dirs),
        model_root=config.model_root,
        metrics=metrics,
        capacity_check=config.capacity_check,
    )
    if config.metrics_port:
        metrics.serve(config.metrics_port)

    async def handle(key: Key) -> None:
        kind, namespace, name = key
        writes_before = ctx.writes
        started = time.monotonic()
        result = "error"
        try:
            if kind == PIPELINE:
                again = await reconcile_pipeline(ctx, namespace, name)
            else:
                again = await reconcile_stage(ctx, namespace, name)
            if again is not None:
                queue.add_after(key, again)
            result = "ok"
        except KubeError as exc:
            if exc.namespace_terminating:
                result = "ok"
                return  # the namespace is going away with everything in it: nothing to converge
            raise
        finally:
            metrics.reconciles.labels(kind, result).inc()
            metrics.duration.labels(kind).observe(time.monotonic() - started)
            metrics.writes.inc(ctx.writes - writes_before)
            metrics.queue_depth.set(queue.depth())

    queue = WorkQueue(handle, workers=config.workers)

    async def resync_forever() -> None:
        while True:
            await asyncio.sleep(config.resync_seconds)
            for key in await _list_all(kube, config.namespaces):
                queue.add(key)

    resync: list[asyncio.Task] = []

    async def started() -> None:
        metrics.leader.set(1)
        queue.start()
        for key in await _list_all(kube, config.namespaces):
            queue.add(key)
        resync.append(asyncio.create_task(resync_forever()))

    async def stopped() -> None:
        metrics.leader.set(0)
        metrics.forget_stages()
        for task in resync:
            task.cancel()
        resync.clear()
        await queue.stop()

    memo = kopf.Memo(queue=queue, ctx=ctx, elector=None, election_task=None)
    tasks = []
    if config.leader_election:
        memo.elector = LeaderElector(
            kube,
            namespace=config.lease_namespace,
            name=config.lease_name,
            identity=config.identity,
            on_started=started,
            on_stopped=stopped,
        )
        memo.election_task = asyncio.create_task(memo.elector.run(), name="leader-election")
        tasks.append(memo.election_task)
    else:
        await started()

    liveness = f"http://0.0.0.0:{config.liveness_port}/healthz" if config.liveness_port else None
    try:
        await kopf.operator(
            clusterwide=not config.namespaces,
            namespaces=config.namespaces,
            memo=memo,
            standalone=True,
            liveness_endpoint=liveness,
        )
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await stopped()
        await kube.close()
