"""Revisions of a tiny model: what a user's model roll brings, a new checkpoint in a folder of its own.

- `<name>-r2` (`build_retrained`): the same files, every floating-point weight moved by seeded noise (a tenth
  of the tensor's spread): the same architecture and tokenizer, other weights, so the same request gives
  another answer. The rollout tests change `spec.model` to it under load.
- `tiny-prompt-enhanced-t2i-broken` (`build_broken_tokenizer`): `-r2`'s layout with the diffusion stage's CLIP
  tokenizer set to pad prompts to 512 tokens while the text encoder has 77 positions, a mistake a checkpoint
  can ship with: it loads, and its first prompt fails in the text encoder, so the stage's self-check fails
  (EngineFailed) and the rollout to it must leave the old generation serving.

Builds are deterministic: the noise is seeded by the tensor's name.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from omni_runtime.tiny_models._build import STAMP_FILE

__all__ = ["BROKEN_TOKENIZER_LENGTH", "build_broken_tokenizer", "build_retrained"]

NOISE = 0.1
"""The noise's standard deviation, as a share of each tensor's own."""

BROKEN_TOKENIZER_LENGTH = 512
"""What the broken revision's CLIP tokenizer pads to (its text encoder has 77 positions)."""


def build_retrained(out: Path, base: Path) -> None:
    """Fill the empty folder `out` with `base`'s files, every floating-point tensor of its safetensors files
    moved by seeded noise."""
    shutil.copytree(base, out, ignore=shutil.ignore_patterns(STAMP_FILE), dirs_exist_ok=True)
    for path in sorted(out.rglob("*.safetensors")):
        _perturb(path, seed_prefix=str(path.relative_to(out)))


def build_broken_tokenizer(out: Path, retrained: Path) -> None:
    """Fill the empty folder `out` with the prompt-enhanced pipeline's `-r2` revision whose `dit/tokenizer`
    pads to BROKEN_TOKENIZER_LENGTH tokens."""
    shutil.copytree(retrained, out, ignore=shutil.ignore_patterns(STAMP_FILE), dirs_exist_ok=True)
    config = out / "dit" / "tokenizer" / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    settings["model_max_length"] = BROKEN_TOKENIZER_LENGTH
    config.write_text(json.dumps(settings, indent=2) + "\n")


def _perturb(path: Path, *, seed_prefix: str) -> None:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open is not a dict
    for name, tensor in tensors.items():
        if not tensor.is_floating_point() or tensor.numel() < 2:
            continue
        seed = int.from_bytes(hashlib.sha256(f"{seed_prefix}:{name}".encode()).digest()[:8], "little")
        generator = torch.Generator().manual_seed(seed)
        values = tensor.float()
        spread = values.std()
        if not torch.isfinite(spread) or spread == 0:
            continue
        noise = torch.randn(values.shape, generator=generator) * (NOISE * spread)
        tensors[name] = (values + noise).to(tensor.dtype).contiguous()
    save_file(tensors, str(path), metadata=metadata)
