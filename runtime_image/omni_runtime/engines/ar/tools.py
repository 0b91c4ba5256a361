"""Tool calling in an `ar` stage, done with vLLM's own pieces so replies match `vllm serve`.

The stage's `engine_args.tool_call_parser` (omnikube's key, never passed to AsyncEngineArgs) names one
of vLLM's tool-call parsers, as `vllm serve --enable-auto-tool-choice --tool-call-parser NAME` does.
A chat input carrying `tools` / `tool_choice` / `parallel_tool_calls` is validated by vLLM's
`ChatCompletionRequest`; the tools reach the chat template (`tools` in its kwargs); the parser's
`adjust_request` sets the structured-output constraint that makes `required` and a named function
produce a valid call (vLLM's structural tags); the generated text is parsed with the same parser:
per piece (`parse_delta`, OpenAI's streamed `delta.tool_calls`) and, on the finished piece, over the
whole text (`parse`, what vLLM's non-streaming reply holds).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from omni_runtime.engines.base import EngineError, InvalidRequest

__all__ = [
    "TOOL_INPUT_KEYS",
    "ToolSession",
    "check_parser_name",
    "open_session",
    "parser_class",
    "template_tools",
]

log = logging.getLogger(__name__)

TOOL_INPUT_KEYS = ("tools", "tool_choice", "parallel_tool_calls")
"""Keys of a chat input that ask for tool calling."""


def check_parser_name(stage: str, name: str) -> str:
    """`name` when it is one of vLLM's registered tool-call parsers; EngineError otherwise."""
    from vllm.tool_parsers import ToolParserManager

    known = sorted(ToolParserManager.list_registered())
    if name not in known:
        raise EngineError(
            f"stage {stage!r}: engine_args.tool_call_parser is {name!r}, which is not a vLLM tool-call "
            f"parser; use one of {known} (Qwen2.5 and Qwen3 models: 'hermes')"
        )
    return name


@dataclass
class ToolSession:
    """One request's tool-calling state: vLLM's request model, its parser and what it decided."""

    request: Any
    """vllm's ChatCompletionRequest after the parser's adjust_request."""
    parser_cls: Any
    """vllm.parser Parser class of the stage's tool_call_parser."""
    tokenizer: Any
    model_config: Any
    chat_template_kwargs: dict[str, Any]
    prompt_token_ids: list[int] | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    streamed_calls: bool = False
    _stream: Any = None

    def new_parser(self) -> Any:
        """A parser of this request (parsers keep streaming state: one per use, as vLLM's server does)."""
        return self.parser_cls(
            self.tokenizer, self.request.tools, chat_template_kwargs=self.chat_template_kwargs,
            model_config=self.model_config,
        )  # fmt: skip

    @property
    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as the chat template sees them (vLLM's `tool_dicts`)."""
        return [t.model_dump() for t in self.request.tools]

    @property
    def named(self) -> bool:
        choice = self.request.tool_choice
        return choice is not None and not isinstance(choice, str)

    def sampling_overrides(self) -> dict[str, Any]:
        """What vLLM's server changes in the sampling parameters for this request."""
        out: dict[str, Any] = {}
        if self.request.structured_outputs is not None:
            out["structured_outputs"] = self.request.structured_outputs
        if self.request.skip_special_tokens is False:
            out["skip_special_tokens"] = False
        return out

    def delta(self, text: str, token_ids: list[int], finished: bool) -> dict[str, Any]:
        """One streamed piece as OpenAI's delta: `text` (content) and `tool_calls` (delta dicts)."""
        self.text += text
        self.token_ids.extend(token_ids)
        if self._stream is None:
            self._stream = self.new_parser()
        message = self._stream.parse_delta(text, list(token_ids), self.request, self.prompt_token_ids,
                                           finished=finished)  # fmt: skip
        if message is None:
            return {"text": ""}
        out: dict[str, Any] = {"text": message.content or ""}
        if message.tool_calls:
            self.streamed_calls = True
            out["tool_calls"] = [c.model_dump(exclude_none=True) for c in message.tool_calls]
        return out

    def final(self, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole reply parsed as vLLM's non-streaming server does (`{"content", "tool_calls"}`),
        and the finish reason it reports: `tool_calls` when auto called a tool or `required` stopped."""
        from vllm.entrypoints.generate.base.protocol import ToolCall
        from vllm.renderers.chat_utils import make_tool_call_id

        parser = self.new_parser()
        parser.set_prompt_token_ids(self.prompt_token_ids or [])
        _, content, calls = parser.parse(
            self.text, self.request, enable_auto_tools=True, model_output_token_ids=self.token_ids
        )
        choice = self.request.tool_choice
        forced = self.named or choice == "required"
        tool_calls = [ToolCall(id=c.id or make_tool_call_id(), function=c).model_dump() for c in calls or []]
        if choice == "none":
            tool_calls = []
        message = {"content": (content or "") if forced else content, "tool_calls": tool_calls}
        auto_called = choice == "auto" and bool(tool_calls)
        if auto_called or (choice == "required" and finish_reason == "stop"):
            return message, "tool_calls"
        return message, finish_reason

    def stream_finish(self, finish_reason: str | None) -> str | None:
        """The finish reason vLLM's server streams: `tool_calls` once calls went out (not for a named one)."""
        if self.streamed_calls and not self.named and finish_reason == "stop":
            return "tool_calls"
        return finish_reason


def parser_class(name: str, model_config: Any, tokenizer: Any) -> Any:
    """vLLM's Parser class for tool-call parser `name`, composed as `vllm serve --enable-auto-tool-choice
    --tool-call-parser NAME` composes it (and checked against the tokenizer the same way)."""
    from vllm.parser import ParserManager

    return ParserManager.get_parser(
        tool_parser_name=name,
        reasoning_parser_name=None,
        enable_auto_tools=True,
        model_name=model_config.model,
        is_harmony=model_config.hf_config.model_type == "gpt_oss",
        tokenizer=tokenizer,
    )


def open_session(
    data: dict[str, Any], parser_cls: Any, tokenizer: Any, model_config: Any, stage: str
) -> ToolSession | None:
    """A ToolSession for a chat input that asks for tools (None when it does not).

    Raises InvalidRequest with vLLM's own message when the tool fields are malformed, or when the
    stage has no tool-call parser and the request wants calls (`tool_choice` other than none)."""
    if not any(data.get(k) is not None for k in TOOL_INPUT_KEYS):
        return None
    from pydantic import ValidationError
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    fields = {k: data[k] for k in TOOL_INPUT_KEYS if data.get(k) is not None}
    try:
        request = ChatCompletionRequest(model="", messages=data.get("messages") or [], **fields)
    except (ValidationError, ValueError) as exc:
        raise InvalidRequest(f"stage {stage!r}: {_first_error(exc)}") from None
    if not request.tools:
        return None  # tool_choice none / parallel_tool_calls without tools: nothing to do
    if parser_cls is None:
        if request.tool_choice == "none":
            return None  # vLLM's server renders the tools and parses nothing; so do we, below
        raise InvalidRequest(
            f"tool_choice {request.tool_choice!r} needs a tool-call parser, and stage {stage!r} has none; "
            "set engine_args.tool_call_parser on the stage (e.g. 'hermes'), or send tool_choice \"none\""
        )
    kwargs = dict(data.get("chat_template_kwargs") or {})
    session = ToolSession(request, parser_cls, tokenizer, model_config, kwargs)
    if request.tool_choice != "none":
        try:
            session.request = session.new_parser().adjust_request(request)
        except ValueError as exc:
            raise InvalidRequest(f"stage {stage!r}: {exc}") from None
    return session


def template_tools(data: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The tools of a chat input as the chat template sees them, without a session (tool_choice none
    on a stage without a parser: vLLM's server still renders them)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam

    tools = data.get("tools")
    if not isinstance(tools, list) or not tools:
        return None
    try:
        return [ChatCompletionToolsParam.model_validate(t).model_dump() for t in tools]
    except ValueError as exc:
        raise InvalidRequest(f"tools: {_first_error(exc)}") from None


def _first_error(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            first = errors()[0]
            return str(first.get("msg") or exc)
        except Exception:  # a ValidationError without entries: fall back to its text
            return str(exc)
    return str(exc)
