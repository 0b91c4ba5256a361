"""Hidden-state rows out of a running vLLM request, step by step (the `ar` engine's `hidden_state_layers`).

vLLM 0.32 returns no hidden states from a generate request. This module gets them out while the
request runs, the route measured in `research/speech-pipeline.md` section 1:

- vLLM's `extract_hidden_states` speculative method (`num_speculative_tokens` 1) makes the model
  return the residual stream before the layers asked (`eagle_aux_hidden_state_layer_ids`; id k is HF
  `output_hidden_states[k]`: 0 the embeddings, k the output of layer k-1, the last id N the output
  of the last layer *before* the final norm), and its drafter writes those rows into a cache-only
  attention layer, one row per computed position, in the KV pool of a group of its own.
- `HiddenStatesConnector`, a KV connector loaded by `kv_connector_module_path`, reads the rows of
  that layer after each step and PUSHes them over ZeroMQ to the socket `RowReceiver` binds in the
  stage process. Scheduler side (`build_connector_meta`): per scheduled request its new block ids
  in the hidden-state group and `upto = num_computed + num_scheduled - num_draft` (the draft
  position's row is only valid if the draft is accepted; an accepted one is sent the next step).
  `request_finished` holds the blocks and queues a final flush up to `num_computed_tokens`. Worker
  side: `wait_for_save` (which vLLM defers, with speculative decoding, until the drafter wrote the
  rows) sends rows `[cursor, upto)`; `get_finished` sends the final flush and frees the blocks.
- A message is `[request id, header json {start, end, final}, float32 rows (end-start, layers, H)]`.
  vLLM's internal request id is the caller's id plus `-<8 chars>`; `RowReceiver` strips it.

Row i of a request belongs to token i of `prompt_token_ids + generated token_ids`: the token that
was the *input* at position i. The last sampled token never is an input, so it has no row.

The vLLM 0.32 internals this relies on (tests/test_hidden_states.py fails when one changes):
`KVConnectorBase_V1` and `SupportsHMA` (`build_connector_meta`, `request_finished_all_groups`,
`wait_for_save`, `get_finished`, `get_finished_count`, `register_kv_caches`, `_get_connector_metadata`),
`SchedulerOutput.scheduled_new_reqs[].{req_id, block_ids, num_computed_tokens}`,
`.scheduled_cached_reqs.{req_ids, new_block_ids, num_computed_tokens, resumed_req_ids}`,
`.num_scheduled_tokens`, `.scheduled_spec_decode_tokens`; `HiddenStateCacheSpec` marking the
cache-only group and its layout `[blocks, layers, block_size, hidden]` (`CacheOnlyAttentionLayer`,
`basic_cache`); the GPU/CPU model runner deferring `wait_for_save` until after the drafter when a
speculative config is set; `EagleModelMixin._set_aux_hidden_state_layers` sorting the layer ids;
`InputProcessor.assign_request_id`'s `-<8 chars>` suffix.

Costs: one extra (draft) token per request per decode step (a step may then give two tokens, when
the draft -- always the token just sampled -- is right), a cache row per layer per token in the KV
pool, min_p / logit_bias refused (`AREngine` answers 400: speculative decoding would skip them), no
other speculative method at the same time. Prefix caching and async scheduling are turned off (see
`vllm_engine_args`). On CPU, sampled requests need `vllm_plugins.expand_kernel` (vLLM's stand-in is broken).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = [
    "CONNECTOR_NAME",
    "HiddenStatesConnector",
    "HiddenStatesError",
    "RowReceiver",
    "RowStream",
    "split_request_id",
    "vllm_engine_args",
]

log = logging.getLogger(__name__)

CONNECTOR_NAME = "HiddenStatesConnector"
ADDRESS_KEY = "omnikube_rows_address"
"""`kv_connector_extra_config` key: the ZeroMQ address the connector pushes rows to."""

LAYERS_KEY = "omnikube_layers"


class HiddenStatesError(RuntimeError):
    """Rows of a request were lost or came out of order (a fault of the route, never of the input)."""


def vllm_engine_args(layers: Sequence[int], address: str) -> dict[str, Any]:
    """The AsyncEngineArgs that turn the route on: extract `layers` (sorted, unique) and push them to
    `address`. Prefix caching and async scheduling are off: neither is verified with this route."""
    ids = sorted(set(int(i) for i in layers))
    return {
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}},
        },
        "kv_transfer_config": {
            "kv_connector": CONNECTOR_NAME,
            "kv_connector_module_path": __name__,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {ADDRESS_KEY: address, LAYERS_KEY: ids},
        },
        "enable_prefix_caching": False,
        "async_scheduling": False,
    }


def split_request_id(internal_id: str) -> str:
    """The caller's request id from vLLM's internal one (`<id>-<8 random chars>`)."""
    head, sep, tail = internal_id.rpartition("-")
    return head if sep and len(tail) == 8 else internal_id


# --- engine-core side ----------------------------------------------------------------------------


@dataclass
class _Step:
    req_id: str
    new_blocks: list[int] | None
    replace_blocks: bool
    upto: int


@dataclass
class HiddenStatesMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    steps: list[_Step] = field(default_factory=list)
    finals: dict[str, int] = field(default_factory=dict)
    """Finished requests: rows are flushed up to this position, then the blocks are freed."""


@dataclass
class _Tracked:
    blocks: list[int] = field(default_factory=list)
    cursor: int = 0


def _hidden_group(kv_cache_config: KVCacheConfig | None) -> int:
    """Index of the KV cache group that holds the cache-only hidden-state layer."""
    if kv_cache_config is None:
        return 0
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    groups = kv_cache_config.kv_cache_groups
    ids = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
    if not ids and len(groups) == 1:  # every layer in one group (uniform specs): the rows share its blocks
        return 0
    if len(ids) != 1:
        raise ValueError(
            f"{CONNECTOR_NAME}: expected one hidden-state KV cache group, found {len(ids)} among "
            f"{len(groups)} groups; it needs speculative_config method 'extract_hidden_states'"
        )
    return ids[0]


class HiddenStatesConnector(KVConnectorBase_V1, SupportsHMA):
    """Pushes each running request's hidden-state rows out of the worker after every step.

    Store-only: it never loads KV. Only tensor-parallel rank 0 sends (every rank holds the rows)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        spec = vllm_config.speculative_config
        if spec is None or spec.method != "extract_hidden_states":
            raise ValueError(f"{CONNECTOR_NAME} needs speculative_config method 'extract_hidden_states'")
        self._group = _hidden_group(kv_cache_config)
        self._block_size = (
            kv_cache_config.kv_cache_groups[self._group].kv_cache_spec.block_size
            if kv_cache_config is not None
            else vllm_config.cache_config.block_size
        )
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._address = str(extra[ADDRESS_KEY])
        # scheduler side
        self._scheduled: set[str] = set()
        self._finals: dict[str, int] = {}
        # worker side
        self._tracked: dict[str, _Tracked] = {}
        self._kv: torch.Tensor | None = None
        self._rank0 = True
        self._sock: zmq.Socket | None = None

    # scheduler side --------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = HiddenStatesMetadata(finals=self._finals)
        self._finals = {}
        drafts = scheduler_output.scheduled_spec_decode_tokens
        counts = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            rid = new.req_id
            self._scheduled.add(rid)
            upto = new.num_computed_tokens + counts[rid] - len(drafts.get(rid, ()))
            meta.steps.append(_Step(rid, list(new.block_ids[self._group]), True, upto))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[i]
            upto = cached.num_computed_tokens[i] + counts[rid] - len(drafts.get(rid, ()))
            replace = rid in cached.resumed_req_ids  # after preemption vLLM sends the whole block list
            new_blocks = list(blocks[self._group]) if blocks is not None else None
            meta.steps.append(_Step(rid, new_blocks, replace, upto))
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        if rid not in self._scheduled:  # aborted before it ever ran: no rows, nothing to hold
            return False, None
        self._scheduled.discard(rid)
        self._finals[rid] = int(request.num_computed_tokens)
        return True, None  # hold the blocks until the worker flushed the last rows

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, list(block_ids[self._group]) if block_ids else [])

    def get_finished_count(self) -> int:
        return 1  # only rank 0 reports sends done

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return "LBNHC"  # one token's rows of all layers together, as `basic_cache` writes them

    # worker side -----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        self._rank0 = get_tensor_model_parallel_rank() == 0
        layers = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(layers) != 1:
            raise ValueError(f"{CONNECTOR_NAME}: expected one cache-only hidden-state layer, found {layers}")
        self._kv = kv_caches[layers[0]]
        if self._kv.shape[2] != self._block_size:
            raise ValueError(
                f"{CONNECTOR_NAME}: hidden-state cache has block size {self._kv.shape[2]}, "
                f"the group says {self._block_size}; the layout vLLM writes changed"
            )
        if self._rank0:
            self._sock = zmq.Context.instance().socket(zmq.PUSH)
            self._sock.setsockopt(zmq.LINGER, 5000)
            self._sock.connect(self._address)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # the drafter already wrote the rows into the cache-only layer

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, HiddenStatesMetadata):
            return
        for step in meta.steps:
            tracked = self._tracked.setdefault(step.req_id, _Tracked())
            if step.replace_blocks:
                tracked.blocks = list(step.new_blocks or [])
            elif step.new_blocks:
                tracked.blocks.extend(step.new_blocks)
            self._send(step.req_id, tracked, step.upto, final=False)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if not self.has_connector_metadata():
            return None, None
        meta = self._get_connector_metadata()
        if not isinstance(meta, HiddenStatesMetadata) or not meta.finals:
            return None, None
        done = set()
        for rid, upto in meta.finals.items():
            tracked = self._tracked.pop(rid, _Tracked())
            self._send(rid, tracked, upto, final=True)
            done.add(rid)
        return (done if self._rank0 else None), None

    def _send(self, rid: str, tracked: _Tracked, upto: int, final: bool) -> None:
        start, end = tracked.cursor, max(tracked.cursor, upto)
        if self._sock is None or self._kv is None:
            return
        if end == start and not final:
            return
        positions = torch.arange(start, end, dtype=torch.long)
        blocks = torch.tensor(tracked.blocks, dtype=torch.long)
        slots = blocks[positions // self._block_size]
        rows = self._kv[slots.to(self._kv.device), :, (positions % self._block_size).to(self._kv.device)]
        payload = rows.to(device="cpu", dtype=torch.float32).contiguous().numpy()
        header = json.dumps({"start": start, "end": end, "final": final}).encode()
        self._sock.send_multipart([rid.encode(), header, payload.tobytes()], copy=False)
        tracked.cursor = end

    def shutdown(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


# --- stage-process side --------------------------------------------------------------------------


class RowStream:
    """The rows of one request as they arrive: `take()` gives those not yet taken."""

    def __init__(self, layers: Sequence[int], hidden_size: int) -> None:
        self.layers = list(layers)
        self.hidden_size = hidden_size
        self._parts: list[np.ndarray] = []
        self.received = 0
        """Rows received so far (positions [0, received))."""
        self.taken = 0
        self.final = False
        self.error: str | None = None
        self._changed = asyncio.Event()

    def _add(self, start: int, end: int, final: bool, data: bytes) -> None:
        if start != self.received:
            self.error = f"rows [{start}, {end}) arrived after {self.received} rows; rows were lost"
        else:
            shape = (end - start, len(self.layers), self.hidden_size)
            if len(data) != int(np.prod(shape)) * 4:
                self.error = f"rows [{start}, {end}) carry {len(data)} bytes, not shape {shape} float32"
            elif end > start:
                self._parts.append(np.frombuffer(data, dtype=np.float32).reshape(shape))
                self.received = end
        self.final = self.final or final
        self._changed.set()

    async def wait_for(self, rows: int, timeout: float) -> None:
        """Until `rows` rows arrived (or the final flush); raises HiddenStatesError on a gap or timeout."""
        async with asyncio.timeout(timeout):
            while self.received < rows and not self.final and self.error is None:
                self._changed.clear()
                await self._changed.wait()
        if self.error is not None:
            raise HiddenStatesError(self.error)

    async def wait_final(self, timeout: float) -> None:
        """Until the final flush arrived; raises HiddenStatesError on a gap or timeout."""
        async with asyncio.timeout(timeout):
            while not self.final and self.error is None:
                self._changed.clear()
                await self._changed.wait()
        if self.error is not None:
            raise HiddenStatesError(self.error)

    def take(self) -> dict[str, torch.Tensor] | None:
        """Rows not taken yet, as `{str(layer): float32 tensor (rows, hidden)}`; None when none."""
        if not self._parts:
            return None
        rows = np.concatenate(self._parts, axis=0) if len(self._parts) > 1 else self._parts[0]
        self._parts = []
        self.taken += rows.shape[0]
        tensor = torch.from_numpy(rows.copy())
        return {str(layer): tensor[:, i, :].contiguous() for i, layer in enumerate(self.layers)}


class RowReceiver:
    """Binds the socket the connector pushes to and hands each request's rows to its `RowStream`.

    Rows of requests nobody `open`ed (companions, requests already closed) are dropped."""

    def __init__(self, layers: Sequence[int], hidden_size: int, address: str | None = None) -> None:
        self.layers = sorted(set(int(i) for i in layers))
        self.hidden_size = hidden_size
        self._dir = tempfile.mkdtemp(prefix="omnikube-rows-") if address is None else None
        self.address = address or f"ipc://{self._dir}/{uuid.uuid4().hex[:12]}.sock"
        self._streams: dict[str, RowStream] = {}
        self._sock: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        import zmq.asyncio

        self._sock = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.address)
        self._task = asyncio.create_task(self._run(), name="hidden-state-rows")

    def open(self, request_id: str) -> RowStream:
        stream = RowStream(self.layers, self.hidden_size)
        self._streams[request_id] = stream
        return stream

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def _run(self) -> None:
        while True:
            rid_b, header_b, data = await self._sock.recv_multipart(copy=True)
            try:
                header = json.loads(header_b)
                rid = split_request_id(rid_b.decode())
                stream = self._streams.get(rid)
                if stream is not None:
                    stream._add(int(header["start"]), int(header["end"]), bool(header["final"]), data)
            except (ValueError, KeyError, UnicodeDecodeError) as exc:  # our own peer; never expected
                log.error("dropped a malformed hidden-state message: %s", exc)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._dir is not None:
            with contextlib.suppress(OSError):
                for name in os.listdir(self._dir):
                    os.unlink(os.path.join(self._dir, name))
                os.rmdir(self._dir)
