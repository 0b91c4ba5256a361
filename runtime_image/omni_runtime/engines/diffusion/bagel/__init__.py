"""BAGEL's generation path in torch: the generation expert attending to a thinker's KV, the sampler, the VAE.

vLLM serves BAGEL's understanding path (`BagelForConditionalGeneration`, the thinker); its generation
weights (`*_moe_gen`, `vae2llm`, `llm2vae`, `time_embedder`, `latent_pos_embed`) and the FLUX AE are run here.

- `weights`: the config and the tensors generation reads from a checkpoint folder.
- `ops`: the Qwen2 pieces both forwards share (RMSNorm, rope, an expert's q/k/v and MLP, attention).
- `context`: `KvContext` (every layer's K/V of a context, time first) and `prefill` (a plain-torch und forward).
- `mot`: the generation forward (one velocity), text tokens through the und expert, latents through gen.
- `sampler`: the flow-matching loop and classifier-free guidance (`BagelGuidance`).
- `vae`: the FLUX AE as diffusers' AutoencoderKL, BAGEL's latent packing.
- `generate`: `BagelGenerator`, contexts by role in, an image out.

Importing this package imports torch (the engine's modules need it) but not diffusers (only `vae` loads it).
"""

from omni_runtime.engines.diffusion.bagel.context import KvContext, empty_context, prefill
from omni_runtime.engines.diffusion.bagel.generate import BagelGenerator, MissingContext
from omni_runtime.engines.diffusion.bagel.sampler import ROLES, BagelGuidance, Role, SampleResult

__all__ = [
    "ROLES",
    "BagelGenerator",
    "BagelGuidance",
    "KvContext",
    "MissingContext",
    "Role",
    "SampleResult",
    "empty_context",
    "prefill",
]
