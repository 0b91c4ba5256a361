"""The Qwen3-Omni talker at GPU speed: preallocated KV slabs, grouped MoE, whole-batch CUDA graphs.

`SlabTalker` wraps a `qwen3_talker.Qwen3Talker` (which still builds every prompt and runs each
prefill eagerly) and replaces its decode loop with two fixed-shape passes over request *slots*:

- frames pass: for every slot with a pending code 0, the code predictor's 15 sub-steps (its own
  16-position KV slab), sampling codes 1-15 on the device, and the frame's summed embeddings;
- decode pass: one talker step for every slot whose next text vector is known, writing the new
  K/V row into the talker's slab at the slot's length, then code 0 sampled on the device
  (repetition penalty from a per-slot history mask, suppressed ids, temperature / top-k / top-p).

KV memory is allocated once (`max_batch` slots x `max_length` positions per layer); a request takes
the lowest free slot after its prefill and gives it back when it finishes, so requests join and
leave between steps. A pass runs slots 0..n-1 with n the smallest bucket (1, 2, 4, 8, ...) that
covers the highest slot in use; slots that take no part compute into their own rows and every
result is kept only where the slot's `active` flag is set (a K/V row written at an idle slot's
length is masked and overwritten by its real step). On CUDA each (pass, bucket) is captured once in
a CUDA graph and replayed; elsewhere the same code runs eagerly, which is what the CPU tests check
(greedy frames equal `Qwen3Talker`'s, which equal transformers' `generate()`).

On CUDA the code predictor's sub-steps (the larger part of a step, and launch bound: ~200 small
kernels each, nearly the same time at 1 slot as at 32) run as `predictor_substep`: fixed shapes (a
16-position K/V slab per layer written functionally, the later positions masked), so one
`torch.compile` (inductor) serves all 16 calls of a pass and fuses the norms, rope, residuals,
activation and the sampling's elementwise work into few kernels; the compiled code is captured in the
pass's CUDA graph like the rest (H200, 32 slots: frames pass 10.5 -> 4.6 ms, bench run 4). Elsewhere
they run as the loop over the layers' own shapes (the CPU tests' path; the fixed-shape form gives the
same frames there, tested). `high_priority` (off by default: no measured gain) puts every talker
kernel on a CUDA stream of the highest priority.

The MoE layers run `grouped_moe`: tokens sorted by expert, one `torch._grouped_mm` for gate/up and
one for down over all 128 experts (fixed shapes, no host sync, so it sits inside the graph).

Sampling differs from the eager path in one way: draws are an exponential race over the filtered
distribution whose noise is a counter-based hash of (the request's seed, its position, the group,
the candidate), computed on the device inside the graphs. So a request with a `seed` draws the same
frames on every run, alone or in any batch (its logits are the same up to the kernels a batch bucket
picks), but not the eager path's samples (that one draws from a torch.Generator); a request without
one gets a random seed; greedy requests are exact.

The device kernels these passes run (grouped MoE, RMS norms, the sampling hash and draw, the fixed-shape
predictor sub-step) are pure functions of tensors, in `kernels`.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from typing import Any

from omni_runtime.engines.speech.kernels import (
    MASK32,
    compiled_substep,
    grouped_moe,
    hashed_exponential,
    predictor_substep,
    rms,
    sample_rows,
    substep_inputs,
    wait_quietly,
)
from omni_runtime.engines.speech.qwen3_talker import CODE_PREDICTOR_TOP_K, CODE_PREDICTOR_TOP_P, Qwen3Talker

__all__ = ["SlabTalker"]

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SUBSTEPS = ("loop", "fixed", "compiled")
"""How the code predictor's 15 sub-steps run: "loop" (the layers' own shapes, growing KV: the CPU
path), "fixed" (`predictor_substep`, fixed shapes), "compiled" (that through torch.compile: its
elementwise work fused into few kernels; the sub-steps are launch bound, not compute bound)."""


@dataclass(eq=False)
class _Slot:
    index: int
    has_frame: bool = False


class SlabTalker:
    """`Qwen3Talker.advance` over preallocated slots (see the module docstring); same API."""

    def __init__(
        self,
        base: Qwen3Talker,
        max_batch: int = 64,
        max_length: int = 2048,
        graphs: bool | None = None,
        substep: str | None = None,
        high_priority: bool = False,
    ):
        """`graphs`: CUDA graphs of the passes (default: on CUDA). `substep`: how the code predictor's
        sub-steps run (SUBSTEPS; default "compiled" on CUDA, "loop" elsewhere, whose results stay those
        of the CPU tests). `high_priority`: the talker's work on a CUDA stream of the highest priority
        (CUDA only; off by default: colocated at c=32 it gave 143.6 audio-s/s against 143.5 without,
        bench run 4)."""
        import torch

        self.base = base
        self.device = base.device
        self.speakers = base.speakers
        self.config = base.config  # the engine's self-check reads the model's config
        model = base.talker.model
        text = base.talker.config.text_config
        predictor = base.talker.code_predictor.model
        pconf = base.talker.code_predictor.config
        self.max_batch, self.max_length = max_batch, max_length
        self.groups = base.groups
        dtype = base.talker.codec_head.weight.dtype
        dev = self.device
        head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        phead = getattr(pconf, "head_dim", None) or pconf.hidden_size // pconf.num_attention_heads
        layers = len(model.layers)
        self.k = torch.zeros(layers, max_batch, text.num_key_value_heads, max_length, head, dtype=dtype, device=dev)
        self.v = torch.zeros_like(self.k)
        shape = (len(predictor.layers), max_batch, pconf.num_key_value_heads, self.groups, phead)
        self.pk = torch.zeros(shape, dtype=dtype, device=dev)
        self.pv = torch.zeros_like(self.pk)
        hidden = text.hidden_size
        vocab = text.vocab_size
        s = max_batch
        self.lengths = torch.zeros(s, dtype=torch.long, device=dev)
        self.rope_delta = torch.zeros(s, dtype=torch.long, device=dev)
        self.active = torch.zeros(s, dtype=torch.bool, device=dev)
        self.code0 = torch.zeros(s, dtype=torch.long, device=dev)
        self.hidden = torch.zeros(s, hidden, dtype=dtype, device=dev)
        self.text = torch.zeros(s, hidden, dtype=dtype, device=dev)
        self.frame = torch.zeros(s, hidden, dtype=dtype, device=dev)
        self.codes = torch.zeros(s, self.groups, dtype=torch.long, device=dev)
        self.history = torch.zeros(s, vocab, dtype=torch.bool, device=dev)
        self.temperature = torch.ones(s, device=dev)
        self.top_k = torch.zeros(s, dtype=torch.long, device=dev)
        self.top_p = torch.ones(s, device=dev)
        self.penalty = torch.ones(s, device=dev)
        self.greedy = torch.ones(s, dtype=torch.bool, device=dev)
        self.seeds = torch.zeros(s, dtype=torch.long, device=dev)
        self.positions = torch.arange(max_length, device=dev)
        self.slots: dict[int, _Slot] = {}
        self.free = list(range(max_batch))
        self.use_graphs = str(dev).startswith("cuda") if graphs is None else graphs
        self._graphs: dict[tuple[str, int], Any] = {}
        self._qkv: dict[int, tuple[Any, list[int]]] = {}
        self._gate_up: dict[int, Any] = {}
        self._pool: Any = None
        cuda = str(dev).startswith("cuda")
        mode = substep or ("compiled" if cuda else "loop")
        if mode not in SUBSTEPS:
            raise ValueError(f"substep {mode!r}: one of {SUBSTEPS}")
        attn = predictor.layers[0].self_attn
        if mode != "loop" and (pconf.hidden_act != "silu" or attn.q_proj.bias is not None):
            log.warning("code predictor with %s / biased attention: its sub-steps run as a loop", pconf.hidden_act)
            mode = "loop"
        self.substep_mode = mode
        """What runs the code predictor's sub-steps (may fall back from "compiled" to "fixed": see
        `_substep`)."""
        if mode != "loop":
            self._dims, self._weights, self._kv0, self._at, self._columns = substep_inputs(
                predictor,
                pconf,
                max_batch,
                self.groups,
                dtype,
                dev,
                lambda a: self._fused(a)[0],
                top_k=CODE_PREDICTOR_TOP_K,
                top_p=CODE_PREDICTOR_TOP_P,
            )
        self.stream: Any = None
        """The high-priority CUDA stream every talker kernel runs on (None: the current stream)."""
        if cuda and high_priority:
            low, high = torch.cuda.Stream.priority_range()
            self.stream = torch.cuda.Stream(dev, priority=min(low, high))

    # -- the passes (fixed shapes: n slots) ----------------------------------------------------------

    def _fused(self, attn: Any) -> tuple[Any, list[int]]:
        """q, k and v projections as one weight (one matmul instead of three), made once per layer."""
        import torch

        key = id(attn)
        if key not in self._qkv:
            weights = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
            self._qkv[key] = (torch.cat(weights).detach(), [w.shape[0] for w in weights])
        return self._qkv[key]

    def _mlp(self, mlp: Any, x: Any) -> Any:
        """A dense SwiGLU MLP with its gate and up projections as one matmul."""
        import torch
        import torch.nn.functional as F

        key = id(mlp)
        if key not in self._gate_up:
            self._gate_up[key] = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
        gate, up = F.linear(x, self._gate_up[key]).chunk(2, dim=-1)
        return mlp.down_proj(mlp.act_fn(gate) * up)

    def _attend(self, attn: Any, x: Any, cos: Any, sin: Any, write: Any, mask: Any) -> Any:
        """q/k/v of `x` [n, T, H], rope, K/V written into the caches by `write(k, v)`, attention with `mask`."""
        import torch.nn.functional as F
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import apply_rotary_pos_emb

        n, t, _ = x.shape
        weight, sizes = self._fused(attn)
        q, k, v = F.linear(x, weight).split(sizes, dim=-1)
        q = rms(attn.q_norm, q.view(n, t, -1, attn.head_dim)).transpose(1, 2)
        k = rms(attn.k_norm, k.view(n, t, -1, attn.head_dim)).transpose(1, 2)
        v = v.view(n, t, -1, attn.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys, values = write(k, v)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=attn.scaling, enable_gqa=True, is_causal=mask is None and t > 1
        )
        return attn.o_proj(out.transpose(1, 2).reshape(n, t, -1))

    def _decode_pass(self, n: int) -> None:
        import torch

        model = self.base.talker.model
        rows = torch.arange(n, device=self.device)
        at = (self.lengths[:n]).clamp(max=self.max_length - 1)
        x = (self.frame[:n] + self.text[:n]).unsqueeze(1)
        position_ids = (at + self.rope_delta[:n]).view(1, n, 1).expand(3, n, 1)
        cos, sin = model.rotary_emb(x, position_ids)
        mask = (self.positions[None] <= at[:, None]).view(n, 1, 1, -1)
        for index, layer in enumerate(model.layers):

            def write(k: Any, v: Any, index: int = index) -> tuple[Any, Any]:
                self.k[index, rows, :, at] = k[:, :, 0]
                self.v[index, rows, :, at] = v[:, :, 0]
                return self.k[index, :n], self.v[index, :n]

            h = rms(layer.input_layernorm, x)
            x = x + self._attend(layer.self_attn, h, cos, sin, write, mask)
            h = rms(layer.post_attention_layernorm, x)
            mlp = layer.mlp
            x = x + (grouped_moe(mlp, h[:, 0]).unsqueeze(1) if hasattr(mlp, "experts") else mlp(h))
        hidden = rms(model.norm, x)[:, 0]
        logits = self.base.talker.codec_head(hidden).float()
        penalty = self.penalty[:n, None]
        logits = torch.where(
            self.history[:n], torch.where(logits < 0, logits * penalty, logits / penalty), logits
        ).masked_fill(self.base.suppress, float("-inf"))
        noise = hashed_exponential(self.seeds[:n], self.lengths[:n] * self.groups, logits.shape[-1])
        code = sample_rows(logits, self.temperature[:n], self.top_k[:n], self.top_p[:n], self.greedy[:n], noise=noise)
        on = self.active[:n]
        self.hidden[:n] = torch.where(on[:, None], hidden, self.hidden[:n])
        self.code0[:n] = torch.where(on, code, self.code0[:n])
        self.history[rows, self.code0[:n]] |= on
        self.lengths[:n] += on.long()

    def _substep(self, *args: Any) -> Any:
        """`predictor_substep`, compiled unless this talker's mode is "fixed" (or compiling failed here:
        then it runs eagerly from then on, logged, as the same fixed-shape function)."""
        if self.substep_mode == "compiled":
            try:
                return compiled_substep()(*args)
            except Exception as exc:  # the eager function computes the same, only slower
                log.warning("talker: cannot compile the code predictor's sub-step (%s); it runs eagerly", exc)
                self.substep_mode = "fixed"
        return predictor_substep(*args)

    def _frames_pass_fixed(self, n: int) -> None:
        """`_frames_pass` as 16 calls of one fixed-shape sub-step (`predictor_substep`): position 0
        (the talker's hidden state; its draw is dropped), then positions 1..15, each drawing group
        g = position - 1 (codes 1-15) with the same hashed noise counters as `_frames_pass`."""
        import torch

        talker = self.base.talker
        predictor = talker.code_predictor.model
        heads = talker.code_predictor.lm_head
        embeds = predictor.codec_embedding
        first = talker.get_input_embeddings()(self.code0[:n])
        positions = torch.arange(self.groups, device=self.device)[None].expand(n, -1)
        cos_all, sin_all = predictor.rotary_emb(first[:, None], positions)
        counters = self.lengths[:n] * self.groups  # + position: the decode pass draws at lengths * groups
        seeds, greedy = self.seeds[:n], self.greedy[:n]
        layers = len(self._weights)
        keys, values = [z[:n] for z in self._kv0[:layers]], [z[:n] for z in self._kv0[layers:]]
        norm = predictor.norm.weight
        common = (self._weights, norm)
        _, _, _, keys, values = self._substep(
            self.hidden[:n, None].clone(), cos_all, sin_all, self._at[0], keys, values, *common,
            heads[0].weight, embeds[0].weight, first, seeds, counters, greedy, self._columns, self._dims,
        )  # fmt: skip
        x, total, codes = first[:, None], first, [self.code0[:n]]
        for group in range(self.groups - 1):
            code, x, total, keys, values = self._substep(
                x, cos_all, sin_all, self._at[group + 1], keys, values, *common,
                heads[group].weight, embeds[group].weight, total, seeds, counters, greedy, self._columns, self._dims,
            )  # fmt: skip
            codes.append(code)
        on = self.active[:n]
        self.frame[:n] = torch.where(on[:, None], total, self.frame[:n])
        self.codes[:n] = torch.where(on[:, None], torch.stack(codes, dim=1), self.codes[:n])

    def _frames_pass(self, n: int) -> None:
        import torch

        if self.substep_mode != "loop":
            self._frames_pass_fixed(n)
            return

        talker = self.base.talker
        predictor = talker.code_predictor.model
        heads = talker.code_predictor.lm_head
        first = talker.get_input_embeddings()(self.code0[:n])
        x = torch.stack([self.hidden[:n], first], dim=1)
        total = first
        codes = [self.code0[:n]]
        ones = torch.ones(n, device=self.device)
        k50 = torch.full((n,), CODE_PREDICTOR_TOP_K, dtype=torch.long, device=self.device)
        p08 = torch.full((n,), CODE_PREDICTOR_TOP_P, device=self.device)
        # rope of all the sub-steps' positions at once (the same values per position as one call each)
        cos_all, sin_all = predictor.rotary_emb(x, torch.arange(self.groups, device=self.device)[None].expand(n, -1))
        start = 0
        for group in range(self.groups - 1):
            t = x.shape[1]
            cos, sin = cos_all[:, start : start + t], sin_all[:, start : start + t]
            for index, layer in enumerate(predictor.layers):

                def write(k: Any, v: Any, index: int = index, start: int = start, t: int = t) -> tuple[Any, Any]:
                    self.pk[index, :n, :, start : start + t] = k
                    self.pv[index, :n, :, start : start + t] = v
                    return self.pk[index, :n, :, : start + t], self.pv[index, :n, :, : start + t]

                h = rms(layer.input_layernorm, x)
                x = x + self._attend(layer.self_attn, h, cos, sin, write, None)
                x = x + self._mlp(layer.mlp, rms(layer.post_attention_layernorm, x))
            logits = heads[group](rms(predictor.norm, x[:, -1])).float()
            counters = self.lengths[:n] * self.groups + group + 1  # the decode pass draws at lengths * groups
            noise = hashed_exponential(self.seeds[:n], counters, min(CODE_PREDICTOR_TOP_K, logits.shape[-1]))
            code = sample_rows(logits, ones, k50, p08, self.greedy[:n], fixed_k=CODE_PREDICTOR_TOP_K, noise=noise)
            codes.append(code)
            x = predictor.codec_embedding[group](code).unsqueeze(1)
            total = total + x[:, 0]
            start += t
        on = self.active[:n]
        self.frame[:n] = torch.where(on[:, None], total, self.frame[:n])
        self.codes[:n] = torch.where(on[:, None], torch.stack(codes, dim=1), self.codes[:n])

    def _read(self, values: Any) -> list[Any]:
        """`values.tolist()`, waiting for the device without holding the GIL (code2wav's thread in
        this process launches its kernels meanwhile)."""
        wait_quietly(values.device)
        return values.tolist()

    def _run(self, name: str, n: int) -> None:
        import torch

        run = self._decode_pass if name == "decode" else self._frames_pass
        if not self.use_graphs:
            with torch.inference_mode():
                run(n)
            return
        graph = self._graphs.get((name, n))
        if graph is None:
            graph = self._capture(run, n)
            self._graphs[(name, n)] = graph
        graph.replay()

    def _capture(self, run: Any, n: int) -> Any:
        """Capture `run(n)` in a CUDA graph; the warm-up and capture touch only idle rows' results
        (`active` is cleared around them), so live requests are not advanced."""
        import torch

        saved = self.active.clone()
        lengths = self.lengths.clone()
        self.active.zero_()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            for _ in range(2):
                run(n)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool):
            run(n)
        self.active.copy_(saved)
        self.lengths.copy_(lengths)
        log.info("captured the talker's %s pass for %d slots", "decode" if run == self._decode_pass else "frames", n)
        return graph

    def capture(self, sizes: list[int]) -> None:
        """Capture both passes for these batch sizes now (rounded up to buckets), before traffic."""
        for size in sizes:
            n = self._bucket(size)
            for name in ("frames", "decode"):
                if self.use_graphs and (name, n) not in self._graphs:
                    run = self._decode_pass if name == "decode" else self._frames_pass
                    self._graphs[(name, n)] = self._capture(run, n)

    def _bucket(self, count: int) -> int:
        for size in BUCKETS:
            if size >= count:
                return min(size, self.max_batch)
        return self.max_batch

    # -- requests -----------------------------------------------------------------------------------

    def new_request(self, *args: Any, **kwargs: Any) -> Any:
        return self.base.new_request(*args, **kwargs)

    def _prefill(self, batch: list[Any]) -> None:
        """`Qwen3Talker.prefill` for every request in `batch` in one pass: prompts right-padded to the
        longest, a causal mask that also hides each row's padding, K/V written straight into a free
        slot each, MoE layers grouped (eager: prompt lengths vary). Then each slot takes its request's
        code 0, hidden state and sampling state."""
        import torch

        base = self.base
        model = base.talker.model
        chosen: list[tuple[Any, Any, Any]] = []
        with torch.inference_mode():
            for r in batch:
                if len(base._spoken(r)) < 4:  # the thinker ended without a token to speak
                    r.finish_reason = "stop"
                    continue
                if len(chosen) >= len(self.free):
                    r.finish_reason = "error: no free talker slot"
                    continue
                embeds, positions = base.prefill_inputs(r)
                if embeds.shape[1] >= self.max_length:
                    r.finish_reason = "length"  # the prompt alone fills the slab's positions
                    continue
                chosen.append((r, embeds, positions))
            if not chosen:
                return
            n = len(chosen)
            lengths = [embeds.shape[1] for _, embeds, _ in chosen]
            t = max(lengths)
            x = chosen[0][1].new_zeros(n, t, chosen[0][1].shape[-1])
            positions = torch.zeros(3, n, t, dtype=torch.long, device=self.device)
            for j, (_, embeds, at) in enumerate(chosen):
                x[j, : lengths[j]] = embeds[0]
                positions[:, j, : lengths[j]] = at[:, 0]
            size = torch.tensor(lengths, device=self.device)
            keys = torch.arange(t, device=self.device)
            mask = (keys[None, :, None] >= keys[None, None, :]) & (keys[None, None, :] < size[:, None, None])
            mask = mask.unsqueeze(1)  # [n, 1, t, t]
            slots = [_Slot(self.free.pop(0)) for _ in chosen]
            rows = torch.tensor([slot.index for slot in slots], device=self.device)
            cos, sin = model.rotary_emb(x, positions)
            for index, layer in enumerate(model.layers):

                def write(k: Any, v: Any, index: int = index) -> tuple[Any, Any]:
                    self.k[index, rows, :, :t] = k  # padding rows land past the length: masked, then overwritten
                    self.v[index, rows, :, :t] = v
                    return k, v

                h = rms(layer.input_layernorm, x)
                x = x + self._attend(layer.self_attn, h, cos, sin, write, mask)
                h = rms(layer.post_attention_layernorm, x)
                mlp = layer.mlp
                x = x + (grouped_moe(mlp, h.reshape(n * t, -1)).view(n, t, -1) if hasattr(mlp, "experts") else mlp(h))
            last = rms(model.norm, x)[torch.arange(n, device=self.device), size - 1]
            for j, ((r, _, _), slot) in enumerate(zip(chosen, slots, strict=True)):
                self.slots[id(r)] = slot
                r.last_hidden = last[j]
                r.length = lengths[j]
                r.kv = [(None, None)]  # the slab holds it
                base._sample_code0(r, base.talker.codec_head(r.last_hidden))
                self._load(slot.index, r)

    def _load(self, i: int, r: Any) -> None:
        """Slot `i` takes request `r`'s length, hidden state, code 0 and sampling state."""
        import torch

        with torch.inference_mode():
            self.lengths[i] = r.length
            self.rope_delta[i] = r.rope_delta
            self.hidden[i] = r.last_hidden
            self.code0[i] = r.code0
            self.history[i] = False
            if r.history:
                self.history[i, torch.tensor(r.history, device=self.device)] = True
            sampling = r.sampling
            self.temperature[i] = max(sampling.temperature, 1e-5)
            self.top_k[i] = sampling.top_k
            self.top_p[i] = sampling.top_p
            self.penalty[i] = sampling.repetition_penalty
            self.greedy[i] = sampling.greedy
            seed = sampling.seed if sampling.seed is not None else secrets.randbits(32)
            self.seeds[i] = (seed ^ (seed >> 32)) & MASK32

    def _release(self, r: Any) -> None:
        slot = self.slots.pop(id(r), None)
        if slot is not None:
            self.free.append(slot.index)
            self.free.sort()

    def _span(self) -> int:
        return self._bucket(max(s.index for s in self.slots.values()) + 1)

    def advance(self, requests: list[Any]) -> tuple[dict[str, list[list[int]]], bool]:
        """`Qwen3Talker.advance` semantics: prefills, one frames pass, one decode pass (on CUDA on the
        talker's high-priority stream, ordered after the work queued on the current one before it)."""
        if self.stream is None:
            return self._advance(requests)
        import torch

        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        try:
            with torch.cuda.stream(self.stream):
                return self._advance(requests)
        finally:
            current.wait_stream(self.stream)

    def _advance(self, requests: list[Any]) -> tuple[dict[str, list[list[int]]], bool]:
        import torch

        base = self.base
        moved = False
        frames: dict[str, list[list[int]]] = {}
        live = {id(r) for r in requests}
        for key in [key for key in self.slots if key not in live]:  # aborted or dropped by the engine
            self.free.append(self.slots.pop(key).index)
        self.free.sort()
        starting = [r for r in requests if r.kv is None and r.finish_reason is None and base.prefill_ready(r)]
        if starting:
            self._prefill(starting)
            moved = True
        for r in requests:
            if r.code0 is not None and r.finish_reason is None and r.code0 == base.eos:
                r.finish_reason, r.code0 = "stop", None
                moved = True
        pending = [r for r in requests if r.code0 is not None and r.finish_reason is None and id(r) in self.slots]
        if pending:
            n = self._span()
            self.active.zero_()
            index = torch.tensor([self.slots[id(r)].index for r in pending], device=self.device)
            self.active[index] = True
            self._run("frames", n)
            codes = self._read(self.codes[index])
            for r, frame in zip(pending, codes, strict=True):
                frames[r.id] = [frame]
                r.code0 = None
                r.frames += 1
                self.slots[id(r)].has_frame = True
                if r.frames >= r.sampling.max_tokens:
                    r.finish_reason = "length"
            moved = True
        ready: list[Any] = []
        tokens: list[int] = []
        fixed: list[Any] = []  # per ready request: a fixed text row (tts_eos / tts_pad) or None (a token)
        for r in requests:
            slot = self.slots.get(id(r))
            if slot is None or not slot.has_frame or r.finish_reason is not None:
                continue
            if r.length >= self.max_length:
                r.finish_reason = "length"
                continue
            known = base._spoken(r)  # as Qwen3Talker._trailing, with one projection for the batch
            at = 4 + r.step
            if at < len(known):
                tokens.append(known[at])
                fixed.append(None)
            elif r.text_done:
                fixed.append(base.tts_eos if at == len(known) else base.tts_pad)
            else:
                continue
            ready.append(r)
        if ready:
            n = self._span()
            index = torch.tensor([self.slots[id(r)].index for r in ready], device=self.device)
            with torch.inference_mode():
                projected = iter(base._project(tokens) if tokens else [])
                rows = [row if row is not None else next(projected) for row in fixed]
                self.text[index] = torch.stack(rows).to(self.text.dtype)
            self.active.zero_()
            self.active[index] = True
            self._run("decode", n)
            code0 = self._read(self.code0[index])
            for r, code in zip(ready, code0, strict=True):
                r.code0 = code
                r.history.append(code)
                r.length += 1
                r.step += 1
                self.slots[id(r)].has_frame = False
            moved = True
        for r in requests:
            if r.finish_reason is not None:
                self._release(r)
        return frames, moved
