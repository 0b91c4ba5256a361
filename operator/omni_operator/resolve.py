"""OmniPipeline -> ResolvedPipeline in cluster mode: registry topology, overrides, discovery by Service.

Pure apart from reading the model's config files when `spec.pipeline` is unset (local files under the
operator's own model-cache mount; never the network).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path, PurePosixPath

from omni_operator.api import OmniPipeline, namespace_of, resolve
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
    ConnectorServer,
    MooncakeMasterAddress,
    PipelineSpec,
    Placement,
    PodGroups,
    ResolvedPipeline,
    StageDiscovery,
    check_engine_args,
    pod_groups,
)

__all__ = [
    "DEFAULT_MOUNT",
    "cluster_placement",
    "connector_server_host",
    "connector_server_name",
    "group_members",
    "resolve_cluster_pipeline",
    "service_discovery",
    "stage_ports",
    "model_path_in_pod",
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
    return pod_groups(resolved.topology.topological_order(), resolved.colocation)


def stage_ports(index_in_group: int) -> tuple[int, int]:
    """(control port, http port) of the i-th stage of a pod group."""
    return STAGE_PORT + index_in_group * PORT_STRIDE, STAGE_HTTP_PORT + index_in_group * PORT_STRIDE


def connector_server_name(pipeline: str, server: ConnectorServer) -> str:
    """The name of a connector server's objects (`<pipeline>-mooncake`: its Deployment and its
    headless Service)."""
    return child_name(pipeline, server.value)


def connector_server_host(pipeline: str, namespace: str, server: ConnectorServer) -> str:
    """The DNS name of a connector server of the pipeline: its headless Service, which resolves to the
    server pod's IP."""
    return f"{connector_server_name(pipeline, server)}.{namespace}.svc"


def service_discovery(pipeline: str, namespace: str, groups: PodGroups) -> dict[str, StageDiscovery]:
    """Each stage is found through its pod group's headless Service, on its own port in the pod."""
    return {
        stage: StageDiscovery(service=child_name(pipeline, root), namespace=namespace, port=stage_ports(index)[0])
        for root, members in groups.items()
        for index, stage in enumerate(members)
    }


def cluster_placement(pipeline: OmniPipeline) -> Placement:
    """Where the pipeline's processes run in the cluster: each pod group behind its headless Service, the
    Mooncake master behind `<pipeline>-mooncake`, and the stages whose autoscaling may reach zero."""
    name = pipeline.metadata.name
    namespace = namespace_of(pipeline)
    return Placement(
        discovery=partial(service_discovery, name, namespace),
        mooncake_master=partial(
            MooncakeMasterAddress, host=connector_server_host(name, namespace, ConnectorServer.MOONCAKE)
        ),
        scale_from_zero=frozenset(
            s.name for s in pipeline.spec.stages if s.autoscaling and s.autoscaling.min_replicas == 0
        ),
    )


def resolve_cluster_pipeline(
    pipeline: OmniPipeline, registry: PipelineRegistry, model_root: Path | None = None
) -> ResolvedPipeline:
    """Resolve for the cluster: each stage is found through its pod group's headless Service.

    Raises SpecError (InvalidEngineArgs among them) when the pipeline cannot run, before anything is built."""
    topology = topology_for(pipeline, registry, model_root)
    placement = cluster_placement(pipeline)
    resolved = resolve(pipeline, topology, model_path=model_path_in_pod(pipeline), placement=placement)
    check_engine_args(resolved.topology)  # omnikube's own keys; vLLM's are checked when the stage starts
    return resolved
