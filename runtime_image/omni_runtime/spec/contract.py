"""The pipeline contract: everything that decides what crosses an edge, and its digests.

Two replicas of stages that talk to each other must agree on what flows between them: the hidden states of
one checkpoint fed to a talker of another give garbage audio, silently, and so do codec codes, CFG companion
KV sets and payload layouts. The contract names those facts, per stage, so that the router can keep every
request within one coherent set of replicas (`router.pool`) and a stage can refuse work planned for another.

What is in, per stage (`StageContract`):

- the model (its path) and, on the stage side, the model folder's identity (`model_identity`: digests of its
  config and weights index files, where the folder has them) and the runtime's wire and payload versions;
- the topology's name and the stage's own spec: name, kind, model subfolder, the modalities it takes and
  makes, its CFG companions, and the engine args that change payloads (each engine-args family says which of
  its fields are in: `EngineArgs.contract_fields`; vLLM's pass-through keys are in unless known neutral);
- every edge into or out of the stage: its ends, its effective connector (and the Mooncake mode and protocol
  on a mooncake edge), window, first window and input processor;
- the own spec of every stage it reads from (an upstream stage's engine args decide what it reads).

Everything else is out: replicas, resources, placement, autoscaling, sampling defaults, router limits,
connector sizes and timeouts, the served model name. A change to those never needs two generations.

The spec digests (`StageContract.digest` per stage, `PipelineContract.digest` for the whole) are what the
operator computes from the resolved pipeline: each stage's pods carry theirs as the label
`contract.omnikube.io/<stage>`, the pipeline's status its whole as `status.contract`. The stage digests
(`stage_digests`) add what only a stage can read (its model folder, its code's versions) and are what the
router keeps a request within.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from omni_runtime.spec.connectors import ConnectorKind
from omni_runtime.spec.engine_args import contract_engine_args
from omni_runtime.spec.pipeline import EdgeSpec, PipelineSpec, StageSpec
from omni_runtime.spec.resolved import ResolvedPipeline

__all__ = [
    "CONTRACT_LABEL_DOMAIN",
    "IDENTITY_FILES",
    "PipelineContract",
    "StageContract",
    "model_identity",
    "pipeline_contract",
    "stage_digests",
]

DIGEST_CHARS = 16

CONTRACT_LABEL_DOMAIN = "contract.omnikube.io"
"""Stage pods carry `contract.omnikube.io/<stage>: <spec digest>` for each stage they run."""

IDENTITY_FILES = ("config.json", "model_index.json", "model.safetensors.index.json", "generation_config.json")
"""Files of a model folder (and of its first-level subfolders: diffusers components) whose bytes make its
identity. Weights themselves are not hashed (28 GB for a 7B model); their index names every tensor's file."""


def _digest(value: Any) -> str:
    data = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(data.encode()).hexdigest()[:DIGEST_CHARS]


class StageContract(BaseModel):
    """What one stage must agree on with the stages it talks to (see the module docstring)."""

    model_config = ConfigDict(frozen=True)

    model: str
    topology: str
    stage: dict[str, Any]
    """The stage's own spec, the payload-changing parts only."""
    edges: list[dict[str, Any]]
    """Every edge into or out of the stage, with its effective connector."""
    reads_from: dict[str, dict[str, Any]]
    """The own spec of every stage with an edge into this one."""

    @property
    def digest(self) -> str:
        """The stage's spec digest: what the operator labels the stage's pods with (`contract.omnikube.io/<stage>`)
        and the stage reports as `Pong.spec_contract`."""
        return _digest(self.model_dump(mode="json"))


class PipelineContract(BaseModel):
    """Every stage's contract; `digest` names the whole."""

    model_config = ConfigDict(frozen=True)

    stages: dict[str, StageContract]

    @property
    def digest(self) -> str:
        """The spec digest: equal for two resolved pipelines exactly when no stage's contract differs."""
        return _digest(self.model_dump(mode="json"))


def _own(stage: StageSpec) -> dict[str, Any]:
    return {
        "name": stage.name,
        "kind": stage.kind.value,
        "model_subfolder": stage.model_subfolder,
        "input_modalities": sorted(m.value for m in stage.input_modalities),
        "output_modality": stage.output_modality.value,
        "companions": [c.model_dump(mode="json") for c in stage.companions],
        "engine_args": contract_engine_args(stage),
    }


def _edge(topology: PipelineSpec, edge: EdgeSpec) -> dict[str, Any]:
    kind = topology.edge_connector(edge)
    out: dict[str, Any] = {
        "from": edge.source,
        "to": edge.target,
        "connector": kind.value,
        "window": edge.window,
        "first_window": edge.first_window,
        "input_processor": edge.input_processor,
    }
    if kind is ConnectorKind.MOONCAKE:  # p2p and store hand over different handles
        mooncake = topology.connectors.mooncake
        out["mooncake"] = {"mode": mooncake.mode.value, "protocol": mooncake.protocol.value}
    return out


def pipeline_contract(resolved: ResolvedPipeline) -> PipelineContract:
    """The contract of a resolved pipeline (pure: the operator, `omnikube render` and every stage agree)."""
    topology = resolved.topology
    own = {s.name: _own(s) for s in topology.stages}
    stages = {}
    for stage in topology.stages:
        touching = [e for e in topology.edges if stage.name in (e.source, e.target)]
        stages[stage.name] = StageContract(
            model=resolved.model,
            topology=topology.name,
            stage=own[stage.name],
            edges=[_edge(topology, e) for e in touching],
            reads_from={e.source: own[e.source] for e in topology.upstream(stage.name)},
        )
    return PipelineContract(stages=stages)


def stage_digests(contract: PipelineContract, *, identity: str, runtime: Mapping[str, int]) -> dict[str, str]:
    """Each stage's digest as a stage replica reports it: its contract, the model folder's `identity` and the
    runtime's wire and payload versions (`runtime`, by name). Two replicas of one stage may take part in the
    same request exactly when their digests are equal."""
    versions = dict(sorted(runtime.items()))
    return {
        name: _digest({"contract": c.model_dump(mode="json"), "identity": identity, "runtime": versions})
        for name, c in contract.stages.items()
    }


def model_identity(folder: Path | str) -> str:
    """A digest of the model folder's IDENTITY_FILES (and those of its subfolders one level down), "" when it
    has none (a folder that is not there: the stage then fails to load it anyway)."""
    root = Path(folder)
    found: dict[str, str] = {}
    candidates = [root / name for name in IDENTITY_FILES]
    if root.is_dir():
        candidates += [sub / name for sub in sorted(root.iterdir()) if sub.is_dir() for name in IDENTITY_FILES]
    for path in candidates:
        if path.is_file():
            found[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return _digest(found) if found else ""
