"""The text of `stages[].engineArgs` in the CRD, written from the engine args models' field descriptions.

`omni_runtime.spec.engine_args` holds one model per engine family; this renders each family's keys with
their type, default, bounds and description, so `kubectl explain omnipipeline.spec.stages.engineArgs`
says what the checks say and nobody edits the prose by hand. The schema of the field stays a free map:
which keys apply depends on the stage's kind and runner, which the schema cannot see.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from omni_runtime.spec.engine_args import ENGINE_ARGS_MODELS, EngineArgs

__all__ = ["engine_args_description"]

INTRO = (
    "Engine arguments merged over the topology's. Which keys a stage takes depends on its kind and, for "
    "generation stages, its `runner`; omnikube checks its own keys when it resolves the pipeline, and a wrong "
    "one makes the pipeline Degraded with reason InvalidEngineArgs (naming the stage and the key) before any "
    "pod starts."
)


def engine_args_description() -> str:
    """The CRD description of `engineArgs`: the intro, then each engine family's keys."""
    parts = [INTRO]
    for title, model in _families():
        keys = " ".join(_key_text(name, schema, defs) for name, schema, defs in _fields(model))
        parts.append(f"{title}: {keys} {model.passes_through or 'Other keys are refused.'}")
    return " ".join(parts)  # crdgen folds a description onto one line anyway: it reads as prose


def _families() -> list[tuple[str, type[EngineArgs]]]:
    """(who takes it, model) per model, in the order of ENGINE_ARGS_MODELS."""
    runners: dict[type[EngineArgs], list[str]] = {}
    kinds: dict[type[EngineArgs], str] = {}
    for (kind, runner), model in ENGINE_ARGS_MODELS.items():
        kinds.setdefault(model, kind.value)
        if runner is not None:
            runners.setdefault(model, []).append(runner)
    out = []
    for model, kind_name in kinds.items():
        named = runners.get(model)
        who = f"{kind_name} stages" + (f" with runner {' or '.join(named)}" if named else "")
        out.append((who, model))
    return out


def _fields(model: type[BaseModel]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(key, its JSON schema, the schema's $defs), a family's own keys first, then those of its bases."""
    schema = model.model_json_schema(mode="validation")
    properties, defs = schema["properties"], schema.get("$defs", {})
    order: list[str] = []
    for cls in model.__mro__:
        for name in getattr(cls, "__annotations__", {}):
            if name in properties and name not in order:
                order.append(name)
    return [(name, properties[name], defs) for name in order]


def _key_text(name: str, schema: dict[str, Any], defs: dict[str, Any]) -> str:
    """`name` (type, default): description; a nested model's keys follow, after "Its keys:"."""
    branches = [_resolve(b, defs) for b in schema.get("anyOf", [schema])]
    optional = any(b.get("type") == "null" for b in branches)
    kinds = [_type_text(b) for b in branches if b.get("type") != "null"]
    facts = [" or ".join(kinds) + (" or unset" if optional else "")]
    if schema.get("default") is not None:
        facts.append(f"default {_value(schema['default'])}")
    text = f"`{name}` ({', '.join(facts)}): {_sentence(schema.get('description', ''))}"
    for sub in (b for b in branches if "properties" in b):
        text += " Its keys: " + " ".join(_key_text(k, v, defs) for k, v in sub["properties"].items())
    return text


def _sentence(text: str) -> str:
    text = text.strip()
    return text if text.endswith(".") else text + "."


def _resolve(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in schema:
        return defs[schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def _type_text(schema: dict[str, Any]) -> str:
    if "const" in schema:
        return _value(schema["const"])
    if "enum" in schema:
        return " or ".join(_value(v) for v in schema["enum"])
    kind = {"integer": "integer", "number": "number", "boolean": "boolean", "string": "string"}.get(
        schema.get("type", ""), "object"
    )
    if schema.get("type") == "array":
        item = _type_text(schema.get("items", {}))
        kind = f"list of {item}s" + (f" (at least {schema['minItems']})" if "minItems" in schema else "")
    low, high = schema.get("minimum"), schema.get("maximum")
    if low is not None and high is not None:
        return f"{kind} from {_value(low)} to {_value(high)}"
    if low is not None:
        return f"{kind} >= {_value(low)}"
    if high is not None:
        return f"{kind} <= {_value(high)}"
    return kind


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
