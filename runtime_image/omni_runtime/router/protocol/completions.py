"""`POST /v1/completions` (prompt in, text out) and vLLM's `/tokenize` and `/detokenize`.

Served for pipelines whose text comes from one AR stage that also takes the prompt (a text chat
model, Qwen-Omni's thinker asked for text); other pipelines answer 400 naming why. The same field
policy as chat applies: `FORWARDED` fields go where the chat's do, `REFUSED` ones get a 400 naming
them, and any other is a 400 unless the pipeline sets `router.unknownFields: ignore`.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from omni_runtime.router.protocol.chat import (
    FORWARDED as CHAT_FORWARDED,
)
from omni_runtime.router.protocol.chat import (
    REFUSED as CHAT_REFUSED,
)
from omni_runtime.router.protocol.chat import ChatMessage, Usage
from omni_runtime.router.protocol.sampling import SamplingFields, TokenId

__all__ = [
    "COMPLETION_FORWARDED",
    "COMPLETION_REFUSED",
    "CompletionChoice",
    "CompletionRequest",
    "CompletionResponse",
    "DetokenizeRequest",
    "TokenizeRequest",
]


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="allow")

    model: str
    prompt: str | list[TokenId] | list[str] = Field(
        description="One prompt: text, or token ids (a list of one text is accepted as OpenAI's SDK sends it)."
    )
    max_tokens: int | None = Field(16, ge=1, description="At most the pipeline's router.limits.maxTokens.")
    logprobs: int | None = Field(None, ge=0, le=20, description="Also return this many most likely tokens each.")
    echo: bool = Field(False, description="Each choice's text starts with the prompt.")
    add_special_tokens: bool = True


_TEXT = "the AR stage that produces the text"
COMPLETION_FORWARDED: dict[str, str] = {
    **{k: v for k, v in CHAT_FORWARDED.items() if k in CompletionRequest.model_fields},
    "prompt": "the AR stage, rendered without a chat template",
    "logprobs": _TEXT + " (the number of alternatives, OpenAI's legacy shape)",
    "echo": "the router: each choice's text starts with the prompt (a text prompt only)",
    "add_special_tokens": "the prompt's tokenization in the AR stage",
    "max_tokens": CHAT_FORWARDED["max_tokens"] + "; OpenAI's default 16",
}
"""Every `/v1/completions` field the router accepts, and where it goes."""

_FROM_CHAT = (
    "use_beam_search", "length_penalty", "prompt_logprobs", "logprob_token_ids", "return_tokens_as_token_ids",
    "return_token_ids", "truncate_prompt_tokens", "priority", "request_id", "cache_salt", "kv_transfer_params",
    "vllm_xargs",
)  # fmt: skip
COMPLETION_REFUSED: dict[str, tuple[str, object]] = {
    **{k: CHAT_REFUSED[k] for k in _FROM_CHAT},
    "suffix": ("fill-in-the-middle suffixes are not served by this router", None),
    "best_of": ("best_of is not served by this router; ask for n choices", None),
    "prompt_embeds": ("prompt embeddings are not served by this router; send text or token ids", None),
}
"""`/v1/completions` fields refused with a 400 naming them (the default value is accepted)."""


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TokenizeRequest(BaseModel):
    """vLLM's `/tokenize`: a `prompt`, or chat `messages` rendered with the model's template."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(None, description="Default: true for a prompt, false for messages.")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """vLLM's `/detokenize`: token ids back to text."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)
