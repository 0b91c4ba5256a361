"""Where a pipeline's processes run and how they find each other: what the caller of `resolve_pipeline`
knows that the topology and the deployment's overrides do not.

The operator places each pod group behind a headless Service and the Mooncake master behind one of its
own; the local launcher places everything on one machine, on ports it picks. Each says so in a
`Placement`, and `resolve_pipeline` writes the result into the resolved pipeline, so no caller changes
that pipeline afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "STAGE_HTTP_PORT",
    "STAGE_PORT",
    "MooncakeMasterAddress",
    "Placement",
    "PodGroups",
    "StageDiscovery",
    "pod_groups",
]

STAGE_PORT = 8100
"""Port of the stage server's ZeroMQ control socket."""
STAGE_HTTP_PORT = 8101
"""Port of the stage server's /healthz, /readyz and /metrics."""

PodGroups = Mapping[str, Sequence[str]]
"""Pod group -> its stages: the stage that owns the pod first, then those colocated with it."""


class StageDiscovery(BaseModel):
    """How the router finds a stage's replicas."""

    model_config = ConfigDict(extra="forbid")

    static: list[str] = Field(default_factory=list, description="Fixed replica addresses `host:port` (local mode).")
    service: str | None = Field(
        None, description="Kubernetes Service whose EndpointSlices list the replicas (cluster mode)."
    )
    namespace: str | None = None
    port: int = STAGE_PORT


class MooncakeMasterAddress(BaseModel):
    """Where the pipeline's one Mooncake master and metadata server listen."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(description="DNS name or IP the stages reach the master at.")
    master_port: int | None = Field(None, ge=1, le=65535, description="RPC port; None keeps the connectors spec's.")
    metadata_port: int | None = Field(
        None, ge=1, le=65535, description="HTTP metadata port; None keeps the connectors spec's."
    )


class Placement(BaseModel):
    """What `resolve_pipeline` needs to know about where the processes of a pipeline run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    discovery: Callable[[PodGroups], Mapping[str, StageDiscovery]] = Field(
        description="Given the pod groups, how the router finds each stage."
    )
    mooncake_master: Callable[[], MooncakeMasterAddress] = Field(
        description="Where the Mooncake master runs; called only when an edge uses `mooncake` (the local "
        "launcher picks its ports then)."
    )
    scale_from_zero: frozenset[str] = Field(
        frozenset(),
        description="Stages owning a pod group that an autoscaler may take to zero replicas; the stages "
        "colocated with one go to zero with its pods.",
    )


def pod_groups(order: Sequence[str], colocation: Mapping[str, str]) -> dict[str, list[str]]:
    """The pod groups of stages in `order` (topological), given `colocation` (stage -> the stage whose
    pod it shares): each group in the order of its first stage, the owning stage first."""
    groups: dict[str, list[str]] = {}
    for name in order:
        groups.setdefault(colocation.get(name, name), [])
    for name in order:
        root = colocation.get(name, name)
        if name == root:
            groups[root].insert(0, name)
        else:
            groups[root].append(name)
    return groups
