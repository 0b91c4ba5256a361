"""What a connector kind's module declares (`KindDeclaration`) and what it is handed at run time.

A kind's module ends with `KIND = KindDeclaration(...)`: its handle classes, the connector class for a
pipeline's connector settings, the keyword arguments only a running stage process knows
(`runtime_info`), and, when the kind needs a per-pipeline server, how `omnikube serve` runs that server on
one machine. `connectors.registry` collects the declarations; the spec's registry line
(`spec.connectors.CONNECTOR_KINDS`) says what the spec and the operator know of the kind without
importing it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from omni_runtime.connectors.base import Connector, Handle
from omni_runtime.spec import ConnectorServer, ConnectorsSpec, ResolvedPipeline

__all__ = ["ConnectorSettings", "KindDeclaration", "LocalServer", "RunningServer"]


@dataclass
class ConnectorSettings:
    """What only the running stage process knows about its connectors."""

    owner: str = "stage"
    """Names this process's shm segments (`omnikube-<pipeline>-<owner>-p<pid>-...`)."""
    shm_pool_bytes: int = 64 * 1024**2
    """Idle shm bytes kept for reuse; 0 unlinks each segment soon after it is released."""
    advertise_host: str = "127.0.0.1"
    """This pod's address as other pods reach it (Mooncake's transfer engine). The servers' hosts are the
    pipeline's (`ResolvedPipeline.mooncake_master_host`), their ports the spec's."""
    start_timeout_s: float = 120.0
    """How long `ConnectorSet.start` keeps trying to make the connectors the stage's edges need."""
    extra: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Additional `make_connector` keyword arguments by kind."""


class RunningServer(Protocol):
    """A per-pipeline server `LocalServer.start` started; the launcher stops it with the run."""

    def process_info(self) -> dict[str, Any]:
        """Its entry in the run's `processes.json`: name, pids, addresses."""
        ...

    def stop(self) -> None:
        """Stop its processes and reap them."""
        ...


class LocalServer(Protocol):
    """How `omnikube serve` runs one per-pipeline server (`ConnectorServer`) on its machine."""

    server: ConnectorServer

    def start(self, resolved: ResolvedPipeline, *, log_dir: Path) -> RunningServer:
        """Start the server where the resolution placed it (`resolve_pipeline` with the launcher's
        `Placement`); return once it answers."""
        ...


@dataclass(frozen=True)
class KindDeclaration:
    """Everything the runtime needs of one connector kind, declared by the kind's module as `KIND`."""

    name: str
    """The kind as edges name it (its `ConnectorKind` member for the kinds the spec knows)."""
    handles: tuple[type[Handle], ...]
    """The handle classes its connectors return; each has its own msgpack tag."""
    connector_class: Callable[[ConnectorsSpec], Callable[..., Connector]]
    """The connector class for a pipeline's connector settings (Mooncake picks one by `mode`); it is
    called as `cls(spec, **runtime_info)`, and its keyword-only parameters are the runtime info it takes."""
    runtime_info: Callable[[ResolvedPipeline, ConnectorSettings], dict[str, Any]] = lambda _pipeline, _settings: {}
    """Keyword arguments for the connector that only the running stage process knows."""
    trim_on_tick: bool = False
    """Whether the stage's housekeeping tick should call `Connector.trim` (consumers in other processes
    release its pooled memory, and the owner would otherwise notice only on its next put)."""
    local_server: LocalServer | None = None
    """How the local launcher runs the per-pipeline server the kind needs (`ConnectorKindFacts.server`)."""
    sweep: Callable[[str], list[str]] | None = None
    """Removes what stopped processes of a pipeline (by name) left on this machine; returns what it removed."""
