"""`POST /v1/images/generations` and `/v1/images/edits`: request and response models.

Only `response_format: b64_json` exists (the router keeps no files to link to). `size` is `WxH`;
`seed`, `negative_prompt`, `num_inference_steps`, `guidance_scale`, BAGEL's guidance (`BAGEL_GUIDANCE`) and
vLLM-Omni's `sampling_params_list` (one dict per stage) come through `extra_body`.
Each returned image carries `revised_prompt`: the prompt the image stage actually received (after a
prompt-enhancing stage), and `revised_negative_prompt` likewise.
"""

from __future__ import annotations

import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from omni_runtime.spec.guidance import BagelGuidance

__all__ = [
    "BAGEL_GUIDANCE",
    "IMAGE_REFUSED",
    "ImageData",
    "ImageGenerationRequest",
    "ImagesResponse",
    "parse_size",
]

BAGEL_GUIDANCE = tuple(BagelGuidance.model_fields)
"""The BAGEL guidance fields: image-stage parameters; a stage that does not read one refuses it (400)."""


def _bounds(name: str) -> dict[str, Any]:
    """The bounds (`ge`, `le`, `gt`, `lt`) BAGEL's dit stage puts on guidance field `name`, as Field arguments."""
    out: dict[str, Any] = {}
    for constraint in BagelGuidance.model_fields[name].metadata:
        for key in ("ge", "le", "gt", "lt"):
            if hasattr(constraint, key):
                out[key] = getattr(constraint, key)
    return out


_SIZE = re.compile(r"^\s*(\d{1,5})\s*[xX×]\s*(\d{1,5})\s*$")


class ImageGenerationRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    prompt: str = Field(min_length=1)
    model: str | None = None
    n: int = Field(1, ge=1, description="Images; at most the pipeline's router.limits.maxN.")
    size: str | None = Field(None, description="WIDTHxHEIGHT, e.g. 512x512; 'auto' or unset: the stage default.")
    response_format: str | None = "b64_json"
    user: str | None = Field(None, description="An end-user id; only recorded.")
    seed: int | None = None
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(None, ge=1)
    guidance_scale: float | None = Field(None, ge=0.0)
    # BAGEL's guidance, bounded as its dit stage bounds it (`spec.guidance.BagelGuidance`, its docstrings).
    cfg_text_scale: float | None = Field(
        None,
        **_bounds("cfg_text_scale"),
        description="BAGEL: text guidance (1: none, and the text-free companion does not run).",
    )
    cfg_img_scale: float | None = Field(
        None, **_bounds("cfg_img_scale"), description="BAGEL: image guidance of an edit (1: none)."
    )
    cfg_interval: tuple[float, float] | None = Field(
        None, description="BAGEL: (low, high]: the timesteps (1 = noise, 0 = image) where guidance applies."
    )
    cfg_renorm_type: Literal["global", "channel", "text_channel"] | None = Field(
        None, description="BAGEL: how a guided velocity's norm is capped at the unguided one's."
    )
    cfg_renorm_min: float | None = Field(
        None,
        **_bounds("cfg_renorm_min"),
        description="BAGEL: the floor of that renormalisation's factor (1: no renormalisation).",
    )
    timestep_shift: float | None = Field(
        None,
        **_bounds("timestep_shift"),
        description="BAGEL: the flow-matching schedule's shift (above 1: more steps at high noise).",
    )
    think: bool = Field(
        False,
        description="BAGEL: think before drawing. The thinker writes its plan first and the image is drawn in the "
        "context of the prompt and that plan, returned as each image's `revised_prompt`. A 400 for a pipeline "
        "whose image is not drawn from a thinker's context.",
    )
    sampling_params_list: list[dict[str, Any]] | None = Field(
        None, description="vLLM-Omni: parameters per stage, in the pipeline's topological order."
    )

    @field_validator("cfg_interval")
    @classmethod
    def _interval(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        if value is not None and not 0.0 <= value[0] < value[1] <= 1.0:
            raise ValueError(f"cfg_interval must be [low, high] with 0 <= low < high <= 1; got {list(value)}")
        return value


IMAGE_REFUSED: dict[str, tuple[str, object]] = {
    "quality": ("OpenAI's quality presets are not served; set num_inference_steps instead", "auto"),
    "style": ("dall-e-3's styles are not served; describe the style in the prompt", None),
    "background": ("transparent backgrounds are not served (images are opaque PNGs)", "auto"),
    "output_format": ("images are PNG only; leave output_format unset or 'png'", "png"),
    "output_compression": ("images are PNG only (lossless)", None),
    "moderation": ("no moderation runs here", "auto"),
    "partial_images": ("partial images are not streamed", 0),
    "stream": ("image generation is not streamed", False),
    "mask": ("inpainting masks are not served; edit the whole image", None),
    "input_fidelity": ("not served", None),
}
"""OpenAI image fields this server does not honour: a request that sets one to anything but the value in
the tuple (what the server does anyway) gets a 400 naming it and why; any other unknown field is a 400
too, unless the pipeline sets `router.unknownFields: ignore`."""


class ImageData(BaseModel):
    model_config = ConfigDict(extra="allow")

    b64_json: str
    revised_prompt: str | None = None


class ImagesResponse(BaseModel):
    created: int = Field(default_factory=lambda: int(time.time()))
    data: list[ImageData]
    usage: dict[str, Any] | None = None


def parse_size(size: str | None) -> tuple[int, int] | None:
    """(width, height) from `WxH`; None for unset or 'auto'. ValueError says the accepted form."""
    if size is None or size.strip().lower() == "auto":
        return None
    match = _SIZE.match(size)
    if not match or int(match.group(1)) < 1 or int(match.group(2)) < 1:
        raise ValueError(f"size {size!r} is not WIDTHxHEIGHT; use a form like '512x512' (or 'auto')")
    return int(match.group(1)), int(match.group(2))
