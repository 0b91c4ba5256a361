"""What the speech engines read from their stage: the model folder, checked engine args, device and dtype.

One place for the rules every speech engine shares, so a stage refuses keys it would not read the same
way whichever runner it names.
"""

from __future__ import annotations

from collections.abc import Set
from pathlib import Path
from typing import Any

from omni_runtime.engines.base import EngineError
from omni_runtime.spec import ResolvedPipeline, StageSpec

__all__ = ["checked_engine_args", "stage_device", "stage_dtype", "stage_model_path"]


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


def stage_device(args: dict[str, Any]) -> str:
    """Engine arg `device`, else cuda where there is one, else cpu."""
    import torch

    return str(args.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))


def stage_dtype(stage: StageSpec, args: dict[str, Any], default: str) -> Any:
    """Engine arg `torch_dtype` (or `default`) as a torch dtype; a name torch lacks is refused."""
    import torch

    name = str(args.get("torch_dtype") or default)
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise EngineError(f"stage {stage.name!r}: torch_dtype {name!r} is not a torch dtype; use float32 or bfloat16")
    return dtype
