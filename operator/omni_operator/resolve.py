"""OmniPipeline -> ResolvedPipeline in cluster mode: registry topology, overrides, discovery by Service.

Pure apart from reading the model's config files when `spec.pipeline` is unset (local files under the
operator's own model-cache mount; never the network).
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from omni_operator.api import OmniPipeline, resolve
from omni_operator.builders.meta import child_name
from omni_runtime.registry import (
    PipelineRegistry,
    RegistryError,
    local_model_dir,
    read_model_signature,
)
from omni_runtime.spec import (
    STAGE_HTTP_PORT,
    STAGE_PORT,
    PipelineSpec,
    ResolvedPipeline,
    StageDiscovery,
)

__all__ = [
    "DEFAULT_MOUNT",
    "group_members",
    "resolve_cluster_pipeline",
    "stage_ports",
    "model_path_in_pod",
    "mooncake_host",
    "uses_mooncake",
]

DEFAULT_MOUNT = "/models"
PORT_STRIDE = 10
"""Colocated stages share a pod: the i-th stage of a group listens on base + i * PORT_STRIDE."""


def model_path_in_pod(pipeline: OmniPipeline) -> str:
    """Where the stage pods find the model: an absolute `model` as is, else under the cache mount."""
    model = pipeline.spec.model
    if model.startswith("/"):
        return model
    cache = pipeline.spec.runtime.model_cache if pipeline.spec.runtime else None
    mount = cache.mount_path if cache else DEFAULT_MOUNT
    return str(PurePosixPath(mount) / model)


def topology_for(pipeline: OmniPipeline, registry: PipelineRegistry, model_root: Path | None) -> PipelineSpec:
    """The registry topology the pipeline names, or the one its model's config files select."""
    if pipeline.spec.pipeline:
        return registry.get(pipeline.spec.pipeline)
    if model_root is None:
        raise RegistryError(
            f"spec.pipeline is unset and this operator has no model cache to read {pipeline.spec.model!r} "
            f"from; set spec.pipeline to one of {registry.names()}"
        )
    folder = local_model_dir(pipeline.spec.model, cache_dir=model_root)
    return registry.match(read_model_signature(folder))


def group_members(resolved: ResolvedPipeline) -> dict[str, list[str]]:
    """Pod group (root stage) -> its stages, root first, in topology order."""
    groups: dict[str, list[str]] = {}
    for name in resolved.topology.topological_order():
        groups.setdefault(resolved.stage_group(name), [])
    for name in resolved.topology.topological_order():
        root = resolved.stage_group(name)
        if name == root:
            groups[root].insert(0, name)
        else:
            groups[root].append(name)
    return groups


def stage_ports(index_in_group: int) -> tuple[int, int]:
    """(control port, http port) of the i-th stage of a pod group."""
    return STAGE_PORT + index_in_group * PORT_STRIDE, STAGE_HTTP_PORT + index_in_group * PORT_STRIDE


def uses_mooncake(resolved: ResolvedPipeline) -> bool:
    """Whether any edge moves data through Mooncake (then the pipeline runs a Mooncake master)."""
    return resolved.uses_mooncake()


def mooncake_host(pipeline: str, namespace: str) -> str:
    """The DNS name of the pipeline's Mooncake master: its headless Service `<pipeline>-mooncake`,
    which resolves to the master pod's IP."""
    return f"{child_name(pipeline, 'mooncake')}.{namespace}.svc"


def resolve_cluster_pipeline(
    pipeline: OmniPipeline, registry: PipelineRegistry, model_root: Path | None = None
) -> ResolvedPipeline:
    """Resolve for the cluster: each stage is found through its pod group's headless Service."""
    name = pipeline.metadata.name
    namespace = pipeline.metadata.namespace or "default"
    topology = topology_for(pipeline, registry, model_root)
    resolved = resolve(pipeline, topology, model_path=model_path_in_pod(pipeline))
    resolved.name = name
    resolved.namespace = namespace
    resolved.served_model_name = pipeline.spec.served_model_name or pipeline.spec.model
    from_zero = {s.name for s in pipeline.spec.stages if s.autoscaling and s.autoscaling.min_replicas == 0}
    for root, members in group_members(resolved).items():
        if root in from_zero:
            resolved.scale_from_zero += members  # colocated stages go to zero with their pods
        for index, stage in enumerate(members):
            resolved.discovery[stage] = StageDiscovery(
                service=child_name(name, root), namespace=namespace, port=stage_ports(index)[0]
            )
    if resolved.uses_mooncake():
        resolved.mooncake_master_host = mooncake_host(name, namespace)
    return resolved
