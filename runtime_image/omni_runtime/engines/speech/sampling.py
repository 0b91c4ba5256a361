"""Per-request sampling of codec tokens, with the same processors, in the same order, as transformers.

Talker code 0: repetition penalty over the codes it sampled before, suppressed ids, then (when
sampling) temperature, top-k, top-p. `temperature` 0 is greedy, as `do_sample=False` in transformers
(the repetition penalty still applies, as there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = ["Sampling", "sample"]


@dataclass(frozen=True)
class Sampling:
    """How one request draws its tokens (engine params `temperature`, `top_k`, `top_p`,
    `repetition_penalty`, `max_tokens`, `seed`)."""

    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    max_tokens: int = 4096
    seed: int | None = None

    PARAMS: ClassVar[frozenset[str]] = frozenset(
        {"temperature", "top_k", "top_p", "repetition_penalty", "max_tokens", "seed"}
    )
    """The request parameters `from_params` reads."""

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @classmethod
    def from_params(cls, params: dict[str, Any], default_max: int) -> Sampling:
        """From merged engine params; raises ValueError naming the bad one."""
        try:
            out = cls(
                temperature=float(params.get("temperature", cls.temperature)),
                top_k=int(params.get("top_k", cls.top_k)),
                top_p=float(params.get("top_p", cls.top_p)),
                repetition_penalty=float(params.get("repetition_penalty", cls.repetition_penalty)),
                max_tokens=int(params.get("max_tokens") or default_max),
                seed=None if params.get("seed") is None else int(params["seed"]),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"sampling parameters {params!r} are not numbers where numbers are needed: {exc}"
            ) from None
        if out.temperature < 0 or not 0 < out.top_p <= 1 or out.repetition_penalty <= 0 or out.max_tokens < 1:
            raise ValueError(
                f"sampling parameters out of range: temperature {out.temperature} (>= 0), top_p {out.top_p} "
                f"(0 < top_p <= 1), repetition_penalty {out.repetition_penalty} (> 0), max_tokens "
                f"{out.max_tokens} (>= 1)"
            )
        return out


def sample(
    logits: Any,
    sampling: Sampling,
    *,
    history: list[int] | None = None,
    suppress: Any = None,
    generator: Any = None,
    top_k: int | None = None,
    top_p: float | None = None,
    temperature: float | None = None,
) -> int:
    """One token id from `logits` [vocab] (float). `suppress`: a bool mask [vocab] of ids never drawn.
    `top_k` / `top_p` / `temperature` override the request's (the code predictor uses fixed ones)."""
    import torch

    scores = logits.float().clone()
    if history and sampling.repetition_penalty != 1.0:
        ids = torch.tensor(sorted(set(history)), device=scores.device)
        picked = scores[ids]
        penalty = sampling.repetition_penalty
        scores[ids] = torch.where(picked < 0, picked * penalty, picked / penalty)
    if suppress is not None:
        scores = scores.masked_fill(suppress, float("-inf"))
    if sampling.greedy:
        return int(torch.argmax(scores))
    scores = scores / (temperature if temperature is not None else sampling.temperature)
    k = top_k if top_k is not None else sampling.top_k
    if 0 < k < scores.shape[-1]:
        kth = torch.topk(scores, k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    p = top_p if top_p is not None else sampling.top_p
    if p < 1.0:
        ordered, order = torch.sort(scores, descending=False)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative <= (1 - p)
        drop[-1] = False
        scores = scores.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    probs = scores.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))
