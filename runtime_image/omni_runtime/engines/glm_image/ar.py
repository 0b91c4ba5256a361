"""`glm_image_ar`: GLM-Image's AR (`GlmImageForConditionalGeneration`, transformers) as a `generation` stage.

It does what `GlmImagePipeline.generate_prior_tokens` does before the DiT, for one request: the chat template
with the target size (`<sop>h w<eop>` grids at 1/32 of the image; t2i also asks for a small preview grid first),
for i2i the input picture's VQ codes, then the AR's sampled generation (the torch seed set from the request's
`seed`, as the pipeline sets it from its generator), whose target-grid tokens (after the preview, before the end
token) are upsampled x2 (nearest) to the DiT's 1/16 grid. Output: one `GlmImagePriorTokens`.

Engine args (`spec.engine_args.GlmImageArArgs`): `runner: glm_image_ar`, `device`, `torch_dtype`. The stage folder
is the whole pipeline folder (`vision_language_encoder/`, `processor/`); the DiT stage loads the same folder.
Request params: `seed`, `height`, `width` (multiples of 32; default 1024). Data: `prompt`, optional `image` (bytes).
"""

from __future__ import annotations

import asyncio
import io
import secrets
import threading
from collections.abc import AsyncIterator
from typing import Any

from omni_runtime.engines.base import Engine, EngineError, EngineInput, EngineOutput, InvalidRequest
from omni_runtime.engines.common import (
    default_device,
    one_build_at_a_time,
    release_device_memory,
    stage_dtype,
    stage_model_path,
    typed_engine_args,
)
from omni_runtime.processors.payloads import GlmImagePriorTokens, as_payload
from omni_runtime.spec import ResolvedPipeline, StageSpec
from omni_runtime.spec.engine_args import GlmImageArArgs

__all__ = ["GRID_FACTOR", "GlmImageArEngine", "upsample_tokens"]

GRID_FACTOR = 32
"""Pixels per AR image token along each side (the processor's target grid)."""
DEFAULT_SIZE = 1024
PARAMS = ("seed", "height", "width")


def upsample_tokens(tokens: Any, grid_h: int, grid_w: int) -> Any:
    """(h*w,) codes on the AR's grid -> (1, 2h*2w) on the DiT's: every code repeated over a 2x2 block (nearest)."""
    grid = tokens.reshape(grid_h, grid_w)
    return grid.repeat_interleave(2, dim=0).repeat_interleave(2, dim=1).reshape(1, -1)


class _Aborted(Exception):
    """The request was aborted while its tokens were sampled."""


class GlmImageArEngine(Engine):
    """One GLM-Image AR; requests run one at a time (the seed is torch's global one, as in the pipeline)."""

    def __init__(self, pipeline: ResolvedPipeline, stage: StageSpec) -> None:
        super().__init__(pipeline, stage)
        self.model_path = stage_model_path(pipeline, stage)
        self.args = typed_engine_args(stage, GlmImageArArgs)
        self.model: Any = None
        self.processor: Any = None
        self._lock = threading.Lock()
        self._running: set[str] = set()
        self._aborted: set[str] = set()
        self._stats = {"requests_total": 0.0, "last_tokens": 0.0}

    async def start(self) -> None:
        self.device = default_device(self.args.device)
        self.dtype = stage_dtype(self.stage.name, self.args.torch_dtype, "float32")
        try:
            await asyncio.to_thread(one_build_at_a_time(self._load))
        except Exception as exc:
            raise EngineError(
                f"stage {self.stage.name!r}: GLM-Image AR failed to load {self.model_path}: {exc}"
            ) from exc

    def _load(self) -> None:
        from transformers import GlmImageForConditionalGeneration, GlmImageProcessor

        self.processor = GlmImageProcessor.from_pretrained(self.model_path / "processor", local_files_only=True)
        model = GlmImageForConditionalGeneration.from_pretrained(
            self.model_path / "vision_language_encoder", dtype=self.dtype, local_files_only=True
        )
        self.model = model.to(self.device).eval()

    def _request(self, request: EngineInput) -> tuple[str, Any, int, int, int]:
        """prompt, picture (PIL or None), height, width, seed; InvalidRequest says what to change."""
        params = {**self.stage.sampling_params, **request.params}
        unknown = sorted(set(params) - set(PARAMS))
        if unknown:
            raise InvalidRequest(f"stage {self.stage.name!r} does not take {unknown}; it takes {list(PARAMS)}")
        prompt = request.data.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidRequest(f"stage {self.stage.name!r} needs a non-empty 'prompt' string")
        sizes = []
        for key in ("height", "width"):
            value = params.get(key, DEFAULT_SIZE)
            if not isinstance(value, int) or isinstance(value, bool) or value < GRID_FACTOR or value % GRID_FACTOR:
                raise InvalidRequest(
                    f"{key} {value!r} is not allowed: stage {self.stage.name!r} needs a multiple of 32"
                )
            sizes.append(value)
        seed = params.get("seed")
        seed = secrets.randbits(63) if seed is None else seed
        if not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise InvalidRequest(f"seed {seed!r} is out of range; use 0 to {2**63 - 1}")
        picture = None
        raw = request.data.get("image")
        if raw is not None:
            from PIL import Image, UnidentifiedImageError

            try:
                with Image.open(io.BytesIO(bytes(raw))) as opened:
                    picture = opened.convert("RGB")
            except (UnidentifiedImageError, OSError, TypeError) as err:
                raise InvalidRequest(f"the input image could not be read ({err}); send a PNG, JPEG or WebP") from None
        return prompt, picture, sizes[0], sizes[1], seed

    def _generate(self, rid: str, prompt: str, picture: Any, height: int, width: int, seed: int) -> dict[str, Any]:
        """The pipeline's AR half for one prompt (in a worker thread, under the lock); `Aborted` once `rid` is
        aborted (checked after every sampled token)."""
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        aborted = self._aborted

        class _StopOnAbort(StoppingCriteria):
            def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
                return torch.full((input_ids.shape[0],), rid in aborted, dtype=torch.bool, device=input_ids.device)

        content: list[dict[str, Any]] = [] if picture is None else [{"type": "image", "image": picture}]
        content.append({"type": "text", "text": prompt})
        inputs = self.processor.apply_chat_template(
            [[{"role": "user", "content": content}]],
            tokenize=True,
            padding=False,
            target_h=height,
            target_w=width,
            return_dict=True,
            return_tensors="pt",
        ).to(self.device)
        grids = inputs["image_grid_thw"]
        # t2i grids: [target, preview], generated preview first; i2i: [sources..., target].
        target = grids[0] if picture is None else grids[-1]
        _, grid_h, grid_w = (int(v) for v in target.tolist())
        skip = 0 if picture is not None else int(sum(int(g[1]) * int(g[2]) for g in grids[1:]))
        new_tokens = skip + grid_h * grid_w + 1  # the end token closes the image
        image_ids = source_grid = None
        with torch.inference_mode():
            if picture is not None:
                sources = grids[:-1]
                embeds = self.model.get_image_features(inputs["pixel_values"], sources).pooler_output
                # One (channels, h, w) map per picture: get_image_tokens quantises each (diffusers 0.42.1's
                # pipeline concatenates them first, which transformers 5.19's get_image_tokens no longer takes).
                codes = self.model.get_image_tokens(list(embeds), sources)
                parts = torch.split(codes.reshape(-1), sources.prod(dim=-1).tolist())
                image_ids = torch.cat(
                    [upsample_tokens(p, int(g[1]), int(g[2])).reshape(-1) for p, g in zip(parts, sources, strict=True)]
                )
                source_grid = sources.clone()
                source_grid[:, 1:] *= 2
            torch.manual_seed(seed)
            if str(self.device).startswith("cuda"):
                torch.cuda.manual_seed(seed)
            out = self.model.generate(
                **inputs,
                max_new_tokens=new_tokens,
                do_sample=True,
                stopping_criteria=StoppingCriteriaList([_StopOnAbort()]),
            )
        if rid in aborted:
            raise _Aborted
        generated = out[0][inputs["input_ids"].shape[-1] :]
        tokens = generated[skip : skip + grid_h * grid_w]
        if tokens.numel() != grid_h * grid_w:
            raise EngineError(
                f"stage {self.stage.name!r}: the AR ended after {generated.numel()} tokens, before its "
                f"{grid_h}x{grid_w} image grid was complete"
            )
        self._stats["last_tokens"] = float(generated.numel())
        return {
            "prior_token_ids": upsample_tokens(tokens, grid_h, grid_w).cpu(),
            "prior_token_image_ids": None if image_ids is None else image_ids.cpu(),
            "source_image_grid_thw": None if source_grid is None else source_grid.cpu(),
        }

    async def generate(self, request: EngineInput) -> AsyncIterator[EngineOutput]:
        if self.model is None:
            raise EngineError(f"stage {self.stage.name!r} is not started")
        prompt, picture, height, width, seed = self._request(request)
        raw = request.data.get("image")

        rid = request.request_id

        def run() -> dict[str, Any]:
            with self._lock:
                if rid in self._aborted:
                    raise _Aborted
                return self._generate(rid, prompt, picture, height, width, seed)

        self._running.add(rid)
        try:
            tokens = await asyncio.to_thread(run)
        except _Aborted:
            yield EngineOutput(rid, {}, finished=True, finish_reason="abort")
            return
        finally:
            self._running.discard(rid)
            self._aborted.discard(rid)
        self._stats["requests_total"] += 1
        payload = GlmImagePriorTokens(
            prior_token_ids=tokens["prior_token_ids"],
            prior_token_image_ids=tokens["prior_token_image_ids"],
            source_image_grid_thw=tokens["source_image_grid_thw"],
            prompt=prompt,
            image=None if raw is None else bytes(raw),
            height=height,
            width=width,
        )
        yield EngineOutput(request.request_id, as_payload(payload), finished=True, finish_reason="stop")

    async def abort(self, request_id: str) -> None:
        """A waiting request never starts; a running one stops after the token being sampled."""
        if request_id in self._running:
            self._aborted.add(request_id)

    async def stop(self) -> None:
        await asyncio.to_thread(self._lock.acquire)  # a generation in progress finishes first
        try:
            self.model = self.processor = None
        finally:
            self._lock.release()
        release_device_memory()

    def stats(self) -> dict[str, float]:
        return {"running_requests": float(len(self._running)), **self._stats}
