"""Planning a request over the pipeline's DAG: which stages run, which of them answer the client, which
edges stream. Pure functions of the topology and the requested modalities.

- The stages that run are the final-output stages producing a requested modality plus everything
  upstream of them (Qwen-Omni asked for text only runs the thinker alone).
- A stage's companions (CFG) run beside its primary only on entry stages with downstream work; their
  prompt is the request's `negative_prompt`, else the companion's default.
- An edge streams (`window` > 0) only when its target has that one upstream edge and its source runs no
  companions; otherwise the whole output travels as one handle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omni_runtime.spec import Modality, PipelineSpec, StageKind
from omni_runtime.wire.protocol import EdgeOut

__all__ = ["Plan", "StagePlan", "companion_inputs", "plan_request", "producible_modalities"]

PRIMARY = "primary"


@dataclass(frozen=True)
class StagePlan:
    name: str
    kind: StageKind
    modality: Modality
    roles: tuple[str, ...] = (PRIMARY,)
    final: bool = False
    """Its primary's output goes to the client."""
    upstream: tuple[str, ...] = ()
    """Stages whose outputs this stage waits for (or streams from)."""
    edges: tuple[EdgeOut, ...] = ()
    """Downstream edges with the window that actually applies."""
    streamed_input: bool = False
    """Its single upstream edge streams: it is submitted on the first chunk and fed the rest."""
    input_processor: str = "identity"


@dataclass(frozen=True)
class Plan:
    stages: dict[str, StagePlan] = field(default_factory=dict)
    """In topological order."""
    entry: tuple[str, ...] = ()
    final: tuple[str, ...] = ()


def producible_modalities(topology: PipelineSpec) -> list[str]:
    """Modalities a client can ask for: those of the final-output stages, in stage order, no repeats."""
    out: list[str] = []
    for stage in topology.stages:
        if stage.final_output and stage.output_modality.value not in out:
            out.append(stage.output_modality.value)
    return out


def plan_request(topology: PipelineSpec, modalities: list[str]) -> Plan:
    """The plan producing `modalities` (each must be producible; the caller checks)."""
    final = [s.name for s in topology.stages if s.final_output and s.output_modality.value in modalities]
    needed: set[str] = set()
    todo = list(final)
    while todo:
        name = todo.pop()
        if name not in needed:
            needed.add(name)
            todo.extend(e.source for e in topology.upstream(name))
    order = [n for n in topology.topological_order() if n in needed]
    edges = [e for e in topology.edges if e.source in needed and e.target in needed]
    entry = tuple(n for n in order if not any(e.target == n for e in edges))
    roles: dict[str, tuple[str, ...]] = {}
    for name in order:
        spec = topology.stage(name)
        has_downstream = any(e.source == name for e in edges)
        if spec.companions and name in entry and has_downstream:
            roles[name] = (PRIMARY, *(c.role for c in spec.companions))
        else:
            roles[name] = (PRIMARY,)
    stages: dict[str, StagePlan] = {}
    for name in order:
        spec = topology.stage(name)
        ups = [e for e in edges if e.target == name]
        streamed = len(ups) == 1 and ups[0].window > 0 and roles[ups[0].source] == (PRIMARY,)
        processors = [e.input_processor for e in ups]
        processor = next((p for p in processors if p != "identity"), processors[0] if processors else "identity")
        outs = []
        for e in edges:
            if e.source != name:
                continue
            target_ups = [u for u in edges if u.target == e.target]
            window = e.window if (len(target_ups) == 1 and roles[name] == (PRIMARY,)) else 0
            first = min(e.first_window, window) if window else 0
            outs.append(
                EdgeOut(target=e.target, connector=topology.edge_connector(e).value, window=window, first_window=first)
            )
        stages[name] = StagePlan(
            name=name,
            kind=spec.kind,
            modality=spec.output_modality,
            roles=roles[name],
            final=name in final,
            upstream=tuple(e.source for e in ups),
            edges=tuple(outs),
            streamed_input=streamed,
            input_processor=processor,
        )
    return Plan(stages=stages, entry=entry, final=tuple(final))


def companion_inputs(
    topology: PipelineSpec, stage: str, entry: dict[str, Any], negative_prompt: str | None
) -> dict[str, dict[str, Any]]:
    """The inline input of each companion role of `stage`: the primary's, with its prompt (the last
    user message of a chat) replaced by `negative_prompt` or the companion's default."""
    out = {}
    for companion in topology.stage(stage).companions:
        text = negative_prompt or companion.negative_prompt
        data = {k: v for k, v in entry.items() if k != "negative_prompt"}
        if "messages" in entry:
            messages = [dict(m) for m in entry["messages"]]
            users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
            if users:
                messages[users[-1]]["content"] = text
            else:
                messages.append({"role": "user", "content": text})
            data["messages"] = messages
        else:
            data["prompt"] = text
        out[companion.role] = data
    return out
