"""Tiny random-weight models: built locally, loaded by the real engines (transformers, vLLM, diffusers).

The models live in the session cache (`$OMNIKUBE_CACHE/models`, else `~/.cache/omnikube/models`) and
are built on first use; the build-mechanics tests at the top use a temporary folder and no model.
vLLM runs in a subprocess (it spawns processes and rebinds the threads of the process it runs in).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from servelib import run_vllm_script

from omni_runtime.tiny_models import MODELS, build_all, default_cache_dir, ensure, read_stamp
from omni_runtime.tiny_models._build import STAMP_FILE, build_atomically
from omni_runtime.tiny_models.prompt_enhanced_t2i import MARKER_FILE

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# --- build mechanics (no model) -----------------------------------------------------------------


def _write(text: str):
    def builder(out: Path) -> None:
        (out / "weights.txt").write_text(text)

    return builder


def test_build_is_reused_until_the_version_changes(tmp_path: Path) -> None:
    first = build_atomically("m", "1", tmp_path, _write("one"))
    again = build_atomically("m", "1", tmp_path, _write("changed but same version"))
    assert again == first == tmp_path / "m"
    assert (first / "weights.txt").read_text() == "one"

    rebuilt = build_atomically("m", "2", tmp_path, _write("two"))
    assert (rebuilt / "weights.txt").read_text() == "two"
    assert read_stamp(rebuilt)["version"] == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock", "m"]  # no temp or old folder left


def test_a_failed_build_leaves_the_previous_one(tmp_path: Path) -> None:
    build_atomically("m", "1", tmp_path, _write("one"))

    def broken(out: Path) -> None:
        (out / "half.bin").write_text("...")
        raise RuntimeError("builder broke")

    with pytest.raises(RuntimeError, match="builder broke"):
        build_atomically("m", "2", tmp_path, broken)
    assert (tmp_path / "m" / "weights.txt").read_text() == "one"
    assert read_stamp(tmp_path / "m")["version"] == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock", "m"]


def test_unknown_name_lists_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tiny-qwen2-chat"):
        ensure("tiny-gpt5", tmp_path)


def test_importing_the_package_imports_no_torch() -> None:
    code = "import sys, omni_runtime.tiny_models; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- fixtures: the session cache -----------------------------------------------------------------


@pytest.fixture(scope="session")
def model_cache() -> Path:
    return default_cache_dir()


@pytest.fixture(scope="session")
def built(model_cache: Path) -> dict[str, Path]:
    started = time.monotonic()
    paths = build_all(model_cache)
    print(f"\n[tiny models] ensured {list(paths)} in {time.monotonic() - started:.1f}s")
    for path in paths.values():
        print(f"[tiny models] {path.name}: built in {read_stamp(path)['build_seconds']}s")
    return paths


@pytest.fixture(scope="session")
def chat_model(built: dict[str, Path]) -> Path:
    return built["tiny-qwen2-chat"]


@pytest.fixture(scope="session")
def sd3_model(built: dict[str, Path]) -> Path:
    return built["tiny-sd3"]


@pytest.fixture(scope="session")
def sd3_pipe(sd3_model: Path):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(sd3_model)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _tree_digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != STAMP_FILE
    }


# --- the cache and the CLI -------------------------------------------------------------------------


@pytest.mark.models
def test_ensure_reuses_the_finished_build(built: dict[str, Path], model_cache: Path) -> None:
    for name, path in built.items():
        stamp = read_stamp(path)
        assert stamp["name"] == name and stamp["version"] == MODELS[name].version
        before = (path / STAMP_FILE).stat().st_mtime_ns
        assert ensure(name, model_cache) == path
        assert (path / STAMP_FILE).stat().st_mtime_ns == before


@pytest.mark.models
def test_builds_are_deterministic(built: dict[str, Path], tmp_path: Path) -> None:
    fresh = build_all(tmp_path)
    for name, path in built.items():
        assert _tree_digest(fresh[name]) == _tree_digest(path), (
            f"a fresh build of {name} differs from the cached one at {path}: the builder changed "
            f"without a VERSION bump, or it is not deterministic"
        )


@pytest.mark.models
def test_cli_prints_the_paths(built: dict[str, Path], model_cache: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "omni_runtime.tiny_models", "--out", str(model_cache), "tiny-sd3"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.splitlines() == [f"tiny-sd3\t{built['tiny-sd3']}"]


# --- the chat model: transformers ----------------------------------------------------------------


@pytest.mark.models
def test_chat_tokenizer_round_trips_and_templates(chat_model: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    for text in ["Hello, world!", "A photo of a café at 9:30 — ünïcode 漢字 🙂", "  two  spaces\nnew line"]:
        ids = tokenizer(text).input_ids
        assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.convert_ids_to_tokens(tokenizer("<|im_start|>user<|im_end|>").input_ids)[0] == "<|im_start|>"

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Draw a cat"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nDraw a cat<|im_end|>\n<|im_start|>assistant\n"
    )
    config = AutoConfig.from_pretrained(chat_model)
    assert config.architectures == ["Qwen2ForCausalLM"]
    assert config.vocab_size >= len(tokenizer)
    assert config.head_dim >= 32  # vLLM's CPU attention needs head_dim >= 32


@pytest.mark.models
def test_chat_model_generates_with_transformers(chat_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    model = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32)
    inputs = tokenizer("Hello, my name is", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert out.shape[1] == inputs.input_ids.shape[1] + 6


# --- the chat model: vLLM (subprocess) ------------------------------------------------------------

_VLLM_LLM_SCRIPT = """
import json, sys, time

def main():
    started = time.monotonic()
    from vllm import LLM, SamplingParams
    imported = time.monotonic()
    llm = LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=512,
              kv_cache_memory_bytes=64 * 1024**2, enforce_eager=True, seed=0)
    loaded = time.monotonic()
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = llm.generate(["Hello, my name is", "A photo of a cat"], greedy, use_tqdm=False)
    second = llm.generate(["Hello, my name is"], greedy, use_tqdm=False)
    chat = llm.chat([{"role": "user", "content": "Draw a cat"}], greedy, use_tqdm=False)
    long = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    t = time.monotonic()
    batch = llm.generate([f"prompt {i}" for i in range(8)], long, use_tqdm=False)
    batch_s = time.monotonic() - t
    print("RESULT " + json.dumps({
        "import_s": imported - started,
        "load_s": loaded - imported,
        "tokens": [list(o.outputs[0].token_ids) for o in first],
        "texts": [o.outputs[0].text for o in first],
        "repeat": list(second[0].outputs[0].token_ids),
        "chat_prompt_ids": list(chat[0].prompt_token_ids),
        "chat_tokens": len(chat[0].outputs[0].token_ids),
        "batch_tokens_per_s": sum(len(o.outputs[0].token_ids) for o in batch) / batch_s,
    }))

if __name__ == "__main__":
    main()
"""

_VLLM_ASYNC_SCRIPT = """
import asyncio, json, sys, time

async def run(path):
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    started = time.monotonic()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=path, dtype="bfloat16", max_model_len=512,
        kv_cache_memory_bytes=64 * 1024**2, enforce_eager=True, seed=0))
    loaded = time.monotonic()

    async def one(i):
        chunks = 0
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        async for out in engine.generate({"prompt": f"request {i}"}, params, request_id=f"r{i}"):
            chunks += 1
            final = out
        return chunks, len(final.outputs[0].token_ids), final.finished

    t = time.monotonic()
    results = await asyncio.gather(*(one(i) for i in range(4)))
    elapsed = time.monotonic() - t
    engine.shutdown()
    print("RESULT " + json.dumps({"load_s": loaded - started, "results": results,
                                  "tokens_per_s": sum(r[1] for r in results) / elapsed}))

if __name__ == "__main__":
    asyncio.run(run(sys.argv[1]))
"""


@pytest.mark.models
def test_vllm_offline_llm_generates(chat_model: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    result = run_vllm_script(_VLLM_LLM_SCRIPT, chat_model, tmp_path, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    print(
        f"\n[vllm LLM, in-process] import {result['import_s']:.1f}s, load {result['load_s']:.1f}s, "
        f"batch of 8 x 64 tokens: {result['batch_tokens_per_s']:.0f} tokens/s"
    )
    assert [len(t) for t in result["tokens"]] == [8, 8]
    assert result["repeat"] == result["tokens"][0]  # greedy decoding is deterministic
    assert all(isinstance(text, str) for text in result["texts"])
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    assert result["chat_prompt_ids"][0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert result["chat_tokens"] == 8


@pytest.mark.models
def test_vllm_async_llm_streams_with_a_separate_engine_process(chat_model: Path, tmp_path: Path) -> None:
    result = run_vllm_script(_VLLM_ASYNC_SCRIPT, chat_model, tmp_path, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    print(
        f"\n[vllm AsyncLLM, engine core + worker processes] load {result['load_s']:.1f}s, "
        f"4 concurrent x 16 tokens: {result['tokens_per_s']:.0f} tokens/s"
    )
    for chunks, tokens, finished in result["results"]:
        assert tokens == 16 and finished and chunks >= 2  # streamed, not one final chunk


# --- the diffusion pipeline -------------------------------------------------------------------------


def _draw(pipe, prompt="a red apple on a table", seed=0, **kwargs):
    import torch

    kwargs = {"height": 64, "width": 64, "num_inference_steps": 2, "output_type": "np", **kwargs}
    return pipe(prompt, generator=torch.Generator().manual_seed(seed), **kwargs).images


@pytest.mark.models
def test_sd3_loads_from_the_folder(sd3_model: Path, sd3_pipe) -> None:
    index = json.loads((sd3_model / "model_index.json").read_text())
    assert index["_class_name"] == type(sd3_pipe).__name__ == "StableDiffusion3Pipeline"
    assert (sd3_model / "tokenizer" / "vocab.json").is_file()
    assert (sd3_model / "tokenizer" / "merges.txt").is_file()


@pytest.mark.models
def test_sd3_same_seed_same_image_other_seed_other_image(sd3_pipe) -> None:
    import numpy as np

    started = time.monotonic()
    first = _draw(sd3_pipe, seed=0)
    elapsed = time.monotonic() - started
    print(f"\n[diffusers] 64x64, 2 steps, CFG: {elapsed:.2f}s per image")
    assert first.shape == (1, 64, 64, 3)
    assert first.std() > 0.01  # not a blank image
    assert np.array_equal(first, _draw(sd3_pipe, seed=0))
    assert not np.allclose(first, _draw(sd3_pipe, seed=1))


@pytest.mark.models
def test_sd3_batches_prompts_and_images_per_prompt(sd3_pipe) -> None:
    import numpy as np

    two_prompts = _draw(sd3_pipe, prompt=["a red apple", "a blue sea"])
    assert two_prompts.shape == (2, 64, 64, 3)
    assert not np.allclose(two_prompts[0], two_prompts[1])
    per_prompt = _draw(sd3_pipe, prompt="a red apple", num_images_per_prompt=2)
    assert per_prompt.shape == (2, 64, 64, 3)


@pytest.mark.models
def test_sd3_accepts_prompt_embeds(sd3_pipe) -> None:
    import numpy as np

    prompt = "a lighthouse at sunset"
    embeds, negative, pooled, negative_pooled = sd3_pipe.encode_prompt(
        prompt, prompt, prompt, negative_prompt="", do_classifier_free_guidance=True
    )
    assert embeds.shape[0] == pooled.shape[0] == 1 and embeds.shape[-1] == pooled.shape[-1] == 64
    from_embeds = _draw(
        sd3_pipe,
        prompt=None,
        prompt_embeds=embeds,
        negative_prompt_embeds=negative,
        pooled_prompt_embeds=pooled,
        negative_pooled_prompt_embeds=negative_pooled,
    )
    assert np.allclose(from_embeds, _draw(sd3_pipe, prompt=prompt), atol=1e-4)


# --- the prompt-enhanced pair -----------------------------------------------------------------------


@pytest.mark.models
def test_prompt_enhanced_folder_holds_both_stages(built: dict[str, Path]) -> None:
    from diffusers import DiffusionPipeline
    from transformers import AutoTokenizer

    root = built["tiny-prompt-enhanced-t2i"]
    marker = json.loads((root / MARKER_FILE).read_text())
    assert marker["pipeline"] == "prompt-enhanced-t2i"
    assert {name: s["model_subfolder"] for name, s in marker["stages"].items()} == {
        "enhancer": "enhancer",
        "dit": "dit",
    }
    assert not (root / "config.json").exists() and not (root / "model_index.json").exists()
    assert json.loads((root / "enhancer" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert json.loads((root / "dit" / "model_index.json").read_text())["_class_name"] == "StableDiffusion3Pipeline"
    assert _tree_digest(root / "enhancer") == _tree_digest(built["tiny-qwen2-chat"])
    assert _tree_digest(root / "dit") == _tree_digest(built["tiny-sd3"])
    assert AutoTokenizer.from_pretrained(root / "enhancer").eos_token == "<|im_end|>"
    assert type(DiffusionPipeline.from_pretrained(root / "dit")).__name__ == "StableDiffusion3Pipeline"


def test_sd3_img2img_is_the_sd3_build_as_image_to_image(built: dict[str, Path]) -> None:
    from diffusers import DiffusionPipeline

    from omni_runtime.registry import resolve_model_pipeline

    root = built["tiny-sd3-img2img"]
    assert json.loads((root / "model_index.json").read_text())["_class_name"] == "StableDiffusion3Img2ImgPipeline"
    assert _tree_digest(root / "transformer") == _tree_digest(built["tiny-sd3"] / "transformer")
    assert type(DiffusionPipeline.from_pretrained(root)).__name__ == "StableDiffusion3Img2ImgPipeline"
    topology = resolve_model_pipeline(root)
    assert topology.name == "stable-diffusion-3-img2img"
    assert "image" in [m.value for m in topology.stages[0].input_modalities]
