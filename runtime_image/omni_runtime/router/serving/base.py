"""What every serving class shares: model checks, admission, the timeout, client-disconnect
cancellation, running the choices of a request, and streaming their events."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from omni_runtime.metrics import Router as M
from omni_runtime.router.admission import Admission
from omni_runtime.router.contract_header import record_contracts
from omni_runtime.router.errors import BadRequest, ClientGone, NotFound, OmniError, RequestTimedOut, error_body
from omni_runtime.router.lifecycle import Lifecycle
from omni_runtime.router.orchestrator import Orchestrator, PipelineRequest, RunResult, StageEvent
from omni_runtime.router.plan import Plan, chat_modalities, producible_modalities
from omni_runtime.router.pool import StagePool
from omni_runtime.router.protocol.chat import REFUSED, refused_fields, unknown_fields
from omni_runtime.router.serving.inputs import text_stages
from omni_runtime.spec import ResolvedPipeline, StageKind

__all__ = ["EventStream", "ManagedStream", "RouterContext", "ServingBase"]


@dataclass
class RouterContext:
    """What the serving classes work with; one per router process."""

    pipeline: ResolvedPipeline
    pool: StagePool
    orchestrator: Orchestrator
    admission: Admission
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    """Draining on SIGTERM: running requests get until the drain period ends."""

    @property
    def model_name(self) -> str:
        return self.pipeline.served_model_name


class ServingBase:
    endpoint = ""

    def __init__(self, ctx: RouterContext) -> None:
        self.ctx = ctx
        self.pipeline = ctx.pipeline
        self.topology = ctx.pipeline.topology
        self.limits = ctx.pipeline.limits

    # -- checks --------------------------------------------------------------------------------

    def check_model(self, model: str | None, *, required: bool = True) -> None:
        if model is None and not required:
            return
        names = {self.ctx.model_name, self.pipeline.name}
        if model not in names:
            raise NotFound(
                f"The model `{model}` does not exist. This server serves `{self.ctx.model_name}` (see GET /v1/models)",
                param="model",
            )

    def check_n(self, n: int) -> None:
        if n > self.limits.max_n:
            raise BadRequest(
                f"n is {n}; this pipeline answers at most {self.limits.max_n} choices per request "
                "(router.limits.maxN); ask for fewer, or send several requests",
                param="n",
            )

    def check_max_tokens(self, value: Any, param: str, where: str | None = None) -> None:
        """400 when `value` exceeds `router.limits.maxTokens`: `param` is the request field the error names,
        `where` the place in it the message names (`sampling_params_list[0].max_tokens`; default `param`)."""
        if isinstance(value, int) and not isinstance(value, bool) and value > self.limits.max_tokens:
            raise BadRequest(
                f"{where or param} is {value}; this pipeline generates at most {self.limits.max_tokens} tokens "
                "per request (router.limits.maxTokens); ask for fewer",
                param=param,
            )

    def check_fields(self, body: BaseModel, refused_list: dict[str, tuple[str, object]] = REFUSED) -> None:
        """400 naming a refused field (`protocol.chat.REFUSED` or the endpoint's list), or an unknown one
        unless the pipeline sets `router.unknownFields: ignore`."""
        refused = refused_fields(body, refused_list)
        if refused:
            name, reason = refused[0]
            raise BadRequest(f"{name} is not supported: {reason}", param=name)
        unknown = unknown_fields(body, refused_list)
        if unknown and self.limits.unknown_fields == "reject":
            raise BadRequest(
                f"unknown fields {unknown} in the request to {self.endpoint}; remove them (the fields this "
                "server accepts are in GET /openapi.json), or set router.unknownFields: ignore on the pipeline "
                "to have them ignored",
                param=unknown[0],
            )

    def check_text_fields(
        self, body: BaseModel, plan: Plan, text_only: Iterable[str], render_only: Iterable[str]
    ) -> None:
        """400 naming a set field that no planned stage can honour: one about the reply's text when no
        AR stage produces it (a DiT's image, a talker's audio), one about chat rendering when the entry
        stage is not AR."""
        set_fields = body.model_fields_set
        texts = text_stages(self.topology, plan)
        for name in sorted(set(text_only) & set_fields):
            if not texts and getattr(body, name) != type(body).model_fields[name].default:
                raise BadRequest(
                    f"{name} needs an AR stage producing the reply's text, and this request's final stages "
                    f"{plan.final} (pipeline {self.topology.name}) produce none; remove {name}"
                    + (" or ask for modalities ['text']" if "text" in self.producible() else ""),
                    param=name,
                )
        ar_entry = any(self.topology.stage(n).kind is StageKind.AR for n in plan.entry)
        for name in sorted(set(render_only) & set_fields):
            if not ar_entry:
                raise BadRequest(
                    f"{name} shapes the chat an AR stage renders, and this request's entry stages {plan.entry} "
                    f"(pipeline {self.topology.name}) render none; remove {name}",
                    param=name,
                )

    def check_stage_params(self, per_stage: list[dict[str, Any]] | None) -> None:
        """vLLM-Omni's `sampling_params_list` must not lift the limits the top-level fields obey."""
        for i, params in enumerate(per_stage or []):
            for key in ("max_tokens", "max_completion_tokens"):
                where = f"sampling_params_list[{i}].{key}"
                self.check_max_tokens((params or {}).get(key), "sampling_params_list", where)
            if isinstance((params or {}).get("n"), int):
                self.check_n(params["n"])

    def check_image_sizes(self, plan: Plan, params: dict[str, dict[str, Any]]) -> None:
        """400 when a planned diffusion stage is asked for a size its replicas say they cannot draw
        (`wire.Pong.image_bounds`, BAGEL's max_latent_size): before any stage works, not after the entry stage
        prefilled for it. A size not given is the stage's own default, which it draws."""
        for name in plan.stages:
            bounds = self.ctx.pool.image_bounds(name) if self.topology.stage(name).kind is StageKind.DIFFUSION else None
            width, height = params.get(name, {}).get("width"), params.get(name, {}).get("height")
            if bounds is None or not isinstance(width, int) or not isinstance(height, int):
                continue
            refusal = bounds.refusal(width, height, name)
            if refusal:
                raise BadRequest(refusal, param="size")

    def producible(self) -> list[str]:
        return producible_modalities(self.topology)

    def check_modalities(self, wanted: list[str] | None) -> list[str]:
        """The modalities a chat gets for `wanted` (`plan.chat_modalities`); BadRequest naming what cannot be."""
        can = self.producible()
        if wanted is None:
            return chat_modalities(self.topology, None)
        if not wanted:
            raise BadRequest(f"modalities is empty; use a subset of {can}", param="modalities")
        unknown = [m for m in wanted if m not in can]
        if unknown:
            raise BadRequest(
                f"modalities {unknown} cannot be produced by model `{self.ctx.model_name}` "
                f"(pipeline {self.topology.name}); it can produce {can}",
                param="modalities",
            )
        try:
            return chat_modalities(self.topology, list(dict.fromkeys(wanted)))
        except ValueError as err:
            raise BadRequest(str(err), param="modalities") from None

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    def error_event(self, err: OmniError) -> str:
        """A failure after a stream's 200 went out: counted like any error, and sent as the stream's last
        event in OpenAI's error shape (clients read it from the event's `error`)."""
        M.errors.labels(self.pipeline.name, self.endpoint, err.type).inc()
        return f"data: {json.dumps(error_body(err.message, err.type, err.status, err.param))}\n\n"

    # -- running -------------------------------------------------------------------------------

    async def run_choices(
        self, requests: list[PipelineRequest], emit: Callable[[StageEvent], Awaitable[None] | None]
    ) -> list[RunResult]:
        """Run every choice concurrently; the first failure cancels the others (each cleans up). The end
        of a shutdown's drain period cancels them all (RouterDraining, a retriable 503). All of them run in one
        generation of the pipeline, chosen here."""
        stages = list(dict.fromkeys(s for r in requests for s in r.plan.stages))
        generation = await self.ctx.lifecycle.bounded(self.ctx.pool.choose_generation(stages))
        record_contracts({s: generation.get(s, "") for s in stages})
        requests = [dataclasses.replace(r, generation=generation) for r in requests]
        tasks = [asyncio.create_task(self.ctx.orchestrator.run(r, emit)) for r in requests]
        try:
            return list(await self.ctx.lifecycle.bounded(asyncio.gather(*tasks)))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def timed_out(self) -> RequestTimedOut:
        t = self.limits.request_timeout_s
        return RequestTimedOut(
            f"the request did not finish within {t:g}s (router limit request_timeout_s); it was stopped "
            "in every stage. Ask for less work (fewer tokens, steps, images) or raise the limit"
        )

    async def run_to_end(
        self,
        raw: Request,
        requests: list[PipelineRequest],
        emit: Callable[[StageEvent], Awaitable[None] | None],
    ) -> list[RunResult]:
        """Admission, then every choice to its end, under the request timeout; cancelled when the
        client disconnects."""
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.limits.request_timeout_s):
                slot = await self.ctx.lifecycle.bounded(self.ctx.admission.acquire())
                try:
                    return await _until_disconnected(raw, self.run_choices(requests, emit))
                finally:
                    slot.release()
        except TimeoutError:
            raise self.timed_out() from None
        finally:
            M.e2el.labels(self.pipeline.name, self.endpoint).observe(time.monotonic() - started)

    async def open_stream(self, requests: list[PipelineRequest]) -> EventStream:
        """Admit and start the choices; returns once the first event is there, so that errors before
        any output (bad prompt, no replica) still get their HTTP status."""
        deadline = asyncio.get_running_loop().time() + self.limits.request_timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                slot = await self.ctx.lifecycle.bounded(self.ctx.admission.acquire())
        except TimeoutError:
            raise self.timed_out() from None
        stream = EventStream(self, requests, slot, deadline)
        try:
            await stream.prime()
        except BaseException:
            await stream.close()
            raise
        return stream


class EventStream:
    """The running choices of a streamed request and their final-output events."""

    def __init__(self, serving: ServingBase, requests: list[PipelineRequest], slot: Any, deadline: float):
        self.serving = serving
        self.slot = slot
        self.deadline = deadline
        self.started = time.monotonic()
        self.queue: asyncio.Queue[StageEvent] = asyncio.Queue()
        self.results: list[RunResult] = []
        self.task = asyncio.create_task(self._run(requests))
        self._first: StageEvent | None = None
        self._closed = False

    async def _run(self, requests: list[PipelineRequest]) -> None:
        self.results = await self.serving.run_choices(requests, self.queue.put_nowait)

    async def prime(self) -> None:
        self._first = await self._next()

    async def _next(self) -> StageEvent | None:
        try:
            async with asyncio.timeout_at(self.deadline):
                if not self.queue.empty():
                    return self.queue.get_nowait()
                getter = asyncio.ensure_future(self.queue.get())
                try:
                    await asyncio.wait({getter, self.task}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if not getter.done():
                        getter.cancel()
                if getter.done() and not getter.cancelled():
                    return getter.result()
                if not self.queue.empty():
                    return self.queue.get_nowait()
                self.task.result()  # raises the run's error
                return None
        except TimeoutError:
            raise self.serving.timed_out() from None

    async def __aiter__(self) -> AsyncIterator[StageEvent]:
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        while (event := await self._next()) is not None:
            yield event

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.slot.release()
        M.e2el.labels(self.serving.pipeline.name, self.serving.endpoint).observe(time.monotonic() - self.started)


class ManagedStream(StreamingResponse):
    """A streaming response that always runs `cleanup`, even when the client is gone before the body
    starts (Starlette then never iterates the body, so a generator's `finally` would not run)."""

    def __init__(self, content: Any, cleanup: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await asyncio.shield(self._cleanup())


async def _until_disconnected(raw: Request, work: Awaitable[Any]) -> Any:
    """Await `work`, cancelling it when the HTTP client disconnects (then raise ClientGone)."""
    task = asyncio.ensure_future(work)
    gone = False

    async def watch() -> None:
        nonlocal gone
        while not task.done():
            message = await raw.receive()
            if message["type"] == "http.disconnect":
                gone = True
                task.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if gone and not _cancelling():
            raise ClientGone("the client disconnected; the request was stopped in every stage") from None
        raise
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher


def _cancelling() -> bool:
    task = asyncio.current_task()
    return bool(task is not None and task.cancelling())
