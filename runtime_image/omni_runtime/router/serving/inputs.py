"""From an OpenAI request to what each stage receives: entry inputs and per-stage parameters.

AR stages get sampling parameters (vLLM names); diffusion stages get image parameters (`height`,
`width`, `seed`, `num_inference_steps`, `guidance_scale`). `seed` reaches every stage, plus the
choice index for `n` > 1, so choice 0 of a seeded request matches the same request with `n` = 1.
The fields about the reply's text (logprobs, structured outputs, logit bias, ...: `text_params`) go
only to the AR stages whose text is a final output (`text_stages`), never to a prompt enhancer.
`sampling_params_list` (vLLM-Omni) overrides per stage, in topological order.
"""

from __future__ import annotations

from typing import Any

from omni_runtime.router.errors import BadRequest
from omni_runtime.router.plan import Plan
from omni_runtime.router.protocol.chat import CHAT_FIELDS
from omni_runtime.router.protocol.fields import FieldRoute, by_name
from omni_runtime.spec import GRID_DECIDING_PROCESSORS, Modality, PipelineSpec, StageKind

__all__ = [
    "entry_inputs",
    "normalize_messages",
    "prompt_text",
    "render_inputs",
    "stage_params",
    "text_params",
    "text_stages",
]

AR_FIELDS = by_name(CHAT_FIELDS, FieldRoute.SAMPLING)
"""Sampling fields (vLLM names) that every AR stage gets as they are (`max_tokens` is sized apart)."""
TEXT_FIELDS = by_name(CHAT_FIELDS, FieldRoute.TEXT)
"""Sampling fields (vLLM names) that only the stage producing the reply's text gets as they are."""


def text_stages(topology: PipelineSpec, plan: Plan) -> list[str]:
    """The planned final AR stages whose output is text: where the reply's text comes from."""
    return [
        n for n in plan.final
        if topology.stage(n).kind is StageKind.AR and topology.stage(n).output_modality is Modality.TEXT
    ]  # fmt: skip


def text_params(body: Any) -> dict[str, Any]:
    """The sampling parameters of the text-producing stage, as vLLM's server derives them: `logprobs`
    (chat: `top_logprobs` when `logprobs` is true; completions: the number), `structured_outputs`
    (`response_format` overriding the constraint of vLLM's `structured_outputs`, as vLLM does) and the
    `TEXT_FIELDS` the request sets."""
    out = {k: getattr(body, k) for k in TEXT_FIELDS if getattr(body, k, None) is not None}
    logprobs = getattr(body, "logprobs", None)
    if logprobs is True:
        out["logprobs"] = getattr(body, "top_logprobs", None) or 0
    elif isinstance(logprobs, int) and not isinstance(logprobs, bool):
        out["logprobs"] = logprobs
    structured = getattr(body, "structured_outputs", None)
    params = structured.params() if structured is not None else None
    response_format = getattr(body, "response_format", None)
    constraint = response_format.structured_outputs() if response_format is not None else None
    if constraint is not None:
        params = constraint
    if params:
        out["structured_outputs"] = params
    return out


def render_inputs(fields: dict[str, Any]) -> dict[str, Any]:
    """What the entry AR stage's chat rendering gets from `add_generation_prompt`,
    `continue_final_message`, `add_special_tokens` and `chat_template_kwargs` (vLLM merges the first
    two into the template's kwargs, as here)."""
    kwargs = dict(fields.get("chat_template_kwargs") or {})
    for key in ("add_generation_prompt", "continue_final_message"):
        if key in fields:
            kwargs[key] = bool(fields[key])
    out: dict[str, Any] = {"chat_template_kwargs": kwargs} if kwargs else {}
    if "add_special_tokens" in fields:
        out["add_special_tokens"] = bool(fields["add_special_tokens"])
    return out


def normalize_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Messages as plain dicts; content made of text parts only becomes one string."""
    out = []
    for message in messages:
        m = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
        content = m.get("content")
        if isinstance(content, list) and all(p.get("type") == "text" for p in content):
            m["content"] = "\n".join(str(p.get("text", "")) for p in content)
        out.append(m)
    return out


def prompt_text(messages: list[dict[str, Any]]) -> str:
    """The last user message's text (for stages that take a prompt, not a chat)."""
    for m in reversed(messages):
        if m.get("role") == "user":
            content = m.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return "\n".join(str(p.get("text", "")) for p in content if p.get("type") == "text")
    raise BadRequest("messages has no user message with text; add one", param="messages")


def entry_inputs(
    topology: PipelineSpec,
    plan: Plan,
    *,
    messages: list[dict[str, Any]] | None = None,
    prompt: str | None = None,
    negative_prompt: str | None = None,
    extra: dict[str, Any] | None = None,
    chat: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Inline input per entry stage: a chat for AR stages (with `chat`'s rendering options), a prompt
    for the others."""
    out: dict[str, dict[str, Any]] = {}
    for name in plan.entry:
        kind = topology.stage(name).kind
        if kind is StageKind.AR:
            data: dict[str, Any] = {"messages": messages or [{"role": "user", "content": prompt or ""}]}
            data.update(chat or {})
        else:
            data = {"prompt": prompt if prompt is not None else prompt_text(messages or [])}
            if negative_prompt is not None:
                data["negative_prompt"] = negative_prompt
        if extra:
            data.update(extra)
        out[name] = data
    return out


def _decides_grid(topology: PipelineSpec, plan: Plan, name: str) -> bool:
    """Whether `name` feeds a planned stage over a `GRID_DECIDING_PROCESSORS` edge (it samples the image's grid)."""
    return any(
        e.source == name and e.target in plan.stages and e.input_processor in GRID_DECIDING_PROCESSORS
        for e in topology.edges
    )


def stage_params(
    topology: PipelineSpec,
    plan: Plan,
    *,
    ar: dict[str, Any],
    image: dict[str, Any],
    per_stage: list[dict[str, Any]] | None = None,
    choice: int = 0,
    extra: dict[str, dict[str, Any]] | None = None,
    text: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Parameters of every planned stage for choice `choice`; `text` goes to the `text_stages` only;
    `extra` adds per-stage parameters the router decided (a speech stage's `voice`), under
    `sampling_params_list`."""
    order = topology.topological_order()
    if per_stage is not None and len(per_stage) > len(order):
        raise BadRequest(
            f"sampling_params_list has {len(per_stage)} entries but pipeline {topology.name} has "
            f"{len(order)} stages ({order}); give at most one dict per stage, in that order",
            param="sampling_params_list",
        )
    out: dict[str, dict[str, Any]] = {}
    texts = set(text_stages(topology, plan)) if text else set()
    for name in plan.stages:
        kind = topology.stage(name).kind
        base = ar if kind is StageKind.AR else image if kind is StageKind.DIFFUSION else {}
        if kind is StageKind.GENERATION and _decides_grid(topology, plan, name):
            base = {k: image.get(k) for k in ("seed", "width", "height")}
        params = {k: v for k, v in base.items() if v is not None}
        if name in texts:
            params.update(text or {})
        params.update((extra or {}).get(name, {}))
        if per_stage is not None and order.index(name) < len(per_stage):
            params.update(per_stage[order.index(name)] or {})
        if choice and isinstance(params.get("seed"), int):
            params["seed"] += choice
        out[name] = params
    return out
