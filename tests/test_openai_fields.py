"""The router's field policy for `/v1/chat/completions` and `/v1/completions`: every field in
`FORWARDED` reaches the stage that honours it, every field in `REFUSED` is a 400 naming it, an unknown
field is a 400 unless the pipeline says `unknownFields: ignore`, and a field no planned stage can
honour (logprobs where a DiT makes the reply) is a 400 naming it.

Stage servers run the EchoEngine (see its docstring: the router's side is what is checked here, and
`seen` shows exactly what a stage received); the same fields against real vLLM are compared with
vLLM's own server in test_openai_conformance.py.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from servelib import chat_topology, echo_cluster, echo_pipeline

from omni_runtime.router.protocol.chat import (
    CHAT_FIELDS,
    FORWARDED,
    REFUSED,
    RENDER_ONLY,
    TEXT_ONLY,
    TOOL_FIELDS,
    ChatCompletionRequest,
)
from omni_runtime.router.protocol.completions import COMPLETION_FORWARDED, COMPLETION_REFUSED, CompletionRequest
from omni_runtime.router.protocol.fields import FieldRoute, Forwarded, by_name, routed_to
from omni_runtime.router.protocol.images import IMAGE_REFUSED
from omni_runtime.router.serving.inputs import AR_FIELDS, TEXT_FIELDS
from omni_runtime.router.serving.logprobs import chat_logprobs, completion_logprobs
from omni_runtime.spec import EdgeSpec, PipelineSpec, RouterLimits, StageSpec

pytestmark = pytest.mark.timeout(120)


def enhancer_then_dit() -> PipelineSpec:
    """An AR prompt enhancer feeding an image stage: the reply has no text."""
    return PipelineSpec(
        name="t2i",
        stages=[
            StageSpec(name="enhancer", kind="ar"),
            StageSpec(name="dit", kind="diffusion", final_output=True, output_modality="image"),
        ],
        edges=[EdgeSpec(**{"from": "enhancer", "to": "dit", "connector": "shm"})],
    )


def thinker_then_talker() -> PipelineSpec:
    """A thinker whose text is a final output and a talker that speaks it."""
    return PipelineSpec(
        name="speech",
        stages=[
            StageSpec(name="thinker", kind="ar", final_output=True),
            StageSpec(name="talker", kind="generation", final_output=True, output_modality="audio"),
        ],
        edges=[EdgeSpec(**{"from": "thinker", "to": "talker", "connector": "shm"})],
    )


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


CHAT_VALUES: dict[str, tuple[Any, str, Any]] = {
    # field: (value sent, key the stage gets, value the stage gets)
    "max_tokens": (5, "max_tokens", 5),
    "max_completion_tokens": (6, "max_tokens", 6),
    "temperature": (0.5, "temperature", 0.5),
    "top_p": (0.9, "top_p", 0.9),
    "seed": (3, "seed", 3),
    "stop": (["zz"], "stop", ["zz"]),
    "presence_penalty": (0.1, "presence_penalty", 0.1),
    "frequency_penalty": (0.2, "frequency_penalty", 0.2),
    "top_k": (4, "top_k", 4),
    "min_p": (0.05, "min_p", 0.05),
    "min_tokens": (1, "min_tokens", 1),
    "ignore_eos": (True, "ignore_eos", True),
    "repetition_penalty": (1.1, "repetition_penalty", 1.1),
    "logprobs": (True, "logprobs", 0),
    "top_logprobs": (2, "logprobs", 2),  # sent with logprobs: true
    "logit_bias": ({"5": 1.5}, "logit_bias", {"5": 1.5}),
    "response_format": ({"type": "json_object"}, "structured_outputs", {"json_object": True}),
    "structured_outputs": ({"regex": "a+"}, "structured_outputs", {"regex": "a+"}),
    "stop_token_ids": ([7], "stop_token_ids", [7]),
    "include_stop_str_in_output": (True, "include_stop_str_in_output", True),
    "skip_special_tokens": (False, "skip_special_tokens", False),
    "spaces_between_special_tokens": (False, "spaces_between_special_tokens", False),
    "bad_words": (["bad"], "bad_words", ["bad"]),
    "allowed_token_ids": ([1, 2], "allowed_token_ids", [1, 2]),
}
RENDER_VALUES: dict[str, tuple[Any, str, Any]] = {
    "add_generation_prompt": (False, "chat_template_kwargs", {"add_generation_prompt": False}),
    "continue_final_message": (True, "chat_template_kwargs", {"continue_final_message": True}),
    "add_special_tokens": (True, "add_special_tokens", True),
    "chat_template_kwargs": ({"enable_thinking": False}, "chat_template_kwargs", {"enable_thinking": False}),
}
TOOL = {"type": "function", "function": {"name": "get_tide", "parameters": {"type": "object", "properties": {}}}}
TOOL_VALUES: dict[str, tuple[Any, str, Any]] = {
    # the chat stage gets them beside the messages (vLLM's request model checks them there)
    "tools": ([TOOL], "tools", [TOOL]),
    "tool_choice": ("required", "tool_choice", "required"),  # sent with tools
    "parallel_tool_calls": (False, "parallel_tool_calls", False),
}
ROUTER_SIDE = {"model", "messages", "modalities", "audio", "n", "stream", "stream_options", "user", "echo",
               "sampling_params_list", "negative_prompt", "size", "height", "width", "num_inference_steps",
               "guidance_scale"}  # fmt: skip
"""Forwarded fields the router itself acts on, or that other suites cover (speech, images)."""


def test_the_lists_cover_the_request_models() -> None:
    assert set(FORWARDED) == set(ChatCompletionRequest.model_fields)
    assert set(COMPLETION_FORWARDED) == set(CompletionRequest.model_fields)
    assert not set(REFUSED) & set(FORWARDED) and not set(COMPLETION_REFUSED) & set(COMPLETION_FORWARDED)
    assert set(FORWARDED) == set(CHAT_VALUES) | set(RENDER_VALUES) | set(TOOL_VALUES) | ROUTER_SIDE
    assert set(RENDER_VALUES) == RENDER_ONLY and TEXT_ONLY <= set(CHAT_VALUES) | {"echo"}
    assert set(TOOL_VALUES) == TOOL_FIELDS


def test_where_a_field_goes_is_declared_once_and_read_by_the_checks_and_the_routing() -> None:
    """The 400 checks and the routing follow each field's typed route, never the words describing it."""
    assert set(CHAT_FIELDS) == set(FORWARDED)
    assert all(FORWARDED[k].startswith(f.route.value) for k, f in CHAT_FIELDS.items())
    text = {k for k, f in CHAT_FIELDS.items() if f.route is FieldRoute.TEXT}
    assert TEXT_ONLY == text | {"echo"} and CHAT_FIELDS["echo"].route is FieldRoute.ROUTER
    assert set(TEXT_FIELDS) == {k for k in text if CHAT_FIELDS[k].by_name}
    assert set(TEXT_FIELDS) == {"logit_bias", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
                                "spaces_between_special_tokens", "bad_words", "allowed_token_ids"}  # fmt: skip
    assert set(AR_FIELDS) == {"temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty", "top_k",
                              "min_p", "min_tokens", "ignore_eos", "repetition_penalty"}  # fmt: skip
    assert RENDER_ONLY == routed_to(CHAT_FIELDS, FieldRoute.RENDER) and TOOL_FIELDS == set(TOOL_VALUES)
    # a field's description is prose only: rewording it moves nothing
    reworded = {**CHAT_FIELDS, "logit_bias": Forwarded(FieldRoute.TEXT, "now described otherwise")}
    assert by_name(reworded, FieldRoute.TEXT) == TEXT_FIELDS and "logit_bias" not in AR_FIELDS


async def test_every_forwarded_chat_field_reaches_the_stage() -> None:
    async with echo_cluster(echo_pipeline(chat_topology())) as cluster, httpx.AsyncClient(base_url=cluster.base) as h:
        engine = cluster.engines["llm"][0]
        for name, (value, key, expected) in {**CHAT_VALUES, **RENDER_VALUES, **TOOL_VALUES}.items():
            body = {"model": "echo", "messages": user("hello sea"), name: value}
            if name == "top_logprobs":
                body["logprobs"] = True
            if name in TOOL_VALUES:
                body["tools"] = [TOOL]
            reply = await h.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, (name, reply.text)
            seen = engine.seen[-1]
            got = (seen.data if name in RENDER_VALUES or name in TOOL_VALUES else seen.params).get(key)
            assert got == expected, name


async def test_refused_and_unknown_fields_are_400s_naming_them() -> None:
    async with echo_cluster(echo_pipeline(chat_topology())) as cluster, httpx.AsyncClient(base_url=cluster.base) as h:
        for name, (reason, default) in REFUSED.items():
            refused = await h.post("/v1/chat/completions", json={"model": "echo", "messages": user("x"), name: "on"})
            assert refused.status_code == 400, name
            error = refused.json()["error"]
            assert error["param"] == name and error["message"] == f"{name} is not supported: {reason}"
            if default is not None:  # a client sending the default is not asking for anything
                ok = await h.post("/v1/chat/completions", json={"model": "echo", "messages": user("x"), name: default})
                assert ok.status_code == 200, name
        for name in COMPLETION_REFUSED:
            refused = await h.post("/v1/completions", json={"model": "echo", "prompt": "x", name: "on"})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == name, name

        for path, body in [("/v1/chat/completions", {"messages": user("x")}), ("/v1/completions", {"prompt": "x"})]:
            unstreamed = await h.post(path, json={"model": "echo", **body, "stream_options": {"include_usage": True}})
            assert unstreamed.status_code == 400 and "stream_options only applies" in unstreamed.text, path

        per_request = {"regex": "a+", "disable_any_whitespace": True}  # vLLM reads it engine-wide only
        ignored = await h.post(
            "/v1/chat/completions", json={"model": "echo", "messages": user("x"), "structured_outputs": per_request}
        )
        assert ignored.status_code == 400 and "['disable_any_whitespace']" in ignored.json()["error"]["message"]

        unknown = await h.post("/v1/chat/completions", json={"model": "echo", "messages": user("x"), "temprature": 1})
        assert unknown.status_code == 400
        assert unknown.json()["error"]["param"] == "temprature"
        assert "unknown fields ['temprature']" in unknown.json()["error"]["message"]
        assert "router.unknownFields: ignore" in unknown.json()["error"]["message"]
        unknown = await h.post("/v1/completions", json={"model": "echo", "prompt": "x", "frobnicate": 1})
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "frobnicate"


async def test_unknown_fields_ignore_mode_drops_them_but_still_refuses() -> None:
    pipeline = echo_pipeline(chat_topology(), limits=RouterLimits(unknown_fields="ignore"))
    async with echo_cluster(pipeline) as cluster, httpx.AsyncClient(base_url=cluster.base) as h:
        ok = await h.post("/v1/chat/completions", json={"model": "echo", "messages": user("a b"), "vendor_x": 1})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "a b "
        assert "vendor_x" not in cluster.engines["llm"][0].seen[-1].params
        functions = [{"name": "f"}]
        refused = await h.post(
            "/v1/chat/completions", json={"model": "echo", "messages": user("x"), "functions": functions}
        )
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "functions"


async def test_image_fields_not_honoured_are_400s_naming_them() -> None:
    """OpenAI's image fields this server does not honour (quality, style, output_format jpeg, a mask...) and
    unknown ones are 400s before any stage works; a refused field sent at what the server does anyway
    (output_format png) is accepted. (The echo DiT draws nothing: the accepted request is only checked not
    to be refused for that field.)"""
    async with (
        echo_cluster(echo_pipeline(enhancer_then_dit(), name="t2i")) as cluster,
        httpx.AsyncClient(base_url=cluster.base) as h,
    ):
        for name, (reason, _default) in IMAGE_REFUSED.items():
            if name == "mask":
                continue  # a file of the edit form: tests/test_serve_t2i.py sends one
            reply = await h.post("/v1/images/generations", json={"model": "t2i", "prompt": "a cat", name: "other"})
            assert reply.status_code == 400, name
            assert reply.json()["error"] == {"message": f"{name} is not supported: {reason}", "type": "BadRequestError",
                                             "param": name, "code": 400}  # fmt: skip
        unknown = await h.post("/v1/images/generations", json={"model": "t2i", "prompt": "a cat", "qualty": "hd"})
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "qualty"
        default = await h.post("/v1/images/generations", json={"model": "t2i", "prompt": "a", "output_format": "png"})
        assert default.json().get("error", {}).get("param") != "output_format"
        assert sum(len(s.works) for servers in cluster.servers.values() for s in servers) == 0


async def test_text_fields_on_a_pipeline_without_text_are_400s() -> None:
    async with (
        echo_cluster(echo_pipeline(enhancer_then_dit(), name="t2i")) as cluster,
        httpx.AsyncClient(base_url=cluster.base) as h,
    ):
        for name in sorted(TEXT_ONLY):
            value, _, _ = CHAT_VALUES.get(name, (True, "", None))
            body = {"model": "t2i", "messages": user("x"), name: value}
            if name == "top_logprobs":  # only valid with logprobs, which is then the field named
                body["logprobs"] = True
            reply = await h.post("/v1/chat/completions", json=body)
            assert reply.status_code == 400, name
            error = reply.json()["error"]
            named = "logprobs" if name == "top_logprobs" else name
            assert error["param"] == named and "produce none" in error["message"], name
        for path, body in [("/v1/completions", {"model": "t2i", "prompt": "a cat"}),
                           ("/tokenize", {"prompt": "a cat"}), ("/detokenize", {"tokens": [1]})]:  # fmt: skip
            reply = await h.post(path, json=body)
            assert reply.status_code == 400, path
            assert "no text output" in reply.json()["error"]["message"] and "/v1/chat/completions" in reply.text


async def test_text_fields_on_an_audio_only_reply_are_400s_naming_the_way_out() -> None:
    """Asked for audio alone, the talker makes the reply: logprobs of its codec frames do not exist."""
    async with (
        echo_cluster(echo_pipeline(thinker_then_talker(), name="speech")) as cluster,
        httpx.AsyncClient(base_url=cluster.base) as h,
    ):
        body = {"model": "speech", "messages": user("x"), "modalities": ["audio"], "logprobs": True}
        reply = await h.post("/v1/chat/completions", json=body)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "logprobs"
        assert "or ask for modalities ['text']" in reply.json()["error"]["message"]
        both = await h.post("/v1/chat/completions", json={**body, "modalities": ["text"], "max_tokens": 2})
        assert both.status_code == 200, both.text
        assert cluster.engines["thinker"][0].seen[-1].params["logprobs"] == 0


async def test_max_tokens_sizing_goes_to_the_text_stage_only() -> None:
    """No max_tokens: the text stage sizes it to its context, at most router.limits.maxTokens; a client's
    max_tokens is checked against that stage's context (by the engine); a prompt enhancer gets neither."""
    limits = RouterLimits(max_tokens=77)
    async with (
        echo_cluster(echo_pipeline(chat_topology(), limits=limits)) as cluster,
        httpx.AsyncClient(base_url=cluster.base) as h,
    ):
        engine = cluster.engines["llm"][0]
        assert (await h.post("/v1/chat/completions", json={"model": "echo", "messages": user("x")})).status_code == 200
        params = engine.seen[-1].params
        assert params["context_max_tokens"] == 77 and "max_tokens" not in params and "check_max_tokens" not in params
        body = {"model": "echo", "messages": user("x"), "max_completion_tokens": 9}
        assert (await h.post("/v1/chat/completions", json=body)).status_code == 200
        params = engine.seen[-1].params
        assert params["max_tokens"] == 9 and params["check_max_tokens"] is True and "context_max_tokens" not in params
    async with (
        echo_cluster(echo_pipeline(enhancer_then_dit(), name="t2i")) as cluster,
        httpx.AsyncClient(base_url=cluster.base) as h,
    ):
        assert (await h.post("/v1/chat/completions", json={"model": "t2i", "messages": user("x")})).status_code == 200
        params = cluster.engines["enhancer"][0].seen[-1].params
        assert "context_max_tokens" not in params and "check_max_tokens" not in params


async def test_tools_need_the_stage_that_renders_the_chat_and_writes_the_text() -> None:
    """A prompt enhancer renders the chat but a DiT makes the reply; a talker makes an audio-only reply:
    nothing could call a tool, so the request is a 400 naming the field."""
    async with (
        echo_cluster(echo_pipeline(enhancer_then_dit(), name="t2i")) as cluster,
        httpx.AsyncClient(base_url=cluster.base) as h,
    ):
        for name in sorted(TOOL_FIELDS):
            body = {"model": "t2i", "messages": user("x"), "tools": [TOOL], name: TOOL_VALUES[name][0]}
            reply = await h.post("/v1/chat/completions", json=body)
            assert reply.status_code == 400, name
            error = reply.json()["error"]
            assert error["param"] == name
            assert "renders the chat and writes the reply's text" in error["message"]
    async with (
        echo_cluster(echo_pipeline(thinker_then_talker(), name="speech")) as cluster,
        httpx.AsyncClient(base_url=cluster.base) as h,
    ):
        body = {"model": "speech", "messages": user("x"), "modalities": ["audio"], "tools": [TOOL]}
        reply = await h.post("/v1/chat/completions", json=body)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "tools"
        assert "or ask for modalities ['text']" in reply.json()["error"]["message"]
        text = await h.post("/v1/chat/completions", json={**body, "modalities": ["text"], "max_tokens": 2})
        assert text.status_code == 200, text.text
        assert cluster.engines["thinker"][0].seen[-1].data["tools"] == [TOOL]


async def test_echo_and_completions_on_the_echo_engine() -> None:
    async with echo_cluster(echo_pipeline(chat_topology())) as cluster, httpx.AsyncClient(base_url=cluster.base) as h:
        messages = [*user("go on"), {"role": "assistant", "content": "so far"}]
        body = {"model": "echo", "messages": messages, "echo": True, "add_generation_prompt": False}
        reply = await h.post("/v1/chat/completions", json=body)
        assert reply.json()["choices"][0]["message"]["content"].startswith("so far")

        done = await h.post("/v1/completions", json={"model": "echo", "prompt": "one two", "echo": True, "n": 2})
        assert done.status_code == 200
        assert [c["text"] for c in done.json()["choices"]] == ["one twoone two "] * 2
        assert cluster.engines["llm"][0].seen[-1].params["max_tokens"] == 16  # OpenAI's default

        batch = await h.post("/v1/completions", json={"model": "echo", "prompt": ["a", "b"]})
        assert batch.status_code == 400 and "one prompt per request" in batch.json()["error"]["message"]
        echo_ids = await h.post("/v1/completions", json={"model": "echo", "prompt": [1, 2], "echo": True})
        assert echo_ids.status_code == 400 and echo_ids.json()["error"]["param"] == "echo"


def test_logprob_rows_become_openais_shapes() -> None:
    rows = [[[5, -0.1, "a"], [6, -2.5, "b"], [7, float("-inf"), "c"]], [[9, -0.7, "é"], [5, -0.9, "a"]]]
    chat = chat_logprobs([5, 9], rows, top=2).model_dump()["content"]
    assert [(c["token"], c["logprob"], c["bytes"]) for c in chat] == [("a", -0.1, [97]), ("é", -0.7, [195, 169])]
    assert [t["token"] for t in chat[0]["top_logprobs"]] == ["a", "b"]
    assert chat_logprobs([5], rows[:1], top=0).content[0].top_logprobs == []
    legacy = completion_logprobs([5, 9], rows, top=1, text_offset=3)
    assert legacy == {
        "text_offset": [3, 4],
        "token_logprobs": [-0.1, -0.7],
        "tokens": ["a", "é"],
        "top_logprobs": [{"a": -0.1, "b": -2.5}, {"é": -0.7, "a": -0.9}],
    }
    assert completion_logprobs([7], [rows[0][2:]], top=0)["token_logprobs"] == [-9999.0]
