"""What an AR stage makes of a request before vLLM runs it: the rendered prompt, the SamplingParams, and the
checks a request must pass; and the media shapes of a rendered prompt (`media_grids`), which a talker reads.

Every refusal is an InvalidRequest naming what was sent, what is allowed and what to send instead.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from omni_runtime.engines.ar.extras import structured_outputs
from omni_runtime.engines.ar.tools import template_tools
from omni_runtime.engines.base import EngineError, InvalidRequest
from omni_runtime.processors.payloads import MediaGrids
from omni_runtime.spec import StageSpec

__all__ = ["check_sampling", "media_grids", "render_prompt", "sampling_fields", "sampling_params"]

_UNSUPPORTED_SAMPLING = frozenset({"output_kind", "skip_clone"})
"""SamplingParams fields the engine owns: streaming is always DELTA."""


def sampling_fields() -> frozenset[str]:
    """The SamplingParams fields a request may set (vLLM's, less those the engine owns)."""
    from vllm import SamplingParams

    names = getattr(SamplingParams, "__struct_fields__", None) or [f.name for f in dataclasses.fields(SamplingParams)]
    return frozenset(n for n in names if not n.startswith("_")) - _UNSUPPORTED_SAMPLING


def sampling_params(stage: StageSpec, fields: frozenset[str], params: dict[str, Any]) -> Any:
    """vLLM SamplingParams from the stage defaults overlaid with `params` (DELTA output); `fields` are the
    keys allowed (`sampling_fields`).

    Raises InvalidRequest naming an unknown key or a value vLLM rejects."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    merged = {**stage.sampling_params, **params}
    for key in merged:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise InvalidRequest(
                f"sampling parameter {key!r} is not supported by stage {stage.name!r}{hint} "
                "(use vLLM SamplingParams names: temperature, top_p, top_k, max_tokens, stop, seed, n...)"
            )
    from vllm.exceptions import VLLMClientError

    if merged.get("structured_outputs") is not None:
        merged["structured_outputs"] = structured_outputs(merged["structured_outputs"], stage.name)
    if isinstance(merged.get("logit_bias"), dict):  # JSON object keys are strings; vLLM wants ids
        try:
            merged["logit_bias"] = {int(k): float(v) for k, v in merged["logit_bias"].items()}
        except (TypeError, ValueError):
            raise InvalidRequest(f"logit_bias must map token ids to numbers; got {merged['logit_bias']!r}") from None
    try:
        return SamplingParams(**merged, output_kind=RequestOutputKind.DELTA)
    except (ValueError, TypeError, VLLMClientError) as exc:
        raise InvalidRequest(f"invalid sampling parameters for stage {stage.name!r}: {exc}") from exc


async def render_prompt(
    renderer: Any, cmpl_tok: Any, chat_tok: Any, data: dict[str, Any], stage_name: str, max_model_len: int
) -> dict[str, Any]:
    """vLLM's engine input (with `prompt_token_ids`) for `{"prompt"}`, `{"messages"}` (rendered
    with the model's chat template and a generation prompt, as `vllm serve` does; optional
    `chat_template_kwargs` go to the template) or `{"prompt_token_ids"}`; `add_special_tokens`
    overrides vLLM's default for the text (true for a prompt, false for a chat). `renderer` is vLLM's (the
    AsyncLLM's), `cmpl_tok` / `chat_tok` its tokenization params for a prompt / a chat.

    Raises InvalidRequest when the input is malformed or longer than max_model_len allows."""
    from vllm.renderers.params import ChatParams

    try:
        if "prompt_token_ids" in data:
            ids = [int(t) for t in data["prompt_token_ids"]]
            (prompt,) = await renderer.render_cmpl_async([{"prompt_token_ids": ids}], cmpl_tok)
        elif "messages" in data:
            messages = data["messages"]
            if not isinstance(messages, list) or not messages:
                raise InvalidRequest("messages must be a non-empty list of {role, content} objects")
            kwargs = {"add_generation_prompt": True, **(data.get("chat_template_kwargs") or {})}
            tools = data.get("template_tools") or template_tools(data)
            if tools:  # as vLLM's server: the template's `tools`, under the request's own kwargs
                kwargs = {"tools": tools, **kwargs}
            chat = ChatParams(chat_template_kwargs=kwargs)
            tok = chat_tok
            if "add_special_tokens" in data:
                tok = dataclasses.replace(tok, add_special_tokens=bool(data["add_special_tokens"]))
            _, (prompt,) = await renderer.render_chat_async([messages], chat, tok)
        elif "prompt" in data:
            if not isinstance(data["prompt"], str):
                raise InvalidRequest(f"prompt must be a string, not {type(data['prompt']).__name__}")
            tok = cmpl_tok
            if "add_special_tokens" in data:
                tok = dataclasses.replace(tok, add_special_tokens=bool(data["add_special_tokens"]))
            (prompt,) = await renderer.render_cmpl_async([{"prompt": data["prompt"]}], tok)
        else:
            raise InvalidRequest(
                f"stage {stage_name!r} needs 'prompt', 'messages' or 'prompt_token_ids' in its "
                f"input; got {sorted(data)}"
            )
    except InvalidRequest:
        raise
    except Exception as exc:  # template errors, bad message shapes, vLLM validation
        raise InvalidRequest(f"stage {stage_name!r} could not read the prompt: {exc}") from exc
    n = len(prompt.get("prompt_token_ids") or [])
    if n == 0:
        raise InvalidRequest("the prompt is empty; send at least one token")
    if n >= max_model_len:
        raise InvalidRequest(
            f"the prompt is {n} tokens but stage {stage_name!r} has max_model_len "
            f"{max_model_len}, which must also hold at least one generated token; shorten the "
            f"prompt to at most {max_model_len - 1} tokens or raise max_model_len"
        )
    return prompt


def check_sampling(
    stage_name: str,
    sampling: Any,
    max_model_len: int,
    *,
    check_max_tokens: bool,
    tools: bool,
    one_sequence_rows: bool,
    speculative_rows: bool,
    kv_export: bool = False,
) -> None:
    """Refuse what this stage cannot run for a request with `sampling` (vLLM SamplingParams): `max_tokens`
    beyond `max_model_len` when the client set it (`check_max_tokens`), several sequences when tool calls are
    parsed (`tools`), every hidden-state row is streamed (`one_sequence_rows`) or the prompt's KV cache goes
    out (`kv_export`), and the logits processors that vLLM's speculative decoding, which the hidden-state
    route is (`speculative_rows`), does not apply."""
    if check_max_tokens and sampling.max_tokens is not None and sampling.max_tokens > max_model_len:
        raise InvalidRequest(
            f"max_tokens={sampling.max_tokens} cannot be greater than max_model_len={max_model_len} "
            f"of stage {stage_name!r}; request fewer output tokens"
        )
    if tools and sampling.n > 1:
        raise InvalidRequest(
            f"stage {stage_name!r} parses tool calls of one sequence per request; got n={sampling.n}, "
            "send n=1 (the router runs one request per choice)"
        )
    if one_sequence_rows and sampling.n > 1:
        raise InvalidRequest(
            f"stage {stage_name!r} streams hidden states, which needs one sequence per request; "
            f"got n={sampling.n}, send n=1"
        )
    if kv_export and sampling.n > 1:
        raise InvalidRequest(
            f"stage {stage_name!r} exports each request's prompt KV cache, once per request; got n={sampling.n}, "
            "send n=1 (the prompt's KV is the same for every sequence)"
        )
    if speculative_rows:
        # The hidden-state route is vLLM speculative decoding, whose rejection sampler skips the
        # min_p and logit_bias logits processors for the target token: accepted, they would do nothing.
        ignored = [
            name for name, on in (("min_p", sampling.min_p > 0), ("logit_bias", bool(sampling.logit_bias))) if on
        ]
        if ignored:
            got = ", ".join(f"{name}={getattr(sampling, name)!r}" for name in ignored)
            raise InvalidRequest(
                f"stage {stage_name!r} streams hidden states (vLLM speculative decoding), which cannot "
                f"apply {' and '.join(ignored)}; got {got}. "
                "Leave them out (temperature, top_p, top_k and the repetition penalties work)"
            )


def _field_values(items: Any, modality: str, key: str) -> list[Any]:
    values = []
    for item in (items.get(modality) if items else None) or []:
        elem = item.get(key) if item is not None else None
        if elem is not None:
            data = elem.data
            values.append(data.tolist() if hasattr(data, "tolist") else data)
    return values


def media_grids(prompt: dict[str, Any]) -> MediaGrids:
    """The media shapes of a rendered vLLM prompt (its `mm_kwargs`), in prompt order per modality, as
    plain lists: what the Qwen3-Omni talker's rope index reads (transformers' names). Needs every item
    rendered, none from vLLM's media processor cache (EngineError otherwise)."""
    items = prompt.get("mm_kwargs")
    if items and any(item is None for values in items.values() for item in values or []):
        raise EngineError(
            "a media item of the prompt came from vLLM's processor cache without its fields; the talker needs "
            "its grid, so set engine_args.mm_processor_cache_gb to 0 on this stage"
        )
    use_audio_in_video = _field_values(items, "video", "use_audio_in_video")
    return {
        "image_grid_thw": _field_values(items, "image", "image_grid_thw"),
        "video_grid_thw": _field_values(items, "video", "video_grid_thw"),
        "video_second_per_grid": [float(v) for v in _field_values(items, "video", "second_per_grid_ts")],
        "audio_feature_lengths": [int(v) for v in _field_values(items, "audio", "audio_feature_lengths")],
        "use_audio_in_video": any(bool(v) for v in use_audio_in_video),
    }
