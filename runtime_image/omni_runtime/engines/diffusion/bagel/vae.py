"""BAGEL's autoencoder: FLUX's AE (`ae.safetensors`, black-forest-labs key layout) run as diffusers' AutoencoderKL.

The architecture is read off the tensors (channels per level, resnets per level, latent channels), so the real
FLUX AE (128-256-512-512, 2 resnets) and a tiny one load the same way; the keys are mapped with diffusers' own
converter from the original layout (`single_file_utils.convert_ldm_vae_checkpoint`). BAGEL's latent scaling is
FLUX's: z_model = 0.3611 (z - 0.1159).

Latent tokens are BAGEL's packing of a (z, h p, w p) latent into (h w, p p z) rows; `unpatchify` is upstream
`decode_image`'s "nhwpqc -> nchpwq", and the picture is (x / 2 + 1/2) clamped, times 255, truncated to uint8,
as upstream converts it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from omni_runtime.engines.diffusion.bagel.weights import CheckpointError

if TYPE_CHECKING:
    import numpy as np

__all__ = ["SCALE_FACTOR", "SHIFT_FACTOR", "BagelVae", "patchify", "unpatchify"]

SCALE_FACTOR = 0.3611
SHIFT_FACTOR = 0.1159


def unpatchify(tokens: torch.Tensor, height_tokens: int, width_tokens: int, patch: int) -> torch.Tensor:
    """(h w, p p z) latent tokens -> (1, z, h p, w p) latent."""
    channels = tokens.shape[-1] // (patch * patch)
    grid = tokens.reshape(1, height_tokens, width_tokens, patch, patch, channels)
    grid = torch.einsum("nhwpqc->nchpwq", grid)
    return grid.reshape(1, channels, height_tokens * patch, width_tokens * patch)


def patchify(latent: torch.Tensor, patch: int) -> torch.Tensor:
    """(1, z, h p, w p) latent -> (h w, p p z) tokens (upstream `forward_cache_update_vae`'s "chpwq -> hwpqc")."""
    _, channels, height, width = latent.shape
    grid = latent[0].reshape(channels, height // patch, patch, width // patch, patch)
    return torch.einsum("chpwq->hwpqc", grid).reshape(-1, patch * patch * channels)


def _diffusers_config(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """AutoencoderKL's config for the FLUX-layout `state` (shapes only)."""
    levels = sorted({int(m.group(1)) for k in state if (m := re.match(r"decoder\.up\.(\d+)\.", k))})
    if not levels or "decoder.conv_in.weight" not in state or "encoder.conv_in.weight" not in state:
        raise CheckpointError("ae.safetensors has no encoder.conv_in / decoder.conv_in / decoder.up.*: not a FLUX AE")
    channels = [int(state[f"decoder.up.{level}.block.0.conv2.weight"].shape[0]) for level in levels]
    decoder_blocks = {int(m.group(1)) for k in state if (m := re.match(r"decoder\.up\.0\.block\.(\d+)\.", k))}
    return {
        "in_channels": int(state["encoder.conv_in.weight"].shape[1]),
        "out_channels": int(state["decoder.conv_out.weight"].shape[0]),
        "down_block_types": ["DownEncoderBlock2D"] * len(levels),
        "up_block_types": ["UpDecoderBlock2D"] * len(levels),
        "block_out_channels": channels,
        "layers_per_block": len(decoder_blocks) - 1,  # the decoder has one resnet more per level
        "latent_channels": int(state["decoder.conv_in.weight"].shape[1]),
        "norm_num_groups": 32,  # GroupNorm(32) throughout, as FLUX
        "use_quant_conv": False,
        "use_post_quant_conv": False,
        "scaling_factor": SCALE_FACTOR,
        "shift_factor": SHIFT_FACTOR,
    }


class BagelVae:
    """The FLUX AE of a BAGEL checkpoint: decode latent tokens to an image, encode an image to latent tokens."""

    def __init__(self, model: Any, patch: int) -> None:
        self.model = model
        self.patch = patch

    @classmethod
    def from_file(cls, file: Path | str, *, patch: int, dtype: torch.dtype, device: str = "cpu") -> BagelVae:
        """Load `ae.safetensors` (original FLUX layout); `patch` is BAGEL's latent_patch_size."""
        from diffusers import AutoencoderKL
        from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
        from safetensors.torch import load_file

        path = Path(file)
        if not path.is_file():
            raise CheckpointError(f"{path} is missing; BAGEL decodes its images with it")
        state = load_file(str(path))
        config = _diffusers_config(state)
        model = AutoencoderKL(**config)
        converted = convert_ldm_vae_checkpoint(state, config)
        missing, unexpected = model.load_state_dict(converted, strict=False)
        if missing or unexpected:
            raise CheckpointError(
                f"{path}: after conversion {len(missing)} tensors are missing (e.g. {missing[:3]}) and "
                f"{len(unexpected)} unexpected (e.g. {unexpected[:3]}); not a FLUX-layout AE"
            )
        model = model.to(device=device)
        if dtype != torch.float32:  # built in float32; diffusers warns on any dtype cast, so only when needed
            model = model.to(dtype=dtype)
        return cls(model.eval(), patch)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the AE computes in."""
        return next(self.model.parameters()).dtype

    @torch.no_grad()
    def decode_latent(self, latent: torch.Tensor) -> torch.Tensor:
        """(1, z, H/8, W/8) model-space latent -> (1, 3, H, W) image in [-1, 1] (not clamped)."""
        z = latent.to(device=self.model.device, dtype=self.dtype) / SCALE_FACTOR + SHIFT_FACTOR
        return self.model.decode(z).sample

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, height_tokens: int, width_tokens: int) -> np.ndarray:
        """Latent tokens of an h x w grid -> the image, uint8 (H, W, 3)."""
        image = self.decode_latent(unpatchify(tokens, height_tokens, width_tokens, self.patch))
        pixels = (image.float() * 0.5 + 0.5).clamp(0, 1)[0].permute(1, 2, 0) * 255
        return pixels.to(torch.uint8).cpu().numpy()

    @torch.no_grad()
    def encode(self, image: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """(1, 3, H, W) image in [-1, 1] -> (h w, p p z) latent tokens. Upstream samples the posterior (mean +
        std noise); pass `generator` to sample it reproducibly, or None for its mean."""
        posterior = self.model.encode(image.to(device=self.model.device, dtype=self.dtype)).latent_dist
        z = posterior.sample(generator=generator) if generator is not None else posterior.mean
        return patchify((z - SHIFT_FACTOR) * SCALE_FACTOR, self.patch)
