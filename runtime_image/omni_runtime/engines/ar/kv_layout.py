"""Where a paged KV cache keeps each token's K and V inside a block, learnt from the backend's own write
(`probe_block_layout`), and the gather that reads a request's K and V back out exactly (`gather_blocks`).

vLLM hands a KV connector each layer's cache as `[blocks, heads, block_size, content]`, but what a backend keeps
inside a block is its own: vLLM's CPU attention keeps each head's K column-major (head_dim x tokens) and V
row-major after it for its VEC/VEC16 kernels, and for AMX K in tiles of 16 tokens of dim pairs and V in tiles of
16 dims of token pairs (VNNI), V after K in the same page. Rather than copy those
layouts, `kv_export` runs the layer's own cache write once on a scratch block with integer markers and reads
where every element landed. Pure torch: no vLLM import.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["BlockLayout", "KvExportError", "Writer", "gather_blocks", "probe_block_layout"]


class KvExportError(RuntimeError):
    """The KV route cannot run on this engine, or a KV message was malformed (never a fault of the input)."""


@dataclass(frozen=True)
class BlockLayout:
    """Where each (token, head, dim) of K and of V sits in one block's page, flattened in the view's logical
    order: `keys[t, h, d]` is the index into `page.reshape(-1)`."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.keys.shape[0])


Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""(key, value, kv_cache, slot_mapping) -> None: a layer's own cache write."""


def _exact_integers(dtype: torch.dtype) -> int:
    """How many consecutive positive integers from 1 `dtype` holds exactly (256 for bfloat16)."""
    if not dtype.is_floating_point:
        raise KvExportError(f"a {dtype} KV cache is quantized; export_kv_cache needs kv_cache_dtype auto")
    return 2 ** (round(-math.log2(torch.finfo(dtype).eps)) + 1)


def probe_block_layout(write: Writer, page_shape: tuple[int, ...], head_dim: int, dtype: torch.dtype,
                       device: torch.device | str = "cpu") -> BlockLayout:  # fmt: skip
    """Learn where `write` puts K and V inside one block (`page_shape`: `(1, heads, tokens, content)`).

    Writes markers through `write` into zeroed scratch blocks: the index of each (token, head, dim) as digits
    small enough for `dtype` to hold exactly, K and V in turn, the other zero. The nonzero positions are the
    element's place; the digits say which element it is. KvExportError when the write is no copy (an element
    lost, doubled or changed), which is what a quantizing cache does."""
    _, heads, tokens, _ = page_shape
    count = tokens * heads * head_dim
    base = _exact_integers(dtype) - 1  # digit + 1 is stored, so a zero still means "nothing written here"
    digits = max(1, math.ceil(math.log(count, base))) if count > 1 else 1
    index = torch.arange(count, dtype=torch.long)
    slots = torch.arange(tokens, dtype=torch.long, device=device)
    found: dict[str, torch.Tensor] = {}
    for which in ("keys", "values"):
        where: torch.Tensor | None = None
        code = torch.zeros(count, dtype=torch.long)
        for j in range(digits):
            marker = ((index // base**j) % base + 1).to(dtype).reshape(tokens, heads, head_dim).to(device)
            blank = torch.zeros_like(marker)
            page = torch.zeros(page_shape, dtype=dtype, device=device)
            write(marker if which == "keys" else blank, blank if which == "keys" else marker, page, slots)
            flat = page.reshape(-1).to(device="cpu", dtype=torch.float64)
            nonzero = flat.nonzero().squeeze(1)
            if where is None:
                where = nonzero
            if nonzero.numel() != count or not torch.equal(nonzero, where):
                raise KvExportError(
                    f"the KV cache write put {nonzero.numel()} {which} elements where {count} were written; it is "
                    "not a copy (a quantized cache?), so the KV cannot be read back exactly"
                )
            code += (flat[nonzero].round().long() - 1) * base**j
        assert where is not None
        if code.min() < 0 or code.max() >= count or torch.unique(code).numel() != count:
            raise KvExportError(f"the KV cache write scrambled the {which} markers; it is not a copy")
        position = torch.empty(count, dtype=torch.long)
        position[code] = where
        found[which] = position.reshape(tokens, heads, head_dim)
    if torch.isin(found["keys"], found["values"]).any():
        raise KvExportError("the KV cache write put K and V in the same places")
    return BlockLayout(found["keys"], found["values"])


def gather_blocks(cache: torch.Tensor, layout: BlockLayout, block_ids: list[int], num_tokens: int) -> tuple[
    torch.Tensor, torch.Tensor
]:  # fmt: skip
    """The first `num_tokens` tokens' K and V, (tokens, heads, head_dim) each, from the blocks `block_ids` (in
    order) of one layer's `cache` (`[blocks, heads, block_size, content]`, laid out as `layout` says)."""
    needed = math.ceil(num_tokens / layout.tokens)
    if needed > len(block_ids):
        raise KvExportError(
            f"{num_tokens} tokens need {needed} blocks of {layout.tokens} tokens, the request has {len(block_ids)}"
        )
    ids = torch.tensor(block_ids[:needed], dtype=torch.long, device=cache.device)
    pages = cache.index_select(0, ids).reshape(needed, -1)
    out = []
    for positions in (layout.keys, layout.values):
        picked = pages[:, positions.reshape(-1).to(cache.device)]
        out.append(picked.reshape(needed * layout.tokens, *positions.shape[1:])[:num_tokens])
    return out[0], out[1]
