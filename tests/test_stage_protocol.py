"""The router <-> stage protocol encoding, and how the stage folds and counts engine outputs."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from omni_runtime.connectors import InlineHandle, MooncakeHandle, ShmHandle
from omni_runtime.stage import protocol as P
from omni_runtime.stage.outputs import count_items, merge, summarize


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
        P.Output(id="w", seq=0, info={"prompt": "x", "steps": 2}),
        P.Failed(id="w", kind="invalid_request", message="height 100 is not a multiple of 16"),
    ]
    for message in messages:
        decoded, rest = roundtrip(message)
        assert decoded == message and rest == []


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
