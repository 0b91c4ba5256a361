"""What every engine family reads from its stage the same way: the model folder, device, dtype, its typed
engine args (`spec.engine_args`, the one description of every key), and the release of a stopped engine's
device memory.

One copy of each rule, below the families (`ar`, `diffusion`, `speech`, `generation`), so a stage finds
its folder, picks its device and names its dtype the same way whichever engine runs it.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from omni_runtime.engines.base import EngineError
from omni_runtime.spec import ResolvedPipeline, StageSpec
from omni_runtime.spec.engine_args import EngineArgs, InvalidEngineArgs, engine_args_for

ArgsT = TypeVar("ArgsT", bound=EngineArgs)
P = ParamSpec("P")
R = TypeVar("R")

__all__ = [
    "default_device",
    "named_dtype",
    "one_build_at_a_time",
    "release_device_memory",
    "stage_dtype",
    "stage_model_path",
    "typed_engine_args",
]


def stage_model_path(pipeline: ResolvedPipeline, stage: StageSpec) -> Path:
    """The folder the stage loads from: the model, or its `model_subfolder`."""
    path = Path(pipeline.model)
    return path / stage.model_subfolder if stage.model_subfolder else path


def typed_engine_args(stage: StageSpec, model: type[ArgsT]) -> ArgsT:
    """The stage's engine args as `model`, the one its engine reads (`spec.engine_args.engine_args_for`).

    Raises InvalidEngineArgs (a SpecError) naming the stage and the key at fault, or when the stage's kind and
    runner choose another engine's model than `model` (an engine built for a stage it does not run)."""
    args = engine_args_for(stage)
    if not isinstance(args, model):
        raise InvalidEngineArgs(
            f"stage {stage.name!r} (kind {stage.kind.value!r}, runner {stage.engine_args.get('runner')!r}) takes "
            f"{type(args).__name__}, not the {model.__name__} of this engine; run it with the engine "
            "`engines.factory.make_engine` picks",
            stage=stage.name,
            field="runner",
        )
    return args


def default_device(requested: object) -> str:
    """The device asked for (engine arg `device`), else cuda where there is one, else cpu."""
    import torch

    return str(requested or ("cuda" if torch.cuda.is_available() else "cpu"))


def named_dtype(stage_name: str, name: str, allowed: str) -> Any:
    """The torch dtype called `name` (engine arg `torch_dtype`); a name torch lacks is refused with `allowed`
    (what to use instead)."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise EngineError(f"stage {stage_name!r}: torch_dtype {name!r} is not a torch dtype; {allowed}")
    return dtype


def stage_dtype(stage_name: str, torch_dtype: str | None, default: str) -> Any:
    """Engine arg `torch_dtype` (or `default` when unset) as a torch dtype; a name torch lacks is refused."""
    return named_dtype(stage_name, torch_dtype or default, "use float32 or bfloat16")


def release_device_memory() -> None:
    """After an engine dropped its model: collect it now and hand CUDA's cached blocks back, so the next
    load (a retry in float32, a restart) finds the memory free."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# Why one lock for the whole process: diffusers' and transformers' loaders build modules under accelerate's
# `init_empty_weights`, which patches `nn.Module.register_parameter` for every thread while it is active. A
# model another thread builds at that moment gets its parameters on the meta device, and fails later with
# "Cannot copy out of meta tensor". `omnikube serve` (and the served tests) start every stage of a pipeline
# in one process, so two stages load at once there; one pod per stage never contends.
_BUILDING = threading.Lock()


def one_build_at_a_time(build: Callable[P, R]) -> Callable[P, R]:
    """`build` (a function that constructs modules or loads weights, run in a worker thread) holding the
    process-wide build lock: two engines of one process never build models at the same moment."""

    @functools.wraps(build)
    def locked(*args: P.args, **kwargs: P.kwargs) -> R:
        with _BUILDING:
            return build(*args, **kwargs)

    return locked
