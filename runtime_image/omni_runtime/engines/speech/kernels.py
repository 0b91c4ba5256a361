"""The slab talker's device kernels: pure functions of tensors, no state (`slab_talker` runs them in its passes).

- `grouped_moe`: an MoE layer as two `torch._grouped_mm` over every expert (fixed shapes, no host sync).
- `rms`, `rms_weight`: RMS norms.
- `column_keys`, `hashed_exponential`, `sample_rows`: sampling as an exponential race whose noise is a
  counter-based hash of (seed, position, group, candidate), so a seeded request draws the same in any batch.
- `predictor_substep` (and `compiled_substep`, it through `torch.compile`): one code-predictor sub-step at
  fixed shapes; `substep_inputs`, the fixed inputs it reads (weights, dimensions, zero K/V slabs).
- `wait_quietly`: wait for a device's (or stream's) work without a busy spin; `code2wav` uses it too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "MASK32",
    "column_keys",
    "compiled_substep",
    "grouped_moe",
    "hashed_exponential",
    "predictor_substep",
    "rms",
    "rms_weight",
    "sample_rows",
    "substep_inputs",
    "wait_quietly",
]


def grouped_moe(block: Any, x: Any) -> Any:
    """`Qwen3OmniMoeTalkerTextSparseMoeBlock.forward` for tokens `x` [T, H] as grouped expert matmuls.

    Every (token, chosen expert) pair is sorted by expert; the gate/up and the down projections of all
    experts are each one `torch._grouped_mm` over those rows (`offs` = where each expert's rows end).
    Shapes depend on T only, and nothing reads back to the host, so it can be captured in a graph."""
    import torch
    import torch.nn.functional as F

    experts = block.experts
    _, weights, chosen = block.gate(x)  # [T, k] each
    k = chosen.shape[1]
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = x[order // k]
    counts = torch.zeros(experts.num_experts, dtype=torch.int32, device=x.device)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    gate_up = torch._grouped_mm(rows.to(experts.gate_up_proj.dtype), experts.gate_up_proj.transpose(1, 2), offs=offs)
    gate, up = gate_up.chunk(2, dim=-1)
    down = torch._grouped_mm(experts.act_fn(gate) * up, experts.down_proj.transpose(1, 2), offs=offs)
    down = down * weights.reshape(-1)[order, None].to(down.dtype)
    # back to (token, choice) order by a permutation, then a sum over the k choices: deterministic,
    # where an index_add_ would add in whatever order the GPU's atomics land
    unsorted = torch.empty_like(down)
    unsorted[order] = down
    out = unsorted.view(-1, k, down.shape[-1]).sum(1).to(x.dtype)
    shared = block.shared_expert(x)
    return out + F.sigmoid(block.shared_expert_gate(x)) * shared


def rms(norm: Any, x: Any) -> Any:
    """A transformers Qwen RMSNorm module applied as torch's fused `rms_norm` (same arithmetic: float32
    statistics, the weight applied in the input's dtype)."""
    return rms_weight(norm.weight, x, norm.variance_epsilon)


def rms_weight(weight: Any, x: Any, eps: float) -> Any:
    """`rms` with the norm's weight and epsilon given."""
    import torch.nn.functional as F

    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


MASK32 = 0xFFFFFFFF
"""The sampling hash works in 32 bits: a seed and every intermediate are masked to them."""


def _mix32(x: Any) -> Any:
    """A 32-bit integer hash (xorshift-multiply rounds) of int64 tensor values in [0, 2^32); every
    product stays under 2^63, so CPU and GPU give the same bits."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & MASK32
    return x ^ (x >> 16)


def column_keys(width: int, device: Any) -> Any:
    """The per-column term of `hashed_exponential`'s hash, (column * 0x9E3779B9) mod 2^32, as a tensor."""
    import torch

    return (torch.arange(width, device=device, dtype=torch.long) * 0x9E3779B9) & MASK32


def hashed_exponential(seeds: Any, counters: Any, width: int, columns: Any = None) -> Any:
    """Exp(1) draws [B, width] that depend only on (seed [B], counter [B], column): the same on every
    run, whatever the batch, with no generator state (so they can sit inside a CUDA graph). `columns`:
    `column_keys(width)` made beforehand (inside torch.compile an arange times the 32-bit constant
    becomes int32 index arithmetic in Triton, which rejects the constant)."""
    import torch

    key = _mix32((seeds ^ _mix32(counters & MASK32)) & MASK32)
    if columns is None:
        columns = column_keys(width, seeds.device)
    bits = _mix32((key[:, None] + columns[None]) & MASK32)
    uniform = (bits >> 8).float() * (1.0 / (1 << 24)) + 1.0 / (1 << 25)  # in (0, 1)
    return -torch.log(uniform)


def sample_rows(
    logits: Any, temperature: Any, top_k: Any, top_p: Any, greedy: Any, fixed_k: int = 0, noise: Any = None
) -> Any:
    """One token per row of `logits` [B, V] (float), all on the device: argmax where `greedy` [B], else
    temperature [B], top-k [B] (<= 0: off) and top-p [B] as transformers filters, then an exponential
    race (argmax of p / Exp(1) draws a token with probability p). `fixed_k`: every row's top-k is
    this one number (the code predictor's 50), so a `topk` replaces the sort of the whole vocabulary.
    `noise`: the Exp(1) draws per ranked candidate [B, fixed_k or V] (`hashed_exponential`); default
    fresh ones from the device's generator."""
    import torch

    vocab = logits.shape[-1]
    best = logits.argmax(-1)
    scores = logits / temperature.clamp_min(1e-5)[:, None]
    if 0 < fixed_k < vocab:
        ordered, order = scores.topk(fixed_k, dim=-1)
    else:
        ordered, order = scores.sort(-1, descending=True)
        rank = torch.arange(vocab, device=logits.device)[None]
        k = torch.where(top_k > 0, top_k, vocab)
        ordered = ordered.masked_fill(rank >= k[:, None], float("-inf"))
    probs = ordered.softmax(-1)
    before = probs.cumsum(-1) - probs  # mass of the tokens ranked above: keep while < top_p (first always)
    ordered = ordered.masked_fill(before >= top_p[:, None], float("-inf"))
    probs = ordered.softmax(-1)
    race = probs / (noise if noise is not None else torch.empty_like(probs).exponential_())
    drawn = order.gather(-1, race.argmax(-1, keepdim=True))[:, 0]
    return torch.where(greedy, best, drawn)


def wait_quietly(device: Any, stream: Any = None) -> None:
    """Wait for the work queued so far on `stream` (default: the current one) of a CUDA `device`,
    polling with sleeps so other Python threads run meanwhile; a blocking sync would hold the GIL."""
    import time

    import torch

    if torch.device(device).type != "cuda":
        return
    event = torch.cuda.Event()
    event.record(stream if stream is not None else torch.cuda.current_stream(device))
    while not event.query():
        time.sleep(0.00005)


def predictor_substep(
    x: Any,
    cos_all: Any,
    sin_all: Any,
    at: Any,
    keys: list[Any],
    values: list[Any],
    layers: list[list[Any]],
    norm: Any,
    head: Any,
    embed: Any,
    total: Any,
    seeds: Any,
    counters: Any,
    greedy: Any,
    columns: Any,
    dims: tuple[int, int, int, float, float, int, float],
) -> tuple[Any, Any, Any, list[Any], list[Any]]:
    """One code-predictor sub-step for `x` [n, 1, H] at position `at` (a 1-element long tensor) in fixed
    shapes, so one `torch.compile` serves every sub-step (and its elementwise work fuses): K/V slabs
    [n, kv_heads, 16, head_dim] per layer written functionally at `at` (new slabs returned), attention
    over all 16 positions with the later ones masked; then the group's head (`head`), the draw (codes
    1-15: top-k 50 / top-p 0.8 of `sample_rows`, noise hashed from (seed, `counters` + at)), and the
    drawn code's embedding (`embed`), returned with `total` + it. `layers`: per layer [input norm,
    fused qkv, q norm, k norm, o, post-attention norm, fused gate/up, down] weights; `dims`: (heads,
    kv_heads, head_dim, attention scale, rms epsilon, top-k, top-p); `columns`: `column_keys(top-k)`."""
    import torch
    import torch.nn.functional as F
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import apply_rotary_pos_emb

    heads, kv_heads, head_dim, scaling, eps, top_k, top_p = dims
    n = x.shape[0]
    width = keys[0].shape[2]
    cos, sin = cos_all.index_select(1, at), sin_all.index_select(1, at)
    mask = (torch.arange(width, device=x.device) <= at).view(1, 1, 1, width)
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    new_keys, new_values = [], []
    for index, (ln1, qkv, q_norm, k_norm, o, ln2, gate_up, down) in enumerate(layers):
        k_slab, v_slab = keys[index], values[index]
        q, k, v = F.linear(rms_weight(ln1, x, eps), qkv).split(sizes, dim=-1)
        q = rms_weight(q_norm, q.view(n, 1, heads, head_dim), eps).transpose(1, 2)
        k = rms_weight(k_norm, k.view(n, 1, kv_heads, head_dim), eps).transpose(1, 2)
        v = v.view(n, 1, kv_heads, head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k_slab, v_slab = k_slab.index_copy(2, at, k), v_slab.index_copy(2, at, v)
        out = F.scaled_dot_product_attention(q, k_slab, v_slab, attn_mask=mask, scale=scaling, enable_gqa=True)
        x = x + F.linear(out.transpose(1, 2).reshape(n, 1, -1), o)
        gate, up = F.linear(rms_weight(ln2, x, eps), gate_up).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, down)
        new_keys.append(k_slab)
        new_values.append(v_slab)
    logits = F.linear(rms_weight(norm, x[:, -1], eps), head).float()
    noise = hashed_exponential(seeds, counters + at, min(top_k, logits.shape[-1]), columns)
    ones = torch.ones(n, device=x.device)
    code = sample_rows(logits, ones, ones.long(), ones * top_p, greedy, fixed_k=top_k, noise=noise)
    drawn = F.embedding(code, embed).unsqueeze(1)
    return code, drawn, total + drawn[:, 0], new_keys, new_values


_compiled_substep: Any = None


def compiled_substep() -> Any:
    """`predictor_substep` through `torch.compile` (inductor, static shapes: one compile per batch
    bucket, shared by the 16 sub-steps); made once per process. The recompile limit is raised so that
    every bucket of every model in the process gets its own compile instead of a silent eager fallback."""
    global _compiled_substep
    if _compiled_substep is None:
        import torch
        import torch._dynamo

        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))
        _compiled_substep = torch.compile(predictor_substep, dynamic=False, fullgraph=True)
    return _compiled_substep


def substep_inputs(
    predictor: Any,
    pconf: Any,
    max_batch: int,
    groups: int,
    dtype: Any,
    device: Any,
    fused_qkv: Callable[[Any], Any],
    *,
    top_k: int,
    top_p: float,
) -> tuple[tuple[Any, ...], list[list[Any]], list[Any], list[Any], Any]:
    """What `predictor_substep` reads besides its running state, made once per talker: (its dimensions, each
    layer's weights with q/k/v as one (`fused_qkv(attention)`) and gate/up as one, the first sub-step's zero
    K/V slabs, each position's index tensor, the sampling's column keys for the `top_k` candidates)."""
    import torch

    attn = predictor.layers[0].self_attn
    phead = getattr(pconf, "head_dim", None) or pconf.hidden_size // pconf.num_attention_heads
    eps = predictor.norm.variance_epsilon
    dims = (
        pconf.num_attention_heads,
        pconf.num_key_value_heads,
        attn.head_dim,
        float(attn.scaling),
        float(eps),
        top_k,
        float(top_p),
    )
    weights = []
    for layer in predictor.layers:
        a, m = layer.self_attn, layer.mlp
        weights.append(
            [
                layer.input_layernorm.weight,
                fused_qkv(a),
                a.q_norm.weight,
                a.k_norm.weight,
                a.o_proj.weight,
                layer.post_attention_layernorm.weight,
                torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach(),
                m.down_proj.weight,
            ]
        )
    # the first sub-step's K/V slabs: zeros, one tensor each and inference tensors, as the later
    # sub-steps' are, so that one compile fits all 16 calls (aliased inputs would make another)
    slab = (max_batch, pconf.num_key_value_heads, groups, phead)
    with torch.inference_mode():
        kv0 = [torch.zeros(slab, dtype=dtype, device=device) for _ in range(2 * len(predictor.layers))]
    at = [torch.full((1,), p, dtype=torch.long, device=device) for p in range(groups)]
    width = min(top_k, pconf.vocab_size)
    with torch.inference_mode():
        columns = column_keys(width, device)
    return dims, weights, kv0, at, columns
