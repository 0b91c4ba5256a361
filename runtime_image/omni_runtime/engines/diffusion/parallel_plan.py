"""How a diffusion stage splits its denoiser over ranks (engine arg `sequence_parallel`): the number of ranks
(`resolve_degree`) and diffusers' Ulysses context parallelism on each denoiser (`enable_context_parallel`).

`parallel` runs the ranks; see its docstring for why Ulysses, what `auto` means and what is refused.
"""

from __future__ import annotations

import logging
import types
from pathlib import Path
from typing import Any, Literal

from omni_runtime.engines.base import EngineError

__all__ = ["ARG", "enable_context_parallel", "resolve_degree"]

log = logging.getLogger(__name__)

ARG = "sequence_parallel"
"""Engine arg: `auto` or the number of ranks."""


def resolve_degree(stage: str, value: Literal["auto"] | int | None, device: str, model_path: str) -> int:
    """The number of ranks for `value` (`auto` or an integer of 1 or more, as `spec.engine_args` checked it) on
    `device`; raises EngineError when this pod cannot run them."""
    import torch

    if value is None or isinstance(value, str):  # unset, or auto (the one string spec.engine_args allows)
        if device != "cuda" or torch.cuda.device_count() < 2:
            return 1
        known = _cp_denoiser(model_path)
        if known is None or not known[1]:
            log.info(
                "stage %s: %d GPUs visible but the denoiser has no context-parallel plan: one GPU",
                stage,
                torch.cuda.device_count(),
            )
            return 1
        return torch.cuda.device_count()
    if value == 1:
        return 1
    if device not in ("cuda", "cpu"):
        raise EngineError(
            f"stage {stage!r}: {ARG}={value} runs one rank per GPU from cuda:0, and the stage's device is "
            f"{device!r}; set device to cuda (or leave it unset), or {ARG}: 1"
        )
    known = _cp_denoiser(model_path)
    if known is not None and not known[1]:  # before any process starts or anything loads
        raise EngineError(_no_plan(stage, known[0], value))
    if device == "cuda" and value > torch.cuda.device_count():
        raise EngineError(
            f"stage {stage!r}: {ARG}={value} needs {value} GPUs and this pod sees {torch.cuda.device_count()}; "
            f"lower {ARG} or raise the stage's accelerator.count"
        )
    return value


def _cp_denoiser(model_path: str) -> tuple[str, bool] | None:
    """The folder's denoiser class name and whether it has a diffusers context-parallel plan (from its
    model_index.json); None when the folder does not say (a pipeline built in code)."""
    import json

    import diffusers

    try:
        index = json.loads((Path(model_path) / "model_index.json").read_text())
    except (OSError, ValueError):
        return None
    entry = index.get("transformer") or index.get("unet")
    if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], str)):
        return None
    cls = getattr(diffusers, entry[1], None)
    return entry[1], getattr(cls, "_cp_plan", None) is not None


def _no_plan(stage: str, denoiser: str, world: int) -> str:
    return (
        f"stage {stage!r}: {denoiser} has no diffusers context-parallel plan, so it cannot be split over {world} "
        f"ranks; set engine arg {ARG}: 1 (Flux, Qwen-Image and Wan denoisers can be split)"
    )


def _denoisers(pipe: Any) -> list[Any]:
    """Every denoiser of the pipeline (Wan2.2 has two experts)."""
    found = [getattr(pipe, name, None) for name in ("transformer", "transformer_2", "unet")]
    return [m for m in found if m is not None]


def enable_context_parallel(stage: str, pipe: Any, world: int, device: str) -> None:
    """Ulysses context parallelism over `world` ranks on each denoiser of `pipe` (every rank calls this)."""
    from diffusers import ContextParallelConfig

    if not _denoisers(pipe):
        raise EngineError(
            f"stage {stage!r}: {type(pipe).__name__} has no transformer or unet to split over {world} ranks; "
            f"set engine arg {ARG}: 1"
        )
    for model in _denoisers(pipe):
        if getattr(model, "_cp_plan", None) is None:
            raise EngineError(_no_plan(stage, type(model).__name__, world))
        if device == "cpu":
            model._resolve_parallel_config = types.MethodType(_resolve_on_cpu, model)
        try:
            model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
        except (ValueError, RuntimeError) as err:
            raise EngineError(
                f"stage {stage!r}: context parallelism over {world} ranks failed on {type(model).__name__} "
                f"({err}); set engine arg {ARG}: 1 or a degree that divides its attention heads"
            ) from err


def _resolve_on_cpu(self: Any, config: Any) -> Any:
    """diffusers' `_resolve_parallel_config` for CPU ranks: it takes the device from the accelerator count,
    which is 0 on a CPU; here the device is the CPU and the mesh is gloo's."""
    import torch
    import torch.distributed as dist
    from diffusers import ContextParallelConfig
    from diffusers.models._modeling_parallel import ParallelConfig

    if isinstance(config, ContextParallelConfig):
        config = ParallelConfig(context_parallel_config=config)
    cp = config.context_parallel_config
    mesh = dist.device_mesh.init_device_mesh("cpu", mesh_shape=cp.mesh_shape, mesh_dim_names=cp.mesh_dim_names)
    config.setup(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), mesh=mesh)
    self._parallel_config = config
    return config
