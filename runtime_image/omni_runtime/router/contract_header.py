"""The `x-omnikube-contract` response header: the stage digest each stage of the request ran on.

A request runs within one generation of the pipeline (`StagePool.choose_generation`); every stage checks the
digest it was planned for against its own and refuses another, so the digests planned are the ones served.
The header carries them as a JSON object, stage -> digest, for clients and tests that must know which
generation answered (a rollout under load: no request's stages span two).

A request whose generation lost its last replica of a stage it had not started yet goes on in a generation that
agrees on every stage it started (`StagePool.continuation`); the header then names the digests it went on
with. A streamed response's header leaves when its first event is ready: a stage that moved after that is
named as planned.
"""

from __future__ import annotations

import contextvars
import json
from collections.abc import Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["CONTRACT_HEADER", "ContractHeader", "record_contracts"]

CONTRACT_HEADER = "x-omnikube-contract"

_served: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("omnikube_contracts", default=None)


def record_contracts(contracts: Mapping[str, str]) -> None:
    """Note the stage digests the current request runs on (before its response starts); outside a request,
    nothing."""
    served = _served.get()
    if served is not None:
        served.update(contracts)


class ContractHeader:
    """ASGI middleware adding CONTRACT_HEADER to a response whose request ran on stages."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        served: dict[str, str] = {}
        token = _served.set(served)  # tasks the request starts copy the context: they fill this same dict

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start" and any(served.values()):
                value = json.dumps(served, sort_keys=True, separators=(",", ":")).encode()
                message = {**message, "headers": [*message.get("headers", []), (CONTRACT_HEADER.encode(), value)]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_header)
        finally:
            _served.reset(token)
