"""CFG companions: what a companion request's input is, and which companions a request runs.

An AR stage with `companions` (spec `CompanionSpec`) runs, beside each primary request, one more context
per companion, and the next stage receives every role's output together (`processors.edges`). This
module is the one place that says how a companion's input derives from the primary's (the router builds
it for entry stages; the AR engine for companions it runs itself) and which companions a request asks
for (a companion whose guidance scale is 1 adds nothing, so it does not run). Pure functions over the
plain dicts the wire carries; importing this imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from omni_runtime.spec import CompanionDrops, CompanionSpec, PipelineSpec

__all__ = ["NO_GUIDANCE", "companion_input", "unweighted_companions"]

NO_GUIDANCE = 1.0
"""A guidance scale of 1 weights the conditional prediction alone: the companion's output is not used."""

_IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})
"""Chat content part types that carry an image (OpenAI's and vLLM's names)."""


def companion_input(
    companion: CompanionSpec, primary: Mapping[str, Any], negative_prompt: str | None
) -> dict[str, Any]:
    """The input of `companion`, derived from the primary request's input `primary` (a chat `messages`, or a
    `prompt`, with optional `image` / `negative_prompt` keys).

    `drops: text`: the text of the last user message (or the prompt) becomes `negative_prompt` (the request's),
    else the companion's default; the images stay. `drops: image`: every image is removed (the `image` key
    and the image parts of every message); the text stays. The primary's `negative_prompt` key never travels:
    a companion's input is its own context."""
    data = {k: v for k, v in primary.items() if k != "negative_prompt"}
    if companion.drops is CompanionDrops.IMAGE:
        data.pop("image", None)
        if "messages" in data:
            data["messages"] = [_without_images(m) for m in data["messages"]]
        return data
    text = negative_prompt or companion.negative_prompt
    if "messages" in data:
        messages = [dict(m) for m in data["messages"]]
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        if users:
            messages[users[-1]]["content"] = _replace_text(messages[users[-1]].get("content"), text)
        else:
            messages.append({"role": "user", "content": text})
        data["messages"] = messages
    else:
        data["prompt"] = text
    return data


def _replace_text(content: Any, text: str) -> Any:
    """A user message's content with its text replaced by `text` and its image parts kept."""
    if not isinstance(content, list):
        return text
    images = [p for p in content if isinstance(p, Mapping) and p.get("type") in _IMAGE_PARTS]
    return [*images, {"type": "text", "text": text}] if images else text


def _without_images(message: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        kept = [p for p in content if not (isinstance(p, Mapping) and p.get("type") in _IMAGE_PARTS)]
        texts = [p for p in kept if isinstance(p, Mapping) and p.get("type") == "text"]
        out["content"] = "\n".join(str(p.get("text", "")) for p in texts) if len(texts) == len(kept) else kept
    return out


def unweighted_companions(
    topology: PipelineSpec, stage: str, params: Mapping[str, Mapping[str, Any]], stages: Iterable[str]
) -> frozenset[str]:
    """The roles of `stage`'s companions that this request does not need: those with a `guidance` parameter
    whose value is 1 in the params a downstream stage gets (`params`: stage name -> request params, the
    stage's `sampling_params` the defaults). Only stages in `stages` (the planned ones) count.

    A guidance parameter that no planned downstream stage has (neither requested nor defaulted) leaves its
    companion running: without a scale there is no knowing it is unused."""
    planned = set(stages)
    downstream = [e.target for e in topology.edges if e.source == stage and e.target in planned]
    skip = set()
    for companion in topology.stage(stage).companions:
        if companion.guidance is None:
            continue
        for target in downstream:
            value = params.get(target, {}).get(companion.guidance)
            if value is None:
                value = topology.stage(target).sampling_params.get(companion.guidance)
            if value is not None:
                if float(value) == NO_GUIDANCE:
                    skip.add(companion.role)
                break
    return frozenset(skip)
