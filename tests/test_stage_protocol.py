"""The router <-> stage protocol encoding, and how the stage folds and counts engine outputs."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio
from servelib import EchoEngine, echo_cluster, echo_pipeline

from omni_runtime.connectors.inline import InlineHandle
from omni_runtime.connectors.mooncake import MooncakeHandle
from omni_runtime.connectors.shm import ShmHandle
from omni_runtime.spec import PipelineSpec, StageSpec
from omni_runtime.spec.image_bounds import ImageSizeBounds
from omni_runtime.stage.outputs import count_items, merge, summarize
from omni_runtime.wire import protocol as P
from omni_runtime.wire.auth import Channel


def roundtrip(message, payload=None):
    frames = P.encode(message, payload)
    assert all(isinstance(f, bytes | memoryview) for f in frames)
    # what a receiver sees: plain bytes per frame
    decoded, rest = P.decode([bytes(f) for f in frames])
    return decoded, rest


HANDLES = [
    InlineHandle(key="r1.primary.0", source="a", target="b", nbytes=5, header=b"\x81", frames=[b"abcd"]),
    ShmHandle(
        key="r1",
        source="a",
        target="b",
        nbytes=100,
        segment="omnikube-p-a-p1-0123456789abcdef",
        generation=3,
        layout=[10, 90],
    ),  # fmt: skip
    MooncakeHandle(key="r1", source="a", target="b", nbytes=64, store_key="omnikube/p/r1/a->b/x", layout=[64]),
]


@pytest.mark.parametrize("handle", HANDLES, ids=lambda h: h.kind.value)
def test_submit_with_handles_roundtrips(handle) -> None:
    submit = P.Submit(
        id="req.0.dit.primary",
        request_id="req",
        stage="dit",
        inputs=[P.Input(source="enhancer", role="cfg_text", seq=2, handle=handle)],
        input_processor="ar_text_to_prompt",
        more_inputs=True,
        params={"seed": 7, "height": 64},
        context={"negative_prompt": "blurry"},
        final=True,
        stream=True,
        edges=[P.EdgeOut(target="vae", connector="shm", window=4)],
    )
    decoded, rest = roundtrip(submit)
    assert decoded == submit and rest == []
    assert type(decoded.inputs[0].handle) is type(handle)


def test_inline_payload_travels_as_raw_frames() -> None:
    tensor = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    array = np.linspace(0, 1, 1000, dtype=np.float32)
    payload = {"prompt": "a cat", "t": tensor, "a": array, "png": b"\x89PNG" + bytes(70_000), "n": [1, 2]}
    message = P.Output(id="w", seq=3, data=True, finished=True, finish_reason="stop",
                       usage={"prompt_tokens": 2, "completion_tokens": 5})  # fmt: skip
    frames = P.encode(message, payload)
    # header, codec header, then one frame per tensor/array/large bytes value: nothing is pickled
    assert len(frames) == 2 + 3
    assert frames[3].nbytes == array.nbytes
    decoded, rest = P.decode([bytes(f) for f in frames])
    assert decoded == message
    out = P.payload_of(decoded, rest)
    assert out["prompt"] == "a cat" and out["n"] == [1, 2] and out["png"] == payload["png"]
    assert torch.equal(out["t"], tensor) and out["t"].dtype == torch.bfloat16
    assert np.array_equal(out["a"], array)


def test_every_message_type_roundtrips() -> None:
    messages = [
        P.Feed(id="w", inputs=[P.Input(source="a", handle=HANDLES[1], seq=5)], last=True),
        P.Abort(id="w", reason="client disconnected"),
        P.Release(handles=HANDLES),
        P.Ping(nonce=9, sent_at=12.5),
        P.Pong(nonce=9, sent_at=12.5, ready=True, stage="llm", running=3),
        P.Pong(nonce=9, ready=True, stage="dit", image_bounds=ImageSizeBounds(max_side=512, multiple=16)),
        P.Output(id="w", seq=0, info={"prompt": "x", "steps": 2}),
        P.Failed(id="w", kind="invalid_request", message="height 100 is not a multiple of 16"),
    ]
    for message in messages:
        decoded, rest = roundtrip(message)
        assert decoded == message and rest == []


def test_image_bounds_refuse_a_side_out_of_range_or_off_the_multiple_naming_what_to_send() -> None:
    bounds = ImageSizeBounds(max_side=128, multiple=16)
    assert bounds.refusal(128, 16, "dit") is None
    for width, height in ((144, 64), (64, 0), (64, 24)):
        refusal = bounds.refusal(width, height, "dit")
        assert refusal is not None and f"{width}x{height}" in refusal and "from 16 to 128 in multiples of 16" in refusal


def test_undecodable_header_is_a_protocol_error() -> None:
    with pytest.raises(P.ProtocolError, match="undecodable"):
        P.decode([b"\x00garbage"])
    with pytest.raises(P.ProtocolError, match="undecodable"):
        P.decode([msgspec.msgpack.encode({"type": "bogus", "id": "x"})])
    with pytest.raises(P.ProtocolError, match="empty"):
        P.decode([])


def test_data_flag_without_frames_is_a_protocol_error() -> None:
    decoded, rest = roundtrip(P.Output(id="w", seq=0, data=True))
    with pytest.raises(P.ProtocolError, match="no frames"):
        P.payload_of(decoded, rest)


def test_merge_folds_deltas_by_type() -> None:
    acc = None
    for piece in (
        {"text": "a ", "token_ids": [1], "audio": torch.zeros(1, 3), "codes": torch.ones(2, 4), "n": 1},
        {"text": "b", "token_ids": [2, 3], "audio": torch.ones(1, 2), "codes": torch.ones(1, 4), "n": 2},
    ):
        acc = merge(acc, piece)
    assert acc["text"] == "a b" and acc["token_ids"] == [1, 2, 3] and acc["n"] == 2
    assert acc["audio"].shape == (1, 5)  # time runs along the last axis of audio
    assert acc["codes"].shape == (3, 4)  # and along the first of everything else
    assert count_items(acc) == 3  # codes come first among item keys
    assert count_items({"token_ids": [1, 2]}) == 2
    assert count_items({"audio": np.zeros((2, 480))}) == 480
    assert count_items({"images": [b"x"]}) == 1
    assert summarize({"prompt": "p", "t": torch.ones(1), "k": 3}) == {"prompt": "p", "k": 3}


class RowsEngine(EchoEngine):
    """EchoEngine whose pieces also carry what a thinker sends its talker (hidden-state rows, media rows and
    shapes), as the `ar` engine's do with `hidden_state_layers` / `media_hidden_layer` on."""

    async def generate(self, request):
        async for out in super().generate(request):
            out.data.update(hidden_states={"0": torch.ones(1, 4)}, media_hidden_states=torch.ones(2, 4),
                            media_grids={"image_grid_thw": torch.tensor([[1, 2, 2]])})  # fmt: skip
            yield out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "folded"])
async def test_a_final_stage_sends_the_router_only_client_fields(stream: bool) -> None:
    """A thinker that is a final output and a talker's upstream (qwen2-5-omni): its pieces for the router carry
    its text and tokens, never the rows meant for the talker (the router must not receive tensors). Real stage
    server and ZeroMQ; the test speaks the router's side of the protocol."""
    topology = PipelineSpec(name="rows", stages=[StageSpec(name="thinker", kind="ar", final_output=True)], edges=[])
    async with echo_cluster(echo_pipeline(topology, name="rows"), engines={"thinker": RowsEngine}) as cluster:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{cluster.servers['thinker'][0].port}")
        channel = Channel(cluster.key, "router")
        try:
            await sock.send_multipart(channel.seal(P.encode(P.Hello())))
            welcome, _ = P.decode(channel.open(await asyncio.wait_for(sock.recv_multipart(), 10)))
            assert isinstance(welcome, P.Welcome)
            submit = P.Submit(id="r.0.thinker.primary", request_id="r", stage="thinker", data=True, final=True,
                              stream=stream)  # fmt: skip
            await sock.send_multipart(channel.seal(P.encode(submit, {"prompt": "the sea is wide"})))
            pieces = []
            while True:
                message, rest = P.decode(channel.open(await asyncio.wait_for(sock.recv_multipart(), 10)))
                if isinstance(message, P.Output) and message.data:
                    pieces.append(P.payload_of(message, rest))
                if isinstance(message, P.Failed):
                    pytest.fail(message.message)
                if isinstance(message, P.Output) and message.finished:
                    break
        finally:
            sock.close(0)
            ctx.term()
    assert len(pieces) == (4 if stream else 1), pieces
    assert all(set(p) == {"text", "token_ids"} for p in pieces), pieces
    assert "".join(p["text"] for p in pieces) == "the sea is wide "
