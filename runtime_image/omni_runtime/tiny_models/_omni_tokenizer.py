"""A Qwen-Omni-shaped tokenizer: the real vocabulary size and the real ids of every id the models read.

The omni configs and the code around them name token ids directly (`im_start_token_id` 151644,
`tts_pad_token_id` 151671, `user_token_id` 872, `assistant_token_id` 77091...), so a tiny checkpoint
keeps them: a byte-level BPE trained on the embedded corpus fills the low ids, the role words
`system` / `user` / `assistant` are moved to their real ids, the special tokens sit at their real
ids, and every other id up to the vocabulary size holds a filler piece (" t1a", " t1b", ...). With
fillers, any id a random-weight model samples decodes to visible text instead of nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["QWEN_VOCAB_SIZE", "ROLE_IDS", "build_omni_tokenizer"]

QWEN_VOCAB_SIZE = 152064
"""Embedding rows of every Qwen2.5 / Qwen3 omni thinker (the tokenizer itself stops near 151676)."""

ROLE_IDS = {"system": 8948, "user": 872, "assistant": 77091}
"""Qwen's ids of the chat role words, which the omni configs name (`system_token_id`...)."""

_BPE_PIECES = 1536
_FILLER_PREFIX = "Ġt"  # byte-level for " t": fillers decode to " t<base36>"
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def _base36(n: int) -> str:
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = _DIGITS[r] + out
        if n == 0:
            return out


def _vocab(bpe: dict[str, int], specials: dict[int, str], size: int) -> dict[str, int]:
    """{piece: id} over all `size` ids: BPE pieces, role words at their real ids, specials, fillers."""
    by_id: list[str | None] = [None] * size
    for piece, i in bpe.items():
        by_id[i] = piece
    for word, real_id in ROLE_IDS.items():
        if word not in bpe:
            raise AssertionError(f"the trained BPE has no single piece {word!r}; add it to the training lines")
        old = bpe[word]
        by_id[old], by_id[real_id] = by_id[real_id], word
    for i, token in specials.items():
        if by_id[i] is not None:
            raise AssertionError(f"special token {token!r} would overwrite piece {by_id[i]!r} at id {i}")
        by_id[i] = token
    taken = {p for p in by_id if p is not None}
    counter = 0
    for i in range(size):
        if by_id[i] is None:
            while (piece := _FILLER_PREFIX + _base36(counter)) in taken:
                counter += 1
            counter += 1
            by_id[i] = piece
    return {piece: i for i, piece in enumerate(by_id) if piece is not None}


def build_omni_tokenizer(
    out: Path,
    *,
    specials: dict[int, str],
    named_specials: dict[str, str],
    eos_token: str,
    pad_token: str,
    chat_template: str,
    model_max_length: int,
):
    """Save the tokenizer into `out` and return it.

    `specials`: {real id: token}; `named_specials`: attribute name -> token (e.g. `image_token`),
    which processors read from the tokenizer.
    """
    from transformers import Qwen2Tokenizer

    from omni_runtime.tiny_models._tokenizers import train_byte_bpe, write_vocab_and_merges

    role_lines = tuple(f"<|im_start|>{w}\n" * 8 for w in ROLE_IDS) * 4
    bpe, merges = train_byte_bpe(_BPE_PIECES, extra_lines=role_lines)
    vocab = _vocab(bpe, specials, QWEN_VOCAB_SIZE)
    ordered = [specials[i] for i in sorted(specials)]
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token=eos_token,
        pad_token=pad_token,
        extra_special_tokens=[t for t in ordered if t not in (eos_token, pad_token)],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        errors="replace",
        split_special_tokens=False,
        model_specific_special_tokens=named_specials,
    )
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = chat_template
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_vocab_and_merges(out)
    return tokenizer
