"""The router's OpenAPI document says what the routes really answer (fuzzers and client generators read it)."""

from __future__ import annotations

import json

from servelib import echo_pipeline

from omni_runtime.router.app import build_app
from omni_runtime.router.errors import BadRequest, error_response
from omni_runtime.spec import PipelineSpec, StageSpec
from omni_runtime.wire.auth import PipelineKey


def document() -> dict:
    topology = PipelineSpec(name="echo", stages=[StageSpec(name="llm", kind="ar", final_output=True)])
    return build_app(echo_pipeline(topology), key=PipelineKey.generate()).openapi()


def test_errors_are_documented_as_openai_errors_not_422() -> None:
    doc = document()
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            assert "422" not in operation["responses"], f"{method} {path} documents a 422 it never answers"
            if method == "post":
                bad = operation["responses"]["400"]["content"]["application/json"]["schema"]
                assert bad == {"$ref": "#/components/schemas/ErrorResponse"}, path
    # the documented shape is the one error_response writes
    body = json.loads(error_response(BadRequest("no", param="n")).body)
    error_schema = doc["components"]["schemas"]["ErrorResponse"]["properties"]["error"]
    assert set(body["error"]) == set(error_schema["required"])


def test_images_edit_documents_its_multipart_form() -> None:
    body = document()["paths"]["/v1/images/edits"]["post"]["requestBody"]
    form = body["content"]["multipart/form-data"]["schema"]
    assert form["required"] == ["image", "prompt"]
    assert form["properties"]["image"]["format"] == "binary"


def test_model_names_and_closed_bodies() -> None:
    """`model` lists the served names (others are 404s); unknown chat/completion fields are 400s (reject)."""
    schemas = document()["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]
    assert chat["additionalProperties"] is False
    assert schemas["CompletionRequest"]["additionalProperties"] is False
    assert chat["properties"]["model"]["enum"] == ["echo"]  # required in chat
    assert schemas["DetokenizeRequest"]["properties"]["model"]["anyOf"] == [
        {"type": "string", "enum": ["echo"]},
        {"type": "null"},
    ]
