"""The engine seam: what a stage server asks of the model it hosts.

One implementation per stage kind (`ar` on vLLM AsyncLLM, `diffusion` on diffusers, `generation` on a
torch module run chunk by chunk). The stage server only sees this interface, so the same server runs
every kind, and the router never knows which engine is behind a stage.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

from omni_runtime.spec import ResolvedPipeline, StageSpec
from omni_runtime.spec.image_bounds import ImageSizeBounds

__all__ = [
    "SELF_CHECK_ID",
    "Engine",
    "EngineError",
    "EngineInput",
    "EngineOutput",
    "InvalidRequest",
    "chunk_request_id",
    "refuse_unknown_params",
    "self_check",
]

log = logging.getLogger(__name__)

Payload = dict[str, Any]
"""Same value types as connectors' Payload: tensors, bytes, str, numbers, None, lists/dicts of those."""


class EngineError(RuntimeError):
    """The engine failed while running a request (a stage-side fault: 5xx to the client)."""


class InvalidRequest(ValueError):
    """The request cannot run on this engine (too long a prompt, bad size...): 4xx to the client.

    The message says what was wrong and what to change."""


def chunk_request_id(work_id: str, chunk_index: int) -> str:
    """The request id of the engine run for chunk `chunk_index` of work `work_id`, fed through a windowed
    edge to an engine that runs once per chunk (wire/PROTOCOL.md, "Ordering"). Unique per chunk; nothing
    reads the work back out of it (the stage keeps which run is its work's)."""
    return f"{work_id}#{chunk_index}"


def refuse_unknown_params(stage: str, params: dict[str, Any], known: Iterable[str]) -> None:
    """Raise InvalidRequest naming the parameters in `params` that this stage's engine does not read.

    An engine that drops a parameter it does not know gives the user something other than what was asked
    for without a word (a `min_p` sent to a talker that has none), so it is refused instead."""
    allowed = set(known)
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise InvalidRequest(
            f"stage {stage!r} does not take the parameter(s) {unknown}; it takes {sorted(allowed) or 'none'} "
            "(check sampling_params_list: one dict per stage, in topological order)"
        )


@dataclass
class EngineInput:
    """One unit of work for a stage.

    `data` holds the stage's inputs after the edge's input processor ran (the payload kinds of
    `processors.payloads`): for an entry AR stage `{"prompt": str}` or `{"messages": [...]}`, for a
    diffusion stage a `DiffusionPrompt` or `{"prompt_embeds": tensor, ...}`, for a talker a
    `TalkerInput`, for a codec decoder a `Code2WavInput`, for a VAE decode stage a `VaeInput`.
    `params` are the merged sampling parameters (stage defaults < request).
    `role` is "primary" or a companion role (e.g. "cfg_text"); a companion run by the same engine as
    its primary names that primary's `request_id` in `companion_of`. Engines match request ids whole
    (they never split one): what belongs together is said by `companion_of`, not by the id's shape.
    """

    request_id: str
    data: Payload
    params: dict[str, Any] = field(default_factory=dict)
    role: str = "primary"
    chunks: AsyncIterator[Payload] | None = None
    """Later input chunks of a streamed upstream edge (each already through the edge's input
    processor), ending after the producer's last one; `data` is the first chunk. Only set for
    engines with `streams_input`; None when the whole input is in `data`."""
    companion_of: str | None = None
    """The `request_id` of the primary this CFG companion runs beside (aborting that primary aborts this
    too); None for a primary."""
    group_size: int = 1
    """How many requests prefill together with this one: the primary and the CFG companions the router sent this
    stage for the same request (each as its own work, the companions naming the primary in `companion_of`)."""
    context_only: bool = False
    """The next stage reads only this request's context (an AR stage's KV cache after prefill): prefill, send
    the context, generate nothing. An engine that cannot export a context refuses it."""
    think: bool = False
    """With `context_only`: first write the reasoning (the primary's text output), then prefill the context with
    it appended (BAGEL's think mode, `wire.protocol.Submit.think`)."""


@dataclass
class EngineOutput:
    """A piece of a stage's output. An engine yields one or more; the last has `finished=True`.

    `data` is a payload kind of `processors.payloads`: for ar an `ArOutput` (deltas when streaming;
    the first piece also has `prompt_token_ids`); for a talker a `TalkerOutput` (`codes`); for a codec
    decoder (code2wav, token2wav) an `AudioOutput` (`audio`, `sample_rate`); for diffusion
    `{"images": [png bytes, ...]}` or a `LatentsOutput`; for a VAE decode stage `{"images": [...]}` with
    `chunk_index` and `num_chunks`.
    `usage` on the last output: `{"prompt_tokens": int, "completion_tokens": int}` where it applies.
    """

    request_id: str
    data: Payload
    finished: bool = False
    finish_reason: str | None = None
    usage: dict[str, int] | None = None


class Engine(ABC):
    """A loaded model serving one stage."""

    streams_input = False
    """True when one request can take its input in chunks while it runs (`EngineInput.chunks`):
    a talker fed the thinker's tokens step by step, a codec decoder fed codec windows. Otherwise a
    streamed edge runs the engine once per chunk."""

    failure: EngineError | None = None
    """Set once a part of the engine died while it served (a worker process): it takes no more work, and the
    stage server stops and exits with this error (see `fail`)."""

    _failure_event: asyncio.Event | None = None

    def __init__(self, pipeline: ResolvedPipeline, stage: StageSpec) -> None:
        self.pipeline = pipeline
        self.stage = stage

    def fail(self, error: EngineError) -> None:
        """Mark the engine dead with `error` (on the event loop's thread; the first error stays). The engine
        fails its requests with it; the stage server sees it (`failed`), stops taking work and exits non-zero
        with it as the termination message, so the pod restarts and its status says why."""
        if self.failure is None:
            self.failure = error
        self._failed_event().set()

    async def failed(self) -> EngineError:
        """Wait until the engine is marked dead (`fail`); its error."""
        await self._failed_event().wait()
        assert self.failure is not None, "fail() sets the failure before the event"
        return self.failure

    def _failed_event(self) -> asyncio.Event:
        if self._failure_event is None:
            self._failure_event = asyncio.Event()
        return self._failure_event

    @abstractmethod
    async def start(self) -> None:
        """Load the model. The stage reports ready only after this returns."""

    @abstractmethod
    def generate(self, request: EngineInput) -> AsyncIterator[EngineOutput]:
        """Run one request, yielding outputs as they come. Raise InvalidRequest or EngineError."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop a running request and free what it holds; unknown ids are ignored."""

    @abstractmethod
    async def stop(self) -> None:
        """Release the model and every resource (processes, memory)."""

    def stats(self) -> dict[str, float]:
        """Gauges for /metrics (queue depth, running requests...); engines add what they know."""
        return {}

    def voices(self) -> list[str]:
        """The speakers a request may name as `voice` (speech stages), once started; [] otherwise."""
        return []

    def image_bounds(self) -> ImageSizeBounds | None:
        """The image sizes this engine can draw, once started, where its model bounds them; None otherwise."""
        return None


SELF_CHECK_ID = "omnikube-self-check"
"""The request id of an engine's self-check (never one a router sends: its ids are random hex)."""


async def self_check(engine: Engine, request: EngineInput, what: str, hint: str) -> None:
    """Run `request` (one tiny request) through `engine.generate`, as every request runs, to its finished
    output, before the stage reports ready: a stage whose every request would fail never becomes ready.

    Raises EngineError saying what ran (`what`), what failed, and what to change (`hint`; for an
    InvalidRequest, that the stage's own args refuse it)."""
    started = time.monotonic()
    try:
        outs = [out async for out in engine.generate(request)]
        if not outs or not outs[-1].finished:
            raise EngineError(f"the engine ended the request after {len(outs)} outputs without a finished one")
    except Exception as exc:
        if isinstance(exc, InvalidRequest):
            hint = "the stage's engine_args or sampling_params refuse even this request; change them"
        raise EngineError(
            f"stage {engine.stage.name!r}: the self-check ({what}) failed, so every request would fail: "
            f"{type(exc).__name__}: {exc}; {hint}"
        ) from exc
    log.info("stage %s: self-check passed (%s in %.2fs)", engine.stage.name, what, time.monotonic() - started)
