"""A container's environment, resolved as the kubelet does: base, `envFrom`, then `env` with `$(VAR)`."""

from __future__ import annotations

import base64
from typing import Any

from podrunner.downward import DownwardError, expand, field_value, resource_value
from podrunner.kube import Kube

__all__ = ["ConfigError", "ObjectCache", "container_env", "expand_command"]


class ConfigError(RuntimeError):
    """The container cannot start yet (CreateContainerConfigError): a ConfigMap, Secret or key is missing."""


class ObjectCache:
    """ConfigMaps and Secrets of one namespace, fetched once per pod sync."""

    def __init__(self, kube: Kube, namespace: str) -> None:
        self.kube, self.namespace = kube, namespace
        self._seen: dict[tuple[str, str], dict | None] = {}

    async def get(self, kind: str, name: str) -> dict | None:
        key = (kind, name)
        if key not in self._seen:
            self._seen[key] = await self.kube.get(f"/api/v1/namespaces/{self.namespace}/{kind}/{name}")
        return self._seen[key]

    async def data(self, kind: str, name: str) -> dict[str, str] | None:
        """String data of a ConfigMap (`configmaps`) or Secret (`secrets`, decoded); None when absent."""
        obj = await self.get(kind, name)
        if obj is None:
            return None
        if kind == "secrets":
            return {k: base64.b64decode(v).decode(errors="replace") for k, v in (obj.get("data") or {}).items()}
        return dict(obj.get("data") or {})


async def _key_ref(cache: ObjectCache, kind: str, ref: dict, env_name: str) -> str | None:
    label = "ConfigMap" if kind == "configmaps" else "Secret"
    data = await cache.data(kind, ref.get("name", ""))
    optional = bool(ref.get("optional"))
    if data is None:
        if optional:
            return None
        raise ConfigError(
            f'{label.lower()} "{ref.get("name")}" not found (env {env_name}); create it or mark the reference optional'
        )
    if ref.get("key") not in data:
        if optional:
            return None
        raise ConfigError(
            f"couldn't find key {ref.get('key')} in {label} {cache.namespace}/{ref.get('name')} (env {env_name})"
        )
    return data[ref["key"]]


async def container_env(
    cache: ObjectCache,
    pod: dict,
    container: dict,
    *,
    base: dict[str, str],
    pod_ip: str,
    host_ip: str,
    node_allocatable: dict[str, str],
) -> dict[str, str]:
    env = dict(base)
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind, field in (("configmaps", "configMapRef"), ("secrets", "secretRef")):
            ref = source.get(field)
            if ref is None:
                continue
            data = await cache.data(kind, ref.get("name", ""))
            if data is None:
                if ref.get("optional"):
                    continue
                raise ConfigError(
                    f'{"configmap" if kind == "configmaps" else "secret"} "{ref.get("name")}" not found (envFrom)'
                )
            env.update({prefix + k: v for k, v in data.items() if "=" not in prefix + k})
    for item in container.get("env") or []:
        name = item["name"]
        value_from: dict[str, Any] | None = item.get("valueFrom")
        if value_from is None:
            env[name] = expand(item.get("value", ""), env)
            continue
        try:
            if "fieldRef" in value_from:
                value: str | None = field_value(
                    pod, value_from["fieldRef"]["fieldPath"], pod_ip=pod_ip, host_ip=host_ip
                )
            elif "resourceFieldRef" in value_from:
                value = resource_value(container, value_from["resourceFieldRef"], node_allocatable)
            elif "configMapKeyRef" in value_from:
                value = await _key_ref(cache, "configmaps", value_from["configMapKeyRef"], name)
            elif "secretKeyRef" in value_from:
                value = await _key_ref(cache, "secrets", value_from["secretKeyRef"], name)
            else:
                raise ConfigError(f"env {name}: valueFrom {sorted(value_from)} is not supported by the pod runner")
        except DownwardError as e:
            raise ConfigError(f"env {name}: {e}") from e
        if value is not None:
            env[name] = value
    return env


def expand_command(container: dict, env: dict[str, str]) -> list[str]:
    """command + args with `$(VAR)` expanded (the host is the image: there is no ENTRYPOINT or CMD)."""
    return [expand(a, env) for a in [*(container.get("command") or []), *(container.get("args") or [])]]
