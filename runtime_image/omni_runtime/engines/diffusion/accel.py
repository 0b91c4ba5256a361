"""Speed options of the `diffusion` engine: regional compilation, FP8 matmuls, step caching, attention backend.

Engine args (read from the stage's `engineArgs`, never passed to diffusers' `from_pretrained`):

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
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib.util
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omni_runtime.engines.base import EngineError, InvalidRequest

__all__ = ["ACCEL_ENGINE_ARGS", "REQUEST_PARAM", "Accel", "AccelSettings", "Fp8Linear"]

log = logging.getLogger(__name__)

REQUEST_PARAM = "step_cache"
"""Request parameter (bool) that turns the stage's step cache off for that request."""


class StepCacheSettings(BaseModel):
    """A schedule-based step cache (engine arg `step_cache`): which steps skip the transformer blocks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: Literal["taylorseer"] = Field(
        description="taylorseer: diffusers' TaylorSeer cache (skipped steps extrapolate the denoiser's output)."
    )
    interval: int = Field(3, ge=2, le=50, description="After the warm-up, one step in `interval` runs in full.")
    warmup: int = Field(4, ge=1, le=1000, description="The first steps, all run in full (Taylor factors).")
    order: int = Field(1, ge=0, le=3, description="Taylor order of the extrapolation (0: reuse the last output).")


class AccelSettings(BaseModel):
    """The speed options of one diffusion stage (engine args; see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enforce_eager: bool = Field(False, description="Never compile the denoiser (GPU only; a CPU never compiles).")
    quantization: Literal["fp8"] | None = Field(
        None, description="fp8: FP8 (e4m3, per-row scaled) matmuls in the repeated blocks; Ada/Hopper GPUs only."
    )
    step_cache_threshold: float = Field(
        0.0, ge=0.0, le=1.0, description="First Block Cache threshold; 0 turns step caching off."
    )
    step_cache: StepCacheSettings | None = Field(
        None, description="A schedule-based step cache, e.g. {policy: taylorseer, interval: 3, warmup: 4}; unset: off."
    )
    cuda_graphs: bool = Field(
        False, description="Replay the compiled denoiser step as CUDA graphs (GPU; one graph per input shape)."
    )
    attention_backend: str = Field("auto", min_length=1, description="auto, or a diffusers attention backend name.")


ACCEL_ENGINE_ARGS: frozenset[str] = frozenset(AccelSettings.model_fields)
"""Engine args this module reads (the engine keeps them out of `from_pretrained`'s keyword arguments)."""


def _settings(stage: str, engine_args: dict[str, Any]) -> AccelSettings:
    given = {k: v for k, v in engine_args.items() if k in ACCEL_ENGINE_ARGS}
    try:
        settings = AccelSettings.model_validate(given)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise EngineError(
            f"stage {stage!r}: engine arg {field}={first.get('input')!r} is not allowed ({first['msg']}); "
            "see enforce_eager (bool), quantization (fp8 or unset), step_cache_threshold (0 to 1), "
            "step_cache ({policy: taylorseer, interval: 2-50, warmup: 1-1000, order: 0-3} or unset), "
            "cuda_graphs (bool), attention_backend (auto or a diffusers backend name)"
        ) from None
    if settings.cuda_graphs and (settings.enforce_eager or settings.step_cache or settings.step_cache_threshold):
        why = "enforce_eager" if settings.enforce_eager else "a step cache (its per-step decision runs in Python)"
        raise EngineError(
            f"stage {stage!r}: engine arg cuda_graphs=true cannot apply with {why}; remove one of them from engineArgs"
        )
    if settings.step_cache is not None and settings.step_cache_threshold > 0:
        raise EngineError(
            f"stage {stage!r}: engine args step_cache ({settings.step_cache.policy}) and step_cache_threshold "
            f"({settings.step_cache_threshold}) are two step caches; keep one of them in engineArgs"
        )
    return settings


class Fp8Linear:
    """Builds FP8 replacements for `torch.nn.Linear`: weights quantized once per output row, activations per
    token at each call, one `torch._scaled_mm` (Hopper's FP8 tensor cores) with bf16 output."""

    FP8_MAX = 448.0  # largest finite float8_e4m3fn

    @staticmethod
    def convertible(linear: Any) -> bool:
        """`_scaled_mm` needs both matrix dimensions to be multiples of 16."""
        return linear.in_features % 16 == 0 and linear.out_features % 16 == 0

    @staticmethod
    def build(linear: Any) -> Any:
        """The FP8 module replacing `linear` (its weights are quantized here, once)."""
        return _fp8_module_class()(linear)


@functools.cache
def _fp8_module_class() -> Any:
    """One class for every FP8 layer, made once: torch.compile guards on a module's class, so a class per
    layer would compile each block anew (torch is imported only when a stage asks for fp8)."""
    import torch

    fp8_max = Fp8Linear.FP8_MAX

    class Fp8LinearModule(torch.nn.Module):
        def __init__(self, src: torch.nn.Linear) -> None:
            super().__init__()
            w = src.weight.detach()
            scale = w.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / fp8_max
            # (out, in) row-major, so .t() below is the column-major operand _scaled_mm wants.
            self.register_buffer("weight_fp8", (w.float() / scale).to(torch.float8_e4m3fn))
            self.register_buffer("weight_scale", scale.reshape(1, -1).contiguous())
            self.bias = None if src.bias is None else torch.nn.Parameter(src.bias.detach(), requires_grad=False)
            self.in_features, self.out_features = src.in_features, src.out_features

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            flat = x.reshape(-1, x.shape[-1])
            x_scale = flat.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / fp8_max
            xq = (flat.float() / x_scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
            # use_fast_accum: Hopper's FP8 MMA accumulates without the periodic FP32 promotion (faster; the
            # error stays within the bench's latents bound, as torchao does for forward matmuls).
            out = torch._scaled_mm(
                xq,
                self.weight_fp8.t(),
                scale_a=x_scale,
                scale_b=self.weight_scale,
                out_dtype=x.dtype,
                use_fast_accum=xq.is_cuda,
            )
            if self.bias is not None:
                out = out + self.bias
            return out.reshape(*x.shape[:-1], self.out_features)

    return Fp8LinearModule


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

    def __init__(self, stage: str, engine_args: dict[str, Any]) -> None:
        self.stage = stage
        self.settings = _settings(stage, engine_args)
        self.compiled = False
        self.attention_backend = "default"
        self.compile_seconds = 0.0
        self.fp8_layers = 0
        self._cache_hooks: list[Any] = []
        """First Block Cache: the hooks that decide whether the other blocks run."""
        self._taylor_hooks: list[Any] = []
        """TaylorSeer: every hook (blocks and proj_out); each counts the steps itself."""
        self.fused_attentions = 0
        self.split_proj_out = 0
        """Flux single blocks whose proj_out runs as two matmuls (attention part, MLP part) with no cat."""
        self.fast_gelu = 0
        """Flux feed-forwards whose GELU (tanh) runs in its sigmoid form."""
        self._graphed: list[_GraphedForward] = []
        """Attentions whose q/k/v projections run as one matmul."""
        self._cached_model: Any = None
        self.cache_checks = 0
        """Denoising steps the step cache looked at."""
        self.cached_steps = 0
        """Of those, steps that reused the previous step's output of all blocks but the first."""

    @property
    def step_cache(self) -> bool:
        """Whether the stage has a step cache (threshold or schedule)."""
        return self.settings.step_cache_threshold > 0 or self.settings.step_cache is not None

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
        if self.step_cache and self.settings.step_cache_threshold >= 1.0:
            raise EngineError(f"stage {self.stage!r}: step_cache_threshold must be below 1")

    def apply(self, pipe: Any, device: str, parallel: Callable[[Any], None] | None = None) -> None:
        """Attention backend, FP8, `parallel(pipe)` (context parallelism, see diffusion_parallel), compilation
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
        if (gpu_compiled or self.settings.quantization == "fp8") and type(model).__name__ in _FUSE_QKV:
            fused = _fuse_qkv(model) + (_fuse_qkv(second) if second is not None and second is not model else 0)
            self.fused_attentions = fused
            log.info("stage %s: fused the q/k/v projections of %d attentions", self.stage, fused)
        if self.settings.quantization == "fp8":
            if type(model).__name__ in _FUSE_QKV:  # Flux: the single blocks' proj_out without its input's cat
                self.split_proj_out = _split_single_proj_out(blocks)
                self.fast_gelu = _fast_gelu(blocks)
                log.info(
                    "stage %s: %d single blocks' proj_out split in two (no cat), GELU (tanh) as x*sigmoid in %d "
                    "feed-forwards", self.stage, self.split_proj_out, self.fast_gelu,
                )  # fmt: skip
            self.fp8_layers = self._fp8(blocks)
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
                graphed = _GraphedForward(self.stage, denoiser.forward)
                denoiser.forward = graphed
                self._graphed.append(graphed)
            log.info("stage %s: the denoiser's step replays CUDA graphs (one per input shape)", self.stage)
        if self.step_cache and type(model).__name__ in _NO_STEP_CACHE:
            raise EngineError(
                f"stage {self.stage!r}: step caching does not apply to {type(model).__name__} (diffusers' "
                "step caches break on its last block, which returns no text states); remove "
                "step_cache_threshold / step_cache from engineArgs (Flux, Qwen-Image and Wan stages take them)"
            )
        if self.settings.step_cache is not None:
            self._taylorseer(model, self.settings.step_cache)
        if self.settings.step_cache_threshold > 0:
            from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache

            # The hook itself, not `enable_cache`: models without diffusers' CacheMixin (SD3) take it too.
            try:
                apply_first_block_cache(model, FirstBlockCacheConfig(threshold=self.settings.step_cache_threshold))
            except (ValueError, TypeError, KeyError) as err:
                raise EngineError(
                    f"stage {self.stage!r}: step caching does not apply to {type(model).__name__} ({err}); "
                    "remove step_cache_threshold from engineArgs"
                ) from err
            self._cache_hooks = _head_hooks(model)
            self._cached_model = model
            for hook in self._cache_hooks:
                hook._should_compute_remaining_blocks = self._counted(hook._should_compute_remaining_blocks)
            log.info("stage %s: first block cache, threshold %s", self.stage, self.settings.step_cache_threshold)

    def _taylorseer(self, model: Any, cfg: StepCacheSettings) -> None:
        """diffusers' TaylorSeer cache, lite variant: on a skipped step every transformer block returns zeros
        at once and `proj_out` (the denoiser's output projection) returns its Taylor extrapolation from the last
        full steps; so a skipped step costs next to nothing, whatever the blocks are."""
        import torch
        from diffusers.hooks import TaylorSeerCacheConfig
        from diffusers.hooks.taylorseer_cache import apply_taylorseer_cache

        config = TaylorSeerCacheConfig(
            cache_interval=cfg.interval,
            disable_cache_before_step=cfg.warmup,
            max_order=cfg.order,
            taylor_factors_dtype=torch.float32,  # the extrapolated output is small (latent channels only)
            use_lite_mode=True,
        )
        try:
            apply_taylorseer_cache(model, config)
        except (ValueError, TypeError, KeyError) as err:
            raise EngineError(
                f"stage {self.stage!r}: step_cache {cfg.policy} does not apply to {type(model).__name__} ({err}); "
                "remove step_cache from engineArgs"
            ) from err
        hooks = _taylor_hooks(model)
        heads = [hook for name, hook in hooks if name == "proj_out"]
        if len(heads) != 1 or len(hooks) < 2:
            raise EngineError(
                f"stage {self.stage!r}: step_cache {cfg.policy} needs a denoiser with transformer blocks and an "
                f"output projection named proj_out; {type(model).__name__} has {len(hooks) - len(heads)} hooked "
                "blocks and no single proj_out. Remove step_cache from engineArgs"
            )
        self._taylor_hooks = [hook for _name, hook in hooks]
        self._cached_model = model
        head = heads[0]
        decide = head._measure_should_compute

        def counted() -> tuple[bool, Any]:
            compute, state = decide()
            self.cache_checks += 1
            self.cached_steps += not compute
            return compute, state

        head._measure_should_compute = counted  # the instance attribute wins over the hook's method
        log.info(
            "stage %s: taylorseer step cache (diffusers, lite): warm-up %d steps, then 1 in %d in full, order %d",
            self.stage, cfg.warmup, cfg.interval, cfg.order,
        )  # fmt: skip

    def _counted(self, decide: Callable[[Any], bool]) -> Callable[[Any], bool]:
        def counted(residual: Any) -> bool:
            compute = decide(residual)
            self.cache_checks += 1
            self.cached_steps += not compute
            return compute

        return counted

    @property
    def graph_replays(self) -> int:
        """Denoiser steps that ran as a CUDA graph replay."""
        return sum(g.replays for g in self._graphed)

    def stats(self) -> dict[str, float]:
        """For the engine's stats: `step_cache_checks_total`, `step_cache_hits_total` (steps served by the cache),
        `cuda_graph_replays_total` (denoiser steps replayed from a CUDA graph)."""
        out = {}
        if self._graphed:
            out["cuda_graph_replays_total"] = float(self.graph_replays)
        if self._cache_hooks or self._taylor_hooks:
            out["step_cache_checks_total"] = float(self.cache_checks)
            out["step_cache_hits_total"] = float(self.cached_steps)
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

    @staticmethod
    def _fp8(blocks: list[Any]) -> int:
        import torch

        count = 0
        for block in blocks:
            for parent in list(block.modules()):
                for child_name, child in list(parent.named_children()):
                    if isinstance(child, torch.nn.Linear) and Fp8Linear.convertible(child):
                        setattr(parent, child_name, Fp8Linear.build(child))
                        count += 1
        return count

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

    def request_option(self, params: dict[str, Any]) -> bool:
        """Pop `step_cache` from a request's params: whether the step cache runs for it."""
        if REQUEST_PARAM not in params:
            return True
        value = params.pop(REQUEST_PARAM)
        if not isinstance(value, bool):
            raise InvalidRequest(f"{REQUEST_PARAM} must be true or false, not {value!r}")
        return value

    @contextlib.contextmanager
    def call(self, step_cache: bool) -> Iterator[None]:
        """Around one pipeline call: a fresh step-cache state (no step compares with another call's), and the
        cache off for this call when its requests asked for that."""
        if not self._cache_hooks and not self._taylor_hooks:
            yield
            return
        from diffusers.hooks.hooks import CacheContext, HookRegistry, _set_cache_context

        HookRegistry.check_if_exists_or_initialize(self._cached_model).reset_stateful_hooks()  # and submodules'
        # Pipelines that name their own cache context (Flux: "cond") override this one inside the call;
        # the others (SD3) would otherwise fail with "No cache context is set".
        _set_cache_context(self._cached_model, CacheContext("omnikube"))
        saved = [h.threshold for h in self._cache_hooks]
        warmups = [h.disable_cache_before_step for h in self._taylor_hooks]
        if not step_cache:
            for hook in self._cache_hooks:
                hook.threshold = -1.0  # every relative change exceeds it: every block runs every step
            for hook in self._taylor_hooks:
                hook.disable_cache_before_step = 1 << 30  # every step is a warm-up step: all run in full
        try:
            yield
        finally:
            _set_cache_context(self._cached_model, None)
            for hook, threshold in zip(self._cache_hooks, saved, strict=True):
                hook.threshold = threshold
            for hook, warmup in zip(self._taylor_hooks, warmups, strict=True):
                hook.disable_cache_before_step = warmup


_NO_STEP_CACHE = frozenset({"SD3Transformer2DModel"})
"""Denoisers whose blocks diffusers' step caches cannot wrap (seen failing on diffusers 0.42)."""

_FUSE_QKV = frozenset({"FluxTransformer2DModel"})
"""Denoisers whose attention processor reads the fused projection (`fused_projections`) in diffusers 0.42 and
whose per-projection layers nothing else reads, so the unfused ones can go (no second copy of the weights)."""


def _fuse_qkv(model: Any) -> int:
    """Fuse each attention's q/k/v (and the text stream's added q/k/v) projections into one Linear and drop
    the separate ones; returns how many attentions were fused. Same arithmetic, one matmul instead of three
    (with FP8: one activation quantization instead of three)."""
    import torch

    count = 0
    for module in list(model.modules()):
        if not getattr(module, "_supports_qkv_fusion", False) or not hasattr(module, "fuse_projections"):
            continue
        if getattr(module, "fused_projections", False) or getattr(module, "is_cross_attention", False):
            continue
        with torch.no_grad():
            module.fuse_projections()
        if not getattr(module, "fused_projections", False):
            continue
        for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
            if isinstance(getattr(module, name, None), torch.nn.Linear):
                delattr(module, name)
        count += 1
    return count


_GELU_K = 2.0 * 0.7978845608028654  # 2 * sqrt(2 / pi)


def _gelu_tanh(x: Any) -> Any:
    """GELU's tanh approximation, 0.5 x (1 + tanh(z)), as x * sigmoid(2 z): the same function (0.5 (1 + tanh z)
    is sigmoid(2 z)) up to float rounding, with one exp instead of tanh in the compiled kernel that also takes
    each row's amax and casts it to FP8 (and computes the GELU twice: once for the amax, once for the cast)."""
    import torch

    xf = x.float()
    return (xf * torch.sigmoid(_GELU_K * (xf + 0.044715 * xf * xf * xf))).to(x.dtype)


@functools.cache
def _split_classes() -> tuple[Any, Any, Any]:
    """(the split proj_out module, the single block class using it, diffusers' GELU in its sigmoid form): one class
    each, made once (torch.compile guards on a module's class: one class per block would compile each anew)."""
    import torch
    from diffusers.models.activations import GELU
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    def part(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Linear:
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        linear.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)
        if bias is not None:
            linear.bias = torch.nn.Parameter(bias, requires_grad=False)
        return linear

    class SplitProjOut(torch.nn.Module):
        """proj_out(cat(a, m)) as a @ Wa^T + m @ Wm^T + b: two Linears (each made FP8 with its own per-row
        scales), so the concatenation is never built and each activation is quantized on its own rows."""

        def __init__(self, src: torch.nn.Linear, attn_features: int) -> None:
            super().__init__()
            w = src.weight.detach()
            b = None if src.bias is None else src.bias.detach()
            self.attn_part = part(w[:, :attn_features], b)  # the bias once
            self.mlp_part = part(w[:, attn_features:], None)
            self.in_features, self.out_features = src.in_features, src.out_features

        def forward(self, attn_output: torch.Tensor, mlp_hidden_states: torch.Tensor) -> torch.Tensor:
            return self.attn_part(attn_output) + self.mlp_part(mlp_hidden_states)

    class SplitSingleBlock(FluxSingleTransformerBlock):
        """diffusers 0.42's FluxSingleTransformerBlock.forward, with proj_out taking its two inputs apart."""

        def forward(
            self,
            hidden_states: torch.Tensor,
            encoder_hidden_states: torch.Tensor,
            temb: torch.Tensor,
            image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
            joint_attention_kwargs: dict[str, Any] | None = None,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            text_seq_len = encoder_hidden_states.shape[1]
            hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
            residual = hidden_states
            norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
            mlp_hidden_states = _gelu_tanh(self.proj_mlp(norm_hidden_states))
            attn_output = self.attn(
                hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {})
            )
            hidden_states = residual + gate.unsqueeze(1) * self.proj_out(attn_output, mlp_hidden_states)
            if hidden_states.dtype == torch.float16:
                hidden_states = hidden_states.clip(-65504, 65504)
            return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]

    SplitSingleBlock.__name__ = SplitSingleBlock.__qualname__ = FluxSingleTransformerBlock.__name__  # name lists

    class SigmoidGELU(GELU):
        """diffusers' GELU (Linear + GELU) with the tanh approximation computed as x * sigmoid(2 z)."""

        def gelu(self, gate: torch.Tensor) -> torch.Tensor:
            return _gelu_tanh(gate)

    SigmoidGELU.__name__ = SigmoidGELU.__qualname__ = GELU.__name__
    return SplitProjOut, SplitSingleBlock, SigmoidGELU


def _split_single_proj_out(blocks: list[Any]) -> int:
    """Give each Flux single block (diffusers 0.42's layout: the attention output and GELU(proj_mlp) concatenated
    into proj_out) a proj_out split into its attention and MLP parts, and the block's forward that feeds each
    part its own input; returns how many. A block of another layout is left as it is."""
    import torch

    split_out, split_block, _gelu = _split_classes()
    count = 0
    for block in blocks:
        if type(block).__name__ != "FluxSingleTransformerBlock" or type(block) is split_block:
            continue
        proj_out, proj_mlp, act = (getattr(block, n, None) for n in ("proj_out", "proj_mlp", "act_mlp"))
        if not (
            isinstance(proj_out, torch.nn.Linear)
            and isinstance(proj_mlp, torch.nn.Linear)
            and isinstance(act, torch.nn.GELU)
            and act.approximate == "tanh"
            and proj_out.in_features == proj_out.out_features + proj_mlp.out_features
            and getattr(getattr(block, "attn", None), "pre_only", False)
        ):
            log.warning("%s has another layout than diffusers 0.42's: its proj_out stays whole", type(block))
            continue
        block.proj_out = split_out(proj_out, proj_out.out_features)
        block.__class__ = split_block
        count += 1
    return count


def _fast_gelu(blocks: list[Any]) -> int:
    """diffusers' GELU modules (tanh approximation) in `blocks` switched to the sigmoid form; returns how many."""
    _split_out, _split_block, sigmoid_gelu = _split_classes()
    from diffusers.models.activations import GELU

    count = 0
    for block in blocks:
        for module in block.modules():
            if type(module) is GELU and module.approximate == "tanh":
                module.__class__ = sigmoid_gelu
                count += 1
    return count


def _head_hooks(model: Any) -> list[Any]:
    """The First Block Cache hooks that decide, each step, whether the other blocks run."""
    from diffusers.hooks import HookRegistry

    hooks: list[Any] = []
    for module in model.modules():
        registry = getattr(module, "_diffusers_hook", None)
        if isinstance(registry, HookRegistry):
            hooks.extend(h for h in registry.hooks.values() if hasattr(h, "threshold"))
    if not hooks:
        raise EngineError("step cache: diffusers registered no first-block hook; its hook layout changed")
    return hooks


class _GraphedForward:
    """A denoiser's `forward` that replays a CUDA graph per input signature (keyword tensors' shapes, dtypes and
    devices, and the other arguments' values). The first call of a signature runs as is (compiling, tuning);
    the second captures (after one warm-up run on a side stream) and every later one copies its tensors into the
    graph's static inputs and replays: no Python and no launches per kernel. Outputs are cloned, so a caller may
    hold one step's output across the next (CFG calls the denoiser twice per step). Anything it cannot key
    (positional tensors, nested containers, tensors off the GPU, `return_dict=True`) runs as is; a failed capture
    turns the graphs off for good (logged), and the stage keeps running compiled."""

    MAX_GRAPHS = 4

    def __init__(self, stage: str, forward: Callable[..., Any]) -> None:
        self.stage = stage
        self.forward = forward
        self.graphs: collections.OrderedDict[tuple[Any, ...], tuple[Any, dict[str, Any], tuple[Any, ...]]] = (
            collections.OrderedDict()
        )
        self.seen: set[tuple[Any, ...]] = set()
        self.broken = False
        self.replays = 0

    @staticmethod
    def _key(kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
        import torch

        if kwargs.get("return_dict", True) is not False:
            return None
        key: list[Any] = []
        for name in sorted(kwargs):
            value = kwargs[name]
            if isinstance(value, torch.Tensor):
                if value.device.type != "cuda":
                    return None
                key.append((name, tuple(value.shape), value.dtype, value.device))
            elif value is None or isinstance(value, (bool, int, float, str)):
                key.append((name, value))
            elif isinstance(value, dict) and not value:
                key.append((name, "{}"))
            else:
                return None
        return tuple(key)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        key = None if self.broken or args or not torch.is_inference_mode_enabled() else self._key(kwargs)
        if key is None:
            return self.forward(*args, **kwargs)
        entry = self.graphs.get(key)
        if entry is None:
            if key not in self.seen:
                if len(self.seen) > 4096:  # bounded: a long-lived stage sees many request shapes
                    self.seen.clear()
                self.seen.add(key)
                return self.forward(**kwargs)
            entry = self._capture(key, kwargs)
            if entry is None:
                return self.forward(**kwargs)
        self.graphs.move_to_end(key)
        graph, static, outputs = entry
        for name, tensor in static.items():
            tensor.copy_(kwargs[name])
        graph.replay()
        self.replays += 1
        return tuple(o.clone() for o in outputs)

    def _capture(self, key: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        import torch

        static = {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        plain = {k: v for k, v in kwargs.items() if k not in static}
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.forward(**static, **plain)  # allocations and library handles on the capture's side
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                outputs = self.forward(**static, **plain)
        except Exception as err:  # capture is best effort: the compiled forward still runs
            self.broken = True
            log.warning("stage %s: CUDA graph capture failed, running without graphs: %s", self.stage, err)
            return None
        if not isinstance(outputs, tuple) or not all(isinstance(o, torch.Tensor) for o in outputs):
            self.broken = True
            log.warning("stage %s: the denoiser returned %s, not tensors: no CUDA graphs", self.stage, type(outputs))
            return None
        while len(self.graphs) >= self.MAX_GRAPHS:
            self.graphs.popitem(last=False)  # its memory pool goes with it
        self.graphs[key] = (graph, static, outputs)
        log.info("stage %s: captured a CUDA graph of the denoiser step (%d kept)", self.stage, len(self.graphs))
        return self.graphs[key]


def _taylor_hooks(model: Any) -> list[tuple[str, Any]]:
    """(module name, TaylorSeer hook) for every module diffusers hooked."""
    from diffusers.hooks import HookRegistry

    found: list[tuple[str, Any]] = []
    for name, module in model.named_modules():
        registry = getattr(module, "_diffusers_hook", None)
        if isinstance(registry, HookRegistry):
            found.extend((name, h) for h in registry.hooks.values() if hasattr(h, "disable_cache_before_step"))
    return found


def _auto_backend(device: str) -> str:
    """FlashAttention-3 when installed (Hopper), cuDNN attention on compute capability 9.0+, else SDPA."""
    import torch

    major, _minor = torch.cuda.get_device_capability(device)
    if major == 9 and importlib.util.find_spec("flash_attn_interface") is not None:
        return "_flash_3"
    if major >= 9 and torch.backends.cudnn.is_available():
        return "_native_cudnn"
    return "native"
