"""The context a BAGEL image is generated in: every layer's K and V of the tokens before it.

`KvContext` is what the thinker stage hands the dit stage per role (primary, cfg_text, cfg_img): K after rope,
V, time first (tokens, layers, kv_heads, head_dim), and the rope position the image takes. `prefill` computes
one in plain torch with the understanding expert, as upstream `forward_cache_update_text` does: it is the
reference vLLM's exported KV is compared against, and what an in-process generation uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from omni_runtime.engines.diffusion.bagel.ops import (
    apply_rope,
    attend,
    expert_mlp,
    expert_qkv,
    rms_norm,
    rope_cos_sin,
)
from omni_runtime.engines.diffusion.bagel.weights import BagelConfig, BagelWeights

__all__ = ["KvContext", "empty_context", "prefill"]


@dataclass(frozen=True)
class KvContext:
    """Every layer's K (after rope) and V of a context's tokens, and the rope position that follows them."""

    keys: torch.Tensor
    """(tokens, layers, kv_heads, head_dim)."""
    values: torch.Tensor
    """(tokens, layers, kv_heads, head_dim), the same shape as `keys`."""
    next_position: int
    """The rope position the generated image's tokens take (upstream's `curr_rope`). For a text-only context
    it is the token count; an image in the context advances it by one only (all its tokens share one
    position), so in general it is not the token count."""

    def __post_init__(self) -> None:
        if self.keys.ndim != 4 or self.keys.shape != self.values.shape:
            raise ValueError(
                f"KvContext keys {tuple(self.keys.shape)} and values {tuple(self.values.shape)} must both be "
                "(tokens, layers, kv_heads, head_dim)"
            )
        if self.next_position < 0:
            raise ValueError(f"KvContext next_position {self.next_position} must be >= 0")

    @property
    def num_tokens(self) -> int:
        """Context tokens the image attends to."""
        return int(self.keys.shape[0])

    def check_fits(self, config: BagelConfig, role: str) -> None:
        """Refuse a context from a model of another shape, naming both sides (a mixed rollout makes garbage)."""
        _, layers, kv_heads, head_dim = self.keys.shape
        ours = (config.num_layers, config.num_kv_heads, config.head_dim)
        if (layers, kv_heads, head_dim) != ours:
            raise ValueError(
                f"context {role!r} has (layers, kv_heads, head_dim) = {(layers, kv_heads, head_dim)}, this model "
                f"{ours}; the thinker and the dit must serve the same checkpoint"
            )


def empty_context(config: BagelConfig, dtype: torch.dtype = torch.float32, device: str = "cpu") -> KvContext:
    """A context of no tokens at rope position 0: upstream's fresh `init_gen_context()`, the cfg_text context of
    a text-to-image request (the image then attends to itself alone)."""
    shape = (0, config.num_layers, config.num_kv_heads, config.head_dim)
    empty = torch.zeros(shape, dtype=dtype, device=device)
    return KvContext(keys=empty, values=empty.clone(), next_position=0)


@torch.no_grad()
def prefill(weights: BagelWeights, token_ids: Sequence[int], past: KvContext | None = None) -> KvContext:
    """The context of `token_ids` (after `past`, if given): a causal und-expert forward, every layer's K and V.

    Positions run from `past.next_position` (0 without one); the result holds past's tokens then these, and
    its next_position is the last position + 1. Upstream frames a text segment as `<|im_start|>` + text +
    `<|im_end|>` (`prepare_prompts`); the caller passes the ids as it wants them framed."""
    config = weights.config
    if not token_ids:
        raise ValueError("prefill needs at least one token id")
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=weights.device)
    if int(ids.min()) < 0 or int(ids.max()) >= weights.embed_tokens.shape[0]:
        raise ValueError(f"token ids must lie in [0, {weights.embed_tokens.shape[0]}); got {ids.min()}..{ids.max()}")
    start = past.next_position if past is not None else 0
    if past is not None:
        past.check_fits(config, "past")
    positions = torch.arange(start, start + len(ids), device=weights.device)
    cos, sin = rope_cos_sin(positions, config, weights.dtype)
    hidden = weights.embed_tokens[ids]
    keys, values = [], []
    for index, layer in enumerate(weights.layers):
        normed = rms_norm(hidden, layer.und.input_norm, config.rms_norm_eps)
        q, k, v = expert_qkv(normed, layer.und.attention, config)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys.append(k)
        values.append(v)
        if index == len(weights.layers) - 1:
            break  # the last layer's K/V are all a context holds; its attention output feeds nothing
        if past is not None:
            k = torch.cat([past.keys[:, index].to(k.dtype), k])
            v = torch.cat([past.values[:, index].to(v.dtype), v])
        attended = attend(q, k, v, causal=True)
        hidden = hidden + torch.nn.functional.linear(attended, layer.und.attention.o_weight)
        normed = rms_norm(hidden, layer.und.post_attention_norm, config.rms_norm_eps)
        hidden = hidden + expert_mlp(normed, layer.und)
    new_keys, new_values = torch.stack(keys, dim=1), torch.stack(values, dim=1)
    if past is not None:
        new_keys = torch.cat([past.keys.to(new_keys.dtype), new_keys])
        new_values = torch.cat([past.values.to(new_values.dtype), new_values])
    return KvContext(keys=new_keys, values=new_values, next_position=start + len(ids))
