"""Speed options of the `diffusion` engine: regional compilation, FP8 matmuls, step caching, attention backend.

Engine args (`spec.engine_args.AccelSettings`, which checks them; never passed to diffusers' `from_pretrained`):

- `enforce_eager` (default false): true never runs `torch.compile`. On a GPU the denoiser's repeated
  transformer blocks are compiled (regional compilation, dynamic shapes) during start-up, before the stage
  is ready, by two short warm-up calls; on a CPU nothing is compiled.
- `quantization` (default unset): `fp8` runs the Linear layers of the repeated blocks as FP8 (e4m3) matmuls
  with per-row scales (`torch._scaled_mm`); needs an NVIDIA GPU of compute capability 8.9 or newer.
- `step_cache_threshold` (default 0, off): > 0 turns on First Block Cache (diffusers' `FirstBlockCacheConfig`):
  a step whose first block's residual changed by less than this relative amount reuses the previous step's
  output of the other blocks (0.05-0.12 is typical; higher is faster and less exact). A request turns it off
  with the parameter `step_cache: false`.
- `step_cache` (default unset, off): a schedule-based step cache, `{policy: taylorseer, interval: 3, warmup: 4,
  order: 1}`: diffusers' TaylorSeer cache (`TaylorSeerCacheConfig`, lite variant): the first `warmup` steps run
  in full, then one step in every `interval` runs in full and the others skip every transformer block and
  extrapolate the denoiser's output (`proj_out`) from the full steps by a Taylor series of `order`. Which steps
  are skipped depends on the schedule only, not on the model's activations (unlike the threshold cache). Not
  together with `step_cache_threshold`; a request turns it off with `step_cache: false` too.
- `attention_backend` (default `auto`): `auto` picks FlashAttention-3 when its package is installed, else
  cuDNN attention on NVIDIA GPUs of compute capability 9.0+, else PyTorch SDPA (`native`); or one of
  diffusers' backend names (`native`, `_native_cudnn`, `_flash_3`, `flash`, ...).

- `cuda_graphs` (default false): true replays the compiled denoiser's whole forward (one denoising step) as a
  CUDA graph, captured the second time an input signature (batch, resolution, dtypes) is seen; at most 4 graphs
  are kept (least recently used go), each holding one step's activations in its own memory pool. It removes the
  CPU's launch work: a compiled FP8 Flux step costs ~42 ms of CPU on the H200 machine. Where the GPU's work per
  step is smaller than that, it pays: a FLUX-sized 256x256 FP8 image took 0.570 s with it against 1.201 s without
  (bench/results-h200-diffusion-speed.txt, run 11). At 1024x1024 the GPU's ~100 ms per step hides the CPU: 3.11 s
  against 3.15 s (run 8), too little to hold a memory pool per shape by default. Refused
  where it cannot apply: on a CPU, with `enforce_eager`, a step cache or sequence parallelism.

On a GPU (unless `enforce_eager`), and wherever `quantization: fp8` is set, a Flux denoiser's q/k/v projections
are fused into one matmul per attention (diffusers' `fuse_projections`): with FP8 that is one activation
quantization and one FP8 matmul instead of three. With `quantization: fp8` on a Flux denoiser, each single block's
`proj_out(cat(attention, GELU(mlp)))` runs as two FP8 matmuls, `attention @ Wa^T + GELU(mlp) @ Wm^T + b` (its weight
split once at load, each part with its own scales), so the concatenation is never built and each input is quantized
on its own contiguous rows; and GELU's tanh approximation runs as `x * sigmoid(2z)` (the same function, one exp
instead of a tanh, computed twice by the kernel that takes the rows' amax and casts to FP8).

Each choice is logged at start. The CPU path is unchanged unless a stage asks for the step cache.

This module reads the options and applies them in order (`Accel.apply`); the pieces live beside it: `fp8`
(the FP8 Linear), `flux` (the Flux rewrites), `step_cache` (both step caches), `graphs` (CUDA-graph replay).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from omni_runtime.engines.base import EngineError
from omni_runtime.engines.diffusion import flux
from omni_runtime.engines.diffusion.fp8 import to_fp8
from omni_runtime.engines.diffusion.graphs import GraphedForward
from omni_runtime.engines.diffusion.step_cache import StepCache
from omni_runtime.spec.engine_args import AccelSettings

__all__ = ["Accel"]

log = logging.getLogger(__name__)


def _repeated_blocks(model: Any) -> list[Any]:
    """The denoiser's repeated transformer blocks: the classes it names in `_repeated_blocks` (diffusers'
    regional-compilation list), else the members of its top-level ModuleLists (e.g. SD3's `transformer_blocks`)."""
    import torch

    names = set(getattr(model, "_repeated_blocks", None) or ())
    if names:
        return [m for m in model.modules() if type(m).__name__ in names]
    blocks: list[Any] = []
    for child in model.children():
        if isinstance(child, torch.nn.ModuleList):
            blocks.extend(child)
    return blocks


def _denoiser(pipe: Any) -> Any:
    return getattr(pipe, "transformer", None) or getattr(pipe, "unet", None)


class Accel:
    """Applies one stage's speed options to its loaded pipeline and steps a call's step-cache switch."""

    def __init__(self, stage: str, settings: AccelSettings) -> None:
        self.stage = stage
        self.settings = settings
        """The stage's speed options (its engine args, checked by `spec.engine_args`)."""
        self.compiled = False
        self.attention_backend = "default"
        self.compile_seconds = 0.0
        self.fp8_layers = 0
        self.cache = StepCache(stage, self.settings.step_cache_threshold, self.settings.step_cache)
        """The step cache (threshold or schedule), on the denoiser once applied."""
        self.fused_attentions = 0
        """Attentions whose q/k/v projections run as one matmul."""
        self.split_proj_out = 0
        """Flux single blocks whose proj_out runs as two matmuls (attention part, MLP part) with no cat."""
        self.fast_gelu = 0
        """Flux feed-forwards whose GELU (tanh) runs in its sigmoid form."""
        self.graphed: list[GraphedForward] = []
        """The denoisers' forwards that replay CUDA graphs."""

    @property
    def step_cache(self) -> bool:
        """Whether the stage has a step cache (threshold or schedule)."""
        return self.cache.enabled

    def check_device(self, device: str) -> None:
        """Refuse, before loading anything, options this device cannot run."""
        import torch

        if self.settings.quantization == "fp8":
            ok = device.startswith("cuda") and torch.cuda.is_available()
            capability = torch.cuda.get_device_capability(device) if ok else (0, 0)
            if capability < (8, 9):
                where = f"{device} (compute capability {capability[0]}.{capability[1]})" if ok else device
                raise EngineError(
                    f"stage {self.stage!r}: quantization fp8 needs an NVIDIA GPU of compute capability 8.9 or "
                    f"newer (Ada, Hopper, Blackwell); this stage runs on {where}. Remove quantization from "
                    "engineArgs, or give the stage accelerator type nvidia.com/gpu on such GPUs"
                )
        if self.settings.cuda_graphs and not (device.startswith("cuda") and torch.cuda.is_available()):
            raise EngineError(
                f"stage {self.stage!r}: engine arg cuda_graphs=true needs an NVIDIA GPU; this stage runs on {device}. "
                "Remove cuda_graphs from engineArgs"
            )

    def apply(self, pipe: Any, device: str, parallel: Callable[[Any], None] | None = None) -> None:
        """Attention backend, FP8, `parallel(pipe)` (context parallelism, see `parallel_plan`), compilation
        and the step cache, in that order (in the loading thread). FP8 comes first so that no parallel hook sits
        on a replaced layer; compilation after, so the compiled blocks include the parallel all-to-alls.

        Compilation wraps each block's own `forward` before the step cache's hooks wrap it, so the
        cache's per-step decision stays in Python and the compiled blocks never see it. A second denoiser
        (`transformer_2`, Wan2.2's low-noise expert) gets the same attention backend, FP8 and compilation;
        the step cache stays on the first.
        """
        model = _denoiser(pipe)
        if model is None:
            if self.settings.quantization or self.step_cache or self.settings.cuda_graphs:
                raise EngineError(
                    f"stage {self.stage!r}: {type(pipe).__name__} has no transformer or unet, so quantization, "
                    "step_cache_threshold, step_cache and cuda_graphs cannot apply; remove them from engineArgs"
                )
            if parallel is not None:
                parallel(pipe)  # refuses: nothing to split
            return
        self._attention(model, device)
        blocks = _repeated_blocks(model)
        second = getattr(pipe, "transformer_2", None)  # Wan2.2's low-noise expert: the same options as the first
        if second is not None and second is not model:
            self._attention(second, device)
            blocks += _repeated_blocks(second)
        gpu_compiled = device.startswith("cuda") and not self.settings.enforce_eager
        if (gpu_compiled or self.settings.quantization == "fp8") and type(model).__name__ in flux.FUSE_QKV:
            fused = flux.fuse_qkv(model) + (flux.fuse_qkv(second) if second is not None and second is not model else 0)
            self.fused_attentions = fused
            log.info("stage %s: fused the q/k/v projections of %d attentions", self.stage, fused)
        if self.settings.quantization == "fp8":
            if type(model).__name__ in flux.FUSE_QKV:  # Flux: the single blocks' proj_out without its input's cat
                self.split_proj_out = flux.split_single_proj_out(blocks)
                self.fast_gelu = flux.fast_gelu(blocks)
                log.info(
                    "stage %s: %d single blocks' proj_out split in two (no cat), GELU (tanh) as x*sigmoid in %d "
                    "feed-forwards", self.stage, self.split_proj_out, self.fast_gelu,
                )  # fmt: skip
            self.fp8_layers = to_fp8(blocks)
            log.info(
                "stage %s: fp8 matmuls (torch._scaled_mm, per-row scales) in %d layers", self.stage, self.fp8_layers
            )
        if parallel is not None:
            parallel(pipe)
        if device.startswith("cuda") and not self.settings.enforce_eager and blocks:
            import torch

            # Every block class compiles once; dynamic shapes keep resolution and batch changes from recompiling.
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            for block in blocks:
                block.forward = torch.compile(block.forward, dynamic=True)
            self.compiled = True
        if self.settings.cuda_graphs:
            if parallel is not None or not self.compiled:
                why = "sequence parallelism (the ranks' collectives)" if parallel else "an uncompiled denoiser"
                raise EngineError(
                    f"stage {self.stage!r}: engine arg cuda_graphs=true cannot apply with {why}; remove cuda_graphs "
                    "from engineArgs"
                )
            for denoiser in {id(m): m for m in (model, second) if m is not None}.values():
                graphed = GraphedForward(self.stage, denoiser.forward)
                denoiser.forward = graphed
                self.graphed.append(graphed)
            log.info("stage %s: the denoiser's step replays CUDA graphs (one per input shape)", self.stage)
        self.cache.apply(model)

    @property
    def graph_replays(self) -> int:
        """Denoiser steps that ran as a CUDA graph replay."""
        return sum(g.replays for g in self.graphed)

    def stats(self) -> dict[str, float]:
        """For the engine's stats: `step_cache_checks_total`, `step_cache_hits_total` (steps served by the cache),
        `cuda_graph_replays_total` (denoiser steps replayed from a CUDA graph)."""
        out = {}
        if self.graphed:
            out["cuda_graph_replays_total"] = float(self.graph_replays)
        out.update(self.cache.stats())
        return out

    def _attention(self, model: Any, device: str) -> None:
        name = self.settings.attention_backend
        if name == "auto":
            if not device.startswith("cuda"):
                return  # diffusers' default (SDPA) on CPU: the CPU path stays as it was
            name = _auto_backend(device)
        if not hasattr(model, "set_attention_backend"):
            if self.settings.attention_backend != "auto":
                raise EngineError(
                    f"stage {self.stage!r}: {type(model).__name__} cannot choose its attention backend; "
                    "remove attention_backend from engineArgs"
                )
            return
        try:
            model.set_attention_backend(name)
        except (ValueError, RuntimeError, ImportError) as err:
            raise EngineError(
                f"stage {self.stage!r}: attention_backend {name!r} cannot run here ({err}); use auto, native or "
                "another diffusers backend whose package is installed"
            ) from err
        self.attention_backend = name
        log.info("stage %s: attention backend %s on %s", self.stage, name, device)

    def warmup(self, call: Callable[[int], None]) -> None:
        """Compile before the stage is ready: `call(batch)` runs a short pipeline call; batch 1 and 2
        (PyTorch specializes sizes 0 and 1, so a batch of 1 compiles its own graph)."""
        if not self.compiled:
            return
        started = time.monotonic()
        for batch in (1, 2):
            with self.call(step_cache=True):  # as a request's call: the step cache's hooks need their context
                call(batch)
        self.compile_seconds = time.monotonic() - started
        log.info("stage %s: compiled the denoiser's blocks in %.1fs (warm-up calls)", self.stage, self.compile_seconds)

    @contextlib.contextmanager
    def call(self, step_cache: bool) -> Iterator[None]:
        """Around one pipeline call: a fresh step-cache state, and the cache off for this call when its requests
        asked for that (`StepCache.call`)."""
        with self.cache.call(step_cache):
            yield


def _auto_backend(device: str) -> str:
    """FlashAttention-3 when installed (Hopper), cuDNN attention on compute capability 9.0+, else SDPA."""
    import torch

    major, _minor = torch.cuda.get_device_capability(device)
    if major == 9 and importlib.util.find_spec("flash_attn_interface") is not None:
        return "_flash_3"
    if major >= 9 and torch.backends.cudnn.is_available():
        return "_native_cudnn"
    return "native"
