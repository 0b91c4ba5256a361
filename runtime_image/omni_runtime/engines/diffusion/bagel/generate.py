"""`BagelGenerator`: contexts in, an image out (the generation expert, the sampler, the VAE decode).

The contexts come by role ("primary", "cfg_text", "cfg_img"), from the thinker stage or from `prefill`. A role
the guidance needs (its scale above 1) that is missing is an error naming it, before any work: a companion that
did not arrive must never turn into an unguided image.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from omni_runtime.engines.diffusion.bagel.context import KvContext, prefill
from omni_runtime.engines.diffusion.bagel.edit import EditImage, EditSizes, edit_contexts, edit_sizes, prepare_image
from omni_runtime.engines.diffusion.bagel.mot import latent_position_ids, velocity
from omni_runtime.engines.diffusion.bagel.sampler import BagelGuidance, Role, SampleResult, sample
from omni_runtime.engines.diffusion.bagel.vae import BagelVae
from omni_runtime.engines.diffusion.bagel.vit import VitWeights, load_vit
from omni_runtime.engines.diffusion.bagel.weights import BagelConfig, BagelWeights, load_weights

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

__all__ = ["MAX_SEED", "BagelGenerator", "MissingContext", "latent_grid", "select_contexts"]

MAX_SEED = 2**63 - 1


class MissingContext(ValueError):
    """The guidance needs a context role the caller did not give (a companion whose KV never arrived)."""

    def __init__(self, role: str, guidance: BagelGuidance) -> None:
        self.role = role
        scale = {"cfg_text": guidance.cfg_text_scale, "cfg_img": guidance.cfg_img_scale}.get(role)
        why = f" (its scale is {scale})" if scale is not None else ""
        super().__init__(
            f"context {role!r} is missing{why}; generation needs it and will not fall back to no guidance: "
            f"send the {role} companion's KV, or set its scale to 1"
        )


def latent_grid(config: BagelConfig, height: int, width: int) -> tuple[int, int]:
    """Latent tokens per column and per row of a `height` x `width` image; ValueError naming a size out of
    bounds (a multiple of the latent downsample, 16 for BAGEL, and at most max_latent_size of them)."""
    step = config.latent_downsample
    largest = config.max_latent_size * step
    for field, value in (("height", height), ("width", width)):
        if isinstance(value, bool) or not isinstance(value, int) or value % step or not step <= value <= largest:
            raise ValueError(f"{field}: {value!r} is not allowed; use a multiple of {step} from {step} to {largest}")
    return height // step, width // step


def select_contexts(
    config: BagelConfig,
    contexts: Mapping[str, KvContext],
    guidance: BagelGuidance,
    dtype: torch.dtype,
    device: torch.device | str,
) -> dict[Role, KvContext]:
    """The contexts `guidance` reads, each checked against the model's shape and moved to `dtype` / `device` once.

    Raises MissingContext for a role the guidance needs (primary, or a companion whose scale is above 1) that
    `contexts` lacks; roles it does not need are ignored."""
    out: dict[Role, KvContext] = {}
    for role in guidance.roles():
        context = contexts.get(role)
        if context is None:
            raise MissingContext(role, guidance)
        context.check_fits(config, role)
        out[role] = KvContext(
            keys=context.keys.to(device=device, dtype=dtype),
            values=context.values.to(device=device, dtype=dtype),
            next_position=context.next_position,
        )
    return out


class BagelGenerator:
    """BAGEL's generation path over one checkpoint: `generate` draws an image from KV contexts."""

    def __init__(self, weights: BagelWeights, vae: BagelVae, vit: VitWeights | None = None) -> None:
        self.weights = weights
        self.vae = vae
        self.vit = vit
        """The ViT an edit's input image goes through (None: this generator draws over given contexts only)."""

    @classmethod
    def from_pretrained(cls, path: Path | str, dtype: torch.dtype | None = None, device: str = "cpu") -> BagelGenerator:
        """Load the generation weights, the AE and the ViT of the BAGEL folder `path` (float32 unless `dtype`)."""
        weights = load_weights(path, dtype, device)
        vae = BagelVae.from_file(
            Path(path) / "ae.safetensors", patch=weights.config.latent_patch_size, dtype=weights.dtype, device=device
        )
        return cls(weights, vae, load_vit(path, weights.dtype, device))

    def edit_sizes(self) -> EditSizes:
        """The resize bounds of an edit's input image on this checkpoint."""
        if self.vit is None:
            raise ValueError("this generator was made without the ViT; it draws no edits")
        return edit_sizes(self.config, self.vit)

    def prepare_edit(self, image: Image.Image) -> EditImage:
        """The VAE's and ViT's views of an edit's input `image`; the edited image takes the VAE view's size."""
        return prepare_image(image, self.edit_sizes())

    def edit_contexts(self, image: EditImage, prompt_ids: Sequence[int], seed: int) -> dict[str, KvContext]:
        """{primary, cfg_text, cfg_img} of editing `image` by the prompt `prompt_ids` (unframed), the VAE
        posterior sampled from `seed` (`edit.edit_contexts`)."""
        assert self.vit is not None
        return edit_contexts(self.weights, self.vae, self.vit, image, self.frame_text(prompt_ids), seed)

    @property
    def config(self) -> BagelConfig:
        """The checkpoint's generation shape."""
        return self.weights.config

    def frame_text(self, token_ids: Sequence[int]) -> list[int]:
        """A text segment as upstream puts it in a context: `<|im_start|>` + ids + `<|im_end|>`."""
        return [self.weights.tokens.bos, *token_ids, self.weights.tokens.eos]

    def prefill(self, token_ids: Sequence[int], past: KvContext | None = None) -> KvContext:
        """The context of `token_ids` after `past` (see `context.prefill`)."""
        return prefill(self.weights, token_ids, past)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """Latent tokens per column and per row of a `height` x `width` image (see `latent_grid`)."""
        return latent_grid(self.config, height, width)

    def noise(self, seed: int, tokens: int) -> torch.Tensor:
        """The initial latents, (tokens, p*p*z) float32, from a CPU generator (the same seed gives the same
        image on any device)."""
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
            raise ValueError(f"seed: {seed!r} is not allowed; use an integer from 0 to {MAX_SEED}")
        generator = torch.Generator(device="cpu").manual_seed(seed)
        return torch.randn(tokens, self.config.patch_latent_dim, generator=generator, dtype=torch.float32)

    def denoise(
        self,
        contexts: Mapping[str, KvContext],
        height: int,
        width: int,
        steps: int,
        seed: int,
        guidance: BagelGuidance | None = None,
        noise: torch.Tensor | None = None,
        on_step: Callable[[int], None] | None = None,
    ) -> SampleResult:
        """The denoised latent tokens (and forwards per role) of one image; `noise` overrides the seeded one;
        `on_step(i)` runs after step i (`sampler.sample`)."""
        guidance = guidance or BagelGuidance()
        grid = self.grid(height, width)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps: {steps!r} is not allowed; use 1 or more")
        ready = select_contexts(self.config, contexts, guidance, self.weights.dtype, self.weights.device)
        tokens = grid[0] * grid[1]
        start = self.noise(seed, tokens) if noise is None else noise
        if start.shape != (tokens, self.config.patch_latent_dim):
            want = (tokens, self.config.patch_latent_dim)
            raise ValueError(f"noise is {tuple(start.shape)}; a {height}x{width} image takes {want}")
        positions = latent_position_ids(*grid, self.config.max_latent_size)
        start = start.to(self.weights.device)  # seeded on the CPU (the same image on any device), denoised here

        def role_velocity(role: Role, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return velocity(self.weights, ready[role], x, t, positions)

        return sample(start, role_velocity, guidance, steps, on_step)

    def generate(
        self,
        contexts: Mapping[str, KvContext],
        height: int,
        width: int,
        steps: int,
        seed: int,
        guidance: BagelGuidance | None = None,
    ) -> np.ndarray:
        """One image, uint8 (height, width, 3), drawn in `steps` denoising steps from the seed's noise."""
        result = self.denoise(contexts, height, width, steps, seed, guidance)
        return self.vae.decode(result.latents, *self.grid(height, width))
