"""BAGEL's ViT path into a context: SigLIP (NaViT packing) -> connector -> the ViT position embedding.

An edit puts its input image into the context twice: through the VAE (`edit`) and through this ViT, whose
tokens then run through the understanding expert. The math is upstream's `modeling/bagel/siglip_navit.py` for
one image (its varlen flash attention over one sequence is full attention) and `Bagel.forward_cache_update_vit`:
patches (row-major, each `p x p x 3` in that order) through the linear patch embedding, plus the learned position
embedding of each patch's (row * max_patches_per_side + column); SigLIP encoder layers (pre-LayerNorm, biased
q/k/v/out, tanh-GELU MLP); the post LayerNorm; the connector MLP (fc1, tanh-GELU, fc2) to the LLM's width; plus
`vit_pos_embed` at the same position ids. BAGEL-7B-MoT's ViT stores 27 layers and runs 26 (upstream app.py and
vLLM both drop the last); a checkpoint of any other depth runs every layer it stores.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from omni_runtime.engines.diffusion.bagel.weights import CheckpointError, TensorSource

__all__ = ["VitWeights", "load_vit", "vit_patches", "vit_position_ids", "vit_tokens"]

UNUSED_LAST_LAYER_DEPTH = 27
"""A ViT of this depth is BAGEL-7B-MoT's SigLIP-so400m, whose last layer BAGEL never ran (it reads the one before)."""


class _VitConfig(BaseModel):
    """vit_config.json, the fields the forward reads."""

    model_config = ConfigDict(extra="ignore")

    hidden_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    patch_size: int = Field(gt=0)
    layer_norm_eps: float = Field(gt=0)
    hidden_act: str = "gelu_pytorch_tanh"


@dataclass(frozen=True)
class VitLayer:
    """One SigLIP encoder layer: (weight, bias) pairs."""

    norm1: tuple[torch.Tensor, torch.Tensor]
    q: tuple[torch.Tensor, torch.Tensor]
    k: tuple[torch.Tensor, torch.Tensor]
    v: tuple[torch.Tensor, torch.Tensor]
    out: tuple[torch.Tensor, torch.Tensor]
    norm2: tuple[torch.Tensor, torch.Tensor]
    fc1: tuple[torch.Tensor, torch.Tensor]
    fc2: tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class VitWeights:
    """The ViT, its connector and position embeddings of a BAGEL checkpoint."""

    patch_size: int
    max_patches_per_side: int
    """Position ids are row * this + column (config `vit_max_num_patch_per_side`)."""
    heads: int
    eps: float
    patch_embedding: tuple[torch.Tensor, torch.Tensor]
    """Linear over a flattened p x p x 3 patch (the checkpoint stores BAGEL's conv-as-linear)."""
    position_embedding: torch.Tensor
    layers: tuple[VitLayer, ...]
    post_norm: tuple[torch.Tensor, torch.Tensor]
    connector: tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    pos_embed: torch.Tensor
    """`vit_pos_embed`: (max_patches_per_side**2, llm hidden), added after the connector."""

    @property
    def max_side(self) -> int:
        """The largest image side the position tables cover, in pixels."""
        return self.max_patches_per_side * self.patch_size


def load_vit(path: Path | str, dtype: torch.dtype, device: str = "cpu") -> VitWeights:
    """The ViT of the BAGEL checkpoint folder `path`, in `dtype` on `device`; CheckpointError when a tensor or
    config field is missing or disagrees with another."""
    folder = Path(path)
    try:
        config = _VitConfig.model_validate(json.loads((folder / "vit_config.json").read_text()))
        top = json.loads((folder / "config.json").read_text())
        per_side = int(top["vit_max_num_patch_per_side"])
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{folder}: cannot read the ViT's config (vit_config.json, config.json): {exc}") from exc
    if config.hidden_act != "gelu_pytorch_tanh":
        raise CheckpointError(f"{folder}: vit hidden_act {config.hidden_act!r}; BAGEL's SigLIP uses gelu_pytorch_tanh")
    source = TensorSource(folder / "ema.safetensors", dtype, device)
    prefix = "vit_model.vision_model."

    def pair(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return source.get(f"{name}.weight"), source.get(f"{name}.bias")

    depth = config.num_hidden_layers - (config.num_hidden_layers == UNUSED_LAST_LAYER_DEPTH)
    layers = []
    for i in range(depth):
        at = f"{prefix}encoder.layers.{i}."
        layers.append(
            VitLayer(
                norm1=pair(at + "layer_norm1"),
                q=pair(at + "self_attn.q_proj"),
                k=pair(at + "self_attn.k_proj"),
                v=pair(at + "self_attn.v_proj"),
                out=pair(at + "self_attn.out_proj"),
                norm2=pair(at + "layer_norm2"),
                fc1=pair(at + "mlp.fc1"),
                fc2=pair(at + "mlp.fc2"),
            )
        )
    position = source.get(f"{prefix}embeddings.position_embedding.weight")
    pos_embed = source.get("vit_pos_embed.pos_embed")
    if position.shape[0] < per_side**2 or pos_embed.shape[0] != per_side**2:
        raise CheckpointError(
            f"{folder}: the ViT position tables ({position.shape[0]}, {pos_embed.shape[0]} rows) do not cover "
            f"vit_max_num_patch_per_side {per_side} squared"
        )
    return VitWeights(
        patch_size=config.patch_size,
        max_patches_per_side=per_side,
        heads=config.num_attention_heads,
        eps=config.layer_norm_eps,
        patch_embedding=pair(f"{prefix}embeddings.patch_embedding"),
        position_embedding=position,
        layers=tuple(layers),
        post_norm=pair(f"{prefix}post_layernorm"),
        connector=(pair("connector.fc1"), pair("connector.fc2")),
        pos_embed=pos_embed,
    )


def vit_patches(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """(3, H, W) -> (H/p * W/p, p*p*3): patches row-major, each flattened (row, column, channel) as upstream's
    `patchify`."""
    c, h, w = pixels.shape
    grid = pixels.reshape(c, h // patch, patch, w // patch, patch)
    return torch.einsum("chpwq->hwpqc", grid).reshape(-1, patch * patch * c)


def vit_position_ids(height: int, width: int, patch: int, per_side: int) -> torch.Tensor:
    """Position-table rows of an image's patches: row * per_side + column (upstream's extrapolating ids)."""
    rows = torch.arange(height // patch)[:, None] * per_side
    return (rows + torch.arange(width // patch)[None, :]).flatten()


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


@torch.no_grad()
def vit_tokens(vit: VitWeights, pixels: torch.Tensor) -> torch.Tensor:
    """The LLM-width embeddings (tokens, hidden) of one image, (3, H, W) in [-1, 1] with sides multiples of the
    patch size and at most `max_side`."""
    _, height, width = pixels.shape
    p = vit.patch_size
    if height % p or width % p or max(height, width) > vit.max_side:
        raise ValueError(f"a ViT image of {width}x{height} must have sides multiple of {p}, at most {vit.max_side}")
    dtype = vit.pos_embed.dtype
    device = vit.pos_embed.device
    ids = vit_position_ids(height, width, p, vit.max_patches_per_side).to(device)
    x = F.linear(vit_patches(pixels.to(device=device, dtype=dtype), p), *vit.patch_embedding)
    x = x + vit.position_embedding[ids]
    tokens, width_ = x.shape
    head_dim = width_ // vit.heads
    for layer in vit.layers:
        h = F.layer_norm(x, (width_,), *layer.norm1, eps=vit.eps)
        q, k, v = (
            F.linear(h, *w).to(torch.bfloat16).view(tokens, vit.heads, head_dim).transpose(0, 1)
            for w in (layer.q, layer.k, layer.v)
        )
        # in bfloat16, as upstream always runs it (flash-attn), whatever the rest of the model's dtype
        attended = F.scaled_dot_product_attention(q[None], k[None], v[None])[0].to(x.dtype)
        x = x + F.linear(attended.transpose(0, 1).reshape(tokens, width_), *layer.out)
        h = F.layer_norm(x, (width_,), *layer.norm2, eps=vit.eps)
        x = x + F.linear(_gelu(F.linear(h, *layer.fc1)), *layer.fc2)
    x = F.layer_norm(x, (width_,), *vit.post_norm, eps=vit.eps)
    (fc1, fc2) = vit.connector
    x = F.linear(_gelu(F.linear(x, *fc1)), *fc2)
    return x + vit.pos_embed[ids]
