"""The pipeline registry: built-in topologies (config/pipelines/*.yaml) and model -> pipeline selection.

    get_pipeline("qwen3-omni")                      # by name or alias
    resolve_model_pipeline("/models/Qwen3-Omni")    # from the model's config.json / model_index.json
    local_model_dir("Qwen/Qwen-Image", "/models")   # model reference -> folder in the model cache

Pure: no torch, no engines, no network.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

from omni_runtime.registry.catalog import PipelineRegistry
from omni_runtime.registry.errors import ModelFilesNotFound, RegistryError
from omni_runtime.registry.loader import (
    RegisteredPipeline,
    builtin_pipelines_dir,
    load_pipeline_file,
    load_pipeline_folders,
)
from omni_runtime.registry.model_files import ModelSignature, local_model_dir, read_model_signature
from omni_runtime.spec import PipelineSpec

__all__ = [
    "ModelFilesNotFound",
    "ModelSignature",
    "PipelineRegistry",
    "RegisteredPipeline",
    "RegistryError",
    "builtin_pipelines_dir",
    "default_registry",
    "get_pipeline",
    "load_pipeline_file",
    "load_registry",
    "local_model_dir",
    "read_model_signature",
    "resolve_model_pipeline",
]


def load_registry(extra_dirs: Iterable[str | Path] = (), *, builtin: bool = True) -> PipelineRegistry:
    """Read the built-in pipelines (unless `builtin=False`) and those of `extra_dirs`, fresh from disk.

    A pipeline in an extra folder replaces a built-in of the same name."""
    folders = [builtin_pipelines_dir()] if builtin else []
    return PipelineRegistry(load_pipeline_folders([*folders, *extra_dirs]))


@lru_cache(maxsize=1)
def default_registry() -> PipelineRegistry:
    """The built-in pipelines, read once per process."""
    return load_registry()


def get_pipeline(name: str, extra_dirs: Iterable[str | Path] = ()) -> PipelineSpec:
    """The topology called `name` (or with that alias); RegistryError lists the known names."""
    extra = list(extra_dirs)
    registry = load_registry(extra) if extra else default_registry()
    return registry.get(name)


def resolve_model_pipeline(model_path: str | Path, extra_dirs: Iterable[str | Path] = ()) -> PipelineSpec:
    """The topology a local model folder selects, from its `config.json` `architectures` or
    `model_index.json` `_class_name`. Reads local files only.

    Raises ModelFilesNotFound (folder or files missing; may heal once the cache is filled) or
    RegistryError (no pipeline, or several, match: the message lists what was found and what each
    pipeline matches). Use `local_model_dir` first to turn a Hugging Face id into a cache folder."""
    extra = list(extra_dirs)
    registry = load_registry(extra) if extra else default_registry()
    return registry.match(read_model_signature(model_path))
