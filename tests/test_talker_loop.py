"""The talker engine's shared loop without a model (no `models` mark): a failed request ends in EngineError
(a typed failure on the request's output queue, not a finish reason that reads "error: ..."), with the
message the stage server sends to the client in its Failed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from omni_runtime.engines.base import EngineError, EngineInput, InvalidRequest
from omni_runtime.engines.speech.talker import TalkerEngine
from omni_runtime.registry import get_pipeline
from omni_runtime.spec import resolve_pipeline


class _Request:
    def __init__(self, request_id: str) -> None:
        self.id = request_id
        self.finish_reason: str | None = None


class _BrokenModel:
    speakers = {"ethan": 0}

    def advance(self, requests: list[Any]) -> tuple[dict[str, list[list[int]]], bool]:
        raise RuntimeError("the model broke")


class _FinishingModel:
    """One frame per step; a request finishes with 'length' after two."""

    speakers = {"ethan": 0}

    def advance(self, requests: list[Any]) -> tuple[dict[str, list[list[int]]], bool]:
        out = {}
        for request in requests:
            request.steps = getattr(request, "steps", 0) + 1
            out[request.id] = [[request.steps]]
            if request.steps == 2:
                request.finish_reason = "length"
        return out, True


class _StalledModel:
    """Waits for more input forever (no step moves)."""

    speakers = {"ethan": 0}

    def advance(self, requests: list[Any]) -> tuple[dict[str, list[list[int]]], bool]:
        return {}, False


class _Talker(TalkerEngine):
    def new_request(
        self, request_id: str, first: dict[str, Any], speaker: str, sampling: Any, extra: Any = None
    ) -> Any:
        return _Request(request_id)

    def absorb(self, request: Any, payloads: list[dict[str, Any]], done: bool) -> None:
        pass

    def check(self, payload: dict[str, Any]) -> None:
        if payload.get("bad"):
            raise InvalidRequest("a malformed chunk")


def _talker(model: Any) -> _Talker:
    pipeline = resolve_pipeline(get_pipeline("qwen3-omni"), name="o", model="/models/none")
    stage = pipeline.topology.stage("talker")
    stage = stage.model_copy(update={"engine_args": {**stage.engine_args, "device": "cpu", "torch_dtype": "float32"}})
    engine = _Talker(pipeline, stage)
    engine.model = model
    return engine


async def _run(engine: _Talker, request: EngineInput) -> list[Any]:
    engine._task = asyncio.create_task(engine._loop())
    try:
        return [out async for out in engine.generate(request)]
    finally:
        await engine.stop()


def test_a_model_fault_fails_the_request_with_engine_error() -> None:
    engine = _talker(_BrokenModel())
    with pytest.raises(EngineError) as info:
        asyncio.run(_run(engine, EngineInput("r1", {"thinker_prompt_ids": [1]})))
    assert str(info.value) == "stage 'talker': the talker failed on request 'r1': error: the model broke"


def test_a_malformed_later_chunk_fails_the_request_with_engine_error() -> None:
    async def chunks() -> AsyncIterator[dict[str, Any]]:
        yield {"bad": True}

    engine = _talker(_StalledModel())
    with pytest.raises(EngineError) as info:
        asyncio.run(_run(engine, EngineInput("r2", {"thinker_prompt_ids": [1]}, chunks=chunks())))
    assert str(info.value) == "stage 'talker': the talker failed on request 'r2': error: a malformed chunk"


def test_frames_raise_on_failure_and_end_with_the_reason_otherwise() -> None:
    async def main() -> None:
        broken = _talker(_BrokenModel())
        broken._task = asyncio.create_task(broken._loop())
        broken.add("r3", {}, None, {})
        broken.push("r3", {}, finished=True)
        with pytest.raises(EngineError, match="failed on request 'r3': error: the model broke"):
            [item async for item in broken.frames("r3")]
        await broken.stop()

        ok = _talker(_FinishingModel())
        ok._task = asyncio.create_task(ok._loop())
        ok.add("r4", {}, None, {})
        ok.push("r4", {}, finished=True)
        items = [item async for item in ok.frames("r4")]
        assert items == [([[1]], None), ([[2]], "length")]
        await ok.stop()

    asyncio.run(main())


def test_a_finished_request_yields_codes_and_a_finished_output() -> None:
    outs = asyncio.run(_run(_talker(_FinishingModel()), EngineInput("r5", {"thinker_prompt_ids": [1, 2]})))
    assert [o.finished for o in outs] == [False, False, True]
    assert outs[-1].finish_reason == "length"
    assert outs[-1].usage == {"prompt_tokens": 2, "completion_tokens": 2}
