"""The router <-> stage protocol: msgspec msgpack messages over ZeroMQ, payload tensors as raw frames.

One ZeroMQ multipart message is `[auth, header, *frames]` (a ROUTER socket adds the peer identity in
front). `auth` proves the message comes from this pipeline's router or stage (`wire.auth`: HMAC-SHA256
with the pipeline key, per-connection sessions and counters); `encode`/`decode` here handle what follows
it. `header` is one of the tagged structs below, msgpack-encoded; `frames` are the raw frames of the one
payload the message carries (`Submit.data`, `Output.data`), produced by `connectors.codec`. Handles
travel inside the header, as any handle class a connector kind declares (`connectors.AnyHandle`): an
inline handle carries its bytes there, the others a few hundred bytes of addressing. PROTOCOL.md next to
this file is the prose version.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from omni_runtime.connectors import AnyHandle
from omni_runtime.connectors.codec import decode_payload, encode_payload
from omni_runtime.spec.image_bounds import ImageSizeBounds

__all__ = [
    "PROTOCOL_VERSION",
    "Abort",
    "Draining",
    "EdgeOut",
    "ErrorKind",
    "Failed",
    "Feed",
    "Hello",
    "Input",
    "Message",
    "Output",
    "Ping",
    "Pong",
    "ProtocolError",
    "Release",
    "Submit",
    "Welcome",
    "decode",
    "encode",
    "payload_of",
]

PROTOCOL_VERSION = 2
"""2: every message starts with an auth frame (`wire.auth`); Hello/Welcome open a connection."""

ErrorKind = Literal["invalid_request", "engine_error", "connector_error", "unavailable", "protocol_error"]
"""`invalid_request` maps to 4xx (the client must change the request); every other kind to 5xx."""


class ProtocolError(ValueError):
    """A message that cannot be decoded, or one that breaks the protocol's rules."""


class Input(msgspec.Struct, frozen=True, kw_only=True):
    """One upstream output delivered to a stage as a connector handle."""

    source: str
    """Upstream stage that produced it."""
    role: str = "primary"
    """Role of the upstream work ("primary" or a companion role such as "cfg_text")."""
    seq: int = 0
    """Orders the chunks of a windowed edge (increasing); whole outputs have one handle."""
    last: bool = True
    """The producer's last handle for this edge (chunks before it say False)."""
    handle: AnyHandle


class EdgeOut(msgspec.Struct, frozen=True, kw_only=True):
    """A downstream edge the stage must produce handles for."""

    target: str
    connector: str
    """Connector kind (`spec.ConnectorKind`): inline, shm or mooncake."""
    window: int = 0
    """Items per chunk handle; 0 puts one handle with the whole output at the end."""
    first_window: int = 0
    """Items in the first chunk handle when > 0 (and a window applies); later ones hold `window`."""


class Submit(msgspec.Struct, frozen=True, kw_only=True, tag="submit"):
    """Router -> stage: start one unit of work."""

    id: str
    """Work id, unique per router over time: `<request id>.<choice>.<stage>.<role>`."""
    request_id: str
    stage: str
    role: str = "primary"
    data: bool = False
    """True when the message frames carry an inline payload (entry stages: prompt, messages...)."""
    inputs: list[Input] = []
    """Upstream outputs as handles; the stage `get`s and `release`s every one of them."""
    input_processor: str = "identity"
    """Name of the edge's input processor applied to `inputs` before the engine sees them."""
    more_inputs: bool = False
    """True when more input chunks follow in `Feed` messages (windowed upstream edge)."""
    params: dict[str, Any] = {}
    """Request sampling parameters; merged over the stage's defaults by the stage."""
    context: dict[str, Any] = {}
    """Client request fields the input processor may use (e.g. `negative_prompt`)."""
    final: bool = False
    """Send engine outputs back inline (`Output.data`): the client sees this stage's output."""
    stream: bool = False
    """With `final`: send every engine output as it comes (deltas); else only merged at the end."""
    edges: list[EdgeOut] = []
    """Downstream edges to `put` this work's output on."""
    companion_of: str | None = None
    """A CFG companion's work: the `id` of its primary's work on this stage (they run as one group)."""
    group_size: int = 1
    """Works of this request the router sends this stage together: the primary and its CFG companions."""
    context_only: bool = False
    """The downstream stages read only this work's context (an AR stage's KV cache after prefill), not text it
    would generate: the stage prefills and stops."""
    think: bool = False
    """With `context_only`: BAGEL's think-before-generating mode. A primary first writes its reasoning (its text,
    to the client when `final`), then prefills its context with the reasoning appended; a companion prefills its
    own context under the same reasoning instruction. The stage runs the group unbatched (`group_size` 1)."""
    contract: str = ""
    """The stage digest the router planned this work for (the generation it keeps the request within); a
    stage of another digest refuses the work naming both ("": not checked)."""


class Feed(msgspec.Struct, frozen=True, kw_only=True, tag="feed"):
    """Router -> stage: more input chunks for a work submitted with `more_inputs`."""

    id: str
    inputs: list[Input] = []
    last: bool = False
    """No more chunks follow."""


class Abort(msgspec.Struct, frozen=True, kw_only=True, tag="abort"):
    """Router -> stage: stop a work, release its input handles and the handles it created."""

    id: str
    reason: str = ""


class Release(msgspec.Struct, frozen=True, kw_only=True, tag="release"):
    """Router -> stage: release handles nobody will consume (sent to the producer of each)."""

    handles: list[AnyHandle]


class Hello(msgspec.Struct, frozen=True, kw_only=True, tag="hello"):
    """Router -> stage: the first message of a connection; its auth frame names the router's session."""

    version: int = PROTOCOL_VERSION


class Welcome(msgspec.Struct, frozen=True, kw_only=True, tag="welcome"):
    """Stage -> router: answer to a valid `Hello`; its auth frame names the stage's session."""

    stage: str = ""
    version: int = PROTOCOL_VERSION


class Ping(msgspec.Struct, frozen=True, kw_only=True, tag="ping"):
    nonce: int
    sent_at: float = 0.0
    awaited: int = 0
    """Requests of this router running in a generation that gives this stage the replica's digest and that
    have not started work on the stage yet. A draining replica waits until every router it told says 0:
    the in-flight requests of its generation finish on it (a rollout's old generation goes only once they
    are done)."""


class Pong(msgspec.Struct, frozen=True, kw_only=True, tag="pong"):
    nonce: int
    sent_at: float = 0.0
    """Echo of `Ping.sent_at`, so the router measures the round trip."""
    ready: bool = False
    """The engine has loaded; the router sends work only to ready replicas."""
    stage: str = ""
    running: int = 0
    """Works running on this replica (all routers together)."""
    version: int = PROTOCOL_VERSION
    voices: list[str] = []
    """Speakers its engine knows (speech stages, once loaded); `voice` in a request must be one."""
    draining: bool = False
    """The replica is shutting down: it finishes the works it has but must get no new ones. `ready`
    stays true meanwhile, so a router that does not know this field keeps its works running."""
    image_bounds: ImageSizeBounds | None = None
    """The image sizes its engine can draw, once loaded, where its model bounds them (BAGEL's dit); the
    router refuses a size outside them before any stage works."""
    contract: str = ""
    """This replica's stage digest (`spec.contract.stage_digests`): what it sends and reads over its edges.
    The router gives one request only replicas whose digests belong to one generation ("": unknown, an older
    stage; such replicas only serve with others that report none)."""
    generation: dict[str, str] = {}
    """The stage digest of every stage of the pipeline this replica was resolved with, by stage: the
    generation it belongs to, which the router keeps a request within."""
    spec_contract: str = ""
    """This stage's spec digest (`StageContract.digest`), as the operator labels its pods."""


class Draining(msgspec.Struct, frozen=True, kw_only=True, tag="draining"):
    """Stage -> router, once, when the replica begins to shut down (SIGTERM): send it no new work.

    Sent at once to every router heard from lately, so they stop choosing this replica before the
    EndpointSlice update reaches them; works already running (and their feeds, aborts and releases)
    go on until they end or `grace_s` runs out."""

    stage: str = ""
    grace_s: float = 0.0
    """Seconds the replica keeps running its works; what is still running then fails `unavailable`."""


class Output(msgspec.Struct, frozen=True, kw_only=True, tag="output"):
    """Stage -> router: a piece of a work's output. The last one of a work has `finished`."""

    id: str
    seq: int
    """0, 1, ... per work, in sending order."""
    data: bool = False
    """True when the frames carry an inline payload (final-output data)."""
    handles: list[Input] = []
    """Handles for downstream edges (`Input.source` is this stage; `handle.target` the edge target)."""
    finished: bool = False
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    info: dict[str, Any] = {}
    """What the stage wants the router to know (the prompt it ran, timings); JSON-friendly values."""


class Failed(msgspec.Struct, frozen=True, kw_only=True, tag="failed"):
    """Stage -> router: the work failed; it ends here (no `Output(finished)` follows)."""

    id: str
    kind: ErrorKind
    message: str


Message = Submit | Feed | Abort | Release | Hello | Welcome | Ping | Pong | Draining | Output | Failed

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message, payload: dict[str, Any] | None = None) -> list[Any]:
    """The multipart frames of `message`; `payload` (for `data=True` messages) follows as codec frames."""
    if payload is None:
        return [_encoder.encode(message)]
    header, frames = encode_payload(payload)
    return [_encoder.encode(message), header, *frames]


def decode(frames: Sequence[Any]) -> tuple[Message, list[Any]]:
    """The message and the payload frames after it (codec header first), or ProtocolError."""
    if not frames:
        raise ProtocolError("empty multipart message; expected a msgpack header frame")
    try:
        message = _decoder.decode(_buffer(frames[0]))
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise ProtocolError(f"undecodable protocol header ({err}); router and stage versions differ?") from err
    return message, [_buffer(f) for f in frames[1:]]


def payload_of(message: Submit | Output, rest: list[Any]) -> dict[str, Any] | None:
    """The inline payload carried after the header, or None when the message has none."""
    if not message.data:
        return None
    if not rest:
        raise ProtocolError(f"{type(message).__name__} {message.id!r} says data=True but carries no frames")
    return decode_payload(rest[0], rest[1:])


def _buffer(frame: Any) -> Any:
    """zmq.Frame (copy=False receives) -> its buffer; bytes stay bytes."""
    return frame.buffer if hasattr(frame, "buffer") else frame
