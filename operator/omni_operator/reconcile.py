"""Reconcile steps: fetch, call the builders, apply what differs, report status.

Level-triggered: each call looks at the whole world for one object and makes it right, whatever event
woke it. An unchanged world causes reads only: every object carries the hash of what it was built from,
a live object with the same hash is left alone, and status is written only when it changes.
"""

from __future__ import annotations

import datetime as dt
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from omni_operator.api import API_VERSION, OmniPipeline, OmniStage
from omni_operator.api.rollout import GenerationStatus, RolloutPhase, RolloutStatus
from omni_operator.builders.autoscaler import HPA_API_VERSION, KEDA_API_VERSION, build_stage_autoscaler
from omni_operator.builders.connector_servers import build_connector_server_objects, unneeded_connector_server_objects
from omni_operator.builders.meta import HASH_ANNOTATION, LABEL_COMPONENT, LABEL_PIPELINE
from omni_operator.builders.pipeline_objects import (
    GENERATION_LABEL,
    build_group_configmap,
    build_omnistages,
    build_pipeline_configmap,
    group_configmap_name,
    group_contract,
    router_name,
)
from omni_operator.builders.router import build_router_objects, router_endpoint
from omni_operator.builders.stage_workload import (
    build_stage_deployment,
    build_stage_service,
    generation_selector,
    replica_accelerator,
    stage_selector,
)
from omni_operator.builders.trust import KEY_BYTES, build_key_secret, build_network_policies, key_secret_name
from omni_operator.capacity import free_accelerators
from omni_operator.kube import FIELD_MANAGER, KubeClient, KubeError
from omni_operator.metrics import OperatorMetrics
from omni_operator.resolve import group_members, resolve_cluster_pipeline
from omni_operator.rollout import GroupView, RolloutPlan, degraded_of, plan_rollout
from omni_operator.status.conditions import Condition, get_condition, now_rfc3339, set_condition
from omni_operator.status.pipeline_status import PipelineObservation, pipeline_conditions, spec_problem
from omni_operator.status.reasons import Reason
from omni_operator.status.stage_status import selector_string, stage_conditions
from omni_runtime.registry import PipelineRegistry
from omni_runtime.spec import SpecError
from omni_runtime.spec.contract import pipeline_contract

__all__ = ["Context", "NameCollision", "TemporaryError", "reconcile_pipeline", "reconcile_stage"]

log = logging.getLogger(__name__)


class TemporaryError(RuntimeError):
    """The world is not ready yet (a Secret is missing, an owner not found): retry with backoff."""


class NameCollision(RuntimeError):
    """An object the operator would create already exists and is not this owner's: it is left alone."""

    def __init__(self, kind: str, name: str, namespace: str | None, owner: str) -> None:
        super().__init__(f"{kind} {namespace}/{name} exists and is not owned by {owner}")
        self.kind, self.name, self.namespace, self.owner = kind, name, namespace, owner

    def condition(self) -> Condition:
        return Condition(
            "Degraded",
            "True",
            Reason.NAME_COLLISION,
            f"{self.kind} {self.name!r} already exists in namespace {self.namespace} and does not belong to "
            f"{self.owner}; the operator leaves it untouched. Delete or rename that {self.kind}, or give "
            "the pipeline another name",
        )


@dataclass
class Context:
    """What reconcile steps share: the API client, the topology registry, where models are readable."""

    kube: KubeClient
    registry: PipelineRegistry
    model_root: Path | None = None
    writes: int = 0
    metrics: OperatorMetrics | None = None
    """Where per-stage gauges go (the operator's registry); None in tests that need none."""
    capacity_check: bool = True
    """Count free accelerators before a rollout makes a new generation (`--no-capacity-check` turns it off);
    turned off too (until the operator restarts) the first time listing nodes or pods is forbidden."""


async def _ensure(
    ctx: Context,
    desired: dict[str, Any],
    *,
    live: dict[str, Any] | None = None,
    fetched: bool = False,
    generation_seen: int | None = None,
) -> dict[str, Any]:
    """Apply `desired` unless the live object already carries its hash (and, when `generation_seen` is
    given, still has the generation we last wrote: someone else's edit changes it and is undone)."""
    meta = desired["metadata"]
    if not fetched:
        live = await ctx.kube.get(desired["apiVersion"], desired["kind"], meta["name"], meta.get("namespace"))
    if live is not None:
        _check_owner(live, desired)
        same_hash = (live["metadata"].get("annotations") or {}).get(HASH_ANNOTATION) == meta["annotations"][
            HASH_ANNOTATION
        ]
        untouched = generation_seen is None or live["metadata"].get("generation") == generation_seen
        if same_hash and untouched:
            return live
    ctx.writes += 1
    log.info("applying %s %s/%s", desired["kind"], meta.get("namespace"), meta["name"])
    return await ctx.kube.apply(desired)


async def _write_status(ctx: Context, obj: dict[str, Any], status: dict[str, Any]) -> bool:
    current = obj.get("status") or {}
    if all(current.get(k) == v for k, v in status.items()):
        return False
    ctx.writes += 1
    meta = obj["metadata"]
    await ctx.kube.merge_patch(
        obj["apiVersion"], obj["kind"], meta["name"], meta["namespace"], {"status": status}, subresource="status"
    )
    return True


def _merge_conditions(obj: dict[str, Any], wanted: list[Condition]) -> tuple[list[dict], list[Condition]]:
    """New condition list and the conditions whose status or reason changed (for Events)."""
    conditions = list((obj.get("status") or {}).get("conditions", []))
    generation = obj["metadata"].get("generation", 0)
    flipped = []
    for cond in wanted:
        before = get_condition(conditions, cond.type)
        conditions, _ = set_condition(conditions, cond, generation)
        if before is None or before.get("status") != cond.status or before.get("reason") != cond.reason:
            flipped.append(cond)
    return conditions, flipped


async def _post_events(ctx: Context, obj: dict[str, Any], flipped: list[Condition]) -> None:
    """One Event per noteworthy transition: Degraded turning on, Ready turning on."""
    for cond in flipped:
        if cond.type == "Degraded" and cond.status == "True":
            await _event(ctx, obj, "Warning", cond.reason, cond.message)
        elif cond.type == "Ready" and cond.status == "True":
            await _event(ctx, obj, "Normal", "Ready", cond.message)


async def _event(ctx: Context, obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
    meta = obj["metadata"]
    ctx.writes += 1
    now = now_rfc3339()
    try:
        await ctx.kube.create(
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
                "involvedObject": {
                    "apiVersion": obj["apiVersion"],
                    "kind": obj["kind"],
                    "name": meta["name"],
                    "namespace": meta["namespace"],
                    "uid": meta["uid"],
                },
                "type": type_,
                "reason": reason,
                "message": message[:1024],
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
                "source": {"component": FIELD_MANAGER},
                "reportingComponent": FIELD_MANAGER,
            }
        )
    except Exception as exc:  # an Event is best effort; never fail a reconcile on it
        log.warning("could not post event %s on %s: %s", reason, meta["name"], exc)


def _check_owner(live: dict[str, Any], desired: dict[str, Any]) -> None:
    """NameCollision unless `live` carries the owner reference `desired` is built with."""
    wanted = desired["metadata"].get("ownerReferences") or []
    uids = {ref.get("uid") for ref in wanted}
    refs = live["metadata"].get("ownerReferences") or []
    if not uids or any(ref.get("uid") in uids for ref in refs):
        return
    meta = desired["metadata"]
    owner = f"{wanted[0]['kind']} {wanted[0]['name']}"
    if any((ref.get("kind"), ref.get("name")) == (wanted[0]["kind"], wanted[0]["name"]) for ref in refs):
        # Owned by an earlier owner of the same name (deleted and recreated): garbage collection removes
        # it shortly, since its owner is gone. Not a collision: retry until it has.
        raise TemporaryError(
            f"{desired['kind']} {meta.get('namespace')}/{meta['name']} still belongs to a deleted {owner}; "
            "waiting for garbage collection to remove it"
        )
    raise NameCollision(desired["kind"], meta["name"], meta.get("namespace"), owner)


async def _ensure_key_secret(ctx: Context, owner: dict[str, Any]) -> str:
    """The uid of the pipeline's key Secret, created once with fresh random bytes; never rewritten."""
    meta = owner["metadata"]
    name = key_secret_name(meta["name"])
    live = await ctx.kube.get("v1", "Secret", name, meta["namespace"])
    if live is None:
        ctx.writes += 1
        log.info("creating the pipeline key Secret %s/%s", meta["namespace"], name)  # never its data
        try:
            live = await ctx.kube.create(build_key_secret(owner, secrets.token_bytes(KEY_BYTES)))
        except KubeError as exc:
            if exc.status != 409:
                raise
            live = await ctx.kube.get("v1", "Secret", name, meta["namespace"])  # another writer won the race
            if live is None:
                raise TemporaryError(f"Secret {name} was created and deleted meanwhile") from None
    _check_owner(live, build_key_secret(owner, b""))
    return live["metadata"]["uid"]


async def _secret_problem(ctx: Context, pipeline: OmniPipeline, namespace: str) -> Condition | None:
    refs = [
        ("runtime.hfTokenSecret", pipeline.spec.runtime.hf_token_secret),
        ("router.apiKeySecret", pipeline.spec.router.api_key_secret),
    ]
    for field_name, ref in refs:
        if ref is None:
            continue
        secret = await ctx.kube.get("v1", "Secret", ref.name, namespace)
        if secret is None or ref.key not in (secret.get("data") or {}) | (secret.get("stringData") or {}):
            what = "not found" if secret is None else f"has no key {ref.key!r}"
            return Condition(
                "Degraded",
                "True",
                Reason.SECRET_MISSING,
                f"{field_name}: Secret {ref.name!r} {what} in namespace {namespace}; create it "
                f"(kubectl create secret generic {ref.name} --from-literal={ref.key}=...) "
                f"or remove {field_name}",
            )
    return None


async def reconcile_pipeline(ctx: Context, namespace: str, name: str) -> float | None:
    """Make an OmniPipeline's ConfigMaps, OmniStages and router match its spec, roll a contract change as
    a unit (`rollout`), then report status. Returns the seconds after which to look again though nothing
    changed (a rollout's progress deadline), or None."""
    live = await ctx.kube.get(API_VERSION, "OmniPipeline", name, namespace)
    if live is None or live["metadata"].get("deletionTimestamp"):
        return None  # garbage collection removes what it owned
    plan: RolloutPlan | None = None
    observation = PipelineObservation()
    resolved = None
    try:
        pipeline = OmniPipeline.model_validate(live)
        resolved = resolve_cluster_pipeline(pipeline, ctx.registry, ctx.model_root)
    except (ValidationError, SpecError) as exc:
        # The spec is wrong: say so and change nothing, so what runs keeps running.
        observation.spec_problem = spec_problem(exc)
        pipeline = None

    status: dict[str, Any] = {"observedGeneration": live["metadata"].get("generation")}
    if pipeline is not None and resolved is not None:
        observation.secret_problem = await _secret_problem(ctx, pipeline, namespace)
        collisions: list[NameCollision] = []

        async def ensure(step: Any, desired: dict[str, Any], **kwargs: Any) -> dict[str, Any] | None:
            try:
                return await step(ctx, desired, **kwargs)
            except NameCollision as exc:
                collisions.append(exc)
                return None

        try:
            key_version = await _ensure_key_secret(ctx, live)
        except NameCollision as exc:
            collisions.append(exc)
            key_version = ""
        await ensure(_ensure, build_pipeline_configmap(live, resolved))
        groups = group_members(resolved)
        for root, members in groups.items():
            await ensure(_ensure, build_group_configmap(live, resolved, root, members))
        for desired in build_network_policies(live, resolved):
            await ensure(_ensure, desired)
        live_stages = {
            s["spec"]["stage"]: s
            for s in await ctx.kube.list(
                API_VERSION, "OmniStage", namespace, label_selector=f"{LABEL_PIPELINE}={name},{LABEL_COMPONENT}=stage"
            )
            if _owned_by(s, live["metadata"]["uid"])
        }
        contract = pipeline_contract(resolved).digest
        old_status = live.get("status") or {}
        targets = {root: group_contract(resolved, members) for root, members in groups.items()}
        views = [_group_view(root, target, live_stages.get(root)) for root, target in targets.items()]
        await _count_free_accelerators(ctx, live, pipeline, resolved, views)
        plan = plan_rollout(
            views,
            pipeline.spec.rollout,
            target=contract,
            previous=RolloutStatus.model_validate(old_status["rollout"]) if old_status.get("rollout") else None,
            serving_before=old_status.get("contract", contract),
            now=dt.datetime.now(dt.timezone.utc),
        )
        stages = []
        desired_stages = build_omnistages(live, pipeline, resolved, key_version=key_version, rollouts=plan.stages)
        for desired in desired_stages:
            applied = await ensure(_ensure_omnistage, desired)
            if applied is not None:
                stages.append(applied)
        wanted = {s["metadata"]["name"] for s in desired_stages}
        for existing in await ctx.kube.list(
            API_VERSION, "OmniStage", namespace, label_selector=f"{LABEL_PIPELINE}={name},{LABEL_COMPONENT}=stage"
        ):
            if existing["metadata"]["name"] not in wanted and _owned_by(existing, live["metadata"]["uid"]):
                ctx.writes += 1
                log.info(
                    "deleting OmniStage %s/%s: its stage left the topology", namespace, existing["metadata"]["name"]
                )
                await ctx.kube.delete(API_VERSION, "OmniStage", existing["metadata"]["name"], namespace)
        router = None
        seen = (live.get("status") or {}).get("routerGeneration")
        for desired in build_router_objects(live, pipeline, resolved, key_version=key_version):
            if desired["kind"] == "Deployment":
                router = await ensure(_ensure, desired, generation_seen=seen)
                if router is not None:
                    status["routerGeneration"] = router["metadata"].get("generation")
            else:
                await ensure(_ensure, desired)
        await _ensure_connector_servers(ctx, live, pipeline, resolved, ensure)
        await _delete_unused_group_configmaps(ctx, live, targets, live_stages)
        if collisions:
            observation.collision_problem = collisions[0].condition()
        observation.stages, observation.router = stages, router
        observation.groups = {s: resolved.stage_group(s) for s in resolved.topology.stage_names()}
        observation.stage_names = resolved.topology.topological_order()
        topo = resolved.topology
        status["topology"] = {
            "pipeline": topo.name,
            "stages": observation.stage_names,
            "edges": [f"{e.source}->{e.target} ({topo.edge_connector(e).value})" for e in topo.edges],
        }
        status["endpoint"] = router_endpoint(pipeline, namespace)
        status["contract"] = contract
        status["rollout"] = plan.status.to_dict()
        observation.rollout_problem = plan.problem
        observation.rollout = plan.status
    else:
        # Report what exists without touching it.
        observation.stages = await ctx.kube.list(
            API_VERSION, "OmniStage", namespace, label_selector=f"{LABEL_PIPELINE}={name}"
        )
        observation.router = await ctx.kube.get("apps/v1", "Deployment", router_name(name), namespace)
        old = (live.get("status") or {}).get("topology") or {}
        observation.stage_names = old.get("stages", [])
    per_stage, stages_ready, wanted_conditions = pipeline_conditions(observation)
    conditions, flipped = _merge_conditions(live, wanted_conditions)
    status.update({"stages": per_stage, "stagesReady": stages_ready, "conditions": conditions})
    if await _write_status(ctx, live, status):
        await _post_events(ctx, live, flipped)
        if plan is not None:
            await _post_rollout_event(ctx, live, (live.get("status") or {}).get("rollout"), plan.status)
    return plan.recheck_seconds if plan is not None else None


async def _count_free_accelerators(
    ctx: Context, live: dict[str, Any], pipeline: OmniPipeline, resolved: Any, views: list[GroupView]
) -> None:
    """Fill in, for each group about to make a new generation (an older one serves, the new one has no
    Deployment yet) whose pods ask for an accelerator, what one replica needs and what the cluster has free.
    Lists nodes and every namespace's pods, so only then; turned off (chart value capacityCheck.enabled false:
    `--no-capacity-check`) or without the permission it counts nothing and a new generation that does not fit
    stays Pending."""
    about_to = [v for v in views if v.older and v.new is None]
    if not about_to or not ctx.capacity_check:
        return
    needs = {}
    for desired in build_omnistages(live, pipeline, resolved, key_version="", rollouts={}):
        root = desired["spec"]["stage"]
        if root in {v.stage for v in about_to}:
            needs[root] = replica_accelerator(OmniStage.model_validate(desired))
    if not any(needs.values()):
        return
    try:
        nodes = await ctx.kube.list("v1", "Node")
        pods = await ctx.kube.list("v1", "Pod", field_selector="status.phase!=Succeeded,status.phase!=Failed")
    except KubeError as exc:
        if exc.status != 403:
            raise
        ctx.capacity_check = False
        log.warning(
            "not counting free accelerators before rollouts: the operator may not list nodes and pods (%s); "
            "grant it with the chart value capacityCheck.enabled", exc,
        )  # fmt: skip
        return
    for view in about_to:
        need = needs.get(view.stage)
        if need is not None:
            view.need, view.free = need, free_accelerators(nodes, pods, need.resource)


def _group_view(root: str, target: str, stage: dict[str, Any] | None) -> GroupView:
    """How the rollout planner sees a pod group: the contract wanted and what its OmniStage reports."""
    if stage is None:
        return GroupView(stage=root, target=target, replicas=0)
    status = stage.get("status") or {}
    if status and "generations" not in status:
        # Written by an operator from before generations: its one Deployment is an older generation of
        # unknown contract, kept until the new one is ready (an operator upgrade never stops a stage).
        generations = [GenerationStatus(contract="", deployment=stage["metadata"]["name"], current=False)]
    else:
        generations = [GenerationStatus.model_validate(g) for g in status.get("generations", [])]
    fresh = status.get("observedGeneration") == stage["metadata"].get("generation")
    degraded = degraded_of(status.get("conditions", [])) if fresh else None
    if degraded is not None and degraded.get("reason") in (Reason.AUTOSCALER_UNAVAILABLE, Reason.NAME_COLLISION):
        degraded = None  # not about its pods: the new generation may still come up
    return GroupView(
        stage=root,
        target=target,
        replicas=stage["spec"].get("replicas", 1),
        generations=generations,
        degraded=degraded,
    )


_ROLLOUT_EVENTS = {
    RolloutPhase.SURGING: ("Normal", "RolloutStarted"),
    RolloutPhase.STOP_THE_WORLD: ("Normal", "RolloutStopTheWorld"),
    RolloutPhase.COMPLETE: ("Normal", "RolloutComplete"),
    RolloutPhase.ROLLED_BACK: ("Warning", "RolledBack"),
    RolloutPhase.FAILED: ("Warning", "RolloutFailed"),
    RolloutPhase.WAITING_FOR_CAPACITY: ("Warning", "RolloutWaitingForCapacity"),
}


async def _post_rollout_event(
    ctx: Context, obj: dict[str, Any], before: dict[str, Any] | None, now: RolloutStatus
) -> None:
    """One Event per rollout phase entered (a first Complete, on a pipeline's creation, is not news)."""
    if before is None and now.phase is RolloutPhase.COMPLETE:
        return
    if before is not None and before.get("phase") == now.phase.value and before.get("target") == now.target:
        return
    type_, reason = _ROLLOUT_EVENTS[now.phase]
    message = now.message or f"every stage runs the generation of contract {now.target}"
    await _event(ctx, obj, type_, reason, message)


async def _delete_unused_group_configmaps(
    ctx: Context, live: dict[str, Any], targets: dict[str, str], live_stages: dict[str, dict[str, Any]]
) -> None:
    """The pod groups' generation ConfigMaps that neither the current generation (`targets`: each group's
    contract digest, by root stage) nor a still-running older one reads (as the OmniStages report them) are
    removed, if ours."""
    name, namespace = live["metadata"]["name"], live["metadata"]["namespace"]
    wanted = {group_configmap_name(name, root, contract) for root, contract in targets.items()}
    for root, stage in live_stages.items():
        for generation in (stage.get("status") or {}).get("generations", []):
            if generation.get("contract"):
                wanted.add(group_configmap_name(name, root, generation["contract"]))
    for existing in await ctx.kube.list(
        "v1", "ConfigMap", namespace, label_selector=f"{LABEL_PIPELINE}={name},{LABEL_COMPONENT}=stage-config"
    ):
        if existing["metadata"]["name"] not in wanted and _owned_by(existing, live["metadata"]["uid"]):
            ctx.writes += 1
            log.info("deleting ConfigMap %s/%s: no generation reads it", namespace, existing["metadata"]["name"])
            await ctx.kube.delete("v1", "ConfigMap", existing["metadata"]["name"], namespace)


async def _ensure_connector_servers(
    ctx: Context, live: dict[str, Any], pipeline: OmniPipeline, resolved: Any, ensure: Any
) -> None:
    """The connector servers the pipeline's edges need (a Mooncake master while an edge uses mooncake);
    those of servers no edge needs any more are removed (if ours). `ensure` applies an object and notes a
    name collision instead of raising it."""
    for obj in build_connector_server_objects(live, pipeline, resolved):
        await ensure(_ensure, obj)
    namespace = live["metadata"]["namespace"]
    for server, api_version, kind, name in unneeded_connector_server_objects(live["metadata"]["name"], resolved):
        existing = await ctx.kube.get(api_version, kind, name, namespace)
        if existing is not None and _owned_by(existing, live["metadata"]["uid"]):
            ctx.writes += 1
            log.info("deleting %s %s/%s: no edge needs the %s server any more", kind, namespace, name, server.value)
            await ctx.kube.delete(api_version, kind, name, namespace)


def _owned_by(obj: dict[str, Any], owner_uid: str | None) -> bool:
    return any(ref.get("uid") == owner_uid for ref in obj["metadata"].get("ownerReferences", []))


async def _ensure_omnistage(ctx: Context, desired: dict[str, Any]) -> dict[str, Any]:
    """Apply an OmniStage without its replicas; set those through /scale (as kubectl scale and an HPA
    do), only when the pipeline owns them (no autoscaling) or the stage is new."""
    meta = desired["metadata"]
    live = await ctx.kube.get(API_VERSION, "OmniStage", meta["name"], meta["namespace"])
    replicas = desired["spec"].pop("replicas")
    autoscaled = "autoscaling" in desired["spec"]
    result = await _ensure(ctx, desired, live=live, fetched=True)
    if live is None or (not autoscaled and result["spec"].get("replicas") != replicas):
        ctx.writes += 1
        await ctx.kube.merge_patch(
            API_VERSION,
            "OmniStage",
            meta["name"],
            meta["namespace"],
            {"spec": {"replicas": replicas}},
            subresource="scale",
        )
        # Read it back: its generation moved on, so its status is stale until the stage reconciles,
        # and the pipeline must not call it ready meanwhile.
        result = await ctx.kube.get(API_VERSION, "OmniStage", meta["name"], meta["namespace"]) or result
    return result


_AUTOSCALER_KINDS = ((KEDA_API_VERSION, "ScaledObject"), (HPA_API_VERSION, "HorizontalPodAutoscaler"))


async def _ensure_autoscaler(ctx: Context, stage: OmniStage) -> Condition | None:
    """The stage's ScaledObject or HPA while it has autoscaling; the other kind (and both, without
    autoscaling) removed when ours. A Degraded condition when KEDA's CRDs are not installed."""
    desired = build_stage_autoscaler(stage)
    problem = None
    if desired is not None:
        try:
            await _ensure(ctx, desired)
        except KubeError as exc:
            # 404 on the kind itself (not on the object: _ensure reads first) means no such API.
            if exc.status != 404 or desired["kind"] != "ScaledObject":
                raise
            problem = Condition(
                "Degraded",
                "True",
                Reason.AUTOSCALER_UNAVAILABLE,
                f"stage {stage.spec.stage}: autoscaling needs KEDA, and the cluster has no ScaledObject "
                f"API ({KEDA_API_VERSION}); install KEDA (helm install keda kedacore/keda -n keda "
                "--create-namespace, see the README), or set autoscaling.engine: hpa, or drop autoscaling",
            )
    meta = stage.metadata
    for api_version, kind in _AUTOSCALER_KINDS:
        if desired is not None and desired["kind"] == kind:
            continue
        try:
            existing = await ctx.kube.get(api_version, kind, meta.name, meta.namespace)
        except KubeError as exc:
            if exc.status == 404:
                continue  # KEDA not installed: nothing of that kind can exist
            raise
        if existing is not None and _owned_by(existing, stage.metadata.uid):
            ctx.writes += 1
            log.info("deleting %s %s/%s: the stage no longer asks for it", kind, meta.namespace, meta.name)
            await ctx.kube.delete(api_version, kind, meta.name, meta.namespace)
    return problem


AUTOSCALER_RECHECK_SECONDS = 30.0
"""How soon a stage waiting for KEDA to be installed is looked at again (no watch sees a CRD arrive)."""


async def reconcile_stage(ctx: Context, namespace: str, name: str) -> float | None:
    """Make an OmniStage's Deployment, Service and autoscaler match it, then report status. Returns the
    seconds after which to reconcile it again though nothing changed (KEDA missing), or None."""
    live = await ctx.kube.get(API_VERSION, "OmniStage", name, namespace)
    if live is None or live["metadata"].get("deletionTimestamp"):
        if ctx.metrics is not None:
            ctx.metrics.observe_stage(namespace, name, None)
        return None
    if ctx.metrics is not None:
        ctx.metrics.observe_stage(namespace, name, live)
    seen = (live.get("status") or {}).get("workloadGeneration")
    stage = OmniStage.model_validate(live)
    collision: Condition | None = None
    deployment = None
    desired = build_stage_deployment(stage)
    # Older generations first: once the pipeline releases them they go before the current one grows to its
    # full count, so the stage never runs more than its replicas plus the surge.
    older = await _older_generations(ctx, stage, desired["metadata"]["name"])
    try:
        # Read by name, not taken from the list of our Deployments: someone else's object of that name must be
        # found (and left alone, NameCollision), and it carries none of our labels.
        if _waits_for_capacity(stage) and await ctx.kube.get("apps/v1", "Deployment", desired["metadata"]["name"],
                                                              stage.metadata.namespace) is None:  # fmt: skip
            deployment = None  # its pods would sit Pending: none is made until the accelerators are free
        else:
            deployment = await _ensure(ctx, desired, generation_seen=seen)
    except NameCollision as exc:
        collision = exc.condition()
    try:
        await _ensure(ctx, build_stage_service(stage))
    except NameCollision as exc:
        collision = collision or exc.condition()
    autoscaler_problem = None
    try:
        autoscaler_problem = await _ensure_autoscaler(ctx, stage)
    except NameCollision as exc:
        collision = collision or exc.condition()
    selector = stage_selector(stage)
    # The current generation's pods: an older generation's trouble is not the new one's, and it goes anyway.
    pods = await ctx.kube.list("v1", "Pod", namespace, label_selector=selector_string(generation_selector(stage)))
    counts, wanted = stage_conditions(live, deployment, pods, problem=collision, autoscaler_problem=autoscaler_problem)
    conditions, flipped = _merge_conditions(live, wanted)
    status = {
        "observedGeneration": live["metadata"].get("generation"),
        **counts,
        "selector": selector_string(selector),
        "workloadGeneration": deployment["metadata"].get("generation") if deployment else seen,
        "generations": [_generation(d, current=True) for d in ([deployment] if deployment else [])]
        + [_generation(d, current=False) for d in older],
        "conditions": conditions,
    }
    if await _write_status(ctx, live, status):
        await _post_events(ctx, live, flipped)
    return AUTOSCALER_RECHECK_SECONDS if autoscaler_problem is not None else None


def _waits_for_capacity(stage: OmniStage) -> bool:
    return stage.spec.rollout is not None and stage.spec.rollout.waiting_for_capacity


async def _older_generations(ctx: Context, stage: OmniStage, current_name: str) -> list[dict[str, Any]]:
    """The stage's Deployments other than its current generation's, as they are now. While the pipeline holds
    them (`spec.rollout.keepOlder`: its new generation is not whole yet) they keep serving, untouched; then
    they are deleted, and their pods drain what they run (SIGTERM) and go."""
    meta = stage.metadata
    listed = await ctx.kube.list(
        "apps/v1", "Deployment", meta.namespace, label_selector=selector_string(stage_selector(stage))
    )
    found = [d for d in listed if d["metadata"]["name"] != current_name and _owned_by(d, meta.uid)]
    if stage.spec.rollout is not None and stage.spec.rollout.keep_older:
        return found
    for old in found:
        ctx.writes += 1
        log.info(
            "deleting Deployment %s/%s: an older generation of stage %s (its pods drain)",
            meta.namespace, old["metadata"]["name"], stage.spec.stage,
        )  # fmt: skip
        await ctx.kube.delete("apps/v1", "Deployment", old["metadata"]["name"], meta.namespace)
    return []


def _generation(deployment: dict[str, Any], *, current: bool) -> dict[str, Any]:
    meta, spec, ds = deployment["metadata"], deployment.get("spec", {}), deployment.get("status", {})
    return GenerationStatus(
        contract=(meta.get("labels") or {}).get(GENERATION_LABEL, ""),
        deployment=meta["name"],
        current=current,
        replicas=spec.get("replicas", 0),
        ready_replicas=ds.get("readyReplicas", 0),
        created=meta.get("creationTimestamp", ""),
    ).to_dict()
