"""The one condition writer: Type, Status, Reason, Message, observedGeneration.

lastTransitionTime changes only when Status flips, and `set_condition` reports whether anything
changed, so an unchanged world writes nothing.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, Literal

from omni_operator.status.reasons import Reason

__all__ = ["Condition", "Reason", "set_condition", "get_condition", "now_rfc3339"]

Status = Literal["True", "False", "Unknown"]


@dataclass(frozen=True)
class Condition:
    """A desired condition; `reason` is typed (`spec.reasons.Reason`), `message` tells a person what to do."""

    type: str
    status: Status
    reason: Reason
    message: str = ""

    def __post_init__(self) -> None:
        # A plain string is accepted only when it is one of the known reasons: a typo fails here.
        object.__setattr__(self, "reason", Reason(self.reason))


def now_rfc3339() -> str:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def get_condition(conditions: list[dict[str, Any]], type_: str) -> dict[str, Any] | None:
    return next((c for c in conditions if c.get("type") == type_), None)


def set_condition(
    conditions: list[dict[str, Any]], wanted: Condition, generation: int, now: str | None = None
) -> tuple[list[dict[str, Any]], bool]:
    """Return (new conditions, changed). The input list is not modified."""
    current = get_condition(conditions, wanted.type)
    entry = {
        "type": wanted.type,
        "status": wanted.status,
        "reason": wanted.reason.value,
        "message": wanted.message,
        "observedGeneration": generation,
        "lastTransitionTime": now or now_rfc3339(),
    }
    if current is not None:
        if current.get("status") == wanted.status:
            entry["lastTransitionTime"] = current.get("lastTransitionTime", entry["lastTransitionTime"])
        if all(current.get(k) == entry[k] for k in entry):
            return list(conditions), False
    others = [c for c in conditions if c.get("type") != wanted.type]
    return [*others, entry] if current is None else [
        entry if c.get("type") == wanted.type else c for c in conditions
    ], True
