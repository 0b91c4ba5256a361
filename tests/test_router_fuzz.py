"""Fuzzing the router through its own OpenAPI schema (schemathesis + Hypothesis) on a served pipeline.

`omnikube serve` of the text-chat pipeline on the tiny Qwen2 model (real vLLM): the session's shared
serve (`chat_serve` in conftest.py; servelib.chat_serve_spec), so the tool-call parser is on and the
admission limits are low (a 429 is an OpenAI-shaped 4xx like any other). Schemathesis reads the
router's `/openapi.json` and sends every route schema-valid and schema-breaking requests. For each reply:
no 5xx, no hang (a per-request timeout), and every 4xx in OpenAI's error shape. Afterwards the stage
still serves: a normal chat request succeeds and no payload is left held.

Reproducible in CI: Hypothesis is derandomized (its seed is derived from the test), the example count
per route is bounded so the module costs about a minute once vLLM is up, and no example database is kept.
"""

from __future__ import annotations

import json

import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from servelib import CHAT_LIMITS, CHAT_MODEL, busy_shm_segments

from omni_runtime.router.routes import ROUTES

pytestmark = [pytest.mark.models, pytest.mark.timeout(900)]

REQUEST_TIMEOUT_S = CHAT_LIMITS["request_timeout_s"] + 30
"""Per request: a reply slower than this is a hang (the router's own request timeout is lower: a request
running past it gets a 504, which `not_a_server_error` reports)."""

EXAMPLES = 20
"""Examples per route and generation mode (schema-valid, schema-breaking)."""


@pytest.fixture
def serve(chat_serve):
    """The session's shared text-chat serve (conftest.py)."""
    return chat_serve


@pytest.fixture(scope="module")
def router_schema(chat_serve):
    return schemathesis.openapi.from_url(f"{chat_serve.base}/openapi.json", timeout=30)


def openai_error_shape(ctx, response, case) -> bool | None:
    """Every 4xx is `{"error": {"message": str, "type": str, "param": str|null, "code": int}}`."""
    if not 400 <= response.status_code < 500:
        return None
    body = json.loads(response.content)
    error = body.get("error") if isinstance(body, dict) else None
    assert isinstance(error, dict), f"4xx body is not OpenAI's error shape: {body!r}"
    assert isinstance(error.get("message"), str) and error["message"], f"no message: {body!r}"
    assert isinstance(error.get("type"), str) and error["type"], f"no type: {body!r}"
    assert error.get("code") == response.status_code, f"code is not the status: {body!r}"
    assert error.get("param") is None or isinstance(error["param"], str), f"param: {body!r}"
    return True


FUZZ_SETTINGS = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=EXAMPLES,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: the failing request is reported as sent
    suppress_health_check=list(HealthCheck),
)


BODY_ROUTES = [r for r in ROUTES if r.startswith(("/v1/chat", "/v1/completions", "/tokenize", "/detokenize",
                                                 "/v1/images", "/v1/audio/speech"))]  # fmt: skip
"""The routes that take a body: the only ones a schema-breaking request can be made for."""
CASES = [(p, GenerationMode.POSITIVE) for p in ROUTES] + [(p, GenerationMode.NEGATIVE) for p in BODY_ROUTES]

UNSET_MAX_TOKENS = 64
"""max_tokens given to a schema-valid chat or completion request that sets neither max_tokens nor
max_completion_tokens. Unset, the stage generates up to what remains of the shared serve's context
(CHAT_MAX_MODEL_LEN, 2048: eight times the 256 this module's own serve had), and a few such requests took
most of the module's time, minutes on a loaded machine, near the router's request timeout. Requests that
set a value keep it. The unset path itself is compared with vLLM's server in
test_openai_conformance.py::test_max_tokens_default_is_what_remains_of_the_context."""
GENERATING = ("/v1/chat/completions", "/v1/completions")


def bound_generation(case, mode: GenerationMode) -> None:
    """Sets UNSET_MAX_TOKENS on a schema-valid generating request that asks for no length (see there)."""
    body = case.body
    if mode is GenerationMode.POSITIVE and case.path in GENERATING and isinstance(body, dict):
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = UNSET_MAX_TOKENS


@pytest.mark.parametrize(("path", "mode"), CASES, ids=[f"{p}-{m.value}" for p, m in CASES])
def test_fuzz_route(router_schema, serve, path: str, mode: GenerationMode) -> None:
    """Schema-valid (positive) and schema-breaking (negative) requests to one route: no 5xx, no hang,
    every 4xx OpenAI-shaped. (schemathesis' own pytest plugin does not run on this pytest, so the
    Hypothesis test is built here from the operation's strategy.)"""
    operations = [r.ok() for r in router_schema.get_all_operations() if r.ok().path == path]
    assert operations, f"{path} is served but missing from /openapi.json"
    if mode is GenerationMode.NEGATIVE:
        assert all(op.body for op in operations), f"{path} documents no body to break"
    for operation in operations:

        @FUZZ_SETTINGS
        @given(case=operation.as_strategy(generation_mode=mode))
        def fuzz(case) -> None:
            bound_generation(case, mode)
            response = case.call(base_url=serve.base, timeout=REQUEST_TIMEOUT_S)
            case.validate_response(response, checks=[not_a_server_error, openai_error_shape])

        fuzz()


def test_stages_keep_serving_after_fuzzing(serve) -> None:
    """Runs after the fuzz tests (file order): the stage answers a plain chat and holds nothing."""
    serve.wait_idle(["llm"], timeout=60)
    client = openai.OpenAI(base_url=serve.endpoint, api_key="none", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model=CHAT_MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0
    )
    client.close()
    assert reply.choices[0].message.content
    serve.wait_idle(["llm"], timeout=60)
    assert busy_shm_segments(serve.name) == []
