"""KubeError carries the API Status's structured fields; a namespace being terminated is told by its
cause (`NamespaceTerminating`), not by the message text."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from omni_operator.kube import NAMESPACE_TERMINATING, KubeClient, KubeError

# What the apiserver's NamespaceLifecycle admission answers to a create in a namespace being deleted.
TERMINATING = {
    "kind": "Status",
    "apiVersion": "v1",
    "metadata": {},
    "status": "Failure",
    "message": 'pods "p" is forbidden: unable to create new content in namespace ns because it is being terminated',
    "reason": "Forbidden",
    "details": {
        "name": "p",
        "kind": "pods",
        "causes": [
            {
                "reason": NAMESPACE_TERMINATING,
                "message": "namespace ns is being terminated",
                "field": "metadata.namespace",
            }
        ],
    },
    "code": 403,
}
RBAC_FORBIDDEN = {
    "kind": "Status",
    "status": "Failure",
    "message": 'pods is forbidden: User "x" cannot create resource "pods" (the request is being terminated)',
    "reason": "Forbidden",
    "details": {"kind": "pods"},
    "code": 403,
}


class _Response:
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        self.status = status
        self._data = json.dumps(body).encode()

    async def read(self) -> bytes:
        return self._data


class _Api:
    def __init__(self, status: int, body: dict[str, Any], *, raise_it: bool = False) -> None:
        self.status, self.body, self.raise_it = status, body, raise_it

    async def call_api(self, *args: Any, **kwargs: Any) -> _Response:
        if self.raise_it:
            exc = ApiException(status=self.status, reason="Forbidden")
            exc.body = json.dumps(self.body).encode()
            raise exc
        return _Response(self.status, self.body)


def _create_error(api: _Api) -> KubeError:
    kube = KubeClient(api=api)  # type: ignore[arg-type]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ns"}}
    with pytest.raises(KubeError) as info:
        asyncio.run(kube.create(pod))
    return info.value


@pytest.mark.parametrize("raise_it", [False, True], ids=["response", "ApiException"])
def test_a_terminating_namespace_is_told_by_the_status_cause(raise_it: bool) -> None:
    err = _create_error(_Api(403, TERMINATING, raise_it=raise_it))
    assert (err.status, err.reason, err.causes) == (403, "Forbidden", (NAMESPACE_TERMINATING,))
    assert err.namespace_terminating
    assert "being terminated" in str(err)  # the message is kept for people


@pytest.mark.parametrize("raise_it", [False, True], ids=["response", "ApiException"])
def test_another_forbidden_is_not_a_terminating_namespace_whatever_its_text(raise_it: bool) -> None:
    err = _create_error(_Api(403, RBAC_FORBIDDEN, raise_it=raise_it))
    assert (err.status, err.reason, err.causes) == (403, "Forbidden", ())
    assert not err.namespace_terminating


def test_the_cause_only_counts_on_a_403() -> None:
    assert KubeError(403, "", causes=[NAMESPACE_TERMINATING]).namespace_terminating
    assert not KubeError(500, "", causes=[NAMESPACE_TERMINATING]).namespace_terminating
    assert not KubeError(403, "namespace ns is being terminated").namespace_terminating
