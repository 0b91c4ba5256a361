"""Every kopf trigger of the operator, in one place. Bodies only turn an event into a queue key.

Events say which object to look at, never what to do: the reconcile steps read the world afresh.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from omni_operator.api import GROUP, VERSION
from omni_operator.builders.meta import LABEL_COMPONENT, LABEL_PIPELINE, LABEL_STAGE, MANAGED_BY, child_name

__all__ = ["Key", "keys_for_child", "PIPELINE", "STAGE"]

log = logging.getLogger(__name__)

PIPELINE = "pipeline"
STAGE = "stage"
Key = tuple[str, str, str]
"""(PIPELINE | STAGE, namespace, name)"""

MANAGED = {"app.kubernetes.io/managed-by": MANAGED_BY}


def keys_for_child(labels: dict[str, str], namespace: str, name: str) -> list[Key]:
    """The owner keys to reconcile when a child object (by its labels) changes."""
    pipeline = labels.get(LABEL_PIPELINE)
    if not pipeline:
        return []
    component = labels.get(LABEL_COMPONENT)
    if component == "stage" and labels.get(LABEL_STAGE):
        return [(STAGE, namespace, child_name(pipeline, labels[LABEL_STAGE]))]
    return [(PIPELINE, namespace, pipeline)]


def _namespaced(namespace: str | None) -> str:
    """kopf types `namespace` optional (cluster-scoped objects have none); every object watched here is
    namespaced, so it is always set."""
    if namespace is None:
        raise kopf.PermanentError("a namespaced object came without a namespace")
    return namespace


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Events only: kopf keeps no progress or diff-base on our objects, so it writes nothing to them
    # (no annotations for Argo CD or Flux to see as drift) and needs no finalizers.
    settings.posting.enabled = False
    # kopf logs every handled event at INFO; ours are one-line queue additions.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    settings.peering.standalone = True
    settings.scanning.disabled = True
    settings.watching.server_timeout = 270
    settings.watching.client_timeout = 300


@kopf.on.event(GROUP, VERSION, "omnipipelines")
def pipeline_event(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    memo.queue.add((PIPELINE, _namespaced(namespace), name))


@kopf.on.event(GROUP, VERSION, "omnistages")
def omnistage_event(namespace: str | None, name: str, spec: kopf.Spec, memo: kopf.Memo, **_: Any) -> None:
    ns = _namespaced(namespace)
    memo.queue.add((STAGE, ns, name))
    if spec.get("pipeline"):  # the pipeline aggregates stage status, and restores a deleted stage
        memo.queue.add((PIPELINE, ns, spec["pipeline"]))


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
@kopf.on.event("", "v1", "pods", labels=MANAGED)
@kopf.on.event("", "v1", "services", labels=MANAGED)
@kopf.on.event("", "v1", "configmaps", labels=MANAGED)
def child_event(namespace: str | None, name: str, labels: Mapping[str, str], memo: kopf.Memo, **_: Any) -> None:
    for key in keys_for_child(dict(labels), _namespaced(namespace), name):
        memo.queue.add(key)


@kopf.on.cleanup()
async def resign(memo: kopf.Memo, **_: Any) -> None:
    """On a graceful stop, stop reconciling and release the Lease as soon as kopf's watches are closed.

    The election loop ends (its own shutdown stops the work queue, then releases the Lease), so another
    replica leads at its next try. Left to the end of `run_operator`, the release would wait until kopf
    has also given the queue's workers, which it sees as its own hung tasks, 5 s to finish."""
    task = memo.get("election_task")
    if task is not None and not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@kopf.on.probe(id="leader")
def leader_probe(memo: kopf.Memo, **_: Any) -> bool:
    """Whether this replica leads; raises (failing /healthz) when the election loop has died."""
    task = memo.get("election_task")
    if task is not None and task.done():
        raise RuntimeError("the leader election loop has stopped; restart the operator")
    return bool(memo.elector.leading) if memo.get("elector") else True
