"""The router as a drop-in for vLLM's OpenAI server: the same requests, through the real `openai`
client, against `omnikube serve` of the text-chat pipeline and `python -m
vllm.entrypoints.openai.api_server`, both on the tiny Qwen2 chat model with the same engine settings,
compared field by field. Ours is the session's shared serve (`chat_serve` in conftest.py, two replicas;
servelib.chat_serve_spec), and vLLM's server is started here with the same engine settings, taken from
the same servelib constants.

Greedy decoding (temperature 0, fixed seeds) makes the text comparable token for token. Logprobs are
compared to `LOGPROB_TOL` (absolute): both servers run the same vLLM build and kernels on the same
weights, so they agree far closer than that; the margin absorbs float reduction order on a loaded CPU.
Among a token's top alternatives, only those both servers list are compared (two alternatives within
the tolerance of each other may trade places at the cut). vLLM's server starts once for the module.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from servelib import CHAT_KV_BYTES, CHAT_MAX_MODEL_LEN, CHAT_MODEL, CHAT_SEED, CHAT_TOOL_PARSER, http_get

pytestmark = [pytest.mark.models, pytest.mark.timeout(1200)]

MODEL = CHAT_MODEL
MAX_MODEL_LEN = CHAT_MAX_MODEL_LEN
LOGPROB_TOL = 1e-3
READY_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` in its own process group, stopped like Ctrl-C."""

    def __init__(self, model: Path, workdir: Path) -> None:
        self.port = _free_port()
        self.log = workdir / "vllm.log"
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN),
            "--kv-cache-memory-bytes", str(CHAT_KV_BYTES), "--enforce-eager", "--seed", str(CHAT_SEED),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--enable-auto-tool-choice", "--tool-call-parser", CHAT_TOOL_PARSER,
        ]  # fmt: skip
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        self._log = open(self.log, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.base = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM's server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if http_get(f"{self.base}/health", timeout=2)[0] == 200:
                    return
            except OSError:  # not listening yet
                pass
            time.sleep(1)
        raise TimeoutError(f"vLLM's server not ready in {READY_TIMEOUT_S}s:\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


@pytest.fixture(scope="module")
def servers(chat_serve, tiny_chat_model, tmp_path_factory):
    """The shared serve and vLLM's own server on the same model with the same engine settings."""
    vllm = VllmServer(tiny_chat_model, tmp_path_factory.mktemp("conformance"))
    try:
        vllm.wait_ready()
        yield chat_serve, vllm
    finally:
        vllm.stop()


@pytest.fixture(scope="module")
def apis(servers):
    serve, vllm = servers
    ours = openai.OpenAI(base_url=serve.endpoint, api_key="none", max_retries=0, timeout=120)
    theirs = openai.OpenAI(base_url=f"{vllm.base}/v1", api_key="none", max_retries=0, timeout=120)
    yield ours, theirs
    ours.close()
    theirs.close()


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


GREEDY = {"model": MODEL, "temperature": 0.0, "seed": 7}


def both(apis, call):
    """`call(client)` against the router and against vLLM."""
    ours, theirs = apis
    return call(ours), call(theirs)


def assert_chat_logprobs_match(ours, theirs) -> None:
    """Token by token, alternatives in order (several byte-fallback tokens decode to the same text,
    so alternatives are compared by position, not by their text)."""
    assert len(ours) == len(theirs) > 0
    for a, b in zip(ours, theirs, strict=True):
        assert (a.token, a.bytes) == (b.token, b.bytes)
        assert a.logprob == pytest.approx(b.logprob, abs=LOGPROB_TOL)
        assert [(t.token, t.bytes) for t in a.top_logprobs] == [(t.token, t.bytes) for t in b.top_logprobs]
        assert [t.logprob for t in a.top_logprobs] == pytest.approx([t.logprob for t in b.top_logprobs],
                                                                    abs=LOGPROB_TOL)  # fmt: skip


def test_chat_greedy_text_and_logprobs_match(apis) -> None:
    ours, theirs = both(apis, lambda c: c.chat.completions.create(
        messages=user("Tell me about the sea."), max_tokens=12, logprobs=True, top_logprobs=3,
        extra_body={"ignore_eos": True}, **GREEDY))  # fmt: skip
    a, b = ours.choices[0], theirs.choices[0]
    assert a.message.content == b.message.content and a.message.content
    assert (a.finish_reason, ours.usage.completion_tokens, ours.usage.prompt_tokens) == (
        b.finish_reason, theirs.usage.completion_tokens, theirs.usage.prompt_tokens)  # fmt: skip
    assert len(a.logprobs.content) == 12
    assert_chat_logprobs_match(a.logprobs.content, b.logprobs.content)


def test_chat_streamed_logprobs_match(apis) -> None:
    def run(client):
        text, logprobs, usages = "", [], []
        stream = client.chat.completions.create(
            messages=user("Count the waves."), max_tokens=8, logprobs=True, top_logprobs=2, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True}, **GREEDY)  # fmt: skip
        for chunk in stream:
            if chunk.usage is not None:
                usages.append(chunk.usage.completion_tokens)
            for choice in chunk.choices:
                text += choice.delta.content or ""
                if choice.logprobs and choice.logprobs.content:
                    logprobs.extend(choice.logprobs.content)
        return text, logprobs, usages

    (text_a, lp_a, use_a), (text_b, lp_b, use_b) = both(apis, run)
    assert text_a == text_b and text_a
    assert_chat_logprobs_match(lp_a, lp_b)
    assert use_a[-1] == use_b[-1] == 8
    assert use_a == sorted(use_a) and len(use_a) > 2  # usage in every chunk, growing


def test_completions_text_and_logprobs_match(apis) -> None:
    ours, theirs = both(apis, lambda c: c.completions.create(
        prompt="The sea is", max_tokens=10, logprobs=2, extra_body={"ignore_eos": True}, **GREEDY))  # fmt: skip
    a, b = ours.choices[0], theirs.choices[0]
    assert a.text == b.text and a.text
    assert ours.object == theirs.object == "text_completion"
    assert (a.logprobs.tokens, a.logprobs.text_offset) == (b.logprobs.tokens, b.logprobs.text_offset)
    assert a.logprobs.token_logprobs == pytest.approx(b.logprobs.token_logprobs, abs=LOGPROB_TOL)
    for top_a, top_b in zip(a.logprobs.top_logprobs, b.logprobs.top_logprobs, strict=True):
        # up to logprobs + 1 entries (OpenAI's legacy shape), fewer where tokens share a text
        assert top_a.keys() == top_b.keys() and 1 <= len(top_a) <= 3
        assert list(top_a.values()) == pytest.approx(list(top_b.values()), abs=LOGPROB_TOL)
    assert (ours.usage.prompt_tokens, ours.usage.completion_tokens) == (
        theirs.usage.prompt_tokens, theirs.usage.completion_tokens)  # fmt: skip


def test_completions_stream_echo_and_token_prompt_match(apis) -> None:
    def run(client):
        streamed = "".join(
            c.choices[0].text for c in client.completions.create(
                prompt="Waves", max_tokens=6, stream=True, echo=True, extra_body={"ignore_eos": True}, **GREEDY)
            if c.choices
        )  # fmt: skip
        ids = client.completions.create(prompt=[1, 2, 3, 4], max_tokens=5, extra_body={"ignore_eos": True}, **GREEDY)
        return streamed, ids.choices[0].text

    ours, theirs = both(apis, run)
    assert ours == theirs
    assert ours[0].startswith("Waves")


SCHEMA = {
    "type": "object",
    "properties": {"mood": {"type": "string", "enum": ["calm", "rough"]}, "big": {"type": "boolean"}},
    "required": ["mood", "big"],
    "additionalProperties": False,
}


GRAMMAR = r'''root ::= "{\"mood\":\"" ("calm" | "rough") "\",\"big\":" ("true" | "false") "}"'''
"""An EBNF grammar whose every sentence is JSON obeying SCHEMA, without the free whitespace a random
model pads JSON with until max_tokens (vLLM 0.32 turns that whitespace off only engine-wide)."""


def test_structured_outputs_match_and_obey(apis) -> None:
    """Even a random-weight model's output obeys the constraint: vLLM's backend masks every other token.
    Both servers give the same output for every kind of constraint; the bounded ones are checked."""

    def run(client):
        out = {}
        strict = {"type": "json_schema", "json_schema": {"name": "sea", "schema": SCHEMA, "strict": True}}
        for name, extra in {
            "response_format json_schema": {"response_format": strict},
            "response_format json_object": {"response_format": {"type": "json_object"}},
            "json": {"extra_body": {"structured_outputs": {"json": SCHEMA}}},
            "grammar": {"extra_body": {"structured_outputs": {"grammar": GRAMMAR}}},
            "choice": {"extra_body": {"structured_outputs": {"choice": ["calm sea", "rough sea"]}}},
            "regex": {"extra_body": {"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}}},
        }.items():
            reply = client.chat.completions.create(messages=user("Describe the sea."), max_tokens=40, **GREEDY,
                                                   **extra)  # fmt: skip
            out[name] = (reply.choices[0].message.content, reply.choices[0].finish_reason)
        return out

    ours, theirs = both(apis, run)
    assert ours == theirs
    for name in ("response_format json_schema", "response_format json_object", "json"):
        assert ours[name][0].lstrip().startswith("{"), name
    text, finish = ours["grammar"]
    assert finish == "stop"
    value = json.loads(text)
    assert set(value) == {"mood", "big"} and value["mood"] in ("calm", "rough") and isinstance(value["big"], bool)
    assert ours["choice"][0] in ("calm sea", "rough sea")
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", ours["regex"][0])


def test_chat_echo_and_continue_final_message_match(apis) -> None:
    messages = [*user("Finish my sentence."), {"role": "assistant", "content": "The sea is"}]
    ours, theirs = both(apis, lambda c: c.chat.completions.create(
        messages=messages, max_tokens=5, extra_body={"echo": True, "add_generation_prompt": False,
                                                     "continue_final_message": True, "ignore_eos": True},
        **GREEDY))  # fmt: skip
    assert ours.choices[0].message.content == theirs.choices[0].message.content
    assert ours.choices[0].message.content.startswith("The sea is")


def test_tokenize_and_detokenize_match(servers) -> None:
    serve, vllm = servers
    bodies = [
        ("/tokenize", {"model": MODEL, "prompt": "The sea is calm.", "return_token_strs": True}),
        ("/tokenize", {"model": MODEL, "messages": user("Hello there"), "add_generation_prompt": True}),
        ("/tokenize", {"model": MODEL, "prompt": "hi", "add_special_tokens": False}),
        ("/detokenize", {"model": MODEL, "tokens": [10, 20, 30, 40]}),
    ]
    for path, body in bodies:
        ours = httpx.post(f"{serve.base}{path}", json=body, timeout=60)
        theirs = httpx.post(f"{vllm.base}{path}", json=body, timeout=60)
        assert ours.status_code == theirs.status_code == 200, (path, ours.text, theirs.text)
        assert ours.json() == theirs.json(), path


def _function(name: str, properties: dict) -> dict:
    parameters = {"type": "object", "properties": properties, "required": sorted(properties),
                  "additionalProperties": False}  # fmt: skip
    return {"type": "function", "function": {"name": name, "parameters": parameters, "strict": True}}


TOOLS = [_function("tide", {"at": {"enum": ["Brest", "Dover"]}}), _function("wind", {"gale": {"type": "boolean"}})]
"""Small on purpose: the tiny tokenizer spends a token on every few characters of the tool list."""
TOOL_CHOICES = {
    "required": "required",
    "named": {"type": "function", "function": {"name": "wind"}},
    "auto": "auto",
    "none": "none",
}


@pytest.fixture(scope="module")
def no_blank_tokens(tiny_chat_model) -> dict:
    """Request fields for the tool tests: a logit_bias pushing every whitespace-only token down (JSON
    lets a random model pad with blanks until max_tokens, and vLLM 0.32 has no per-request switch for
    that inside tool-call grammars; a token the grammar requires, the newline after <tool_call>, is
    still the only one allowed), one call at most, and room for it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    bias = {str(i): -100.0 for i in tok.get_vocab().values() if tok.decode([i]) and not tok.decode([i]).strip()}
    return {"logit_bias": bias, "parallel_tool_calls": False, "max_tokens": 120}


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def check_call(name: str, arguments: str) -> None:
    """A call a client can run: a tool that exists, arguments that obey its schema."""
    tool = next(t["function"] for t in TOOLS if t["function"]["name"] == name)
    args = json.loads(arguments)
    props = tool["parameters"]["properties"]
    assert set(args) == set(props), (name, args)
    for key, value in args.items():
        if "enum" in props[key]:
            assert value in props[key]["enum"], (name, args)
        else:
            assert isinstance(value, bool), (name, args)


def test_tool_calls_match_for_every_tool_choice(apis, no_blank_tokens) -> None:
    """required and a named function constrain even a random model to a valid call (vLLM's structural
    tags; parallel_tool_calls false keeps it to one call within max_tokens); auto and none leave it
    free. Same content, calls and finish reason as vLLM's server."""

    def run(client):
        out = {}
        for name, choice in TOOL_CHOICES.items():
            reply = client.chat.completions.create(messages=user("What is the sea doing?"), tools=TOOLS,
                                                   tool_choice=choice, **no_blank_tokens, **GREEDY)  # fmt: skip
            c = reply.choices[0]
            assert all(t.id and t.type == "function" for t in c.message.tool_calls or []), name
            out[name] = (c.message.content, calls_of(c.message), c.finish_reason)
        return out

    ours, theirs = both(apis, run)
    assert ours == theirs
    assert ours["required"][1] and ours["required"][2] == "tool_calls", ours
    assert [n for n, _ in ours["named"][1]] == ["wind"] and ours["named"][2] == "stop", ours
    for name, arguments in ours["required"][1] + ours["named"][1]:
        check_call(name, arguments)
    assert ours["none"][1] == []


def test_streamed_tool_calls_match(apis, no_blank_tokens) -> None:
    """`delta.tool_calls` pieces, put together as an OpenAI client does, give the same calls as the
    unstreamed reply and as vLLM's server."""

    def run(client):
        out = {}
        for name in ("required", "named"):
            calls: dict[int, list[str]] = {}
            finish = None
            for chunk in client.chat.completions.create(messages=user("What is the sea doing?"), tools=TOOLS,
                                                        tool_choice=TOOL_CHOICES[name], stream=True,
                                                        **no_blank_tokens, **GREEDY):  # fmt: skip
                for choice in chunk.choices:
                    finish = choice.finish_reason or finish
                    for piece in choice.delta.tool_calls or []:
                        entry = calls.setdefault(piece.index, ["", ""])
                        entry[0] += (piece.function.name or "") if piece.function else ""
                        entry[1] += (piece.function.arguments or "") if piece.function else ""
            out[name] = ([tuple(calls[i]) for i in sorted(calls)], finish)
        return out

    ours, theirs = both(apis, run)
    assert ours == theirs
    unstreamed = apis[0].chat.completions.create(messages=user("What is the sea doing?"), tools=TOOLS,
                                                 tool_choice="required", **no_blank_tokens, **GREEDY)  # fmt: skip
    # the same calls; the unstreamed reply re-serialises the arguments (json.dumps), as vLLM's does
    assert [(n, json.loads(a)) for n, a in ours["required"][0]] == [
        (n, json.loads(a)) for n, a in calls_of(unstreamed.choices[0].message)]  # fmt: skip
    assert ours["required"][1] == "tool_calls" and ours["named"][1] == "stop"


def test_a_conversation_with_tool_results_matches(apis) -> None:
    """An assistant turn with tool_calls and the `tool` turns answering them render with the model's
    template on both servers."""
    call = {"id": "call-1", "type": "function", "function": {"name": "wind", "arguments": '{"gale": true}'}}
    messages = [*user("Is it windy?"), {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call-1", "content": "force 6"}]  # fmt: skip
    ours, theirs = both(apis, lambda c: c.chat.completions.create(
        messages=messages, tools=TOOLS, max_tokens=8, extra_body={"ignore_eos": True}, **GREEDY))  # fmt: skip
    assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens
    assert (ours.choices[0].message.content, calls_of(ours.choices[0].message)) == (
        theirs.choices[0].message.content, calls_of(theirs.choices[0].message))  # fmt: skip


def test_max_tokens_default_is_what_remains_of_the_context(servers, apis) -> None:
    """No max_tokens: vLLM's server generates up to max_model_len - prompt tokens (not the library's 16).
    The prompt is sized (with /tokenize) to leave a few tokens of context, so the run stays short."""
    serve, _ = servers

    def prompt_tokens(words: int) -> int:
        body = {"model": MODEL, "messages": user("sea " * words), "add_generation_prompt": True}
        return httpx.post(f"{serve.base}/tokenize", json=body, timeout=60).json()["count"]

    base, per_word = prompt_tokens(0), prompt_tokens(100) - prompt_tokens(0)
    words = (MAX_MODEL_LEN - 12 - base) * 100 // per_word
    ours, theirs = both(apis, lambda c: c.chat.completions.create(
        messages=user("sea " * words), extra_body={"ignore_eos": True}, **GREEDY))  # fmt: skip
    assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens < MAX_MODEL_LEN - 1
    assert ours.usage.completion_tokens == theirs.usage.completion_tokens == MAX_MODEL_LEN - ours.usage.prompt_tokens
    assert ours.choices[0].message.content == theirs.choices[0].message.content
    assert ours.choices[0].finish_reason == theirs.choices[0].finish_reason == "length"


BAD_CHAT = {
    "unknown model": {"model": "nope", "messages": user("hi")},
    "negative temperature": {"model": MODEL, "messages": user("hi"), "temperature": -0.5},
    "top_logprobs too large": {"model": MODEL, "messages": user("hi"), "logprobs": True, "top_logprobs": 30},
    "no messages": {"model": MODEL, "messages": []},
    "json_schema without a schema": {
        "model": MODEL, "messages": user("hi"), "response_format": {"type": "json_schema"}},
    "two structured constraints": {
        "model": MODEL, "messages": user("hi"), "structured_outputs": {"regex": "a+", "choice": ["a"]}},
    "no choices": {"model": MODEL, "messages": user("hi"), "n": 0},
    "stream_options without stream": {
        "model": MODEL, "messages": user("hi"), "stream_options": {"include_usage": True}},
    "top_logprobs without logprobs": {"model": MODEL, "messages": user("hi"), "top_logprobs": 2},
    "invalid regex": {"model": MODEL, "messages": user("hi"), "structured_outputs": {"regex": "(unclosed"}},
    "max_tokens beyond the context": {"model": MODEL, "messages": user("hi"), "max_tokens": MAX_MODEL_LEN + 1},
    "max_completion_tokens beyond the context": {
        "model": MODEL, "messages": user("hi"), "max_completion_tokens": MAX_MODEL_LEN + 1},
    "empty tools": {"model": MODEL, "messages": user("hi"), "tools": []},
    "tool_choice without tools": {"model": MODEL, "messages": user("hi"), "tool_choice": "required"},
    "named tool not among the tools": {"model": MODEL, "messages": user("hi"), "tools": TOOLS,
                                       "tool_choice": {"type": "function", "function": {"name": "rain"}}},
    "unknown tool_choice": {"model": MODEL, "messages": user("hi"), "tools": TOOLS, "tool_choice": "always"},
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_CHAT))
def test_bad_chat_requests_get_vllms_status(servers, case) -> None:
    serve, vllm = servers
    ours = httpx.post(f"{serve.endpoint}/chat/completions", json=BAD_CHAT[case], timeout=60)
    theirs = httpx.post(f"{vllm.base}/v1/chat/completions", json=BAD_CHAT[case], timeout=60)
    assert ours.status_code == theirs.status_code, (case, ours.text, theirs.text)
    assert ours.status_code in (400, 404)
    assert "error" in ours.json() and ours.json()["error"]["message"]
