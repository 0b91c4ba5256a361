"""Load one part of a whole-model checkpoint folder (safetensors, one file or sharded) into a module.

A talker pod needs the talker, a code2wav pod the code2wav; neither loads the 30B thinker. The
checkpoint stores MoE experts one by one (`...experts.3.gate_proj.weight`), as the original
checkpoints and transformers' `save_pretrained` write them, while transformers 5 modules hold them
fused (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]); `load_part` fuses them.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["load_part", "read_tensors"]

_EXPERT = re.compile(r"^(?P<base>.+\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def _files_by_key(folder: Path) -> dict[str, Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {key: folder / name for key, name in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")
    from safetensors import safe_open

    with safe_open(str(single), "pt") as handle:
        return dict.fromkeys(handle.keys(), single)


def read_tensors(folder: Path, prefix: str) -> dict[str, Any]:
    """Every tensor whose name starts with `prefix`, keyed by the rest of its name (read from disk lazily)."""
    from safetensors import safe_open

    wanted: dict[Path, list[str]] = defaultdict(list)
    for key, path in _files_by_key(folder).items():
        if key.startswith(prefix):
            wanted[path].append(key)
    out = {}
    for path, keys in wanted.items():
        with safe_open(str(path), "pt") as handle:
            for key in keys:
                out[key[len(prefix) :]] = handle.get_tensor(key)
    if not out:
        raise ValueError(f"{folder} holds no tensor named {prefix}*; is it a whole-model checkpoint?")
    return out


def _fuse_experts(tensors: dict[str, Any]) -> dict[str, Any]:
    import torch

    groups: dict[str, dict[str, dict[int, Any]]] = defaultdict(lambda: defaultdict(dict))
    out = {}
    for key, tensor in tensors.items():
        match = _EXPERT.match(key)
        if match is None:
            out[key] = tensor
        else:
            groups[match["base"]][match["proj"]][int(match["index"])] = tensor
    for base, projs in groups.items():
        count = len(projs["down_proj"])
        out[f"{base}.gate_up_proj"] = torch.stack(
            [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]], dim=0) for e in range(count)]
        )
        out[f"{base}.down_proj"] = torch.stack([projs["down_proj"][e] for e in range(count)])
    return out


def load_part(module: Any, folder: Path, prefix: str) -> None:
    """Fill `module`'s parameters and buffers from the tensors named `prefix`* (experts fused); strict."""
    tensors = _fuse_experts(read_tensors(folder, prefix))
    expected = set(module.state_dict())
    missing = sorted(expected - set(tensors))
    unexpected = sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ValueError(
            f"{folder}: the tensors named {prefix}* do not fit {type(module).__name__}: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    module.load_state_dict(tensors, strict=True)
