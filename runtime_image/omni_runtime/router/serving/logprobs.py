"""OpenAI's logprobs shapes from the rows an AR stage sends (`engines.ar.extras.logprob_rows`).

A row is one generated token: `[token_id, logprob, decoded]` entries in vLLM's order, the sampled
token first. The cuts follow vLLM's server exactly: chat returns the first `top_logprobs` entries,
completions the first `logprobs + 1` (OpenAI's legacy API counts the sampled token in); a logprob
below -9999 (minus infinity included) is reported as -9999.0, which JSON can carry.
"""

from __future__ import annotations

from typing import Any

from omni_runtime.router.protocol.chat import ChatLogProbs, TokenLogProb, TopLogProb

__all__ = ["chat_logprobs", "completion_logprobs"]

Row = list[list[Any]]

FLOOR = -9999.0


def _lp(value: Any) -> float:
    return max(float(value), FLOOR)


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def _sampled(row: Row, token_id: int) -> list[Any] | None:
    return next((e for e in row if e[0] == token_id), None)


def chat_logprobs(token_ids: list[int], rows: list[Row], top: int) -> ChatLogProbs:
    """`choices[].logprobs` for the tokens `token_ids` and their rows, with `top` alternatives each."""
    content = []
    for token_id, row in zip(token_ids, rows, strict=False):
        entry = _sampled(row, token_id)
        if entry is None:  # vLLM reports such a token with its floor logprob
            content.append(TokenLogProb(token=str(token_id), logprob=FLOOR, bytes=None))
            continue
        tops = [TopLogProb(token=t, logprob=_lp(lp), bytes=_bytes(t)) for _, lp, t in row[:top]]
        content.append(TokenLogProb(token=entry[2], logprob=_lp(entry[1]), bytes=_bytes(entry[2]), top_logprobs=tops))
    return ChatLogProbs(content=content)


def completion_logprobs(token_ids: list[int], rows: list[Row], top: int, text_offset: int = 0) -> dict[str, Any]:
    """A completion choice's `logprobs`: tokens, token_logprobs, top_logprobs (the first `top + 1`
    entries, as vLLM), text_offset (where each token starts in the choice's text, from `text_offset`)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = text_offset
    for token_id, row in zip(token_ids, rows, strict=False):
        entry = _sampled(row, token_id)
        token = entry[2] if entry is not None else str(token_id)
        tokens.append(token)
        token_logprobs.append(_lp(entry[1]) if entry is not None else None)
        tops.append({t: _lp(lp) for i, (_, lp, t) in enumerate(row) if top >= i} if entry is not None else None)
        offsets.append(offset)
        offset += len(token)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": tops}
