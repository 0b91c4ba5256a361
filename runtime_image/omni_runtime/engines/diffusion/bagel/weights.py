"""What BAGEL's generation path reads from a checkpoint folder: the config and the tensors it runs.

From `config.json` (its `llm_config`, or `llm_config.json` for checkpoints whose config.json predates the
`bagel` model type) and `ema.safetensors`, only what generation needs: every `language_model.model.*` tensor
(the generation expert `*_moe_gen` for latent tokens, the understanding expert for the text tokens of the
query and for `context.prefill`), `time_embedder`, `vae2llm`, `llm2vae` and `latent_pos_embed`. The lm head,
the ViT and its connector stay on disk. The special token ids come from `tokenizer.json`.

Tensors are plain torch tensors in frozen dataclasses (no nn.Module): the forward in `ops` / `mot` /
`context` is a function of them, which keeps the two experts' weights side by side and explicit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

if TYPE_CHECKING:
    import torch

__all__ = [
    "AttentionWeights",
    "BagelConfig",
    "BagelWeights",
    "CheckpointError",
    "ExpertWeights",
    "LayerWeights",
    "SpecialTokens",
    "load_weights",
    "read_config",
]


class CheckpointError(ValueError):
    """A BAGEL checkpoint folder that lacks a file, a tensor or a config field generation needs."""


class _LlmConfig(BaseModel):
    """The Qwen2 fields of `llm_config` generation reads (others are ignored)."""

    model_config = ConfigDict(extra="ignore")

    hidden_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    rms_norm_eps: float = Field(gt=0)
    rope_theta: float | None = None
    rope_parameters: dict[str, Any] | None = None
    rope_scaling: dict[str, Any] | None = None
    qk_norm: bool = True
    """BAGEL-7B-MoT runs with qk_norm (upstream app.py sets it whatever llm_config.json says)."""
    vocab_size: int = Field(gt=0)


class _VaeConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    z_channels: int = Field(16, gt=0)
    downsample: int = Field(8, gt=0)


class _CheckpointConfig(BaseModel):
    """config.json of a BAGEL checkpoint, the fields generation reads (BagelConfig's defaults otherwise)."""

    model_config = ConfigDict(extra="ignore")

    llm_config: _LlmConfig
    vae_config: _VaeConfig = _VaeConfig()
    latent_patch_size: int = Field(2, gt=0)
    max_latent_size: int = Field(32, gt=0)


@dataclass(frozen=True)
class BagelConfig:
    """The shape of BAGEL's generation path, resolved from a checkpoint's config files."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    qk_norm: bool
    latent_channels: int
    """The VAE's z channels (16 for FLUX's AE)."""
    vae_downsample: int
    latent_patch_size: int
    max_latent_size: int
    """Latent patches per side the position table holds: images are at most this x `latent_downsample` px."""

    @property
    def latent_downsample(self) -> int:
        """Pixels per latent token along each side (VAE downsample x latent patch size; 16 for BAGEL)."""
        return self.vae_downsample * self.latent_patch_size

    @property
    def patch_latent_dim(self) -> int:
        """Channels of one latent token: p x p x z (the `(p, q, c)` order of upstream's patchify)."""
        return self.latent_patch_size**2 * self.latent_channels


@dataclass(frozen=True)
class SpecialTokens:
    """Token ids the generation query and a prompt context are framed with (upstream `new_token_ids`)."""

    bos: int
    """`<|im_start|>`: upstream frames every text segment of a context as bos + text + eos."""
    eos: int
    """`<|im_end|>`."""
    vision_start: int
    vision_end: int


@dataclass(frozen=True)
class AttentionWeights:
    """One expert's attention projections; the q/k norms are None when the checkpoint has no qk_norm."""

    q_weight: torch.Tensor
    q_bias: torch.Tensor
    k_weight: torch.Tensor
    k_bias: torch.Tensor
    v_weight: torch.Tensor
    v_bias: torch.Tensor
    o_weight: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


@dataclass(frozen=True)
class ExpertWeights:
    """One expert's share of a decoder layer (BAGEL's MoT: every weight but the shared attention itself)."""

    input_norm: torch.Tensor
    attention: AttentionWeights
    post_attention_norm: torch.Tensor
    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor


@dataclass(frozen=True)
class LayerWeights:
    """A Qwen2MoTDecoderLayer: `und` runs text (and ViT) tokens, `gen` the latent tokens."""

    und: ExpertWeights
    gen: ExpertWeights


@dataclass(frozen=True)
class BagelWeights:
    """Everything the generation forward and `context.prefill` compute with."""

    config: BagelConfig
    tokens: SpecialTokens
    embed_tokens: torch.Tensor
    layers: tuple[LayerWeights, ...]
    norm_und: torch.Tensor
    norm_gen: torch.Tensor
    time_mlp: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    """time_embedder.mlp.0 weight, bias, mlp.2 weight, bias (Linear, SiLU, Linear)."""
    vae2llm: tuple[torch.Tensor, torch.Tensor]
    llm2vae: tuple[torch.Tensor, torch.Tensor]
    latent_pos_embed: torch.Tensor
    """(max_latent_size**2, hidden): the row of latent patch (i, j) is i * max_latent_size + j."""

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype every tensor was loaded in."""
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        """Where the tensors live."""
        return self.embed_tokens.device


def _rope_theta(llm: _LlmConfig) -> float:
    """rope theta from llm_config, refusing rope scalings this forward does not implement."""
    params = llm.rope_parameters or llm.rope_scaling or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise CheckpointError(f"llm_config rope_type {kind!r} is not supported; BAGEL uses the default rope")
    theta = params.get("rope_theta", llm.rope_theta)
    if theta is None:
        raise CheckpointError("llm_config has no rope_theta (nor rope_parameters.rope_theta)")
    return float(theta)


def read_config(path: Path | str) -> BagelConfig:
    """The generation shape of the checkpoint at `path` (config.json, else llm_config.json for the LM part)."""
    folder = Path(path)
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        raw = {}  # the original BAGEL-7B-MoT release shipped a config.json that is not JSON
    if not isinstance(raw, dict):
        raw = {}
    if "llm_config" not in raw:
        try:
            raw["llm_config"] = json.loads((folder / "llm_config.json").read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(
                f"{folder}: config.json has no llm_config and llm_config.json is unreadable ({exc}); "
                "is this a BAGEL checkpoint?"
            ) from exc
    try:
        parsed = _CheckpointConfig.model_validate(raw)
    except ValidationError as exc:
        raise CheckpointError(f"{folder}: not a BAGEL config: {exc}") from exc
    llm = parsed.llm_config
    if llm.hidden_size % llm.num_attention_heads or llm.num_attention_heads % llm.num_key_value_heads:
        raise CheckpointError(
            f"{folder}: hidden_size {llm.hidden_size}, {llm.num_attention_heads} heads and "
            f"{llm.num_key_value_heads} KV heads do not divide evenly"
        )
    return BagelConfig(
        hidden_size=llm.hidden_size,
        num_layers=llm.num_hidden_layers,
        num_heads=llm.num_attention_heads,
        num_kv_heads=llm.num_key_value_heads,
        head_dim=llm.hidden_size // llm.num_attention_heads,
        rms_norm_eps=llm.rms_norm_eps,
        rope_theta=_rope_theta(llm),
        qk_norm=llm.qk_norm,
        latent_channels=parsed.vae_config.z_channels,
        vae_downsample=parsed.vae_config.downsample,
        latent_patch_size=parsed.latent_patch_size,
        max_latent_size=parsed.max_latent_size,
    )


def read_special_tokens(path: Path | str) -> SpecialTokens:
    """BAGEL's framing token ids from the folder's tokenizer.json (its added tokens)."""
    file = Path(path) / "tokenizer.json"
    try:
        added = json.loads(file.read_text()).get("added_tokens", [])
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file} is unreadable ({exc}); BAGEL's special token ids come from it") from exc
    ids: dict[str, int] = {
        entry["content"]: entry["id"]
        for entry in added
        if isinstance(entry, dict) and isinstance(entry.get("content"), str) and isinstance(entry.get("id"), int)
    }
    wanted = {
        "bos": "<|im_start|>",
        "eos": "<|im_end|>",
        "vision_start": "<|vision_start|>",
        "vision_end": "<|vision_end|>",
    }
    missing = [token for token in wanted.values() if token not in ids]
    if missing:
        raise CheckpointError(f"{file} lacks the added tokens {missing}; BAGEL frames contexts and images with them")
    return SpecialTokens(**{name: ids[token] for name, token in wanted.items()})


class TensorSource:
    """Reads named tensors from one safetensors file, converted to the engine's dtype and device."""

    def __init__(self, file: Path, dtype: torch.dtype, device: str) -> None:
        from safetensors import safe_open

        if not file.is_file():
            raise CheckpointError(f"{file} is missing; BAGEL's generation weights are read from it")
        self.file = file
        self.handle = safe_open(str(file), framework="pt", device="cpu")
        self.names = set(self.handle.keys())
        self.dtype = dtype
        self.device = device

    def get(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise CheckpointError(f"{self.file} has no tensor {name!r}; generation needs it")
        return self.handle.get_tensor(name).to(device=self.device, dtype=self.dtype)


def _expert(source: TensorSource, layer: int, suffix: str, qk_norm: bool) -> ExpertWeights:
    """Layer `layer`'s understanding expert (suffix "") or generation expert (suffix "_moe_gen")."""
    prefix = f"language_model.model.layers.{layer}."
    attn = prefix + "self_attn."
    return ExpertWeights(
        input_norm=source.get(f"{prefix}input_layernorm{suffix}.weight"),
        attention=AttentionWeights(
            q_weight=source.get(f"{attn}q_proj{suffix}.weight"),
            q_bias=source.get(f"{attn}q_proj{suffix}.bias"),
            k_weight=source.get(f"{attn}k_proj{suffix}.weight"),
            k_bias=source.get(f"{attn}k_proj{suffix}.bias"),
            v_weight=source.get(f"{attn}v_proj{suffix}.weight"),
            v_bias=source.get(f"{attn}v_proj{suffix}.bias"),
            o_weight=source.get(f"{attn}o_proj{suffix}.weight"),
            q_norm=source.get(f"{attn}q_norm{suffix}.weight") if qk_norm else None,
            k_norm=source.get(f"{attn}k_norm{suffix}.weight") if qk_norm else None,
        ),
        post_attention_norm=source.get(f"{prefix}post_attention_layernorm{suffix}.weight"),
        gate_proj=source.get(f"{prefix}mlp{suffix}.gate_proj.weight"),
        up_proj=source.get(f"{prefix}mlp{suffix}.up_proj.weight"),
        down_proj=source.get(f"{prefix}mlp{suffix}.down_proj.weight"),
    )


def load_weights(path: Path | str, dtype: torch.dtype | None = None, device: str = "cpu") -> BagelWeights:
    """The generation weights of the BAGEL checkpoint at `path`, in `dtype` (float32 unless given) on `device`."""
    import torch

    folder = Path(path)
    config = read_config(folder)
    source = TensorSource(folder / "ema.safetensors", dtype or torch.float32, device)
    layers = tuple(
        LayerWeights(und=_expert(source, i, "", config.qk_norm), gen=_expert(source, i, "_moe_gen", config.qk_norm))
        for i in range(config.num_layers)
    )
    pos_embed = source.get("latent_pos_embed.pos_embed")
    if pos_embed.shape != (config.max_latent_size**2, config.hidden_size):
        raise CheckpointError(
            f"latent_pos_embed.pos_embed is {tuple(pos_embed.shape)}, config max_latent_size "
            f"{config.max_latent_size} and hidden {config.hidden_size} say "
            f"({config.max_latent_size**2}, {config.hidden_size})"
        )
    return BagelWeights(
        config=config,
        tokens=read_special_tokens(folder),
        embed_tokens=source.get("language_model.model.embed_tokens.weight"),
        layers=layers,
        norm_und=source.get("language_model.model.norm.weight"),
        norm_gen=source.get("language_model.model.norm_moe_gen.weight"),
        time_mlp=(
            source.get("time_embedder.mlp.0.weight"),
            source.get("time_embedder.mlp.0.bias"),
            source.get("time_embedder.mlp.2.weight"),
            source.get("time_embedder.mlp.2.bias"),
        ),
        vae2llm=(source.get("vae2llm.weight"), source.get("vae2llm.bias")),
        llm2vae=(source.get("llm2vae.weight"), source.get("llm2vae.bias")),
        latent_pos_embed=pos_embed,
    )
