"""Request parsing of the `diffusion` engine: one `EngineInput` checked and turned into a `Job`.

What a request may set comes from the loaded pipeline (its `__call__` parameters, read once into
`RequestRules`) and the stage's limits (`max_pixels`, `max_inference_steps`, `max_batch_size`); a request
that breaks one gets an InvalidRequest saying what was asked, what is allowed and what to send instead.
Requests whose jobs have equal keys may share one pipeline call (`batcher`).
"""

from __future__ import annotations

import asyncio
import difflib
import io
import math
import secrets
from dataclasses import dataclass, field
from typing import Any

from omni_runtime.engines.base import EngineInput, InvalidRequest
from omni_runtime.engines.diffusion import flux
from omni_runtime.engines.diffusion import video as V
from omni_runtime.engines.diffusion.step_cache import request_option
from omni_runtime.spec import Modality, StageSpec
from omni_runtime.spec.engine_args import VideoArgs

__all__ = ["Job", "RequestRules", "call_steps", "default_size", "parse", "size_multiple"]


def call_steps(call: dict[str, Any], default: int = 1) -> int:
    """Denoising steps a pipeline call runs: one per entry of a custom schedule, else num_inference_steps
    (`default` when the call leaves it to the pipeline)."""
    schedule = call.get("sigmas") or call.get("timesteps")
    return len(schedule) if schedule else int(call.get("num_inference_steps") or default)


@dataclass
class Job:
    """One request on its way through the batcher: what its pipeline call needs, and its future."""

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
    upstream: dict[str, Any] = field(default_factory=dict)
    """Call arguments from the upstream stage (`RequestRules.upstream_params`), passed to the call as they are."""
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


@dataclass(frozen=True)
class RequestRules:
    """What a request may ask of one loaded pipeline: its call's parameters and the stage's limits."""

    stage: StageSpec
    call_params: frozenset[str]
    """The pipeline's scalar call arguments a request may set."""
    embed_params: frozenset[str]
    """The pipeline's embedding inputs (`prompt_embeds`, ...)."""
    takes_image: bool
    takes_size: bool
    video: bool
    temporal: int
    """A video pipeline's temporal compression (frames per latent frame); 1 for images."""
    video_args: VideoArgs
    """The stage's frame and fps bounds (its engine args)."""
    size_multiple: int
    default_size: int
    max_pixels: int
    max_inference_steps: int
    max_batch_size: int
    upstream_params: frozenset[str] = frozenset()
    """The pipeline's call arguments an upstream stage hands over in `data`, beside the prompt (GLM-Image's AR
    tokens: `prior_token_ids`, ...); never sampling params. A request carrying them runs in a call of its own."""


def parse(request: EngineInput, rules: RequestRules) -> Job:
    """The request as a job: its parameters checked against what the pipeline takes and the stage allows,
    its key (equal keys may share a pipeline call), seed and inputs; InvalidRequest says what to change."""
    name = rules.stage.name
    params = {**rules.stage.sampling_params, **request.params}
    if "num_images_per_prompt" in params:
        params.setdefault("n", params.pop("num_images_per_prompt"))
    negative = request.data.get("negative_prompt")
    param_negative = params.pop("negative_prompt", None)
    negative = param_negative if negative is None else negative
    seed = params.pop("seed", None)
    n = params.pop("n", 1)
    upstream = {k: v for k, v in request.data.items() if k in rules.upstream_params and v is not None}
    for key in ("height", "width"):  # the upstream stage drew its tokens for this size: it is the image's
        if key in request.data and request.data[key] is not None:
            params[key] = request.data[key]
    step_cache = request_option(params)
    fps = V.check_video_params(params, name, rules.video_args, rules.temporal) if rules.video else 0
    picture = _input_image(rules, request.data.get("image"))
    if picture is not None:  # the output's size defaults to the input's (rounded to the multiple)
        m = rules.size_multiple
        params.setdefault("width", max(m, picture.width // m * m))
        params.setdefault("height", max(m, picture.height // m * m))
    size_params = set() if rules.takes_size else {"height", "width"}  # an img2img pipeline sizes by image
    unknown = sorted(set(params) - rules.call_params - size_params)
    if unknown:
        close = difflib.get_close_matches(unknown[0], rules.call_params, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise InvalidRequest(
            f"parameter {unknown[0]!r}{hint} is not supported by stage {name!r}; "
            f"use seed, n or one of {sorted(rules.call_params)}"
        )
    height = _int(params.setdefault("height", rules.default_size), "height")
    width = _int(params.setdefault("width", rules.default_size), "width")
    m = rules.size_multiple
    for label, value in (("height", height), ("width", width)):
        if value <= 0 or value % m:
            raise InvalidRequest(
                f"{label} {value} is not allowed: stage {name!r} needs a positive multiple of {m} "
                f"(VAE scale factor x patch size); use {max(m, value // m * m)} or {(value // m + 1) * m}"
            )
    if height * width > rules.max_pixels:
        raise InvalidRequest(
            f"{width}x{height} is {height * width} pixels; stage {name!r} allows at most "
            f"{rules.max_pixels} (max_pixels); ask for a smaller image"
        )
    if "num_inference_steps" in params:
        steps = _int(params["num_inference_steps"], "num_inference_steps")
        if not 1 <= steps <= rules.max_inference_steps:
            raise InvalidRequest(
                f"num_inference_steps {steps} is out of range: stage {name!r} accepts 1 to "
                f"{rules.max_inference_steps} (max_inference_steps)"
            )
    for key in ("sigmas", "timesteps"):  # a schedule given as a list runs one step per entry
        if params.get(key) is not None:
            params[key] = _schedule(rules, params[key], key)
    n = _int(n, "n")
    if not 1 <= n <= rules.max_batch_size:
        raise InvalidRequest(
            f"n {n} is out of range: stage {name!r} makes 1 to {rules.max_batch_size} images per request "
            "(max_batch_size)"
        )
    if seed is None:
        seed = secrets.randbits(63)
    seed = _int(seed, "seed")
    if not 0 <= seed < 2**63:
        raise InvalidRequest(f"seed {seed} is out of range; use 0 to {2**63 - 1}")

    if picture is not None and not rules.takes_size:
        picture = picture.resize((width, height))
        del params["height"], params["width"]
    skip = {"negative_prompt", "image", "height", "width", *rules.upstream_params}  # read above
    data = {k: v for k, v in request.data.items() if v is not None and k not in skip}
    embeds = {k: v for k, v in data.items() if k in rules.embed_params}
    if embeds and picture is not None:
        raise InvalidRequest(f"stage {name!r} takes an image with a text prompt, not with embeddings")
    if embeds:
        extra = sorted(set(data) - set(embeds))
        if extra or negative is not None:
            raise InvalidRequest(
                f"stage {name!r} takes either text or embeddings, not both; got {sorted(request.data)}"
            )
        job = _embeds_job(request.request_id, params, embeds, n, seed)
        job.fps, job.step_cache = fps, step_cache
        job.key += repr(step_cache)
        return job
    if not isinstance(data.get("prompt"), str) or not data["prompt"].strip():
        raise InvalidRequest(
            f"stage {name!r} needs a non-empty 'prompt' string or prompt embeddings "
            f"({sorted(rules.embed_params)}); got {sorted(request.data)}"
        )
    extra = sorted(set(data) - {"prompt"})
    if extra:
        raise InvalidRequest(f"stage {name!r} does not take {extra}; send prompt and negative_prompt")
    if negative is not None and not isinstance(negative, str):
        raise InvalidRequest(f"negative_prompt must be a string, not {type(negative).__name__}")
    size = None if picture is None else picture.size
    key = repr(("text", sorted(params.items()), n, negative is not None, size, step_cache))
    if (picture is not None and rules.video) or upstream:  # one conditioning image / upstream input per call
        key += request.request_id
    return Job(
        request.request_id,
        "text",
        key,
        params,
        n,
        seed,
        data["prompt"],
        negative,
        image=picture,
        upstream=upstream,
        fps=fps,
        step_cache=step_cache,
    )


def _schedule(rules: RequestRules, value: Any, key: str) -> list[float]:
    """A custom `sigmas` / `timesteps` list: it sets the number of steps, so the step bound applies."""
    name = rules.stage.name
    if not isinstance(value, list | tuple):
        raise InvalidRequest(f"{key} must be a list of numbers, one per denoising step, not {type(value).__name__}")
    if not 1 <= len(value) <= rules.max_inference_steps:
        raise InvalidRequest(
            f"{key} has {len(value)} entries, one denoising step each; stage {name!r} runs 1 to "
            f"{rules.max_inference_steps} steps (max_inference_steps); send a shorter schedule"
        )
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in value):
        raise InvalidRequest(f"{key} must hold finite numbers only")
    return [float(v) for v in value]


def _input_image(rules: RequestRules, raw: Any) -> Any:
    """The request's input image as an RGB PIL image; None when it has none and needs none."""
    name = rules.stage.name
    if raw is None:
        if Modality.IMAGE in rules.stage.input_modalities and rules.takes_image:
            raise InvalidRequest(
                f"stage {name!r} edits an image and got none; send it as the multipart 'image' file of /v1/images/edits"
            )
        return None
    if not rules.takes_image:
        raise InvalidRequest(f"stage {name!r} takes no image input; send only a prompt")
    if not isinstance(raw, bytes | bytearray | memoryview):
        raise InvalidRequest(f"image must be the bytes of a PNG, JPEG or WebP file, not {type(raw).__name__}")
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(bytes(raw))) as opened:
            if opened.width * opened.height > rules.max_pixels * 4:
                raise InvalidRequest(
                    f"the input image is {opened.width}x{opened.height}; stage {name!r} reads at most "
                    f"{rules.max_pixels * 4} pixels (4x max_pixels); send a smaller image"
                )
            return opened.convert("RGB")
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError) as err:
        raise InvalidRequest(f"the input image could not be read ({err}); send a PNG, JPEG or WebP file") from None


def _embeds_job(rid: str, params: dict, embeds: dict, n: int, seed: int) -> Job:
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
    return Job(rid, "embeds", key, params, n, seed, embeds=tensors)


def _int(value: Any, label: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise InvalidRequest(f"{label} must be an integer, not {value!r}")
    return int(value)


def size_multiple(pipe: Any) -> int:
    """What height and width must be multiples of: the VAE scale factor x the DiT's patch size.

    Flux- and QwenImage-style pipelines pack 2x2 latent patches, whatever the transformer config says (`flux`).
    Z-Image's DiT lists the patch sizes it has weights for (`all_patch_size`, (2,) in Z-Image-Turbo) instead of one
    `patch_size`; a multiple of the largest (they are powers of two) suits every one its pipelines may use.
    """
    vae = int(getattr(pipe, "vae_scale_factor", None) or getattr(pipe, "vae_scale_factor_spatial", 8) or 8)
    patch = getattr(pipe, "patch_size", None)
    if patch is None:
        config = getattr(getattr(pipe, "transformer", None), "config", None)
        patch = getattr(config, "patch_size", None) or max(getattr(config, "all_patch_size", None) or (1,))
    if isinstance(patch, list | tuple):  # video DiTs patch (frames, height, width)
        patch = patch[-1]
    if flux.packs_latents(pipe):
        patch = flux.PACKED_PATCH
    return vae * int(patch)


def default_size(pipe: Any) -> int:
    """The pipeline's own default edge in pixels (sample size x VAE scale factor)."""
    vae = int(getattr(pipe, "vae_scale_factor", 8) or 8)
    sample = getattr(pipe, "default_sample_size", None)
    if sample is None:
        denoiser = getattr(pipe, "unet", None) or getattr(pipe, "transformer", None)
        sample = getattr(getattr(denoiser, "config", None), "sample_size", None) or 64
    if isinstance(sample, (list, tuple)):
        sample = sample[0]
    return int(sample) * vae
