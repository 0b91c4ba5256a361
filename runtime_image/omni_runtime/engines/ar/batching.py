"""A primary and its CFG companions go to vLLM together (`CompanionGate`), so they prefill in one batch.

Each of them is its own `generate` call and renders its prompt on its own. Without a gate the first one
rendered reaches vLLM's engine core alone, which schedules it at once, and the others prefill a step later.
With the gate, each member of a group (a primary and the companions naming it, `EngineInput.companion_of`)
waits after rendering until every member the engine holds at that moment has rendered; they are then released
together and go to vLLM back to back, each knowing the group's size. vLLM's engine core may still read them
in two steps, so the KV route's connector (`kv_export.KvExportConnector`) holds a group's first arrivals
back until all its members are in the scheduler (at most `kv_export.GROUP_WAIT_S`); `kv_transfer_params`
carry the group to it.

A group whose size is known (`EngineInput.group_size`: the router says how many works of a request it sent this
stage) also waits until that many members joined, at most `JOIN_WAIT_S`: companions the router sent reach the
stage as works of their own, and one could render before the others are even in the engine. A member that
arrives after its group was handed over runs on its own (a group of one).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

__all__ = ["JOIN_WAIT_S", "CompanionGate"]

JOIN_WAIT_S = 2.0
"""Seconds a group waits for members it was told of that have not joined (lost on the way): then the members
there go on (the KV of a missing one fails the request downstream, naming its role)."""


@dataclass
class _Group:
    members: set[str] = field(default_factory=set)
    ready: set[str] = field(default_factory=set)
    size: int = 0
    expected: int = 1
    """Members the group waits for (the router's count; at least those that joined)."""
    released: asyncio.Event = field(default_factory=asyncio.Event)


class CompanionGate:
    """Holds each member of a primary's group until every member rendered (see the module docstring)."""

    def __init__(self) -> None:
        self._open: dict[str, _Group] = {}
        """Groups not handed over yet, by the primary's request id."""
        self._of: dict[str, _Group] = {}

    def join(self, request_id: str, primary: str, expected: int = 1) -> None:
        """`request_id` (the primary itself, or a companion of `primary`) is on its way: its group waits for it,
        and for `expected` members in all (the group's size as the router planned it)."""
        group = self._open.setdefault(primary, _Group())
        group.members.add(request_id)
        group.expected = max(group.expected, expected)
        self._of[request_id] = group

    async def ready(self, request_id: str) -> int:
        """`request_id` rendered its prompt: wait for the rest of its group; the group's size (members that go to
        vLLM together, itself included)."""
        group = self._of.get(request_id)
        if group is None:
            return 1
        group.ready.add(request_id)
        self._check(group)
        try:
            await asyncio.wait_for(group.released.wait(), JOIN_WAIT_S)
        except TimeoutError:  # a member it was told of never joined: go on with those that did
            group.expected = 0
            self._check(group)
            await group.released.wait()
        return group.size

    def leave(self, request_id: str) -> None:
        """`request_id` is done (or failed before it was ready): its group no longer waits for it."""
        group = self._of.pop(request_id, None)
        if group is None:
            return
        group.members.discard(request_id)
        group.ready.discard(request_id)
        self._check(group)
        if not group.members:  # everyone left before the group was handed over
            for key, open_group in list(self._open.items()):
                if open_group is group:
                    del self._open[key]

    def _check(self, group: _Group) -> None:
        if group.released.is_set() or not group.members or group.ready < group.members:
            return
        if len(group.members) < group.expected:  # the router sent more than have joined yet
            return
        group.size = len(group.ready)
        group.released.set()
        for key, open_group in list(self._open.items()):
            if open_group is group:
                del self._open[key]
