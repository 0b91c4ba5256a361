"""The operator's one door to the Kubernetes API: get, list, server-side apply, status patch, delete.

Handlers never build URLs or talk HTTP themselves; they call this. Only the kinds in RESOURCES are
reachable, which keeps the operator's RBAC and its code in step.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

__all__ = ["KubeClient", "KubeError", "NAMESPACE_TERMINATING", "RESOURCES", "FIELD_MANAGER", "USER_AGENT"]

log = logging.getLogger(__name__)

FIELD_MANAGER = "omnikube-operator"
USER_AGENT = "omnikube-operator/0.1.0"

# (apiVersion, kind) -> (plural, namespaced)
RESOURCES: dict[tuple[str, str], tuple[str, bool]] = {
    ("v1", "ConfigMap"): ("configmaps", True),
    ("v1", "Service"): ("services", True),
    ("v1", "ServiceAccount"): ("serviceaccounts", True),
    ("v1", "Secret"): ("secrets", True),
    ("v1", "Pod"): ("pods", True),
    ("v1", "Event"): ("events", True),
    ("v1", "Node"): ("nodes", False),
    ("apps/v1", "Deployment"): ("deployments", True),
    ("apps/v1", "ReplicaSet"): ("replicasets", True),
    ("policy/v1", "PodDisruptionBudget"): ("poddisruptionbudgets", True),
    ("rbac.authorization.k8s.io/v1", "Role"): ("roles", True),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): ("rolebindings", True),
    ("networking.k8s.io/v1", "NetworkPolicy"): ("networkpolicies", True),
    ("discovery.k8s.io/v1", "EndpointSlice"): ("endpointslices", True),
    ("coordination.k8s.io/v1", "Lease"): ("leases", True),
    ("autoscaling/v2", "HorizontalPodAutoscaler"): ("horizontalpodautoscalers", True),
    ("keda.sh/v1alpha1", "ScaledObject"): ("scaledobjects", True),
    ("omnikube.io/v1alpha1", "OmniPipeline"): ("omnipipelines", True),
    ("omnikube.io/v1alpha1", "OmniStage"): ("omnistages", True),
}


NAMESPACE_TERMINATING = "NamespaceTerminating"
"""The cause (`details.causes[].reason` of the API's Status) of a 403 for new content in a namespace that is
being deleted (Kubernetes' `NamespaceTerminatingCause`)."""


class KubeError(RuntimeError):
    """An API call failed; `status` is the HTTP status (0 when no response came).

    `reason` and `causes` come from the API's Status body when it sent one: `reason` its one-word reason
    (`Forbidden`, `NotFound`, `Conflict`...), `causes` the `reason` of each `details.causes` entry."""

    def __init__(self, status: int, message: str, *, reason: str = "", causes: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.causes = tuple(causes)

    @property
    def namespace_terminating(self) -> bool:
        """The API refused new content because the namespace is being deleted."""
        return self.status == 403 and NAMESPACE_TERMINATING in self.causes


@dataclass
class KubeClient:
    """Thin async client over kubernetes_asyncio's ApiClient."""

    api: client.ApiClient
    field_manager: str = FIELD_MANAGER

    @classmethod
    async def from_environment(cls, kubeconfig: str | None = None) -> KubeClient:
        """In a pod: the service account; elsewhere: $KUBECONFIG or ~/.kube/config."""
        configuration = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            await config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        api = client.ApiClient(configuration)
        api.user_agent = USER_AGENT  # lets audit logs tell the operator's requests apart
        return cls(api=api)

    async def close(self) -> None:
        await self.api.close()

    # -- paths --

    @staticmethod
    def path(
        api_version: str,
        kind: str,
        namespace: str | None = None,
        name: str | None = None,
        subresource: str | None = None,
    ) -> str:
        try:
            plural, namespaced = RESOURCES[(api_version, kind)]
        except KeyError:
            raise KubeError(0, f"{api_version}/{kind} is not a kind the operator manages") from None
        base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        if namespaced and namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{plural}"
        if name:
            base += f"/{name}"
        if subresource:
            base += f"/{subresource}"
        return base

    async def _call(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        try:
            response = await self.api.call_api(
                path,
                method,
                query_params=query or [],
                header_params={"Accept": "application/json", "Content-Type": content_type},
                body=body,
                auth_settings=["BearerToken"],
                _preload_content=False,
            )
            data = await response.read()
        except ApiException as exc:
            raise KubeError(exc.status or 0, _api_message(exc), **_status_fields(_json_or_none(exc.body))) from None
        try:
            body = json.loads(data) if data else {}
        except ValueError:
            # Not JSON: a path the apiserver does not serve at all (a kind whose CRD is not installed
            # answers "404 page not found" in plain text).
            if response.status < 400:
                raise
            text = data[:200].decode(errors="replace").strip()
            raise KubeError(response.status, f"{method} {path}: {text or response.status}") from None
        if response.status >= 400:
            message = body.get("message") if isinstance(body, dict) else None
            raise KubeError(response.status, f"{method} {path}: {message or response.status}", **_status_fields(body))
        return body

    # -- verbs --

    async def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return await self._call("GET", self.path(api_version, kind, namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(
        self,
        api_version: str,
        kind: str,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[dict[str, Any]]:
        query = []
        if label_selector:
            query.append(("labelSelector", label_selector))
        if field_selector:
            query.append(("fieldSelector", field_selector))
        result = await self._call("GET", self.path(api_version, kind, namespace), query=query)
        items = result.get("items", [])
        for item in items:  # list responses drop these; callers build on full objects
            item.setdefault("apiVersion", api_version)
            item.setdefault("kind", kind)
        return items

    async def apply(self, obj: dict[str, Any], *, subresource: str | None = None) -> dict[str, Any]:
        """Server-side apply as the operator's field manager, taking over conflicting fields."""
        meta = obj["metadata"]
        path = self.path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"], subresource)
        query = [("fieldManager", self.field_manager), ("force", "true")]
        return await self._call("PATCH", path, query=query, body=obj, content_type="application/apply-patch+yaml")

    async def merge_patch(
        self,
        api_version: str,
        kind: str,
        name: str,
        namespace: str | None,
        patch: dict[str, Any],
        *,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        path = self.path(api_version, kind, namespace, name, subresource)
        return await self._call(
            "PATCH",
            path,
            body=patch,
            content_type="application/merge-patch+json",
            query=[("fieldManager", self.field_manager)],
        )

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        path = self.path(obj["apiVersion"], obj["kind"], meta.get("namespace"))
        return await self._call("POST", path, body=obj, query=[("fieldManager", self.field_manager)])

    async def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> bool:
        """Delete in the background (dependents are garbage-collected); False when already gone."""
        try:
            await self._call(
                "DELETE", self.path(api_version, kind, namespace, name), body={"propagationPolicy": "Background"}
            )
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True


def _api_message(exc: ApiException) -> str:
    try:
        return json.loads(exc.body or b"").get("message") or str(exc.reason)
    except (TypeError, ValueError):
        return f"{exc.status} {exc.reason}"


def _json_or_none(data: Any) -> Any:
    try:
        return json.loads(data or b"")
    except (TypeError, ValueError):
        return None


def _status_fields(body: Any) -> dict[str, Any]:
    """`reason` and `causes` (see KubeError) of an API Status body; empty for anything else."""
    if not isinstance(body, dict):
        return {}
    details = body.get("details")
    causes = details.get("causes") if isinstance(details, dict) else None
    return {
        "reason": str(body.get("reason") or ""),
        "causes": [
            str(c["reason"])
            for c in (causes if isinstance(causes, list) else [])
            if isinstance(c, dict) and c.get("reason")
        ],
    }
