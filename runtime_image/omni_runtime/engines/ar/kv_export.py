"""A request's prompt KV cache out of vLLM after its prefill (the `ar` engine's `export_kv_cache`).

An AR -> DiT pipeline (BAGEL) needs, for the primary prompt and each CFG companion, every attention layer's
K and V once the prompt is prefilled. This module gets them out through vLLM's KV-connector interface:

- `KvExportConnector`, loaded by `kv_connector_module_path` (kv_role kv_producer), is told by the scheduler
  when a request finishes (`request_finished`; a request with max_tokens 1 finishes right after its
  prefill). For a request that finished normally (stop, length, repetition) it keeps the request's blocks
  (returns delay_free) and queues a send in the next step's metadata; an aborted or failed one, or one
  whose prompt was not fully computed, is freed at once and nothing is sent.
- On the worker, `get_finished` gathers the prompt tokens' K and V of every attention layer from the paged
  cache into contiguous (tokens, layers, kv_heads, head_dim) tensors in the cache dtype (K after rope, as
  vLLM stores it), PUSHes them over ZeroMQ to the socket `KvReceiver` binds in the stage process, and
  reports the request done, which frees the blocks.
- A message is `[request id, header json, K bytes, V bytes]`; the header names the shape, dtype, rope
  positions and the scheduler steps that computed the prompt (`prefill_steps`, so a caller can see that a
  primary and its companions ran in one batch). vLLM's internal request id is the caller's plus
  `-<8 chars>`; the receiver strips it (`hidden_states.split_request_id`). Messages of requests nobody
  opened (or already closed) are dropped.
- A primary and its companions prefill in one batch: the engine hands them to vLLM together
  (`batching.CompanionGate`) with `kv_transfer_params` naming their group and its size, and the
  connector's `get_num_new_matched_tokens` holds a group's members back (answers None: "not yet") until
  all of them are in the scheduler (`on_new_request`), at most GROUP_WAIT_S.

**Gathering exactly.** A layer's cache is the `[blocks, heads, tokens, content]` view vLLM hands connectors,
but what a backend keeps inside a block is its own: vLLM's CPU attention keeps each head's K column-major
(head_dim x tokens) for its VEC/VEC16 kernels and in VNNI tiles for AMX, with V after K in the same page.
Rather than copy those layouts, the connector learns each layer's by running the layer's own cache write
(`impl.do_kv_cache_update`) once on a scratch block with integer markers (`kv_layout.probe_block_layout`):
the position where every (token, head, dim) of K and V lands. The gather is an index into those positions,
exact on any backend whose write is a copy (a quantized cache, `kv_cache_dtype` fp8, is refused).
tests/test_kv_export.py checks it bit for bit on VEC, VEC16 and AMX.

The vLLM 0.32 internals this relies on (tests/test_kv_export.py fails when one changes):
`KVConnectorBase_V1` (`build_connector_meta`, `request_finished`, `get_finished`, `register_kv_caches`,
`_get_connector_metadata`, `on_new_request`, `get_num_new_matched_tokens` whose None skips a waiting
request for the step), `SamplingParams.extra_args["kv_transfer_params"]` becoming
`Request.kv_transfer_params`, the scheduler calling `request_finished(request, block_ids)` with the blocks of
the computed tokens before it frees them and freeing them when `finished_sending` names the request
(`Scheduler._connector_finished`, `_update_from_kv_xfer_finished`); `Request.{status, num_prompt_tokens,
num_computed_tokens}` and `RequestStatus`; `SchedulerOutput.{scheduled_new_reqs[].(req_id, prompt_token_ids,
num_computed_tokens), scheduled_cached_reqs.(req_ids, num_computed_tokens), num_scheduled_tokens}`;
`register_kv_caches` receiving the manager-block views `[blocks, heads, block_size, 2 * head_dim]`
(`allocate_kv_cache`); `KVCacheConfig.kv_cache_groups[].{layer_names, kv_cache_spec}` with
`FullAttentionSpec`; the attention layer in `static_forward_context` with `.impl.do_kv_cache_update(layer,
key, value, kv_cache, slot_mapping)` and its bound `.kv_cache`; `InputProcessor.assign_request_id`'s suffix.

Limits, each refused with a message when the engine starts: one connector per engine (not with the
hidden-state route), tensor and pipeline parallel size 1, no speculative decoding, text rope (no M-RoPE
models), full-attention layers only (no sliding window, MLA or state-space layers), `kv_cache_dtype` auto.
Async scheduling is turned off (vLLM's CPU build never runs it; not verified with this route).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from omni_runtime.engines.ar.hidden_states import split_request_id
from omni_runtime.engines.ar.kv_layout import BlockLayout, KvExportError, gather_blocks, probe_block_layout
from omni_runtime.processors.kv_cache import KvCachePayload, make_kv_payload

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = [
    "CONNECTOR_NAME",
    "GROUP_KEY",
    "GROUP_SIZE_KEY",
    "GROUP_WAIT_S",
    "KvDelivery",
    "KvExportConnector",
    "KvExportError",
    "KvReceiver",
    "add_to_engine_args",
    "group_params",
    "kv_message",
    "vllm_engine_args",
]

log = logging.getLogger(__name__)

CONNECTOR_NAME = "KvExportConnector"
ADDRESS_KEY = "omnikube_kv_address"
"""`kv_connector_extra_config` key: the ZeroMQ address the connector pushes KV to."""

GROUP_KEY = "omnikube_kv_group"
"""`kv_transfer_params` key: the primary's request id, shared by it and its companions."""
GROUP_SIZE_KEY = "omnikube_kv_group_size"
"""`kv_transfer_params` key: how many requests of the group the engine handed to vLLM together."""
GROUP_WAIT_S = 1.0
"""Longest a group's first arrival waits in vLLM's queue for the rest (they were sent in one turn of the event
loop; this only bounds a member lost on the way)."""

HISTORY = 256
"""Deliveries `KvReceiver.history` keeps (the newest)."""


def vllm_engine_args(address: str) -> dict[str, Any]:
    """The AsyncEngineArgs that turn the route on, pushing to `address`. Async scheduling is off: not verified
    with this route (vLLM's CPU build never runs it)."""
    return {
        "kv_transfer_config": {
            "kv_connector": CONNECTOR_NAME,
            "kv_connector_module_path": __name__,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {ADDRESS_KEY: address},
        },
        "async_scheduling": False,
    }


def add_to_engine_args(kwargs: Mapping[str, Any], address: str) -> dict[str, Any]:
    """`kwargs` (AsyncEngineArgs keys) with the route's args added; KvExportError when they already name a KV
    connector (vLLM runs one per engine: the hidden-state route's, or the user's)."""
    taken = kwargs.get("kv_transfer_config")
    if taken:
        name = taken.get("kv_connector") if isinstance(taken, Mapping) else getattr(taken, "kv_connector", taken)
        raise KvExportError(
            f"export_kv_cache needs vLLM's KV connector, which is already taken by {name!r} (one connector per "
            "engine: hidden_state_layers / media_hidden_layer use one); turn one of them off"
        )
    return {**kwargs, **vllm_engine_args(address)}


# --- engine-core side ------------------------------------------------------------------------------------


@dataclass
class _Send:
    req_id: str
    block_ids: list[int]
    num_tokens: int
    prefill_steps: tuple[int, int] | None


@dataclass
class KvExportMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step: the finished requests whose KV goes out now."""

    sends: list[_Send] = field(default_factory=list)


@dataclass
class _Gathering:
    """The members of one group that reached the scheduler (engine-core side)."""

    size: int
    since: float
    members: set[str] = field(default_factory=set)
    finished: set[str] = field(default_factory=set)

    def waiting(self) -> bool:
        """Whether members are still missing (and the wait for them has not run out)."""
        return len(self.members) < self.size and time.monotonic() - self.since < GROUP_WAIT_S


def _group_of(request: Request) -> tuple[str | None, int]:
    """(group, size) from a request's `kv_transfer_params` (None, 1 when it has no group)."""
    params = request.kv_transfer_params or {}
    group = params.get(GROUP_KEY)
    return (str(group), int(params.get(GROUP_SIZE_KEY, 1))) if group is not None else (None, 1)


def group_params(group: str, size: int) -> dict[str, Any]:
    """The `kv_transfer_params` that tell the connector a request belongs to `group` of `size` members."""
    return {GROUP_KEY: group, GROUP_SIZE_KEY: size}


@dataclass
class _Layer:
    name: str
    cache: torch.Tensor
    layout: BlockLayout | None = None


def _check_supported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> None:
    """Refuse what the route does not handle (see the module docstring), naming what to change."""
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise KvExportError(
            f"export_kv_cache runs with tensor_parallel_size 1 and pipeline_parallel_size 1, not "
            f"{parallel.tensor_parallel_size} and {parallel.pipeline_parallel_size} (each rank would hold part of "
            "the KV); set both to 1"
        )
    if vllm_config.speculative_config is not None:
        raise KvExportError("export_kv_cache cannot run with speculative_config; remove it")
    if vllm_config.model_config is not None and vllm_config.model_config.uses_mrope:
        raise KvExportError(
            "export_kv_cache sends text rope positions 0..n-1; this model uses M-RoPE, whose positions it does not "
            "export yet"
        )
    if str(vllm_config.cache_config.cache_dtype) != "auto":
        raise KvExportError(
            "export_kv_cache needs kv_cache_dtype auto (the model's dtype), not "
            f"{vllm_config.cache_config.cache_dtype!r}"
        )
    if kv_cache_config is None:
        return
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        plain = (
            type(spec) is FullAttentionSpec
            and spec.sliding_window is None
            and spec.attention_chunk_size is None
            and spec.head_size_v == spec.head_size
        )
        if not plain:
            raise KvExportError(
                f"export_kv_cache reads full-attention layers only; layers {group.layer_names[:3]}... have "
                f"{type(spec).__name__} (sliding window, chunked, MLA or state-space layers are not exported)"
            )


class KvExportConnector(KVConnectorBase_V1):
    """Sends each finished request's prompt KV out of the worker, then frees its blocks. Store-only: it never
    loads KV."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _check_supported(vllm_config, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._address = str(extra[ADDRESS_KEY])
        # scheduler side
        self._step = 0
        self._prompt_len: dict[str, int] = {}
        self._steps: dict[str, tuple[int, int]] = {}
        self._pending: list[_Send] = []
        self._groups: dict[str, _Gathering] = {}
        # worker side
        self._layers: list[_Layer] = []
        self._layouts: dict[tuple[Any, ...], BlockLayout] = {}
        self._sock: zmq.Socket | None = None

    # scheduler side --------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        group, size = _group_of(request)
        if group is not None and size > 1:
            self._groups.setdefault(group, _Gathering(size, time.monotonic())).members.add(request.request_id)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        group, _ = _group_of(request)
        gathering = self._groups.get(group) if group is not None else None
        if gathering is not None and gathering.waiting():
            return None, False  # "not yet": vLLM skips it this step, so the whole group prefills together
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._step += 1
        counts = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            if new.prompt_token_ids is not None:
                self._prompt_len[new.req_id] = len(new.prompt_token_ids)
            self._prefilled(new.req_id, new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if counts.get(rid):
                self._prefilled(rid, cached.num_computed_tokens[i])
        meta = KvExportMetadata(sends=self._pending)
        self._pending = []
        return meta

    def _prefilled(self, rid: str, computed: int) -> None:
        """Note that this step computes prompt tokens of `rid` (when it does)."""
        if computed < self._prompt_len.get(rid, computed + 1):
            first = self._steps.get(rid, (self._step, self._step))[0]
            self._steps[rid] = (first, self._step)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        steps = self._steps.pop(rid, None)
        self._prompt_len.pop(rid, None)
        group, _ = _group_of(request)
        if group is not None and (gathering := self._groups.get(group)) is not None:
            gathering.finished.add(rid)
            if gathering.finished >= gathering.members:
                del self._groups[group]
        done = request.status in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_REPETITION,
        )
        if not done or not block_ids or request.num_computed_tokens < request.num_prompt_tokens:
            return False, None  # aborted, failed, or never prefilled: free now, send nothing
        self._pending.append(_Send(rid, list(block_ids), int(request.num_prompt_tokens), steps))
        return True, None  # the blocks stay until the worker sent the KV (get_finished)

    # worker side -----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        groups = self._kv_cache_config.kv_cache_groups if self._kv_cache_config is not None else []
        names = [n for g in groups for n in g.layer_names]
        names = [n for n in names if n in kv_caches] or list(kv_caches)
        self._layers = [_Layer(n, kv_caches[n]) for n in sorted(names, key=extract_layer_index)]
        for layer in self._layers:
            if layer.cache.dim() != 4 or not layer.cache[0].is_contiguous():
                raise KvExportError(
                    f"{CONNECTOR_NAME}: layer {layer.name}'s KV cache is {tuple(layer.cache.shape)} with strides "
                    f"{layer.cache.stride()}; the route reads [blocks, heads, tokens, content] views whose blocks are "
                    "contiguous (a layer-compact KV cache layout)"
                )
        self._sock = zmq.Context.instance().socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 5000)
        self._sock.connect(self._address)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None  # the KV is read once the request finished (get_finished), not while it runs

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if not self.has_connector_metadata():
            return None, None
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvExportMetadata) or not meta.sends:
            return None, None
        done = set()
        for send in meta.sends:
            self._send(send)
            done.add(send.req_id)
        return done, None

    def _layout(self, layer: _Layer) -> BlockLayout:
        """The block layout of `layer`, learnt once per kind of layer (`probe_block_layout`)."""
        if layer.layout is not None:
            return layer.layout
        attn = self._vllm_config.compilation_config.static_forward_context.get(layer.name)
        impl = getattr(attn, "impl", None)
        if impl is None or not hasattr(impl, "do_kv_cache_update"):
            raise KvExportError(f"{CONNECTOR_NAME}: layer {layer.name} has no attention impl with do_kv_cache_update")
        bound = getattr(attn, "kv_cache", None)
        if not isinstance(bound, torch.Tensor) or tuple(bound.shape) != tuple(layer.cache.shape):
            shape = tuple(bound.shape) if isinstance(bound, torch.Tensor) else None
            raise KvExportError(
                f"{CONNECTOR_NAME}: layer {layer.name}'s kernel sees its KV cache as {shape}, the connector as "
                f"{tuple(layer.cache.shape)} (the backend splits vLLM's blocks); set block_size to the kernel's"
            )
        head_dim = int(impl.head_size)
        key = (type(impl), getattr(attn, "isa", None), tuple(layer.cache.shape[1:]), layer.cache.dtype, head_dim)
        if key not in self._layouts:

            def write(k: torch.Tensor, v: torch.Tensor, page: torch.Tensor, slots: torch.Tensor) -> None:
                impl.do_kv_cache_update(attn, k, v, page, slots)

            page_shape = (1, *layer.cache.shape[1:])
            self._layouts[key] = probe_block_layout(write, page_shape, head_dim, layer.cache.dtype, layer.cache.device)
        layer.layout = self._layouts[key]
        return layer.layout

    def _send(self, send: _Send) -> None:
        if self._sock is None:
            return
        keys, values = [], []
        for layer in self._layers:
            k, v = gather_blocks(layer.cache, self._layout(layer), send.block_ids, send.num_tokens)
            keys.append(k)
            values.append(v)
        # (tokens, layers, kv_heads, head_dim); text rope: positions 0..n-1 (M-RoPE models are refused)
        k_all, v_all = torch.stack(keys, dim=1), torch.stack(values, dim=1)
        frames = kv_message(send.req_id, k_all, v_all, list(range(send.num_tokens)), send.prefill_steps)
        self._sock.send_multipart(frames, copy=False)

    def shutdown(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def kv_message(
    req_id: str,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: list[int],
    prefill_steps: tuple[int, int] | None = None,
) -> list[Any]:
    """The frames of one KV message (see the module docstring): `keys` and `values` (tokens, layers, kv_heads,
    head_dim) as raw bytes, their shape, dtype and rope positions in the header."""
    keys, values = keys.cpu().contiguous(), values.cpu().contiguous()
    header = {
        "shape": list(keys.shape),
        "dtype": str(keys.dtype).removeprefix("torch."),
        "positions": positions,
        "next_position": max(positions) + 1 if positions else 0,
        "prefill_steps": list(prefill_steps) if prefill_steps else None,
    }
    return [req_id.encode(), json.dumps(header).encode(), _raw(keys), _raw(values)]


def _raw(tensor: torch.Tensor) -> Any:
    """The bytes of a contiguous CPU tensor, without a copy (numpy has no bfloat16: viewed as bytes)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


# --- stage-process side ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class KvDelivery:
    """One KV payload that reached an open request: what the logs and metrics read."""

    request_id: str
    seq_len: int
    nbytes: int
    prefill_steps: tuple[int, int] | None
    """The engine steps (first, last) whose batches computed the prompt: a primary and companions that ran in one
    batch share them."""


class KvReceiver:
    """Binds the socket the connector pushes to and hands each open request its `KvCachePayload`.

    `open(request_id)` before the request goes to vLLM, `await get(request_id, timeout)` once it finished,
    `close(request_id)` when done with it (also after an abort). KV of requests nobody opened, or already
    closed, is dropped. `model` is the fingerprint stamped on payloads (`processors.kv_cache`)."""

    def __init__(self, address: str | None = None, model: str = "") -> None:
        self._dir = tempfile.mkdtemp(prefix="omnikube-kv-") if address is None else None
        self.address = address or f"ipc://{self._dir}/{uuid.uuid4().hex[:12]}.sock"
        self.model = model
        self.history: deque[KvDelivery] = deque(maxlen=HISTORY)
        """The newest deliveries, oldest first."""
        self._waiting: dict[str, asyncio.Future[KvCachePayload]] = {}
        self._sock: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        import zmq.asyncio

        self._sock = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.address)
        self._task = asyncio.create_task(self._run(), name="kv-export")

    def open(self, request_id: str) -> None:
        """Expect the KV of `request_id` (replacing an earlier expectation of the same id)."""
        self._waiting[request_id] = asyncio.get_running_loop().create_future()

    def close(self, request_id: str) -> None:
        """Stop expecting `request_id`: its KV, if it comes, is dropped."""
        future = self._waiting.pop(request_id, None)
        if future is not None and not future.done():
            future.cancel()

    def open_requests(self) -> frozenset[str]:
        """The requests whose KV is expected now."""
        return frozenset(self._waiting)

    async def get(self, request_id: str, timeout: float) -> KvCachePayload:
        """The KV of `request_id`, then closes it. Raises TimeoutError when it does not come within `timeout`
        seconds, KvExportError when it was never opened or its message was malformed."""
        future = self._waiting.get(request_id)
        if future is None:
            raise KvExportError(f"the KV of request {request_id!r} was never opened (or already taken)")
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(future)
        finally:
            self.close(request_id)

    async def _run(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=True)
            rid = split_request_id(frames[0].decode(errors="replace"))
            future = self._waiting.get(rid)
            if future is None or future.done():
                continue  # nobody waits for it (a request closed, aborted or never opened)
            try:
                payload, delivery = self._payload(rid, frames)
            except (KvExportError, ValueError, KeyError, TypeError) as exc:  # our own peer; never expected
                future.set_exception(KvExportError(f"the KV message of request {rid!r} is malformed: {exc}"))
                continue
            self.history.append(delivery)
            future.set_result(payload)

    def _payload(self, rid: str, frames: list[bytes]) -> tuple[KvCachePayload, KvDelivery]:
        if len(frames) != 4:
            raise KvExportError(f"{len(frames)} frames, not 4")
        header = json.loads(frames[1])
        shape = tuple(int(n) for n in header["shape"])
        dtype = getattr(torch, str(header["dtype"]))
        if not isinstance(dtype, torch.dtype):
            raise KvExportError(f"dtype {header['dtype']!r} is not a torch dtype")
        size = math.prod(shape) * dtype.itemsize
        arrays = []
        for data in frames[2:]:
            if len(data) != size:
                raise KvExportError(f"{len(data)} bytes, not shape {shape} {header['dtype']}")
            empty = torch.empty(shape, dtype=dtype)
            arrays.append(torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape) if size else empty)
        payload = make_kv_payload(arrays[0], arrays[1], model=self.model, positions=header["positions"],
                                  next_position=header["next_position"])  # fmt: skip
        steps = header.get("prefill_steps")
        delivery = KvDelivery(rid, shape[0], 2 * size, (int(steps[0]), int(steps[1])) if steps else None)
        return payload, delivery

    async def stop(self) -> None:
        for rid in list(self._waiting):
            self.close(rid)
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
