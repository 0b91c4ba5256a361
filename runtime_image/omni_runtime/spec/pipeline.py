"""A pipeline's topology: stages, the edges between them, and their connectors.

This is the contract between the registry (config/pipelines/*.yaml), the operator and the runtime.
It is pure pydantic: importing it never pulls in torch or an engine.
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from omni_runtime.spec.connectors import ConnectorKind, ConnectorsSpec
from omni_runtime.spec.enums import INPUT_PROCESSORS, Modality, StageKind
from omni_runtime.spec.reasons import Reason

__all__ = [
    "CompanionDrops",
    "CompanionSpec",
    "EdgeSpec",
    "ModelMatch",
    "NoUsableConnector",
    "PipelineSpec",
    "SpecError",
    "StageSpec",
    "UnknownEdge",
    "UnknownStage",
]

NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
"""Stage and pipeline names become parts of Kubernetes object names (RFC 1123 labels)."""


class SpecError(ValueError):
    """A pipeline spec that cannot run; the message names the field and what to change.

    Raised as the subclass that says what is wrong: its `reason` is the operator's Degraded reason, so
    nobody has to recover it from the message."""

    reason: ClassVar[Reason] = Reason.INVALID_TOPOLOGY


class UnknownStage(SpecError):
    """The spec names a stage the topology lacks."""

    reason: ClassVar[Reason] = Reason.UNKNOWN_STAGE


class UnknownEdge(SpecError):
    """The spec names an edge the topology lacks."""

    reason: ClassVar[Reason] = Reason.UNKNOWN_EDGE


class NoUsableConnector(SpecError):
    """An edge's connector cannot serve the placement of its stages (e.g. `shm` across pods)."""

    reason: ClassVar[Reason] = Reason.NO_USABLE_CONNECTOR


class CompanionDrops(str, enum.Enum):
    """What a CFG companion's input leaves out of the primary's."""

    TEXT = "text"
    """The prompt's text: the last user message becomes the negative prompt (a text-free context)."""
    IMAGE = "image"
    """The request's images: the text stays (the image-free context an edit's image guidance needs)."""


class CompanionSpec(BaseModel):
    """A CFG companion: the AR stage also runs a second context beside the primary (a negative prompt, or the
    prompt without its image), and both outputs reach the next stage together."""

    model_config = ConfigDict(extra="forbid")

    role: str = Field(
        "cfg_text",
        pattern=r"^[a-z][a-z0-9_]*$",  # it becomes part of work ids (`<request>.<choice>.<stage>.<role>`)
        max_length=40,
        description="Tag carried by the companion request and its output (seed: `cfg_text`, `cfg_img`).",
    )
    negative_prompt: str = Field("", description="Prompt used when the request gives no `negative_prompt` of its own.")
    drops: CompanionDrops = Field(
        CompanionDrops.TEXT,
        description="What the companion's input leaves out: `text` (the last user message's text becomes the "
        "request's `negative_prompt`, else `negative_prompt` here) or `image` (the request's images are removed, "
        "the text kept).",
    )
    guidance: str | None = Field(
        None,
        pattern=r"^[a-z][a-z0-9_]*$",
        max_length=64,
        description="The request parameter of the stage this companion feeds that weights it (e.g. "
        "`cfg_text_scale`): when the request's value, else that stage's default, is 1 (no guidance), the "
        "companion does not run. Unset: it always runs.",
    )


class StageSpec(BaseModel):
    """One stage of a pipeline: what runs, and what it produces."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN, max_length=40, description="Stage name, unique in the pipeline.")
    kind: StageKind = Field(description="Engine family: ar (vLLM), diffusion (diffusers) or generation.")
    model_subfolder: str = Field(
        "", description="Folder inside the model that holds this stage's component; empty for the root."
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Arguments passed through to the engine (vLLM or diffusers); for ar stages also "
        "`tool_call_parser`, the vLLM tool-call parser of the stage (as `vllm serve --tool-call-parser`).",
    )
    sampling_params: dict[str, Any] = Field(
        default_factory=dict, description="Default sampling parameters; a request may override them."
    )
    input_modalities: list[Modality] = Field(
        default_factory=lambda: [Modality.TEXT], description="What the stage accepts."
    )
    output_modality: Modality = Field(Modality.TEXT, description="What the stage produces.")
    final_output: bool = Field(False, description="Whether the stage's output is returned to the client.")
    companions: list[CompanionSpec] = Field(
        default_factory=list, description="CFG companions this (AR) stage runs beside each request."
    )

    @model_validator(mode="after")
    def _companions_need_ar(self) -> StageSpec:
        if self.companions and self.kind is not StageKind.AR:
            raise ValueError(
                f"stage {self.name!r}: companions are only supported on ar stages, not {self.kind.value}; "
                "move them to the AR stage that feeds this one"
            )
        roles = [c.role for c in self.companions]
        if "primary" in roles or len(set(roles)) != len(roles):
            raise ValueError(
                f"stage {self.name!r}: companion roles {roles} must be distinct and never 'primary' (the primary "
                "request's own role); rename the companion"
            )
        if self.final_output and self.output_modality is Modality.HIDDEN:
            raise ValueError(
                f"stage {self.name!r}: a final output cannot have output_modality 'hidden'; "
                "set output_modality to text, image, audio or video"
            )
        return self


class EdgeSpec(BaseModel):
    """Data flow from one stage to another."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    source: str = Field(alias="from", description="Upstream stage name.")
    target: str = Field(alias="to", description="Downstream stage name.")
    connector: ConnectorKind | None = Field(
        None, description="Connector for this edge; the pipeline default when unset."
    )
    window: int = Field(
        0,
        ge=0,
        description="Stream the edge in chunks of this many items (tokens/codes); 0 sends the whole output.",
    )
    first_window: int = Field(
        0,
        ge=0,
        description="Items in the first chunk of a streamed edge, when fewer than `window` (0: `window`): a "
        "small first chunk starts the target sooner (Qwen3-Omni decodes its first audio packet from 4 codec "
        "frames, then windows of 25).",
    )
    input_processor: str = Field(
        "identity",
        description=f"Transform applied before the target sees the data: {sorted(INPUT_PROCESSORS)}.",
    )


class ModelMatch(BaseModel):
    """How a local model folder is recognised as this pipeline."""

    model_config = ConfigDict(extra="forbid")

    architectures: list[str] = Field(
        default_factory=list, description="`config.json` `architectures` entries that select this pipeline."
    )
    diffusers_classes: list[str] = Field(
        default_factory=list, description="`model_index.json` `_class_name` values that select this pipeline."
    )


class PipelineSpec(BaseModel):
    """A complete pipeline topology."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN, max_length=40, description="Registry name of the topology.")
    description: str = Field("", description="One line for people.")
    match: ModelMatch = Field(default_factory=ModelMatch)
    stages: list[StageSpec] = Field(min_length=1)
    edges: list[EdgeSpec] = Field(default_factory=list)
    connectors: ConnectorsSpec = Field(default_factory=ConnectorsSpec)

    @model_validator(mode="after")
    def _check_topology(self) -> PipelineSpec:
        problems = topology_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def stage(self, name: str) -> StageSpec:
        """The stage called `name`; raises SpecError listing the stages when there is none."""
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise UnknownStage(f"pipeline {self.name!r} has no stage {name!r}; its stages are {self.stage_names()}")

    def stage_names(self) -> list[str]:
        return [s.name for s in self.stages]

    def edge_connector(self, edge: EdgeSpec) -> ConnectorKind:
        """The connector an edge uses: its own, or the pipeline default."""
        return edge.connector or self.connectors.default

    def entry_stages(self) -> list[str]:
        """Stages with no upstream edge: a request starts there."""
        targets = {e.target for e in self.edges}
        return [s.name for s in self.stages if s.name not in targets]

    def downstream(self, name: str) -> list[EdgeSpec]:
        return [e for e in self.edges if e.source == name]

    def upstream(self, name: str) -> list[EdgeSpec]:
        return [e for e in self.edges if e.target == name]

    def topological_order(self) -> list[str]:
        """Stage names, every stage after all of its upstream stages (declaration order breaks ties)."""
        order = _topological_order(self.stage_names(), [(e.source, e.target) for e in self.edges])
        assert order is not None, "validated pipelines are acyclic"
        return order


def topology_problems(spec: PipelineSpec) -> list[str]:
    """Everything wrong with a topology, each naming the field and what to change."""
    problems: list[str] = []
    names = spec.stage_names()
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            problems.append(f"stages[{i}].name: {name!r} is used by another stage; stage names must be unique")
        seen.add(name)
    for i, edge in enumerate(spec.edges):
        for field, value in (("from", edge.source), ("to", edge.target)):
            if value not in seen:
                problems.append(f"edges[{i}].{field}: no stage is named {value!r}; known stages are {names}")
        if edge.source == edge.target:
            problems.append(f"edges[{i}]: stage {edge.source!r} cannot feed itself")
        if edge.input_processor not in INPUT_PROCESSORS:
            problems.append(
                f"edges[{i}].input_processor: {edge.input_processor!r} is unknown; "
                f"use one of {sorted(INPUT_PROCESSORS)}"
            )
    pairs = [(e.source, e.target) for e in spec.edges]
    for i, pair in enumerate(pairs):
        if pair in pairs[:i]:
            problems.append(f"edges[{i}]: the edge {pair[0]} -> {pair[1]} is declared twice")
    if not problems and _topological_order(names, pairs) is None:
        cycle = _describe_cycle(names, pairs)
        problems.append(f"edges: the stages form a cycle ({cycle}); remove one edge of it")
    if not any(s.final_output for s in spec.stages):
        problems.append("stages: no stage has final_output: true, so a request would return nothing")
    return problems


def _topological_order(names: list[str], pairs: list[tuple[str, str]]) -> list[str] | None:
    order = _kahn(names, pairs)
    return order if len(order) == len(names) else None


def _kahn(names: list[str], pairs: list[tuple[str, str]]) -> list[str]:
    """Kahn's algorithm; the stages it could order (all of them unless there is a cycle).

    Among stages ready at the same time, the one declared first goes first."""
    position = {n: i for i, n in enumerate(names)}
    indegree = {n: 0 for n in names}
    for _, target in pairs:
        indegree[target] += 1
    ready = [n for n in names if indegree[n] == 0]
    order: list[str] = []
    while ready:
        node = ready.pop(0)
        order.append(node)
        for source, target in pairs:
            if source == node:
                indegree[target] -= 1
                if indegree[target] == 0:
                    ready.append(target)
        ready.sort(key=position.__getitem__)
    return order


def _describe_cycle(names: list[str], pairs: list[tuple[str, str]]) -> str:
    # Every stage Kahn's algorithm leaves over has an upstream stage that is also left over, so walking
    # upstream from any of them must revisit a stage; the walk between the two visits is a cycle.
    ordered = set(_kahn(names, pairs))
    remaining = [n for n in names if n not in ordered]
    upstream: dict[str, str] = {}
    for source, target in pairs:
        if source in remaining and target in remaining:
            upstream.setdefault(target, source)
    path, node = [], remaining[0]
    while node not in path:
        path.append(node)
        node = upstream[node]
    cycle = path[path.index(node) :] + [node]
    return " -> ".join(reversed(cycle))
