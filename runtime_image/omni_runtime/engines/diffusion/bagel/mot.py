"""BAGEL's generation forward: one velocity of the latent tokens, attending to a context's K/V.

The query is `<|vision_start|>` + the latent tokens + `<|vision_end|>`, every token at rope position
`context.next_position` (an image takes one position). Mixture of transformers: the two framing tokens run
through the understanding expert, the latent tokens through the generation expert (`*_moe_gen`: layer norms,
q/k/v, q/k norms, o_proj, MLP, final norm); attention is shared and non-causal over context + query. A latent
token's input is `vae2llm(x_t) + time_embedder(t) + latent_pos_embed(position)`; the velocity is
`llm2vae` of its final hidden state (upstream `Bagel._forward_flow`, mode "gen").
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from omni_runtime.engines.diffusion.bagel.context import KvContext
from omni_runtime.engines.diffusion.bagel.ops import (
    apply_rope,
    attend,
    expert_mlp,
    expert_qkv,
    rms_norm,
    rope_cos_sin,
)
from omni_runtime.engines.diffusion.bagel.weights import BagelWeights

__all__ = ["TIME_FREQUENCIES", "latent_position_ids", "time_embedding", "velocity"]

TIME_FREQUENCIES = 256
"""Width of the sinusoidal timestep features BAGEL's TimestepEmbedder reads (DiT's frequency_embedding_size)."""


def latent_position_ids(height_tokens: int, width_tokens: int, max_latent_size: int) -> torch.Tensor:
    """Rows of `latent_pos_embed` for an h x w grid of latent tokens, row-major: i * max_latent_size + j
    (upstream `get_flattened_position_ids_extrapolate`)."""
    rows = torch.arange(height_tokens)[:, None] * max_latent_size
    return (rows + torch.arange(width_tokens)[None, :]).flatten()


def time_embedding(weights: BagelWeights, t: torch.Tensor) -> torch.Tensor:
    """TimestepEmbedder of the scalar timestep `t` in [0, 1]: (1, hidden). cos first, then sin, as DiT's."""
    half = TIME_FREQUENCIES // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half).to(weights.device)
    args = t.reshape(1, 1).to(device=weights.device, dtype=torch.float32) * freqs[None]
    features = torch.cat([torch.cos(args), torch.sin(args)], dim=-1).to(weights.dtype)
    w0, b0, w2, b2 = weights.time_mlp
    return F.linear(F.silu(F.linear(features, w0, b0)), w2, b2)


@torch.no_grad()
def velocity(
    weights: BagelWeights, context: KvContext, x_t: torch.Tensor, t: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    """The flow velocity (tokens, p*p*z) of latents `x_t` at timestep `t`, conditioned on `context`.

    `context` must already be in the weights' dtype and device (the sampler converts each once);
    `position_ids` are `latent_position_ids` of the image's grid."""
    config = weights.config
    dtype = weights.dtype
    tokens = weights.tokens
    frame_ids = torch.tensor([tokens.vision_start, tokens.vision_end], device=weights.device)
    text = weights.embed_tokens[frame_ids]
    latent = (
        F.linear(x_t.to(device=weights.device, dtype=dtype), *weights.vae2llm)
        + time_embedding(weights, t)
        + weights.latent_pos_embed[position_ids.to(weights.device)]
    )
    length = latent.shape[0] + 2
    position = torch.full((1,), context.next_position, device=weights.device)
    cos, sin = rope_cos_sin(position, config, dtype)
    cos, sin = cos.expand(length, -1), sin.expand(length, -1)
    for index, layer in enumerate(weights.layers):
        text_q, text_k, text_v = expert_qkv(
            rms_norm(text, layer.und.input_norm, config.rms_norm_eps), layer.und.attention, config
        )
        lat_q, lat_k, lat_v = expert_qkv(
            rms_norm(latent, layer.gen.input_norm, config.rms_norm_eps), layer.gen.attention, config
        )
        # the query's order, as upstream packs it: vision_start, latents, vision_end
        q = apply_rope(torch.cat([text_q[:1], lat_q, text_q[1:]]), cos, sin)
        k = apply_rope(torch.cat([text_k[:1], lat_k, text_k[1:]]), cos, sin)
        v = torch.cat([text_v[:1], lat_v, text_v[1:]])
        attended = attend(
            q, torch.cat([context.keys[:, index], k]), torch.cat([context.values[:, index], v]), causal=False
        )
        text = text + F.linear(attended[[0, length - 1]], layer.und.attention.o_weight)
        latent = latent + F.linear(attended[1 : length - 1], layer.gen.attention.o_weight)
        text = text + expert_mlp(rms_norm(text, layer.und.post_attention_norm, config.rms_norm_eps), layer.und)
        latent = latent + expert_mlp(rms_norm(latent, layer.gen.post_attention_norm, config.rms_norm_eps), layer.gen)
    return F.linear(rms_norm(latent, weights.norm_gen, config.rms_norm_eps), *weights.llm2vae)
