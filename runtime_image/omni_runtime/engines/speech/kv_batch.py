"""Per-request KV caches stepped together: the batching both talkers' decode loops share.

A talker request owns its KV cache (a list of (keys, values) per layer, [1, heads, length, dim]) and
its length. `prefill` runs one request's prompt; `step` runs one decode token for several requests
at once: their caches are left-padded to the longest, masked, run as one batch, and each request
keeps its own new row. A request can therefore join at any step and leave after any step without
touching the others. Positions are given on the three rope axes (Qwen's multimodal rope, all three
equal for text), so any transformers decoder taking `inputs_embeds`, `attention_mask`,
`position_ids` [3, B, T] and `past_key_values` fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["KVState", "prefill", "step"]


class KVState(Protocol):
    """What `step` reads and updates on a request."""

    kv: list[tuple[Any, Any]] | None
    length: int


def prefill(model: Any, embeds: Any, positions: Any = None) -> tuple[list[tuple[Any, Any]], int, Any]:
    """Run `embeds` [1, T, H] at `positions` [3, 1, T] (default 0..T-1 on every axis): (the KV cache, T,
    the last position's hidden state [H])."""
    import torch

    length = embeds.shape[1]
    if positions is None:
        positions = torch.arange(length, device=embeds.device).view(1, 1, -1).expand(3, 1, -1)
    out = model(inputs_embeds=embeds, position_ids=positions, use_cache=True)
    kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    return kv, length, out.last_hidden_state[0, -1]


def step(model: Any, states: Sequence[KVState], embeds: Any, steps: Sequence[int] | None = None) -> Any:
    """One decode token for each state (`embeds` [B, 1, H], in the order of `states`), batched, at rope
    positions `steps` (default: each state's length; a multimodal rope continues from another one).

    Appends each request's new KV row to its own cache and bumps its length; returns the hidden
    states of the new tokens [B, H]."""
    import torch
    import torch.nn.functional as F
    from transformers import DynamicCache

    caches = [s.kv for s in states]
    if any(kv is None for kv in caches):
        raise ValueError("step() got a request that has not run its prefill")
    longest = max(s.length for s in states)
    cache = DynamicCache()
    device = embeds.device
    for layer in range(len(caches[0])):  # type: ignore[arg-type]
        keys = [F.pad(kv[layer][0], (0, 0, longest - s.length, 0)) for kv, s in zip(caches, states, strict=True)]  # type: ignore[index]
        values = [F.pad(kv[layer][1], (0, 0, longest - s.length, 0)) for kv, s in zip(caches, states, strict=True)]  # type: ignore[index]
        cache.update(torch.cat(keys), torch.cat(values), layer)
    mask = torch.zeros(len(states), longest + 1, dtype=torch.long, device=device)
    for i, s in enumerate(states):
        mask[i, longest - s.length :] = 1
    at = list(steps) if steps is not None else [s.length for s in states]
    positions = torch.tensor(at, device=device).view(1, -1, 1).expand(3, -1, 1)
    out = model(
        inputs_embeds=embeds, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
    )
    for i, s in enumerate(states):
        s.kv = [
            (
                torch.cat([k, layer.keys[i : i + 1, :, -1:]], dim=2),
                torch.cat([v, layer.values[i : i + 1, :, -1:]], dim=2),
            )
            for (k, v), layer in zip(caches[i], out.past_key_values.layers, strict=True)  # type: ignore[arg-type]
        ]
        s.length += 1
    return out.last_hidden_state[:, -1]
