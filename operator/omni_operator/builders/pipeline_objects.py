"""OmniPipeline -> its ConfigMap (the resolved pipeline) and one OmniStage per pod group."""

from __future__ import annotations

from typing import Any

from omni_operator.api import API_VERSION, OmniPipeline, PipelineStage
from omni_operator.api.common import DEFAULT_GRACE_SECONDS
from omni_operator.builders.meta import (
    child_name,
    content_hash,
    labels,
    owner_reference,
    with_hash,
)
from omni_operator.resolve import group_members
from omni_runtime.spec import ResolvedPipeline

__all__ = [
    "CONFIG_KEY",
    "CONFIG_HASH_ANNOTATION",
    "KEY_VERSION_ANNOTATION",
    "build_pipeline_configmap",
    "build_omnistages",
    "configmap_name",
    "mooncake_name",
    "omnistage_name",
    "router_name",
]

CONFIG_KEY = "resolved.json"
CONFIG_HASH_ANNOTATION = "omnikube.io/config-hash"
"""On an OmniStage: hash of the resolved config its pods read (its stages and their edges)."""
KEY_VERSION_ANNOTATION = "omnikube.io/key-version"
"""On an OmniStage: the uid of the pipeline key Secret its pods mount (a new Secret rolls them)."""


def configmap_name(pipeline: str) -> str:
    return child_name(pipeline, "config")


def omnistage_name(pipeline: str, stage: str) -> str:
    return child_name(pipeline, stage)


def router_name(pipeline: str) -> str:
    return child_name(pipeline, "router")


def mooncake_name(pipeline: str) -> str:
    """The pipeline's Mooncake master: its Deployment and its headless Service (see resolve.mooncake_host)."""
    return child_name(pipeline, "mooncake")


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


def _stage_overrides(pipeline: OmniPipeline) -> dict[str, PipelineStage]:
    return {s.name: s for s in pipeline.spec.stages}


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
    owner: dict[str, Any], pipeline: OmniPipeline, resolved: ResolvedPipeline, *, key_version: str = ""
) -> list[dict[str, Any]]:
    """One OmniStage per pod group (a stage and those colocated with it), fully resolved. `key_version`:
    the uid of the pipeline's key Secret (empty when rendering offline)."""
    name = owner["metadata"]["name"]
    namespace = owner["metadata"]["namespace"]
    overrides = _stage_overrides(pipeline)
    runtime = pipeline.spec.runtime
    out = []
    for root, members in group_members(resolved).items():
        stage = resolved.topology.stage(root)
        override = overrides.get(root) or PipelineStage(name=root)
        spec: dict[str, Any] = {
            "pipeline": name,
            "stage": root,
            "kind": stage.kind.value,
            "replicas": (override.autoscaling.min_replicas if override.autoscaling else override.replicas),
            "image": runtime.image,
            "imagePullPolicy": runtime.image_pull_policy.value,
            "model": resolved.model,
            "configMap": configmap_name(name),
            "shmSize": override.shm_size or runtime.shm_size,
            "terminationGracePeriodSeconds": override.termination_grace_period_seconds or DEFAULT_GRACE_SECONDS,
            "engineArgs": stage.engine_args,
            "samplingParams": stage.sampling_params,
        }
        if members[1:]:
            spec["colocated"] = members[1:]
        if runtime.image_pull_secrets:
            spec["imagePullSecrets"] = list(runtime.image_pull_secrets)
        if runtime.model_cache:
            spec["modelCache"] = runtime.model_cache.to_dict()
        env = [e.to_dict() for e in runtime.env]
        if env:
            spec["env"] = env
        if runtime.hf_token_secret:
            spec["hfTokenSecret"] = runtime.hf_token_secret.to_dict()
        if override.autoscaling:
            spec["autoscaling"] = override.autoscaling.to_dict()
        placement = override.to_dict()
        for key in ("accelerator", "nodeSelector", "tolerations", "affinity", "resources"):
            value = placement.get(key)
            if value and (key != "resources" or any(value.values())):
                spec[key] = value
        out.append(
            with_hash(
                {
                    "apiVersion": API_VERSION,
                    "kind": "OmniStage",
                    "metadata": {
                        "name": omnistage_name(name, root),
                        "namespace": namespace,
                        "labels": labels(name, "stage", root),
                        "annotations": {
                            CONFIG_HASH_ANNOTATION: group_config_hash(resolved, members),
                            KEY_VERSION_ANNOTATION: key_version,
                        },
                        "ownerReferences": [owner_reference(owner)],
                    },
                    "spec": spec,
                }
            )
        )
    return out
