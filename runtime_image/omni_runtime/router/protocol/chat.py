"""`POST /v1/chat/completions`: request, response and stream chunk models, and the field lists.

Besides OpenAI's fields the request accepts vLLM's sampling and structured-output extras (`top_k`,
`min_p`, `ignore_eos`, `structured_outputs`, ...), vLLM-Omni's `sampling_params_list` (one dict per
stage, in the pipeline's topological order) and, for image-producing pipelines, `negative_prompt`,
`size`, `height`/`width`, `num_inference_steps` and `guidance_scale` (send them with the SDK's
`extra_body`). `FORWARDED` says where each accepted field goes, `REFUSED` which of vLLM's fields get a
400 and why; any other field is a 400 naming it, unless the pipeline sets `router.unknownFields:
ignore`.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from omni_runtime.router.protocol.sampling import SamplingFields

__all__ = [
    "AUDIO_FORMATS",
    "FORWARDED",
    "REFUSED",
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


_SAMPLING = "the sampling parameters of every AR stage the request runs"
_TEXT = "the AR stage that produces the reply's text (400 when the pipeline's text comes from no AR stage)"
_RENDER = "the prompt rendering of the entry AR stage (400 when the entry stage is not AR)"
_TOOL = (
    "the AR stage that renders the chat and produces the reply's text (400 when no stage is both): its chat "
    "template, vLLM's structured outputs for required/named, and its engine_args.tool_call_parser"
)

FORWARDED: dict[str, str] = {
    "model": "checked against the served model name",
    "messages": "the entry stage's input (a chat for an AR stage, the last user text for the others)",
    "modalities": "which final stages run",
    "audio": "the speech stages' voice and the reply's audio encoding",
    "n": "one pipeline run per choice (at most router.limits.maxN)",
    "stream": "server-sent events, one chunk per output piece",
    "stream_options": "include_usage: a usage chunk at the end; continuous_usage_stats: usage in every chunk",
    "max_tokens": _SAMPLING + " (at most router.limits.maxTokens)",
    "max_completion_tokens": _SAMPLING + " (as max_tokens)",
    "temperature": _SAMPLING,
    "top_p": _SAMPLING,
    "seed": _SAMPLING + ", and the diffusion stages (plus the choice index)",
    "stop": _SAMPLING,
    "presence_penalty": _SAMPLING,
    "frequency_penalty": _SAMPLING,
    "top_k": _SAMPLING,
    "min_p": _SAMPLING,
    "min_tokens": _SAMPLING,
    "ignore_eos": _SAMPLING,
    "repetition_penalty": _SAMPLING,
    "user": "accepted and recorded nowhere; it changes no reply (as in OpenAI's and vLLM's servers)",
    "logprobs": _TEXT,
    "top_logprobs": _TEXT,
    "logit_bias": _TEXT,
    "response_format": _TEXT + ", as vLLM's structured_outputs",
    "structured_outputs": _TEXT,
    "stop_token_ids": _TEXT,
    "include_stop_str_in_output": _TEXT,
    "skip_special_tokens": _TEXT,
    "spaces_between_special_tokens": _TEXT,
    "bad_words": _TEXT,
    "allowed_token_ids": _TEXT,
    "echo": "the router: the reply starts with the last message when that has the reply's role",
    "add_generation_prompt": _RENDER,
    "continue_final_message": _RENDER,
    "add_special_tokens": _RENDER,
    "chat_template_kwargs": _RENDER,
    "tools": _TOOL,
    "tool_choice": _TOOL,
    "parallel_tool_calls": _TOOL,
    "sampling_params_list": "per stage, in topological order, over the fields above",
    "negative_prompt": "the diffusion stages and CFG companions",
    "size": "the diffusion stages (height and width)",
    "height": "the diffusion stages",
    "width": "the diffusion stages",
    "num_inference_steps": "the diffusion stages",
    "guidance_scale": "the diffusion stages",
}
"""Every request field the router accepts, and where it goes."""

TEXT_ONLY = frozenset({"echo", *(k for k, v in FORWARDED.items() if v.startswith(_TEXT))})
"""Fields only the AR stage producing the reply's text can honour."""
RENDER_ONLY = frozenset(k for k, v in FORWARDED.items() if v == _RENDER)
"""Fields only an AR entry stage (one that renders the chat) can honour."""
TOOL_FIELDS = frozenset(k for k, v in FORWARDED.items() if v == _TOOL)
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
