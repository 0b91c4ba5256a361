"""The `ar` stage's tool-call parser setting (`engine_args.tool_call_parser`): a vLLM parser name or a
clear refusal when the stage is set up, never passed to vLLM's engine arguments. Tool calls themselves
are compared with vLLM's own server in test_openai_conformance.py."""

from __future__ import annotations

import pytest

from omni_runtime.engines.ar.engine import AREngine
from omni_runtime.engines.base import EngineError
from omni_runtime.registry import get_pipeline
from omni_runtime.spec import StageOverride, resolve_pipeline
from omni_runtime.spec.engine_args import InvalidEngineArgs


def _chat_stage(**engine_args) -> AREngine:
    pipeline = resolve_pipeline(
        get_pipeline("text-chat"),
        name="t",
        model="/models/none",
        stages=[StageOverride(name="llm", engine_args=engine_args)],
    )
    return AREngine(pipeline, pipeline.topology.stage("llm"))


def test_a_vllm_parser_name_is_kept_for_the_stage_and_not_passed_to_vllm() -> None:
    engine = _chat_stage(tool_call_parser="hermes")
    assert "tool_call_parser" not in engine.engine_args()
    assert engine.tool_parser == "hermes"
    assert _chat_stage().tool_parser is None


def test_a_tool_call_parser_that_is_not_a_name_is_refused_when_the_engine_is_made() -> None:
    with pytest.raises(
        InvalidEngineArgs, match=r"engine_args\.tool_call_parser is 3: input should be a valid string"
    ) as err:
        _chat_stage(tool_call_parser=3)
    assert err.value.field == "tool_call_parser" and "e.g. `hermes`" in str(err.value)


@pytest.mark.parametrize("bad", ["hermes2", ""])
def test_a_name_that_is_not_a_vllm_parser_is_refused_with_the_choices(bad) -> None:
    with pytest.raises(EngineError) as err:
        _chat_stage(tool_call_parser=bad).engine_args()
    message = str(err.value)
    assert f"engine_args.tool_call_parser is {bad!r}, which is not a vLLM tool-call parser" in message
    assert "'hermes'" in message and "'llama3_json'" in message
