"""Tiny omni checkpoints: the real folder layout, loadable by transformers (whole model, speaking) and vLLM.

Built in the session cache like the other tiny models (tests/test_tiny_models.py); vLLM runs in a
subprocess (it spawns processes and rebinds the threads of the process it runs in).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from servelib import run_vllm_script, tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = pytest.mark.models

SAMPLES_PER_FRAME = 1920
"""Qwen3-Omni code2wav: 12.5 frames per second at 24 kHz."""


@pytest.fixture(scope="module")
def qwen3_omni() -> Path:
    return tiny_model("tiny-qwen3-omni")


@pytest.fixture(scope="module")
def qwen3_omni_model(qwen3_omni: Path):
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(qwen3_omni, dtype=torch.float32).eval()


def _chat_ids(folder: Path, text: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]


def test_qwen3_omni_config_keeps_what_the_loaders_read(qwen3_omni: Path) -> None:
    config = json.loads((qwen3_omni / "config.json").read_text())
    assert config["architectures"] == ["Qwen3OmniMoeForConditionalGeneration"]
    thinker, talker, code2wav = config["thinker_config"], config["talker_config"], config["code2wav_config"]
    text = thinker["text_config"]
    assert text["vocab_size"] == 152064 and text["num_experts"] > 1
    head_dim = text["head_dim"]
    assert head_dim >= 32  # vLLM's CPU attention
    assert sum(text["rope_parameters"]["mrope_section"]) == head_dim // 2
    assert text["num_hidden_layers"] > talker["accept_hidden_layer"]
    vision = thinker["vision_config"]
    assert (vision["image_size"] // vision["patch_size"]) ** 2 == vision["num_position_embeddings"]
    assert vision["apply_vit_abs_pos_embed"] is True and vision["out_hidden_size"] == text["hidden_size"]
    assert thinker["audio_config"]["output_dim"] == talker["thinker_hidden_size"] == text["hidden_size"]
    assert talker["num_code_groups"] == talker["code_predictor_config"]["num_code_groups"] == 16
    assert code2wav["num_quantizers"] == 16
    talker_vocab = talker["text_config"]["vocab_size"]
    codec_ids = [talker[k] for k in ("codec_pad_id", "codec_bos_id", "codec_eos_token_id", "codec_nothink_id")]
    assert max(codec_ids + list(talker["speaker_id"].values())) < talker_vocab
    assert talker["speaker_id"] == {"chelsie": 2301, "ethan": 2302, "aiden": 2303}


def test_qwen3_omni_tokenizer_has_the_real_ids(qwen3_omni: Path) -> None:
    from transformers import AutoProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen3_omni)
    config = json.loads((qwen3_omni / "config.json").read_text())
    named = {
        "im_start_token_id": "<|im_start|>",
        "im_end_token_id": "<|im_end|>",
        "tts_pad_token_id": "<tts_pad>",
        "tts_bos_token_id": "<tts_text_bos>",
        "tts_eos_token_id": "<tts_text_eod>",
        "user_token_id": "user",
        "assistant_token_id": "assistant",
        "system_token_id": "system",
    }
    assert {key: tokenizer.convert_tokens_to_ids(tok) for key, tok in named.items()} == {
        key: config[key] for key in named
    }
    thinker = config["thinker_config"]
    assert tokenizer.convert_tokens_to_ids("<|audio_pad|>") == thinker["audio_token_id"] == 151675
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == thinker["image_token_id"]
    assert len(tokenizer) == 152064  # every id decodes (random models sample any of them)
    assert tokenizer.decode([100000, 150000]).strip()

    ids = _chat_ids(qwen3_omni, "Hello, who are you?")[0].tolist()
    assert ids[:2] == [151644, 872] and ids[-3:] == [151644, 77091, 198]
    text = "A photo of a café at 9:30 — ünïcode 漢字 🙂"
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    parts = [{"type": "text", "text": "Describe"}, {"type": "image"}, {"type": "audio"}]
    templated = tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)
    assert "<|vision_start|><|image_pad|><|vision_end|>" in templated and "<|audio_pad|>" in templated
    assert type(AutoProcessor.from_pretrained(qwen3_omni)).__name__ == "Qwen3OmniMoeProcessor"


def test_qwen3_omni_speaks_with_transformers(qwen3_omni: Path, qwen3_omni_model) -> None:
    import torch

    ids = _chat_ids(qwen3_omni, "Hello, who are you?")
    kwargs = dict(thinker_max_new_tokens=6, talker_max_new_tokens=9, talker_do_sample=False, return_audio=True)
    sequences, wav = qwen3_omni_model.generate(ids, speaker="Ethan", **kwargs)
    assert sequences.shape[1] <= ids.shape[1] + 6
    frames = (wav.shape[-1] + 555) / SAMPLES_PER_FRAME  # a whole-output decode is 555 samples short
    assert frames == int(frames) and 1 <= frames <= 8  # the last sampled codec token gets no frame
    assert 0.01 < wav.std().item() < 1  # audible, not silence
    again = qwen3_omni_model.generate(ids, speaker="Ethan", **kwargs)[1]
    assert torch.equal(wav, again)  # greedy is deterministic


_VLLM_THINKER_SCRIPT = """
import json, sys

def main():
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=512, kv_cache_memory_bytes=64 * 1024**2,
              enforce_eager=True, seed=0, limit_mm_per_prompt={"image": 0, "video": 0, "audio": 0})
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    chat = llm.chat([{"role": "user", "content": "Hello, who are you?"}], greedy, use_tqdm=False)[0]
    print("RESULT " + json.dumps({"prompt": list(chat.prompt_token_ids), "tokens": list(chat.outputs[0].token_ids),
                                  "text": chat.outputs[0].text}))

if __name__ == "__main__":
    main()
"""


def test_qwen3_omni_thinker_runs_in_vllm_like_transformers(qwen3_omni: Path, qwen3_omni_model, tmp_path) -> None:
    ids = _chat_ids(qwen3_omni, "Hello, who are you?")
    result = run_vllm_script(_VLLM_THINKER_SCRIPT, qwen3_omni, tmp_path, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    assert result["prompt"] == ids[0].tolist()
    hf = qwen3_omni_model.thinker.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert result["tokens"] == hf[0, ids.shape[1] :].tolist()
    assert result["text"].strip()


# --- Qwen2.5-Omni ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen2_5_omni() -> Path:
    return tiny_model("tiny-qwen2-5-omni")


@pytest.fixture(scope="module")
def qwen2_5_omni_model(qwen2_5_omni: Path):
    import torch
    from transformers import Qwen2_5OmniForConditionalGeneration

    return Qwen2_5OmniForConditionalGeneration.from_pretrained(qwen2_5_omni, dtype=torch.float32).eval()


def test_qwen2_5_omni_folder_has_speakers_and_real_ids(qwen2_5_omni: Path) -> None:
    import torch
    from transformers import AutoProcessor, AutoTokenizer

    config = json.loads((qwen2_5_omni / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5OmniForConditionalGeneration"]
    thinker, talker = config["thinker_config"], config["talker_config"]
    text = thinker["text_config"]
    assert text["vocab_size"] == 152064 and text["hidden_size"] // text["num_attention_heads"] >= 32
    assert sum(text["rope_parameters"]["mrope_section"]) == text["hidden_size"] // text["num_attention_heads"] // 2
    assert talker["embedding_size"] == text["hidden_size"]
    codec = [talker[f"tts_codec_{k}_token_id"] for k in ("start", "end", "pad", "mask")]
    assert max(codec) < talker["vocab_size"]
    speakers = torch.load(qwen2_5_omni / "spk_dict.pt", weights_only=True)
    assert sorted(speakers) == ["Chelsie", "Ethan"]
    dit = config["token2wav_config"]["dit_config"]
    for speaker in speakers.values():
        assert speaker["cond"].shape == (1, dit["enc_emb_dim"]) and speaker["ref_mel"].shape[-1] == dit["mel_dim"]
    tokenizer = AutoTokenizer.from_pretrained(qwen2_5_omni)
    assert tokenizer.convert_tokens_to_ids("<|AUDIO|>") == thinker["audio_token_index"] == 151646
    assert tokenizer.convert_tokens_to_ids("<|IMAGE|>") == thinker["image_token_index"]
    assert _chat_ids(qwen2_5_omni, "Hi")[0].tolist()[:2] == [151644, 872]
    assert type(AutoProcessor.from_pretrained(qwen2_5_omni)).__name__ == "Qwen2_5OmniProcessor"


def test_qwen2_5_omni_speaks_with_transformers(qwen2_5_omni: Path, qwen2_5_omni_model) -> None:
    ids = _chat_ids(qwen2_5_omni, "Hello, who are you?")
    kwargs = dict(thinker_max_new_tokens=5, talker_max_new_tokens=12, talker_do_sample=False)
    sequences, wav = qwen2_5_omni_model.generate(ids, speaker="Ethan", **kwargs)
    assert sequences.shape[1] <= ids.shape[1] + 5
    assert wav.dim() == 1 and wav.shape[0] > 0
    assert 0.01 < wav.std().item() < 1  # audible, not silence


def test_qwen2_5_omni_thinker_runs_in_vllm_like_transformers(qwen2_5_omni: Path, qwen2_5_omni_model, tmp_path) -> None:
    ids = _chat_ids(qwen2_5_omni, "Hello, who are you?")
    result = run_vllm_script(_VLLM_THINKER_SCRIPT, qwen2_5_omni, tmp_path, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    assert result["prompt"] == ids[0].tolist()
    hf = qwen2_5_omni_model.thinker.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert result["tokens"] == hf[0, ids.shape[1] :].tolist()
