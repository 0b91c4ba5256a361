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
from typing import Literal

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

__all__ = [
    "TIME_FREQUENCIES",
    "extend_with_image",
    "latent_embeddings",
    "latent_position_ids",
    "time_embedding",
    "velocity",
]

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


def _image_block(
    weights: BagelWeights, context: KvContext, inner: torch.Tensor, expert: Literal["und", "gen"], keep_kv: bool
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """`<|vision_start|>` + `inner` (embeddings) + `<|vision_end|>` at one rope position after `context`, attending
    to the context and to one another (non-causal); the framing tokens through the und expert, `inner` through
    `expert`. The final hidden states of `inner`, and with `keep_kv` every layer's K (after rope) and V of the
    block's tokens."""
    config = weights.config
    frame_ids = torch.tensor([weights.tokens.vision_start, weights.tokens.vision_end], device=weights.device)
    text = weights.embed_tokens[frame_ids]
    length = inner.shape[0] + 2
    position = torch.full((1,), context.next_position, device=weights.device)
    cos, sin = rope_cos_sin(position, config, weights.dtype)
    cos, sin = cos.expand(length, -1), sin.expand(length, -1)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for index, layer in enumerate(weights.layers):
        experts = layer.und, (layer.gen if expert == "gen" else layer.und)
        text_q, text_k, text_v = expert_qkv(
            rms_norm(text, experts[0].input_norm, config.rms_norm_eps), experts[0].attention, config
        )
        in_q, in_k, in_v = expert_qkv(
            rms_norm(inner, experts[1].input_norm, config.rms_norm_eps), experts[1].attention, config
        )
        # the query's order, as upstream packs it: vision_start, inner tokens, vision_end
        q = apply_rope(torch.cat([text_q[:1], in_q, text_q[1:]]), cos, sin)
        k = apply_rope(torch.cat([text_k[:1], in_k, text_k[1:]]), cos, sin)
        v = torch.cat([text_v[:1], in_v, text_v[1:]])
        if keep_kv:
            keys.append(k)
            values.append(v)
        attended = attend(
            q, torch.cat([context.keys[:, index], k]), torch.cat([context.values[:, index], v]), causal=False
        )
        text = text + F.linear(attended[[0, length - 1]], experts[0].attention.o_weight)
        inner = inner + F.linear(attended[1 : length - 1], experts[1].attention.o_weight)
        text = text + expert_mlp(rms_norm(text, experts[0].post_attention_norm, config.rms_norm_eps), experts[0])
        inner = inner + expert_mlp(rms_norm(inner, experts[1].post_attention_norm, config.rms_norm_eps), experts[1])
    return inner, keys, values


def latent_embeddings(
    weights: BagelWeights, latents: torch.Tensor, t: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    """A latent token's input: `vae2llm(x_t) + time_embedder(t) + latent_pos_embed(position)`."""
    return (
        F.linear(latents.to(device=weights.device, dtype=weights.dtype), *weights.vae2llm)
        + time_embedding(weights, t)
        + weights.latent_pos_embed[position_ids.to(weights.device)]
    )


@torch.no_grad()
def velocity(
    weights: BagelWeights, context: KvContext, x_t: torch.Tensor, t: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    """The flow velocity (tokens, p*p*z) of latents `x_t` at timestep `t`, conditioned on `context`.

    `context` must already be in the weights' dtype and device (the sampler converts each once);
    `position_ids` are `latent_position_ids` of the image's grid."""
    latent = latent_embeddings(weights, x_t, t, position_ids)
    hidden, _, _ = _image_block(weights, context, latent, "gen", keep_kv=False)
    return F.linear(rms_norm(hidden, weights.norm_gen, weights.config.rms_norm_eps), *weights.llm2vae)


@torch.no_grad()
def extend_with_image(
    weights: BagelWeights, context: KvContext, inner: torch.Tensor, expert: Literal["und", "gen"]
) -> KvContext:
    """`context` followed by an image block (`<|vision_start|>` + `inner` + `<|vision_end|>`, all at the
    context's next rope position, which then advances by one): upstream's `forward_cache_update_vae` (inner =
    clean latent embeddings at t = 0, through the gen expert) and `forward_cache_update_vit` (inner = ViT tokens,
    through the und expert)."""
    context = KvContext(
        keys=context.keys.to(device=weights.device, dtype=weights.dtype),
        values=context.values.to(device=weights.device, dtype=weights.dtype),
        next_position=context.next_position,
    )
    _, keys, values = _image_block(weights, context, inner.to(weights.dtype), expert, keep_kv=True)
    return KvContext(
        keys=torch.cat([context.keys, torch.stack(keys, dim=1)]),
        values=torch.cat([context.values, torch.stack(values, dim=1)]),
        next_position=context.next_position + 1,
    )
