"""What a running AR request streams: the pieces one vLLM output becomes (`completion_pieces`), and the
hidden-state rows that go into its pieces (`attach_rows`, `attach_media_rows`; see `hidden_states`).
"""

from __future__ import annotations

from typing import Any, cast

from omni_runtime.engines.ar.extras import logprob_rows
from omni_runtime.engines.ar.prompt import media_grids
from omni_runtime.engines.base import EngineError
from omni_runtime.processors.payloads import ArOutput

__all__ = ["ROWS_TIMEOUT_S", "attach_media_rows", "attach_rows", "completion_pieces"]

ROWS_TIMEOUT_S = 120.0
"""How long a step's hidden-state rows may lag its tokens (they are pushed before the tokens go out,
so only a stalled process reaches this)."""


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
