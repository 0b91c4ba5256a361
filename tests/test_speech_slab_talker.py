"""The talker's GPU path (`slab_talker`) on the CPU: grouped MoE, device-side sampling, KV slabs.

The same passes that are captured in CUDA graphs on a GPU run eagerly here; greedy frames must equal
`Qwen3Talker`'s own loop (itself anchored to transformers' `generate()` in test_speech_engines.py)
with requests joining and leaving at different steps. Graph capture itself needs CUDA: that test
is skipped without it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from servelib import tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.models

ANSWERS = [("Hello, who are you?", 16, 6), ("Tell me a story", 8, 10), ("Hi", 5, 4)]
"""(user text, thinker tokens, frames): request i joins at step i, each stops at its own length."""


@pytest.fixture(scope="module")
def folder() -> Path:
    return tiny_model("tiny-qwen3-omni")


@pytest.fixture(scope="module")
def base(folder: Path):
    import torch

    from omni_runtime.engines.speech.qwen3_talker import Qwen3Talker

    return Qwen3Talker(folder, "cpu", torch.float32)


def _run(
    model, tokenizer, greedy: bool = True, stagger: bool = True
) -> tuple[dict[str, list[list[int]]], list[str | None]]:
    """Request i joins at step i (`stagger`) or all at step 0 (then their prefills share one pass)."""
    from omni_runtime.engines.speech.sampling import Sampling

    requests = []
    for i, (text, tokens, frames) in enumerate(ANSWERS):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        sampling = Sampling(temperature=0.0 if greedy else 0.9, max_tokens=frames)
        r = model.new_request(f"r{i}", ids, "ethan", sampling)
        requests.append((r, [100 + 7 * i + j for j in range(tokens)]))
    out: dict[str, list[list[int]]] = {r.id: [] for r, _ in requests}
    step = 0
    while any(r.finish_reason is None for r, _ in requests):
        for joined, (r, feed) in enumerate(requests):
            if feed and step >= (joined if stagger else 0):
                r.text.append(feed.pop(0))
            r.text_done = not feed
        frames, _ = model.advance([r for r, _ in requests if r.finish_reason is None])
        for rid, new in frames.items():
            out[rid] += new
        step += 1
    return out, [r.finish_reason for r, _ in requests]


def test_grouped_moe_equals_the_module_forward(base) -> None:
    import torch

    from omni_runtime.engines.speech.kernels import grouped_moe

    block = base.talker.model.layers[0].mlp
    x = torch.randn(9, base.talker.config.text_config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = block(x.unsqueeze(0))[0]
        got = grouped_moe(block, x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_device_sampling_keeps_to_its_filters() -> None:
    import torch

    from omni_runtime.engines.speech.kernels import sample_rows

    torch.manual_seed(0)
    logits = torch.randn(4, 300)
    ones = torch.ones(4)
    top = logits.topk(5).indices
    for _ in range(20):
        greedy = torch.tensor([True, False, False, False])
        k = torch.tensor([0, 1, 5, 0])
        p = torch.tensor([1.0, 1.0, 1.0, 1e-6])
        got = sample_rows(logits, ones, k, p, greedy)
        assert got[0] == logits[0].argmax() and got[1] == logits[1].argmax() and got[3] == logits[3].argmax()
        assert got[2] in top[2]  # drawn, but only among the 5 best
        fixed = sample_rows(logits, ones, k, ones, torch.zeros(4, dtype=torch.bool), fixed_k=5)
        assert all(fixed[i] in top[i] for i in range(4))
    drawn = {
        int(sample_rows(logits, ones, torch.zeros(4, dtype=torch.long), ones, torch.zeros(4, dtype=torch.bool))[0])
        for _ in range(50)
    }
    assert len(drawn) > 5  # really sampled, not argmax


def test_slab_talker_frames_equal_the_eager_loop_as_requests_join_and_leave(folder: Path, base) -> None:
    from transformers import AutoTokenizer

    from omni_runtime.engines.speech.slab_talker import SlabTalker

    tokenizer = AutoTokenizer.from_pretrained(folder)
    expected, reasons = _run(base, tokenizer)
    slab = SlabTalker(base, max_batch=4, max_length=128)
    sampled, _ = _run(slab, tokenizer, greedy=False)
    assert all(0 <= c < 3072 for frames in sampled.values() for frame in frames for c in frame)
    # all at once (one batched prefill of three prompt lengths), in slots the sampled run gave back
    got, slab_reasons = _run(slab, tokenizer, stagger=False)
    assert [len(v) for v in got.values()] == [frames for _, _, frames in ANSWERS]
    assert got == expected and slab_reasons == reasons
    assert slab.free == [0, 1, 2, 3] and not slab.slots  # every slot given back


def test_fixed_shape_sub_steps_give_the_loops_frames(folder: Path, base) -> None:
    """The code predictor as 16 calls of one fixed-shape sub-step (what CUDA compiles and captures):
    the same greedy frames as the loop over the layers' own shapes, requests joining and leaving."""
    from transformers import AutoTokenizer

    from omni_runtime.engines.speech.slab_talker import SlabTalker

    tokenizer = AutoTokenizer.from_pretrained(folder)
    expected, reasons = _run(base, tokenizer)
    fixed = SlabTalker(base, max_batch=4, max_length=128, substep="fixed")
    got, fixed_reasons = _run(fixed, tokenizer)
    assert fixed.substep_mode == "fixed" and fixed.stream is None
    assert got == expected and fixed_reasons == reasons


def test_a_seed_draws_the_same_frames_alone_or_beside_other_requests(folder: Path, base) -> None:
    """Sampled (not greedy) frames of a seeded request: the slab path's draws hash (seed, position,
    candidate), so the request alone and beside two others gives the same frames; another seed not."""
    from transformers import AutoTokenizer

    from omni_runtime.engines.speech.sampling import Sampling
    from omni_runtime.engines.speech.slab_talker import SlabTalker

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a story"}], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    slab = SlabTalker(base, max_batch=4, max_length=128)

    def run(seeds: list[int]) -> list[list[list[int]]]:
        requests = [
            slab.new_request(f"s{i}", ids, "ethan", Sampling(max_tokens=6, seed=s)) for i, s in enumerate(seeds)
        ]
        out: dict[str, list[list[int]]] = {r.id: [] for r in requests}
        for r in requests:
            r.text, r.text_done = [100 + j for j in range(8)], True
        while any(r.finish_reason is None for r in requests):
            frames, _ = slab.advance([r for r in requests if r.finish_reason is None])
            for rid, new in frames.items():
                out[rid] += new
        return [out[r.id] for r in requests]

    alone = run([7])[0]
    crowd = run([3, 7, 8])
    assert len(alone) == 6 and crowd[1] == alone
    assert crowd[0] != alone and crowd[2] != alone
    slab = SlabTalker(base, max_batch=4, max_length=128, substep="fixed")  # the same draws, fixed-shape sub-steps
    assert run([3, 7, 8]) == crowd


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_graphs_replay_the_eager_passes(folder: Path) -> None:  # pragma: no cover - GPU only
    import torch
    from transformers import AutoTokenizer

    from omni_runtime.engines.speech.qwen3_talker import Qwen3Talker
    from omni_runtime.engines.speech.slab_talker import SlabTalker

    tokenizer = AutoTokenizer.from_pretrained(folder)
    talker = Qwen3Talker(folder, "cuda", torch.float32)
    eager, _ = _run(SlabTalker(talker, max_batch=4, max_length=128, graphs=False), tokenizer)
    graphed, _ = _run(SlabTalker(talker, max_batch=4, max_length=128, graphs=True), tokenizer)
    assert graphed == eager
