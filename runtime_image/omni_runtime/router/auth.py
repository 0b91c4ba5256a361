"""The router's API key: every `/v1/*` request must carry `Authorization: Bearer <key>`.

The key lives in a file (in a pod: a Secret volume, which the kubelet rewrites when the Secret
changes), so a rotated key takes effect without a restart: the file is looked at (one `stat`) at most
once per `recheck_s` and read again only when it changed. `/health`, `/livez` and `/metrics` stay open
to probes and scrapers; they carry no request data.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from omni_runtime.router.errors import Unauthorized, error_response

__all__ = ["ApiKeyError", "ApiKeyFile", "BearerAuth"]

log = logging.getLogger(__name__)

MAX_KEY_BYTES = 4096
"""A key file larger than this is a mistake (a wrong file mounted), not a key."""


class ApiKeyError(RuntimeError):
    """The key file cannot be used: missing, unreadable, empty or too large."""


class ApiKeyFile:
    """The current key from `path`: surrounding whitespace (a trailing newline) is not part of it."""

    def __init__(self, path: str | Path, *, recheck_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.path = Path(path)
        self.recheck_s = recheck_s
        self._clock = clock
        self._stamp = self._stat()
        self._key = self._read()
        self._checked = clock()
        self._problem: str | None = None

    def _stat(self) -> tuple[int, int, int]:
        try:
            st = os.stat(self.path)  # follows the kubelet's ..data symlink to the current file
        except OSError as err:
            raise ApiKeyError(
                f"API key file {self.path}: {err.strerror}; mount the Secret there or fix the path"
            ) from None
        return st.st_mtime_ns, st.st_ino, st.st_size

    def _read(self) -> bytes:
        try:
            with open(self.path, "rb") as f:
                data = f.read(MAX_KEY_BYTES + 1)
        except OSError as err:
            raise ApiKeyError(f"API key file {self.path}: {err.strerror}") from None
        if len(data) > MAX_KEY_BYTES:
            raise ApiKeyError(f"API key file {self.path} is over {MAX_KEY_BYTES} bytes; it should hold only the key")
        key = data.strip()
        if not key:
            raise ApiKeyError(f"API key file {self.path} is empty; put the key in the Secret")
        return key

    def key(self) -> bytes:
        """The key now in force. A file that changed is read again; one that became unusable keeps the
        last good key (the endpoint never opens because a rotation went wrong) and is logged."""
        now = self._clock()
        if now - self._checked < self.recheck_s:
            return self._key
        self._checked = now
        try:
            stamp = self._stat()
            if stamp != self._stamp:
                self._stamp = stamp  # first, so a bad file is read (and reported) once, not every second
                self._key = self._read()
                log.info("API key file %s changed; the new key is in force", self.path)
            self._problem = None
        except ApiKeyError as err:
            if str(err) != self._problem:
                log.warning("%s; still accepting the previous key", err)
            self._problem = str(err)
        return self._key


GUARDED_OUTSIDE_V1 = ("/tokenize", "/detokenize")
"""Routes outside `/v1` that need the key too: they run work on a stage (vLLM leaves them open)."""


class BearerAuth:
    """Refuses `/v1/*` (and `GUARDED_OUTSIDE_V1`) requests whose Bearer token is not the key (401,
    OpenAI's error shape), before their body is read. The comparison takes the same time wherever the
    first differing byte is."""

    def __init__(self, app: ASGIApp, key: ApiKeyFile) -> None:
        self.app = app
        self.key = key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        guarded = path == "/v1" or path.startswith("/v1/") or path in GUARDED_OUTSIDE_V1
        if scope["type"] != "http" or not guarded:
            await self.app(scope, receive, send)
            return
        problem = self._problem(dict(scope.get("headers") or []).get(b"authorization"))
        if problem is None:
            await self.app(scope, receive, send)
            return
        await error_response(Unauthorized(problem))(scope, receive, send)

    def _problem(self, header: bytes | None) -> str | None:
        if header is None:
            return "this endpoint needs an API key; send it as 'Authorization: Bearer <key>'"
        scheme, _, token = header.strip().partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            return "the Authorization header must be 'Bearer <key>'"
        if not hmac.compare_digest(token.strip(), self.key.key()):
            return "the API key is not valid; check the key you send (it may have been rotated)"
        return None
