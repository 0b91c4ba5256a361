"""`omnikube render`: every object the operator would create for an OmniPipeline, offline, as YAML.

For review in GitOps and for diffing releases. The owner's uid is unknown before the pipeline exists,
so owner references carry a placeholder (or are left out with `--no-owner-references`).

The pipeline key Secret is not rendered: its bytes are random, made by the operator once in the cluster,
and must never land in Git. The pods that mount it wait for it (the operator creates it first).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from omni_operator.api import OmniPipeline, OmniStage, validation_messages
from omni_operator.builders.autoscaler import build_stage_autoscaler
from omni_operator.builders.connector_servers import build_connector_server_objects
from omni_operator.builders.pipeline_objects import build_group_configmap, build_omnistages, build_pipeline_configmap
from omni_operator.builders.router import build_router_objects
from omni_operator.builders.stage_workload import build_stage_deployment, build_stage_service
from omni_operator.builders.trust import build_network_policies
from omni_operator.resolve import group_members, resolve_cluster_pipeline
from omni_runtime.registry import PipelineRegistry
from omni_runtime.spec import SpecError

__all__ = ["RenderError", "dump_yaml", "render_pipeline", "render_file"]

PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"

# Strings a YAML 1.1 or 1.2 reader (kubectl, Helm, Argo CD) would take for a number, boolean or null.
# PyYAML leaves some of them unquoted (`12e45` is a number to Go's YAML, not to PyYAML).
_NOT_A_STRING = re.compile(
    r"[-+]?(\.[0-9]+|[0-9][0-9_]*(\.[0-9_]*)?)([eE][-+]?[0-9]+)?|0x[0-9a-fA-F_]+|0o?[0-7_]+|0b[01_]+"
    r"|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)|[0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9_]*)?"
    r"|(?i:y|n|yes|no|true|false|on|off|null)|~|"
)


class _QuotingDumper(yaml.SafeDumper):
    """SafeDumper that quotes every string another YAML reader could take for something else."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "'" if _NOT_A_STRING.fullmatch(value) else None
    if "\n" in value:
        style = "|"
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_QuotingDumper.add_representer(str, _represent_str)


def dump_yaml(objects: list[dict[str, Any]]) -> str:
    """A multi-document YAML stream that kubectl, Helm and GitOps tools read back exactly."""
    return yaml.dump_all(objects, Dumper=_QuotingDumper, sort_keys=False)


class RenderError(ValueError):
    """The manifest cannot be rendered; the message lists every problem with its field."""


def render_pipeline(
    manifest: dict[str, Any],
    registry: PipelineRegistry,
    *,
    owner_references: bool = True,
    model_root: Path | None = None,
) -> list[dict[str, Any]]:
    """The ConfigMaps (the router's, and each pod group's generation), NetworkPolicies, OmniStages, their
    Deployments, Services and autoscalers, and the router objects."""
    owner = {**manifest, "metadata": {"namespace": "default", **manifest.get("metadata", {})}}
    owner["metadata"].setdefault("uid", PLACEHOLDER_UID)
    try:
        pipeline = OmniPipeline.model_validate(owner)
        resolved = resolve_cluster_pipeline(pipeline, registry, model_root)
    except ValidationError as exc:
        raise RenderError("\n".join(validation_messages(exc))) from None
    except SpecError as exc:
        raise RenderError(str(exc)) from None
    objects = [
        build_pipeline_configmap(owner, resolved),
        *(build_group_configmap(owner, resolved, root, members) for root, members in group_members(resolved).items()),
        *build_network_policies(owner, resolved),
    ]
    for stage_manifest in build_omnistages(owner, pipeline, resolved):
        objects.append(stage_manifest)
        stage = OmniStage.model_validate(stage_manifest)
        stage.metadata.uid = PLACEHOLDER_UID  # as if created: the objects it owns refer to it
        objects += [build_stage_deployment(stage), build_stage_service(stage)]
        autoscaler = build_stage_autoscaler(stage)
        if autoscaler is not None:
            objects.append(autoscaler)
    objects += build_router_objects(owner, pipeline, resolved)
    objects += build_connector_server_objects(owner, pipeline, resolved)
    if not owner_references:
        for obj in objects:
            obj["metadata"].pop("ownerReferences", None)
    return objects


def render_file(path: Path, registry: PipelineRegistry, **kwargs: Any) -> str:
    """Render every OmniPipeline in a YAML file as one multi-document YAML stream."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    pipelines = [d for d in docs if d.get("kind") == "OmniPipeline"]
    if not pipelines:
        raise RenderError(f"{path}: no OmniPipeline in the file (found kinds {[d.get('kind') for d in docs]})")
    out: list[dict[str, Any]] = []
    for doc in pipelines:
        try:
            out += render_pipeline(doc, registry, **kwargs)
        except RenderError as exc:
            name = (doc.get("metadata") or {}).get("name", "?")
            raise RenderError(f"{path}: OmniPipeline {name}:\n{exc}") from None
    return dump_yaml(out)
