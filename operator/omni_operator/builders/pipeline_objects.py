"""OmniPipeline -> its ConfigMap (the resolved pipeline) and one OmniStage per pod group."""

from __future__ import annotations

from typing import Any

from omni_operator.api import API_VERSION, KubeModel, OmniPipeline, OmniStage, OmniStageSpec, PipelineStage
from omni_operator.api.common import DEFAULT_GRACE_SECONDS, Placement
from omni_operator.api.rollout import StageRollout
from omni_operator.builders.meta import (
    child_name,
    content_hash,
    labels,
    owner_reference,
    with_hash,
)
from omni_operator.resolve import group_members
from omni_runtime.spec import ResolvedPipeline
from omni_runtime.spec.contract import CONTRACT_LABEL_DOMAIN, pipeline_contract

__all__ = [
    "GENERATION_LABEL",
    "CONFIG_KEY",
    "CONFIG_HASH_ANNOTATION",
    "KEY_VERSION_ANNOTATION",
    "build_group_configmap",
    "build_pipeline_configmap",
    "group_configmap_name",
    "group_contract",
    "build_omnistages",
    "configmap_name",
    "omnistage_name",
    "omnistage_spec",
    "router_name",
    "stored_omnistage_spec",
]

CONFIG_KEY = "resolved.json"
CONFIG_HASH_ANNOTATION = "omnikube.io/config-hash"
"""On an OmniStage: hash of the resolved config its pods read (its stages and their edges)."""
KEY_VERSION_ANNOTATION = "omnikube.io/key-version"
"""On an OmniStage: the uid of the pipeline key Secret its pods mount (a new Secret rolls them)."""
GENERATION_LABEL = "omnikube.io/generation"
"""On a pod group's generation ConfigMap, Deployment and pods: the group's contract digest (`group_contract`)."""
GENERATION_NAME_CHARS = 10
"""Characters of the group's contract digest in the names of its generation's Deployment and ConfigMap."""


def configmap_name(pipeline: str) -> str:
    return child_name(pipeline, "config")


def omnistage_name(pipeline: str, stage: str) -> str:
    return child_name(pipeline, stage)


def router_name(pipeline: str) -> str:
    return child_name(pipeline, "router")


def group_contract(resolved: ResolvedPipeline, members: list[str]) -> str:
    """The contract digest of a pod group (its stages' digests): equal exactly when none of its stages'
    contracts changed, so a change elsewhere in the pipeline leaves the group's pods as they are."""
    contract = pipeline_contract(resolved)
    return content_hash({m: contract.stages[m].digest for m in members})


def group_configmap_name(pipeline: str, root: str, contract: str) -> str:
    """The ConfigMap the pods of one generation of pod group `root` read."""
    return child_name(pipeline, root, contract[:GENERATION_NAME_CHARS])


def build_pipeline_configmap(owner: dict[str, Any], resolved: ResolvedPipeline) -> dict[str, Any]:
    """The resolved pipeline as JSON, read by the router and every stage server."""
    name = owner["metadata"]["name"]
    return with_hash(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": configmap_name(name),
                "namespace": owner["metadata"]["namespace"],
                "labels": labels(name, "config"),
                "ownerReferences": [owner_reference(owner)],
            },
            "data": {CONFIG_KEY: resolved.model_dump_json(by_alias=True, indent=2)},
        }
    )


def build_group_configmap(
    owner: dict[str, Any], resolved: ResolvedPipeline, root: str, members: list[str]
) -> dict[str, Any]:
    """The resolved pipeline for the pods of pod group `root`'s current generation. Each generation has its
    own (named by the group's contract digest): an older generation's pod that restarts mid-rollout, or after
    a rolled-back one, reads what it ran, not the new spec."""
    name = owner["metadata"]["name"]
    contract = group_contract(resolved, members)
    return with_hash(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": group_configmap_name(name, root, contract),
                "namespace": owner["metadata"]["namespace"],
                "labels": {**labels(name, "stage-config", root), GENERATION_LABEL: contract},
                "ownerReferences": [owner_reference(owner)],
            },
            "data": {CONFIG_KEY: resolved.model_dump_json(by_alias=True, indent=2)},
        }
    )


def group_config_hash(resolved: ResolvedPipeline, members: list[str]) -> str:
    """What the pods of a group read from the config: their stages, the edges touching them, connectors."""
    topo = resolved.topology
    return content_hash(
        {
            "stages": [topo.stage(m).model_dump(mode="json") for m in members],
            "edges": [
                e.model_dump(mode="json", by_alias=True)
                for e in topo.edges
                if e.source in members or e.target in members
            ],
            "connectors": topo.connectors.model_dump(mode="json"),
            "colocation": {m: resolved.stage_group(m) for m in members},
            "model": resolved.model,
        }
    )


def build_omnistages(
    owner: dict[str, Any],
    pipeline: OmniPipeline,
    resolved: ResolvedPipeline,
    *,
    key_version: str = "",
    rollouts: dict[str, StageRollout] | None = None,
) -> list[dict[str, Any]]:
    """One OmniStage per pod group (a stage and those colocated with it), fully resolved. `key_version`:
    the uid of the pipeline's key Secret (empty when rendering offline). `rollouts`: what the pipeline's
    rollout tells each pod group, by its root stage (`rollout.plan_rollout`); none in steady state."""
    name = owner["metadata"]["name"]
    overrides = {s.name: s for s in pipeline.spec.stages}
    contract = pipeline_contract(resolved)
    out = []
    for root, members in group_members(resolved).items():
        spec = omnistage_spec(pipeline, resolved, members, overrides.get(root) or PipelineStage(name=root))
        spec.rollout = (rollouts or {}).get(root)
        out.append(
            with_hash(
                {
                    "apiVersion": API_VERSION,
                    "kind": OmniStage.crd.kind,
                    "metadata": {
                        "name": omnistage_name(name, root),
                        "namespace": owner["metadata"]["namespace"],
                        "labels": {
                            **labels(name, "stage", root),
                            **{f"{CONTRACT_LABEL_DOMAIN}/{m}": contract.stages[m].digest for m in members},
                        },
                        "annotations": {
                            CONFIG_HASH_ANNOTATION: group_config_hash(resolved, members),
                            KEY_VERSION_ANNOTATION: key_version,
                        },
                        "ownerReferences": [owner_reference(owner)],
                    },
                    "spec": stored_omnistage_spec(spec),
                }
            )
        )
    return out


def omnistage_spec(
    pipeline: OmniPipeline, resolved: ResolvedPipeline, members: list[str], override: PipelineStage
) -> OmniStageSpec:
    """The OmniStage of the pod group `members` (its owning stage first), whose entry in the pipeline's
    `stages` is `override`."""
    root = members[0]
    stage = resolved.topology.stage(root)
    runtime = pipeline.spec.runtime
    contract = group_contract(resolved, members)
    return OmniStageSpec(
        pipeline=pipeline.metadata.name,
        stage=root,
        kind=stage.kind,
        replicas=override.autoscaling.min_replicas if override.autoscaling else override.replicas,
        image=runtime.image,
        image_pull_policy=runtime.image_pull_policy,
        image_pull_secrets=list(runtime.image_pull_secrets),
        model=resolved.model,
        config_map=group_configmap_name(pipeline.metadata.name, root, contract),
        contract=contract,
        colocated=members[1:],
        shm_size=override.shm_size or runtime.shm_size,
        autoscaling=override.autoscaling,
        engine_args=stage.engine_args,
        sampling_params=stage.sampling_params,
        model_cache=runtime.model_cache,
        env=list(runtime.env),
        hf_token_secret=runtime.hf_token_secret,
        termination_grace_period_seconds=override.termination_grace_period_seconds or DEFAULT_GRACE_SECONDS,
        accelerator=override.accelerator,
        node_selector=override.node_selector,
        tolerations=override.tolerations,
        affinity=override.affinity,
        resources=override.resources,
    )


_LEFT_OUT_WHEN_EMPTY = frozenset(Placement.model_fields) | {"colocated", "image_pull_secrets", "env"}
"""Fields of an OmniStage spec written only when they hold something (the optional ones, None, are never
written): an OmniStage shows what its pipeline chose, and its content hash stays what it was."""


def stored_omnistage_spec(spec: OmniStageSpec) -> dict[str, Any]:
    """The spec as the operator applies it: camelCase, without the unset and the empty optional fields."""
    empty = {name for name in _LEFT_OUT_WHEN_EMPTY if not _holds_something(getattr(spec, name))}
    return spec.model_dump(mode="json", by_alias=True, exclude_none=True, exclude=empty)


def _holds_something(value: Any) -> bool:
    if isinstance(value, KubeModel):
        return any(_holds_something(v) for v in value.to_dict().values())
    return bool(value)
