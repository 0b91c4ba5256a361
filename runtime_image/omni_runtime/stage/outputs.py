"""Folding engine output pieces together, and counting the items of a windowed edge.

An engine yields `EngineOutput.data` pieces (deltas when it streams). The stage server folds them into
one payload for a downstream edge (window 0), for a non-streaming final output, or into one chunk of
`window` items for a windowed edge.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from omni_runtime.processors.payloads import downstream_only_keys, item_keys

__all__ = ["DOWNSTREAM_ONLY_KEYS", "ITEM_KEYS", "client_fields", "count_items", "merge", "summarize"]

_ITEM_AXES = item_keys()
ITEM_KEYS = tuple(_ITEM_AXES)
"""Keys whose length counts a piece's items (first one present wins): codec codes, tokens, latents, audio
samples; the fields that `processors.payloads` marks `Items`."""

DOWNSTREAM_ONLY_KEYS = downstream_only_keys()
"""Keys an engine output carries for the next stage only (a thinker's hidden-state rows, media rows and media
shapes for its talker): never part of what the client sees; the fields `processors.payloads` marks so."""

_CAT_LAST = frozenset(key for key, axis in _ITEM_AXES.items() if axis == -1)
"""Time runs along the last dimension of these (audio: channels x samples)."""


def client_fields(data: dict[str, Any]) -> dict[str, Any]:
    """`data` without DOWNSTREAM_ONLY_KEYS: what a final stage sends to the router. A thinker that is both a final
    output (its text) and a talker's upstream (qwen2-5-omni) would otherwise send its rows to the router, which
    would decode tensors it has no use for (and keep them for the whole request when the reply is not streamed)."""
    if not any(key in data for key in DOWNSTREAM_ONLY_KEYS):
        return data
    return {key: value for key, value in data.items() if key not in DOWNSTREAM_ONLY_KEYS}


def merge(into: dict[str, Any] | None, piece: dict[str, Any]) -> dict[str, Any]:
    """Fold `piece` (a delta) into `into`: strings and bytes concatenate, lists extend, tensors and
    arrays concatenate (along the last dimension for audio, else the first), dicts merge recursively,
    anything else takes the newest value."""
    if into is None:
        return dict(piece)
    out = dict(into)
    for key, value in piece.items():
        if key not in out or out[key] is None:
            out[key] = value
        else:
            out[key] = _fold(key, out[key], value)
    return out


def _fold(key: str, old: Any, new: Any) -> Any:
    if new is None:
        return old
    if isinstance(old, str) and isinstance(new, str):
        return old + new
    if isinstance(old, bytes | bytearray) and isinstance(new, bytes | bytearray):
        return bytes(old) + bytes(new)
    if isinstance(old, list) and isinstance(new, list):
        return old + new
    if isinstance(old, dict) and isinstance(new, dict):
        return merge(old, new)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
        if old.ndim == 0 or new.ndim == 0:
            return new
        return torch.cat([old, new], dim=-1 if key in _CAT_LAST else 0)
    if isinstance(old, np.ndarray) and isinstance(new, np.ndarray):
        if old.ndim == 0 or new.ndim == 0:
            return new
        return np.concatenate([old, new], axis=-1 if key in _CAT_LAST else 0)
    return new


def count_items(data: dict[str, Any] | None) -> int:
    """Items in a piece, for windowed edges: the length of its first `ITEM_KEYS` entry, else 1."""
    if not data:
        return 0
    for key in ITEM_KEYS:
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, list | tuple):
            return len(value)
        shape = getattr(value, "shape", None)
        if shape is not None and len(shape) > 0:
            return int(shape[-1] if key in _CAT_LAST else shape[0])
    return 1


def summarize(data: dict[str, Any], limit: int = 2000) -> dict[str, Any]:
    """The JSON-friendly, short values of a payload (strings, numbers), for `Output.info`."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, str):
            out[key] = value[:limit]
        elif isinstance(value, bool | int | float) or value is None:
            out[key] = value
    return out
