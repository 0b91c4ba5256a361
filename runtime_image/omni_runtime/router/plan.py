"""Planning a request over the pipeline's DAG: which stages run, which of them answer the client, which
edges stream. Pure functions of the topology and the requested modalities.

- The stages that run are the final-output stages producing a requested modality plus everything
  upstream of them (Qwen-Omni asked for text only runs the thinker alone).
- A stage's companions (CFG) run beside its primary only on entry stages with downstream work; their
  input is the primary's less its text (the request's `negative_prompt`, else the companion's default) or
  its images; a companion whose guidance scale the request sets to 1 does not run
  (`without_unweighted_companions`).
- An edge streams (`window` > 0) only when its target has that one upstream edge and its source runs no
  companions; otherwise the whole output travels as one handle.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from omni_runtime.processors.companions import companion_input, unweighted_companions
from omni_runtime.spec import CONTEXT_ONLY_PROCESSORS, Modality, PipelineSpec, StageKind
from omni_runtime.wire.protocol import EdgeOut

__all__ = [
    "Plan",
    "StagePlan",
    "chat_modalities",
    "companion_inputs",
    "context_drawn",
    "edit_entry",
    "plan_edit",
    "plan_request",
    "producible_modalities",
    "without_unweighted_companions",
]

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
    context_only: bool = False
    """Every planned edge out of it reads only its context (`CONTEXT_ONLY_PROCESSORS`): an AR stage prefills and
    stops."""
    think: bool = False
    """Its context-only edges are planned and it answers too (a final stage): BAGEL's think mode, where the
    stage writes its reasoning (the answer) and then prefills the context with it (`wire.protocol.Submit.think`)."""


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


def context_drawn(topology: PipelineSpec) -> dict[str, str]:
    """Modality -> the stage whose context draws it: the modalities a final stage makes from a context-only edge
    (`CONTEXT_ONLY_PROCESSORS`) out of a stage that answers in text itself (BAGEL's images, from the thinker's KV).
    Such a stage either answers or prefills a context for the other, not both in one request."""
    out: dict[str, str] = {}
    for stage in topology.stages:
        if not stage.final_output:
            continue
        for edge in topology.upstream(stage.name):
            source = topology.stage(edge.source)
            if edge.input_processor in CONTEXT_ONLY_PROCESSORS and source.final_output:
                out.setdefault(stage.output_modality.value, source.name)
    return out


def chat_modalities(topology: PipelineSpec, wanted: list[str] | None) -> list[str]:
    """What a chat asking for `wanted` (None: nothing said) gets: the producible modalities, less those drawn from a
    context (`context_drawn`) when it names none: drawing is asked for. Asking for the answering stage's text and
    such a modality together is think mode (`StagePlan.think`): the text is the reasoning the drawing follows."""
    drawn = context_drawn(topology)
    if wanted is None:
        return [m for m in producible_modalities(topology) if m not in drawn]
    return wanted


def edit_entry(topology: PipelineSpec) -> str | None:
    """The stage an image edit enters at when that stage builds the edit's context itself: a final image stage
    taking images whose every upstream edge reads only a context (`CONTEXT_ONLY_PROCESSORS`). BAGEL's dit: an
    edit's context starts with the input image's VAE tokens, which only its generation expert computes, so the
    thinker (vLLM, no generation expert) cannot prefill it. None: edits enter at the entry stages as usual."""
    for stage in topology.stages:
        ups = topology.upstream(stage.name)
        if (
            stage.final_output
            and stage.output_modality is Modality.IMAGE
            and Modality.IMAGE in stage.input_modalities
            and ups
            and all(e.input_processor in CONTEXT_ONLY_PROCESSORS for e in ups)
        ):
            return stage.name
    return None


def plan_edit(topology: PipelineSpec) -> Plan:
    """The plan of an image edit: the `edit_entry` stage alone when there is one, else the plan for images."""
    name = edit_entry(topology)
    if name is None:
        return plan_request(topology, ["image"])
    spec = topology.stage(name)
    only = StagePlan(name=name, kind=spec.kind, modality=spec.output_modality, final=True)
    return Plan(stages={name: only}, entry=(name,), final=(name,))


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
        out_edges = [e for e in edges if e.source == name]
        context_only = bool(out_edges) and all(e.input_processor in CONTEXT_ONLY_PROCESSORS for e in out_edges)
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
            context_only=context_only and name not in final,
            think=context_only and name in final,
        )
    return Plan(stages=stages, entry=entry, final=tuple(final))


def companion_inputs(
    topology: PipelineSpec, stage: str, entry: dict[str, Any], negative_prompt: str | None, roles: tuple[str, ...]
) -> dict[str, dict[str, Any]]:
    """The inline input of each companion role of `stage` in `roles`, derived from the primary's `entry`
    (`processors.companions.companion_input`: its text replaced by `negative_prompt` or the companion's
    default, or its images dropped)."""
    return {
        c.role: companion_input(c, entry, negative_prompt) for c in topology.stage(stage).companions if c.role in roles
    }


def without_unweighted_companions(topology: PipelineSpec, plan: Plan, params: dict[str, dict[str, Any]]) -> Plan:
    """`plan` less the companions this request's guidance makes useless (a scale of 1:
    `processors.companions.unweighted_companions`), so that no work for them is ever sent."""
    stages = dict(plan.stages)
    for name, sp in plan.stages.items():
        if len(sp.roles) == 1:
            continue
        skip = unweighted_companions(topology, name, params, plan.stages)
        if skip:
            stages[name] = dataclasses.replace(sp, roles=tuple(r for r in sp.roles if r not in skip))
    return dataclasses.replace(plan, stages=stages)
