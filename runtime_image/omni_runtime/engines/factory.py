"""`make_engine`: the engine for one stage of a resolved pipeline, chosen by the stage's kind.

Engine modules are imported only when their kind is asked for, so a diffusion stage never imports
vLLM and an AR stage never imports diffusers.
"""

from __future__ import annotations

from omni_runtime.engines.base import Engine
from omni_runtime.spec import ResolvedPipeline, StageKind

__all__ = ["make_engine"]


def make_engine(pipeline: ResolvedPipeline, stage_name: str) -> Engine:
    """An unstarted engine for `stage_name` (call `await engine.start()` to load the model).

    Raises SpecError (from the topology) when the pipeline has no such stage, and EngineError when
    the stage's engine args cannot work (for example a generation stage without a known runner).
    """
    stage = pipeline.topology.stage(stage_name)
    if stage.kind is StageKind.AR:
        from omni_runtime.engines.ar import AREngine

        return AREngine(pipeline, stage)
    if stage.kind is StageKind.DIFFUSION:
        from omni_runtime.engines.diffusion import DiffusionEngine

        return DiffusionEngine(pipeline, stage)
    if stage.kind is StageKind.GENERATION:
        runner = stage.engine_args.get("runner")
        if runner == "qwen3_omni_talker":
            from omni_runtime.engines.speech.talker import Qwen3TalkerEngine

            return Qwen3TalkerEngine(pipeline, stage)
        if runner == "qwen2_5_omni_talker":
            from omni_runtime.engines.speech.talker import Qwen25TalkerEngine

            return Qwen25TalkerEngine(pipeline, stage)
        if runner == "qwen3_omni_code2wav":
            from omni_runtime.engines.speech.code2wav import Code2WavEngine

            return Code2WavEngine(pipeline, stage)
        if runner == "qwen2_5_omni_token2wav":
            from omni_runtime.engines.speech.token2wav import Token2WavEngine

            return Token2WavEngine(pipeline, stage)
        from omni_runtime.engines.generation import GenerationEngine

        return GenerationEngine(pipeline, stage)
    raise AssertionError(f"unhandled stage kind {stage.kind!r}")  # StageKind is a closed enum
