"""Serving `POST /v1/completions`, `/tokenize` and `/detokenize` on the pipeline's AR text stage.

These need a stage that both takes the client's input and produces the reply's text, with the
model's tokenizer: the plan for `modalities: ["text"]` when it is that one AR stage (a text chat
model, Qwen-Omni's thinker). Any other pipeline answers 400 saying so. Tokenize and detokenize run on
that stage too (the router holds no tokenizer), as one short work each.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omni_runtime.router.errors import BadRequest, OmniError
from omni_runtime.router.orchestrator import PipelineRequest, StageEvent
from omni_runtime.router.plan import Plan, plan_request
from omni_runtime.router.protocol.chat import Usage
from omni_runtime.router.protocol.completions import (
    COMPLETION_REFUSED,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    TokenizeRequest,
)
from omni_runtime.router.serving.base import ManagedStream, ServingBase
from omni_runtime.router.serving.clock import RequestClock
from omni_runtime.router.serving.inputs import AR_FIELDS, normalize_messages, stage_params, text_params
from omni_runtime.router.serving.logprobs import completion_logprobs
from omni_runtime.spec import Modality, StageKind

__all__ = ["ServingCompletions"]


class ServingCompletions(ServingBase):
    endpoint = "/v1/completions"

    def text_plan(self, what: str) -> Plan:
        """The one-AR-stage plan that serves `what`; 400 naming why when the pipeline has none."""
        if "text" in self.producible():
            plan = plan_request(self.topology, ["text"])
            if len(plan.stages) == 1:
                (name,) = plan.stages
                if self.topology.stage(name).kind is StageKind.AR:
                    return plan
        texts = [s.name for s in self.topology.stages if s.final_output and s.output_modality is Modality.TEXT]
        raise BadRequest(
            f"{what} needs an AR stage that takes the prompt and produces the text; pipeline "
            f"{self.topology.name} (model `{self.ctx.model_name}`) has "
            + (f"text from {texts}, which needs upstream stages" if texts else "no text output")
            + "; use /v1/chat/completions",
        )

    async def create(self, body: CompletionRequest, raw: Request) -> Response:
        self.check_model(body.model)
        self.check_fields(body, COMPLETION_REFUSED)
        plan = self.text_plan("/v1/completions")
        self.check_n(body.n)
        self.check_max_tokens(body.max_tokens, "max_tokens")
        entry, prompt_text = _prompt(body)
        if body.echo and prompt_text is None:
            raise BadRequest("echo needs a text prompt (token ids cannot be echoed here); send the text", param="echo")
        if body.echo and body.logprobs is not None:
            raise BadRequest(
                "echo with logprobs asks for prompt logprobs, which this router does not serve; drop one of them",
                param="echo",
            )
        (stage,) = plan.stages
        ar = {k: getattr(body, k) for k in AR_FIELDS} | {"max_tokens": body.max_tokens}
        text = text_params(body)
        request_id = self.new_id("cmpl")
        requests = [
            PipelineRequest(
                request_id=request_id,
                plan=plan,
                entry={stage: entry},
                params=stage_params(self.topology, plan, ar=ar, image={}, text=text, choice=i),
                stream=body.stream,
                choice=i,
            )
            for i in range(body.n)
        ]
        echo = prompt_text if body.echo and prompt_text else ""
        clock = RequestClock(self.pipeline.name, self.endpoint)
        if body.stream:
            return await self._stream(body, request_id, requests, clock, echo)
        accs = {i: _Acc() for i in range(body.n)}

        def collect(event: StageEvent) -> None:
            accs[event.choice].fold(event)
            clock.saw(event)

        await self.run_to_end(raw, requests, collect)
        usage = _usage(accs.values())
        clock.done(usage.completion_tokens)
        choices = [
            CompletionChoice(
                index=i,
                text=echo + a.text,
                finish_reason=a.finish_reason,
                logprobs=completion_logprobs(a.token_ids, a.rows, body.logprobs, len(echo))
                if body.logprobs is not None
                else None,
            )
            for i, a in sorted(accs.items())
        ]
        response = CompletionResponse(id=request_id, model=body.model, choices=choices, usage=usage)
        return JSONResponse(response.model_dump(exclude_none=True))

    async def _stream(
        self, body: CompletionRequest, request_id: str, requests: list[PipelineRequest], clock: RequestClock, echo: str
    ) -> Response:
        stream = await self.open_stream(requests)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
        accs = {r.choice: _Acc() for r in requests}

        def chunk(choice: CompletionChoice) -> str:
            c = CompletionResponse(id=request_id, model=body.model, choices=[choice])
            if continuous:
                c.usage = _usage(accs.values())
            return f"data: {c.model_dump_json(exclude_none=True)}\n\n"

        async def body_iter() -> AsyncIterator[str]:
            try:
                async for event in stream:
                    clock.saw(event)
                    acc = accs[event.choice]
                    offset = len(echo) + len(acc.text)
                    first = not acc.started
                    acc.fold(event)
                    data = event.data or {}
                    piece = (echo if first else "") + str(data.get("text") or "")
                    logprobs = None
                    if body.logprobs is not None:
                        logprobs = completion_logprobs(
                            data.get("token_ids") or [], data.get("logprobs") or [], body.logprobs, offset
                        )
                    if piece or event.finished:
                        finish = acc.finish_reason if event.finished else None
                        yield chunk(CompletionChoice(index=event.choice, text=piece, logprobs=logprobs,
                                                     finish_reason=finish))  # fmt: skip
                usage = _usage(accs.values())
                clock.done(usage.completion_tokens)
                if include_usage:
                    final = CompletionResponse(id=request_id, model=body.model, choices=[], usage=usage)
                    yield f"data: {final.model_dump_json(exclude_none=True)}\n\n"
            except OmniError as err:
                yield self.error_event(err)
            yield "data: [DONE]\n\n"

        return ManagedStream(body_iter(), stream.close, media_type="text/event-stream")

    # -- tokenizer -----------------------------------------------------------------------------

    async def tokenize(self, body: TokenizeRequest, raw: Request) -> Response:
        self.check_model(body.model, required=False)
        if (body.prompt is None) == (body.messages is None):
            raise BadRequest("send either prompt (text) or messages (a chat), not both or neither", param="prompt")
        spec: dict[str, Any] = {"return_token_strs": body.return_token_strs}
        if body.prompt is not None:
            spec["prompt"] = body.prompt
        else:
            spec["messages"] = normalize_messages(body.messages or [])
            spec["add_generation_prompt"] = body.add_generation_prompt
            spec["continue_final_message"] = body.continue_final_message
            spec["chat_template_kwargs"] = body.chat_template_kwargs or {}
        if body.add_special_tokens is not None:
            spec["add_special_tokens"] = body.add_special_tokens
        out = await self._token_op("/tokenize", "tokenize", spec, raw)
        out.setdefault("token_strs", None)  # vLLM's shape: the key is there, null unless asked for
        return JSONResponse(out)

    async def detokenize(self, body: DetokenizeRequest, raw: Request) -> Response:
        self.check_model(body.model, required=False)
        return JSONResponse(await self._token_op("/detokenize", "detokenize", {"tokens": body.tokens}, raw))

    async def _token_op(self, route: str, op: str, spec: dict[str, Any], raw: Request) -> dict[str, Any]:
        plan = self.text_plan(route)
        (stage,) = plan.stages
        out: dict[str, Any] = {}

        def collect(event: StageEvent) -> None:
            out.update(event.data or {})

        request = PipelineRequest(request_id=self.new_id(op), plan=plan, entry={stage: {op: spec}})
        await self.run_to_end(raw, [request], collect)
        return {k: v for k, v in out.items() if k in _TOKEN_KEYS}


_TOKEN_KEYS = ("count", "max_model_len", "tokens", "token_strs", "prompt")


class _Acc:
    """One completion choice being assembled."""

    def __init__(self) -> None:
        self.text = ""
        self.token_ids: list[int] = []
        self.rows: list[list[list[Any]]] = []
        self.prompt_tokens = 0
        self.finish_reason: str | None = None
        self.started = False

    def fold(self, event: StageEvent) -> None:
        self.started = True
        data = event.data or {}
        self.text += str(data.get("text") or "")
        self.token_ids.extend(data.get("token_ids") or [])
        self.rows.extend(data.get("logprobs") or [])
        self.prompt_tokens = len(data.get("prompt_token_ids") or []) or self.prompt_tokens
        if event.usage:
            self.prompt_tokens = event.usage.get("prompt_tokens", self.prompt_tokens)
        if event.finished:
            self.finish_reason = event.finish_reason or "stop"


def _usage(accs: Any) -> Usage:
    accs = list(accs)
    prompt = max((a.prompt_tokens for a in accs), default=0)
    done = sum(len(a.token_ids) for a in accs)
    return Usage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)


def _prompt(body: CompletionRequest) -> tuple[dict[str, Any], str | None]:
    """The AR stage's input and the prompt's text (None for token ids)."""
    prompt: Any = body.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise BadRequest(
                f"prompt is a batch of {len(prompt)} texts; this router answers one prompt per request "
                "(use n for several choices, or send one request per prompt)",
                param="prompt",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt is empty; send at least one character", param="prompt")
        data: dict[str, Any] = {"prompt": prompt}
        text: str | None = prompt
    else:
        if not prompt:
            raise BadRequest("prompt is an empty list; send text or at least one token id", param="prompt")
        data, text = {"prompt_token_ids": list(prompt)}, None
    if not body.add_special_tokens:
        data["add_special_tokens"] = False
    return data, text
