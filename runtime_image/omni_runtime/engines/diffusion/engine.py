"""The `diffusion` engine: a diffusers pipeline loaded from a local folder, with request batching.

Requests that arrive within `batch_window_ms` of the oldest waiting one and agree on everything
that a pipeline call shares (input kind, size, steps, guidance, images per prompt, whether a negative
prompt is given, embedding shapes) run as ONE pipeline call, up to `max_batch_size` images. Each
request gets its own CPU `torch.Generator` seeded with its seed, so its image depends only on its
own seed and not on what it was batched with (beyond float rounding). Requests that do not fit run
in a later call. One call runs at a time, in a worker thread, so the event loop stays responsive.

Engine args: `spec.engine_args.DiffusionArgs` says each key, its default and bounds (`torch_dtype`, `device`,
`batch_window_ms`, `max_batch_size`, `max_pixels`, `max_inference_steps`, `sequence_parallel`, and the video and
speed keys below); the engine reads that model, and the keys it leaves as extras go to
`DiffusionPipeline.from_pretrained`.

Input (`EngineInput.data`): `{"prompt": str, "negative_prompt": str | None}`, or embeddings named as
the pipeline's `__call__` names them (`prompt_embeds`, `pooled_prompt_embeds`, `negative_*`...), each
with a leading batch axis of 1. Params: the pipeline's scalar call arguments (`height`, `width`,
`num_inference_steps`, `guidance_scale`, ...) plus `seed` and `n` (images for this request).
Output: `{"images": [png bytes, ...]}`; a stage whose `output_modality` is `hidden` gives
a `processors.payloads.LatentsOutput`, `{"latents": tensor (n, C, h, w)}`, instead (for a separate VAE
stage, see `dit_to_vae`).

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

This module loads the pipeline, runs its self-check, makes each pipeline call and its step callback; beside it
are `request` (request parsing), `batcher` (the keyed batcher), `png` (the encode pool), `video`, `accel` (speed
options), `parallel` and `parallel_plan` (sequence parallelism).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from omni_runtime.engines.base import Engine, EngineError, EngineInput, EngineOutput, InvalidRequest
from omni_runtime.engines.common import (
    default_device,
    named_dtype,
    one_build_at_a_time,
    release_device_memory,
    stage_model_path,
    typed_engine_args,
)
from omni_runtime.engines.diffusion import parallel as P
from omni_runtime.engines.diffusion import parallel_plan
from omni_runtime.engines.diffusion import png as PNG
from omni_runtime.engines.diffusion import video as V
from omni_runtime.engines.diffusion.accel import Accel
from omni_runtime.engines.diffusion.batcher import Batcher, Interrupted
from omni_runtime.engines.diffusion.request import Job, RequestRules, default_size, parse, size_multiple
from omni_runtime.metrics import Stage as StageMetrics
from omni_runtime.processors.payloads import LatentsOutput, as_payload
from omni_runtime.spec import Modality, ResolvedPipeline, StageSpec
from omni_runtime.spec.engine_args import DiffusionArgs

__all__ = ["DiffusionEngine", "device_dtype"]

log = logging.getLogger(__name__)


UPSTREAM_CALL_ARGS = frozenset({"prior_token_ids", "prior_token_image_ids", "source_image_grid_thw"})
"""Call arguments only an upstream stage supplies, in its payload (GLM-Image's AR tokens, `glm_ar_to_dit`)."""


def _on_device(values: dict[str, Any], device: str) -> dict[str, Any]:
    """Upstream call arguments with their tensors (alone or in lists) moved to `device`."""
    import torch

    def move(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(device)
        if isinstance(value, list):
            return [move(v) for v in value]
        return value

    return {k: move(v) for k, v in values.items()}


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


class DiffusionEngine(Engine):
    """A diffusion stage on a diffusers pipeline, batching compatible requests.

    `stats()`: `queue_depth`, `running_batch`, `denoising_steps_queued`, `last_batch_size` (requests),
    `last_batch_images`, `last_batch_seconds`, `last_step_seconds`, `batches_total`. `batch_log` keeps
    the request ids of the last 100 pipeline calls (the batcher's).
    """

    worker_state: tuple[str, ...] = ()
    """Instance attributes a subclass sets after construction that its sequence-parallel worker ranks need too
    (they build their own engine from the class, the pipeline and the stage)."""

    def __init__(self, pipeline: ResolvedPipeline, stage: StageSpec) -> None:
        super().__init__(pipeline, stage)
        self.model_path = str(stage_model_path(pipeline, stage))
        self.args = typed_engine_args(stage, DiffusionArgs)
        """The stage's engine args (InvalidEngineArgs at construction when they are wrong)."""
        self.max_batch_size = self.args.max_batch_size
        self.max_pixels = self.args.max_pixels
        self.max_inference_steps = self.args.max_inference_steps
        self._load_kwargs = dict(self.args.model_extra or {})
        """diffusers' `from_pretrained` keyword arguments: the keys that are not omnikube's."""
        self.accel = Accel(stage.name, self.args)
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
        self._takes_image = False
        self._takes_size = True
        self._rules: RequestRules | None = None
        """What a request may ask of the loaded pipeline (set once loaded)."""
        self._encoder: concurrent.futures.ThreadPoolExecutor | None = None
        batch_window = self.args.batch_window_ms / 1000.0
        self.batcher = Batcher(stage.name, self._call, self._encode, batch_window, self.max_batch_size)
        self.batch_log = self.batcher.batch_log

    @property
    def batch_window(self) -> float:
        """Seconds the oldest waiting request waits for company (engine arg `batch_window_ms`; the batcher's)."""
        return self.batcher.window

    @batch_window.setter
    def batch_window(self, seconds: float) -> None:
        self.batcher.window = seconds

    # -- loading -----------------------------------------------------------------------------------

    async def start(self) -> None:
        import torch

        self.device = default_device(self.args.device)
        dtype_name = self.args.torch_dtype or ("float32" if self.device == "cpu" else "bfloat16")
        dtype = named_dtype(self.stage.name, str(dtype_name), "use float32, bfloat16 or float16")
        self.accel.check_device(self.device)
        fitting, why = device_dtype(self.device, dtype)
        if fitting != dtype:
            log.warning("stage %s: torch_dtype %s -> %s: %s", self.stage.name, dtype_name, fitting, why)
        self.sequence_parallel = parallel_plan.resolve_degree(
            self.stage.name, self.args.sequence_parallel, self.device, self.model_path
        )
        auto = self.args.sequence_parallel in (None, "auto")
        if self.sequence_parallel > 1 and self.accel.step_cache and auto:
            log.info("stage %s: one GPU: the step cache is on, and it cannot run split", self.stage.name)
            self.sequence_parallel = 1
        if self.sequence_parallel > 1 and self.accel.settings.cuda_graphs and auto:
            log.info("stage %s: one GPU: cuda_graphs is on, and it cannot run split", self.stage.name)
            self.sequence_parallel = 1  # an explicit sequence_parallel with cuda_graphs fails in Accel.apply
        if self.sequence_parallel > 1 and self.accel.step_cache:
            raise EngineError(
                f"stage {self.stage.name!r}: a step cache (step_cache_threshold or step_cache) and "
                f"{parallel_plan.ARG}={self.sequence_parallel} cannot "
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
            self.pipe = await asyncio.to_thread(one_build_at_a_time(self._load), dtype)
        except Exception as exc:  # diffusers raises many types while loading; the message matters
            raise EngineError(f"stage {self.stage.name!r}: diffusers failed to load {self.model_path}: {exc}") from exc
        group = self._group
        parallel = None
        if group is not None:
            world, device = group.world, self.device

            def parallel(pipe: Any) -> None:
                parallel_plan.enable_context_parallel(self.stage.name, pipe, world, device)

        await asyncio.to_thread(self.accel.apply, self.pipe, self.device, parallel)
        self._encoder = concurrent.futures.ThreadPoolExecutor(PNG.encode_workers(), thread_name_prefix="omnikube-png")
        params = inspect.signature(self.pipe.__call__).parameters
        embed_params = frozenset(
            p for p in params if ("embeds" in p or p.endswith("_mask")) and not p.startswith("ip_adapter")
        )
        upstream_params = frozenset(p for p in params if p in UPSTREAM_CALL_ARGS)
        call_params = frozenset(
            p
            for p in params
            if p not in _CALL_ARGS_OWNED
            and p not in embed_params
            and p not in upstream_params
            and not p.startswith(("prompt", "negative_prompt", "ip_adapter"))
            and p not in ("self", "image", "mask_image")
        )
        self._takes_image = "image" in params
        self.video = V.is_video_pipeline(call_params)
        self._temporal = V.temporal_factor(self.pipe) if self.video else 1
        self._on_step = "callback_on_step_end" in params
        self._event_loop = asyncio.get_running_loop()
        # The steps a request without num_inference_steps runs: the pipeline's own default.
        default_steps = params["num_inference_steps"].default if "num_inference_steps" in params else 1
        self.batcher.default_steps = default_steps if isinstance(default_steps, int) else 1
        self._takes_size = "height" in params and "width" in params
        self.size_multiple = size_multiple(self.pipe)
        self.default_size = default_size(self.pipe)
        self._rules = RequestRules(
            stage=self.stage,
            call_params=call_params,
            embed_params=embed_params,
            upstream_params=upstream_params,
            takes_image=self._takes_image,
            takes_size=self._takes_size,
            video=self.video,
            temporal=self._temporal,
            video_args=self.args,
            size_multiple=self.size_multiple,
            default_size=self.default_size,
            max_pixels=self.max_pixels,
            max_inference_steps=self.max_inference_steps,
            max_batch_size=self.max_batch_size,
        )
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
        self.batcher.start()

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

            data["image"] = PNG.encode_pillow(Image.new("RGB", (edge, edge), "gray"), PNG.PNG_COMPRESS_LEVEL)
        job = self._parse(EngineInput("omnikube-self-check", data, params))
        started = time.monotonic()
        results = await asyncio.to_thread(self._call, [job])
        await self._encode(results)
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
        self.batcher.fail(error, RUNNING_GRACE_S)

    async def stop(self) -> None:
        """Fail queued requests, let a running call finish, and release the pipeline."""
        # A dead engine's call may never end (a collective on a dead rank): it gets a bounded wait.
        await self.batcher.stop(RUNNING_GRACE_S if self.failure is not None else None)
        encoder, self._encoder = self._encoder, None
        if encoder is not None:
            encoder.shutdown(wait=True)
        group, self._group = self._group, None
        if group is not None:
            await asyncio.to_thread(group.close)
        pipe, self.pipe = self.pipe, None
        if pipe is not None:
            del pipe
            release_device_memory()

    # -- requests ----------------------------------------------------------------------------------

    def _parse(self, request: EngineInput) -> Job:
        """The request as a job for the batcher (InvalidRequest when the pipeline or the stage refuses it)."""
        assert self._rules is not None, "a loaded pipeline has its request rules"
        return parse(request, self._rules)

    async def generate(self, request: EngineInput) -> AsyncIterator[EngineOutput]:
        if self.failure is not None:
            raise self.failure
        if self.pipe is None or not self.batcher.started:
            raise EngineError(f"stage {self.stage.name!r} is not started")
        job = self._parse(request)
        loop = asyncio.get_running_loop()
        job.arrival = loop.time()
        job.future = loop.create_future()
        if self.video:
            job.progressed = asyncio.Event()
        self.batcher.submit(job)
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
            self.batcher.withdraw(job)  # the consumer went away while the request waited
            job.aborted = job.aborted or not job.future.done()
        if result is None:
            yield EngineOutput(request.request_id, {}, finished=True, finish_reason="abort")
            return
        yield EngineOutput(request.request_id, result, finished=True, finish_reason="stop")

    async def abort(self, request_id: str) -> None:
        """Drop a queued request; a running one's result is discarded, and its pipeline call stops between
        two denoising steps once every request of the batch is aborted."""
        self.batcher.abort(request_id)

    def stats(self) -> dict[str, float]:
        return {
            "queue_depth": float(len(self.batcher.pending)),
            "running_batch": float(len(self.batcher.running)),
            "denoising_steps_queued": self.batcher.steps_queued(),
            **self.batcher.stats,
            **self.accel.stats(),
        }

    # -- the call ----------------------------------------------------------------------------------

    async def _encode(self, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A call's outputs as the stage returns them: PNGs and MP4s on the encode pool (`png`)."""
        assert self._encoder is not None, "started engines have an encoder"
        return await PNG.encode_results(results, self._encoder)

    def _call(self, batch: list[Job]) -> list[dict[str, Any]]:
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
            kwargs.update(_on_device(first.upstream, self.device))  # a job with these runs alone
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
                out.append({"frames": list(mine), "fps": job.fps})  # _encode makes MP4s
            elif self.latent_output:
                out.append(as_payload(LatentsOutput(latents=mine.detach().to("cpu"))))
            else:
                out.append({"images": list(mine)})  # PIL images; _encode makes PNGs
        return out

    def _step_callback(self, batch: list[Job]) -> Any:
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
                raise Interrupted
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
