"""What a local model folder says about itself, and where a model reference lives in the model cache.

Only local files are read: never the network, never `huggingface_hub` or `transformers` (the operator
calls this at reconcile time, where downloads must not happen).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_runtime.registry.errors import ModelFilesNotFound, RegistryError

__all__ = ["CONFIG_FILE", "DIFFUSERS_INDEX_FILE", "ModelSignature", "local_model_dir", "read_model_signature"]

CONFIG_FILE = "config.json"
"""transformers / vLLM models: its `architectures` list names the model class."""
DIFFUSERS_INDEX_FILE = "model_index.json"
"""diffusers pipelines: its `_class_name` names the pipeline class."""

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ModelSignature:
    """The class names a model folder declares, which select its pipeline."""

    path: Path
    architectures: tuple[str, ...] = ()
    diffusers_class: str | None = None

    def describe(self) -> str:
        """What was found, for error messages."""
        found = []
        if (self.path / CONFIG_FILE).is_file():
            found.append(f"{CONFIG_FILE} architectures {list(self.architectures)}")
        if (self.path / DIFFUSERS_INDEX_FILE).is_file():
            found.append(f"{DIFFUSERS_INDEX_FILE} _class_name {self.diffusers_class!r}")
        return " and ".join(found)


def read_model_signature(model_dir: str | Path) -> ModelSignature:
    """Read `config.json` `architectures` and `model_index.json` `_class_name` from a local folder.

    Raises ModelFilesNotFound when the folder or both files are missing, RegistryError when a file is
    not valid JSON or a field has the wrong type."""
    path = Path(model_dir)
    looked_for = f"{path / CONFIG_FILE} (transformers) or {path / DIFFUSERS_INDEX_FILE} (diffusers)"
    if not path.is_dir():
        raise ModelFilesNotFound(
            f"model folder {path} does not exist; looked for {looked_for}. Put the model in the model "
            "cache (a Hugging Face id is looked up there), or name the pipeline explicitly"
        )
    config = _read_json(path / CONFIG_FILE)
    index = _read_json(path / DIFFUSERS_INDEX_FILE)
    if config is None and index is None:
        raise ModelFilesNotFound(
            f"model folder {path} has neither file; looked for {looked_for}. Point `model` at the folder "
            "that holds them (a diffusers model's root, not a component), or name the pipeline explicitly"
        )
    architectures: tuple[str, ...] = ()
    if config is not None:
        raw = config.get("architectures") or []
        if not isinstance(raw, list) or not all(isinstance(a, str) for a in raw):
            raise RegistryError(f"{path / CONFIG_FILE}: architectures: expected a list of class names, found {raw!r}")
        architectures = tuple(raw)
    diffusers_class = None
    if index is not None:
        raw = index.get("_class_name")
        if raw is not None and not isinstance(raw, str):
            raise RegistryError(f"{path / DIFFUSERS_INDEX_FILE}: _class_name: expected a class name, found {raw!r}")
        diffusers_class = raw
    return ModelSignature(path=path, architectures=architectures, diffusers_class=diffusers_class)


def local_model_dir(model: str | Path, cache_dir: str | Path | None = None, revision: str | None = None) -> Path:
    """The local folder of a model reference, looked up in the model cache mounted at `cache_dir`.

    - An absolute path, or one starting with `.` or `~`, is that path.
    - A Hugging Face id `Org/Name` is the hub cache snapshot `<cache>/models--Org--Name/snapshots/<rev>/`
      (also under `<cache>/hub/`, the layout of HF_HOME) when present: `<rev>` is what `refs/<revision>`
      (default `main`) points to, or `revision` itself as a commit, or else the newest snapshot.
    - Otherwise `<cache>/<model>` (e.g. `<cache>/Org/Name`) when that folder exists.
    - Otherwise the reference itself as a path; resolving it then fails with a message naming it.
    Nothing is downloaded."""
    text = str(model)
    path = Path(text).expanduser()
    if cache_dir is None or path.is_absolute() or text.startswith((".", "~")):
        return path
    cache = Path(cache_dir)
    if _HUB_ID.match(text):
        org, name = text.split("/")
        for hub in (cache, cache / "hub"):
            snapshot = _hub_snapshot(hub / f"models--{org}--{name}", revision)
            if snapshot is not None:
                return snapshot
    if (cache / text).is_dir():
        return cache / text
    return path


def _hub_snapshot(repo: Path, revision: str | None) -> Path | None:
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / (revision or "main")
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
        if (snapshots / commit).is_dir():
            return snapshots / commit
    if revision is not None:
        return snapshots / revision if (snapshots / revision).is_dir() else None
    candidates = [d for d in snapshots.iterdir() if d.is_dir()]
    return max(candidates, key=lambda d: d.stat().st_mtime) if candidates else None


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RegistryError(f"{path}: not valid JSON ({err}); replace the file with the model's own") from err
    if not isinstance(data, dict):
        raise RegistryError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data
