"""The context a context-only request prefills (`EngineInput.context_only`: an AR -> DiT edge reads its KV cache).

A DiT that attends to an AR stage's KV was trained on contexts of one exact shape, and the checkpoint's chat
template may not make it: BAGEL frames every text segment as `<|im_start|>` + its tokens + `<|im_end|>`, with no
role word and nothing after (upstream `prepare_prompts`), while its tokenizer's template is Qwen's ChatML. The
engine arg `context_format` says which: `chat_template` (the model's template, as every chat) or `bagel`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omni_runtime.engines.base import InvalidRequest

__all__ = ["BAGEL_BOS", "BAGEL_EOS", "BAGEL_THINK_INSTRUCTION", "bagel_context_ids"]

BAGEL_BOS = "<|im_start|>"
BAGEL_EOS = "<|im_end|>"
"""The tokens BAGEL frames each text segment of a context with (upstream's `new_token_ids` bos / eos)."""

BAGEL_THINK_INSTRUCTION = (
    "You should first think about the planning process in the mind and then generate the image. \n"
    "The planning process is enclosed within <think> </think> tags, i.e. <think> planning process here </think> "
    "image here"
)
"""The first segment of every context in think mode, the primary's and its companions' (upstream inferencer.py's
GEN_THINK_SYSTEM_PROMPT, verbatim: the model was trained on it)."""


def _text(message: dict[str, Any], stage: str) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        if any(isinstance(p, dict) and p.get("type") != "text" for p in content):
            raise InvalidRequest(
                f"stage {stage!r}: a chat that draws takes text only; to edit an image send it to /v1/images/edits "
                "(the dit builds an edit's context from the image itself), or ask about it with modalities ['text']"
            )
        return "\n".join(str(p.get("text", "")) for p in content)
    raise InvalidRequest(f"stage {stage!r}: message content must be text, not {type(content).__name__}")


def bagel_context_ids(
    tokenizer: Any, messages: Sequence[dict[str, Any]], stage: str, *, think: bool = False, thinking: str | None = None
) -> list[int]:
    """BAGEL's context of a chat: every message's text, in order, as `<|im_start|>` + tokens + `<|im_end|>`
    (an empty text is the bare pair: the reference system's empty companion turn). With `think` the segments
    follow `BAGEL_THINK_INSTRUCTION`'s, and `thinking` (the reasoning the model wrote) closes them, as upstream's
    `interleave_inference(think=True)` updates its context. InvalidRequest for content that is not text."""
    bos, eos = (tokenizer.convert_tokens_to_ids(t) for t in (BAGEL_BOS, BAGEL_EOS))
    unk = getattr(tokenizer, "unk_token_id", None)
    if not isinstance(bos, int) or not isinstance(eos, int) or unk is not None and unk in (bos, eos):
        raise InvalidRequest(f"stage {stage!r}: its tokenizer lacks {BAGEL_BOS} / {BAGEL_EOS}; it is not BAGEL's")
    if not messages:
        raise InvalidRequest("messages must be a non-empty list of {role, content} objects")
    texts = [_text(dict(message), stage) for message in messages]
    if think:
        texts = [BAGEL_THINK_INSTRUCTION, *texts]
    if thinking is not None:
        texts.append(thinking)
    ids: list[int] = []
    for text in texts:
        ids += [bos, *tokenizer.encode(text, add_special_tokens=False), eos]
    return ids
