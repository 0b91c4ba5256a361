"""Everything the diffusion engine does differently for Flux- and Qwen-Image-style denoisers.

- Their pipelines pack 2x2 latent patches, so a request's size is a multiple of the VAE scale factor x 2
  whatever the transformer's config says (`packs_latents`, read by `request.size_multiple`).
- A Flux denoiser's q/k/v projections fuse into one matmul per attention (`fuse_qkv`, `FUSE_QKV`).
- With FP8, each Flux single block's `proj_out(cat(attention, GELU(mlp)))` runs as two matmuls with no
  concatenation (`split_single_proj_out`), and GELU's tanh form as `x * sigmoid(2z)` (`fast_gelu`).

`accel` decides when each rewrite applies; see its docstring.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

__all__ = ["FUSE_QKV", "PACKED_PATCH", "fast_gelu", "fuse_qkv", "packs_latents", "split_single_proj_out"]

log = logging.getLogger(__name__)

PACKED_PATCH = 2
"""The latent patch edge of a pipeline that packs its latents (2x2 patches)."""


def packs_latents(pipe: Any) -> bool:
    """Whether the pipeline packs 2x2 latent patches (Flux- and QwenImage-style pipelines, by class name)."""
    return type(pipe).__name__.startswith(("Flux", "QwenImage"))


FUSE_QKV = frozenset({"FluxTransformer2DModel"})
"""Denoisers whose attention processor reads the fused projection (`fused_projections`) in diffusers 0.42 and
whose per-projection layers nothing else reads, so the unfused ones can go (no second copy of the weights)."""


def fuse_qkv(model: Any) -> int:
    """Fuse each attention's q/k/v (and the text stream's added q/k/v) projections into one Linear and drop
    the separate ones; returns how many attentions were fused. Same arithmetic, one matmul instead of three
    (with FP8: one activation quantization instead of three)."""
    import torch

    count = 0
    for module in list(model.modules()):
        if not getattr(module, "_supports_qkv_fusion", False) or not hasattr(module, "fuse_projections"):
            continue
        if getattr(module, "fused_projections", False) or getattr(module, "is_cross_attention", False):
            continue
        with torch.no_grad():
            module.fuse_projections()
        if not getattr(module, "fused_projections", False):
            continue
        for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
            if isinstance(getattr(module, name, None), torch.nn.Linear):
                delattr(module, name)
        count += 1
    return count


_GELU_K = 2.0 * 0.7978845608028654  # 2 * sqrt(2 / pi)


def _gelu_tanh(x: Any) -> Any:
    """GELU's tanh approximation, 0.5 x (1 + tanh(z)), as x * sigmoid(2 z): the same function (0.5 (1 + tanh z)
    is sigmoid(2 z)) up to float rounding, with one exp instead of tanh in the compiled kernel that also takes
    each row's amax and casts it to FP8 (and computes the GELU twice: once for the amax, once for the cast)."""
    import torch

    xf = x.float()
    return (xf * torch.sigmoid(_GELU_K * (xf + 0.044715 * xf * xf * xf))).to(x.dtype)


@functools.cache
def _split_classes() -> tuple[Any, Any, Any]:
    """(the split proj_out module, the single block class using it, diffusers' GELU in its sigmoid form): one class
    each, made once (torch.compile guards on a module's class: one class per block would compile each anew)."""
    import torch
    from diffusers.models.activations import GELU
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    def part(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Linear:
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        linear.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)
        if bias is not None:
            linear.bias = torch.nn.Parameter(bias, requires_grad=False)
        return linear

    class SplitProjOut(torch.nn.Module):
        """proj_out(cat(a, m)) as a @ Wa^T + m @ Wm^T + b: two Linears (each made FP8 with its own per-row
        scales), so the concatenation is never built and each activation is quantized on its own rows."""

        def __init__(self, src: torch.nn.Linear, attn_features: int) -> None:
            super().__init__()
            w = src.weight.detach()
            b = None if src.bias is None else src.bias.detach()
            self.attn_part = part(w[:, :attn_features], b)  # the bias once
            self.mlp_part = part(w[:, attn_features:], None)
            self.in_features, self.out_features = src.in_features, src.out_features

        def forward(self, attn_output: torch.Tensor, mlp_hidden_states: torch.Tensor) -> torch.Tensor:
            return self.attn_part(attn_output) + self.mlp_part(mlp_hidden_states)

    class SplitSingleBlock(FluxSingleTransformerBlock):
        """diffusers 0.42's FluxSingleTransformerBlock.forward, with proj_out taking its two inputs apart."""

        def forward(
            self,
            hidden_states: torch.Tensor,
            encoder_hidden_states: torch.Tensor,
            temb: torch.Tensor,
            image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
            joint_attention_kwargs: dict[str, Any] | None = None,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            text_seq_len = encoder_hidden_states.shape[1]
            hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
            residual = hidden_states
            norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
            mlp_hidden_states = _gelu_tanh(self.proj_mlp(norm_hidden_states))
            attn_output = self.attn(
                hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {})
            )
            hidden_states = residual + gate.unsqueeze(1) * self.proj_out(attn_output, mlp_hidden_states)
            if hidden_states.dtype == torch.float16:
                hidden_states = hidden_states.clip(-65504, 65504)
            return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]

    SplitSingleBlock.__name__ = SplitSingleBlock.__qualname__ = FluxSingleTransformerBlock.__name__  # name lists

    class SigmoidGELU(GELU):
        """diffusers' GELU (Linear + GELU) with the tanh approximation computed as x * sigmoid(2 z)."""

        def gelu(self, gate: torch.Tensor) -> torch.Tensor:
            return _gelu_tanh(gate)

    SigmoidGELU.__name__ = SigmoidGELU.__qualname__ = GELU.__name__
    return SplitProjOut, SplitSingleBlock, SigmoidGELU


def split_single_proj_out(blocks: list[Any]) -> int:
    """Give each Flux single block (diffusers 0.42's layout: the attention output and GELU(proj_mlp) concatenated
    into proj_out) a proj_out split into its attention and MLP parts, and the block's forward that feeds each
    part its own input; returns how many. A block of another layout is left as it is."""
    import torch

    split_out, split_block, _gelu = _split_classes()
    count = 0
    for block in blocks:
        if type(block).__name__ != "FluxSingleTransformerBlock" or type(block) is split_block:
            continue
        proj_out, proj_mlp, act = (getattr(block, n, None) for n in ("proj_out", "proj_mlp", "act_mlp"))
        if not (
            isinstance(proj_out, torch.nn.Linear)
            and isinstance(proj_mlp, torch.nn.Linear)
            and isinstance(act, torch.nn.GELU)
            and act.approximate == "tanh"
            and proj_out.in_features == proj_out.out_features + proj_mlp.out_features
            and getattr(getattr(block, "attn", None), "pre_only", False)
        ):
            log.warning("%s has another layout than diffusers 0.42's: its proj_out stays whole", type(block))
            continue
        block.proj_out = split_out(proj_out, proj_out.out_features)
        block.__class__ = split_block
        count += 1
    return count


def fast_gelu(blocks: list[Any]) -> int:
    """diffusers' GELU modules (tanh approximation) in `blocks` switched to the sigmoid form; returns how many."""
    _split_out, _split_block, sigmoid_gelu = _split_classes()
    from diffusers.models.activations import GELU

    count = 0
    for block in blocks:
        for module in block.modules():
            if type(module) is GELU and module.approximate == "tanh":
                module.__class__ = sigmoid_gelu
                count += 1
    return count
