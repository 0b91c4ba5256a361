"""The connector registry as someone adding a kind meets it.

A toy kind, declared as a kind's module declares one and registered in-process by a fixture, moves a
payload through a stage's `ConnectorSet` (made with its runtime info, timed into metrics, counted while
unreleased) and is gone once unregistered. The kinds the spec lists are each declared by the module their
registry line names, their handles decode from the wire's union, each says who may release it (what the
router does with a handle nobody reads), and the launcher learns which per-pipeline servers to run.
"""

from __future__ import annotations

import asyncio
import itertools
import typing
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import pytest
from servelib import windowed_topology

from omni_runtime.connectors import (
    AnyHandle,
    Connector,
    ConnectorSettings,
    Handle,
    KindDeclaration,
    Payload,
    PayloadGone,
    ReleasedBy,
    decode_handle,
    encode_handle,
    registry,
)
from omni_runtime.connectors.codec import decode_payload, encode_payload, payload_nbytes
from omni_runtime.connectors.inline import InlineHandle
from omni_runtime.connectors.mooncake import MooncakeHandle, MooncakePeerHandle
from omni_runtime.connectors.shm import ShmHandle
from omni_runtime.metrics import REGISTRY as METRICS
from omni_runtime.spec import (
    CONNECTOR_KINDS,
    ConnectorKind,
    ConnectorServer,
    ConnectorsSpec,
    MooncakeMasterAddress,
    PipelineSpec,
    Placement,
    ResolvedPipeline,
    StageOverride,
    resolve_pipeline,
)
from omni_runtime.stage.connectors import ConnectorSet

# -- a toy kind, written as a kind's module would be ---------------------------------------------


class ToyHandle(Handle, frozen=True, kw_only=True, tag="toy"):
    """A slot in the producer's dict."""

    kind: ClassVar[str] = "toy"
    released_by: ClassVar[ReleasedBy] = ReleasedBy.PRODUCER

    slot: int


class ToyConnector(Connector):
    """Keeps encoded payloads in a dict of this process."""

    kind: ClassVar[str] = "toy"

    def __init__(self, spec: ConnectorsSpec | None = None, *, pipeline: str = "local", owner: str = "stage") -> None:
        self.pipeline, self.owner = pipeline, owner
        self.slots: dict[int, tuple[bytes, list[bytes]]] = {}
        self._next = itertools.count()

    async def put(self, source_stage: str, target_stage: str, key: str, payload: Payload) -> ToyHandle:
        header, frames = encode_payload(payload)
        slot = next(self._next)
        self.slots[slot] = (header, [bytes(f) for f in frames])
        nbytes = payload_nbytes(header, frames)
        return ToyHandle(key=key, source=source_stage, target=target_stage, nbytes=nbytes, slot=slot)

    async def get(self, handle: Handle) -> dict[str, Any]:
        h = self._check_handle(handle, ToyHandle)
        if h.slot not in self.slots:
            raise PayloadGone(f"toy slot {h.slot} of {h.key!r} was released")
        return decode_payload(*self.slots[h.slot])

    async def release(self, handle: Handle) -> None:
        self.slots.pop(self._check_handle(handle, ToyHandle).slot, None)

    def stats(self) -> dict[str, int]:
        return {"busy": len(self.slots)}


TOY = KindDeclaration(
    name="toy",
    handles=(ToyHandle,),
    connector_class=lambda _spec: ToyConnector,
    runtime_info=lambda pipeline, settings: {"pipeline": pipeline.name, "owner": settings.owner},
)


@pytest.fixture
def toy_kind() -> Iterator[KindDeclaration]:
    registry.register(TOY)
    try:
        yield TOY
    finally:
        registry.unregister(TOY.name)


def two_stages(connector: ConnectorKind = ConnectorKind.INLINE) -> ResolvedPipeline:
    """Stages `a` -> `b` (pipeline `echo3`) over `connector`, in separate pods."""
    return resolve_pipeline(windowed_topology(connector.value, window=0), name="toyline", model="/nonexistent")


# -- the toy kind through a stage's ConnectorSet -------------------------------------------------


def test_a_kind_registered_in_process_moves_a_payload_through_a_stage_connector_set(toy_kind) -> None:
    pipeline = two_stages()
    connectors = ConnectorSet(pipeline, "a", ConnectorSettings(owner="a-r0"))
    payload = {"hidden": np.arange(12, dtype=np.float32).reshape(3, 4), "ids": [1, 2, 3], "text": "hi"}

    async def go() -> None:
        handle = await connectors.put("toy", "b", "req-1", payload)
        assert isinstance(handle, ToyHandle) and (handle.kind, handle.source, handle.target) == ("toy", "a", "b")
        toy = connectors.connector("toy")
        assert isinstance(toy, ToyConnector) and (toy.pipeline, toy.owner) == ("toyline", "a-r0")  # runtime info
        assert connectors.unreleased() == 1
        got = await connectors.get(handle)
        np.testing.assert_array_equal(got["hidden"], payload["hidden"])
        assert (got["ids"], got["text"]) == ([1, 2, 3], "hi")
        labels = {"pipeline": "toyline", "stage": "a", "kind": "toy"}
        for op in ("put", "get"):
            assert METRICS.get_sample_value("omnikube_connector_bytes_total", {**labels, "op": op}) == handle.nbytes
        assert METRICS.get_sample_value("omnikube_connector_payloads_unreleased", labels) == 1
        await connectors.release(handle)
        await connectors.release(handle)  # idempotent, as every kind's release
        assert connectors.unreleased() == 0
        with pytest.raises(PayloadGone):
            await connectors.get(handle)

    try:
        asyncio.run(go())
    finally:
        connectors.close()


def test_an_unregistered_kind_is_unknown_and_the_error_lists_the_known_ones(toy_kind) -> None:
    assert registry.kinds() == [*ConnectorKind, "toy"]
    registry.unregister("toy")
    try:
        with pytest.raises(
            ValueError, match=r"connector kind 'toy' is not known; use one of 'inline', 'shm', 'mooncake'$"
        ):
            ConnectorSet(two_stages(), "a", ConnectorSettings()).connector("toy")
    finally:
        registry.register(TOY)  # the fixture unregisters it


def test_a_taken_kind_name_or_handle_tag_or_a_handle_of_another_kind_is_refused(toy_kind) -> None:
    with pytest.raises(ValueError, match="'toy' is already registered"):
        registry.register(TOY)

    class Other(Handle, frozen=True, kw_only=True, tag="toy"):
        kind: ClassVar[str] = "toy2"
        released_by: ClassVar[ReleasedBy] = ReleasedBy.NOBODY

    with pytest.raises(ValueError, match="handle tag 'toy' is already taken"):
        registry.register(KindDeclaration(name="toy2", handles=(Other,), connector_class=lambda _spec: ToyConnector))
    with pytest.raises(ValueError, match="its handle Other says kind 'toy2'"):
        registry.register(KindDeclaration(name="toy3", handles=(Other,), connector_class=lambda _spec: ToyConnector))
    assert "toy2" not in registry.kinds() and "toy3" not in registry.kinds()


# -- the kinds the spec lists ----------------------------------------------------------------------


def test_every_kind_of_the_spec_is_declared_by_the_module_its_registry_line_names() -> None:
    assert list(CONNECTOR_KINDS) == list(ConnectorKind)
    assert registry.kinds() == list(ConnectorKind)
    declared = [h for k in registry.kinds() for h in registry.declaration(k).handles]
    assert set(typing.get_args(AnyHandle)) == set(declared)
    assert len({h.__struct_config__.tag for h in declared}) == len(declared)  # the wire tells them apart
    for kind, facts in CONNECTOR_KINDS.items():
        found = registry.declaration(kind)
        assert all(h.__module__ == facts.implementation and h.kind == kind for h in found.handles)
        assert (found.local_server.server if found.local_server else None) == facts.server


@pytest.mark.parametrize(
    ("handle", "released_by"),
    [
        (InlineHandle(key="k", source="a", target="b", nbytes=1, header=b"\x80", frames=[]), ReleasedBy.NOBODY),
        (
            ShmHandle(key="k", source="a", target="b", nbytes=1, segment="s", generation=1, layout=[1]),
            ReleasedBy.PRODUCER,
        ),
        (
            MooncakeHandle(key="k", source="a", target="b", nbytes=1, store_key="omnikube/p/k", layout=[1]),
            ReleasedBy.ANY_STAGE,
        ),
        (
            MooncakePeerHandle(
                key="k", source="a", target="b", nbytes=1, segment="h:1", address=64, generation=1, layout=[1]
            ),
            ReleasedBy.ANY_STAGE,
        ),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Handle) else v.name,
)
def test_each_handle_decodes_from_the_wire_and_says_who_may_release_it(handle: Handle, released_by: ReleasedBy) -> None:
    # The router skips NOBODY, sends PRODUCER to the producer only, and hands ANY_STAGE to another replica
    # when the producer is gone.
    decoded = decode_handle(encode_handle(handle))
    assert decoded == handle and type(decoded) is type(handle)
    assert decoded.released_by is released_by
    assert registry.declaration(decoded.kind).name == decoded.kind


# -- the servers a pipeline's connectors need ------------------------------------------------------


@pytest.mark.parametrize("connector", list(ConnectorKind))
def test_the_resolver_places_the_servers_the_pipeline_needs_where_the_launcher_runs_them(
    connector: ConnectorKind,
) -> None:
    """The launcher's Placement puts Mooncake's master on its machine, on ports it picks, only when an
    edge uses mooncake; the registry then offers the launcher exactly the servers the pipeline needs."""
    topology = windowed_topology(connector.value, window=0)
    one_pod = [StageOverride(name="b", colocate_with="a")] if CONNECTOR_KINDS[connector].one_pod else []
    ports = iter(range(40000, 40100))
    placed = Placement(
        discovery=lambda groups: {},
        mooncake_master=lambda: MooncakeMasterAddress(
            host="10.1.2.3", master_port=next(ports), metadata_port=next(ports)
        ),
    )
    resolved = resolve_pipeline(topology, name="toyline", model="/nonexistent", stages=one_pod, placement=placed)
    servers = registry.local_servers(resolved)
    assert [s.server for s in servers] == resolved.connector_servers()
    assert resolved.connector_servers() == ([ConnectorServer.MOONCAKE] if connector is ConnectorKind.MOONCAKE else [])
    mc = resolved.topology.connectors.mooncake
    if connector is ConnectorKind.MOONCAKE:
        assert (mc.master_port, mc.metadata_port, resolved.mooncake_master_host) == (40000, 40001, "10.1.2.3")
        info = registry.runtime_info(connector, resolved, ConnectorSettings(advertise_host="10.9.9.9"))
        assert (info["master_host"], info["local_hostname"]) == ("10.1.2.3", "10.9.9.9")
    else:
        assert resolved.mooncake_master_host is None and mc == ConnectorsSpec().mooncake
        assert next(ports) == 40000, "no port is taken for a server nobody needs"


def test_a_pipeline_without_edges_needs_no_server() -> None:
    topology = PipelineSpec.model_validate(
        {"name": "one", "stages": [{"name": "llm", "kind": "ar", "final_output": True}]}
    )
    resolved = resolve_pipeline(
        topology, name="one", model="/nonexistent", connectors=ConnectorsSpec(default="mooncake")
    )
    assert resolved.connector_servers() == [] and registry.local_servers(resolved) == []
