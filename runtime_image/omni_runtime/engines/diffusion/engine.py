"""The `diffusion` engine: a diffusers pipeline loaded from a local folder, with request batching.

Requests that arrive within `batch_window_ms` of the oldest waiting one and agree on everything
that a pipeline call shares (input kind, size, steps, guidance, images per prompt, whether a negative
prompt is given, embedding shapes) run as ONE pipeline call, up to `max_batch_size` images. Each
request gets its own CPU `torch.Generator` seeded with its seed, so its image depends only on its
own seed and not on what it was batched with (beyond float rounding). Requests that do not fit run
in a later call. One call runs at a time, in a worker thread, so the event loop stays responsive.

Engine args (the rest go to `DiffusionPipeline.from_pretrained`):

| key | default | meaning |
|---|---|---|
| `torch_dtype` | `float32` on CPU, `bfloat16` on CUDA | dtype; replaced when the device lacks it (`device_dtype`) |
| `device` | `cuda` when available, else `cpu` | where the pipeline runs |
| `batch_window_ms` | 10 | how long the oldest waiting request waits for company |
| `max_batch_size` | 8 | most images (requests x `n`) in one pipeline call |
| `max_pixels` | 4194304 (2048 x 2048) | largest height x width accepted |
| `max_inference_steps` | 200 | most denoising steps (`num_inference_steps`, or entries of `sigmas`/`timesteps`) |
| `sequence_parallel` | `auto` | ranks (one per GPU) the denoiser's sequence is split over (`diffusion_parallel`) |

Input (`EngineInput.data`): `{"prompt": str, "negative_prompt": str | None}`, or embeddings named as
the pipeline's `__call__` names them (`prompt_embeds`, `pooled_prompt_embeds`, `negative_*`...), each
with a leading batch axis of 1. Params: the pipeline's scalar call arguments (`height`, `width`,
`num_inference_steps`, `guidance_scale`, ...) plus `seed` and `n` (images for this request).
Output: `{"images": [png bytes, ...]}`; a stage whose `output_modality` is `hidden` gives
`{"latents": tensor (n, C, h, w)}` instead (for a separate VAE stage, see `dit_to_vae`).

Video pipelines (their `__call__` takes `num_frames`) take `fps` too and give an MP4 per request, with
progress outputs while they denoise: see `engines/diffusion/video.py` (its engine args: `max_frames`,
`default_fps`, `max_fps`). Speed options are engine args too, see `engines/diffusion/accel.py`:
`enforce_eager`, `quantization`, `step_cache_threshold`, `step_cache`, `attention_backend` (a request's
`step_cache: false` turns the step cache off). Every pipeline that takes `callback_on_step_end` stops
between two denoising steps once every request of its batch is aborted, and reports its step time
(`omnikube_stage_denoise_step_seconds`).

Before the stage reports ready it runs a self-check: one request of one denoising step at the smallest
size (twice the size multiple; the fewest frames for video; a gray picture for image-input stages), with
the stage's sampling_params, through the same parsing, pipeline call and encoding as every request. When it
fails, `start()` raises with what to change, so the stage never becomes ready instead of failing every
request. On a CPU a half-precision check that fails is retried once in float32 (logged): a kernel the CPU
lacks shows only when it runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import difflib
import inspect
import io
import logging
import math
import os
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_runtime.engines.base import Engine, EngineError, EngineInput, EngineOutput, InvalidRequest
from omni_runtime.engines.diffusion import parallel as P
from omni_runtime.engines.diffusion import png as PNG
from omni_runtime.engines.diffusion import video as V
from omni_runtime.engines.diffusion.accel import ACCEL_ENGINE_ARGS, Accel
from omni_runtime.metrics import Stage as StageMetrics
from omni_runtime.spec import Modality, ResolvedPipeline, StageSpec

__all__ = ["DIFFUSION_ENGINE_ARGS", "DiffusionEngine", "device_dtype"]

log = logging.getLogger(__name__)

DIFFUSION_ENGINE_ARGS: dict[str, Any] = {
    "torch_dtype": None,
    "device": None,
    "batch_window_ms": 10.0,
    "max_batch_size": 8,
    "max_pixels": 2048 * 2048,
    "max_inference_steps": 200,
    P.ARG: "auto",
}
"""Engine args this engine reads itself (None: chosen by device); see the module docstring."""

_REGISTRY_ONLY = frozenset({"model_stage", "model_arch", "hf_config_name", "engine_output_type"})
_CALL_ARGS_OWNED = frozenset(
    {
        "generator",
        "latents",
        "output_type",
        "return_dict",
        "callback",
        "callback_steps",
        "callback_on_step_end",
        "callback_on_step_end_tensor_inputs",
        "num_images_per_prompt",
        "cross_attention_kwargs",
        "joint_attention_kwargs",
        "attention_kwargs",
    }
)
"""Pipeline call arguments the engine sets itself; a request may not pass them."""

RUNNING_GRACE_S = 10.0
"""Once a sequence-parallel rank died, how long the running call may take to end (its aborted collective
raises at once; a decode already past the last collective may finish) before its requests fail anyway."""


def _steps(call: dict[str, Any], default: int = 1) -> int:
    """Denoising steps a pipeline call runs: one per entry of a custom schedule, else num_inference_steps
    (`default` when the call leaves it to the pipeline)."""
    schedule = call.get("sigmas") or call.get("timesteps")
    return len(schedule) if schedule else int(call.get("num_inference_steps") or default)


@dataclass
class _Job:
    request_id: str
    kind: str
    """`text` or `embeds`."""
    key: str
    """Requests with equal keys may share a pipeline call."""
    call: dict[str, Any]
    """Call arguments shared by the batch (size, steps, guidance...)."""
    n: int
    seed: int
    prompt: str | None = None
    negative_prompt: str | None = None
    embeds: dict[str, Any] = field(default_factory=dict)
    step_cache: bool = True
    """False: this request asked for every denoising step in full (`step_cache: false`)."""
    image: Any = None
    """The input picture (PIL, RGB) of an image-to-image request."""
    arrival: float = 0.0
    future: asyncio.Future | None = None
    aborted: bool = False
    fps: int = 0
    """Frames per second of a video request's MP4 (0: an image request)."""
    steps_done: int = 0
    steps: int = 0
    progressed: asyncio.Event | None = None
    """Set (from the pipeline's thread) after each denoising step of a video request."""


class _Interrupted(Exception):
    """Raised between two denoising steps once every request of the batch is aborted."""


class DiffusionEngine(Engine):
    """A diffusion stage on a diffusers pipeline, batching compatible requests.

    `stats()`: `queue_depth`, `running_batch`, `denoising_steps_queued`, `last_batch_size` (requests),
    `last_batch_images`, `last_batch_seconds`, `last_step_seconds`, `batches_total`. `batch_log` keeps
    the request ids of the last 100 pipeline calls.
    """

    worker_state: tuple[str, ...] = ()
    """Instance attributes a subclass sets after construction that its sequence-parallel worker ranks need too
    (they build their own engine from the class, the pipeline and the stage)."""

    def __init__(self, pipeline: ResolvedPipeline, stage: StageSpec) -> None:
        super().__init__(pipeline, stage)
        path = Path(pipeline.model)
        self.model_path = str(path / stage.model_subfolder) if stage.model_subfolder else str(path)
        args = {**DIFFUSION_ENGINE_ARGS, **stage.engine_args}
        self.batch_window = float(args["batch_window_ms"]) / 1000.0
        self.max_batch_size = int(args["max_batch_size"])
        self.max_pixels = int(args["max_pixels"])
        self.max_inference_steps = int(args["max_inference_steps"])
        if self.max_batch_size < 1:
            raise EngineError(f"stage {stage.name!r}: max_batch_size is {self.max_batch_size}; use 1 or more")
        self._device_arg = args["device"]
        self._dtype_arg = args["torch_dtype"]
        self._video_args = {k: args.get(k, default) for k, default in V.VIDEO_ENGINE_ARGS.items()}
        self._load_kwargs = {
            k: v
            for k, v in stage.engine_args.items()
            if k not in DIFFUSION_ENGINE_ARGS
            and k not in _REGISTRY_ONLY
            and k not in V.VIDEO_ENGINE_ARGS
            and k not in ACCEL_ENGINE_ARGS
        }
        self.accel = Accel(stage.name, stage.engine_args)
        self._sp_arg = args[P.ARG]
        self.sequence_parallel = 1
        """Ranks the denoiser runs on (1: this process alone)."""
        self._group: P.ParallelGroup | None = None
        self.video = False
        """A video pipeline (set once loaded): MP4 outputs, `fps`, progress."""
        self._temporal = 1
        self._on_step = False
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self.latent_output = stage.output_modality is Modality.HIDDEN
        self.pipe: Any = None
        self.device = "cpu"
        self.size_multiple = 8
        self.default_size = 512
        self.load_seconds = 0.0
        self.batch_log: deque[list[str]] = deque(maxlen=100)
        self._call_params: frozenset[str] = frozenset()
        self._embed_params: frozenset[str] = frozenset()
        self._takes_image = False
        self._takes_size = True
        self._pending: list[_Job] = []
        self._arrived: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._default_steps = 1
        self._running: list[_Job] = []
        self._current: asyncio.Future | None = None
        self._encoding: asyncio.Future | None = None
        self._encoder: concurrent.futures.ThreadPoolExecutor | None = None
        self._stats = {
            "last_batch_size": 0.0,
            "last_batch_images": 0.0,
            "last_batch_seconds": 0.0,
            "last_step_seconds": 0.0,
            "batches_total": 0.0,
        }

    # -- loading -----------------------------------------------------------------------------------

    async def start(self) -> None:
        import torch

        self.device = self._device_arg or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype_name = self._dtype_arg or ("float32" if self.device == "cpu" else "bfloat16")
        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype):
            raise EngineError(
                f"stage {self.stage.name!r}: torch_dtype {dtype_name!r} is not a torch dtype; "
                "use float32, bfloat16 or float16"
            )
        self.accel.check_device(self.device)
        fitting, why = device_dtype(self.device, dtype)
        if fitting != dtype:
            log.warning("stage %s: torch_dtype %s -> %s: %s", self.stage.name, dtype_name, fitting, why)
        self.sequence_parallel = P.resolve_degree(self.stage.name, self._sp_arg, self.device, self.model_path)
        if self.sequence_parallel > 1 and self.accel.step_cache and self._sp_arg in (None, "auto"):
            log.info("stage %s: one GPU: the step cache is on, and it cannot run split", self.stage.name)
            self.sequence_parallel = 1
        if self.sequence_parallel > 1 and self.accel.settings.cuda_graphs and self._sp_arg in (None, "auto"):
            log.info("stage %s: one GPU: cuda_graphs is on, and it cannot run split", self.stage.name)
            self.sequence_parallel = 1  # an explicit sequence_parallel with cuda_graphs fails in Accel.apply
        if self.sequence_parallel > 1 and self.accel.step_cache:
            raise EngineError(
                f"stage {self.stage.name!r}: a step cache (step_cache_threshold or step_cache) and "
                f"{P.ARG}={self.sequence_parallel} cannot "
                f"run together (each rank would decide from its own part of the sequence whether to skip "
                f"blocks, and the ranks would fall out of step); remove one of them from engineArgs"
            )
        started = time.monotonic()
        if self.sequence_parallel > 1:
            group = P.ParallelGroup(self.stage.name, self.sequence_parallel, self.device)
            loop = asyncio.get_running_loop()

            def on_death(error: P.RankDied) -> None:  # a thread of the group (or the call's, out of step)
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left to tell
                    loop.call_soon_threadsafe(self._rank_died, error)

            group.on_death = on_death
            self._group = group
            try:
                await asyncio.to_thread(group.start, self, str(fitting).removeprefix("torch."))
                await self._load_pipeline(fitting)
            except BaseException:
                await self.stop()  # the worker ranks go with the failed start
                raise
        else:
            await self._load_pipeline(fitting)
        try:
            await self._self_check()
        except Exception as exc:
            if isinstance(exc, InvalidRequest) or self.device != "cpu" or fitting == torch.float32 or self._group:
                message = self._self_check_failed(exc, fitting)
                await self.stop()  # its memory and any worker ranks go with the failed start
                raise EngineError(message) from exc
            # A half-precision kernel this CPU lacks shows only when it runs: float32 always runs on a CPU.
            log.warning(
                "stage %s: the self-check failed in %s on the CPU (%s); loading again in float32",
                self.stage.name, fitting, exc,
            )  # fmt: skip
            await self.stop()
            await self._load_pipeline(torch.float32)
            try:
                await self._self_check()
            except Exception as again:
                message = self._self_check_failed(again, torch.float32)
                await self.stop()
                raise EngineError(message) from again
        self.load_seconds = time.monotonic() - started
        log.info(
            "stage %s: diffusers loaded %s (%s, %s, %s) and passed its self-check in %.1fs",
            self.stage.name,
            self.model_path,
            self._pipe_name(),
            self.device,
            self.pipe.dtype,
            self.load_seconds,
        )

    async def _load_pipeline(self, dtype: Any) -> None:
        """Load the pipeline in `dtype` and read what it takes (sizes, inputs, video or not)."""
        try:
            self.pipe = await asyncio.to_thread(self._load, dtype)
        except Exception as exc:  # diffusers raises many types while loading; the message matters
            raise EngineError(f"stage {self.stage.name!r}: diffusers failed to load {self.model_path}: {exc}") from exc
        group = self._group
        parallel = None
        if group is not None:
            world, device = group.world, self.device

            def parallel(pipe: Any) -> None:
                P.enable_context_parallel(self.stage.name, pipe, world, device)

        await asyncio.to_thread(self.accel.apply, self.pipe, self.device, parallel)
        self._encoder = concurrent.futures.ThreadPoolExecutor(encode_workers(), thread_name_prefix="omnikube-png")
        params = inspect.signature(self.pipe.__call__).parameters
        self._embed_params = frozenset(
            p for p in params if ("embeds" in p or p.endswith("_mask")) and not p.startswith("ip_adapter")
        )
        self._call_params = frozenset(
            p
            for p in params
            if p not in _CALL_ARGS_OWNED
            and p not in self._embed_params
            and not p.startswith(("prompt", "negative_prompt", "ip_adapter"))
            and p not in ("self", "image", "mask_image")
        )
        self._takes_image = "image" in params
        self.video = V.is_video_pipeline(self._call_params)
        self._temporal = V.temporal_factor(self.pipe) if self.video else 1
        self._on_step = "callback_on_step_end" in params
        self._event_loop = asyncio.get_running_loop()
        # The steps a request without num_inference_steps runs: the pipeline's own default.
        default_steps = params["num_inference_steps"].default if "num_inference_steps" in params else 1
        self._default_steps = default_steps if isinstance(default_steps, int) else 1
        self._takes_size = "height" in params and "width" in params
        self.size_multiple = _size_multiple(self.pipe)
        self.default_size = _default_size(self.pipe)
        if group is not None:  # from here on every call runs on every rank
            await asyncio.to_thread(group.wait_ready)
            self.pipe = P.ParallelPipe(self.pipe, group)
            log.info("stage %s: denoiser split over %d ranks (Ulysses)", self.stage.name, group.world)
        try:
            await asyncio.to_thread(self.accel.warmup, self._warmup_call)
        except Exception as exc:  # a compiler error: say which switch avoids it
            raise EngineError(
                f"stage {self.stage.name!r}: compiling the denoiser failed in its warm-up call: {exc}; "
                "set engineArgs enforce_eager: true to run it uncompiled"
            ) from exc
        self._arrived = asyncio.Event()
        self._worker = asyncio.create_task(self._loop(), name=f"diffusion-batcher-{self.stage.name}")

    async def _self_check(self) -> None:
        """One denoising step of one tiny request, through the same parsing, call and encoding as every
        request, before the stage reports ready: a stage that would fail every request never becomes ready."""
        name = self.stage.name
        if Modality.TEXT not in self.stage.input_modalities:
            log.info("stage %s: no self-check (its input is not a prompt)", name)
            return
        edge = 2 * self.size_multiple
        params: dict[str, Any] = {"num_inference_steps": 1, "seed": 0, "n": 1}
        if self._takes_size:
            params.update(height=edge, width=edge)
        if self.video:
            params["num_frames"] = self._temporal + 1
        data: dict[str, Any] = {"prompt": "omnikube self-check"}
        if self._takes_image and Modality.IMAGE in self.stage.input_modalities:
            from PIL import Image

            data["image"] = PNG.encode_pillow(Image.new("RGB", (edge, edge), "gray"), PNG_COMPRESS_LEVEL)
        job = self._parse(EngineInput("omnikube-self-check", data, params))
        started = time.monotonic()
        results = await asyncio.to_thread(self._call, [job])
        assert self._encoder is not None, "started engines have an encoder"
        await _encode_results(results, self._encoder)
        log.info(
            "stage %s: self-check passed (one step at %dx%d in %.2fs)", name, edge, edge, time.monotonic() - started
        )

    def _pipe_name(self) -> str:
        """The pipeline's class name (the wrapped one's on a sequence-parallel stage)."""
        return type(getattr(self.pipe, "_pipe", self.pipe)).__name__

    def _self_check_failed(self, exc: BaseException, dtype: Any) -> str:
        """What the stage says when its self-check fails: what ran, what failed, what to change."""
        hint = (
            "check the stage's engine_args and sampling_params (the check runs them with one step at the "
            "smallest size), and that the model folder holds a complete diffusers pipeline"
        )
        if isinstance(exc, InvalidRequest):
            hint = "the stage's engine_args or sampling_params refuse even this request; change them"
        elif str(dtype) != "torch.float32":
            hint = f"set the stage's engine_args torch_dtype: float32 (it ran in {dtype}), or {hint}"
        return (
            f"stage {self.stage.name!r}: the self-check (one denoising step of {self._pipe_name()} on "
            f"{self.device} in {dtype}) failed, so every request would fail: {type(exc).__name__}: {exc}; {hint}"
        )

    def _load(self, dtype: Any) -> Any:
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(
            self.model_path, dtype=dtype, local_files_only=True, **self._load_kwargs
        )
        pipe = pipe.to(self.device)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def _warmup_call(self, batch: int) -> None:
        """A short call at the default size with `batch` prompts, to compile before the stage is ready."""
        import torch

        kwargs: dict[str, Any] = {"prompt": ["warm-up"] * batch, "num_inference_steps": 2, "output_type": "latent"}
        if self._takes_size:
            kwargs.update(height=self.default_size, width=self.default_size)
        if self.video:
            kwargs["num_frames"] = self._temporal + 1
        if self._takes_image:
            from PIL import Image

            kwargs["image"] = [Image.new("RGB", (self.default_size, self.default_size))] * batch
        with torch.inference_mode():
            self.pipe(**kwargs)

    def _rank_died(self, error: P.RankDied) -> None:
        """A sequence-parallel rank died (on the event loop, from the group's watcher): the engine is dead.
        Queued requests fail now with the error; the running call fails with it as soon as its collective
        is aborted (or, should it hang, after `RUNNING_GRACE_S`); nothing new is taken."""
        self.fail(error)
        for job in self._pending:
            if job.future is not None and not job.future.done():
                job.future.set_exception(error)
        self._pending.clear()
        running = list(self._running)

        def fail_running() -> None:
            for job in running:
                if job.future is not None and not job.future.done():
                    job.future.set_exception(error)

        asyncio.get_running_loop().call_later(RUNNING_GRACE_S, fail_running)

    async def stop(self) -> None:
        """Fail queued requests, let a running call finish, and release the pipeline."""
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker
        if self._current is not None:
            # A dead engine's call may never end (a collective on a dead rank): it gets a bounded wait.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    asyncio.shield(self._current), RUNNING_GRACE_S if self.failure is not None else None
                )
        if self._encoding is not None:  # results already computed reach their requests
            with contextlib.suppress(Exception):
                await self._encoding
        for job in self._pending + self._running:
            if job.future is not None and not job.future.done():
                job.future.set_exception(EngineError(f"stage {self.stage.name!r} is stopping"))
        self._pending.clear()
        self._running = []
        encoder, self._encoder = self._encoder, None
        if encoder is not None:
            encoder.shutdown(wait=True)
        group, self._group = self._group, None
        if group is not None:
            await asyncio.to_thread(group.close)
        pipe, self.pipe = self.pipe, None
        if pipe is not None:
            del pipe
            import gc

            import torch

            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    # -- requests ----------------------------------------------------------------------------------

    def _parse(self, request: EngineInput) -> _Job:
        name = self.stage.name
        params = {**self.stage.sampling_params, **request.params}
        if "num_images_per_prompt" in params:
            params.setdefault("n", params.pop("num_images_per_prompt"))
        negative = request.data.get("negative_prompt")
        param_negative = params.pop("negative_prompt", None)
        negative = param_negative if negative is None else negative
        seed = params.pop("seed", None)
        n = params.pop("n", 1)
        step_cache = self.accel.request_option(params)
        fps = V.check_video_params(params, name, self._video_args, self._temporal) if self.video else 0
        picture = self._input_image(request.data.get("image"))
        if picture is not None:  # the output's size defaults to the input's (rounded to the multiple)
            m = self.size_multiple
            params.setdefault("width", max(m, picture.width // m * m))
            params.setdefault("height", max(m, picture.height // m * m))
        size_params = set() if self._takes_size else {"height", "width"}  # an img2img pipeline sizes by image
        unknown = sorted(set(params) - self._call_params - size_params)
        if unknown:
            close = difflib.get_close_matches(unknown[0], self._call_params, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise InvalidRequest(
                f"parameter {unknown[0]!r}{hint} is not supported by stage {name!r}; "
                f"use seed, n or one of {sorted(self._call_params)}"
            )
        height = _int(params.setdefault("height", self.default_size), "height")
        width = _int(params.setdefault("width", self.default_size), "width")
        m = self.size_multiple
        for label, value in (("height", height), ("width", width)):
            if value <= 0 or value % m:
                raise InvalidRequest(
                    f"{label} {value} is not allowed: stage {name!r} needs a positive multiple of {m} "
                    f"(VAE scale factor x patch size); use {max(m, value // m * m)} or {(value // m + 1) * m}"
                )
        if height * width > self.max_pixels:
            raise InvalidRequest(
                f"{width}x{height} is {height * width} pixels; stage {name!r} allows at most "
                f"{self.max_pixels} (max_pixels); ask for a smaller image"
            )
        if "num_inference_steps" in params:
            steps = _int(params["num_inference_steps"], "num_inference_steps")
            if not 1 <= steps <= self.max_inference_steps:
                raise InvalidRequest(
                    f"num_inference_steps {steps} is out of range: stage {name!r} accepts 1 to "
                    f"{self.max_inference_steps} (max_inference_steps)"
                )
        for key in ("sigmas", "timesteps"):  # a schedule given as a list runs one step per entry
            if params.get(key) is not None:
                params[key] = self._schedule(params[key], key)
        n = _int(n, "n")
        if not 1 <= n <= self.max_batch_size:
            raise InvalidRequest(
                f"n {n} is out of range: stage {name!r} makes 1 to {self.max_batch_size} images per request "
                "(max_batch_size)"
            )
        if seed is None:
            seed = secrets.randbits(63)
        seed = _int(seed, "seed")
        if not 0 <= seed < 2**63:
            raise InvalidRequest(f"seed {seed} is out of range; use 0 to {2**63 - 1}")

        if picture is not None and not self._takes_size:
            picture = picture.resize((width, height))
            del params["height"], params["width"]
        data = {k: v for k, v in request.data.items() if v is not None and k not in ("negative_prompt", "image")}
        embeds = {k: v for k, v in data.items() if k in self._embed_params}
        if embeds and picture is not None:
            raise InvalidRequest(f"stage {name!r} takes an image with a text prompt, not with embeddings")
        if embeds:
            extra = sorted(set(data) - set(embeds))
            if extra or negative is not None:
                raise InvalidRequest(
                    f"stage {name!r} takes either text or embeddings, not both; got {sorted(request.data)}"
                )
            job = self._embeds_job(request.request_id, params, embeds, n, seed)
            job.fps, job.step_cache = fps, step_cache
            job.key += repr(step_cache)
            return job
        if not isinstance(data.get("prompt"), str) or not data["prompt"].strip():
            raise InvalidRequest(
                f"stage {name!r} needs a non-empty 'prompt' string or prompt embeddings "
                f"({sorted(self._embed_params)}); got {sorted(request.data)}"
            )
        extra = sorted(set(data) - {"prompt"})
        if extra:
            raise InvalidRequest(f"stage {name!r} does not take {extra}; send prompt and negative_prompt")
        if negative is not None and not isinstance(negative, str):
            raise InvalidRequest(f"negative_prompt must be a string, not {type(negative).__name__}")
        size = None if picture is None else picture.size
        key = repr(("text", sorted(params.items()), n, negative is not None, size, step_cache))
        if picture is not None and self.video:  # video pipelines take one conditioning image per call
            key += request.request_id
        return _Job(
            request.request_id,
            "text",
            key,
            params,
            n,
            seed,
            data["prompt"],
            negative,
            image=picture,
            fps=fps,
            step_cache=step_cache,
        )

    def _schedule(self, value: Any, key: str) -> list[float]:
        """A custom `sigmas` / `timesteps` list: it sets the number of steps, so the step bound applies."""
        name = self.stage.name
        if not isinstance(value, list | tuple):
            raise InvalidRequest(f"{key} must be a list of numbers, one per denoising step, not {type(value).__name__}")
        if not 1 <= len(value) <= self.max_inference_steps:
            raise InvalidRequest(
                f"{key} has {len(value)} entries, one denoising step each; stage {name!r} runs 1 to "
                f"{self.max_inference_steps} steps (max_inference_steps); send a shorter schedule"
            )
        if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in value):
            raise InvalidRequest(f"{key} must hold finite numbers only")
        return [float(v) for v in value]

    def _input_image(self, raw: Any) -> Any:
        """The request's input image as an RGB PIL image; None when it has none and needs none."""
        name = self.stage.name
        if raw is None:
            if Modality.IMAGE in self.stage.input_modalities and self._takes_image:
                raise InvalidRequest(
                    f"stage {name!r} edits an image and got none; send it as the multipart 'image' file "
                    "of /v1/images/edits"
                )
            return None
        if not self._takes_image:
            raise InvalidRequest(f"stage {name!r} takes no image input; send only a prompt")
        if not isinstance(raw, bytes | bytearray | memoryview):
            raise InvalidRequest(f"image must be the bytes of a PNG, JPEG or WebP file, not {type(raw).__name__}")
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(bytes(raw))) as opened:
                if opened.width * opened.height > self.max_pixels * 4:
                    raise InvalidRequest(
                        f"the input image is {opened.width}x{opened.height}; stage {name!r} reads at most "
                        f"{self.max_pixels * 4} pixels (4x max_pixels); send a smaller image"
                    )
                return opened.convert("RGB")
        except (UnidentifiedImageError, Image.DecompressionBombError, OSError) as err:
            raise InvalidRequest(f"the input image could not be read ({err}); send a PNG, JPEG or WebP file") from None

    def _embeds_job(self, rid: str, params: dict, embeds: dict, n: int, seed: int) -> _Job:
        import torch

        tensors = {}
        for key, value in embeds.items():
            tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
            if tensor.dim() < 2 or tensor.shape[0] != 1:
                raise InvalidRequest(
                    f"{key} has shape {tuple(tensor.shape)}; a request carries one prompt, so its leading "
                    "(batch) axis must be 1, e.g. (1, tokens, dim) or (1, dim)"
                )
            tensors[key] = tensor
        if not any(k in tensors for k in ("prompt_embeds", "pooled_prompt_embeds")):
            raise InvalidRequest(f"embedding input needs prompt_embeds; got {sorted(tensors)}")
        shapes = sorted((k, tuple(t.shape), str(t.dtype)) for k, t in tensors.items())
        key = repr(("embeds", sorted(params.items()), n, shapes))
        return _Job(rid, "embeds", key, params, n, seed, embeds=tensors)

    async def generate(self, request: EngineInput) -> AsyncIterator[EngineOutput]:
        if self.failure is not None:
            raise self.failure
        if self.pipe is None or self._arrived is None:
            raise EngineError(f"stage {self.stage.name!r} is not started")
        job = self._parse(request)
        loop = asyncio.get_running_loop()
        job.arrival = loop.time()
        job.future = loop.create_future()
        if self.video:
            job.progressed = asyncio.Event()
        self._pending.append(job)
        self._arrived.set()
        try:
            reported = 0
            while job.progressed is not None and not job.future.done():
                progressed = asyncio.ensure_future(job.progressed.wait())
                try:
                    await asyncio.wait([job.future, progressed], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    progressed.cancel()
                job.progressed.clear()
                if job.steps_done > reported and not job.future.done():
                    reported = job.steps_done
                    progress = {"steps_done": job.steps_done, "steps": job.steps}
                    yield EngineOutput(request.request_id, {"progress": progress})
            result = await job.future
        finally:
            if job in self._pending:  # the consumer went away while the request waited
                self._pending.remove(job)
            job.aborted = job.aborted or not job.future.done()
        if result is None:
            yield EngineOutput(request.request_id, {}, finished=True, finish_reason="abort")
            return
        yield EngineOutput(request.request_id, result, finished=True, finish_reason="stop")

    async def abort(self, request_id: str) -> None:
        """Drop a queued request; a running one's result is discarded, and its pipeline call stops between
        two denoising steps once every request of the batch is aborted."""
        for job in list(self._pending):
            if job.request_id == request_id:
                self._pending.remove(job)
                if job.future is not None and not job.future.done():
                    job.future.set_result(None)
        for job in self._running:
            if job.request_id == request_id:
                job.aborted = True

    def stats(self) -> dict[str, float]:
        return {
            "queue_depth": float(len(self._pending)),
            "running_batch": float(len(self._running)),
            # The backlog an autoscaler reads: denoising steps still to run for the requests waiting or
            # running (a running one less the steps its step callback reported done).
            "denoising_steps_queued": float(
                sum(_steps(j.call, self._default_steps) for j in self._pending)
                + sum(max(0, _steps(j.call, self._default_steps) - j.steps_done) for j in self._running)
            ),
            **self._stats,
            **self.accel.stats(),
        }

    # -- batching ----------------------------------------------------------------------------------

    async def _loop(self) -> None:
        assert self._arrived is not None
        loop = asyncio.get_running_loop()
        while True:
            while not self._pending:
                self._arrived.clear()
                await self._arrived.wait()
            first = self._pending[0]
            deadline = first.arrival + self.batch_window
            while self._pending and self._pending[0] is first and loop.time() < deadline:
                if sum(j.n for j in self._pending if j.key == first.key) >= self.max_batch_size:
                    break
                self._arrived.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._arrived.wait(), deadline - loop.time())
            if not self._pending or self._pending[0] is not first:
                continue  # the oldest request was aborted while we gathered
            batch, images = [], 0
            for job in list(self._pending):
                if job.key == first.key and images + job.n <= self.max_batch_size:
                    batch.append(job)
                    images += job.n
                    self._pending.remove(job)
            await self._run_batch(batch)

    async def _run_batch(self, batch: list[_Job]) -> None:
        self._running = batch
        started = time.monotonic()
        self._current = asyncio.ensure_future(asyncio.to_thread(self._call, batch))
        try:
            results = await asyncio.shield(self._current)
        except _Interrupted:
            log.info("stage %s: stopped a pipeline call: every request of it was aborted", self.stage.name)
            self.batch_log.append([j.request_id for j in batch])
            for job in batch:
                if job.future is not None and not job.future.done():
                    job.future.set_result(None)
            return
        except Exception as exc:
            ids = [j.request_id for j in batch]
            log.exception("stage %s: pipeline call failed for %s", self.stage.name, ids)
            error = (
                exc
                if isinstance(exc, P.RankDied)
                else EngineError(f"stage {self.stage.name!r}: the diffusion pipeline failed: {exc}")
            )
            for job in batch:
                if job.future is not None and not job.future.done():
                    job.future.set_exception(error)
            return
        finally:
            self._current = None
            self._running = []
        seconds = time.monotonic() - started
        steps = _steps(batch[0].call, self._default_steps)
        self._stats.update(
            last_batch_size=float(len(batch)),
            last_batch_images=float(sum(j.n for j in batch)),
            last_batch_seconds=seconds,
            last_step_seconds=seconds / steps,
            batches_total=self._stats["batches_total"] + 1,
        )
        self.batch_log.append([j.request_id for j in batch])
        # Encode this batch's PNGs on another thread while the next batch runs on the device: the
        # accelerator never waits for CPU-side encoding. One batch encodes at a time (bounded memory).
        if self._encoding is not None:
            await asyncio.shield(self._encoding)
        self._encoding = asyncio.ensure_future(self._deliver(batch, results))

    async def _deliver(self, batch: list[_Job], results: list[dict[str, Any]]) -> None:
        try:
            assert self._encoder is not None, "started engines have an encoder"
            encoded = await _encode_results(results, self._encoder)
        except Exception as exc:
            error = EngineError(f"stage {self.stage.name!r}: encoding the images failed: {exc}")
            for job in batch:
                if job.future is not None and not job.future.done():
                    job.future.set_exception(error)
            return
        for job, result in zip(batch, encoded, strict=True):
            if job.future is not None and not job.future.done():
                job.future.set_result(None if job.aborted else result)

    def _call(self, batch: list[_Job]) -> list[dict[str, Any]]:
        """One pipeline call for `batch` (in a worker thread); one output payload per job."""
        import torch

        first = batch[0]
        n = first.n
        kwargs: dict[str, Any] = dict(first.call)
        kwargs["num_videos_per_prompt" if self.video else "num_images_per_prompt"] = n
        # One CPU generator per request, reused for its n images: they depend on its seed alone, and
        # CPU generators give the same noise whatever the device.
        generators = []
        for job in batch:
            generators.extend([torch.Generator("cpu").manual_seed(job.seed)] * n)
        kwargs["generator"] = generators
        kwargs["output_type"] = "latent" if self.latent_output else "np" if self.video else "pil"
        if self._on_step:
            kwargs["callback_on_step_end"] = self._step_callback(batch)
        if first.kind == "text":
            kwargs["prompt"] = [j.prompt for j in batch]
            if first.image is not None:
                kwargs["image"] = first.image if self.video else [j.image for j in batch]
            if first.negative_prompt is not None:
                kwargs["negative_prompt"] = [j.negative_prompt for j in batch]
        else:
            dtype = self.pipe.dtype
            for key in first.embeds:
                kwargs[key] = torch.cat([j.embeds[key] for j in batch]).to(self.device, dtype)
        with torch.inference_mode(), self.accel.call(first.step_cache):
            result = self.pipe(**kwargs)
        images = result.frames if self.video else result.images
        out = []
        for i, job in enumerate(batch):
            mine = images[i * n : (i + 1) * n]
            if self.video and not self.latent_output:
                out.append({"frames": list(mine), "fps": job.fps})  # _encode_results makes MP4s
            elif self.latent_output:
                out.append({"latents": mine.detach().to("cpu")})
            else:
                out.append({"images": list(mine)})  # PIL images; _encode_results makes PNGs
        return out

    def _step_callback(self, batch: list[_Job]) -> Any:
        """`callback_on_step_end` for one call: step time, video progress, and the stop once all are aborted."""
        steps = batch[0].call.get("num_inference_steps") or 0
        schedule = batch[0].call.get("sigmas") or batch[0].call.get("timesteps")
        steps = len(schedule) if schedule else steps
        labels = (self.pipeline.name, self.stage.name)
        last = [time.monotonic()]

        def on_step(_pipe: Any, index: int, _timestep: Any, _tensors: dict[str, Any]) -> dict[str, Any]:
            now = time.monotonic()
            StageMetrics.denoise_step.labels(*labels).observe(now - last[0])
            last[0] = now
            for job in batch:
                job.steps_done, job.steps = index + 1, int(steps)
                if job.progressed is not None and self._event_loop is not None:
                    self._event_loop.call_soon_threadsafe(job.progressed.set)
            if all(job.aborted for job in batch):
                raise _Interrupted
            return {}

        return on_step


def device_dtype(
    device: str, dtype: Any, *, cpu_bf16: bool | None = None, cpu_fp16: bool | None = None
) -> tuple[Any, str]:
    """The dtype a stage runs in on `device` when asked for `dtype`, and why it differs ("" when it does not).

    The rule: on a CPU, bfloat16 (float16) is kept only when oneDNN has fast kernels for it there
    (AVX512-BF16 / AMX, resp. AVX512-FP16); otherwise float32, which every CPU runs. On CUDA, bfloat16 on a
    GPU without it (before Ampere) becomes float16. `cpu_bf16` / `cpu_fp16` override the detection (tests).
    """
    import torch

    if device == "cpu" and dtype in (torch.bfloat16, torch.float16):
        mkldnn = torch.ops.mkldnn
        if dtype == torch.bfloat16:
            fast = cpu_bf16 if cpu_bf16 is not None else bool(mkldnn._is_mkldnn_bf16_supported())
        else:
            fast = cpu_fp16 if cpu_fp16 is not None else bool(mkldnn._is_mkldnn_fp16_supported())
        if not fast:
            return (
                torch.float32,
                f"this CPU has no fast {str(dtype).removeprefix('torch.')} kernels; float32 runs everywhere",
            )
    if str(device).startswith("cuda") and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return torch.float16, "this GPU has no bfloat16 (it needs compute capability 8.0 or newer)"
    return dtype, ""


def encode_workers() -> int:
    """Threads that encode a stage's PNGs and MP4s (both release the GIL): a batch's images, and the pieces of
    each, encode on every core this process may use but one, which stays with the thread that drives the device
    (the next batch runs while this one encodes)."""
    return max(1, min(len(os.sched_getaffinity(0)) - 1, 16))


async def _encode_results(results: list[dict[str, Any]], pool: concurrent.futures.Executor) -> list[dict[str, Any]]:
    """PIL images -> PNG bytes, every image of the batch at once, each on several of `pool`'s threads (see
    `png`); latent results pass through."""
    loop = asyncio.get_running_loop()
    pngs = [  # tasks: every image starts now, not when its result's turn comes below
        [asyncio.ensure_future(PNG.encode(img, pool, PNG_COMPRESS_LEVEL)) for img in r["images"]]
        if "images" in r
        else None
        for r in results
    ]
    mp4s = [
        [loop.run_in_executor(pool, V.encode_mp4, f, r["fps"]) for f in r["frames"]] if "frames" in r else None
        for r in results
    ]
    out = []
    for r, p, m in zip(results, pngs, mp4s, strict=True):
        if m is not None:
            videos = list(await asyncio.gather(*m))
            out.append(videos[0] if len(videos) == 1 else {"videos": videos})
        else:
            out.append(r if p is None else {"images": list(await asyncio.gather(*p))})
    return out


PNG_COMPRESS_LEVEL = 1
"""zlib level of the PNGs a stage returns (the encode is on every image's critical path; with the run-length
strategy `png` uses, a higher level buys almost nothing)."""


def _int(value: Any, label: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise InvalidRequest(f"{label} must be an integer, not {value!r}")
    return int(value)


def _size_multiple(pipe: Any) -> int:
    """What height and width must be multiples of: the VAE scale factor x the DiT's patch size.

    Flux- and QwenImage-style pipelines pack 2x2 latent patches, whatever the transformer config says.
    """
    vae = int(getattr(pipe, "vae_scale_factor", None) or getattr(pipe, "vae_scale_factor_spatial", 8) or 8)
    patch = getattr(pipe, "patch_size", None)
    if patch is None:
        transformer = getattr(pipe, "transformer", None)
        patch = getattr(getattr(transformer, "config", None), "patch_size", None) or 1
    if isinstance(patch, list | tuple):  # video DiTs patch (frames, height, width)
        patch = patch[-1]
    if type(pipe).__name__.startswith(("Flux", "QwenImage")):
        patch = 2
    return vae * int(patch)


def _default_size(pipe: Any) -> int:
    """The pipeline's own default edge in pixels (sample size x VAE scale factor)."""
    vae = int(getattr(pipe, "vae_scale_factor", 8) or 8)
    sample = getattr(pipe, "default_sample_size", None)
    if sample is None:
        denoiser = getattr(pipe, "unet", None) or getattr(pipe, "transformer", None)
        sample = getattr(getattr(denoiser, "config", None), "sample_size", None) or 64
    if isinstance(sample, (list, tuple)):
        sample = sample[0]
    return int(sample) * vae
