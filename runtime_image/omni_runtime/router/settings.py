"""`RouterSettings`: how one `omnikube router` process is started (flags, launcher argv, pod command).

Imports only pydantic and the spec, so the operator's builders can use it.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field

from omni_runtime.settings import FromPod, ProcessSettings
from omni_runtime.spec import DRAIN_TIMEOUT_S, ROUTER_PORT

__all__ = ["RouterSettings"]


class RouterSettings(ProcessSettings):
    """The OpenAI-compatible router (holds no model)."""

    command: ClassVar[str] = "router"

    config: str
    """Path of the resolved pipeline JSON (the operator's ConfigMap, or the launcher's file)."""
    pipeline_key_file: str
    """File holding the pipeline's key (32+ random bytes) the stages hold; every stage message is
    authenticated with it."""
    host: str = "0.0.0.0"
    """Address to bind the HTTP port to."""
    port: int = Field(ROUTER_PORT, ge=0, le=65535)
    """HTTP port of the OpenAI API, /health and /metrics (0: any free port)."""
    kubeconfig: str | None = None
    """kubeconfig for EndpointSlice discovery (default: the in-cluster service account)."""
    ping_timeout: float = Field(10.0, gt=0)
    """Seconds without a message before a stage replica counts as hung."""
    api_key_file: str | None = None
    """File holding the key every /v1 request must send as 'Authorization: Bearer <key>'; re-read when it
    changes (a mounted Secret), so a rotated key needs no restart (default: no key)."""
    drain_timeout: float = Field(DRAIN_TIMEOUT_S, ge=0)
    """Seconds a SIGTERM lets running requests finish before they fail with a retriable 503 (the operator
    derives it from terminationGracePeriodSeconds)."""
    advertise_host: Annotated[str, FromPod("POD_IP", "status.podIP")] = "127.0.0.1"
    """Address the other router replicas reach this one at (the pod IP in a cluster): video job ids name it."""
    videos_dir: str | None = None
    """Directory of finished videos (a volume in a pod; default: a temporary directory removed at exit)."""
    peers_service: str | None = None
    """The router Service whose EndpointSlices list the other router replicas (requests about a video job
    another replica owns are forwarded to it); unset: this replica is alone (local mode)."""
