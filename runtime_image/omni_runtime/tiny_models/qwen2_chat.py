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
VERSION = "2"
"""Bump whenever the output of `build` changes; cached builds of another version are rebuilt."""

SEED = 1234
BPE_VOCAB_SIZE = 1536
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen2.5-Instruct's template (its tool section: tools in the system turn, <tool_call> JSON in assistant
# turns, tool results as <tool_response> in a user turn), with Qwen2-Instruct's default system text.
_SYSTEM = "You are a helpful assistant."
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- '" + _SYSTEM + "' }}{%- endif %}"
    '{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
    '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}'
    "{%- else %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\n" + _SYSTEM + "<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    '{%- if (message.role == "user") or (message.role == "system" and not loop.first) '
    'or (message.role == "assistant" and not message.tool_calls) %}'
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    '{%- elif message.role == "assistant" %}'
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    '{%- elif message.role == "tool" %}'
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
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
