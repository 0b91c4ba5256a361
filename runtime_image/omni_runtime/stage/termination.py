"""Why a stage process exits, written for Kubernetes (`terminationMessagePath`) and read by the operator.

The message is one JSON object, `{"reason": "ConnectorUnavailable", "message": "..."}`, so the operator
takes the reason as a typed value instead of searching the text; the reason is a member of the one
`spec.reasons.Reason` vocabulary, which the operator's conditions carry as they are. Pure pydantic: the
operator imports it.
"""

from __future__ import annotations

import logging
import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omni_runtime.spec.reasons import Reason

__all__ = ["MAX_MESSAGE_BYTES", "ExitReason", "Termination"]

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 4096
"""The kubelet keeps at most 4096 bytes of a termination message."""


ExitReason = Literal[Reason.CONNECTOR_UNAVAILABLE, Reason.ENGINE_FAILED]
"""The `Reason`s a stage process exits with: a connector an edge needs could not start, or the engine
failed to load, failed its self-check or died while serving (see `Reason` for each)."""


class Termination(BaseModel):
    """A stage's last word: a typed reason plus a message for a person."""

    model_config = ConfigDict(extra="forbid")

    reason: ExitReason
    message: str = Field(max_length=MAX_MESSAGE_BYTES)

    def dumps(self) -> str:
        """JSON that fits the kubelet's 4096 bytes (the message is shortened from the front if needed)."""
        text = self.model_dump_json()
        excess = len(text.encode()) - MAX_MESSAGE_BYTES
        if excess > 0:
            return self.model_copy(update={"message": "..." + self.message[excess + 3 :]}).model_dump_json()
        return text

    def write(self, path: str) -> bool:
        """Write to `path` when it exists (the kubelet creates it in a pod; locally there is none)."""
        if not path or not os.path.exists(path):
            return False
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(self.dumps())
        except OSError as err:
            log.warning("could not write the termination message to %s: %s", path, err)
            return False
        return True

    @classmethod
    def parse(cls, text: str | None) -> Termination | None:
        """The termination a stage wrote, or None for any other text (a crash's log tail)."""
        if not text or not text.lstrip().startswith("{"):
            return None
        try:
            return cls.model_validate_json(text)
        except ValidationError:
            return None
