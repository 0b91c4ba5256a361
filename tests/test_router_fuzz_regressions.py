"""Bugs the schema fuzzer (tests/test_router_fuzz.py) found, each pinned by a fast test.

Run on the in-process echo cluster (EchoEngine: see its docstring for why); the fuzzer itself drives
the real engines.
"""

from __future__ import annotations

import httpx
import pytest
from servelib import chat_topology, echo_cluster, echo_pipeline

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("route", "body"),
    [
        (
            "/v1/chat/completions",
            {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "sampling_params_list": [{"x": 2**70}]},
        ),
        ("/detokenize", {"tokens": [-(2**63) - 1]}),
    ],
)
async def test_integer_past_64_bits_is_a_400_not_a_500(route: str, body: dict) -> None:
    """Found by the fuzzer: msgpack cannot encode the integer, which was a 500 with an OverflowError."""
    async with echo_cluster(echo_pipeline(chat_topology())) as cluster:
        async with httpx.AsyncClient(base_url=cluster.base, trust_env=False) as http:
            reply = await http.post(route, json=body)
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["type"] == "BadRequestError" and "-2**63 and 2**64-1" in error["message"]
            # nothing was left on the stage, and it still answers
            assert sum(len(s.works) for s in cluster.servers["llm"]) == 0
            ok = await http.post(
                "/v1/chat/completions", json={"model": "echo", "messages": [{"role": "user", "content": "hi there"}]}
            )
            assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "hi there "


@pytest.mark.parametrize(
    ("route", "field", "value"),
    [
        ("/v1/chat/completions", "seed", 2**70),
        ("/v1/chat/completions", "top_k", -2),
        ("/v1/chat/completions", "min_tokens", 2**40),
        ("/v1/chat/completions", "stop_token_ids", [5, -1]),
        ("/v1/completions", "allowed_token_ids", [2**31]),
        ("/v1/completions", "min_p", 1.5),
        ("/v1/completions", "prompt", [2**64]),
    ],
)
async def test_sampling_fields_out_of_vllms_range_are_a_400_naming_the_field(route: str, field: str, value) -> None:
    """Values vLLM's SamplingParams cannot hold are refused by the router, naming the field, before any stage
    sees them (both text routes share these fields)."""
    body: dict = (
        {"messages": [{"role": "user", "content": "hi"}]} if route == "/v1/chat/completions" else {"prompt": "hi"}
    )
    body |= {"model": "echo", field: value}
    async with echo_cluster(echo_pipeline(chat_topology())) as cluster:
        async with httpx.AsyncClient(base_url=cluster.base, trust_env=False) as http:
            reply = await http.post(route, json=body)
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["type"] == "BadRequestError" and field in (error.get("param") or "") + error["message"]
            assert sum(len(s.works) for s in cluster.servers["llm"]) == 0
