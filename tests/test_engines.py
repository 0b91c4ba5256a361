"""Engines and input processors.

Fast tests (no model) cover the processors, engine-arg handling and the factory. Tests marked
`models` load the tiny random-weight models (built on first use in the model cache) with the real
engines: vLLM AsyncLLM for `ar` (started once for the module: it is slow on CPU), diffusers for
`diffusion` and an AutoencoderKL runner for `generation`. Diffusion runs 2 steps at 64x64.
"""

from __future__ import annotations

import asyncio
import io
import os
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import pytest_asyncio
import torch
from servelib import diffusion_image

from omni_runtime.engines.ar.cpu import CPU_ENGINE_DEFAULTS, cpu_defaults
from omni_runtime.engines.ar.engine import AREngine, companion_requests
from omni_runtime.engines.base import EngineError, EngineInput, EngineOutput, InvalidRequest
from omni_runtime.engines.diffusion.engine import DiffusionEngine
from omni_runtime.engines.factory import make_engine
from omni_runtime.engines.generation import VAEDecodeEngine
from omni_runtime.processors import (
    PROCESSORS,
    ProcessorContext,
    ProcessorError,
    apply_processor,
)
from omni_runtime.registry import get_pipeline
from omni_runtime.spec import (
    INPUT_PROCESSORS,
    PipelineSpec,
    ResolvedPipeline,
    SpecError,
    StageOverride,
    StageSpec,
    resolve_pipeline,
)
from omni_runtime.spec.engine_args import RegistryOnlyKeys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = pytest.mark.timeout(600)
models = pytest.mark.models
in_module_loop = pytest.mark.asyncio(loop_scope="module")

MAX_MODEL_LEN = 256
AR_ARGS = {"max_model_len": MAX_MODEL_LEN, "kv_cache_memory_bytes": 64 * 1024**2, "seed": 0}
DIT_ARGS = {"torch_dtype": "float32", "batch_window_ms": 20, "max_batch_size": 8}
"""float32 not to make a CPU run work (the topology's bfloat16 serves: test_serve_t2i) but because the batching
tests compare a batched image with the same request alone to float rounding, which half precision's
batch-shape-dependent rounding would blur."""
DIT_PARAMS = {"num_inference_steps": 2, "height": 64, "width": 64}


# --- helpers ------------------------------------------------------------------------------------


def _prompt_enhanced(model: str = "/models/none", **overrides: dict) -> ResolvedPipeline:
    stages = [StageOverride(name=name, **fields) for name, fields in overrides.items()]
    return resolve_pipeline(get_pipeline("prompt-enhanced-t2i"), name="t", model=model, stages=stages)


async def _collect(engine, request: EngineInput) -> list[EngineOutput]:
    return [out async for out in engine.generate(request)]


def _pixels(png: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(np.int16)


def _our_children() -> set[int]:
    """Child processes of this test process, without multiprocessing's resource tracker (a
    process-wide singleton that lives as long as the interpreter)."""
    pids = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            zombie = proc.status() == psutil.STATUS_ZOMBIE
            if zombie or not any("resource_tracker" in part for part in proc.cmdline()):
                pids.add(proc.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


def _stage(name: str, **fields) -> dict:
    return {"name": name, **fields}


# --- processors (no model) ----------------------------------------------------------------------


def test_processors_implement_every_registered_name() -> None:
    assert set(PROCESSORS) == set(INPUT_PROCESSORS)


def test_identity_passes_the_primary_output() -> None:
    upstream = StageSpec(name="a", kind="ar")
    outputs = {"primary": {"text": "hi", "token_ids": [1]}}
    out = apply_processor("identity", upstream, outputs, ProcessorContext("r"))
    assert out == {"text": "hi", "token_ids": [1]}
    with pytest.raises(ProcessorError, match="primary"):
        apply_processor("identity", upstream, {"cfg_text": {}}, ProcessorContext("r"))
    with pytest.raises(ProcessorError, match="unknown"):
        apply_processor("nope", upstream, {}, ProcessorContext("r"))


def test_ar_text_to_prompt_pairs_the_companion_as_negative_prompt() -> None:
    enhancer = get_pipeline("prompt-enhanced-t2i").stage("enhancer")
    outputs = {"primary": {"text": " a red fox in snow \n"}, "cfg_text": {"text": "blurry, dark"}}
    out = apply_processor("ar_text_to_prompt", enhancer, outputs, ProcessorContext("r"))
    assert out == {"prompt": "a red fox in snow", "negative_prompt": "blurry, dark"}
    # No companion output: the client's own negative prompt, else none.
    ctx = ProcessorContext("r", {"negative_prompt": "ugly"})
    fox = {"primary": {"text": "fox"}}
    assert apply_processor("ar_text_to_prompt", enhancer, fox, ctx)["negative_prompt"] == "ugly"
    plain = StageSpec(name="llm", kind="ar")
    out = apply_processor("ar_text_to_prompt", plain, fox, ProcessorContext("r"))
    assert out == {"prompt": "fox", "negative_prompt": None}
    with pytest.raises(ProcessorError, match="empty text"):
        apply_processor("ar_text_to_prompt", plain, {"primary": {"text": "  "}}, ProcessorContext("r"))


def test_thinker_to_talker_hands_over_the_thinkers_rows_and_tokens() -> None:
    """Qwen2.5-Omni: the ar engine's per-layer rows (layer 0 and the last) reach the talker by name."""
    thinker = get_pipeline("qwen2-5-omni").stage("thinker")
    rng = np.random.default_rng(0)
    embeds, last = (rng.standard_normal((4, 8)).astype(np.float16) for _ in range(2))  # connectors may give numpy
    payload = {"hidden_states": {"0": embeds, "2": last}, "prompt_token_ids": [1, 2, 3], "token_ids": [4, 5],
               "text": "hi"}  # fmt: skip
    out = apply_processor("thinker_to_talker", thinker, {"primary": payload}, ProcessorContext("r"))
    assert out["thinker_prompt_ids"] == [1, 2, 3] and out["thinker_token_ids"] == [4, 5]
    assert out["thinker_text"] == "hi" and out["thinker_hidden_layer"] == 2
    assert out["thinker_embeds"].dtype == torch.float32 and tuple(out["thinker_hidden"].shape) == (4, 8)
    assert torch.allclose(out["thinker_hidden"], torch.from_numpy(last).float())
    assert torch.allclose(out["thinker_embeds"], torch.from_numpy(embeds).float())
    assert "thinker_media_grids" not in out  # a text prompt has none; a media prompt's go with the rows
    grids = {"image_grid_thw": [[1, 4, 4]], "audio_feature_lengths": [50]}
    media = apply_processor("thinker_to_talker", thinker, {"primary": {**payload, "media_grids": grids}},
                            ProcessorContext("r"))  # fmt: skip
    assert media["thinker_media_grids"] == grids and media["thinker_hidden_layer"] == 2
    with pytest.raises(ProcessorError, match="hidden_state_layers to \\[0, -1\\]"):
        only = {**payload, "hidden_states": {"2": last}}
        apply_processor("thinker_to_talker", thinker, {"primary": only}, ProcessorContext("r"))
    with pytest.raises(ProcessorError, match="have shapes \\(4, 8\\) and \\(3, 8\\)"):
        short = {**payload, "hidden_states": {"0": embeds, "2": last[:3]}}
        apply_processor("thinker_to_talker", thinker, {"primary": short}, ProcessorContext("r"))
    with pytest.raises(ProcessorError, match="not a dict of layer index"):
        apply_processor("thinker_to_talker", thinker, {"primary": {**payload, "hidden_states": last}},
                        ProcessorContext("r"))  # fmt: skip
    with pytest.raises(ProcessorError, match="'token_ids'"):
        apply_processor("thinker_to_talker", thinker, {"primary": {"text": "hi"}}, ProcessorContext("r"))


def test_thinker_to_talker_hands_over_token_ids_per_chunk() -> None:
    """Qwen3-Omni text prompts: ids only, the prompt's on the first chunk (the talker embeds them)."""
    thinker = get_pipeline("qwen3-omni").stage("thinker")
    first = {"prompt_token_ids": [1, 2, 3], "token_ids": [4], "text": "Hi"}
    out = apply_processor("thinker_to_talker", thinker, {"primary": first}, ProcessorContext("r"))
    assert out == {"thinker_prompt_ids": [1, 2, 3], "thinker_token_ids": [4], "thinker_text": "Hi"}
    later = apply_processor("thinker_to_talker", thinker, {"primary": {"token_ids": [5, 6], "text": " there"}},
                            ProcessorContext("r"))  # fmt: skip
    assert later == {"thinker_token_ids": [5, 6], "thinker_text": " there"}


def test_talker_to_code2wav_gives_codes_without_the_stop_token() -> None:
    talker = StageSpec(name="talker", kind="ar", output_modality="hidden", sampling_params={"stop_token_ids": [8294]})
    out = apply_processor(
        "talker_to_code2wav", talker, {"primary": {"token_ids": [7, 8, 9, 8294]}}, ProcessorContext("r")
    )
    assert out["codes"].tolist() == [[7], [8], [9]]  # (frames, codebooks): time first on every edge
    codes = torch.arange(12).reshape(4, 3)  # (frames, codebooks)
    out = apply_processor("talker_to_code2wav", talker, {"primary": {"codes": codes}}, ProcessorContext("r"))
    assert out["codes"].shape == (4, 3) and torch.equal(out["codes"], codes)  # no transpose on the way
    one = apply_processor("talker_to_code2wav", talker, {"primary": {"codes": np.arange(5)}}, ProcessorContext("r"))
    assert one["codes"].shape == (5, 1) and one["codes"].dtype == torch.long


def test_processors_refuse_a_payload_of_the_wrong_shape_naming_the_edge_and_the_field() -> None:
    """A mismatched engine and edge is a clear error: the edge (`source->target`), the field, what came, what fits."""
    talker = StageSpec(name="talker", kind="generation")
    to_code2wav = ProcessorContext("r", target="code2wav")
    with pytest.raises(ProcessorError, match=r"edge talker->code2wav: field 'codes' has shape \(3, 4, 5\); "
                       r"expected \(frames,\) or \(frames, codebooks\)"):  # fmt: skip
        apply_processor("talker_to_code2wav", talker, {"primary": {"codes": torch.zeros(3, 4, 5, dtype=torch.long)}},
                        to_code2wav)  # fmt: skip
    with pytest.raises(ProcessorError, match=r"edge talker->code2wav: field 'codes' has dtype torch.float32; "
                       r"expected integer"):  # fmt: skip
        apply_processor("talker_to_code2wav", talker, {"primary": {"codes": np.zeros((4, 16), np.float32)}},
                        to_code2wav)  # fmt: skip
    with pytest.raises(ProcessorError, match=r"edge talker->code2wav: field 'token_ids' is missing"):
        apply_processor("talker_to_code2wav", talker, {"primary": {"text": ""}}, to_code2wav)

    thinker = get_pipeline("qwen3-omni").stage("thinker")
    to_talker = ProcessorContext("r", target="talker")
    with pytest.raises(ProcessorError, match=r"edge thinker->talker: field 'media_hidden_states' has shape \(6,\); "
                       r"expected \(media positions, hidden\)"):  # fmt: skip
        apply_processor("thinker_to_talker", thinker,
                        {"primary": {"token_ids": [1], "media_hidden_states": torch.zeros(6)}}, to_talker)  # fmt: skip
    with pytest.raises(ProcessorError, match=r"edge thinker->talker: field 'media_hidden_states' has dtype "
                       r"torch.int64; expected floating point"):  # fmt: skip
        apply_processor("thinker_to_talker", thinker,
                        {"primary": {"token_ids": [1], "media_hidden_states": torch.zeros(2, 8, dtype=torch.long)}},
                        to_talker)  # fmt: skip
    rows = {"0": torch.zeros(3, 8, dtype=torch.long), "2": torch.zeros(3, 8, dtype=torch.long)}
    with pytest.raises(ProcessorError, match=r"edge thinker->talker: field 'hidden_states' .*expected floating"):
        apply_processor("thinker_to_talker", thinker, {"primary": {"token_ids": [1], "hidden_states": rows}},
                        to_talker)  # fmt: skip
    with pytest.raises(ProcessorError, match=r"edge thinker->talker: field 'token_ids' is missing"):
        apply_processor("thinker_to_talker", thinker, {"primary": {"text": "hi"}}, to_talker)

    dit = StageSpec(name="dit", kind="diffusion", output_modality="hidden")
    to_vae = ProcessorContext("r", target="vae")
    with pytest.raises(ProcessorError, match=r"edge dit->vae: field 'latents' has shape \(8, 8\); "
                       r"expected \(channels, height, width\) or \(batch, channels, height, width\)"):  # fmt: skip
        apply_processor("dit_to_vae", dit, {"primary": {"latents": torch.zeros(8, 8)}}, to_vae)
    with pytest.raises(ProcessorError, match=r"edge dit->vae: field 'latents' has dtype torch.int64"):
        apply_processor("dit_to_vae", dit, {"primary": {"latents": torch.zeros(1, 4, 8, 8, dtype=torch.long)}},
                        to_vae)  # fmt: skip
    enhancer = StageSpec(name="enhancer", kind="ar")
    with pytest.raises(ProcessorError, match=r"edge enhancer->dit: field 'text' is missing"):
        apply_processor("ar_text_to_prompt", enhancer, {"primary": {"token_ids": [1]}},
                        ProcessorContext("r", target="dit"))  # fmt: skip


def test_dit_to_vae_gives_batched_latents() -> None:
    dit = StageSpec(name="dit", kind="diffusion", output_modality="hidden")
    latents = torch.zeros(16, 8, 8)
    out = apply_processor("dit_to_vae", dit, {"primary": {"latents": latents}}, ProcessorContext("r"))
    assert out["input"].shape == (1, 16, 8, 8)
    with pytest.raises(ProcessorError, match="latents"):
        apply_processor("dit_to_vae", dit, {"primary": {"images": []}}, ProcessorContext("r"))


# --- engine args and factory (no model) ---------------------------------------------------------


def test_cpu_defaults_fill_only_what_is_unset() -> None:
    env: dict[str, str] = {}
    args = cpu_defaults({"max_model_len": 64}, env)
    assert args == {"max_model_len": 64, **CPU_ENGINE_DEFAULTS}
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    args = cpu_defaults({"enforce_eager": False}, env)
    assert args == {"enforce_eager": False}  # the env's KV cache size wins over our default
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


def test_cpu_threads_follow_the_cpus_the_process_is_pinned_to() -> None:
    """A pod pinned to one core (a Guaranteed pod under the static CPU manager, or the pod runner's
    stand-in for it) runs one OpenMP thread, not one per host core. The affinity is really set, on this
    thread (sched_setaffinity(0) is per thread on Linux), and restored."""
    host = os.sched_getaffinity(0)
    if len(host) < 2:
        pytest.skip("one CPU: pinning to it changes nothing")
    os.sched_setaffinity(0, {min(host)})
    try:
        env: dict[str, str] = {}
        cpu_defaults({}, env)
        assert env["OMP_NUM_THREADS"] == "1"
        env = {"OMP_NUM_THREADS": "4"}
        cpu_defaults({}, env)
        assert env["OMP_NUM_THREADS"] == "4"  # the user's setting wins
    finally:
        os.sched_setaffinity(0, host)


def test_registry_only_engine_args_never_reach_vllm() -> None:
    omni = resolve_pipeline(get_pipeline("qwen3-omni"), name="o", model="/models/none")
    engine = AREngine(omni, omni.topology.stage("thinker"))
    args = engine.engine_args()
    assert not set(args) & set(RegistryOnlyKeys.model_fields)
    assert args["gpu_memory_utilization"] == 0.6 and args["trust_remote_code"] is True
    bad = _prompt_enhanced(enhancer={"engine_args": {"max_model_length": 10}})
    with pytest.raises(EngineError, match="'max_model_length' \\(did you mean 'max_model_len'\\?\\)"):
        AREngine(bad, bad.topology.stage("enhancer")).engine_args()


def test_companion_requests_use_the_negative_prompt() -> None:
    stage = get_pipeline("prompt-enhanced-t2i").stage("enhancer")
    primary = EngineInput("r1", {"prompt": "a fox"}, {"max_tokens": 8})
    (companion,) = companion_requests(stage, primary)
    assert companion.request_id == "r1#cfg_text" and companion.role == "cfg_text"
    assert companion.data == {"prompt": stage.companions[0].negative_prompt}
    assert companion.params == {"max_tokens": 8}
    chat = EngineInput(
        "r2",
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a fox"}]},
        {"negative_prompt": "dark"},
    )
    (companion,) = companion_requests(stage, chat)
    assert companion.data["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "dark"},
    ]
    assert companion.params == {}


class _SteppingLLM:
    """Stands in for vLLM's AsyncLLM where only request ids matter: each request yields one token per step
    until its `max_tokens`, or ends `abort` once aborted, as vLLM's DELTA outputs do."""

    def __init__(self) -> None:
        self.aborted: set[str] = set()
        self.renderer = self

    async def render_cmpl_async(self, prompts: list[dict], _tok: object) -> list[dict]:
        return [{"prompt_token_ids": [1, 2, 3]} for _ in prompts]

    async def abort(self, ids: str | list[str]) -> None:
        self.aborted.update([ids] if isinstance(ids, str) else ids)

    async def generate(self, _prompt: dict, sampling, rid: str):
        from types import SimpleNamespace as NS

        for step in range(sampling.max_tokens):
            await asyncio.sleep(0.002)
            aborted = rid in self.aborted
            reason = "abort" if aborted else "length" if step == sampling.max_tokens - 1 else None
            done = NS(index=0, text="a", token_ids=[] if aborted else [5], finish_reason=reason, logprobs=None)
            yield NS(prompt_token_ids=None, outputs=[done], finished=reason is not None)
            if reason is not None:
                return


async def test_ar_abort_stops_a_request_and_its_companions_and_no_request_whose_id_only_looks_related() -> None:
    """Ids are matched whole: aborting work `w` aborts `w` and the CFG companion that names it as its
    primary (`companion_of`), never another work whose id merely starts with `w#` (here a chunk run's)."""
    from omni_runtime.engines.base import chunk_request_id

    pipeline = _prompt_enhanced()
    engine = AREngine(pipeline, pipeline.topology.stage("enhancer"))
    engine.llm, engine.max_model_len = _SteppingLLM(), 64
    engine._sampling_fields = frozenset({"max_tokens", *engine.stage.sampling_params})
    primary = EngineInput("w", {"prompt": "a fox"}, {"max_tokens": 40})
    (companion,) = companion_requests(engine.stage, primary)
    other = EngineInput(chunk_request_id("w", 2), {"prompt": "a hen"}, {"max_tokens": 40})
    assert companion.companion_of == "w" and other.request_id.startswith("w#") and other.companion_of is None
    runs = [asyncio.create_task(_collect(engine, r)) for r in (primary, companion, other)]
    while len(engine._active) < 3 and not any(r.done() for r in runs):  # all three in "vLLM" (after its import)
        await asyncio.sleep(0.002)
    await engine.abort("w")
    async with asyncio.timeout(10):
        outs = await asyncio.gather(*runs)
    assert [o[-1].finish_reason for o in outs] == ["abort", "abort", "length"]
    assert sum(len(o.data["token_ids"]) for o in outs[2]) == 40  # the other work ran to its end
    assert engine.llm.aborted == {"w", companion.request_id}


def test_make_engine_picks_the_engine_by_stage_kind() -> None:
    pipeline = _prompt_enhanced()
    assert type(make_engine(pipeline, "enhancer")) is AREngine
    assert type(make_engine(pipeline, "dit")) is DiffusionEngine
    with pytest.raises(SpecError, match="no stage 'vae'"):
        make_engine(pipeline, "vae")
    vae = _vae_pipeline("/models/none")
    assert type(make_engine(vae, "vae")) is VAEDecodeEngine
    # Qwen3-Omni's talker and code2wav run on the speech engines (named by engine_args.runner).
    omni = resolve_pipeline(get_pipeline("qwen3-omni"), name="o", model="/models/none")
    assert type(make_engine(omni, "talker")).__name__ == "Qwen3TalkerEngine"
    assert type(make_engine(omni, "code2wav")).__name__ == "Code2WavEngine"
    # A generation stage without a known runner: the error says what to set (tests/test_engine_factory.py).
    with pytest.raises(EngineError, match="has no engine_args.runner; set engine_args.runner to one of .*'vae_decode'"):
        make_engine(_vae_pipeline("/models/none", runner=None), "vae")


def _vae_pipeline(model: str, runner: str | None = "vae_decode") -> ResolvedPipeline:
    """dit (diffusion, latent output) -> vae (generation, vae_decode), both from the tiny SD3 folder."""
    registry_dit = get_pipeline("prompt-enhanced-t2i").stage("dit")
    spec = PipelineSpec(
        name="latent-t2i",
        stages=[
            _stage(
                "dit",
                kind="diffusion",
                model_subfolder="dit",
                engine_args=DIT_ARGS,
                # the registry's DiT defaults (guidance 4.0), so images match the `dit` fixture's
                sampling_params={**registry_dit.sampling_params, **DIT_PARAMS},
                output_modality="hidden",
            ),
            _stage(
                "vae",
                kind="generation",
                model_subfolder="dit",
                engine_args={"runner": runner, "chunk_size": 1} if runner else {"chunk_size": 1},
                input_modalities=["hidden"],
                output_modality="image",
                final_output=True,
            ),
        ],
        edges=[{"from": "dit", "to": "vae", "input_processor": "dit_to_vae"}],
    )
    return resolve_pipeline(spec, name="latent", model=model)


# --- models: the tiny prompt-enhanced folder ----------------------------------------------------


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from omni_runtime.tiny_models import ensure

    return ensure("tiny-prompt-enhanced-t2i")


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir / "enhancer")


# --- models: ar ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def children_before_vllm() -> set[int]:
    return _our_children()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ar(model_dir: Path, children_before_vllm: set[int]):
    pipeline = _prompt_enhanced(str(model_dir), enhancer={"engine_args": AR_ARGS})
    engine = AREngine(pipeline, pipeline.topology.stage("enhancer"))
    await engine.start()
    yield engine
    await engine.stop()


def _greedy(max_tokens: int, **more) -> dict:
    return {"temperature": 0.0, "seed": 7, "max_tokens": max_tokens, "ignore_eos": True, **more}


@models
@in_module_loop
async def test_ar_stream_deltas_join_to_the_whole_text(ar: AREngine, hf_tokenizer) -> None:
    request = EngineInput("s1", {"prompt": "A photograph of a lighthouse"}, _greedy(24))
    outs = await _collect(ar, request)
    assert len(outs) > 1 and all(not o.finished for o in outs[:-1]) and outs[-1].finished
    text = "".join(o.data["text"] for o in outs)
    ids = [t for o in outs for t in o.data["token_ids"]]
    assert len(ids) == 24
    assert text == hf_tokenizer.decode(ids, skip_special_tokens=True)
    again = await _collect(ar, EngineInput("s2", request.data, request.params))
    assert "".join(o.data["text"] for o in again) == text  # temperature 0, same seed: same text


@models
@in_module_loop
async def test_ar_respects_max_tokens_and_reports_usage(ar: AREngine, hf_tokenizer) -> None:
    prompt = "Two children fly a kite"
    outs = await _collect(ar, EngineInput("m1", {"prompt": prompt}, _greedy(5)))
    last = outs[-1]
    assert sum(len(o.data["token_ids"]) for o in outs) == 5
    assert last.finish_reason == "length"
    assert last.usage == {"prompt_tokens": len(hf_tokenizer.encode(prompt)), "completion_tokens": 5}
    assert all(o.usage is None for o in outs[:-1])


@models
@in_module_loop
async def test_ar_runs_two_requests_concurrently(ar: AREngine) -> None:
    a = EngineInput("c1", {"prompt": "A bowl of hot soup"}, _greedy(12))
    b = EngineInput("c2", {"prompt": "The city wakes up slowly"}, _greedy(8))
    both = await asyncio.gather(_collect(ar, a), _collect(ar, b))
    assert {o.request_id for o in both[0]} == {"c1"} and {o.request_id for o in both[1]} == {"c2"}
    assert both[0][-1].usage["completion_tokens"] == 12 and both[1][-1].usage["completion_tokens"] == 8
    assert sum(len(o.data["token_ids"]) for o in both[1]) == 8


@models
@in_module_loop
async def test_ar_runs_the_cfg_companion_beside_the_primary(ar: AREngine) -> None:
    primary = EngineInput("p1", {"prompt": "a fox in snow"}, _greedy(40))
    (companion,) = companion_requests(ar.stage, primary)
    running: list[float] = []

    async def watch() -> None:
        while True:
            running.append(ar.stats()["running_requests"])
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    try:
        outs = await asyncio.gather(_collect(ar, primary), _collect(ar, companion))
    finally:
        watcher.cancel()
    assert max(running) == 2  # both were in vLLM at once: one continuous batch
    assert outs[1][-1].request_id == "p1#cfg_text" and outs[1][-1].usage["completion_tokens"] == 40
    assert outs[0][-1].usage["completion_tokens"] == 40


@models
@in_module_loop
async def test_ar_abort_stops_a_running_request(ar: AREngine) -> None:
    request = EngineInput("a1", {"prompt": "Write a short story"}, _greedy(200))
    outs = []
    async for out in ar.generate(request):
        outs.append(out)
        if len(outs) == 3:
            await ar.abort("a1")
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert sum(len(o.data["token_ids"]) for o in outs) < 200
    assert ar.llm.get_num_unfinished_requests() == 0
    # A consumer that goes away aborts too.
    gen = ar.generate(EngineInput("a2", request.data, request.params))
    await gen.__anext__()
    await gen.aclose()
    # The close starts vLLM's abort; its output processor forgets the request once the abort is handled.
    deadline = time.monotonic() + 30
    while ar.llm.get_num_unfinished_requests():
        assert time.monotonic() < deadline, "closing the stream left the request running in vLLM"
        await asyncio.sleep(0.02)


@models
@in_module_loop
async def test_ar_rejects_unknown_sampling_params(ar: AREngine) -> None:
    with pytest.raises(InvalidRequest, match="'temprature'.*did you mean 'temperature'"):
        await _collect(ar, EngineInput("u1", {"prompt": "hi"}, {"temprature": 0.0}))
    with pytest.raises(InvalidRequest, match="temperature"):
        await _collect(ar, EngineInput("u2", {"prompt": "hi"}, {"temperature": -1.0}))
    with pytest.raises(InvalidRequest, match="needs 'prompt', 'messages' or 'prompt_token_ids'"):
        await _collect(ar, EngineInput("u3", {"text": "hi"}))


@models
@in_module_loop
async def test_ar_rejects_a_prompt_longer_than_max_model_len(ar: AREngine, hf_tokenizer) -> None:
    prompt = "word " * 400
    with pytest.raises(InvalidRequest) as info:
        await _collect(ar, EngineInput("l1", {"prompt": prompt}, _greedy(4)))
    n = len(hf_tokenizer.encode(prompt))
    assert f"is {n} tokens" in str(info.value) and f"max_model_len {MAX_MODEL_LEN}" in str(info.value)
    with pytest.raises(InvalidRequest, match=f"is {MAX_MODEL_LEN} tokens"):
        await _collect(ar, EngineInput("l2", {"prompt_token_ids": [5] * MAX_MODEL_LEN}, _greedy(4)))
    assert ar.llm.get_num_unfinished_requests() == 0


@models
@in_module_loop
async def test_ar_chat_messages_use_the_chat_template(ar: AREngine, hf_tokenizer) -> None:
    messages = [{"role": "user", "content": "Describe the picture"}]
    expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected_ids = hf_tokenizer.encode(expected, add_special_tokens=False)
    assert expected.startswith("<|im_start|>system\n") and expected.endswith("<|im_start|>assistant\n")
    rendered = await ar.render_prompt({"messages": messages})
    assert rendered["prompt_token_ids"] == expected_ids
    outs = await _collect(ar, EngineInput("t1", {"messages": messages}, _greedy(3)))
    assert outs[-1].usage == {"prompt_tokens": len(expected_ids), "completion_tokens": 3}


@models
@in_module_loop
async def test_ar_streams_prompt_ids_then_one_token_per_step(ar: AREngine, hf_tokenizer) -> None:
    """What a thinker streamed per step to a talker relies on (vLLM 0.32 DELTA outputs): the first piece
    carries the rendered prompt ids, then each engine step gives its new token id (vLLM merges the
    steps of a reader that fell behind into one piece, so pieces hold one id or, under load, a few)."""
    messages = [{"role": "user", "content": "Say something"}]
    expected = hf_tokenizer.encode(
        hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    outs = await _collect(ar, EngineInput("p1", {"messages": messages}, _greedy(6)))
    assert outs[0].data["prompt_token_ids"] == expected
    assert all("prompt_token_ids" not in o.data for o in outs[1:])
    assert sum(len(o.data["token_ids"]) for o in outs) == 6 and len(outs) > 1


@models
@in_module_loop
async def test_ar_stop_leaves_no_process_behind(ar: AREngine, children_before_vllm: set[int]) -> None:
    assert _our_children() - children_before_vllm  # vLLM's engine core is running
    await ar.stop()
    assert ar.llm is None
    assert _our_children() == children_before_vllm
    await ar.stop()  # idempotent


@models
def test_an_ar_stage_that_would_fail_every_request_never_becomes_ready(model_dir: Path, tmp_path: Path) -> None:
    """`max_model_len: 1` is a real engine arg with which vLLM loads but no request can run (a prompt and
    its first token need 2 positions): the stage's self-check (one greedy token before it reports ready)
    fails, and the `omnikube stage` process exits with an EngineFailed termination message saying what to
    change, which the operator reports as the pipeline's Degraded reason. vLLM's processes go with it (a
    child left behind would hold the captured output open, and the run would time out)."""
    import subprocess
    import sys

    from omni_operator.status.reasons import Reason
    from omni_operator.status.stage_status import pod_problem
    from omni_runtime.connectors.mooncake_master import free_port
    from omni_runtime.stage.settings import StageSettings
    from omni_runtime.stage.termination import Termination
    from omni_runtime.wire.auth import PipelineKey

    pipeline = _prompt_enhanced(str(model_dir), enhancer={"engine_args": {**AR_ARGS, "max_model_len": 1}})
    config = tmp_path / "resolved.json"
    config.write_text(pipeline.model_dump_json(by_alias=True))
    termination = tmp_path / "termination-log"
    termination.write_text("")  # the kubelet creates the file; the stage only writes into it
    key = tmp_path / "pipeline-key"
    PipelineKey.write_new(key)
    settings = StageSettings(
        config=str(config), pipeline_key_file=str(key), stage="enhancer", host="127.0.0.1", port=free_port(),
        http_port=free_port(), termination_log=str(termination),
    )  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "omni_runtime.cli", settings.command, *settings.to_argv()],
        capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    told = Termination.parse(termination.read_text())
    assert told is not None and told.reason is Reason.ENGINE_FAILED, termination.read_text()
    assert "self-check" in told.message and "every request would fail" in told.message
    assert "max_model_len 1" in told.message and "raise max_model_len" in told.message
    status = {
        "name": "enhancer", "ready": False, "restartCount": 1,
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": termination.read_text()}},
    }  # fmt: skip
    pod = {"metadata": {"name": "t-enhancer-0"}, "status": {"phase": "Running", "containerStatuses": [status]}}
    cond = pod_problem([pod], "enhancer")
    assert cond is not None and cond.reason is Reason.ENGINE_FAILED and "raise max_model_len" in cond.message


# --- models: diffusion --------------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def dit(model_dir: Path):
    pipeline = _prompt_enhanced(str(model_dir), dit={"engine_args": DIT_ARGS, "sampling_params": DIT_PARAMS})
    engine = DiffusionEngine(pipeline, pipeline.topology.stage("dit"))
    await engine.start()
    yield engine
    await engine.stop()


@models
@in_module_loop
async def test_diffusion_gives_a_png_of_the_requested_size(dit: DiffusionEngine) -> None:
    from PIL import Image

    png = await diffusion_image(dit, "d1", "a red apple on a table", seed=1)
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG" and image.size == (64, 64)
    wide = Image.open(io.BytesIO(await diffusion_image(dit, "d2", "a red apple", seed=1, width=96, height=32)))
    assert wide.size == (96, 32)
    outs = await _collect(dit, EngineInput("d3", {"prompt": "an apple"}, {"seed": 1, "n": 2}))
    assert len(outs[0].data["images"]) == 2


@models
@in_module_loop
async def test_diffusion_seed_decides_the_image(dit: DiffusionEngine) -> None:
    first = await diffusion_image(dit, "e1", "a forest path", seed=11)
    assert await diffusion_image(dit, "e2", "a forest path", seed=11) == first
    assert await diffusion_image(dit, "e3", "a forest path", seed=12) != first


@models
@in_module_loop
async def test_diffusion_batches_compatible_requests_without_changing_them(dit: DiffusionEngine) -> None:
    prompts = ["a lighthouse", "a white horse", "a bowl of soup", "a sailing ship"]
    alone = [await diffusion_image(dit, f"alone{i}", p, seed=100 + i) for i, p in enumerate(prompts)]
    batched = await asyncio.gather(*(diffusion_image(dit, f"b{i}", p, seed=100 + i) for i, p in enumerate(prompts)))
    assert sorted(dit.batch_log[-1]) == ["b0", "b1", "b2", "b3"]
    assert dit.stats()["last_batch_size"] == 4 and dit.stats()["queue_depth"] == 0
    for a, b in zip(alone, batched, strict=True):
        assert np.abs(_pixels(a) - _pixels(b)).max() <= 2  # float rounding only
    assert np.abs(_pixels(batched[0]) - _pixels(batched[1])).mean() > 5  # and they are different images


@models
@in_module_loop
async def test_diffusion_keeps_incompatible_requests_apart(dit: DiffusionEngine) -> None:
    calls = len(dit.batch_log)
    await asyncio.gather(
        diffusion_image(dit, "s64a", "a cat", seed=1),
        diffusion_image(dit, "s32a", "a cat", seed=1, width=32, height=32),
        diffusion_image(dit, "s64b", "a dog", seed=2),
        diffusion_image(dit, "s32b", "a dog", seed=2, width=32, height=32),
        diffusion_image(dit, "neg", "a dog", seed=2, negative_prompt="blurry"),
    )
    batches = sorted(sorted(b) for b in list(dit.batch_log)[calls:])
    assert batches == [["neg"], ["s32a", "s32b"], ["s64a", "s64b"]]


@models
@in_module_loop
async def test_diffusion_rejects_bad_sizes_and_steps(dit: DiffusionEngine) -> None:
    with pytest.raises(InvalidRequest, match="height 60 is not allowed.*multiple of 16.*use 48 or 64"):
        await diffusion_image(dit, "v1", "a cat", height=60)
    with pytest.raises(InvalidRequest, match="at most 4194304"):
        await diffusion_image(dit, "v2", "a cat", height=4096, width=4096)
    with pytest.raises(InvalidRequest, match="num_inference_steps 0 is out of range"):
        await diffusion_image(dit, "v3", "a cat", num_inference_steps=0)
    with pytest.raises(InvalidRequest, match="'num_steps'"):
        await diffusion_image(dit, "v4", "a cat", num_steps=3)
    with pytest.raises(InvalidRequest, match="non-empty 'prompt'"):
        await _collect(dit, EngineInput("v5", {"text": "a cat"}))


@models
@in_module_loop
async def test_diffusion_bounds_the_steps_a_sigmas_schedule_asks_for(dit: DiffusionEngine) -> None:
    """A custom schedule runs one step per entry, so it obeys max_inference_steps like num_inference_steps."""
    long = [1.0 - i / 10_000 for i in range(10_000)]
    with pytest.raises(InvalidRequest, match="sigmas has 10000 entries.*1 to 200 steps.*max_inference_steps"):
        await diffusion_image(dit, "g1", "a cat", sigmas=long)
    with pytest.raises(InvalidRequest, match="sigmas must be a list of numbers"):
        await diffusion_image(dit, "g2", "a cat", sigmas="1.0,0.5")
    with pytest.raises(InvalidRequest, match="sigmas has 0 entries"):
        await diffusion_image(dit, "g3", "a cat", sigmas=[])
    with pytest.raises(InvalidRequest, match="finite numbers"):
        await diffusion_image(dit, "g4", "a cat", sigmas=[1.0, float("nan")])
    png = await diffusion_image(dit, "g5", "a cat", seed=1, sigmas=[1.0, 0.5])
    assert png.startswith(b"\x89PNG")


@models
@in_module_loop
async def test_diffusion_abort_drops_a_queued_request(dit: DiffusionEngine) -> None:
    calls = len(dit.batch_log)
    running = asyncio.ensure_future(_collect(dit, EngineInput("q1", {"prompt": "a cat"}, {"seed": 1})))
    queued = asyncio.ensure_future(
        _collect(
            dit,
            EngineInput("q2", {"prompt": "a cat"}, {"seed": 1, "width": 32, "height": 32, "num_inference_steps": 3}),
        )
    )
    while dit.stats()["running_batch"] == 0:
        await asyncio.sleep(0.002)
    assert dit.stats()["queue_depth"] == 1
    # The backlog an autoscaler reads: q2's 3 steps waiting, plus what is left of q1's 2 (the stage
    # default; its steps may be running already).
    assert 3 <= dit.stats()["denoising_steps_queued"] <= 3 + 2
    await dit.abort("q2")
    assert dit.stats()["queue_depth"] == 0
    assert dit.stats()["denoising_steps_queued"] <= 2
    (aborted,) = await queued
    assert aborted.finished and aborted.finish_reason == "abort" and "images" not in aborted.data
    assert (await running)[0].data["images"]
    # A running request's call stops between two steps (all of its batch is aborted); no result.
    running = asyncio.ensure_future(_collect(dit, EngineInput("q3", {"prompt": "a cat"}, {"seed": 1})))
    while dit.stats()["running_batch"] == 0:
        await asyncio.sleep(0.002)
    await dit.abort("q3")
    assert (await running)[0].finish_reason == "abort"
    assert [b for b in list(dit.batch_log)[calls:]] == [["q1"], ["q3"]]
    assert dit.stats()["denoising_steps_queued"] == 0


@models
@in_module_loop
async def test_diffusion_takes_prompt_embeddings(dit: DiffusionEngine) -> None:
    prompt, negative = "a red apple", "blurry"
    with torch.inference_mode():
        embeds, neg_embeds, pooled, neg_pooled = dit.pipe.encode_prompt(
            prompt=prompt, prompt_2=None, prompt_3=None, negative_prompt=negative, device="cpu"
        )
    data = {
        "prompt_embeds": embeds,
        "negative_prompt_embeds": neg_embeds,
        "pooled_prompt_embeds": pooled,
        "negative_pooled_prompt_embeds": neg_pooled,
    }
    from_text = await diffusion_image(dit, "x1", prompt, seed=5, negative_prompt=negative)
    outs = await _collect(dit, EngineInput("x2", data, {"seed": 5}))
    assert np.abs(_pixels(outs[0].data["images"][0]) - _pixels(from_text)).max() <= 2
    with pytest.raises(InvalidRequest, match="leading"):
        await _collect(dit, EngineInput("x3", {**data, "prompt_embeds": embeds[0]}, {"seed": 5}))


# --- models: generation -------------------------------------------------------------------------


@models
@in_module_loop
async def test_generation_decodes_latents_chunk_by_chunk_in_order(model_dir: Path, dit: DiffusionEngine) -> None:
    pipeline = _vae_pipeline(str(model_dir))
    latent_dit = make_engine(pipeline, "dit")
    vae = make_engine(pipeline, "vae")
    await latent_dit.start()
    await vae.start()
    try:
        request = EngineInput("g1", {"prompt": "a lighthouse"}, {"seed": 3, "n": 3})
        (out,) = await _collect(latent_dit, request)
        assert tuple(out.data["latents"].shape) == (3, 16, 8, 8)
        data = apply_processor("dit_to_vae", latent_dit.stage, {"primary": out.data}, ProcessorContext("g1"))
        chunks = await _collect(vae, EngineInput("g1", data))
        assert [c.data["chunk_index"] for c in chunks] == [0, 1, 2]
        assert [c.finished for c in chunks] == [False, False, True]
        assert all(c.data["num_chunks"] == 3 and len(c.data["images"]) == 1 for c in chunks)
        # Each chunk is the image the one-stage pipeline makes for that position and seed.
        (direct,) = await _collect(dit, EngineInput("g2", {"prompt": "a lighthouse"}, {"seed": 3, "n": 3}))
        for chunk, png in zip(chunks, direct.data["images"], strict=True):
            assert np.abs(_pixels(chunk.data["images"][0]) - _pixels(png)).max() <= 2

        # Abort between chunks; bad input is the caller's fault.
        outs = []
        async for chunk in vae.generate(EngineInput("g3", data)):
            outs.append(chunk)
            await vae.abort("g3")
        assert [o.finish_reason for o in outs] == [None, "abort"]
        with pytest.raises(InvalidRequest, match="needs latents"):
            await _collect(vae, EngineInput("g4", {"input": torch.zeros(2, 4, 8, 8)}))
        with pytest.raises(InvalidRequest, match="'input'"):
            await _collect(vae, EngineInput("g5", {"latents": torch.zeros(1)}))
    finally:
        await latent_dit.stop()
        await vae.stop()


# --- models: image to image -----------------------------------------------------------------------


def _png_bytes(color: str, size: tuple[int, int]) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def img2img():
    from omni_runtime.registry import resolve_model_pipeline
    from omni_runtime.spec import ResolvedPipeline
    from omni_runtime.tiny_models import ensure

    folder = ensure("tiny-sd3-img2img")
    topology = resolve_model_pipeline(folder)
    stage = topology.stages[0].model_copy(
        update={
            "engine_args": {"max_pixels": 64 * 64, "batch_window_ms": 200},
            "sampling_params": {"num_inference_steps": 3, "strength": 0.6},  # with 2, sigma is 1: pure noise
        }
    )
    topology = topology.model_copy(update={"stages": [stage]})
    engine = DiffusionEngine(
        ResolvedPipeline(name="edit", model=str(folder), served_model_name="edit", topology=topology), stage
    )
    await engine.start()
    yield engine
    await engine.stop()


@models
@in_module_loop
async def test_image_edits_of_one_size_share_a_call_and_bad_images_are_refused(img2img: DiffusionEngine) -> None:
    red, blue = _png_bytes("red", (64, 48)), _png_bytes("blue", (64, 48))
    outs = await asyncio.gather(
        _collect(img2img, EngineInput("i1", {"prompt": "a boat", "image": red}, {"seed": 1})),
        _collect(img2img, EngineInput("i2", {"prompt": "a boat", "image": blue}, {"seed": 1})),
    )
    assert ["i1", "i2"] in [sorted(b) for b in img2img.batch_log]  # one pipeline call for both
    assert outs[0][0].data["images"][0] != outs[1][0].data["images"][0]  # each got its own picture
    with pytest.raises(InvalidRequest, match="129x129; stage 'dit' reads at most 16384 pixels"):
        await _collect(img2img, EngineInput("i3", {"prompt": "x", "image": _png_bytes("red", (129, 129))}, {}))
    with pytest.raises(InvalidRequest, match="bytes of a PNG, JPEG or WebP file, not str"):
        await _collect(img2img, EngineInput("i4", {"prompt": "x", "image": "red.png"}, {}))
    embeds = {"prompt_embeds": torch.zeros(1, 4, 32), "image": red}
    with pytest.raises(InvalidRequest, match="takes an image with a text prompt, not with embeddings"):
        await _collect(img2img, EngineInput("i5", embeds, {}))


@models
@in_module_loop
async def test_text_to_image_stage_refuses_an_image(dit: DiffusionEngine) -> None:
    request = EngineInput("t1", {"prompt": "x", "image": _png_bytes("red", (64, 64))}, {})
    with pytest.raises(InvalidRequest, match="takes no image input; send only a prompt"):
        await _collect(dit, request)


def test_a_stage_runs_in_a_dtype_its_device_has() -> None:
    """The rule a diffusion stage applies to its torch_dtype. A CPU without fast bfloat16/float16 kernels
    cannot be had on this machine, so the detection is overridden here (the real detection runs in every
    served test, where the topology's bfloat16 reaches it)."""
    import torch

    from omni_runtime.engines.diffusion.engine import device_dtype

    assert device_dtype("cpu", torch.bfloat16, cpu_bf16=True) == (torch.bfloat16, "")
    dtype, why = device_dtype("cpu", torch.bfloat16, cpu_bf16=False)
    assert dtype == torch.float32 and "no fast bfloat16" in why
    dtype, why = device_dtype("cpu", torch.float16, cpu_fp16=False)
    assert dtype == torch.float32 and "no fast float16" in why
    assert device_dtype("cpu", torch.float32) == (torch.float32, "")
