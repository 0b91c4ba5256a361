"""The local pipeline file `omnikube serve` reads, or the one it makes up for a model folder.

The file (YAML) is an OmniPipeline spec cut down to what one machine needs; a relative `model` is
relative to the file:

    model: ./tiny-prompt-enhanced-t2i      # required
    pipeline: prompt-enhanced-t2i          # registry name; default: from the model folder
    name: demo                             # deployment name (default: the pipeline's)
    served_model_name: demo                # what clients put in `model` (default: name)
    stages:                                # per-stage overrides, all optional
      - name: enhancer
        replicas: 1
        engine_args: {max_model_len: 512}
        sampling_params: {max_tokens: 32}
    connectors:                            # ConnectorsSpec plus per-edge overrides
      default: shm                         # inline | shm | mooncake (local default: shm)
      edges:
        - {from: enhancer, to: dit, connector: mooncake, window: 0}
    limits: {max_concurrent_requests: 8, request_timeout_s: 120}   # RouterLimits
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omni_runtime.spec import ConnectorKind, ConnectorsSpec, EdgeOverride, RouterLimits, SpecError

__all__ = ["LocalConnectors", "LocalPipelineFile", "LocalStage", "load_local_spec"]


class LocalStage(BaseModel):
    """What the file changes on one stage: its replicas, and its overrides of the topology's args."""

    model_config = ConfigDict(extra="forbid")

    name: str
    replicas: int = Field(1, ge=1, le=16)
    engine_args: dict[str, Any] = Field(default_factory=dict)
    sampling_params: dict[str, Any] = Field(default_factory=dict)


class LocalConnectors(ConnectorsSpec):
    """The connectors of the pipeline; on one machine `shm` serves every edge by default."""

    default: ConnectorKind = ConnectorKind.SHM
    edges: list[EdgeOverride] = Field(default_factory=list)


class LocalPipelineFile(BaseModel):
    """The YAML `omnikube serve` accepts (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    pipeline: str | None = None
    name: str | None = None
    served_model_name: str | None = None
    stages: list[LocalStage] = Field(default_factory=list)
    connectors: LocalConnectors = Field(default_factory=LocalConnectors)
    limits: RouterLimits = Field(default_factory=RouterLimits)


def load_local_spec(target: str | Path, *, pipeline: str | None = None) -> LocalPipelineFile:
    """A local pipeline file, or one made up for a model folder (`pipeline` overrides the file's)."""
    path = Path(target).expanduser()
    if path.is_file() and path.suffix in (".yaml", ".yml", ".json"):
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            raise SpecError(f"{path}: not valid YAML: {' '.join(str(err).split())}") from err
        if not isinstance(raw, dict):
            raise SpecError(f"{path}: expected a mapping with at least `model`, found {type(raw).__name__}")
        try:
            spec = LocalPipelineFile.model_validate(raw)
        except ValidationError as err:
            from omni_runtime.registry.loader import format_validation_error

            raise SpecError(f"{path}: {format_validation_error(err)}") from err
        model = Path(spec.model).expanduser()
        if not model.is_absolute():
            model = (path.parent / model).resolve()
        spec.model = str(model)
    elif path.is_dir():
        spec = LocalPipelineFile(model=str(path.resolve()))
    else:
        raise SpecError(
            f"{target}: neither a model folder nor a pipeline file (.yaml); give the folder that holds "
            "config.json / model_index.json, or a YAML file with at least `model:`"
        )
    if pipeline:
        spec.pipeline = pipeline
    return spec
