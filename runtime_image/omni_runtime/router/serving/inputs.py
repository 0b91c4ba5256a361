"""From an OpenAI request to what each stage receives: entry inputs and per-stage parameters.

AR stages get sampling parameters (vLLM names); diffusion stages get image parameters (`height`,
`width`, `seed`, `num_inference_steps`, `guidance_scale`). `seed` reaches every stage, plus the
choice index for `n` > 1, so choice 0 of a seeded request matches the same request with `n` = 1.
`sampling_params_list` (vLLM-Omni) overrides per stage, in topological order.
"""

from __future__ import annotations

from typing import Any

from omni_runtime.router.errors import BadRequest
from omni_runtime.router.plan import Plan
from omni_runtime.spec import PipelineSpec, StageKind

__all__ = ["entry_inputs", "normalize_messages", "prompt_text", "stage_params"]

AR_FIELDS = (
    "temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty", "top_k", "min_p",
    "min_tokens", "ignore_eos", "repetition_penalty",
)  # fmt: skip
IMAGE_FIELDS = ("height", "width", "seed", "num_inference_steps", "guidance_scale")


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
) -> dict[str, dict[str, Any]]:
    """Inline input per entry stage: a chat for AR stages, a prompt for the others."""
    out: dict[str, dict[str, Any]] = {}
    for name in plan.entry:
        kind = topology.stage(name).kind
        if kind is StageKind.AR:
            data: dict[str, Any] = {"messages": messages or [{"role": "user", "content": prompt or ""}]}
        else:
            data = {"prompt": prompt if prompt is not None else prompt_text(messages or [])}
            if negative_prompt is not None:
                data["negative_prompt"] = negative_prompt
        if extra:
            data.update(extra)
        out[name] = data
    return out


def stage_params(
    topology: PipelineSpec,
    plan: Plan,
    *,
    ar: dict[str, Any],
    image: dict[str, Any],
    per_stage: list[dict[str, Any]] | None = None,
    choice: int = 0,
    extra: dict[str, dict[str, Any]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Parameters of every planned stage for choice `choice`; `extra` adds per-stage parameters the
    router decided (a speech stage's `voice`), under `sampling_params_list`."""
    order = topology.topological_order()
    if per_stage is not None and len(per_stage) > len(order):
        raise BadRequest(
            f"sampling_params_list has {len(per_stage)} entries but pipeline {topology.name} has "
            f"{len(order)} stages ({order}); give at most one dict per stage, in that order",
            param="sampling_params_list",
        )
    out: dict[str, dict[str, Any]] = {}
    for name in plan.stages:
        kind = topology.stage(name).kind
        base = ar if kind is StageKind.AR else image if kind is StageKind.DIFFUSION else {}
        params = {k: v for k, v in base.items() if v is not None}
        params.update((extra or {}).get(name, {}))
        if per_stage is not None and order.index(name) < len(per_stage):
            params.update(per_stage[order.index(name)] or {})
        if choice and isinstance(params.get("seed"), int):
            params["seed"] += choice
        out[name] = params
    return out
