"""A stage's replicas and least-outstanding-requests balancing over the usable ones."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar

from omni_runtime.router.errors import StageUnavailable

__all__ = ["Balanceable", "ReplicaSet"]


class Balanceable(Protocol):
    address: str
    outstanding: int

    @property
    def usable(self) -> bool: ...

    def describe(self) -> str: ...


R = TypeVar("R", bound=Balanceable)


class ReplicaSet(Generic[R]):
    """The replicas of one stage, by address."""

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self.replicas: dict[str, R] = {}
        self._turn = itertools.count()

    def pick(self, exclude: Iterable[str] = (), where: Callable[[R], bool] | None = None) -> R:
        """The usable replica (of those `where` accepts) with the fewest outstanding works; ties rotate, so
        equal replicas share.

        Raises StageUnavailable describing every replica when none is usable."""
        skip = set(exclude)
        usable = [r for a, r in self.replicas.items() if r.usable and a not in skip and (where is None or where(r))]
        if not usable:
            raise StageUnavailable(self._why_none() if where is None else self._why_none_of_generation())
        least = min(r.outstanding for r in usable)
        tied = sorted((r for r in usable if r.outstanding == least), key=lambda r: r.address)
        return tied[next(self._turn) % len(tied)]

    def usable(self) -> list[R]:
        return [r for r in self.replicas.values() if r.usable]

    def _why_none_of_generation(self) -> str:
        states = ", ".join(r.describe() for _, r in sorted(self.replicas.items()))
        return (
            f"stage {self.stage!r} has no ready replica of the pipeline generation this request runs in "
            f"({states}); retry shortly: a new request runs in a generation whose every stage is ready"
        )

    def _why_none(self) -> str:
        if not self.replicas:
            return (
                f"stage {self.stage!r} has no replicas (discovery lists none yet); "
                "retry shortly, or check that the stage's pods are running and ready"
            )
        states = ", ".join(r.describe() for _, r in sorted(self.replicas.items()))
        return f"stage {self.stage!r} has no ready replica ({states}); retry shortly"
