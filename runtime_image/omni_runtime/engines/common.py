"""What every engine family reads from its stage the same way: the model folder, device, dtype, checked
engine args, and the release of a stopped engine's device memory.

One copy of each rule, below the families (`ar`, `diffusion`, `speech`, `generation`), so a stage finds
its folder, picks its device and names its dtype the same way whichever engine runs it.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from pathlib import Path
from typing import Any

from omni_runtime.engines.base import EngineError
from omni_runtime.spec import ResolvedPipeline, StageSpec

__all__ = [
    "checked_engine_args",
    "default_device",
    "named_dtype",
    "release_device_memory",
    "stage_device",
    "stage_dtype",
    "stage_model_path",
]


def stage_model_path(pipeline: ResolvedPipeline, stage: StageSpec) -> Path:
    """The folder the stage loads from: the model, or its `model_subfolder`."""
    path = Path(pipeline.model)
    return path / stage.model_subfolder if stage.model_subfolder else path


def checked_engine_args(stage: StageSpec, allowed: Set[str]) -> dict[str, Any]:
    """The stage's engine args; a key the runner does not read is refused, never silently ignored."""
    args = dict(stage.engine_args)
    unknown = sorted(set(args) - set(allowed))
    if unknown:
        raise EngineError(
            f"stage {stage.name!r}: engine_args {unknown} are not read by runner {args.get('runner')!r}; "
            f"it takes {sorted(allowed)}"
        )
    return args


def default_device(requested: object) -> str:
    """The device asked for (engine arg `device`), else cuda where there is one, else cpu."""
    import torch

    return str(requested or ("cuda" if torch.cuda.is_available() else "cpu"))


def stage_device(args: Mapping[str, Any]) -> str:
    """Engine arg `device`, else cuda where there is one, else cpu."""
    return default_device(args.get("device"))


def named_dtype(stage_name: str, name: str, allowed: str) -> Any:
    """The torch dtype called `name` (engine arg `torch_dtype`); a name torch lacks is refused with `allowed`
    (what to use instead)."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise EngineError(f"stage {stage_name!r}: torch_dtype {name!r} is not a torch dtype; {allowed}")
    return dtype


def stage_dtype(stage: StageSpec, args: Mapping[str, Any], default: str) -> Any:
    """Engine arg `torch_dtype` (or `default`) as a torch dtype; a name torch lacks is refused."""
    return named_dtype(stage.name, str(args.get("torch_dtype") or default), "use float32 or bfloat16")


def release_device_memory() -> None:
    """After an engine dropped its model: collect it now and hand CUDA's cached blocks back, so the next
    load (a retry in float32, a restart) finds the memory free."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
