"""Kubernetes value helpers shared by env and volumes: quantities, timestamps, the downward API, `$(VAR)`."""

from __future__ import annotations

import datetime as dt
import math
import re
from decimal import Decimal
from typing import Any

__all__ = ["DownwardError", "expand", "field_value", "now", "parse_quantity", "resource_value"]

_SUFFIX = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)(e[+-]?[0-9]+|[a-zA-Z]*)$")


class DownwardError(ValueError):
    pass


def parse_quantity(value: Any) -> Decimal:
    """`"8Gi"` -> 8589934592, `"500m"` -> 0.5."""
    text = str(value).strip()
    m = _QUANTITY.match(text)
    if not m:
        raise DownwardError(f"{text!r} is not a quantity (e.g. 512Mi, 2, 500m)")
    number, suffix = m.groups()
    if suffix.startswith("e"):
        return Decimal(number + suffix)
    if suffix not in _SUFFIX:
        raise DownwardError(f"{text!r}: unknown suffix {suffix!r}")
    return Decimal(number) * Decimal(_SUFFIX[suffix])


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _selector(path: str, prefix: str) -> str | None:
    m = re.fullmatch(re.escape(prefix) + r"\['(.*)'\]", path)
    return m.group(1) if m else None


def field_value(pod: dict, path: str, *, pod_ip: str = "", host_ip: str = "") -> str:
    """The downward API's `fieldRef.fieldPath` of `pod` (podIP and hostIP as the runner knows them)."""
    meta, spec = pod.get("metadata", {}), pod.get("spec", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if path in simple:
        return simple[path]
    for prefix, source in (
        ("metadata.labels", meta.get("labels") or {}),
        ("metadata.annotations", meta.get("annotations") or {}),
    ):
        key = _selector(path, prefix)
        if key is not None:
            return source.get(key, "")
        if path == prefix:  # the whole map, as the volume plugin writes it
            return "\n".join(f'{k}="{v}"' for k, v in sorted(source.items()))
    raise DownwardError(
        f"fieldRef.fieldPath {path!r} is not supported; use metadata.name, metadata.namespace, "
        "metadata.uid, metadata.labels['k'], metadata.annotations['k'], spec.nodeName, "
        "spec.serviceAccountName, status.podIP or status.hostIP"
    )


def resource_value(container: dict, ref: dict, node_allocatable: dict[str, str]) -> str:
    """`resourceFieldRef`: the container's limit (or request), else the node's allocatable, over divisor."""
    resource = ref.get("resource", "")
    kind, _, name = resource.partition(".")
    if kind not in ("limits", "requests") or name not in ("cpu", "memory", "ephemeral-storage"):
        raise DownwardError(f"resourceFieldRef.resource {resource!r} is not supported")
    resources = container.get("resources") or {}
    raw = (resources.get(kind) or {}).get(name)
    if raw is None and kind == "requests":
        raw = (resources.get("limits") or {}).get(name)
    if raw is None:
        raw = node_allocatable.get(name, "0") if kind == "limits" else "0"
    divisor = parse_quantity(ref.get("divisor") or "1")
    return str(math.ceil(parse_quantity(raw) / divisor))


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: known names are replaced, unknown ones kept, `$$` is a literal `$`."""
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch != "$" or i + 1 >= len(text):
            out.append(ch)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            end = text.find(")", i + 2)
            if end == -1:
                out.append("$(")
                i += 2
            else:
                name = text[i + 2 : end]
                out.append(env[name] if name in env else f"$({name})")
                i = end + 1
        else:
            out.append("$" + nxt)
            i += 2
    return "".join(out)
