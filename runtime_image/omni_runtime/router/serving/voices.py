"""Voices: which speakers a request may name, checked against what the speech stages report.

A speech stage's engine lists its checkpoint's speakers; each replica reports them in its pongs, so
the router (which holds no model) knows them. `GET /v1/audio/voices` lists them; a request's `voice`
must be one of them and reaches those stages as the `voice` parameter.
"""

from __future__ import annotations

from typing import Any

from omni_runtime.router.errors import BadRequest
from omni_runtime.router.plan import Plan
from omni_runtime.router.pool import StagePool

__all__ = ["all_voices", "voice_params"]


def all_voices(pool: StagePool) -> list[str]:
    """Every speaker any ready speech stage knows, sorted."""
    return sorted({v for voices in pool.voices().values() for v in voices})


def voice_params(pool: StagePool, plan: Plan, voice: str | None, param: str) -> dict[str, dict[str, Any]]:
    """`{stage: {"voice": voice}}` for the planned stages that know voices; {} without a voice.

    Raises BadRequest (naming `param`) when the voice is unknown, listing the known ones."""
    if voice is None:
        return {}
    known = {s: v for s, v in pool.voices().items() if s in plan.stages}
    if not known:
        raise BadRequest(
            f"{param} {voice!r} cannot be used: no ready stage of this request lists voices "
            "(GET /v1/audio/voices); omit it to use the model's default speaker, or retry once the "
            "speech stages are ready",
            param=param,
        )
    unknown = [s for s, v in known.items() if voice not in v]
    if unknown:
        names = sorted({v for voices in known.values() for v in voices})
        raise BadRequest(f"{param} {voice!r} is not a voice of this model; use one of {names}", param=param)
    return {s: {"voice": voice} for s in known}
