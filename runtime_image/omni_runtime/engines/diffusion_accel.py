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
- `attention_backend` (default `auto`): `auto` picks FlashAttention-3 when its package is installed, else
  cuDNN attention on NVIDIA GPUs of compute capability 9.0+, else PyTorch SDPA (`native`); or one of
  diffusers' backend names (`native`, `_native_cudnn`, `_flash_3`, `flash`, ...).

Each choice is logged at start. The CPU path is unchanged unless a stage asks for the step cache.
"""

from __future__ import annotations

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
    attention_backend: str = Field("auto", min_length=1, description="auto, or a diffusers attention backend name.")


ACCEL_ENGINE_ARGS: frozenset[str] = frozenset(AccelSettings.model_fields)
"""Engine args this module reads (the engine keeps them out of `from_pretrained`'s keyword arguments)."""


def _settings(stage: str, engine_args: dict[str, Any]) -> AccelSettings:
    given = {k: v for k, v in engine_args.items() if k in ACCEL_ENGINE_ARGS}
    try:
        return AccelSettings.model_validate(given)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise EngineError(
            f"stage {stage!r}: engine arg {field}={given.get(field)!r} is not allowed ({first['msg']}); "
            "see enforce_eager (bool), quantization (fp8 or unset), step_cache_threshold (0 to 1), "
            "attention_backend (auto or a diffusers backend name)"
        ) from None


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
            out = torch._scaled_mm(
                xq, self.weight_fp8.t(), scale_a=x_scale, scale_b=self.weight_scale, out_dtype=x.dtype
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
        self._cached_model: Any = None
        self.cache_checks = 0
        """Denoising steps the step cache looked at."""
        self.cached_steps = 0
        """Of those, steps that reused the previous step's output of all blocks but the first."""

    @property
    def step_cache(self) -> bool:
        return self.settings.step_cache_threshold > 0

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
            if self.settings.quantization or self.step_cache:
                raise EngineError(
                    f"stage {self.stage!r}: {type(pipe).__name__} has no transformer or unet, so quantization "
                    "and step_cache_threshold cannot apply; remove them from engineArgs"
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
        if self.settings.quantization == "fp8":
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
        if self.step_cache:
            from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache

            if type(model).__name__ in _NO_STEP_CACHE:
                raise EngineError(
                    f"stage {self.stage!r}: step caching does not apply to {type(model).__name__} (diffusers' "
                    "first block cache breaks on its last block, which returns no text states); remove "
                    "step_cache_threshold from engineArgs (Flux, Qwen-Image and Wan stages take it)"
                )

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

    def _counted(self, decide: Callable[[Any], bool]) -> Callable[[Any], bool]:
        def counted(residual: Any) -> bool:
            compute = decide(residual)
            self.cache_checks += 1
            self.cached_steps += not compute
            return compute

        return counted

    def stats(self) -> dict[str, float]:
        """For the engine's stats: `step_cache_checks_total`, `step_cache_hits_total` (steps served by the cache)."""
        if not self._cache_hooks:
            return {}
        return {"step_cache_checks_total": float(self.cache_checks), "step_cache_hits_total": float(self.cached_steps)}

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
        if not self._cache_hooks:
            yield
            return
        from diffusers.hooks.hooks import CacheContext, HookRegistry, _set_cache_context

        HookRegistry.check_if_exists_or_initialize(self._cached_model).reset_stateful_hooks()
        # Pipelines that name their own cache context (Flux: "cond") override this one inside the call;
        # the others (SD3) would otherwise fail with "No cache context is set".
        _set_cache_context(self._cached_model, CacheContext("omnikube"))
        saved = [h.threshold for h in self._cache_hooks]
        if not step_cache:
            for hook in self._cache_hooks:
                hook.threshold = -1.0  # every relative change exceeds it: every block runs every step
        try:
            yield
        finally:
            _set_cache_context(self._cached_model, None)
            for hook, threshold in zip(self._cache_hooks, saved, strict=True):
                hook.threshold = threshold


_NO_STEP_CACHE = frozenset({"SD3Transformer2DModel"})
"""Denoisers whose blocks diffusers' first block cache cannot wrap (seen failing on diffusers 0.42)."""


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


def _auto_backend(device: str) -> str:
    """FlashAttention-3 when installed (Hopper), cuDNN attention on compute capability 9.0+, else SDPA."""
    import torch

    major, _minor = torch.cuda.get_device_capability(device)
    if major == 9 and importlib.util.find_spec("flash_attn_interface") is not None:
        return "_flash_3"
    if major >= 9 and torch.backends.cudnn.is_available():
        return "_native_cudnn"
    return "native"
