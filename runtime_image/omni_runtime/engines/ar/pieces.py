"""What a running AR request streams: the pieces one vLLM output becomes (`completion_pieces`), the
hidden-state rows that go into its pieces (`attach_rows`, `attach_media_rows`; see `hidden_states`), and
the prompt's KV cache on its final piece (`attach_kv`; see `kv_export`).
"""

from __future__ import annotations

from typing import Any, cast

from omni_runtime.engines.ar.extras import logprob_rows
from omni_runtime.engines.ar.prompt import media_grids
from omni_runtime.engines.base import EngineError
from omni_runtime.processors.kv_cache import KvExpectation, KvPayloadMismatch, check_kv_payload
from omni_runtime.processors.payloads import ArOutput

__all__ = ["KV_TIMEOUT_S", "ROWS_TIMEOUT_S", "attach_kv", "attach_media_rows", "attach_rows", "completion_pieces"]

ROWS_TIMEOUT_S = 120.0
"""How long a step's hidden-state rows may lag its tokens (they are pushed before the tokens go out,
so only a stalled process reaches this)."""

KV_TIMEOUT_S = 120.0
"""How long a finished request's KV cache may take to arrive after its last token: the engine core sends it in
the step after the request finished, so only a stalled engine or a lost message reaches this."""


def completion_pieces(
    out: Any, completion_tokens: dict[int, int], finish_reason: str | None, n: int, tools: Any, tokenizer: Any
) -> tuple[list[ArOutput], str | None]:
    """The pieces of one vLLM output (one per completion, at least one) and the request's finish reason so far.

    Counts each completion's new tokens into `completion_tokens`; a piece carries `logprobs` when asked
    (`tokenizer` given), `index` when the request has `n` > 1 sequences, and the tool-call deltas and final
    message of `tools` (the request's tool session, or None)."""
    pieces = []
    for completion in out.outputs:
        completion_tokens[completion.index] = completion_tokens.get(completion.index, 0) + len(completion.token_ids)
        finish_reason = completion.finish_reason or finish_reason
        data = ArOutput(text=completion.text, token_ids=list(completion.token_ids))
        if completion.logprobs is not None:
            data["logprobs"] = logprob_rows(completion.logprobs, tokenizer)
        if n > 1:
            data["index"] = completion.index
        if tools is not None:
            done = completion.finish_reason is not None
            data.update(cast(ArOutput, tools.delta(completion.text, list(completion.token_ids), done)))
            if done:
                data["message"], data["finish_reason"] = tools.final(completion.finish_reason)
                data["stream_finish_reason"] = tools.stream_finish(completion.finish_reason)
        pieces.append(data)
    if not pieces:
        pieces.append(ArOutput(text="", token_ids=[]))
    return pieces, finish_reason


async def attach_media_rows(
    rows: Any,
    data: ArOutput,
    prompt: dict[str, Any],
    out: Any,
    stage_name: str,
    layer_index: int | None,
    media_ids: frozenset[int],
) -> None:
    """Put the media positions' rows (of layer `layer_index`; `media_ids` are the placeholder token ids) and the
    media grids into the first piece's `data`."""
    from omni_runtime.engines.ar.hidden_states import HiddenStatesError

    ids = prompt["prompt_token_ids"]
    if out.finished and out.outputs and out.outputs[0].finish_reason == "abort":
        return  # the prompt may never have run; nothing downstream will read it
    try:
        await rows.wait_for(len(ids), ROWS_TIMEOUT_S)
    except (TimeoutError, HiddenStatesError) as exc:
        raise EngineError(
            f"stage {stage_name!r}: hidden-state rows of request {out.request_id!r} stopped at "
            f"{rows.received} of {len(ids)} prompt rows ({exc or 'timed out'}); the engine is stalled or "
            "the route broke"
        ) from exc
    taken = rows.take()
    layer = taken[str(layer_index)] if taken is not None else None
    if layer is None or layer.shape[0] < len(ids):
        raise EngineError(
            f"stage {stage_name!r}: request {out.request_id!r} got {rows.received} hidden-state rows "
            f"for a prompt of {len(ids)} tokens; the route broke"
        )
    import torch

    positions = [i for i, t in enumerate(ids) if t in media_ids]
    data["media_hidden_states"] = layer[torch.tensor(positions)].contiguous()
    data["media_grids"] = media_grids(prompt)


async def attach_rows(rows: Any, data: ArOutput, prompt_tokens: int, generated: int, out: Any, stage_name: str) -> None:
    """Put the rows that arrived for this output into `data["hidden_states"]`.

    Waits for the rows this step surely produced: every prompt row with the first token; later
    at least up to the second-to-last token (the row of a token whose draft was accepted is
    sent one step later); when finished, all of them (one per input position)."""
    from omni_runtime.engines.ar.hidden_states import HiddenStatesError

    reason = out.outputs[0].finish_reason if out.outputs else None
    if out.finished:
        need = prompt_tokens + generated - 1 if reason != "abort" else 0
    else:
        need = prompt_tokens + max(0, generated - 2)
    try:
        await rows.wait_for(need, ROWS_TIMEOUT_S)
    except (TimeoutError, HiddenStatesError) as exc:
        raise EngineError(
            f"stage {stage_name!r}: hidden-state rows of request {out.request_id!r} stopped at "
            f"{rows.received} of {need} ({exc or 'timed out'}); the engine is stalled or the route broke"
        ) from exc
    taken = rows.take()
    if taken is not None:
        data["hidden_states"] = taken


async def attach_kv(
    receiver: Any,
    data: ArOutput,
    expected: KvExpectation,
    *,
    request_id: str,
    role: str,
    prompt_tokens: int,
    stage_name: str,
    timeout: float,
) -> None:
    """Put the prompt KV cache of `request_id` (opened on `receiver`, a `kv_export.KvReceiver`) into its final
    piece `data`, checked against what this stage's checkpoint gives (`expected`). Raises EngineError naming the
    request and its `role` when it does not arrive within `timeout` seconds or is not what was sent for."""
    from omni_runtime.engines.ar.kv_export import KvExportError

    try:
        payload = await receiver.get(request_id, timeout)
    except TimeoutError as exc:
        raise EngineError(
            f"stage {stage_name!r}: the KV cache of request {request_id!r} (role {role}) did not arrive within "
            f"{timeout:g}s after its prefill; the engine is stalled or the KV route lost it (no output goes on "
            "without it: a DiT would guide without this role)"
        ) from exc
    except KvExportError as exc:
        raise EngineError(f"stage {stage_name!r}, request {request_id!r} (role {role}): {exc}") from exc
    try:
        check_kv_payload(payload, expected, role=role, edge=f"vLLM->{stage_name}")
    except KvPayloadMismatch as exc:
        raise EngineError(f"stage {stage_name!r}, request {request_id!r}: {exc}") from exc
    if payload["seq_len"] != prompt_tokens:
        raise EngineError(
            f"stage {stage_name!r}: the KV cache of request {request_id!r} (role {role}) covers {payload['seq_len']} "
            f"tokens, its prompt has {prompt_tokens}; the KV route broke"
        )
    data["kv_cache"] = payload
