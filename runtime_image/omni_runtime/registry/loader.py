"""Reading pipeline topologies from YAML files: the built-in folder and any extra folders.

Each file holds one PipelineSpec plus an optional top-level `aliases` list, which is registry metadata
(other names users may type, e.g. `qwen2.5-omni`) and is removed before the spec is validated. A file is
named after its pipeline: `qwen3-omni.yaml` holds `name: qwen3-omni`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from omni_runtime.registry.errors import RegistryError
from omni_runtime.spec import PipelineSpec

__all__ = [
    "ALIAS_PATTERN",
    "RegisteredPipeline",
    "builtin_pipelines_dir",
    "format_validation_error",
    "load_pipeline_file",
    "load_pipeline_folders",
]

ALIAS_PATTERN = r"^[a-z0-9]([-.a-z0-9]*[a-z0-9])?$"
"""An alias is never part of an object name, so unlike pipeline names it may contain dots."""

_PACKAGE = Path(__file__).resolve().parent.parent
_CANDIDATES = (
    _PACKAGE / "_pipelines",  # installed wheel: pyproject force-includes config/pipelines here
    _PACKAGE.parent.parent / "config" / "pipelines",  # source checkout: <repo>/config/pipelines
)


@dataclass(frozen=True)
class RegisteredPipeline:
    """A validated topology, the file it came from, and the other names it answers to."""

    spec: PipelineSpec
    source: Path
    aliases: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.spec.name


def builtin_pipelines_dir() -> Path:
    """The folder of built-in topologies: inside the installed package, else the source checkout's."""
    for folder in _CANDIDATES:
        if folder.is_dir():
            return folder
    raise RegistryError(
        "the built-in pipeline folder is missing; looked in "
        + ", ".join(str(c) for c in _CANDIDATES)
        + "; reinstall omnikube, or run from a source checkout that has config/pipelines"
    )


def load_pipeline_file(path: str | Path) -> RegisteredPipeline:
    """Read and validate one pipeline file; errors name the file and the field."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise RegistryError(f"{path}: cannot be read ({err.strerror or err})") from err
    except yaml.YAMLError as err:
        raise RegistryError(f"{path}: not valid YAML: {_one_line(err)}") from err
    if not isinstance(data, dict):
        raise RegistryError(
            f"{path}: expected a mapping of PipelineSpec fields (name, stages, edges, ...), found {type(data).__name__}"
        )
    aliases = _aliases(path, data.pop("aliases", []))
    try:
        spec = PipelineSpec.model_validate(data)
    except ValidationError as err:
        raise RegistryError(f"{path}: {format_validation_error(err)}") from err
    if spec.name != path.stem:
        raise RegistryError(
            f"{path}: name: {spec.name!r} differs from the file name; "
            f"rename the file to {spec.name}{path.suffix} or set name: {path.stem}"
        )
    return RegisteredPipeline(spec=spec, source=path, aliases=aliases)


def load_pipeline_folders(folders: Iterable[str | Path]) -> list[RegisteredPipeline]:
    """Every `*.yaml` / `*.yml` file of the folders, in order.

    A pipeline in a later folder replaces one of the same name from an earlier folder (that is how a
    deployment ships its own version of a built-in); two files of one folder may not share a name."""
    by_name: dict[str, RegisteredPipeline] = {}
    for folder in folders:
        folder = Path(folder)
        if not folder.is_dir():
            raise RegistryError(f"pipeline folder {folder} does not exist or is not a folder")
        in_folder: dict[str, Path] = {}
        files = sorted([*folder.glob("*.yaml"), *folder.glob("*.yml")])
        for path in files:
            entry = load_pipeline_file(path)
            if entry.name in in_folder:
                raise RegistryError(
                    f"{path}: pipeline {entry.name!r} is also defined in {in_folder[entry.name]}; keep one"
                )
            in_folder[entry.name] = path
            by_name[entry.name] = entry
    return list(by_name.values())


def format_validation_error(err: ValidationError) -> str:
    """Pydantic errors as `field.path: message (got value)`, joined by `; `."""
    parts = []
    for item in err.errors():
        loc = _loc(item["loc"])
        msg = item["msg"].removeprefix("Value error, ")
        if item["type"] not in ("value_error", "missing") and not isinstance(item.get("input"), dict):
            msg += f" (got {item.get('input')!r})"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _aliases(path: Path, raw: Any) -> tuple[str, ...]:
    if not isinstance(raw, list):
        raise RegistryError(f"{path}: aliases: expected a list of names, found {type(raw).__name__}")
    for i, alias in enumerate(raw):
        if not isinstance(alias, str) or not re.match(ALIAS_PATTERN, alias):
            raise RegistryError(
                f"{path}: aliases[{i}]: {alias!r} is not a valid alias; use lower-case letters, digits, "
                "'-' and '.', starting and ending with a letter or digit"
            )
    return tuple(raw)


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())
