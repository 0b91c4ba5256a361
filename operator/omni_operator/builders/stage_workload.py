"""OmniStage -> its Deployment and headless Service. Pure functions of the live OmniStage."""

from __future__ import annotations

from typing import Any

from omni_operator.api import AcceleratorType, OmniStage
from omni_operator.builders.drain import drain_timeout
from omni_operator.builders.meta import (
    TEMPLATE_HASH_ANNOTATION,
    child_name,
    content_hash,
    labels,
    owner_reference,
    selector_labels,
    with_hash,
)
from omni_operator.builders.pipeline_objects import (
    CONFIG_HASH_ANNOTATION,
    CONFIG_KEY,
    GENERATION_LABEL,
    GENERATION_NAME_CHARS,
    KEY_VERSION_ANNOTATION,
)
from omni_operator.builders.trust import KEY_FILE, key_volume
from omni_operator.capacity import AcceleratorNeed, pod_accelerator
from omni_operator.resolve import stage_ports
from omni_runtime.spec.contract import CONTRACT_LABEL_DOMAIN
from omni_runtime.stage.settings import StageSettings

__all__ = [
    "CONFIG_MOUNT",
    "build_stage_deployment",
    "build_stage_service",
    "generation_deployment_name",
    "generation_selector",
    "container_security_context",
    "pod_container_env",
    "pod_security_context",
    "scratch_volumes",
    "stage_settings",
    "stage_selector",
    "model_volume",
]

CONFIG_MOUNT = "/etc/omnikube"
RUNTIME_UID = 1000
RUNTIME_HOME = "/home/omnikube"
"""The runtime user's home in the image (Dockerfile: `useradd --create-home omnikube`)."""


def container_security_context() -> dict[str, Any]:
    """Every container we run: non-root, no privilege escalation, no capabilities, default seccomp, and
    a read-only root filesystem (what the runtime writes goes to the emptyDirs of `scratch_volumes`)."""
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def pod_security_context() -> dict[str, Any]:
    """The pod's: the image's runtime user; fsGroup makes mounted Secrets (mode 0440) readable to it."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUNTIME_UID,
        "runAsGroup": RUNTIME_UID,
        "fsGroup": RUNTIME_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def scratch_volumes() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) for what a read-only root filesystem still needs writable: /tmp and the home
    folder (caches of vLLM, Triton, torch.compile, Hugging Face, matplotlib live under ~ or /tmp)."""
    volumes = [{"name": "tmp", "emptyDir": {}}, {"name": "home", "emptyDir": {}}]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "home", "mountPath": RUNTIME_HOME}]
    return volumes, mounts


def stage_selector(stage: OmniStage) -> dict[str, str]:
    """The pods of every generation of the stage: what its Service, /scale and an HPA count."""
    return selector_labels(stage.spec.pipeline, "stage", stage.spec.stage)


def generation_selector(stage: OmniStage) -> dict[str, str]:
    """The pods of the stage's current generation: its Deployment's selector."""
    return {**stage_selector(stage), GENERATION_LABEL: stage.spec.contract}


def generation_deployment_name(stage: OmniStage) -> str:
    """The Deployment of the stage's current generation: the OmniStage's name and its contract digest, so a
    change to the contract brings up a new Deployment beside the old one instead of rolling it."""
    return child_name(stage.metadata.name, stage.spec.contract[:GENERATION_NAME_CHARS])


def pod_container_env(
    extra: list[dict[str, Any]], hf_token: dict[str, str] | None, command_env: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Downward-API identity, what the settings model's command refers to (`$(POD_IP)`), the HF token
    from its Secret (never inline), then the user's env."""
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        *(command_env or []),
        {"name": "HF_HUB_OFFLINE", "value": "1"},
    ]
    if hf_token:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {**hf_token, "optional": False}}})
    return env + extra


def stage_settings(stage: OmniStage, name: str, index: int) -> StageSettings:
    """What the `index`-th stage process of the pod group is started with (its container command)."""
    port, http_port = stage_ports(index)
    return StageSettings(
        config=f"{CONFIG_MOUNT}/{CONFIG_KEY}",
        stage=name,
        host="0.0.0.0",
        port=port,
        http_port=http_port,
        drain_timeout=drain_timeout(stage.spec.termination_grace_period_seconds),
        pipeline_key_file=KEY_FILE,
    )


def model_volume(model_cache: dict[str, Any] | None) -> tuple[list[dict], list[dict]]:
    """(volumes, mounts) for the model cache."""
    if not model_cache:
        return [], []
    if "pvc" in model_cache:
        source = {
            "persistentVolumeClaim": {
                "claimName": model_cache["pvc"]["claimName"],
                "readOnly": model_cache.get("readOnly", False),
            }
        }
    else:
        source = {"hostPath": {"path": model_cache["hostPath"]["path"], "type": "Directory"}}
    mount = {
        "name": "model-cache",
        "mountPath": model_cache.get("mountPath", "/models"),
        "readOnly": model_cache.get("readOnly", False),
    }
    return [{"name": "model-cache", **source}], [mount]


def _container(
    stage: OmniStage, name: str, index: int, *, with_accelerator: bool, mounts: list[dict]
) -> dict[str, Any]:
    spec = stage.spec
    settings = stage_settings(stage, name, index)
    port, http_port = settings.port, settings.http_port  # the ports the process binds, from one place
    resources: dict[str, dict[str, Any]] = {"requests": {}, "limits": {}}
    if index == 0:
        resources = {k: dict(v) for k, v in spec.resources.to_dict().items()} if spec.resources else resources
    accel = spec.accelerator
    if with_accelerator and accel and accel.type is not AcceleratorType.NONE:
        # Extended resources: requests must equal limits.
        resources.setdefault("limits", {})[accel.type.value] = str(accel.count)
        resources.setdefault("requests", {})[accel.type.value] = str(accel.count)
    probe = {"httpGet": {"path": "/readyz", "port": "http" if index == 0 else http_port}}
    started = settings.pod_command()
    container: dict[str, Any] = {
        "name": name,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy.value,
        "command": started.command,
        "ports": [
            {"name": "stage" if index == 0 else f"stage-{index}", "containerPort": port, "protocol": "TCP"},
            {"name": "http" if index == 0 else f"http-{index}", "containerPort": http_port, "protocol": "TCP"},
        ],
        "env": pod_container_env(
            [e.to_dict() for e in spec.env],
            spec.hf_token_secret.to_dict() if spec.hf_token_secret else None,
            started.env,
        ),
        # The stage writes why it gave up (e.g. ConnectorUnavailable) here; the operator reads it back.
        "terminationMessagePath": StageSettings.model_fields["termination_log"].default,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 3},
        # Loading a model can take many minutes: the startup probe holds liveness off until ready once (30 min).
        # Checked every 2 s, so the pod turns Ready within 2 s of its engine, not up to 10 s later (a roll
        # waits for that, and so does the pipeline's Ready); a GET /readyz costs the stage next to nothing.
        "startupProbe": {**probe, "periodSeconds": 2, "failureThreshold": 900},
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": probe["httpGet"]["port"]},
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            *mounts,
        ],
        "securityContext": container_security_context(),
    }
    if any(resources.get(k) for k in ("requests", "limits")):
        container["resources"] = {k: v for k, v in resources.items() if v}
    return container


def replica_accelerator(stage: OmniStage) -> AcceleratorNeed | None:
    """The accelerator one replica of the stage's pod group asks for (its first container holds it), or None."""
    first = _container(stage, stage.spec.stage, 0, with_accelerator=True, mounts=[])
    return pod_accelerator({"containers": [first]})


def build_stage_deployment(stage: OmniStage) -> dict[str, Any]:
    """The Deployment of the stage's current generation: one container per stage of the pod group, sharing
    the pod's IPC; while older generations still serve, at most `spec.rollout.maxReplicas` replicas."""
    spec = stage.spec
    volumes, mounts = model_volume(spec.model_cache.to_dict() if spec.model_cache else None)
    key_vol, key_mount = key_volume(spec.pipeline)
    scratch, scratch_mounts = scratch_volumes()
    mounts = [*mounts, key_mount, *scratch_mounts]
    members = [spec.stage, *spec.colocated]
    containers = [
        _container(stage, name, i, with_accelerator=(i == 0), mounts=mounts) for i, name in enumerate(members)
    ]
    pod_spec: dict[str, Any] = {
        "containers": containers,
        "volumes": [
            {"name": "config", "configMap": {"name": spec.config_map}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": str(spec.shm_size)}},
            *volumes,
            key_vol,
            *scratch,
        ],
        "securityContext": pod_security_context(),
        # Stages never call the Kubernetes API: no token in the pod for anyone who gets in to use.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        # SIGTERM drains (see builders.drain): the grace period bounds it.
        "terminationGracePeriodSeconds": spec.termination_grace_period_seconds,
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [t.to_dict() for t in spec.tolerations]
    if spec.affinity:
        pod_spec["affinity"] = spec.affinity
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in spec.image_pull_secrets]
    # Pods roll when what they run changes: the spec minus replicas/autoscaling, plus their config.
    template_inputs = stage.spec.to_dict()
    for key in ("replicas", "autoscaling", "rollout"):
        template_inputs.pop(key, None)
    template_hash = content_hash(
        {
            "spec": template_inputs,
            "config": stage.metadata.annotations.get(CONFIG_HASH_ANNOTATION, ""),
            # A recreated key Secret holds a new key: every pod must restart to read it.
            "key": stage.metadata.annotations.get(KEY_VERSION_ANNOTATION, ""),
        }
    )
    pod_labels = labels(spec.pipeline, "stage", spec.stage)
    # each stage's contract digest (spec.contract): which generation of the pipeline its pods belong to
    contracts = {k: v for k, v in stage.metadata.labels.items() if k.startswith(f"{CONTRACT_LABEL_DOMAIN}/")}
    generation = {GENERATION_LABEL: spec.contract}
    replicas = spec.replicas if spec.rollout is None else min(spec.replicas, spec.rollout.max_replicas)
    return with_hash(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {
                "name": generation_deployment_name(stage),
                "namespace": stage.metadata.namespace,
                "labels": {**pod_labels, **generation},
                "ownerReferences": [owner_reference(stage)],
            },
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": generation_selector(stage)},
                # Bring a new replica up before taking an old one down: a stage never drops to zero.
                "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                "revisionHistoryLimit": 3,
                "template": {
                    "metadata": {
                        "labels": {**pod_labels, **contracts, **generation},
                        "annotations": {TEMPLATE_HASH_ANNOTATION: template_hash},
                    },
                    "spec": pod_spec,
                },
            },
        }
    )


def build_stage_service(stage: OmniStage) -> dict[str, Any]:
    """Headless Service: its EndpointSlices list the stage replicas the router balances over."""
    members = [stage.spec.stage, *stage.spec.colocated]
    ports = []
    for i, _ in enumerate(members):
        port, http_port = stage_ports(i)
        suffix = "" if i == 0 else f"-{i}"
        ports += [
            {"name": f"stage{suffix}", "port": port, "targetPort": port, "protocol": "TCP"},
            {"name": f"http{suffix}", "port": http_port, "targetPort": http_port, "protocol": "TCP"},
        ]
    return with_hash(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": stage.metadata.name,
                "namespace": stage.metadata.namespace,
                "labels": labels(stage.spec.pipeline, "stage", stage.spec.stage),
                "ownerReferences": [owner_reference(stage)],
            },
            "spec": {
                "clusterIP": "None",
                "selector": stage_selector(stage),
                "ports": ports,
                # Only ready replicas may receive work.
                "publishNotReadyAddresses": False,
            },
        }
    )
