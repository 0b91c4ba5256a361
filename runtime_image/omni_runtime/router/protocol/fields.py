"""Where an accepted OpenAI request field goes, as a typed declaration (`Forwarded`, one per field).

The router's checks (a field no planned stage can honour is a 400 naming it), its routing (which
fields a stage gets under their own names) and the field list's prose are all read from the same
declaration, so a field's destination is written once and never recovered from its description.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

__all__ = ["FieldRoute", "Forwarded", "by_name", "routed_to"]


class FieldRoute(Enum):
    """Which part of the pipeline honours a field; each value is the field list's text for it."""

    ROUTER = "the router"
    """The router acts on it (checks it, plans with it, shapes the reply)."""
    SAMPLING = "the sampling parameters of every AR stage the request runs"
    TEXT = "the AR stage that produces the reply's text (400 when the pipeline's text comes from no AR stage)"
    RENDER = "the prompt rendering of the entry AR stage (400 when the entry stage is not AR)"
    TOOL = (
        "the AR stage that renders the chat and produces the reply's text (400 when no stage is both): its chat "
        "template, vLLM's structured outputs for required/named, and its engine_args.tool_call_parser"
    )
    DIFFUSION = "the diffusion stages"


@dataclass(frozen=True)
class Forwarded:
    """One accepted field: where it goes, and what the field list says about it beyond that."""

    route: FieldRoute
    detail: str = ""
    """Said after the route's text (a bound, a second destination, how the router reads it)."""
    by_name: bool = True
    """The stage gets the field under its own name and value; False where the router derives what it
    sends from it (`max_completion_tokens` becomes `max_tokens`, `response_format` `structured_outputs`)."""
    needs_text: bool = False
    """Honoured only where a stage produces the reply's text, though the route is not `TEXT` (`echo`)."""

    @property
    def text_only(self) -> bool:
        """Only an AR stage producing the reply's text can honour it: a 400 on a request whose reply has none."""
        return self.route is FieldRoute.TEXT or self.needs_text

    @property
    def prose(self) -> str:
        """The field list's sentence: the route's text, then the detail."""
        return f"{self.route.value}: {self.detail}" if self.detail else self.route.value


def routed_to(fields: Mapping[str, Forwarded], route: FieldRoute) -> frozenset[str]:
    """The fields that `route` honours."""
    return frozenset(k for k, f in fields.items() if f.route is route)


def by_name(fields: Mapping[str, Forwarded], route: FieldRoute) -> tuple[str, ...]:
    """The fields that `route`'s stages get under their own names, in declaration order."""
    return tuple(k for k, f in fields.items() if f.route is route and f.by_name)
