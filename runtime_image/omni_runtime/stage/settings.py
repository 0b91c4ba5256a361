"""`StageSettings`: how one `omnikube stage` process is started (flags, launcher argv, pod command).

Pipeline-wide facts (topology, connectors, where the Mooncake master is) are in the resolved config
the process reads; these are the facts of this one process. Imports only pydantic and the spec.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Annotated, ClassVar

from pydantic import Field

from omni_runtime.settings import FromPod, ProcessSettings
from omni_runtime.spec import DRAIN_TIMEOUT_S, STAGE_HTTP_PORT, STAGE_PORT

__all__ = ["STAGE_ENV_DEFAULTS", "StageSettings", "apply_stage_env_defaults"]

STAGE_ENV_DEFAULTS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""Environment every stage process starts with unless its environment already decides (a pod's `env`).

One engine per process, so vLLM's worker may run inside its engine-core process: on CPU, vLLM otherwise
starts a third process per AR stage (its platform forces the multiprocessing executor), which imports vLLM
again (~12 CPU-seconds and ~10 s more to Ready on two cores). On a GPU the single-GPU executor is in-process
either way. vLLM's AsyncLLM keeps its engine core in a process of its own regardless."""


def apply_stage_env_defaults(environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """Set each `STAGE_ENV_DEFAULTS` key that `environ` lacks (before any engine is made); the keys it set."""
    added = [key for key in STAGE_ENV_DEFAULTS if key not in environ]
    for key in added:
        environ[key] = STAGE_ENV_DEFAULTS[key]
    return added


class StageSettings(ProcessSettings):
    """One stage server: its engine, its protocol socket and its probes."""

    command: ClassVar[str] = "stage"

    config: str
    """Path of the resolved pipeline JSON (the operator's ConfigMap, or the launcher's file)."""
    pipeline_key_file: str
    """File holding the pipeline's key (32+ random bytes): only a router holding the same key is answered."""
    stage: str = Field(min_length=1)
    """Name of the stage this process serves."""
    host: str = "0.0.0.0"
    """Address to bind the protocol and probe ports to."""
    port: int = Field(STAGE_PORT, ge=0, le=65535)
    """Protocol port (ZeroMQ, router <-> stage; 0: any free port)."""
    http_port: int = Field(STAGE_HTTP_PORT, ge=0, le=65535)
    """Port of /healthz, /readyz and /metrics."""
    replica: str | None = None
    """Replica name for metrics and shm segment names (default: the host name)."""
    advertise_host: Annotated[str, FromPod("POD_IP", "status.podIP")] = "127.0.0.1"
    """This process's address as other pods reach it (the Mooncake transfer engine registers it)."""
    shm_pool_bytes: int = Field(64 * 1024**2, ge=0)
    """Idle shm bytes kept for reuse (0: unlink each segment when released)."""
    connector_timeout: float | None = Field(None, gt=0, le=3600)
    """Seconds to keep trying to start the connectors this stage's edges need (the Mooncake master may
    still be starting); the stage is not ready meanwhile, and exits with a termination message after.
    Unset: the pipeline's `connectors.start_timeout_seconds` (the OmniPipeline's
    `connectors.startTimeoutSeconds`)."""
    termination_log: str = "/dev/termination-log"
    """File this process writes why it exits into, when the file exists (the kubelet creates it at the
    container's terminationMessagePath; the operator reads it back as a Degraded reason)."""
    drain_timeout: float = Field(DRAIN_TIMEOUT_S, ge=0)
    """Seconds a SIGTERM lets running works finish before they fail with a retriable error (the operator
    derives it from terminationGracePeriodSeconds)."""
