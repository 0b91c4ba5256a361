"""The reasons our conditions carry: `Reason`, defined once in the runtime's pure spec
(`omni_runtime.spec.reasons`) and used as it is here, by the resolver's `SpecError`s and by a stage's
termination message; plus `reason_of` for a reason read back from the API server.

A reason is chosen where the problem is found and travels as a `Reason`; nobody recovers it from a
message.
"""

from __future__ import annotations

from omni_runtime.spec.reasons import Reason

__all__ = ["Reason", "reason_of"]


def reason_of(text: str | None, fallback: Reason = Reason.STAGE_DEGRADED) -> Reason:
    """The `Reason` a condition read back from the API server carries (`fallback` if unknown)."""
    try:
        return Reason(text)
    except ValueError:
        return fallback
