"""A pod's volumes, materialised on the host under the pod's state folder and listed as bind sources.

configMap, secret, downwardAPI and projected volumes (service-account token through the TokenRequest API
included) become files under `<pod dir>/volumes/<name>`, mounted read-only, as the kubelet does. Like the
kubelet, the runner rewrites configMap and secret volumes when their object changes (`refresh_volumes`,
called every sync period): each changed file is replaced by a rename inside the mounted folder, so a
container sees the new content (a `subPath` mount of one file keeps the old one, as with the kubelet).
Projected and downwardAPI volumes are written once. emptyDir is a folder there; with
`medium: Memory` the agent mounts a tmpfs (sizeLimit as its size) on that folder inside the pod's mount
namespace, shared by all containers of the pod. hostPath and PVCs (bound to a hostPath or local PV) are the
host folder itself.
"""

from __future__ import annotations

import base64
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from podrunner.downward import DownwardError, expand, field_value, parse_quantity, resource_value
from podrunner.envs import ObjectCache
from podrunner.kube import Kube

__all__ = ["Volume", "VolumeError", "container_mounts", "keep_image_visible", "prepare_volumes", "refresh_volumes"]


class VolumeError(RuntimeError):
    """A volume cannot be set up yet (FailedMount); the pod waits and the runner tries again."""


@dataclass
class Volume:
    name: str
    path: str
    read_only: bool = False
    memory: bool = False
    size: int | None = None


def _write_file(root: Path, rel: str, data: bytes, mode: int | None) -> None:
    if rel.startswith("/") or ".." in Path(rel).parts:
        raise VolumeError(f"item path {rel!r} must be relative and must not contain '..'")
    target = root / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    target.chmod(mode if mode is not None else 0o644)


def _replace_file(root: Path, rel: str, data: bytes, mode: int | None) -> bool:
    """Write `rel` under `root` by a rename (a reader never sees half a file); False when unchanged."""
    if rel.startswith("/") or ".." in Path(rel).parts:
        raise VolumeError(f"item path {rel!r} must be relative and must not contain '..'")
    target = root / rel
    mode = mode if mode is not None else 0o644
    try:
        if target.read_bytes() == data and (target.stat().st_mode & 0o7777) == mode:
            return False
    except OSError:
        pass
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_bytes(data)
    tmp.chmod(mode)
    os.replace(tmp, target)
    return True


Files = dict[str, tuple[bytes, "int | None"]]
"""Relative path -> (data, mode): what a configMap or secret volume should hold."""


async def _key_files(
    cache: ObjectCache, kind: str, name: str, items: list | None, optional: bool, default_mode: int | None
) -> Files | None:
    """The files of a configMap or secret volume (source); None when the object is absent and optional."""
    obj = await cache.get(kind, name)
    label = "configmap" if kind == "configmaps" else "secret"
    if obj is None:
        if optional:
            return None
        raise VolumeError(f'{label} "{name}" not found')
    data: dict[str, bytes] = {}
    if kind == "secrets":
        data = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    else:
        data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    if not items:
        return {key: (value, default_mode) for key, value in data.items()}
    files: Files = {}
    for item in items:
        if item["key"] not in data:
            if optional:
                continue
            raise VolumeError(f'{label} "{name}" has no key {item["key"]!r}')
        files[item["path"]] = (data[item["key"]], item.get("mode", default_mode))
    return files


def _write_files(root: Path, files: Files | None) -> None:
    for rel, (data, mode) in (files or {}).items():
        _write_file(root, rel, data, mode)


def _downward_files(
    pod: dict,
    container_by_name: dict[str, dict],
    items: list,
    root: Path,
    default_mode: int | None,
    pod_ip: str,
    host_ip: str,
    allocatable: dict[str, str],
) -> None:
    for item in items:
        try:
            if "fieldRef" in item:
                value = field_value(pod, item["fieldRef"]["fieldPath"], pod_ip=pod_ip, host_ip=host_ip)
            else:
                ref = item["resourceFieldRef"]
                value = resource_value(container_by_name.get(ref.get("containerName", ""), {}), ref, allocatable)
        except (DownwardError, KeyError) as e:
            raise VolumeError(f"downwardAPI item {item.get('path')!r}: {e}") from e
        _write_file(root, item["path"], value.encode(), item.get("mode", default_mode))


async def _token(kube: Kube, pod: dict, source: dict) -> bytes:
    meta = pod["metadata"]
    sa = pod["spec"].get("serviceAccountName") or "default"
    body = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {
            "audiences": [source["audience"]] if source.get("audience") else [],
            "expirationSeconds": int(source.get("expirationSeconds", 3600)),
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]},
        },
    }
    try:
        out = await kube.request(
            "POST", f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{sa}/token", body=body
        )
    except Exception as e:  # noqa: BLE001 - any failure means: not yet
        raise VolumeError(f"service account token for {sa}: {e}") from e
    return out["status"]["token"].encode()


async def prepare_volumes(
    kube: Kube, cache: ObjectCache, pod: dict, pod_dir: Path, *, pod_ip: str, host_ip: str, allocatable: dict[str, str]
) -> dict[str, Volume]:
    volumes: dict[str, Volume] = {}
    containers = {c["name"]: c for c in [*(pod["spec"].get("initContainers") or []), *pod["spec"]["containers"]]}
    for vol in pod["spec"].get("volumes") or []:
        name = vol["name"]
        root = pod_dir / "volumes" / name
        if "emptyDir" in vol:
            root.mkdir(parents=True, exist_ok=True)
            spec = vol["emptyDir"] or {}
            memory = spec.get("medium") == "Memory"
            size = int(parse_quantity(spec["sizeLimit"])) if memory and spec.get("sizeLimit") else None
            volumes[name] = Volume(name, str(root), memory=memory, size=size)
            continue
        if "hostPath" in vol:
            volumes[name] = Volume(name, _host_path(vol["hostPath"]))
            continue
        if "persistentVolumeClaim" in vol:
            claim = vol["persistentVolumeClaim"]
            path = await _claim_path(kube, pod["metadata"]["namespace"], claim["claimName"])
            volumes[name] = Volume(name, path, read_only=bool(claim.get("readOnly")))
            continue
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        if "configMap" in vol or "secret" in vol:
            kind = "configmaps" if "configMap" in vol else "secrets"
            spec = vol.get("configMap") or vol.get("secret")
            files = await _key_files(
                cache,
                kind,
                spec.get("name") or spec.get("secretName", ""),
                spec.get("items"),
                bool(spec.get("optional")),
                spec.get("defaultMode"),
            )
            _write_files(root, files)
        elif "downwardAPI" in vol:
            spec = vol["downwardAPI"]
            _downward_files(
                pod, containers, spec.get("items") or [], root, spec.get("defaultMode"), pod_ip, host_ip, allocatable
            )
        elif "projected" in vol:
            spec = vol["projected"]
            mode = spec.get("defaultMode")
            for source in spec.get("sources") or []:
                if "serviceAccountToken" in source:
                    st = source["serviceAccountToken"]
                    _write_file(root, st["path"], await _token(kube, pod, st), mode if mode is not None else 0o600)
                elif "configMap" in source or "secret" in source:
                    kind = "configmaps" if "configMap" in source else "secrets"
                    s = source.get("configMap") or source.get("secret")
                    _write_files(
                        root, await _key_files(cache, kind, s["name"], s.get("items"), bool(s.get("optional")), mode)
                    )
                elif "downwardAPI" in source:
                    _downward_files(
                        pod,
                        containers,
                        source["downwardAPI"].get("items") or [],
                        root,
                        mode,
                        pod_ip,
                        host_ip,
                        allocatable,
                    )
                else:
                    raise VolumeError(
                        f"volume {name}: projected source {sorted(source)} is not supported by the pod runner"
                    )
        else:
            kinds = sorted(k for k in vol if k != "name")
            raise VolumeError(
                f"volume {name}: type {kinds} is not supported by the pod runner; use configMap, "
                "secret, emptyDir, hostPath, persistentVolumeClaim, downwardAPI or projected"
            )
        volumes[name] = Volume(name, str(root), read_only=True)
    return volumes


async def refresh_volumes(cache: ObjectCache, pod: dict, volumes: dict[str, Volume]) -> list[str]:
    """Bring the pod's configMap and secret volumes up to date with their objects; returns the files
    changed (`<volume>/<path>`). A missing object keeps the files as they are (the kubelet keeps the
    last content too); a key removed from the object removes its file."""
    changed = []
    for vol in pod["spec"].get("volumes") or []:
        spec = vol.get("configMap") or vol.get("secret")
        mounted = volumes.get(vol["name"])
        if spec is None or mounted is None:
            continue
        kind = "configmaps" if "configMap" in vol else "secrets"
        try:
            want = await _key_files(
                cache, kind, spec.get("name") or spec.get("secretName", ""), spec.get("items"), True,
                spec.get("defaultMode"),
            )  # fmt: skip
        except VolumeError:
            continue
        if want is None:  # the object is gone: keep the last content
            continue
        root = Path(mounted.path)
        for rel, (data, mode) in want.items():
            if _replace_file(root, rel, data, mode):
                changed.append(f"{vol['name']}/{rel}")
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            rel = str(path.relative_to(root))
            if rel not in want and not path.name.startswith("."):
                path.unlink()
                changed.append(f"{vol['name']}/{rel}")
    return changed


def _host_path(spec: dict) -> str:
    path, kind = spec["path"], spec.get("type") or ""
    if kind == "DirectoryOrCreate":
        os.makedirs(path, mode=0o755, exist_ok=True)
    elif kind == "FileOrCreate":
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "a").close()
    checks = {
        "Directory": os.path.isdir,
        "File": os.path.isfile,
        "Socket": os.path.exists,
        "CharDevice": os.path.exists,
        "BlockDevice": os.path.exists,
    }
    if kind in checks and not checks[kind](path):
        raise VolumeError(f"hostPath type check failed: {path} is not a {kind}")
    return path


async def _claim_path(kube: Kube, namespace: str, claim: str) -> str:
    pvc = await kube.get(f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{claim}")
    if pvc is None:
        raise VolumeError(f'persistentvolumeclaim "{claim}" not found')
    pv_name = (pvc.get("spec") or {}).get("volumeName")
    if (pvc.get("status") or {}).get("phase") != "Bound" or not pv_name:
        raise VolumeError(f'persistentvolumeclaim "{claim}" is not bound yet')
    pv = await kube.get(f"/api/v1/persistentvolumes/{pv_name}")
    spec = (pv or {}).get("spec") or {}
    if "hostPath" in spec:
        return _host_path(spec["hostPath"])
    if "local" in spec:
        return spec["local"]["path"]
    raise VolumeError(f"persistentvolume {pv_name} is neither hostPath nor local; the pod runner mounts only those")


def container_mounts(container: dict, volumes: dict[str, Volume], env: dict[str, str]) -> list[dict]:
    """Bind mounts (source, target, readonly) for one container's volumeMounts."""
    mounts = []
    for vm in container.get("volumeMounts") or []:
        vol = volumes.get(vm["name"])
        if vol is None:
            raise VolumeError(f"volumeMount {vm['name']!r} names no volume of the pod")
        sub = vm.get("subPath") or (expand(vm["subPathExpr"], env) if vm.get("subPathExpr") else "")
        source = vol.path
        if sub:
            if sub.startswith("/") or ".." in Path(sub).parts:
                raise VolumeError(f"subPath {sub!r} must be relative and must not contain '..'")
            source = os.path.join(vol.path, sub)
            if not vol.memory and not os.path.lexists(source) and not vol.read_only:
                os.makedirs(source, exist_ok=True)
        mounts.append(
            {"source": source, "target": vm["mountPath"], "readonly": bool(vm.get("readOnly")) or vol.read_only}
        )
    return mounts


def _strictly_under(path: str, folder: str) -> bool:
    folder = folder.rstrip("/")
    return path != folder and path.startswith(folder + "/")


def keep_image_visible(mounts: list[dict], image_paths: list[str]) -> list[dict]:
    """`mounts` plus a bind of each image path that a mount's target would otherwise cover.

    The host is every container's image, so the image lives wherever the checkout and its venv are. A real
    image keeps its code away from the paths volumes cover; here a clone under /tmp would vanish under a
    pod's `/tmp` emptyDir, and the container could not even start its interpreter. So an image path strictly
    under a mount's target is bound again from the host on top of that volume (deeper, so mounted after it):
    the volume still covers everything else, and volumes inside the image path still go on top of it. A mount
    whose target is the image path itself, or above nothing of it, is left alone.
    """
    roots = sorted({p.rstrip("/") or "/" for p in image_paths})
    roots = [p for p in roots if not any(_strictly_under(p, q) for q in roots)]
    targets = {m["target"].rstrip("/") for m in mounts}
    extra = [
        {"source": p, "target": p, "readonly": False}
        for p in roots
        if p not in targets and any(_strictly_under(p, t) for t in targets)
    ]
    return [*mounts, *extra]
