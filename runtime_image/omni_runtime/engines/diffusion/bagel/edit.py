"""An image edit's contexts, built by the dit itself: the input image through the VAE and the ViT, then the text.

BAGEL's edit context is [the image's VAE tokens (generation expert), its ViT tokens (understanding expert), the
prompt]. vLLM's BAGEL has no generation expert, and the ViT and text tokens attend to the VAE tokens, so the
thinker cannot prefill it; the dit, which holds both experts, does (`router.plan.plan_edit` sends an edit here).
As upstream's `InterleaveInferencer.interleave_inference([image, prompt])`:

- the image is resized for the VAE (`resize_within`: longest side at most `vae_max`, shortest at least `vae_min`,
  sides multiples of the latent downsample); the output has that size, and the ViT reads that resized image
  resized again for its own bounds;
- primary = [VAE image, ViT image, prompt]; cfg_text = [VAE image, ViT image] (the text left out); cfg_img =
  [prompt] (the image left out). Upstream has no negative prompt for edits.

The VAE posterior is sampled (as upstream's AutoEncoder does), from a generator seeded by the request's seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from omni_runtime.engines.diffusion.bagel.context import KvContext, empty_context, prefill
from omni_runtime.engines.diffusion.bagel.mot import extend_with_image, latent_embeddings, latent_position_ids
from omni_runtime.engines.diffusion.bagel.vit import VitWeights, vit_tokens

if TYPE_CHECKING:
    from PIL import Image

    from omni_runtime.engines.diffusion.bagel.vae import BagelVae
    from omni_runtime.engines.diffusion.bagel.weights import BagelConfig, BagelWeights

__all__ = ["EditImage", "EditSizes", "edit_contexts", "edit_sizes", "pixels_of", "prepare_image", "resize_within"]

VAE_SIDES = (1024, 512)
"""Upstream's VAE transform (longest side at most, shortest side at least), for BAGEL-7B-MoT."""
VIT_SIDES = (980, 224)
"""Upstream's ViT transform, likewise."""
MAX_PIXELS = 14 * 14 * 9 * 1024
"""Upstream ImageTransform's pixel bound."""


@dataclass(frozen=True)
class EditSizes:
    """The two resize bounds of an edit's input image: upstream's, capped where a checkpoint's tables are
    smaller (a tiny model's)."""

    vae_max: int
    vae_min: int
    vae_stride: int
    vit_max: int
    vit_min: int
    vit_stride: int


def edit_sizes(config: BagelConfig, vit: VitWeights) -> EditSizes:
    """Upstream's bounds, each capped at what the checkpoint's position tables reach."""
    vae_max = min(VAE_SIDES[0], config.max_latent_size * config.latent_downsample)
    vit_max = min(VIT_SIDES[0], vit.max_side)
    return EditSizes(
        vae_max=vae_max,
        vae_min=min(VAE_SIDES[1], vae_max),
        vae_stride=config.latent_downsample,
        vit_max=vit_max,
        vit_min=min(VIT_SIDES[1], vit_max),
        vit_stride=vit.patch_size,
    )


def _divisible(value: float, stride: int) -> int:
    return max(stride, int(round(value / stride) * stride))


def resize_within(image: Image.Image, max_side: int, min_side: int, stride: int) -> Image.Image:
    """Upstream's `MaxLongEdgeMinShortEdgeResize` (bicubic, as torchvision resizes a PIL image): scale so the
    longest side is at most `max_side` and the shortest at least `min_side`, sides rounded to `stride`, then
    within `MAX_PIXELS` and `max_side` again."""
    from PIL import Image

    width, height = image.size

    def scaled(w: int, h: int, scale: float) -> tuple[int, int]:
        return _divisible(round(w * scale), stride), _divisible(round(h * scale), stride)

    scale = max(min(max_side / max(width, height), 1.0), min_side / min(width, height))
    new_w, new_h = scaled(width, height, scale)
    if new_w * new_h > MAX_PIXELS:
        new_w, new_h = scaled(new_w, new_h, MAX_PIXELS / (new_w * new_h))
    if max(new_w, new_h) > max_side:
        new_w, new_h = scaled(new_w, new_h, max_side / max(new_w, new_h))
    return image.resize((new_w, new_h), Image.Resampling.BICUBIC)


def pixels_of(image: Image.Image) -> torch.Tensor:
    """(3, H, W) float32 in [-1, 1]: ToTensor then Normalize(0.5, 0.5), as upstream's ImageTransform."""
    array = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    return (torch.from_numpy(array).permute(2, 0, 1) - 0.5) / 0.5


@dataclass(frozen=True)
class EditImage:
    """An edit's input image as the contexts read it."""

    vae_pixels: torch.Tensor
    """(3, H, W): the VAE-resized image; (H, W) is the edited image's size."""
    vit_pixels: torch.Tensor

    @property
    def size(self) -> tuple[int, int]:
        """(height, width) of the edited image."""
        return int(self.vae_pixels.shape[1]), int(self.vae_pixels.shape[2])


def prepare_image(image: Image.Image, sizes: EditSizes) -> EditImage:
    """The VAE's and the ViT's views of `image` (the ViT's resized from the VAE's, as upstream)."""
    vae_view = resize_within(image.convert("RGB"), sizes.vae_max, sizes.vae_min, sizes.vae_stride)
    vit_view = resize_within(vae_view, sizes.vit_max, sizes.vit_min, sizes.vit_stride)
    return EditImage(vae_pixels=pixels_of(vae_view), vit_pixels=pixels_of(vit_view))


def _with_image(
    weights: BagelWeights, vae: BagelVae, vit: VitWeights, image: EditImage, generator: torch.Generator
) -> KvContext:
    """A fresh context holding `image`: its VAE block, then its ViT block."""
    config = weights.config
    height, width = image.size
    grid = (height // config.latent_downsample, width // config.latent_downsample)
    latents = vae.encode(image.vae_pixels[None], generator=generator)
    positions = latent_position_ids(*grid, config.max_latent_size)
    clean = latent_embeddings(weights, latents, torch.zeros(()), positions)  # a context image is at t = 0
    context = extend_with_image(weights, empty_context(config, weights.dtype, str(weights.device)), clean, "gen")
    return extend_with_image(weights, context, vit_tokens(vit, image.vit_pixels), "und")


def edit_contexts(
    weights: BagelWeights, vae: BagelVae, vit: VitWeights, image: EditImage, framed: list[int], seed: int
) -> dict[str, KvContext]:
    """{primary, cfg_text, cfg_img} of an edit of `image` by the prompt whose framed ids (`<|im_start|>` + ids +
    `<|im_end|>`) are `framed`; the VAE posterior sampled from `seed`."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with_image = _with_image(weights, vae, vit, image, generator)
    return {
        "primary": prefill(weights, framed, past=with_image),
        "cfg_text": with_image,
        "cfg_img": prefill(weights, framed),
    }
