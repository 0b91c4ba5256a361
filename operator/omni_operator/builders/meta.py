"""Names, labels, owner references and content hashes shared by every builder."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from omni_operator.api.base import CustomResource

__all__ = [
    "HASH_ANNOTATION",
    "LABEL_COMPONENT",
    "LABEL_PIPELINE",
    "LABEL_STAGE",
    "MANAGED_BY",
    "child_name",
    "content_hash",
    "labels",
    "owner_reference",
    "selector_labels",
    "TEMPLATE_HASH_ANNOTATION",
    "with_hash",
]

MANAGED_BY = "omnikube"
LABEL_PIPELINE = "omnikube.io/pipeline"
LABEL_STAGE = "omnikube.io/stage"
LABEL_COMPONENT = "app.kubernetes.io/component"
HASH_ANNOTATION = "omnikube.io/spec-hash"
"""Hash of what an object was built from: equal hash, no write."""
TEMPLATE_HASH_ANNOTATION = "omnikube.io/template-hash"
"""Hash of a pod template's inputs: it changes only when the pods must roll."""

_MAX_NAME = 63


def child_name(*parts: str) -> str:
    """`a-b-c`, shortened with a stable hash suffix when over 63 characters (DNS label limit)."""
    name = "-".join(p for p in parts if p)
    if len(name) <= _MAX_NAME:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[: _MAX_NAME - 9].rstrip('-')}-{digest}"


def selector_labels(pipeline: str, component: str, stage: str | None = None) -> dict[str, str]:
    """The labels that select an object's pods; never change them on a live Deployment (immutable)."""
    out = {"app.kubernetes.io/instance": pipeline, LABEL_COMPONENT: component, LABEL_PIPELINE: pipeline}
    if stage:
        out[LABEL_STAGE] = stage
    return out


def labels(pipeline: str, component: str, stage: str | None = None, version: str = "") -> dict[str, str]:
    """Recommended app.kubernetes.io labels plus omnikube's own."""
    out = {
        "app.kubernetes.io/name": "omnikube",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "app.kubernetes.io/part-of": "omnikube",
        **selector_labels(pipeline, component, stage),
    }
    if version:
        out["app.kubernetes.io/version"] = version[:63]
    return out


def owner_reference(owner: dict[str, Any] | CustomResource, *, controller: bool = True) -> dict[str, Any]:
    """Owner reference to a live object (needs its uid) so garbage collection follows it; `owner` as the
    API returned it, or parsed into its model."""
    if isinstance(owner, CustomResource):
        if owner.metadata.uid is None:
            raise ValueError(f"{owner.kind} {owner.metadata.name} has no uid: only a live object can own another")
        api_version, kind, name, uid = owner.api_version, owner.kind, owner.metadata.name, owner.metadata.uid
    else:
        meta = owner["metadata"]
        api_version, kind, name, uid = owner["apiVersion"], owner["kind"], meta["name"], meta["uid"]
    return {
        "apiVersion": api_version,
        "kind": kind,
        "name": name,
        "uid": uid,
        "controller": controller,
        "blockOwnerDeletion": True,
    }


def content_hash(value: Any) -> str:
    """Stable short hash of JSON-able content."""
    data = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(data.encode()).hexdigest()[:16]


def with_hash(obj: dict[str, Any]) -> dict[str, Any]:
    """The object with HASH_ANNOTATION set to the hash of everything else in it."""
    body = json.loads(json.dumps(obj))
    body["metadata"].setdefault("annotations", {}).pop(HASH_ANNOTATION, None)
    body["metadata"]["annotations"][HASH_ANNOTATION] = content_hash(body)
    return body
