"""The markers a payload kind's fields carry (`processors.payloads` declares the kinds with them): the layout of an
array field, the field that counts a piece's items, and the fields that go to the next stage only.

A module of its own so that payload kinds declared beside `payloads` (`processors.kv_cache`) use the same markers
and `payloads` can still list them among `PAYLOAD_KINDS`. Importing it imports neither torch nor numpy.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

__all__ = ["Array", "DtypeKind", "Items", "Layout", "downstream_only"]

Array = Any
"""A torch tensor or a numpy array (connectors hand back either); Any, so importing this needs no torch."""


class DtypeKind(enum.Enum):
    """The kind of number an array field holds (its exact width is the producer's)."""

    INT = "integer"
    FLOAT = "floating point"


@dataclass(frozen=True)
class Layout:
    """The shapes an array field may have, as axis names (time first), and the kind of its numbers."""

    shapes: tuple[tuple[str, ...], ...]
    dtype: DtypeKind

    def describe(self) -> str:
        """The accepted shapes as a reader writes them: `(frames,) or (frames, codebooks)`."""
        return " or ".join(f"({', '.join(axes)}{',' if len(axes) == 1 else ''})" for axes in self.shapes)


@dataclass(frozen=True)
class Items:
    """Marks the field whose length counts a piece's items on a windowed edge, along `axis` of an array."""

    axis: int = 0


@dataclass(frozen=True)
class _DownstreamOnly:
    """Marks a field that an engine output carries for the next stage only, never for the client."""


downstream_only = _DownstreamOnly()
