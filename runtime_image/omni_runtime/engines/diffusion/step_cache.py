"""Step caching of a diffusion stage's denoiser (engine args `step_cache_threshold` and `step_cache`): `StepCache`.

Two of diffusers' caches, at most one per stage: First Block Cache (a threshold on the first block's residual
decides each step whether the other blocks run) and TaylorSeer (a schedule decides which steps skip every block
and extrapolate the output). See `accel`'s docstring for what each does and costs. A request turns the stage's
cache off for itself with `step_cache: false` (`request_option`); each pipeline call starts from a fresh cache
state (`StepCache.call`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from omni_runtime.engines.base import EngineError, InvalidRequest
from omni_runtime.spec.engine_args import StepCacheSettings

__all__ = ["NO_STEP_CACHE", "REQUEST_PARAM", "StepCache", "request_option"]

log = logging.getLogger(__name__)

REQUEST_PARAM = "step_cache"
"""Request parameter (bool) that turns the stage's step cache off for that request."""


NO_STEP_CACHE = frozenset({"SD3Transformer2DModel"})
"""Denoisers whose blocks diffusers' step caches cannot wrap (seen failing on diffusers 0.42)."""


def request_option(params: dict[str, Any]) -> bool:
    """Pop `step_cache` from a request's params: whether the step cache runs for it."""
    if REQUEST_PARAM not in params:
        return True
    value = params.pop(REQUEST_PARAM)
    if not isinstance(value, bool):
        raise InvalidRequest(f"{REQUEST_PARAM} must be true or false, not {value!r}")
    return value


class StepCache:
    """One stage's step cache: put on its denoiser by `apply`, switched per call by `call`, counted for `stats`."""

    def __init__(self, stage: str, threshold: float, schedule: StepCacheSettings | None) -> None:
        self.stage = stage
        self.threshold = threshold
        """First Block Cache threshold (0: off)."""
        self.schedule = schedule
        """The schedule-based (TaylorSeer) cache, or None."""
        self.threshold_hooks: list[Any] = []
        """First Block Cache: the hooks that decide whether the other blocks run."""
        self.taylor_hooks: list[Any] = []
        """TaylorSeer: every hook (blocks and proj_out); each counts the steps itself."""
        self.model: Any = None
        """The denoiser the hooks sit on."""
        self.checks = 0
        """Denoising steps the step cache looked at."""
        self.hits = 0
        """Of those, steps that reused the previous step's output of all blocks but the first."""

    @property
    def enabled(self) -> bool:
        """Whether the stage has a step cache (threshold or schedule)."""
        return self.threshold > 0 or self.schedule is not None

    def apply(self, model: Any) -> None:
        """Put the stage's step cache on `model` (after compilation: the cache's per-step decision stays in
        Python and the compiled blocks never see it); EngineError when it cannot apply."""
        if self.enabled and type(model).__name__ in NO_STEP_CACHE:
            raise EngineError(
                f"stage {self.stage!r}: step caching does not apply to {type(model).__name__} (diffusers' "
                "step caches break on its last block, which returns no text states); remove "
                "step_cache_threshold / step_cache from engineArgs (Flux, Qwen-Image and Wan stages take them)"
            )
        if self.schedule is not None:
            self._taylorseer(model, self.schedule)
        if self.threshold > 0:
            from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache

            # The hook itself, not `enable_cache`: models without diffusers' CacheMixin (SD3) take it too.
            try:
                apply_first_block_cache(model, FirstBlockCacheConfig(threshold=self.threshold))
            except (ValueError, TypeError, KeyError) as err:
                raise EngineError(
                    f"stage {self.stage!r}: step caching does not apply to {type(model).__name__} ({err}); "
                    "remove step_cache_threshold from engineArgs"
                ) from err
            self.threshold_hooks = _head_hooks(model)
            self.model = model
            for hook in self.threshold_hooks:
                hook._should_compute_remaining_blocks = self._counted(hook._should_compute_remaining_blocks)
            log.info("stage %s: first block cache, threshold %s", self.stage, self.threshold)

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
        self.taylor_hooks = [hook for _name, hook in hooks]
        self.model = model
        head = heads[0]
        decide = head._measure_should_compute

        def counted() -> tuple[bool, Any]:
            compute, state = decide()
            self.checks += 1
            self.hits += not compute
            return compute, state

        head._measure_should_compute = counted  # the instance attribute wins over the hook's method
        log.info(
            "stage %s: taylorseer step cache (diffusers, lite): warm-up %d steps, then 1 in %d in full, order %d",
            self.stage, cfg.warmup, cfg.interval, cfg.order,
        )  # fmt: skip

    def _counted(self, decide: Callable[[Any], bool]) -> Callable[[Any], bool]:
        def counted(residual: Any) -> bool:
            compute = decide(residual)
            self.checks += 1
            self.hits += not compute
            return compute

        return counted

    def stats(self) -> dict[str, float]:
        """`step_cache_checks_total`, `step_cache_hits_total` (steps served by the cache), once a cache is on."""
        if not self.threshold_hooks and not self.taylor_hooks:
            return {}
        return {"step_cache_checks_total": float(self.checks), "step_cache_hits_total": float(self.hits)}

    @contextlib.contextmanager
    def call(self, step_cache: bool) -> Iterator[None]:
        """Around one pipeline call: a fresh step-cache state (no step compares with another call's), and the
        cache off for this call when its requests asked for that."""
        if not self.threshold_hooks and not self.taylor_hooks:
            yield
            return
        from diffusers.hooks.hooks import CacheContext, HookRegistry, _set_cache_context

        HookRegistry.check_if_exists_or_initialize(self.model).reset_stateful_hooks()  # and submodules'
        # Pipelines that name their own cache context (Flux: "cond") override this one inside the call;
        # the others (SD3) would otherwise fail with "No cache context is set".
        _set_cache_context(self.model, CacheContext("omnikube"))
        saved = [h.threshold for h in self.threshold_hooks]
        warmups = [h.disable_cache_before_step for h in self.taylor_hooks]
        if not step_cache:
            for hook in self.threshold_hooks:
                hook.threshold = -1.0  # every relative change exceeds it: every block runs every step
            for hook in self.taylor_hooks:
                hook.disable_cache_before_step = 1 << 30  # every step is a warm-up step: all run in full
        try:
            yield
        finally:
            _set_cache_context(self.model, None)
            for hook, threshold in zip(self.threshold_hooks, saved, strict=True):
                hook.threshold = threshold
            for hook, warmup in zip(self.taylor_hooks, warmups, strict=True):
                hook.disable_cache_before_step = warmup


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


def _taylor_hooks(model: Any) -> list[tuple[str, Any]]:
    """(module name, TaylorSeer hook) for every module diffusers hooked."""
    from diffusers.hooks import HookRegistry

    found: list[tuple[str, Any]] = []
    for name, module in model.named_modules():
        registry = getattr(module, "_diffusers_hook", None)
        if isinstance(registry, HookRegistry):
            found.extend((name, h) for h in registry.hooks.values() if hasattr(h, "disable_cache_before_step"))
    return found
