"""`make_engine`: the engine for one stage of a resolved pipeline, chosen by the stage's kind and runner.

`ENGINES` is the one table of every engine a stage server can build: `(stage kind, runner)` to
`"module:Class"`. The runner is the stage's `engine_args.runner`; a kind's default engine has the key
`(kind, None)` and runs every stage of the kind whose `runner` names no other engine (an AR stage's `runner`
is vLLM's own engine arg, passed on; a diffusion stage's `runner: bagel` picks BAGEL's generation engine).
Engine modules are imported by name only when their key is asked for, so importing the factory imports no
torch, vLLM or diffusers, a diffusion stage never imports vLLM and an AR stage never imports diffusers.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from omni_runtime.engines.base import Engine, EngineError
from omni_runtime.spec import ResolvedPipeline, StageKind

__all__ = ["ENGINES", "engine_class", "make_engine", "runners"]

ENGINES: Mapping[tuple[StageKind, str | None], str] = {
    (StageKind.AR, None): "omni_runtime.engines.ar.engine:AREngine",
    (StageKind.DIFFUSION, None): "omni_runtime.engines.diffusion.engine:DiffusionEngine",
    (StageKind.DIFFUSION, "bagel"): "omni_runtime.engines.diffusion.bagel.engine:BagelEngine",
    (StageKind.GENERATION, "vae_decode"): "omni_runtime.engines.generation:VAEDecodeEngine",
    (StageKind.GENERATION, "qwen3_omni_talker"): "omni_runtime.engines.speech.talker:Qwen3TalkerEngine",
    (StageKind.GENERATION, "qwen2_5_omni_talker"): "omni_runtime.engines.speech.talker:Qwen25TalkerEngine",
    (StageKind.GENERATION, "qwen3_omni_code2wav"): "omni_runtime.engines.speech.code2wav:Code2WavEngine",
    (StageKind.GENERATION, "qwen2_5_omni_token2wav"): "omni_runtime.engines.speech.token2wav:Token2WavEngine",
    (StageKind.GENERATION, "glm_image_ar"): "omni_runtime.engines.glm_image.ar:GlmImageArEngine",
}
"""Every engine a stage can run: `(stage kind, engine_args.runner)` -> `"module:Class"`."""


def runners(kind: StageKind) -> list[str]:
    """The runner names a stage of `kind` may set in `engine_args.runner`, sorted (empty when the kind
    has a single engine that reads no runner)."""
    return sorted(runner for k, runner in ENGINES if k is kind and runner is not None)


def engine_class(kind: StageKind, runner: object = None, stage_name: str = "?") -> type[Engine]:
    """The engine class for a stage of `kind` whose `engine_args.runner` is `runner`, imported now.

    Raises EngineError naming every valid runner for the kind (every kind when the kind has no engine).
    """
    key: tuple[StageKind, str | None] | None = (kind, runner) if isinstance(runner, str) else None
    if key not in ENGINES:
        key = (kind, None) if (kind, None) in ENGINES else key
    target = ENGINES.get(key) if key is not None else None
    if key is None or target is None:
        kinds = sorted({k.value for k, _ in ENGINES})
        if all(k is not kind for k, _ in ENGINES):
            raise EngineError(f"stage {stage_name!r} has kind {kind.value!r}, which no engine runs; use one of {kinds}")
        what = "has no engine_args.runner" if runner is None else f"names runner {runner!r}"
        raise EngineError(
            f"stage {stage_name!r} {what}; set engine_args.runner to one of {runners(kind)} "
            f"(the runners of kind {kind.value!r})"
        )
    module_name, _, class_name = target.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise TypeError(f"ENGINES[{key!r}] = {target!r} is not an Engine class")
    return cls


def make_engine(pipeline: ResolvedPipeline, stage_name: str) -> Engine:
    """An unstarted engine for `stage_name` (call `await engine.start()` to load the model).

    Raises SpecError (from the topology) when the pipeline has no such stage, and EngineError when
    the stage's engine args cannot work (for example a generation stage without a known runner).
    """
    stage = pipeline.topology.stage(stage_name)
    return engine_class(stage.kind, stage.engine_args.get("runner"), stage.name)(pipeline, stage)
