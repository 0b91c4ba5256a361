"""OmniPipeline -> the router: ServiceAccount, Role, RoleBinding, Deployment, Service, PodDisruptionBudget."""

from __future__ import annotations

from typing import Any

from omni_operator.api import OmniPipeline
from omni_operator.builders.drain import drain_timeout, router_pre_stop
from omni_operator.builders.meta import (
    TEMPLATE_HASH_ANNOTATION,
    content_hash,
    labels,
    owner_reference,
    selector_labels,
    with_hash,
)
from omni_operator.builders.pipeline_objects import CONFIG_KEY, configmap_name, router_name
from omni_operator.builders.stage_workload import (
    CONFIG_MOUNT,
    container_security_context,
    pod_container_env,
    pod_security_context,
)
from omni_operator.builders.trust import KEY_FILE, key_volume
from omni_runtime.router.settings import RouterSettings
from omni_runtime.spec import ROUTER_PORT, ResolvedPipeline

__all__ = ["API_KEY_FILE", "API_KEY_MOUNT", "build_router_objects", "router_endpoint"]

API_KEY_MOUNT = "/etc/omnikube-auth"
API_KEY_FILE = f"{API_KEY_MOUNT}/api-key"
"""Where the router reads `router.apiKeySecret`: a Secret volume, which the kubelet rewrites when the
Secret changes (within about a minute), and the router re-reads, so rotating the key needs no restart."""


VIDEOS_MOUNT = "/var/lib/omnikube/videos"
"""Where the router keeps finished videos: `router.videos.volumeClaim`, or an emptyDir of `maxBytes`."""


def _router_config_hash(resolved: ResolvedPipeline) -> str:
    # The router reads topology, connectors, discovery and limits; stage engine args are the stages' own
    # business, so changing them must not roll the router.
    data = resolved.model_dump(mode="json", by_alias=True)
    for stage in data["topology"]["stages"]:
        stage.pop("engine_args", None)
    return content_hash(data)


def _placement(router: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if router.node_selector:
        out["nodeSelector"] = dict(router.node_selector)
    if router.tolerations:
        out["tolerations"] = [t.to_dict() for t in router.tolerations]
    if router.affinity:
        out["affinity"] = router.affinity
    return out


def build_router_objects(
    owner: dict[str, Any], pipeline: OmniPipeline, resolved: ResolvedPipeline, *, key_version: str = ""
) -> list[dict[str, Any]]:
    """Every object of the router, each carrying its content hash. `key_version`: the uid of the
    pipeline's key Secret (a new one rolls the router, which reads the key at start)."""
    name = owner["metadata"]["name"]
    namespace = owner["metadata"]["namespace"]
    rname = router_name(name)
    own = [owner_reference(owner)]
    lbl = labels(name, "router")
    spec = pipeline.spec
    runtime, router = spec.runtime, spec.router

    def meta(obj_name: str = rname) -> dict[str, Any]:
        return {"name": obj_name, "namespace": namespace, "labels": lbl, "ownerReferences": own}

    service_account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": meta(),
        "automountServiceAccountToken": True,
    }
    # Least privilege: discovery lists and watches its stages' EndpointSlices, and that is all the router
    # asks the API (router/discovery.py); it reads no pods and gets no single object.
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": meta(),
        "rules": [
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": meta(),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": rname},
        "subjects": [{"kind": "ServiceAccount", "name": rname, "namespace": namespace}],
    }
    grace = router.termination_grace_period_seconds
    pre_stop = router_pre_stop(grace)
    key_vol, key_mount = key_volume(name)
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": configmap_name(name)}},
        key_vol,
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
        key_mount,
        {"name": "tmp", "mountPath": "/tmp"},  # uploads (images/edits) spool there
    ]
    videos = router.videos
    if videos.volume_claim:
        volumes.append({"name": "videos", "persistentVolumeClaim": {"claimName": videos.volume_claim}})
    else:
        volumes.append({"name": "videos", "emptyDir": {"sizeLimit": str(videos.max_bytes)}})
    mounts.append({"name": "videos", "mountPath": VIDEOS_MOUNT})
    api_key_file: str | None = None
    if router.api_key_secret:
        ref = router.api_key_secret
        volumes.append(
            {"name": "api-key", "secret": {"secretName": ref.name, "items": [{"key": ref.key, "path": "api-key"}]}}
        )
        mounts.append({"name": "api-key", "mountPath": API_KEY_MOUNT, "readOnly": True})
        api_key_file = API_KEY_FILE
    settings = RouterSettings(
        config=f"{CONFIG_MOUNT}/{CONFIG_KEY}",
        host="0.0.0.0",
        port=ROUTER_PORT,
        api_key_file=api_key_file,
        drain_timeout=drain_timeout(grace, pre_stop),
        pipeline_key_file=KEY_FILE,
        videos_dir=VIDEOS_MOUNT,
        peers_service=rname,  # the other router replicas: a video job's owner is found among them
    )
    started = settings.pod_command()
    env = pod_container_env([e.to_dict() for e in runtime.env], None, started.env)
    container: dict[str, Any] = {
        "name": "router",
        "image": runtime.image,
        "imagePullPolicy": runtime.image_pull_policy.value,
        "command": started.command,
        "ports": [{"name": "http", "containerPort": settings.port, "protocol": "TCP"}],
        "env": env,
        # Ready: every stage has a ready replica (the Service sends clients only then). Alive: the process
        # serves; never tied to the stages, or a router would restart-loop while a model loads.
        # Checked every 2 s so the router is Ready (and a roll goes on) within 2 s of its last stage, not up
        # to 5 s later; 7 failures in a row (14 s, as 3 x 5 s before) take it out of its Service.
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 2, "failureThreshold": 7},
        "livenessProbe": {
            "httpGet": {"path": "/livez", "port": "http"},
            "periodSeconds": router.liveness_probe.period_seconds,
            "failureThreshold": router.liveness_probe.failure_threshold,
        },
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
    }
    if pre_stop:  # keep serving while the Service's endpoints drop the pod (see builders.drain)
        container["lifecycle"] = {"preStop": {"sleep": {"seconds": pre_stop}}}
    resources = {k: v for k, v in router.resources.to_dict().items() if v}
    if resources:
        container["resources"] = resources
    containers = [container]
    selector = selector_labels(name, "router")
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(),
        "spec": {
            "replicas": router.replicas,
            "selector": {"matchLabels": selector},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {
                    "labels": lbl,
                    "annotations": {
                        TEMPLATE_HASH_ANNOTATION: content_hash([_router_config_hash(resolved), key_version])
                    },
                },
                "spec": {
                    **_placement(router),
                    "serviceAccountName": rname,
                    "containers": containers,
                    "volumes": volumes,
                    "securityContext": pod_security_context(),
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": grace,
                },
            },
        },
    }
    # Only the OpenAI port: the Mooncake master has a headless Service of its own (builders/mooncake.py).
    service_ports = [{"name": "http", "port": router.service.port, "targetPort": "http", "protocol": "TCP"}]
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(),
        "spec": {"type": router.service.type.value, "selector": selector, "ports": service_ports},
    }
    pdb = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": meta(),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}},
    }
    return [with_hash(o) for o in (service_account, role, binding, deployment, service, pdb)]


def router_endpoint(pipeline: OmniPipeline, namespace: str) -> str:
    """The in-cluster OpenAI base URL clients use."""
    name = router_name(pipeline.metadata.name)
    return f"http://{name}.{namespace}.svc:{pipeline.spec.router.service.port}/v1"
