"""The connector kinds this process can make, by name, and the questions asked of them.

A kind is one module that ends with `KIND = KindDeclaration(...)` (`connectors.kind`) plus its registry
line in the spec (`spec.connectors.CONNECTOR_KINDS`), which names that module; this registry imports
every module the spec names when it is first imported and checks that each declares the kind it is
listed under. Everyone else asks here instead of comparing kinds: the stage's `ConnectorSet` makes its
connectors with `make_connector` and `runtime_info`, the wire decodes `AnyHandle` (the union of every
declared handle class, told apart by msgpack tag), the router asks a handle's `released_by`, and the
local launcher asks `local_servers` and `sweep_leftovers`.

`register` and `unregister` add and remove a kind in this process only; that is how the built-in kinds
are added, and how a test adds a toy kind. A kind the spec does not list cannot be named by an edge, and
its handles are not in `AnyHandle` (built once, at import, for the wire), so only code that names it
(a `ConnectorSet.put`, a benchmark) uses it.
"""

from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING, Any, TypeAlias, Union

import msgspec

from omni_runtime.connectors.base import Connector, Handle
from omni_runtime.connectors.kind import ConnectorSettings, KindDeclaration, LocalServer
from omni_runtime.spec import CONNECTOR_KINDS, ConnectorKind, ConnectorsSpec, ResolvedPipeline

__all__ = [
    "AnyHandle",
    "declaration",
    "decode_handle",
    "encode_handle",
    "kinds",
    "local_servers",
    "make_connector",
    "register",
    "runtime_info",
    "sweep_leftovers",
    "unregister",
]

_kinds: dict[str, KindDeclaration] = {}
"""The registered kinds by name (a plain str: `str(ConnectorKind.SHM)` is `"shm"`)."""


def register(kind: KindDeclaration) -> None:
    """Make `kind` available in this process; a name or handle tag already taken is an error."""
    name = str(kind.name)
    if name in _kinds:
        raise ValueError(f"connector kind {name!r} is already registered; unregister it first")
    tags = {h.__struct_config__.tag for k in _kinds.values() for h in k.handles}
    for handle in kind.handles:
        if handle.kind != name:
            raise ValueError(f"connector kind {name!r}: its handle {handle.__name__} says kind {str(handle.kind)!r}")
        if handle.__struct_config__.tag in tags:
            raise ValueError(f"connector kind {name!r}: handle tag {handle.__struct_config__.tag!r} is already taken")
    _kinds[name] = kind


def unregister(name: str) -> None:
    """Forget the kind called `name` (it must be registered)."""
    declaration(name)
    del _kinds[str(name)]


def kinds() -> list[str]:
    """The registered kinds' names, the spec's kinds first, in `ConnectorKind` order."""
    return list(_kinds)


def declaration(name: str) -> KindDeclaration:
    """The declaration of the kind called `name`; an unknown name is a ValueError listing the known ones."""
    found = _kinds.get(str(name))
    if found is None:
        allowed = ", ".join(repr(k) for k in _kinds)
        raise ValueError(f"connector kind {str(name)!r} is not known; use one of {allowed}")
    return found


def make_connector(kind: str, spec: ConnectorsSpec | None = None, **runtime_info: Any) -> Connector:
    """Build the connector for `kind` from the pipeline's connector spec plus what only the running
    process knows (`runtime_info`): for shm `pipeline`, `owner`, `pool_max_bytes`, `copy_out`...;
    for mooncake `pipeline`, `local_hostname`, `master_host`, `metadata_server`... (mode `store` also
    `master_address`)
    Unknown keys are an error, so a typo does not silently fall back to a default."""
    found = declaration(kind)
    spec = spec or ConnectorsSpec()
    cls = found.connector_class(spec)
    params = inspect.signature(cls).parameters
    known = sorted(n for n, p in params.items() if p.kind is p.KEYWORD_ONLY)
    unknown = sorted(set(runtime_info) - set(known))
    if unknown:
        raise TypeError(f"make_connector({str(kind)!r}): unknown runtime_info {unknown}; allowed: {known or 'none'}")
    return cls(spec, **runtime_info)


def runtime_info(kind: str, pipeline: ResolvedPipeline, settings: ConnectorSettings) -> dict[str, Any]:
    """The `make_connector` keyword arguments a stage process of `pipeline` passes for `kind`:
    the kind's own, then `settings.extra[kind]` over them."""
    found = declaration(kind)
    return {**found.runtime_info(pipeline, settings), **settings.extra.get(str(kind), {})}


def local_servers(resolved: ResolvedPipeline) -> list[LocalServer]:
    """How to run on this machine each per-pipeline server the pipeline's connectors need
    (`ResolvedPipeline.connector_servers()`; Mooncake's master when an edge uses `mooncake`)."""
    by_server = {k.local_server.server: k.local_server for k in _kinds.values() if k.local_server is not None}
    return [by_server[server] for server in resolved.connector_servers()]


def sweep_leftovers(pipeline: str) -> list[str]:
    """Remove what stopped stage processes of `pipeline` left on this machine (shm segments); returns it."""
    return [removed for k in _kinds.values() if k.sweep is not None for removed in k.sweep(pipeline)]


def _register_spec_kinds() -> None:
    for kind, facts in CONNECTOR_KINDS.items():
        declared = getattr(importlib.import_module(facts.implementation), "KIND", None)
        if not isinstance(declared, KindDeclaration) or declared.name != kind:
            raise ImportError(
                f"{facts.implementation} must end with `KIND = KindDeclaration(name=ConnectorKind.{kind.name}, "
                "...)`: spec.connectors.CONNECTOR_KINDS lists it as the implementation of that kind"
            )
        server = declared.local_server.server if declared.local_server is not None else None
        if server != facts.server:
            raise ImportError(
                f"{facts.implementation}: its local server is for {server}, but the spec says kind "
                f"{kind.value!r} needs {facts.server}; make them agree"
            )
        register(declared)
    missing = [k.value for k in ConnectorKind if k not in CONNECTOR_KINDS]
    if missing:
        raise ImportError(f"spec.connectors.CONNECTOR_KINDS has no line for kinds {missing}")


_register_spec_kinds()

if TYPE_CHECKING:
    AnyHandle: TypeAlias = Handle
else:
    # The wire's msgspec structs need a concrete union of tagged classes; mypy sees the common base.
    AnyHandle = Union[tuple(h for k in _kinds.values() for h in k.handles)]  # noqa: UP007 (built at run time)
"""Decode target for any handle of the kinds the spec lists (the msgpack tag picks the class)."""

_handle_encoder = msgspec.msgpack.Encoder()
_handle_decoder = msgspec.msgpack.Decoder(AnyHandle)


def encode_handle(handle: Handle) -> bytes:
    """The msgpack bytes of one handle (its tag included)."""
    return _handle_encoder.encode(handle)


def decode_handle(data: bytes | memoryview) -> AnyHandle:
    """The handle `encode_handle` wrote, as its own class."""
    return _handle_decoder.decode(data)
