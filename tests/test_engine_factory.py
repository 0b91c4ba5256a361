"""`engines.factory.ENGINES`, the one table of engines: unknown runners are refused with every valid one,
the table's classes exist, and every runner the registry's topologies name has an engine."""

from __future__ import annotations

import subprocess
import sys

import pytest

from omni_runtime.engines.base import Engine, EngineError
from omni_runtime.engines.factory import ENGINES, engine_class, make_engine, runners
from omni_runtime.registry import default_registry
from omni_runtime.spec import PipelineSpec, ResolvedPipeline, StageKind, StageSpec, resolve_pipeline

ALL_GENERATION_RUNNERS = [
    "glm_image_ar",
    "qwen2_5_omni_talker",
    "qwen2_5_omni_token2wav",
    "qwen3_omni_code2wav",
    "qwen3_omni_talker",
    "vae_decode",
]


def _generation_pipeline(runner: object) -> ResolvedPipeline:
    args = {} if runner is None else {"runner": runner}
    spec = PipelineSpec(
        name="g", stages=[StageSpec(name="gen", kind=StageKind.GENERATION, engine_args=args, final_output=True)]
    )
    return resolve_pipeline(spec, name="g", model="/models/none")


@pytest.mark.parametrize("runner", [None, "no_such_runner", 3])
def test_an_unknown_generation_runner_lists_every_runner_of_the_kind(runner: object) -> None:
    with pytest.raises(EngineError) as info:
        make_engine(_generation_pipeline(runner), "gen")
    message = str(info.value)
    assert f"set engine_args.runner to one of {ALL_GENERATION_RUNNERS}" in message
    assert "stage 'gen'" in message


def test_runners_per_kind() -> None:
    assert runners(StageKind.GENERATION) == ALL_GENERATION_RUNNERS
    assert runners(StageKind.AR) == [] and runners(StageKind.DIFFUSION) == ["bagel"]


def test_every_stage_kind_has_an_engine_and_each_table_entry_is_an_engine_class() -> None:
    assert {kind for kind, _ in ENGINES} == set(StageKind)
    for (kind, runner), target in ENGINES.items():
        cls = engine_class(kind, runner)
        assert issubclass(cls, Engine)
        assert f"{cls.__module__}:{cls.__qualname__}" == target


def test_an_ar_stage_runner_arg_is_vllms_and_does_not_pick_the_engine() -> None:
    assert engine_class(StageKind.AR, "pooling").__name__ == "AREngine"


def test_every_runner_the_registry_names_has_an_engine() -> None:
    named = {
        (stage.kind, stage.engine_args.get("runner"))
        for pipeline in default_registry()
        for stage in pipeline.stages
        if stage.kind is StageKind.GENERATION
    }
    assert named, "the registry has generation stages"
    assert named <= set(ENGINES)


def test_importing_the_factory_imports_no_ml_library() -> None:
    code = (
        "import sys, omni_runtime.engines.factory\n"
        "heavy = [m for m in ('torch', 'vllm', 'diffusers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
