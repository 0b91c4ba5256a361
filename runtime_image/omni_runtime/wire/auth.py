"""Who may speak the stage protocol: one secret key per pipeline, an HMAC-SHA256 on every message.

Every protocol message travels as `[auth, header, *frames]`. The `auth` frame (73 bytes) says who sent
it, to whom, and in which order, and carries `HMAC-SHA256(key, domain | sender role | sender session |
receiver session | counter | each frame's length and bytes)`:

    version (1 byte) | sender session (16) | receiver session (16) | counter (8, little endian) | mac (32)

A *session* is one side of one connection: 16 random bytes chosen afresh for every connection. The router
opens a connection with a `Hello` addressed to no session yet; the stage answers it with a `Welcome` from
a session of its own, addressed to the router's. From then on each side accepts only messages addressed
to its own session, from the peer's session, with a counter above the last one it accepted and a valid
MAC. So a message replayed later, on this or any other connection, is refused (its session or counter
does not match), and a peer without the key can neither send anything a stage acts on nor get an answer.
A router session id is accepted in a `Hello` only once per stage process, so a captured `Hello` cannot be
replayed either. The sender's role is in the MAC, so a stage's message reflected back to a stage is refused.

The key itself is never logged: `PipelineKey.fingerprint` (a truncated SHA-256 of it) lets a person check
that two processes hold the same key.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "AUTH_FRAME_BYTES",
    "KEY_BYTES",
    "NO_SESSION",
    "AuthError",
    "Channel",
    "HelloLedger",
    "PipelineKey",
    "Role",
    "RejectReason",
    "open_hello",
]

KEY_BYTES = 32
"""Length of a generated pipeline key (random bytes); shorter keys are refused."""
AUTH_VERSION = 1
SESSION_BYTES = 16
NO_SESSION = bytes(SESSION_BYTES)
"""The receiver session of a `Hello`: the router does not know the stage's session yet."""
_AUTH = struct.Struct("<B16s16sQ32s")
AUTH_FRAME_BYTES = _AUTH.size
_DOMAIN = b"omnikube-stage-protocol/1"
_LENGTH = struct.Struct("<Q")
HELLO_MAX_BYTES = 1024
"""An opening message (`Hello`) is a few bytes; anything bigger from an unknown connection is not read."""
THREAD_MIN_BYTES = 1 << 20
"""`seal_async`/`open_async` compute the MAC of a message this large in a worker thread (hashlib releases
the GIL), so a large inline payload does not stall the event loop for the milliseconds it takes."""

Role = Literal["router", "stage"]
RejectReason = Literal["no_auth", "bad_mac", "unknown_session", "replay"]
"""Why a message was dropped (the `reason` label of the rejected-messages metric)."""

_ROLE_BYTE: dict[str, bytes] = {"router": b"r", "stage": b"s"}


class AuthError(ValueError):
    """A message that is not authenticated for this connection; it is dropped, never answered."""

    def __init__(self, reason: RejectReason, message: str) -> None:
        super().__init__(message)
        self.reason: RejectReason = reason


class PipelineKey:
    """The pipeline's shared secret. Its repr and str never show the bytes."""

    __slots__ = ("_base",)

    def __init__(self, secret: bytes) -> None:
        if len(secret) < KEY_BYTES:
            raise ValueError(
                f"a pipeline key holds {len(secret)} bytes; at least {KEY_BYTES} random bytes are required "
                "(the operator generates them into the Secret <pipeline>-key; `omnikube serve` per run)"
            )
        # The HMAC key schedule once; each message copies it.
        self._base = hmac.new(bytes(secret), digestmod=hashlib.sha256)
        self._base.update(_DOMAIN)

    @classmethod
    def generate(cls) -> PipelineKey:
        """A new random key (`os.urandom`)."""
        return cls(os.urandom(KEY_BYTES))

    @classmethod
    def from_file(cls, path: str | Path) -> PipelineKey:
        """The key in `path` (raw bytes, as a Secret volume writes them)."""
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as err:
            raise ValueError(
                f"cannot read the pipeline key file {path} ({err.strerror}); the stage protocol needs the "
                "pipeline's key: mount the Secret <pipeline>-key there, or give the file `omnikube serve` wrote"
            ) from None
        try:
            return cls(data)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None

    @staticmethod
    def write_new(path: str | Path) -> PipelineKey:
        """Generate a key and write it to `path`, readable by this user only (mode 0600)."""
        secret = os.urandom(KEY_BYTES)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secret)
        return PipelineKey(secret)

    @property
    def fingerprint(self) -> str:
        """8 hex digits naming the key without revealing it (compare two processes' logs)."""
        probe = self._base.copy()
        probe.update(b"fingerprint")
        return probe.hexdigest()[:8]

    def __repr__(self) -> str:
        return f"PipelineKey(fingerprint={self.fingerprint})"

    __str__ = __repr__

    def mac(self, role: bytes, sender: bytes, receiver: bytes, counter: int, frames: Sequence[Any]) -> bytes:
        h = self._base.copy()
        h.update(b"".join((role, sender, receiver, _LENGTH.pack(counter))))  # one call: small messages are most
        for frame in frames:
            data = _buffer(frame)
            h.update(_LENGTH.pack(_size(data)))
            h.update(data)
        return h.digest()


def _buffer(frame: Any) -> Any:
    """zmq.Frame (copy=False receives) -> its buffer; bytes, memoryviews and arrays stay as they are."""
    return frame.buffer if hasattr(frame, "buffer") else frame


def _size(data: Any) -> int:
    return len(data) if isinstance(data, bytes) else memoryview(data).nbytes


def _total(frames: Sequence[Any]) -> int:
    return sum(_size(_buffer(f)) for f in frames)


@dataclass(frozen=True)
class _Auth:
    sender: bytes
    receiver: bytes
    counter: int
    mac: bytes


def _parse(frames: Sequence[Any]) -> _Auth:
    if len(frames) < 2:
        raise AuthError("no_auth", "a message without an auth frame and a header; expected [auth, header, ...]")
    raw = _buffer(frames[0])
    if memoryview(raw).nbytes != AUTH_FRAME_BYTES:
        raise AuthError(
            "no_auth", f"the first frame is {memoryview(raw).nbytes} bytes, not a {AUTH_FRAME_BYTES}-byte auth frame"
        )
    version, sender, receiver, counter, mac = _AUTH.unpack(bytes(raw))
    if version != AUTH_VERSION:
        raise AuthError("no_auth", f"auth version {version}; this process speaks {AUTH_VERSION}")
    return _Auth(sender, receiver, counter, mac)


def _verify(key: PipelineKey, role: Role, auth: _Auth, body: Sequence[Any]) -> None:
    expected = key.mac(_ROLE_BYTE[role], auth.sender, auth.receiver, auth.counter, body)
    if not hmac.compare_digest(expected, auth.mac):
        raise AuthError("bad_mac", "the message's MAC does not verify with this pipeline's key")


@dataclass
class Channel:
    """This process's side of one authenticated connection: `seal` what it sends, `open` what it gets."""

    key: PipelineKey
    role: Role
    """Who this side is; messages it opens must come from the other role."""
    local: bytes = field(default_factory=lambda: os.urandom(SESSION_BYTES))
    remote: bytes = NO_SESSION
    """The peer's session; NO_SESSION until the router has its stage's `Welcome`."""
    sent: int = 0
    received: int = 0

    @property
    def established(self) -> bool:
        return self.remote != NO_SESSION

    def seal(self, frames: list[Any]) -> list[Any]:
        """`[auth, *frames]`, with the next counter."""
        self.sent += 1
        mac = self.key.mac(_ROLE_BYTE[self.role], self.local, self.remote, self.sent, frames)
        return [_AUTH.pack(AUTH_VERSION, self.local, self.remote, self.sent, mac), *frames]

    async def seal_async(self, frames: list[Any]) -> list[Any]:
        """`seal`, with the MAC of a large message computed in a worker thread. The counter is taken at
        the call, so sends must still leave in call order (the stage holds its send lock across both)."""
        if _total(frames) < THREAD_MIN_BYTES:
            return self.seal(frames)
        self.sent += 1
        counter, local, remote = self.sent, self.local, self.remote
        mac = await asyncio.to_thread(self.key.mac, _ROLE_BYTE[self.role], local, remote, counter, frames)
        return [_AUTH.pack(AUTH_VERSION, local, remote, counter, mac), *frames]

    def open(self, frames: Sequence[Any]) -> list[Any]:
        """The frames after the auth frame, once the message is proven to be the peer's next one;
        AuthError otherwise. The first message a router accepts (a `Welcome`) names the stage's session."""
        auth, body = self._addressed(frames)
        _verify(self.key, self._peer_role, auth, body)
        return self._accept(auth, body)

    async def open_async(self, frames: Sequence[Any]) -> list[Any]:
        """`open`, with the MAC of a large message checked in a worker thread so the event loop keeps
        serving meanwhile. Open one message at a time, in arrival order."""
        auth, body = self._addressed(frames)
        if _total(body) >= THREAD_MIN_BYTES:
            await asyncio.to_thread(_verify, self.key, self._peer_role, auth, body)
        else:
            _verify(self.key, self._peer_role, auth, body)
        return self._accept(auth, body)

    @property
    def _peer_role(self) -> Role:
        return "stage" if self.role == "router" else "router"

    def _addressed(self, frames: Sequence[Any]) -> tuple[_Auth, list[Any]]:
        auth = _parse(frames)
        if auth.receiver != self.local:
            raise AuthError("unknown_session", "the message is addressed to another session (an old connection?)")
        if self.established and auth.sender != self.remote:
            raise AuthError("unknown_session", "the message comes from a session this connection does not know")
        return auth, list(frames[1:])

    def _accept(self, auth: _Auth, body: list[Any]) -> list[Any]:
        if auth.counter <= self.received:
            raise AuthError("replay", f"counter {auth.counter} was already used (last accepted: {self.received})")
        self.received = auth.counter
        if not self.established:
            self.remote = auth.sender
        return body


def open_hello(key: PipelineKey, frames: Sequence[Any]) -> tuple[Channel, list[Any]]:
    """A stage's channel for a router's first message (addressed to NO_SESSION): verified, with a fresh
    stage session; AuthError when it is not a valid opening message."""
    auth = _parse(frames)
    if auth.receiver != NO_SESSION:
        raise AuthError("unknown_session", "the message belongs to a session this stage does not know")
    body = list(frames[1:])
    if len(body) != 1 or _total(body) > HELLO_MAX_BYTES:  # refused unread: a stranger's bulk costs no hashing
        raise AuthError("no_auth", f"an opening message must be one header frame of at most {HELLO_MAX_BYTES} bytes")
    _verify(key, "router", auth, body)
    return Channel(key, "stage", remote=auth.sender, received=auth.counter), body


class HelloLedger:
    """Router sessions a stage has accepted a `Hello` from: each is accepted once (no replayed Hello)."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._seen: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def first_time(self, session: bytes) -> bool:
        if session in self._seen:
            return False
        self._seen[session] = None
        while len(self._seen) > self.size:
            self._seen.popitem(last=False)
        return True
