"""Train small tokenizers on the embedded corpus, in the exact shapes transformers' classes expect.

Each function returns the raw pieces (vocab, merges or scored pieces); the model modules hand them to
the transformers tokenizer class (Qwen2Tokenizer, CLIPTokenizer, T5Tokenizer), whose own normaliser
and pre-tokeniser match the ones used here, and save that. Training is deterministic: the same
corpus gives byte-identical tokenizer files in every process (tests/test_tiny_models.py checks it).
"""

from __future__ import annotations

import io
import json
import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

from omni_runtime.tiny_models.corpus import corpus_lines

__all__ = ["train_byte_bpe", "train_clip_bpe", "train_unigram", "write_vocab_and_merges"]

# Qwen2's pre-tokenisation regex (transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# CLIP's pre-tokenisation regex (transformers.models.clip.tokenization_clip).
CLIP_PRETOKENIZE_REGEX = (
    r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
)


def _model_json(tok: Tokenizer) -> dict:
    return json.loads(tok.to_str())["model"]


def train_byte_bpe(vocab_size: int, extra_lines: tuple[str, ...] = ()) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A Qwen2-style byte-level BPE: every byte is in the vocab, so any text encodes without <unk>.

    `extra_lines` join the corpus (a model that needs certain words as single pieces repeats them there).
    """
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([*corpus_lines(), *extra_lines], trainer)
    model = _model_json(tok)
    return dict(model["vocab"]), [tuple(m) for m in model["merges"]]


def train_clip_bpe(vocab_size: int, specials: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A CLIP-style BPE (lower-cased, byte-level, words end in `</w>`); `specials` come first.

    The tokenizers trainer is nondeterministic when given `end_of_word_suffix` (it numbers the
    suffixed symbols in hash-map order, which breaks ties between equally frequent pairs differently
    from run to run). So the words are pre-tokenised here and each word's last symbol is replaced
    by a private-use character standing for "that symbol + </w>"; a plain BPE (deterministic, as
    for Qwen2) learns on that, and the marks are turned back into `</w>` suffixes afterwards. The
    result is the same kind of model a suffix-BPE learns. Every byte symbol is in the vocab both
    bare and with `</w>`, as in CLIP's own vocab, so any text encodes without <unk>.
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    to_end = {c: chr(0xE000 + i) for i, c in enumerate(alphabet)}
    from_end = {v: k + "</w>" for k, v in to_end.items()}

    normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    splitter = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(CLIP_PRETOKENIZE_REGEX), behavior="removed", invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )

    def marked_words(line: str) -> str:
        words = [w for w, _ in splitter.pre_tokenize_str(normalizer.normalize_str(line))]
        return " ".join(w[:-1] + to_end[w[-1]] for w in words if w)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size + len(alphabet),  # the end-marked alphabet is counted too
        min_frequency=1,
        initial_alphabet=alphabet + list(to_end.values()),
        show_progress=False,
    )
    tok.train_from_iterator([marked_words(line) for line in corpus_lines()], trainer)
    model = _model_json(tok)

    def unmark(piece: str) -> str:
        return piece[:-1] + from_end[piece[-1]] if piece[-1] in from_end else piece

    vocab = {token: i for i, token in enumerate(specials)}
    for piece, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(unmark(piece), len(vocab))
    merges = [(unmark(a), unmark(b)) for a, b in model["merges"]]
    return vocab, merges


def train_unigram(vocab_size: int) -> list[tuple[str, float]]:
    """A T5-style sentencepiece Unigram: (piece, log-prob) with <pad>=0, </s>=1, <unk>=2 first.

    Trained with sentencepiece itself (deterministic, unlike the tokenizers Unigram trainer), with
    identity normalisation so transformers' T5Tokenizer (Metaspace, no normaliser) matches it. A
    line of printable ASCII joins the corpus so that every ASCII character has a piece.
    """
    import sentencepiece

    lines = [*corpus_lines(), " ".join(string.ascii_letters + string.digits + string.punctuation)]
    buffer = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=buffer,
        model_type="unigram",
        vocab_size=vocab_size,
        hard_vocab_limit=False,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        character_coverage=1.0,
        normalization_rule_name="identity",
        num_threads=1,
        minloglevel=2,
    )
    processor = sentencepiece.SentencePieceProcessor(model_proto=buffer.getvalue())
    return [(processor.id_to_piece(i), processor.get_score(i)) for i in range(processor.get_piece_size())]


def write_vocab_and_merges(folder: Path) -> None:
    """Write `vocab.json` + `merges.txt` beside a saved BPE `tokenizer.json`.

    transformers 5 reads tokenizer.json alone; the two classic files are for older readers
    (transformers 4 slow tokenizers, other runtimes) and hold exactly the BPE model's tables.
    """
    model = json.loads((folder / "tokenizer.json").read_text())["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"{folder}/tokenizer.json holds a {model.get('type')} model; only BPE has merges")
    (folder / "vocab.json").write_text(json.dumps(model["vocab"], ensure_ascii=False) + "\n")
    lines = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(line + "\n" for line in lines))
