"""`POST /v1/chat/completions`: request, response and stream chunk models, and the field lists.

Besides OpenAI's fields the request accepts vLLM's sampling and structured-output extras (`top_k`,
`min_p`, `ignore_eos`, `structured_outputs`, ...), vLLM-Omni's `sampling_params_list` (one dict per
stage, in the pipeline's topological order) and, for image-producing pipelines, `negative_prompt`,
`size`, `height`/`width`, `num_inference_steps` and `guidance_scale` (send them with the SDK's
`extra_body`). `CHAT_FIELDS` declares where each accepted field goes (`FORWARDED` says it in words),
`REFUSED` which of vLLM's fields get a 400 and why; any other field is a 400 naming it, unless the
pipeline sets `router.unknownFields: ignore`.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from omni_runtime.router.protocol.fields import FieldRoute, Forwarded, routed_to
from omni_runtime.router.protocol.sampling import SamplingFields

__all__ = [
    "AUDIO_FORMATS",
    "CHAT_FIELDS",
    "FORWARDED",
    "REFUSED",
    "RENDER_ONLY",
    "TEXT_ONLY",
    "TOOL_FIELDS",
    "ChatLogProbs",
    "AudioParam",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatCompletionStreamResponse",
    "ChatMessage",
    "Choice",
    "ChunkChoice",
    "Usage",
]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


AUDIO_FORMATS = ("wav", "pcm16")
"""`audio.format` values: a WAV file, or raw 16-bit little-endian mono PCM at the model's rate."""


class AudioParam(BaseModel):
    """OpenAI's `audio` request field: which speaker and which encoding `message.audio.data` uses."""

    model_config = ConfigDict(extra="forbid")

    voice: str | None = Field(None, description="A speaker of the model (GET /v1/audio/voices); unset: its default.")
    format: str = Field("wav", description=f"One of {AUDIO_FORMATS}.")


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    modalities: list[str] | None = Field(
        None,
        description="Output modalities wanted (text, image, audio, video); default: all the pipeline makes.",
    )
    audio: AudioParam | None = Field(None, description="Voice and format of the audio reply (with modality audio).")
    max_tokens: int | None = Field(None, ge=1, description="At most the pipeline's router.limits.maxTokens.")
    max_completion_tokens: int | None = Field(None, ge=1, description="As max_tokens (OpenAI's newer name).")
    logprobs: bool = Field(False, description="Return the log probability of each generated token.")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="With logprobs: this many most likely tokens.")
    # vLLM prompt rendering extras
    echo: bool = Field(False, description="Prefix the reply with the last message when it has the reply's role.")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # tool calling (checked by vLLM's own request model in the stage)
    tools: list[dict[str, Any]] | None = Field(
        None,
        min_length=1,
        description="Functions the model may call (OpenAI's shape); rendered with the model's chat template.",
    )
    tool_choice: str | dict[str, Any] | None = Field(
        None, description='"none", "auto" (the default with tools), "required" or {"type": "function", ...}.'
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one tool call per reply.")

    # vLLM-Omni extras
    sampling_params_list: list[dict[str, Any]] | None = None
    negative_prompt: str | None = None
    size: str | None = None
    height: int | None = Field(None, ge=1)
    width: int | None = Field(None, ge=1)
    num_inference_steps: int | None = Field(None, ge=1)
    guidance_scale: float | None = Field(None, ge=0.0)

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true; send both, or drop top_logprobs")
        return self


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    """OpenAI's `{id, type: function, function: {name, arguments}}`, as the stage's vLLM parser read them."""


class TopLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogProb(TopLogProb):
    top_logprobs: list[TopLogProb] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    """OpenAI's `choices[].logprobs` of a chat reply."""

    content: list[TokenLogProb] | None = None


class Choice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None = None
    logprobs: ChatLogProbs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Choice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    """OpenAI's streamed `{index, id?, type?, function: {name?, arguments}}` pieces."""


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChatLogProbs | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


_R, _S, _T, _D = FieldRoute.ROUTER, FieldRoute.SAMPLING, FieldRoute.TEXT, FieldRoute.DIFFUSION
_RENDER, _TOOL = FieldRoute.RENDER, FieldRoute.TOOL

CHAT_FIELDS: dict[str, Forwarded] = {
    "model": Forwarded(_R, "checked against the served model name"),
    "messages": Forwarded(_R, "the entry stage's input (a chat for an AR stage, the last user text for the others)"),
    "modalities": Forwarded(_R, "which final stages run"),
    "audio": Forwarded(_R, "the speech stages' voice and the reply's audio encoding"),
    "n": Forwarded(_R, "one pipeline run per choice (at most router.limits.maxN)"),
    "stream": Forwarded(_R, "server-sent events, one chunk per output piece"),
    "stream_options": Forwarded(
        _R, "include_usage: a usage chunk at the end; continuous_usage_stats: usage in every chunk"
    ),
    "max_tokens": Forwarded(_S, "at most router.limits.maxTokens", by_name=False),
    "max_completion_tokens": Forwarded(_S, "as max_tokens", by_name=False),
    "temperature": Forwarded(_S),
    "top_p": Forwarded(_S),
    "seed": Forwarded(_S, "and the diffusion stages (plus the choice index)"),
    "stop": Forwarded(_S),
    "presence_penalty": Forwarded(_S),
    "frequency_penalty": Forwarded(_S),
    "top_k": Forwarded(_S),
    "min_p": Forwarded(_S),
    "min_tokens": Forwarded(_S),
    "ignore_eos": Forwarded(_S),
    "repetition_penalty": Forwarded(_S),
    "user": Forwarded(_R, "accepted and recorded nowhere; it changes no reply (as in OpenAI's and vLLM's servers)"),
    "logprobs": Forwarded(_T, "as vLLM's logprobs, top_logprobs of them", by_name=False),
    "top_logprobs": Forwarded(_T, "with logprobs", by_name=False),
    "logit_bias": Forwarded(_T),
    "response_format": Forwarded(_T, "as vLLM's structured_outputs", by_name=False),
    "structured_outputs": Forwarded(_T, "overridden by response_format", by_name=False),
    "stop_token_ids": Forwarded(_T),
    "include_stop_str_in_output": Forwarded(_T),
    "skip_special_tokens": Forwarded(_T),
    "spaces_between_special_tokens": Forwarded(_T),
    "bad_words": Forwarded(_T),
    "allowed_token_ids": Forwarded(_T),
    "echo": Forwarded(_R, "the reply starts with the last message when that has the reply's role", needs_text=True),
    "add_generation_prompt": Forwarded(_RENDER, "in chat_template_kwargs", by_name=False),
    "continue_final_message": Forwarded(_RENDER, "in chat_template_kwargs", by_name=False),
    "add_special_tokens": Forwarded(_RENDER),
    "chat_template_kwargs": Forwarded(_RENDER),
    "tools": Forwarded(_TOOL),
    "tool_choice": Forwarded(_TOOL),
    "parallel_tool_calls": Forwarded(_TOOL),
    "sampling_params_list": Forwarded(_R, "per stage, in topological order, over the fields above"),
    "negative_prompt": Forwarded(_D, "and the CFG companions, in their input", by_name=False),
    "size": Forwarded(_D, "as height and width", by_name=False),
    "height": Forwarded(_D),
    "width": Forwarded(_D),
    "num_inference_steps": Forwarded(_D),
    "guidance_scale": Forwarded(_D),
}
"""Every request field the router accepts, and where it goes: the one declaration the field checks, the
routing (`router.serving.inputs`) and the field list's prose (`FORWARDED`) are read from."""

FORWARDED: dict[str, str] = {k: f.prose for k, f in CHAT_FIELDS.items()}
"""Every request field the router accepts, and where it goes, in words."""

TEXT_ONLY = frozenset(k for k, f in CHAT_FIELDS.items() if f.text_only)
"""Fields only the AR stage producing the reply's text can honour."""
RENDER_ONLY = routed_to(CHAT_FIELDS, FieldRoute.RENDER)
"""Fields only an AR entry stage (one that renders the chat) can honour."""
TOOL_FIELDS = routed_to(CHAT_FIELDS, FieldRoute.TOOL)
"""Fields only an AR stage that both renders the chat and produces the reply's text can honour."""

_NOT_SERVED = "not served by this router"

REFUSED: dict[str, tuple[str, object]] = {
    "functions": ("deprecated by OpenAI and not served; use tools", None),
    "function_call": ("deprecated by OpenAI and not served; use tool_choice", None),
    "chat_template": (
        "a request may not bring its own template (it runs in the stage); set the stage's "
        "chat template in its engine args",
        None,
    ),  # fmt: skip
    "use_beam_search": ("beam search is " + _NOT_SERVED + "; use n with sampling", False),
    "length_penalty": ("it only applies to beam search, which is " + _NOT_SERVED, 1.0),
    "prompt_logprobs": ("prompt logprobs are " + _NOT_SERVED + "; use /v1/completions with echo", None),
    "logprob_token_ids": ("logprobs of chosen token ids are " + _NOT_SERVED + "; use top_logprobs", None),
    "return_tokens_as_token_ids": (_NOT_SERVED, None),
    "return_token_ids": ("token ids in replies are " + _NOT_SERVED + "; use /tokenize", None),
    "truncate_prompt_tokens": ("prompt truncation is " + _NOT_SERVED + "; shorten the messages", None),
    "documents": ("retrieval documents are " + _NOT_SERVED + "; put them in the messages", None),
    "mm_processor_kwargs": ("per-request multimodal processor arguments are " + _NOT_SERVED, None),
    "media_io_kwargs": ("per-request media loading arguments are " + _NOT_SERVED, None),
    "reasoning_effort": ("reasoning controls are " + _NOT_SERVED + "; use chat_template_kwargs", None),
    "thinking_token_budget": ("reasoning budgets are " + _NOT_SERVED, None),
    "priority": ("request priorities are " + _NOT_SERVED + "; the router admits requests in order", 0),
    "request_id": ("the router assigns request ids", None),
    "cache_salt": ("prefix-cache salts are " + _NOT_SERVED, None),
    "kv_transfer_params": ("KV transfer between stages is the router's, not the client's", None),
    "vllm_xargs": ("vLLM's free-form extra arguments are " + _NOT_SERVED, None),
    "watermarking": ("watermarking is " + _NOT_SERVED, None),
    "service_tier": ("service tiers are " + _NOT_SERVED, None),
    "store": ("stored completions are " + _NOT_SERVED, None),
    "metadata": ("stored-completion metadata is " + _NOT_SERVED, None),
    "prediction": ("predicted outputs are " + _NOT_SERVED, None),
    "web_search_options": ("web search is " + _NOT_SERVED, None),
}
"""Fields of OpenAI's or vLLM's chat request the router refuses with a 400 naming them: the reason,
and the field's default value, which is accepted (clients send `parallel_tool_calls: true` unasked)."""


def refused_fields(body: BaseModel, refused: dict[str, tuple[str, object]] = REFUSED) -> list[tuple[str, str]]:
    """(field, reason) for each refused field the request sets to something other than its default."""
    extra = body.model_extra or {}
    return [(k, refused[k][0]) for k, v in extra.items() if k in refused and v != refused[k][1]]


def unknown_fields(body: BaseModel, refused: dict[str, tuple[str, object]] = REFUSED) -> list[str]:
    """Fields neither forwarded nor refused (the request model allows extras so these can be named)."""
    return sorted(k for k in (body.model_extra or {}) if k not in refused)
