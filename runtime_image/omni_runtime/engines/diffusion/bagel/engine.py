"""`BagelEngine`: the `dit` stage of the `bagel` topology (a diffusion stage with `runner: bagel`).

Its input is `BagelContexts` (`processors.kv_cache`, made by the edge processor `ar_kv_to_bagel`): the thinker's KV
cache of the primary context and of each CFG companion it ran, by role. Every payload is checked against this
stage's own checkpoint (`check_kv_payload`: payload version, layers, KV heads, head size, dtype, fingerprint) before
it costs anything, so a thinker of another checkpoint or version is refused with both sides named. The guidance
(`spec.guidance.BagelGuidance`, from the request's parameters over the stage's defaults) says which roles are read;
one that is needed and absent fails the request naming the role (`MissingContext`): a companion lost on the way
never becomes an unguided image. A text-to-image request's image guidance reads the primary context, as upstream
(its cfg_img context is the primary's).

An image edit comes straight from the router (`router.plan.plan_edit`): `{"prompt", "image"}` and no contexts. The
dit builds the three contexts itself (`edit`: the picture through the VAE and the ViT, then the prompt), with
upstream's edit guidance under the request's (`EDIT_GUIDANCE`), and draws at the picture's size as BAGEL resizes
it.

Requests run one at a time in a worker thread (a BAGEL image is one long sequence per step; batching would pad
contexts of different lengths), and an abort stops the loop between two denoising steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from omni_runtime.engines.base import (
    SELF_CHECK_ID,
    Engine,
    EngineError,
    EngineInput,
    EngineOutput,
    InvalidRequest,
)
from omni_runtime.engines.common import (
    default_device,
    named_dtype,
    one_build_at_a_time,
    stage_model_path,
    typed_engine_args,
)
from omni_runtime.engines.diffusion import png as PNG
from omni_runtime.engines.diffusion.bagel.context import KvContext
from omni_runtime.engines.diffusion.bagel.generate import BagelGenerator, MissingContext
from omni_runtime.metrics import Stage as StageMetrics
from omni_runtime.processors.kv_cache import (
    KvExpectation,
    KvPayloadMismatch,
    check_kv_payload,
    kv_expectation,
)
from omni_runtime.spec import ResolvedPipeline, StageSpec
from omni_runtime.spec.engine_args import BagelArgs
from omni_runtime.spec.guidance import BagelGuidance
from omni_runtime.spec.image_bounds import ImageSizeBounds

__all__ = ["BagelEngine", "Interrupted"]

log = logging.getLogger(__name__)

_REQUEST_KEYS = frozenset({"height", "width", "seed", "n", "num_inference_steps", *BagelGuidance.model_fields})
"""What a request may set; anything else is refused (a field accepted and ignored is a defect)."""

EDIT_GUIDANCE: dict[str, Any] = {
    "cfg_text_scale": 4.0,
    "cfg_img_scale": 2.0,
    "cfg_interval": (0.0, 1.0),
    "cfg_renorm_type": "text_channel",
    "cfg_renorm_min": 0.0,
    "timestep_shift": 3.0,
}
"""An edit's guidance before the request's own: upstream app.py's edit tab (the stage's sampling_params hold the
text-to-image defaults)."""
MAX_INPUT_PIXELS = 4096 * 4096
"""The largest input picture an edit decodes (BAGEL resizes it to at most 1024 px a side anyway)."""


class Interrupted(Exception):
    """Raised inside the denoising loop of an aborted request (between two steps)."""


def _tokenizer(path: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _picture(raw: Any, stage: str) -> Any:
    """An edit's input picture, decoded (PIL RGB); InvalidRequest when it is missing, not an image, or larger than
    `MAX_INPUT_PIXELS` (checked from its header, before it is decoded)."""
    import io

    from PIL import Image, UnidentifiedImageError

    if not isinstance(raw, bytes | bytearray) or not raw:
        raise InvalidRequest(f"stage {stage!r}: an edit needs one input image (PNG, JPEG or WebP bytes)")
    try:
        with Image.open(io.BytesIO(bytes(raw))) as opened:
            if opened.width * opened.height > MAX_INPUT_PIXELS:
                raise InvalidRequest(
                    f"the input image is {opened.width}x{opened.height}; stage {stage!r} reads at most "
                    f"{MAX_INPUT_PIXELS} pixels; send a smaller one"
                )
            return opened.convert("RGB")
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as err:
        raise InvalidRequest(f"the input image could not be read ({err}); send a PNG, JPEG or WebP") from None


class BagelEngine(Engine):
    """BAGEL's generation expert over the thinker's KV caches. `stats()`: `running`, `last_image_seconds`."""

    def __init__(self, pipeline: ResolvedPipeline, stage: StageSpec) -> None:
        super().__init__(pipeline, stage)
        self.model_path = stage_model_path(pipeline, stage)
        self.args = typed_engine_args(stage, BagelArgs)
        self.generator: BagelGenerator | None = None
        self.tokenizer: Any = None
        """The checkpoint's tokenizer: an edit's prompt is tokenized here (no thinker takes part in an edit)."""
        self.expected: KvExpectation | None = None
        self.device = "cpu"
        self._lock = asyncio.Lock()  # one image at a time (see the module docstring)
        self._aborted: set[str] = set()
        """Requests aborted while they wait or run (the worker thread reads it between two steps)."""
        self._live: set[str] = set()
        """Requests inside `generate`: only those can be aborted (an unknown id is ignored)."""
        self._running: str | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._stats = {"last_image_seconds": 0.0, "images_total": 0.0}
        self.forwards_log: list[dict[str, int]] = []
        """Velocity forwards per role of the last 100 images (a companion at scale 1 runs none)."""

    # -- loading -----------------------------------------------------------------------------------

    async def start(self) -> None:
        self.device = default_device(self.args.device)
        name = self.args.torch_dtype or ("float32" if self.device == "cpu" else "bfloat16")
        dtype = named_dtype(self.stage.name, str(name), "use float32 or bfloat16")
        started = time.monotonic()
        try:
            self.generator = await asyncio.to_thread(
                one_build_at_a_time(BagelGenerator.from_pretrained), self.model_path, dtype, self.device
            )
            self.expected = await asyncio.to_thread(self._kv_expectation)
            self.tokenizer = await asyncio.to_thread(_tokenizer, self.model_path)
        except (OSError, ValueError, KeyError) as exc:
            raise EngineError(
                f"stage {self.stage.name!r}: could not load BAGEL's generation path from {self.model_path}: {exc}; "
                "the folder must hold a BAGEL checkpoint (config.json with llm_config, ema.safetensors, "
                "ae.safetensors)"
            ) from exc
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"bagel-{self.stage.name}")
        await self._self_check()
        log.info("stage %s: BAGEL generation loaded in %.1fs", self.stage.name, time.monotonic() - started)

    def _kv_expectation(self) -> KvExpectation:
        """What the thinker's payloads must match: this checkpoint's config.json at the thinker's KV dtype (engine
        arg `kv_dtype`, else the checkpoint's torch_dtype)."""
        config = json.loads((self.model_path / "config.json").read_text(encoding="utf-8"))
        llm = config.get("llm_config") or {}
        dtype = self.args.kv_dtype or next(
            (str(c[k]) for c in (config, llm) for k in ("torch_dtype", "dtype") if c.get(k)), "bfloat16"
        )
        return kv_expectation(config, dtype=dtype.removeprefix("torch."))

    async def _self_check(self) -> None:
        """One step of the smallest image over a context this engine prefills itself (the same framing as the
        thinker's): the generation expert, the sampler, the VAE and the PNG encode, before the stage is ready."""
        assert self.generator is not None
        gen = self.generator
        context = await asyncio.to_thread(gen.prefill, gen.frame_text([gen.weights.tokens.vision_start]))
        size = gen.config.latent_downsample
        request = EngineInput(SELF_CHECK_ID, {}, {"height": size, "width": size, "num_inference_steps": 1})
        await self._self_check_run(request, {"primary": context, "cfg_text": context})

    async def _self_check_run(self, request: EngineInput, contexts: Mapping[str, KvContext]) -> None:
        try:
            call, guidance = self._parse(request)
            outs = [out async for out in self._generate(request.request_id, contexts, call, guidance)]
        except Exception as exc:
            raise EngineError(
                f"stage {self.stage.name!r}: the self-check (one denoising step of the smallest image) failed, so "
                f"every request would fail: {type(exc).__name__}: {exc}; check the checkpoint folder and the "
                "stage's torch_dtype"
            ) from exc
        if not outs or not outs[-1].finished:
            raise EngineError(f"stage {self.stage.name!r}: the self-check ended without an image")

    async def stop(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self.generator = None

    # -- requests ----------------------------------------------------------------------------------

    def _parse(self, request: EngineInput, *, with_stage_defaults: bool = True) -> tuple[dict[str, Any], BagelGuidance]:
        """The request's size, steps and seed, and its guidance (the stage's defaults under the request's, unless
        `with_stage_defaults` is False: the caller merged them); InvalidRequest naming the field at fault."""
        assert self.generator is not None
        params = {**(self.stage.sampling_params if with_stage_defaults else {}), **request.params}
        unknown = sorted(set(params) - _REQUEST_KEYS)
        if unknown:
            raise InvalidRequest(
                f"parameter {unknown[0]!r} is not supported by stage {self.stage.name!r} (BAGEL); use "
                f"{sorted(_REQUEST_KEYS)}"
            )
        if int(params.get("n") or 1) != 1:
            raise InvalidRequest(f"stage {self.stage.name!r} draws one image per request; send n=1")
        guidance_fields = {k: params[k] for k in BagelGuidance.model_fields if params.get(k) is not None}
        try:
            guidance = BagelGuidance.model_validate(guidance_fields)
        except ValueError as exc:
            raise InvalidRequest(f"stage {self.stage.name!r}: {exc}") from None
        default = self.generator.config.latent_downsample * min(self.generator.config.max_latent_size, 32)
        steps = params.get("num_inference_steps") or 50
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= self.args.max_inference_steps:
            raise InvalidRequest(
                f"num_inference_steps: {steps!r} is not allowed; use 1 to {self.args.max_inference_steps} "
                "(engine arg max_inference_steps)"
            )
        seed = params.get("seed")
        call = {
            "height": params.get("height") or default,
            "width": params.get("width") or default,
            "steps": steps,
            "seed": secrets.randbits(63) if seed is None else seed,
        }
        try:
            self.generator.grid(call["height"], call["width"])
            self.generator.noise(call["seed"], 0)
        except ValueError as exc:
            raise InvalidRequest(f"stage {self.stage.name!r}: {exc}") from None
        return call, guidance

    def _contexts(self, request: EngineInput, guidance: BagelGuidance) -> dict[str, KvContext]:
        """The request's KV payloads as contexts, each checked against this checkpoint. EngineError names a
        payload from another checkpoint or version (both sides) or a role the guidance needs that is missing."""
        import torch

        assert self.expected is not None
        payloads = request.data.get("contexts")
        if not isinstance(payloads, Mapping):
            raise EngineError(
                f"stage {self.stage.name!r} got no KV contexts (its input has {sorted(request.data)}); it must be fed "
                "by an ar stage with export_kv_cache over the edge processor ar_kv_to_bagel"
            )
        out: dict[str, KvContext] = {}
        for role, payload in payloads.items():
            try:
                check_kv_payload(payload, self.expected, role=role, edge=f"-> {self.stage.name}")
            except KvPayloadMismatch as exc:
                raise EngineError(str(exc)) from None
            out[str(role)] = KvContext(
                keys=torch.as_tensor(payload["keys"]),
                values=torch.as_tensor(payload["values"]),
                next_position=int(payload["next_position"]),
            )
        if "primary" in out and "cfg_img" not in out and guidance.cfg_img_scale > 1.0:
            out["cfg_img"] = out["primary"]  # text-to-image: the image-free context is the primary's (upstream)
        StageMetrics.kv_companions.labels(self.pipeline.name, self.stage.name).observe(max(0, len(payloads) - 1))
        return out

    async def generate(self, request: EngineInput) -> AsyncIterator[EngineOutput]:
        if self.generator is None:
            raise EngineError(f"stage {self.stage.name!r} is not started")
        if "contexts" not in request.data and "image" in request.data:
            async for out in self._edit(request):
                yield out
            return
        call, guidance = self._parse(request)
        contexts = self._contexts(request, guidance)
        async for out in self._generate(request.request_id, contexts, call, guidance):
            yield out

    async def _edit(self, request: EngineInput) -> AsyncIterator[EngineOutput]:
        """An image edit (see the module docstring). InvalidRequest for what an edit cannot take: no prompt, a
        picture that does not decode or is too large, a negative prompt (upstream's edits have none)."""
        assert self.generator is not None and self._pool is not None and self.tokenizer is not None
        picture = _picture(request.data.get("image"), self.stage.name)
        prompt = request.data.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidRequest(f"stage {self.stage.name!r}: an edit needs a non-empty prompt saying what to change")
        if request.data.get("negative_prompt") is not None or request.params.get("negative_prompt") is not None:
            raise InvalidRequest(
                "negative_prompt: BAGEL edits take none (their text guidance is the picture without the prompt); "
                "leave it unset"
            )
        # The picture decides the size: the stage's default size is text-to-image's (a size the client asks for
        # is refused by the router, `router.serving.images`, which can tell it from the stage's default).
        loop = asyncio.get_running_loop()
        image = await loop.run_in_executor(self._pool, self.generator.prepare_edit, picture)
        height, width = image.size
        defaults = {k: v for k, v in self.stage.sampling_params.items() if k not in BagelGuidance.model_fields}
        edit = EngineInput(
            request.request_id,
            {},
            {**EDIT_GUIDANCE, **defaults, **request.params, "height": height, "width": width},
        )
        call, guidance = self._parse(edit, with_stage_defaults=False)
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        contexts = await loop.run_in_executor(self._pool, self.generator.edit_contexts, image, ids, call["seed"])
        StageMetrics.kv_companions.labels(self.pipeline.name, self.stage.name).observe(len(contexts) - 1)
        async for out in self._generate(request.request_id, contexts, call, guidance):
            yield out

    async def _generate(
        self, rid: str, contexts: Mapping[str, KvContext], call: dict[str, Any], guidance: BagelGuidance
    ) -> AsyncIterator[EngineOutput]:
        """One parsed request (`_parse`) drawn over `contexts`, abortable while it waits or runs."""
        assert self.generator is not None and self._pool is not None
        self._live.add(rid)
        try:
            async for out in self._draw_one(rid, contexts, call, guidance):
                yield out
        finally:
            self._live.discard(rid)
            self._aborted.discard(rid)

    async def _draw_one(
        self, rid: str, contexts: Mapping[str, KvContext], call: dict[str, Any], guidance: BagelGuidance
    ) -> AsyncIterator[EngineOutput]:
        assert self._pool is not None
        loop = asyncio.get_running_loop()
        async with self._lock:
            if rid in self._aborted:
                self._aborted.discard(rid)
                yield EngineOutput(rid, {}, finished=True, finish_reason="abort")
                return
            self._running = rid
            try:
                image = await loop.run_in_executor(self._pool, self._draw, rid, contexts, call, guidance)
            except Interrupted:
                yield EngineOutput(rid, {}, finished=True, finish_reason="abort")
                return
            except MissingContext as exc:
                raise EngineError(f"stage {self.stage.name!r}: {exc}") from None
            finally:
                self._running = None
        png = await loop.run_in_executor(self._pool, PNG.encode_pillow, image, PNG.PNG_COMPRESS_LEVEL)
        info = {"width": call["width"], "height": call["height"], "seed": call["seed"]}
        yield EngineOutput(rid, {"images": [png], **info}, finished=True, finish_reason="stop")

    def _draw(self, rid: str, contexts: Mapping[str, KvContext], call: dict[str, Any], guidance: BagelGuidance) -> Any:
        """One image (PIL), in the worker thread; Interrupted between two steps once `rid` is aborted."""
        import torch
        from PIL import Image

        assert self.generator is not None
        labels = (self.pipeline.name, self.stage.name)
        started = last = time.monotonic()

        def on_step(_index: int) -> None:
            nonlocal last
            now = time.monotonic()
            StageMetrics.denoise_step.labels(*labels).observe(now - last)
            last = now
            if rid in self._aborted:
                raise Interrupted

        with torch.inference_mode():
            result = self.generator.denoise(
                contexts, call["height"], call["width"], call["steps"], call["seed"], guidance, on_step=on_step
            )
            decode_started = time.monotonic()
            pixels = self.generator.vae.decode(result.latents, *self.generator.grid(call["height"], call["width"]))
        StageMetrics.vae_decode.labels(*labels).observe(time.monotonic() - decode_started)
        self.forwards_log = [*self.forwards_log[-99:], {str(role): n for role, n in result.forwards.items()}]
        self._stats["last_image_seconds"] = time.monotonic() - started
        self._stats["images_total"] += 1
        return Image.fromarray(pixels)

    async def abort(self, request_id: str) -> None:
        """A waiting request never starts; a running one stops between two denoising steps."""
        if request_id in self._live:
            self._aborted.add(request_id)

    def image_bounds(self) -> ImageSizeBounds | None:
        """Sides of up to max_latent_size latent tokens, in multiples of the latent downsample (`latent_grid`)."""
        if self.generator is None:
            return None
        config = self.generator.config
        return ImageSizeBounds(
            max_side=config.max_latent_size * config.latent_downsample, multiple=config.latent_downsample
        )

    def stats(self) -> dict[str, float]:
        return {"running": float(self._running is not None), **self._stats}
