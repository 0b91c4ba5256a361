"""Which OmniPipeline spec fields are in the pipeline contract (`omni_runtime.spec.contract`).

A field is in when changing it can change what crosses an edge between stages. The operator never reads
this table to compute a digest (the digest is computed from the resolved pipeline, where every field in it
arrives); it is the promise the CRD docs make, and tests/test_contract.py walks every field of the spec,
checks each is listed here exactly once, and that changing each field listed in SPEC changes the digest.
"""

from __future__ import annotations

__all__ = ["BY_FOLDER", "NEUTRAL", "SPEC"]

SPEC = frozenset(
    {
        "model",
        "pipeline",
        "runtime.modelCache.mountPath",  # where the stages read the model: part of its path
        "stages[].engineArgs",  # the keys each engine family marks (EngineArgs.contract_fields), not all
        "connectors.default",
        "connectors.mooncake.mode",
        "connectors.mooncake.protocol",
        "connectors.edges[].from",
        "connectors.edges[].to",
        "connectors.edges[].kind",
        "connectors.edges[].window",
        "connectors.edges[].firstWindow",
    }
)
"""In the contract through the resolved pipeline: a change changes status.contract and the pods' labels."""

BY_FOLDER = frozenset({"runtime.modelCache.pvc.claimName", "runtime.modelCache.hostPath.path"})
"""In the contract through the model folder they name: the stages' digests carry its identity (its config
and weights index), which only a stage can read."""

NEUTRAL = frozenset(
    {
        "servedModelName",
        "runtime.image",  # a new image's payload layouts are in the stages' digests (wire and payload versions)
        "runtime.imagePullPolicy",
        "runtime.imagePullSecrets[]",
        "runtime.modelCache.readOnly",
        "runtime.env[].name",
        "runtime.env[].value",
        "runtime.hfTokenSecret.name",
        "runtime.hfTokenSecret.key",
        "runtime.shmSize",
        "connectors.inlineMaxBytes",
        "connectors.mooncake.deviceName",
        "connectors.mooncake.globalSegmentSize",
        "connectors.mooncake.localBufferSize",
        "connectors.startTimeoutSeconds",
        "rollout.maxSurge",  # how a contract change rolls, not what it is
        "rollout.progressDeadlineSeconds",
        "rollout.autoRollback",
        "stages[].name",  # which stage the entry's fields apply to: those fields are classified
        "stages[].replicas",
        "stages[].samplingParams",
        "stages[].colocateWith",  # what it changes is an edge's connector, which is in
        "stages[].shmSize",
        "stages[].terminationGracePeriodSeconds",
        "stages[].nodeSelector",
        "stages[].affinity",
        "stages[].accelerator.type",
        "stages[].accelerator.count",
        "stages[].resources.requests",
        "stages[].resources.limits",
        *(f"stages[].tolerations[].{k}" for k in ("key", "operator", "value", "effect", "tolerationSeconds")),
        *(
            f"stages[].autoscaling.{k}"
            for k in (
                "engine",
                "minReplicas",
                "maxReplicas",
                "targetQueueDepth",
                "metric",
                "target",
                "windowSeconds",
                "scaleDownStabilizationSeconds",
                "pollingIntervalSeconds",
                "prometheusAddress",
            )
        ),  # fmt: skip
    }
)
"""Out of the contract; so is every field under `router.` (the router carries no payload of its own)."""
