"""`tiny-qwen2-chat`: a random-weight Qwen2ForCausalLM with a locally trained ChatML tokenizer.

Folder (what `save_pretrained` writes, plus a generation config):

    config.json               Qwen2ForCausalLM, hidden 128, 2 layers, 4 heads x head_dim 32, 2 KV heads
    model.safetensors         bfloat16 weights, tied embeddings (about 0.8 MB)
    generation_config.json    eos = [<|im_end|>, <|endoftext|>], pad = <|endoftext|>
    tokenizer.json            byte-level BPE trained on `corpus.CORPUS` (~1.5k pieces) + 3 specials
    vocab.json, merges.txt    the same BPE tables, for readers that want the classic files
    tokenizer_config.json     Qwen2Tokenizer, eos <|im_end|>, pad <|endoftext|>, ChatML chat_template
    chat_template.jinja       the same template (transformers 5 reads this file first)

head_dim is 32 because vLLM's CPU attention kernels support head sizes of 32 and up. The weights are
random (std 0.02), so generations are gibberish; greedy decoding is deterministic, and a random model
may emit an end-of-sequence token at any step, so tests that need N tokens pass `ignore_eos=True`.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "NAME", "SPECIAL_TOKENS", "VERSION", "build"]

NAME = "tiny-qwen2-chat"
VERSION = "1"
"""Bump whenever the output of `build` changes; cached builds of another version are rebuilt."""

SEED = 1234
BPE_VOCAB_SIZE = 1536
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen2-Instruct's template: a default system turn, then ChatML turns.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

MODEL_CONFIG = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=256,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    initializer_range=0.02,
    tie_word_embeddings=True,
    use_sliding_window=False,
)


def build_tokenizer(out: Path):
    """Train the BPE, wrap it in a Qwen2Tokenizer with the ChatML template, save it; return it."""
    from transformers import Qwen2Tokenizer

    from omni_runtime.tiny_models._tokenizers import train_byte_bpe, write_vocab_and_merges

    vocab, merges = train_byte_bpe(BPE_VOCAB_SIZE)
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=["<|im_start|>", "<|endoftext|>"],
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
        errors="replace",
        split_special_tokens=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    _write_template_into_config(out / "tokenizer_config.json")
    write_vocab_and_merges(out)
    return tokenizer


def _write_template_into_config(path: Path) -> None:
    """Also keep `chat_template` in tokenizer_config.json, where readers other than transformers 5 look."""
    config = json.loads(path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def build(out: Path) -> None:
    """Write the tiny chat model into the empty folder `out`."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(out)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab_size = _round_up(len(tokenizer), 64)
    config = Qwen2Config(
        vocab_size=vocab_size,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        **MODEL_CONFIG,
    )
    config.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(out)
    GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        do_sample=False,
    ).save_pretrained(out)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
