"""The Qwen2 pieces both BAGEL forwards share: RMSNorm, rope, one expert's q/k/v and MLP, attention.

Every function is the math of upstream's `modeling/bagel/qwen2_navit.py` (itself Qwen2's) written over
plain tensors: rope after the q/k norms, K stored after rope, attention scaled by head_dim**-0.5 with
grouped KV heads (query head h reads KV head h // (heads / kv_heads), as flash-attn and SDPA's GQA do).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omni_runtime.engines.diffusion.bagel.weights import AttentionWeights, BagelConfig, ExpertWeights

__all__ = ["apply_rope", "attend", "expert_mlp", "expert_qkv", "rms_norm", "rope_cos_sin"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen2RMSNorm: normalise in float32, cast back, then scale (the order matters in bfloat16)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rope_cos_sin(positions: torch.Tensor, config: BagelConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, (tokens, head_dim) each, of Qwen2's default rope at integer `positions` (computed in float32)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (tokens, heads, head_dim) by per-token cos/sin (tokens, head_dim): x cos + rotate_half(x) sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def expert_qkv(
    x: torch.Tensor, attention: AttentionWeights, config: BagelConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (tokens, heads, d), k and v (tokens, kv_heads, d) of normed hidden states `x`, q/k normed, no rope yet."""
    q = F.linear(x, attention.q_weight, attention.q_bias).view(-1, config.num_heads, config.head_dim)
    k = F.linear(x, attention.k_weight, attention.k_bias).view(-1, config.num_kv_heads, config.head_dim)
    v = F.linear(x, attention.v_weight, attention.v_bias).view(-1, config.num_kv_heads, config.head_dim)
    if attention.q_norm is not None and attention.k_norm is not None:
        q = rms_norm(q, attention.q_norm, config.rms_norm_eps)
        k = rms_norm(k, attention.k_norm, config.rms_norm_eps)
    return q, k, v


def expert_mlp(x: torch.Tensor, expert: ExpertWeights) -> torch.Tensor:
    """Qwen2MLP: down(silu(gate(x)) * up(x))."""
    return F.linear(F.silu(F.linear(x, expert.gate_proj)) * F.linear(x, expert.up_proj), expert.down_proj)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """Attention of q (Lq, heads, d) over k, v (Lk, kv_heads, d); (Lq, heads * d) out.

    `causal`: query i sees keys up to Lk - Lq + i (the queries are the last Lq of the keys, after a cached
    past); otherwise every query sees every key (BAGEL's image tokens attend to one another both ways)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    mask = None
    if causal:
        lq, lk = q.shape[0], k.shape[0]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask
    )
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)
