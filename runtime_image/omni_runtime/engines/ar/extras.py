"""What an AR stage serves besides sampled text: logprob rows, structured outputs, tokenize/detokenize.

The router holds no tokenizer and never imports vLLM, so the stage does the vLLM-side work and hands
back plain data the router shapes into OpenAI's replies:

- **Logprob rows.** With `logprobs` in the sampling params, each output piece carries
  `data["logprobs"]`: one row per generated token, each row the `[token_id, logprob, decoded]` entries
  of vLLM's logprob dict in vLLM's order (the sampled token first, then the top ones by rank), so the
  router can cut them exactly as vLLM's server does for chat (`top_logprobs`) and completions.
- **Structured outputs.** `structured_outputs` arrives as a dict of vLLM's `StructuredOutputsParams`
  fields (`json`, `json_object`, `regex`, `choice`, `grammar`, ...) and becomes that object, so vLLM's
  own structured-output backend (xgrammar / guidance / outlines, per `structured_outputs_config`)
  constrains the decode.
- **Tokenize / detokenize.** An input `{"tokenize": {...}}` or `{"detokenize": {"tokens": [...]}}` is
  answered with one finished piece, rendered exactly as vLLM's `/tokenize` and `/detokenize` do.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omni_runtime.engines.base import InvalidRequest

__all__ = ["TOKEN_OPS", "detokenize", "logprob_rows", "structured_outputs", "tokenize"]

TOKEN_OPS = ("tokenize", "detokenize")
"""Input keys that ask the stage for its tokenizer instead of a generation."""


def structured_outputs(value: Any, stage: str) -> Any:
    """vLLM's `StructuredOutputsParams` from a dict of its fields (an object already one passes).

    Raises InvalidRequest naming what vLLM refused (unknown key, none or several constraints)."""
    from vllm.sampling_params import StructuredOutputsParams

    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, dict):
        raise InvalidRequest(f"structured_outputs must be an object, not {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(StructuredOutputsParams) if f.init and not f.name.startswith("_")}
    unknown = sorted(set(value) - known)
    if unknown:
        raise InvalidRequest(f"structured_outputs keys {unknown} are unknown; use {sorted(known)}")
    try:
        return StructuredOutputsParams(**value)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"invalid structured_outputs for stage {stage!r}: {exc}") from exc


def logprob_rows(logprobs: Any, tokenizer: Any) -> list[list[list[Any]]]:
    """vLLM's per-token logprob dicts as plain rows (see the module docstring); a token vLLM did not
    decode is decoded here, as vLLM's server does."""
    rows: list[list[list[Any]]] = []
    for step in logprobs or []:
        row: list[list[Any]] = []
        for token_id, lp in (step or {}).items():
            decoded = lp.decoded_token
            if decoded is None and tokenizer is not None:
                decoded = tokenizer.decode([token_id])
            row.append([int(token_id), float(lp.logprob), decoded if decoded is not None else ""])
        rows.append(row)
    return rows


async def tokenize(renderer: Any, spec: dict[str, Any], max_model_len: int) -> dict[str, Any]:
    """vLLM's `/tokenize` for `{"prompt"}` or `{"messages", "add_generation_prompt",
    "continue_final_message", "chat_template_kwargs"}`, with `add_special_tokens` and
    `return_token_strs`: `{"tokens", "count", "max_model_len", "token_strs"?}`."""
    from vllm.renderers.params import ChatParams, TokenizeParams

    tok = TokenizeParams(max_total_tokens=None, max_output_tokens=0,
                         add_special_tokens=bool(spec.get("add_special_tokens", "messages" not in spec)))  # fmt: skip
    try:
        if "messages" in spec:
            kwargs = {
                "add_generation_prompt": bool(spec.get("add_generation_prompt", True)),
                "continue_final_message": bool(spec.get("continue_final_message", False)),
                **(spec.get("chat_template_kwargs") or {}),
            }
            _, prompts = await renderer.render_chat_async(
                [spec["messages"]], ChatParams(chat_template_kwargs=kwargs), tok
            )
        else:
            prompts = await renderer.render_cmpl_async([{"prompt": str(spec.get("prompt", ""))}], tok)
    except Exception as exc:  # template errors, bad message shapes
        raise InvalidRequest(f"could not tokenize the input: {exc}") from exc
    ids = [int(t) for p in prompts for t in (p.get("prompt_token_ids") or [])]
    out: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}
    if spec.get("return_token_strs"):
        out["token_strs"] = renderer.get_tokenizer().convert_ids_to_tokens(ids)
    return out


async def detokenize(renderer: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `/detokenize`: `{"prompt": text}` for `{"tokens": [ids]}`. Raises InvalidRequest for an
    id outside the vocabulary."""
    from vllm.renderers.params import TokenizeParams

    tokens = spec.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise InvalidRequest("detokenize needs tokens: a list of token ids")
    tok = TokenizeParams(max_total_tokens=None, max_output_tokens=0, needs_detokenization=True)
    try:
        prompt = await renderer.tokenize_prompt_async({"prompt_token_ids": tokens}, tok)
    except Exception as exc:  # an id the tokenizer does not know
        raise InvalidRequest(f"could not detokenize the tokens: {exc}") from exc
    return {"prompt": prompt.get("prompt", "")}
