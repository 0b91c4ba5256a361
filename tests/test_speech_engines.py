"""Talker and code2wav engines on the tiny Qwen3-Omni, anchored to transformers' own `generate()`.

The thinker runs in transformers here (its greedy tokens are what the talker reads); the talker and
code2wav engines run exactly as in a stage (`make_engine` from the registry's qwen3-omni topology),
fed the thinker's tokens one at a time, several requests at once. Tolerances: codec codes equal
exactly; a whole-output waveform equals transformers' within 1e-4 absolute (the same decoder on the
same codes, in other batch shapes); a windowed waveform has exactly the one-shot length (no sample
lost or doubled) and stays within 0.01 absolute of it (each window sees 25 frames of left context,
the one-shot decode all of them; measured 0.002 over 80 frames, waveform std 0.1).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from servelib import tiny_model

from omni_runtime.engines.base import EngineError, EngineInput, InvalidRequest
from omni_runtime.engines.factory import make_engine
from omni_runtime.registry import get_pipeline
from omni_runtime.spec import EdgeOverride, StageOverride, resolve_pipeline
from omni_runtime.spec.engine_args import InvalidEngineArgs

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.models

PROMPTS = [("Hello, who are you?", 6, 10), ("Tell me a story about a cat and a dog, please.", 9, 14), ("Hi", 4, 7)]
"""(user text, thinker tokens, codec frames): different prompt and answer lengths."""


@pytest.fixture(scope="module")
def folder() -> Path:
    return tiny_model("tiny-qwen3-omni")


@pytest.fixture(scope="module")
def reference(folder: Path) -> list[dict]:
    """Per prompt: transformers' prompt ids, thinker tokens, codec codes [frames][16] and waveform."""
    import torch
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    captured = []
    decode = model.code2wav.chunked_decode

    def capture(codes, **kwargs):
        captured.append(codes[0].T.tolist())
        return decode(codes, **kwargs)

    model.code2wav.chunked_decode = capture
    out = []
    for text, tokens, frames in PROMPTS:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        sequences, wav = model.generate(
            ids,
            speaker="Ethan",
            thinker_max_new_tokens=tokens,
            talker_max_new_tokens=frames + 1,  # transformers makes no frame for its last codec token
            talker_do_sample=False,
            return_audio=True,
        )
        out.append(
            {
                "prompt": ids[0].tolist(),
                "tokens": sequences[0, ids.shape[1] :].tolist(),
                "codes": captured[-1],
                "wav": wav[0, 0],
                "frames": frames,
            }
        )
    return out


def _pipeline(folder: Path):
    return resolve_pipeline(get_pipeline("qwen3-omni"), name="o", model=str(folder))


async def _talk(engine, ref: dict, rid: str) -> list[list[int]]:
    """Feed the thinker tokens one by one (yielding between them) and collect the frames."""
    params = {"temperature": 0.0, "max_tokens": ref["frames"], "voice": "Ethan"}
    first, *rest = ref["tokens"]

    async def chunks():
        for token in rest:
            await asyncio.sleep(0)
            yield {"thinker_token_ids": [token]}

    request = EngineInput(rid, {"thinker_prompt_ids": ref["prompt"], "thinker_token_ids": [first]}, params)
    request.chunks = chunks()
    frames: list[list[int]] = []
    async for output in engine.generate(request):
        if "codes" in output.data:
            frames.extend(output.data["codes"].tolist())
        if output.finished:
            assert output.finish_reason in ("stop", "length")
    return frames


async def _decode(engine, codes: list[list[int]], rid: str, first_window: int, window: int):
    """Feed frames to code2wav in windows (first_window, then window...); the concatenated audio."""
    import numpy as np

    cuts = [0, first_window] if window else [0, len(codes)]
    while window and cuts[-1] < len(codes):
        cuts.append(cuts[-1] + window)
    pieces = [np.asarray(codes[a:b], dtype=np.int64) for a, b in zip(cuts, cuts[1:], strict=False) if a < len(codes)]

    async def chunks():
        for piece in pieces[1:]:
            yield {"codes": piece}

    request = EngineInput(rid, {"codes": pieces[0]}, {})
    request.chunks = chunks()
    audio = [out.data["audio"] for out in [o async for o in engine.generate(request)] if "audio" in out.data]
    return np.concatenate(audio), len(audio)


async def _started(folder: Path, stage: str):
    engine = make_engine(_pipeline(folder), stage)
    await engine.start()
    return engine


def test_talker_and_code2wav_equal_transformers_for_concurrent_requests(folder: Path, reference) -> None:
    import numpy as np

    async def main():
        talker = await _started(folder, "talker")
        code2wav = await _started(folder, "code2wav")
        try:
            assert talker.voices() == ["aiden", "chelsie", "ethan"]
            alone = await _talk(talker, reference[0], "alone")
            together = await asyncio.gather(*(_talk(talker, ref, f"r{i}") for i, ref in enumerate(reference)))
            assert talker.stats()["running_requests"] == 0
            whole = await asyncio.gather(
                *(_decode(code2wav, ref["codes"], f"w{i}", 0, 0) for i, ref in enumerate(reference))
            )
            windowed = await asyncio.gather(
                *(_decode(code2wav, ref["codes"], f"s{i}", 4, 5) for i, ref in enumerate(reference))
            )
            return alone, together, whole, windowed, code2wav.stats()
        finally:
            await talker.stop()
            await code2wav.stop()

    alone, together, whole, windowed, stats = asyncio.run(main())
    assert alone == reference[0]["codes"]
    for ref, frames in zip(reference, together, strict=True):
        assert frames == ref["codes"]  # exact, batched with requests of other lengths
    for ref, (wav, _) in zip(reference, whole, strict=True):
        hf = ref["wav"].numpy()
        assert wav.shape == hf.shape
        np.testing.assert_allclose(wav, hf, atol=1e-4)
    for ref, (wav, count) in zip(reference, windowed, strict=True):
        hf = ref["wav"].numpy()
        assert count == 1 + -(-(len(ref["codes"]) - 4) // 5)  # first window of 4, then windows of 5
        assert wav.shape == hf.shape  # no sample lost or doubled at a boundary
        np.testing.assert_allclose(wav, hf, atol=0.01)
    assert stats["last_batch_size"] >= 1 and stats["windows_total"] > stats["calls_total"]  # windows shared calls


def test_talker_waits_for_the_thinker_and_stops_on_abort(folder: Path, reference) -> None:
    ref = reference[1]

    async def main():
        talker = await _started(folder, "talker")
        try:
            # At most the reference's frames: past them transformers stopped, so there is nothing to compare with
            # (on an idle machine the talker runs far past them in the half second before the abort).
            talker.add_request("slow", ref["prompt"], "ethan", {"temperature": 0.0, "max_tokens": ref["frames"]})
            talker.push_text("slow", ref["tokens"][:3])
            got = []

            async def read():
                async for frames, reason in talker.frames("slow"):
                    got.extend(frames)
                    if reason is not None:
                        return reason

            reader = asyncio.create_task(read())
            await asyncio.sleep(2)
            waited = list(got)  # 3 tokens known: the prefill and one step, then it must wait
            talker.push_text("slow", ref["tokens"][3:], finished=True)
            await asyncio.sleep(0.5)
            await talker.abort("slow")
            reason = await asyncio.wait_for(reader, 60)
            with pytest.raises(InvalidRequest, match="speaker 'nobody' is not one of"):
                talker.add_request("x", ref["prompt"], "nobody", {})
            with pytest.raises(InvalidRequest, match="no '<\\|im_start\\|>assistant' turn"):
                talker.add_request("y", ref["prompt"][:5], "ethan", {})
            return waited, got, reason
        finally:
            await talker.stop()

    waited, got, reason = asyncio.run(main())
    assert 1 <= len(waited) <= 2 and waited == ref["codes"][: len(waited)]  # never ran ahead on pads
    assert reason in ("abort", "stop", "length") and got == ref["codes"][: len(got)]


def test_code2wav_windows_join_without_a_gap_and_batch_alike(folder: Path) -> None:
    """Random codes, the real edge (first window 4 or 2, then 25): windowed == one-shot within 0.01, same
    length; two requests decoded at once equal each decoded alone (1e-5); a first window waiting beside
    a longer window is decoded in a call of its own, and both equal their decodes alone (1e-5)."""
    import numpy as np
    import torch

    codes = torch.randint(0, 2048, (80, 16), generator=torch.Generator().manual_seed(7)).tolist()

    async def main():
        engine = await _started(folder, "code2wav")
        try:
            whole, _ = await _decode(engine, codes, "whole", 0, 0)
            short, _ = await _decode(engine, codes[:30], "short", 0, 0)
            windowed, count = await _decode(engine, codes, "windowed", 4, 25)
            both = await asyncio.gather(_decode(engine, codes[:30], "a", 0, 0), _decode(engine, codes, "b", 0, 0))
            small_first = await _decode(engine, codes, "small-first", 2, 25)
            # a first window waiting beside a later (longer) window: decoded in a call of its own, ahead
            history = torch.tensor(codes).T
            calls = engine.stats()["calls_total"]
            together = await asyncio.gather(
                engine.decode_window(history[:, :60], 25), engine.decode_window(history[:, :2], 2)
            )
            calls = engine.stats()["calls_total"] - calls
            alone = [await engine.decode_window(history[:, :60], 25), await engine.decode_window(history[:, :2], 2)]
            return whole, short, windowed, count, both, small_first, together, calls, alone
        finally:
            await engine.stop()

    whole, short, windowed, count, both, small_first, together, calls, alone = asyncio.run(main())
    assert whole.shape == (80 * 1920 - 555,) and count == 5  # 4 + 25 + 25 + 25 + 1
    assert windowed.shape == whole.shape
    np.testing.assert_allclose(windowed, whole, atol=0.01)
    # a first window of 2 frames (the edge's first_window): the same length, the same audio within 0.01
    assert small_first[0].shape == whole.shape and small_first[1] == 5  # 2 + 25 + 25 + 25 + 3
    np.testing.assert_allclose(small_first[0], whole, atol=0.01)
    assert calls == 2
    for got, expected in zip(together, alone, strict=True):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), atol=1e-5)
    np.testing.assert_allclose(both[0][0], short, atol=1e-5)
    np.testing.assert_allclose(both[1][0], whole, atol=1e-5)


def test_code2wav_graph_buckets_follow_the_edge_and_mixed_precision_keeps_30_db(folder: Path) -> None:
    """The code2wav graphs' frame buckets come from the talker -> code2wav edge (first window 4, window 25,
    25 frames of context: a 50-frame window is not padded to 64); `torch_dtype: mixed` (bfloat16 decoder,
    float32 pre-transformer) decodes within 30 dB SNR of float32; a dtype it cannot run is refused."""
    import torch

    from omni_runtime.engines.speech.code2wav import GRAPH_FRAMES, MIXED, Qwen3Code2Wav, graph_frames

    assert graph_frames(4, 25, 25) == [4, 8, 16, 29, 32, 50]
    assert graph_frames(2, 25, 25) == [2, 4, 8, 16, 27, 32, 50]
    assert graph_frames(0, 25, 0) == [4, 8, 16, 25]
    assert graph_frames(0, 0, 25) == list(GRAPH_FRAMES)  # whole outputs
    assert make_engine(_pipeline(folder), "code2wav").graph_frames == [4, 8, 16, 29, 32, 50]
    streamed = resolve_pipeline(
        get_pipeline("qwen3-omni"),
        name="o",
        model=str(folder),
        edges=[EdgeOverride(source="talker", target="code2wav", window=10)],  # first window 4 (registry)
        stages=[StageOverride(name="code2wav", engine_args={"torch_dtype": MIXED, "left_context": 5})],
    )
    engine = make_engine(streamed, "code2wav")
    assert engine.graph_frames == [4, 8, 14, 15] and engine.dtype == MIXED
    wrong = resolve_pipeline(
        get_pipeline("qwen3-omni"),
        name="o",
        model=str(folder),
        stages=[StageOverride(name="code2wav", engine_args={"torch_dtype": "float9"})],
    )
    # unless the stage says, a GPU decodes mixed and a CPU in float32 (constructing reads args only)
    on_gpu = resolve_pipeline(
        get_pipeline("qwen3-omni"),
        name="o",
        model=str(folder),
        stages=[StageOverride(name="code2wav", engine_args={"device": "cuda:0"})],
    )
    assert make_engine(on_gpu, "code2wav").dtype == MIXED
    assert make_engine(_pipeline(folder), "code2wav").dtype == (MIXED if torch.cuda.is_available() else torch.float32)
    with pytest.raises(EngineError, match="torch_dtype 'float9' is not a torch dtype.*or mixed"):
        make_engine(wrong, "code2wav")
    codes = torch.randint(0, 2048, (2, 16, 40), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        exact = Qwen3Code2Wav(folder, "cpu", torch.float32).module(codes).float()
        mixed = Qwen3Code2Wav(folder, "cpu", MIXED).module(codes).float()
    assert 20 * torch.log10(exact.norm() / (mixed - exact).norm()) >= 30


def test_speech_engines_refuse_what_they_cannot_run(folder: Path, reference) -> None:
    import numpy as np

    loud = resolve_pipeline(
        get_pipeline("qwen3-omni"),
        name="o",
        model=str(folder),
        stages=[StageOverride(name="talker", engine_args={"gpu_memory_utilization": 0.5})],
    )
    with pytest.raises(InvalidEngineArgs, match=r"engine_args\.gpu_memory_utilization is not read by runner"):
        make_engine(loud, "talker")
    ref = reference[0]

    async def main():
        talker = await _started(folder, "talker")
        code2wav = await _started(folder, "code2wav")
        try:
            with pytest.raises(InvalidRequest, match="needs thinker_prompt_ids"):
                await anext(talker.generate(EngineInput("a", {"thinker_token_ids": [1]}, {})))
            with pytest.raises(InvalidRequest, match="temperature -1.0"):
                talker.add_request("c", ref["prompt"], "ethan", {"temperature": -1})
            talker.add_request("d", ref["prompt"], "ethan", {})
            with pytest.raises(InvalidRequest, match="already running"):
                talker.add_request("d", ref["prompt"], "ethan", {})
            await talker.abort("d")
            bad = EngineInput("e", {"codes": np.zeros((3, 8), dtype=np.int64)}, {})
            with pytest.raises(InvalidRequest, match="codes \\(frames, 16\\)"):
                await anext(code2wav.generate(bad))
            high = EngineInput("f", {"codes": np.full((3, 16), 5000, dtype=np.int64)}, {})
            with pytest.raises(InvalidRequest, match="must lie in \\[0, 2048\\)"):
                await anext(code2wav.generate(high))
        finally:
            await talker.stop()
            await code2wav.stop()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("topology", "folder_name", "stage", "what"),
    [
        ("qwen3-omni", "tiny-qwen3-omni", "talker", "a greedy one-frame request"),
        ("qwen3-omni", "tiny-qwen3-omni", "code2wav", "decoding 4 codec frames"),
        ("qwen2-5-omni", "tiny-qwen2-5-omni", "talker", "a greedy one-frame request"),
        ("qwen2-5-omni", "tiny-qwen2-5-omni", "code2wav", "decoding 4 codec frames"),
    ],
)
def test_a_speech_stage_that_would_fail_every_request_never_becomes_ready(
    topology: str, folder_name: str, stage: str, what: str
) -> None:
    """`device: meta` is a real engine arg (torch's meta device: the modules load as shapes and compute
    nothing), with which each speech engine (Qwen3 talker and code2wav, Qwen2.5 talker and token2wav) loads
    but no request can run. Its self-check (one tiny request before the stage reports ready) fails, and
    `start()` raises saying what ran and what to change instead of the stage failing every request (the stage
    process turns that into an EngineFailed termination message, tests/test_engines.py runs it for `ar`).
    Every other test here starts these engines with the topology's defaults, so there the self-check passes."""
    defaults = next(s for s in get_pipeline(topology).stages if s.name == stage).engine_args
    pipeline = resolve_pipeline(
        get_pipeline(topology), name="o", model=str(tiny_model(folder_name)),
        stages=[StageOverride(name=stage, engine_args={**defaults, "device": "meta"})],
    )  # fmt: skip
    engine = make_engine(pipeline, stage)

    async def main():
        try:
            with pytest.raises(EngineError) as err:
                await engine.start()
        finally:
            await engine.stop()
        return str(err.value)

    message = asyncio.run(main())
    assert f"stage {stage!r}: the self-check ({what}" in message and "on meta" in message
    assert "every request would fail" in message and "check the stage's engine_args device" in message


def test_qwen2_5_token2wav_whole_equals_transformers_and_windows_join() -> None:
    """Whole output (edge window 0): transformers' own token2wav waveform for the same speaker and noise
    seed (within 1e-5). Windowed (the registry's edge: 4 codes, then 25): each window gives exactly its
    codes' samples (480 a code), so the total is the one-shot length, and all but the last 10 codes of
    each window (which lack the codes after them) equal a one-shot decode with the same noise (1e-4):
    no sample lost or doubled at a boundary. Bad voices and codes are 400s."""
    import numpy as np
    import torch
    from transformers import Qwen2_5OmniForConditionalGeneration

    folder = tiny_model("tiny-qwen2-5-omni")
    codes = torch.randint(0, 8192, (80,), generator=torch.Generator().manual_seed(3))
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    speaker = model.speaker_map["Ethan"]
    torch.manual_seed(5)
    with torch.inference_mode():
        expected = model.token2wav(codes[None, :40], conditioning=speaker["cond"], reference_mel=speaker["ref_mel"])
    expected = expected.reshape(-1).numpy()
    streamed = resolve_pipeline(get_pipeline("qwen2-5-omni"), name="q", model=str(folder))
    whole = resolve_pipeline(
        get_pipeline("qwen2-5-omni"), name="q", model=str(folder),
        edges=[EdgeOverride(source="talker", target="code2wav", window=0)],
    )  # fmt: skip
    cuts = [0, 4, 29, 54, 79, 80]

    async def main():
        engine = make_engine(whole, "code2wav")
        windowed = make_engine(streamed, "code2wav")
        await engine.start()
        await windowed.start()
        try:
            assert engine.voices() == ["chelsie", "ethan"]

            async def rest():
                yield {"codes": codes[15:40].numpy()}

            request = EngineInput("r", {"codes": codes[:15].numpy()}, {"voice": "ethan", "seed": 5}, chunks=rest())
            outputs = [o async for o in engine.generate(request)]

            async def windows():
                for a, b in zip(cuts[1:], cuts[2:], strict=False):
                    yield {"codes": codes[a:b].numpy()}

            request = EngineInput("s", {"codes": codes[:4].numpy()}, {"voice": "ethan"}, chunks=windows())
            pieces = [o.data["audio"] async for o in windowed.generate(request) if "audio" in o.data]
            oneshot = windowed.model.decode_window(codes, 0, "Ethan", 0, windowed.num_steps, 25).numpy()
            torch.manual_seed(5)
            noise = torch.randn(1, 80, 80)
            mel = windowed.model._sample(codes[None, :40], noise, windowed.model.speakers["Ethan"], 10)
            again = windowed.model.module.code2wav_bigvgan_model(mel).reshape(-1).detach().numpy()
            with pytest.raises(InvalidRequest, match="voice 'nobody' is not one of"):
                await anext(engine.generate(EngineInput("x", {"codes": codes.numpy()}, {"voice": "nobody"})))
            with pytest.raises(InvalidRequest, match="must lie in \\[0, 8193\\)"):
                await anext(engine.generate(EngineInput("y", {"codes": np.array([9000])}, {})))
            return outputs, pieces, oneshot, again, windowed.model
        finally:
            await engine.stop()
            await windowed.stop()

    outputs, pieces, oneshot, again, t2w = asyncio.run(main())
    assert [o.finished for o in outputs] == [False, True] and outputs[-1].usage["codec_tokens"] == 40
    np.testing.assert_allclose(outputs[0].data["audio"], expected, atol=1e-5)
    np.testing.assert_allclose(again, expected, atol=1e-5)  # the windows' DiT route, given transformers' noise
    assert [len(p) for p in pieces] == [(b - a) * 480 for a, b in zip(cuts, cuts[1:], strict=False)]
    joined = np.concatenate(pieces)
    assert joined.shape == oneshot.shape == (80 * 480,)
    exact = np.zeros(80, dtype=bool)
    for start, end in zip(cuts, cuts[1:], strict=False):
        for code in range(start, end):  # measured: BigVGAN reaches ~15 mel frames (8 codes) ahead
            exact[code] = end == 80 or code < end - 10
    assert exact.sum() == 46 and t2w.block_codes == 12
    mask = np.repeat(exact, 480)
    np.testing.assert_allclose(joined[mask], oneshot[mask], atol=1e-4)


def test_qwen2_5_token2wav_decodes_windows_of_concurrent_requests_together() -> None:
    """Three concurrent windowed requests of different lengths and voices (4 codes, then 25): the windows
    waiting at the same moment are decoded in shared calls (stats: fewer calls than windows), windows of one
    length in one DiT + BigVGAN call, and each request's waveform equals its decode alone (1e-4: the same
    model in another batch shape)."""
    import numpy as np
    import torch

    folder = tiny_model("tiny-qwen2-5-omni")
    pipeline = resolve_pipeline(get_pipeline("qwen2-5-omni"), name="q", model=str(folder))
    cases = [(70, "ethan", 1), (45, "chelsie", 2), (30, "ethan", 3)]
    codes = [torch.randint(0, 8192, (n,), generator=torch.Generator().manual_seed(n)) for n, _, _ in cases]

    async def decode(engine, rid: str, i: int):
        cuts = [0, 4, *range(29, len(codes[i]), 25), len(codes[i])]

        async def rest():
            for a, b in zip(cuts[1:], cuts[2:], strict=False):
                yield {"codes": codes[i][a:b].numpy()}

        params = {"voice": cases[i][1], "seed": cases[i][2]}
        request = EngineInput(rid, {"codes": codes[i][:4].numpy()}, params, chunks=rest())
        return np.concatenate([o.data["audio"] async for o in engine.generate(request) if "audio" in o.data])

    async def main():
        engine = make_engine(pipeline, "code2wav")
        await engine.start()
        try:
            alone = [await decode(engine, f"a{i}", i) for i in range(3)]
            before = engine.stats()
            together = await asyncio.gather(*(decode(engine, f"t{i}", i) for i in range(3)))
            after = engine.stats()
            return alone, together, before, after
        finally:
            await engine.stop()

    alone, together, before, after = asyncio.run(main())
    assert before["calls_total"] == before["windows_total"] == 4 + 3 + 3  # one at a time: a call per window
    calls, windows = after["calls_total"] - before["calls_total"], after["windows_total"] - before["windows_total"]
    assert windows == 10 and calls < windows, (calls, windows)  # windows shared calls
    for (n, _, _), one, batched in zip(cases, alone, together, strict=True):
        assert one.shape == batched.shape == (n * 480,)
        np.testing.assert_allclose(batched, one, atol=1e-4)


Q25_CASES = [("Hello, who are you?", 8, 30), ("Tell me a story about a cat and a dog, please.", 12, 24), ("Hi", 5, 16)]
"""(user text, thinker tokens, talker codes): different prompt and answer lengths."""


@pytest.fixture(scope="module")
def q25_reference() -> list[dict]:
    from qwen25_reference import generate_reference

    return generate_reference(Q25_CASES)


async def _talk25(engine, ref: dict, rid: str, streamed: bool) -> list[int]:
    """Feed the thinker's rows as the ar engine sends them: streamed, one token per chunk, the row of
    token j-1 with token j (the prompt's rows with the first, through the edge's real processor, with
    the media grids of a media prompt); or whole, in one input."""
    from omni_runtime.processors import ProcessorContext, apply_processor

    prompt, tokens, n = ref["prompt"], ref["tokens"], len(ref["prompt"])
    params = {"temperature": 0.0, "max_tokens": ref["frames"], "voice": "Ethan"}
    grids = {"thinker_media_grids": ref["grids"]} if "grids" in ref else {}

    def rows(a: int, b: int) -> dict:
        return {"thinker_embeds": ref["embeds"][a:b], "thinker_hidden": ref["hidden"][a:b], "thinker_hidden_layer": 2}

    if not streamed:
        whole = {"thinker_prompt_ids": prompt, "thinker_token_ids": tokens, **rows(0, None), **grids}
        request = EngineInput(rid, whole, params)
    else:

        async def chunks():
            for j in range(1, len(tokens)):
                await asyncio.sleep(0)
                yield {"thinker_token_ids": tokens[j : j + 1], **rows(n + j - 1, n + j)}

        thinker = get_pipeline("qwen2-5-omni").stage("thinker")
        output = {"prompt_token_ids": prompt, "token_ids": tokens[:1], "text": "",
                  "hidden_states": {"0": ref["embeds"][:n], "2": ref["hidden"][:n]}}  # fmt: skip
        if "grids" in ref:
            output["media_grids"] = ref["grids"]
        first = apply_processor("thinker_to_talker", thinker, {"primary": output}, ProcessorContext(rid))
        request = EngineInput(rid, first, params, chunks=chunks())
    codes: list[int] = []
    async for output in engine.generate(request):
        if "codes" in output.data:
            assert output.data["codes"].shape[1] == 1
            codes.extend(output.data["codes"][:, 0].tolist())
    return codes


def test_qwen2_5_talker_and_token2wav_equal_transformers(q25_reference) -> None:
    """Greedy codes equal transformers' exactly: alone and with two other requests of other lengths,
    streamed per thinker step and whole; token2wav of those codes (whole) equals transformers' waveform
    within 1e-4. A thinker sending the wrong layer or no rows is a 400 naming the fix."""
    import numpy as np

    pipeline = resolve_pipeline(
        get_pipeline("qwen2-5-omni"), name="q", model=str(tiny_model("tiny-qwen2-5-omni")),
        edges=[EdgeOverride(source="talker", target="code2wav", window=0)],  # whole outputs: transformers' decode
    )  # fmt: skip
    refs = q25_reference

    async def main():
        talker = make_engine(pipeline, "talker")
        token2wav = make_engine(pipeline, "code2wav")
        await talker.start()
        await token2wav.start()
        try:
            assert talker.voices() == ["chelsie", "ethan"] == token2wav.voices()
            alone = await _talk25(talker, refs[0], "alone", streamed=True)
            together = {
                streamed: await asyncio.gather(
                    *(_talk25(talker, r, f"{streamed}{i}", streamed) for i, r in enumerate(refs))
                )
                for streamed in (True, False)
            }
            assert talker.stats()["running_requests"] == 0
            wavs = []
            for i, r in enumerate(refs):
                request = EngineInput(f"w{i}", {"codes": np.asarray(r["codes"], dtype=np.int64)}, {"voice": "ethan"})
                wavs.append([o.data["audio"] async for o in token2wav.generate(request) if "audio" in o.data][0])
            ref = refs[0]
            wrong = {"thinker_prompt_ids": ref["prompt"], "thinker_token_ids": [1], "thinker_embeds": ref["embeds"],
                     "thinker_hidden": ref["hidden"], "thinker_hidden_layer": 1}  # fmt: skip
            with pytest.raises(InvalidRequest, match="hidden_state_layers to \\[0, -1\\]"):
                await anext(talker.generate(EngineInput("x", wrong, {})))
            with pytest.raises(InvalidRequest, match="needs thinker_prompt_ids and the thinker's rows"):
                await anext(talker.generate(EngineInput("y", {"thinker_prompt_ids": ref["prompt"]}, {})))
            return alone, together, wavs
        finally:
            await talker.stop()
            await token2wav.stop()

    alone, together, wavs = asyncio.run(main())
    assert alone == refs[0]["codes"] and len(alone) > 10
    for streamed in (True, False):
        for ref, codes in zip(refs, together[streamed], strict=True):
            assert codes == ref["codes"], streamed
    for ref, wav in zip(refs, wavs, strict=True):
        np.testing.assert_allclose(wav, ref["wav"].numpy(), atol=1e-4)


MEDIA_FRAMES = 8


def _red_picture():
    from PIL import Image

    return Image.new("RGB", (64, 48), (200, 30, 30))


def _audio():
    import numpy as np

    return (np.sin(np.arange(8000, dtype=np.float32) / 10) * 0.3).astype(np.float32)  # 0.5 s at 16 kHz


@pytest.fixture(scope="module")
def media_reference(folder: Path) -> list[dict]:
    """transformers' own generate() of the whole tiny model on a prompt with an image and one with audio:
    prompt ids, thinker tokens, codes, waveform, and what the thinker stage exports for the talker (the
    layer-`accept_hidden_layer` rows at the media positions, from the thinker's own prefill, and the grids)."""
    import torch
    from transformers import AutoProcessor, Qwen3OmniMoeForConditionalGeneration

    processor = AutoProcessor.from_pretrained(folder)
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    captured: dict[str, object] = {}
    decode, thinker_generate = model.code2wav.chunked_decode, model.thinker.generate

    def capture_codes(codes, **kwargs):
        captured["codes"] = codes[0].T.tolist()
        return decode(codes, **kwargs)

    def capture_thinker(*args, **kwargs):
        captured["thinker"] = result = thinker_generate(*args, **kwargs)
        return result

    model.code2wav.chunked_decode, model.thinker.generate = capture_codes, capture_thinker
    layer = model.config.talker_config.accept_hidden_layer
    media_ids = {model.config.thinker_config.audio_token_id, model.config.thinker_config.image_token_id}
    out = []
    for kind, media in (("image", {"images": [_red_picture()]}), ("audio", {"audio": [_audio()]})):
        content = [{"type": kind}, {"type": "text", "text": f"what is in this {kind}?"}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        inputs = processor(text=[text], return_tensors="pt", **media)
        sequences, wav = model.generate(
            **inputs, speaker="Ethan", thinker_max_new_tokens=6, talker_max_new_tokens=MEDIA_FRAMES + 1,
            talker_do_sample=False, return_audio=True,
        )  # fmt: skip
        prompt = inputs["input_ids"][0].tolist()
        rows = captured["thinker"].hidden_states[0][layer][0]  # the prefill step: every prompt position
        positions = [i for i, t in enumerate(prompt) if t in media_ids]
        assert positions
        grids = {
            "image_grid_thw": inputs["image_grid_thw"].tolist() if "image_grid_thw" in inputs else [],
            "audio_feature_lengths": inputs["feature_attention_mask"].sum(-1).tolist()
            if "feature_attention_mask" in inputs
            else [],
        }
        out.append(
            {
                "kind": kind,
                "prompt": prompt,
                "tokens": sequences[0, len(prompt) :].tolist(),
                "codes": captured["codes"],
                "wav": wav[0, 0],
                "frames": len(captured["codes"]),
                "thinker_output": {"media_hidden_states": rows[positions], "media_grids": grids},
            }
        )
    return out


async def _talk_media(engine, folder: Path, ref: dict, rid: str) -> list[list[int]]:
    """As `_talk`, the first chunk built by the edge's real processor from a thinker-stage output."""
    from omni_runtime.processors import ProcessorContext, apply_processor

    topology = _pipeline(folder).topology
    thinker_output = {"prompt_token_ids": ref["prompt"], "token_ids": ref["tokens"][:1], "text": "",
                      **ref.get("thinker_output", {})}  # fmt: skip
    first = apply_processor("thinker_to_talker", topology.stage("thinker"), {"primary": thinker_output},
                            ProcessorContext(rid))  # fmt: skip
    params = {"temperature": 0.0, "max_tokens": ref["frames"], "voice": "Ethan"}

    async def chunks():
        for token in ref["tokens"][1:]:
            await asyncio.sleep(0)
            yield {"thinker_token_ids": [token]}

    request = EngineInput(rid, first, params, chunks=chunks())
    frames: list[list[int]] = []
    async for output in engine.generate(request):
        if "codes" in output.data:
            frames.extend(output.data["codes"].tolist())
    return frames


def test_talker_speaks_prompts_with_media_as_transformers_does(folder: Path, reference, media_reference) -> None:
    """An image prompt (3-D rope positions from the image grid) and an audio prompt, each beside a text-only
    request: codec codes equal transformers' exactly, the waveform within 1e-4 (as above). The rows are the
    ones transformers' thinker computed (the vLLM thinker's equal them: tests/test_hidden_states.py)."""
    import numpy as np

    async def main():
        talker = await _started(folder, "talker")
        code2wav = await _started(folder, "code2wav")
        try:
            together = await asyncio.gather(
                *(_talk_media(talker, folder, ref, f"m{i}") for i, ref in enumerate([*media_reference, reference[2]]))
            )
            wavs = [(await _decode(code2wav, frames, f"w{i}", 0, 0))[0] for i, frames in enumerate(together)]
            # what is genuinely unsupported or broken is a clear 400
            ref = media_reference[0]
            rows = ref["thinker_output"]["media_hidden_states"]
            with pytest.raises(InvalidRequest, match="sent no hidden-state rows for them; set engine_args"):
                talker.add_request("a", ref["prompt"], "ethan", {})
            broken = {"thinker_prompt_ids": ref["prompt"], "thinker_media_rows": rows[1:], "thinker_media_grids": {}}
            with pytest.raises(InvalidRequest, match="media rows of shape"):
                await anext(talker.generate(EngineInput("b", broken, {})))
            wrong = {**broken, "thinker_media_rows": rows, "thinker_media_grids": {"image_grid_thw": [[1, 2, 2]]}}
            with pytest.raises(InvalidRequest, match="image grids \\[\\[1, 2, 2\\]\\] for a prompt with"):
                await anext(talker.generate(EngineInput("c", wrong, {})))
            odd = {**broken, "thinker_media_rows": rows, "thinker_media_grids": {"fps": 2}}
            with pytest.raises(InvalidRequest, match="thinker_media_grids must be a mapping with keys from"):
                await anext(talker.generate(EngineInput("d", odd, {})))
            return together, wavs
        finally:
            await talker.stop()
            await code2wav.stop()

    together, wavs = asyncio.run(main())
    for ref, frames, wav in zip([*media_reference, reference[2]], together, wavs, strict=True):
        assert frames == ref["codes"][: ref["frames"]], ref.get("kind", "text")
        if len(frames) == len(ref["codes"]):
            hf = ref["wav"].numpy()
            assert wav.shape == hf.shape
            np.testing.assert_allclose(wav, hf, atol=1e-4)


Q25_MEDIA = [("image",), ("audio",), ("image", "audio")]


@pytest.fixture(scope="module")
def q25_media_reference() -> list[dict]:
    from qwen25_reference import generate_media_reference

    # only the image request's waveform is compared: token2wav is the slow part of transformers' generate()
    return [
        generate_media_reference(kinds, "what is this?", 6, 12, waveform=i == 0) for i, kinds in enumerate(Q25_MEDIA)
    ]


def test_qwen2_5_talker_speaks_media_prompts_as_transformers_does(q25_reference, q25_media_reference) -> None:
    """Prompts with an image (3-D rope positions from its grid, decode steps at cache length + rope
    delta), audio, and both, beside a text-only request, streamed and whole: greedy codes equal
    transformers' generate() of the whole model exactly (its rows at the media positions keep only the
    last layer, as there); the image request alone has transformers' codec logits at every step within
    1e-5 (measured 2e-7; plain positions instead of the rope index give 1e-3 with the same codes, so
    codes alone would not notice); token2wav of its codes equals its waveform within 1e-4. The rows are
    transformers' own (the served test has vLLM's). Grids missing or not fitting are a 400."""
    import numpy as np

    pipeline = resolve_pipeline(
        get_pipeline("qwen2-5-omni"), name="q", model=str(tiny_model("tiny-qwen2-5-omni")),
        edges=[EdgeOverride(source="talker", target="code2wav", window=0)],
    )  # fmt: skip
    refs = [*q25_media_reference, q25_reference[2]]

    async def main():
        talker = make_engine(pipeline, "talker")
        token2wav = make_engine(pipeline, "code2wav")
        await talker.start()
        await token2wav.start()
        try:
            logits: list = []
            head = talker.model.talker.codec_head
            hook = head.register_forward_hook(lambda m, i, o: logits.append(o.reshape(-1, o.shape[-1])[-1].clone()))
            alone = await _talk25(talker, refs[0], "alone", streamed=True)
            hook.remove()
            together = {
                streamed: await asyncio.gather(
                    *(_talk25(talker, r, f"m{streamed}{i}", streamed) for i, r in enumerate(refs))
                )
                for streamed in (True, False)
            }
            codes = np.asarray(refs[0]["codes"], dtype=np.int64)
            request = EngineInput("w", {"codes": codes}, {"voice": "ethan"})
            wav = [o.data["audio"] async for o in token2wav.generate(request) if "audio" in o.data][0]
            image, both = q25_media_reference[0], q25_media_reference[2]
            rows = {"thinker_embeds": image["embeds"], "thinker_hidden": image["hidden"], "thinker_hidden_layer": 2}
            base = {"thinker_prompt_ids": image["prompt"], "thinker_token_ids": image["tokens"][:1], **rows}
            with pytest.raises(
                InvalidRequest, match="image / video token ids \\[151655\\] but the thinker sent no media"
            ):
                await anext(talker.generate(EngineInput("x", base, {})))
            wrong = {**base, "thinker_media_grids": {"image_grid_thw": [[1, 2, 2]]}}
            with pytest.raises(InvalidRequest, match="image grids \\[\\[1, 2, 2\\]\\] for a prompt with 4 image"):
                await anext(talker.generate(EngineInput("y", wrong, {})))
            no_audio = {
                **base,
                "thinker_prompt_ids": both["prompt"],
                "thinker_media_grids": {"image_grid_thw": [[1, 4, 4]]},
            }
            with pytest.raises(InvalidRequest, match="0 audio_feature_lengths for a prompt with 1 audios"):
                await anext(talker.generate(EngineInput("z", no_audio, {})))
            assert talker.stats()["running_requests"] == 0
            return alone, logits, together, wav
        finally:
            await talker.stop()
            await token2wav.stop()

    alone, logits, together, wav = asyncio.run(main())
    assert alone == refs[0]["codes"] and len(logits) == len(refs[0]["logits"]) == 12
    for got, want in zip(logits, refs[0]["logits"], strict=True):
        assert (got - want).abs().max().item() <= 1e-5
    for streamed in (True, False):
        for ref, codes in zip(refs, together[streamed], strict=True):
            assert codes == ref["codes"], (ref.get("kinds"), streamed)
    np.testing.assert_allclose(wav, refs[0]["wav"].numpy(), atol=1e-4)
