"""Sampling fields shared by `/v1/chat/completions` and `/v1/completions`.

OpenAI's sampling fields and vLLM's extras mean the same on both routes and go to the same place (the AR
stage that writes the text), so both request models inherit them from `SamplingFields`. Integers that
end up in vLLM's `SamplingParams` are bounded here so that an out-of-range value is a 400 naming the field
rather than an error deep in the stage.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "STRUCTURED_KEYS",
    "JsonSchema",
    "ResponseFormat",
    "SamplingFields",
    "StreamOptions",
    "StructuredOutputs",
    "check_stream_options",
]

INT32_MAX = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
"""A token id: vLLM keeps them as 32-bit integers."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    """A last chunk with the request's usage and no choices."""
    continuous_usage_stats: bool = False
    """vLLM's: every chunk carries the usage so far."""


def check_stream_options(options: StreamOptions | None, stream: bool) -> None:
    """Stream options on a request that does not stream would do nothing: refused, as vLLM does."""
    if options is not None and options.model_fields_set and not stream:
        raise ValueError("stream_options only applies with stream: true; set stream, or drop stream_options")


class JsonSchema(BaseModel):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON following a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema (a JSON Schema object)")
        return self

    def structured_outputs(self) -> dict[str, Any] | None:
        """The same constraint as vLLM's `StructuredOutputsParams` fields (None for text)."""
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema" and self.json_schema is not None:
            return {"json": self.json_schema.json_schema}
        return None


STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
"""vLLM's `structured_outputs` constraints (exactly one per request)."""
_ENGINE_WIDE = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
"""`StructuredOutputsParams` fields vLLM's backends read from the engine's config, never the request's."""


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one constraint (`json`, `regex`, `choice`, `grammar`,
    `json_object`, `structural_tag`) and its options; decoded by vLLM's structured-output backend."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputs:
        engine_wide = [k for k in _ENGINE_WIDE if getattr(self, k) not in (None, False)]
        if engine_wide:
            raise ValueError(
                f"structured_outputs {engine_wide} are not honoured per request (vLLM reads them only from "
                "the engine's structured_outputs_config); remove them"
            )
        given = [k for k in STRUCTURED_KEYS if getattr(self, "json_" if k == "json" else k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {list(STRUCTURED_KEYS)}; got {given or 'none'}")
        return self

    def params(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_defaults=True)


class SamplingFields(BaseModel):
    """The sampling fields of both text routes (OpenAI's, then vLLM's extras)."""

    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, description="Choices; at most the pipeline's router.limits.maxN.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, description="Token id -> bias added to its logit.")
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1, description="Seed of this request's sampling.")
    user: str | None = Field(None, description="An end-user id; OpenAI's and vLLM's servers only record it.")
    response_format: ResponseFormat | None = None
    # vLLM sampling extras
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX, description="Sample from the k most likely; 0 or -1: all.")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    ignore_eos: bool | None = None
    repetition_penalty: float | None = Field(None, gt=0.0)
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[TokenId] | None = None
    structured_outputs: StructuredOutputs | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        check_stream_options(self.stream_options, self.stream)
        return self
