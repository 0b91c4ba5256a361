"""The router's OpenAPI document (`GET /openapi.json`), made truthful about what the routes answer.

FastAPI's generated document says a bad body is a 422 `HTTPValidationError`; the router answers every
error with OpenAI's shape (`errors.error_response`) and the statuses below, and fuzzers and client
generators read this document. `/v1/images/edits` reads a multipart form by hand, so its body is
described here too. `model` lists the names this server answers to (any other is a 404), and the chat
and completion bodies are closed (`additionalProperties: false`) when unknown fields are refused.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ERROR_SCHEMA", "REJECTING_BODIES", "document"]

ERROR_SCHEMA: dict[str, Any] = {
    "title": "ErrorResponse",
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string", "description": "What was seen, what is allowed, what to change."},
                "type": {"type": "string", "description": "OpenAI's error type, e.g. BadRequestError."},
                "param": {"type": ["string", "null"], "description": "The request field at fault, if one is."},
                "code": {"type": "integer", "description": "The HTTP status."},
            },
        }
    },
}

_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}

_STATUSES = {
    "400": "The request is invalid (body, field values, or a field this pipeline cannot honour).",
    "401": "No API key, or a wrong one (when the pipeline has one).",
    "404": "Unknown model or route.",
    "413": "The body is over router.limits.maxBodyBytes.",
    "429": "Admission is full (in flight and queued); retry after Retry-After seconds.",
    "499": "The client went away before the answer.",
    "500": "A stage's engine failed on the request.",
    "502": "The replica running the request went away.",
    "503": "No ready replica of a stage, or the router is draining; retry after Retry-After seconds.",
    "504": "The request ran past router.limits.requestTimeoutS.",
}
"""Error statuses of the routes that run work on the stages (every one in OpenAI's error shape)."""

_INFO_ROUTES = {"/v1/models": ("401",), "/v1/audio/voices": ("401",), "/health": ("503",)}
"""Routes that run nothing on the stages, with the errors they can still answer."""

REJECTING_BODIES = ("ChatCompletionRequest", "CompletionRequest", "ImageGenerationRequest")
"""Request bodies whose unknown fields are a 400 under `router.unknownFields: reject`."""

_EDIT_FORM: dict[str, Any] = {
    "type": "object",
    "required": ["image", "prompt"],
    "properties": {
        "image": {"type": "string", "format": "binary", "description": "The image to edit."},
        "prompt": {"type": "string", "minLength": 1},
        "model": {"type": "string"},
        "n": {"type": "integer", "minimum": 1},
        "size": {"type": "string", "description": "WIDTHxHEIGHT, e.g. 512x512, or 'auto'."},
        "seed": {"type": "integer"},
        "negative_prompt": {"type": "string"},
        "num_inference_steps": {"type": "integer", "minimum": 1},
        "response_format": {"type": "string", "enum": ["b64_json"]},
    },
}


def _error_responses(statuses: tuple[str, ...]) -> dict[str, Any]:
    return {
        code: {"description": _STATUSES[code], "content": {"application/json": {"schema": _ERROR_REF}}}
        for code in statuses
    }


def document(schema: dict[str, Any], *, model_names: list[str], closed_bodies: tuple[str, ...] = ()) -> dict[str, Any]:
    """`schema` (FastAPI's generated document) with the router's real error responses, the images edit
    form, `model` limited to `model_names`, and the bodies named in `closed_bodies` refusing unknown
    fields. Pure: returns the changed document."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    components["ErrorResponse"] = ERROR_SCHEMA
    for name, body in components.items():
        model = body.get("properties", {}).get("model") if name.endswith("Request") else None
        if model is not None:
            names = {"type": "string", "enum": list(model_names)}
            nullable = "model" not in body.get("required", [])
            body["properties"]["model"] = {
                **{k: v for k, v in model.items() if k in ("title", "description", "default")},
                **({"anyOf": [names, {"type": "null"}]} if nullable else names),
            }
        if name in closed_bodies:
            body["additionalProperties"] = False
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            if path in _INFO_ROUTES:
                responses.update(_error_responses(_INFO_ROUTES[path]))
            elif path.startswith("/v1/") or path in ("/tokenize", "/detokenize"):
                responses.update(_error_responses(tuple(_STATUSES)))
            if path == "/v1/images/edits" and method == "post":
                form = {**_EDIT_FORM, "properties": {**_EDIT_FORM["properties"]}}
                form["properties"]["model"] = {"type": "string", "enum": list(model_names)}
                operation["requestBody"] = {"required": True, "content": {"multipart/form-data": {"schema": form}}}
    return schema
