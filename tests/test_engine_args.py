"""Typed engine args (`spec.engine_args`): each family's model says what its engine reads today, every built-in
topology passes its checks, and a wrong value, combination or key is refused naming the stage and the key.

The engines still read their dicts (until they read these models), so the models are compared with the
engines' own constants and with what a constructed engine (no model loaded) takes as its defaults: the two
cannot drift apart unnoticed.
"""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from omni_runtime.registry import builtin_pipelines_dir, load_pipeline_file
from omni_runtime.spec import PipelineSpec, StageKind, StageSpec, check_engine_args, resolve_pipeline
from omni_runtime.spec.engine_args import (
    ENGINE_ARGS_MODELS,
    AccelSettings,
    ArArgs,
    Code2WavArgs,
    DiffusionArgs,
    EngineArgs,
    GenerationArgs,
    InvalidEngineArgs,
    RegistryOnlyKeys,
    StepCacheSettings,
    TalkerArgs,
    Token2WavArgs,
    VideoArgs,
    engine_args_for,
)

ENGINE_MODULES = {
    "factory": "omni_runtime.engines.factory",
    "ar": "omni_runtime.engines.ar.engine",
    "ar_tools": "omni_runtime.engines.ar.tools",
    "diffusion": "omni_runtime.engines.diffusion.engine",
    "accel": "omni_runtime.engines.diffusion.accel",
    "video": "omni_runtime.engines.diffusion.video",
    "parallel": "omni_runtime.engines.diffusion.parallel",
    "generation": "omni_runtime.engines.generation",
    "talker": "omni_runtime.engines.speech.talker",
    "code2wav": "omni_runtime.engines.speech.code2wav",
    "token2wav": "omni_runtime.engines.speech.token2wav",
}
"""Where each engine module lives today: when the engines move into their family packages, only this changes."""


def engine(name: str) -> ModuleType:
    """The engine module `name` (a key of ENGINE_MODULES), imported from where it lives now."""
    return importlib.import_module(ENGINE_MODULES[name])


def built(kind: StageKind, args: dict[str, Any], cls: type) -> Any:
    """An engine of `cls` for one stage with `args`, constructed (it reads its args) but not started."""
    spec = PipelineSpec(name="p", stages=[StageSpec(name="s", kind=kind, engine_args=args, final_output=True)])
    pipeline = resolve_pipeline(spec, name="p", model="/models/none")
    return cls(pipeline, pipeline.topology.stage("s"))


def defaults(model: type[EngineArgs], **required: Any) -> dict[str, Any]:
    """Every key of `model` at its default (with `required` for the keys that have none)."""
    return model.model_validate(required).model_dump() | required


def field_facts(model: type[Any], name: str) -> tuple[Any, Any, list[Any]]:
    info = model.model_fields[name]
    return info.annotation, info.default, list(info.metadata)


# --- the table ------------------------------------------------------------------------------------------


def test_every_engine_has_an_args_model_and_every_model_an_engine() -> None:
    assert set(ENGINE_ARGS_MODELS) == set(engine("factory").ENGINES)


def test_a_generation_models_runner_field_names_the_runners_it_is_chosen_by() -> None:
    for (kind, runner), model in ENGINE_ARGS_MODELS.items():
        if runner is None:
            assert "runner" not in model.model_fields, model  # an AR stage's runner is vLLM's own
            continue
        assert kind is StageKind.GENERATION
        chosen_by = {r for (_, r), m in ENGINE_ARGS_MODELS.items() if m is model}
        assert set(model.model_fields["runner"].annotation.__args__) == chosen_by  # type: ignore[union-attr]


# --- each family against its engine --------------------------------------------------------------------


def test_ar_args_are_the_keys_the_ar_engine_keeps_from_vllm() -> None:
    ar, tools = engine("ar"), engine("ar_tools")
    ours = set(ar.REGISTRY_ONLY_ENGINE_ARGS) | {ar.HIDDEN_STATE_ARG, ar.MEDIA_HIDDEN_ARG, tools.TOOL_CALL_PARSER_ARG}
    assert set(ArArgs.model_fields) == ours
    assert set(RegistryOnlyKeys.model_fields) == set(ar.REGISTRY_ONLY_ENGINE_ARGS)
    assert ArArgs.model_config.get("extra") == "allow"  # vLLM's keys pass through, checked at start


def test_diffusion_args_are_the_keys_the_diffusion_engine_keeps_from_from_pretrained() -> None:
    diffusion, accel, video = engine("diffusion"), engine("accel"), engine("video")
    ours = (
        set(diffusion.DIFFUSION_ENGINE_ARGS)
        | set(accel.ACCEL_ENGINE_ARGS)
        | set(video.VIDEO_ENGINE_ARGS)
        | set(diffusion._REGISTRY_ONLY)
    )
    assert set(DiffusionArgs.model_fields) == ours
    assert set(AccelSettings.model_fields) == set(accel.ACCEL_ENGINE_ARGS)
    assert set(VideoArgs.model_fields) == set(video.VIDEO_ENGINE_ARGS)
    # What the engine hands to from_pretrained is exactly what the model leaves as extras.
    dit = built(StageKind.DIFFUSION, defaults(DiffusionArgs) | {"boundary_ratio": 0.875}, diffusion.DiffusionEngine)
    assert dit._load_kwargs == {"boundary_ratio": 0.875}


def test_diffusion_defaults_are_the_engines() -> None:
    diffusion, video, parallel = engine("diffusion"), engine("video"), engine("parallel")
    given = defaults(DiffusionArgs)
    for key, value in diffusion.DIFFUSION_ENGINE_ARGS.items():
        assert given[key] == value, key  # None: the engine chooses by device
    assert given[parallel.ARG] == "auto"
    assert {k: given[k] for k in video.VIDEO_ENGINE_ARGS} == video.VIDEO_ENGINE_ARGS
    dit = built(StageKind.DIFFUSION, {}, diffusion.DiffusionEngine)
    assert (dit.batch_window * 1000, dit.max_batch_size, dit.max_pixels, dit.max_inference_steps) == (
        given["batch_window_ms"],
        given["max_batch_size"],
        given["max_pixels"],
        given["max_inference_steps"],
    )


@pytest.mark.parametrize("pair", ["accel", "step_cache"])
def test_accel_settings_are_the_accel_modules_with_their_bounds(pair: str) -> None:
    accel = engine("accel")
    ours, theirs = (
        (AccelSettings, accel.AccelSettings) if pair == "accel" else (StepCacheSettings, accel.StepCacheSettings)
    )
    assert list(ours.model_fields) == list(theirs.model_fields)
    for name in theirs.model_fields:
        if name == "step_cache":  # the nested model is ours in the spec, theirs in the engine
            assert ours.model_fields[name].default is theirs.model_fields[name].default is None
            continue
        assert field_facts(ours, name) == field_facts(theirs, name), name


def test_generation_args_are_what_the_generation_engine_pops() -> None:
    generation = engine("generation")
    given = defaults(GenerationArgs, runner="vae_decode")
    vae = built(StageKind.GENERATION, given | {"for_the_runner": 1}, generation.VAEDecodeEngine)
    assert vae._runner_args == {"for_the_runner": 1}  # every key of the model was taken by the engine
    assert (vae.chunk_size, vae.chunk_dim, vae._dtype_name, vae._device) == (
        given["chunk_size"],
        given["chunk_dim"],
        given["torch_dtype"],
        given["device"],
    )
    default = built(StageKind.GENERATION, {"runner": "vae_decode"}, generation.VAEDecodeEngine)
    assert (default.chunk_size, default.chunk_dim, default._dtype_name) == (1, 0, "float32")
    assert GenerationArgs.model_config.get("extra") == "allow"


@pytest.mark.parametrize(
    ("module", "cls", "model", "runner", "read"),
    [
        ("talker", "Qwen3TalkerEngine", TalkerArgs, "qwen3_omni_talker", {"max_requests": "max_requests"}),
        ("talker", "Qwen25TalkerEngine", TalkerArgs, "qwen2_5_omni_talker", {"max_requests": "max_requests"}),
        (
            "code2wav",
            "Code2WavEngine",
            Code2WavArgs,
            "qwen3_omni_code2wav",
            {"left_context": "left_context", "max_frames_per_call": "max_frames"},
        ),
        (
            "token2wav",
            "Token2WavEngine",
            Token2WavArgs,
            "qwen2_5_omni_token2wav",
            {"num_steps": "num_steps", "left_context": "left_context"},
        ),
    ],
    ids=["qwen3-talker", "qwen25-talker", "code2wav", "token2wav"],
)
def test_speech_args_are_the_keys_each_runner_takes_with_its_defaults(
    module: str, cls: str, model: type[EngineArgs], runner: str, read: dict[str, str]
) -> None:
    mod = engine(module)
    assert set(model.model_fields) == set(mod.ENGINE_ARGS)
    assert model.model_config.get("extra") == "forbid"  # the runner refuses keys it does not read
    given = defaults(model, runner=runner)
    made = built(StageKind.GENERATION, {"runner": runner}, getattr(mod, cls))
    assert {key: getattr(made, attr) for key, attr in read.items()} == {key: given[key] for key in read}
    built(StageKind.GENERATION, given, getattr(mod, cls))  # every key of the model is one it takes


# --- engine_args_for --------------------------------------------------------------------------------------


def stage(kind: str, **args: Any) -> StageSpec:
    return StageSpec(name="dit" if kind == "diffusion" else "gen", kind=StageKind(kind), engine_args=args)


def refused(kind: str, **args: Any) -> InvalidEngineArgs:
    with pytest.raises(InvalidEngineArgs) as info:
        engine_args_for(stage(kind, **args))
    return info.value


def test_each_stage_gets_its_familys_model() -> None:
    assert isinstance(engine_args_for(stage("ar", max_model_len=512)), ArArgs)
    args = engine_args_for(stage("diffusion", torch_dtype="bfloat16", quantization="fp8"))
    assert isinstance(args, DiffusionArgs) and args.quantization == "fp8" and args.max_batch_size == 8
    assert isinstance(engine_args_for(stage("generation", runner="qwen3_omni_code2wav")), Code2WavArgs)


def test_the_sd3_stage_of_the_issue_is_refused_naming_the_stage_the_key_and_what_is_allowed() -> None:
    err = refused("diffusion", torch_dtype="bfloat16", quantization="fp9")
    assert (err.reason, err.stage, err.field) == ("InvalidEngineArgs", "dit", "quantization")
    message = str(err)
    assert "stage 'dit'" in message and "engine_args.quantization is 'fp9'" in message
    assert "'fp8'" in message and "change it or remove it" in message


@pytest.mark.parametrize(
    ("kind", "args", "field", "words"),
    [
        ("diffusion", {"max_batch_size": 0}, "max_batch_size", ["is 0", "greater than or equal to 1"]),
        ("diffusion", {"sequence_parallel": "many"}, "sequence_parallel", ["'auto'", "valid integer"]),
        ("diffusion", {"step_cache": {"policy": "taylorseer", "interval": 1}}, "step_cache.interval", ["is 1"]),
        ("diffusion", {"cuda_graphs": True, "enforce_eager": True}, "cuda_graphs", ["cannot apply with enforce_eager"]),
        ("diffusion", {"step_cache": {"policy": "taylorseer"}, "step_cache_threshold": 0.1}, "step_cache", ["two"]),
        ("diffusion", {"step_cache_threshold": 1.0}, "step_cache_threshold", ["below 1"]),
        ("ar", {"hidden_state_layers": [0, True]}, "hidden_state_layers", ["[0, True]", "valid integer"]),
        ("ar", {"hidden_state_layers": []}, "hidden_state_layers", ["at least 1"]),
        ("ar", {"media_hidden_layer": "thinker"}, "media_hidden_layer", ["'talker'"]),
        ("ar", {"hidden_state_layers": [0], "media_hidden_layer": 2}, "media_hidden_layer", ["cannot be combined"]),
        ("ar", {"media_hidden_layer": "talker", "enable_prefix_caching": True}, "enable_prefix_caching", ["prefix"]),
        ("ar", {"hidden_state_layers": [-1], "mm_processor_cache_gb": 4}, "mm_processor_cache_gb", ["cached media"]),
        ("generation", {}, "runner", ["has no engine_args.runner", "vae_decode", "qwen3_omni_talker"]),
        ("generation", {"runner": "vae"}, "runner", ["names runner 'vae'", "qwen2_5_omni_token2wav"]),
        (
            "generation",
            {"runner": "qwen3_omni_code2wav", "enforce_eager": True},
            "enforce_eager",
            ["not read by runner 'qwen3_omni_code2wav'", "max_frames_per_call"],
        ),
        ("generation", {"runner": "qwen3_omni_talker", "max_requests": 0}, "max_requests", ["is 0"]),
    ],
)
def test_what_the_engines_refuse_is_refused_before_any_engine_runs(
    kind: str, args: dict[str, Any], field: str, words: list[str]
) -> None:
    err = refused(kind, **args)
    assert err.field == field
    assert all(word in str(err) for word in words), str(err)


def test_what_is_not_omnikubes_passes_through() -> None:
    ar = engine_args_for(stage("ar", max_model_len=512, runner="pooling", enable_prefix_caching=False))
    assert ar.model_extra == {"max_model_len": 512, "runner": "pooling", "enable_prefix_caching": False}
    dit = engine_args_for(stage("diffusion", boundary_ratio=0.875))
    assert dit.model_extra == {"boundary_ratio": 0.875}


# --- the registry's topologies ------------------------------------------------------------------------------

TOPOLOGIES = sorted(builtin_pipelines_dir().glob("*.yaml"))


def check_topology_file(path: Path) -> None:
    """What `make test` asks of a topology file: it loads, and every stage's engine args pass their model."""
    check_engine_args(load_pipeline_file(path).spec)


def test_the_registry_has_topologies() -> None:
    assert len(TOPOLOGIES) >= 10


@pytest.mark.parametrize("path", TOPOLOGIES, ids=[p.stem for p in TOPOLOGIES])
def test_every_builtin_topologys_engine_args_pass_their_model(path: Path) -> None:
    check_topology_file(path)


def test_a_builtin_topology_with_a_wrong_engine_arg_fails_that_check(tmp_path: Path) -> None:
    copy = tmp_path / "stable-diffusion-3.yaml"
    shutil.copy(builtin_pipelines_dir() / "stable-diffusion-3.yaml", copy)
    raw = yaml.safe_load(copy.read_text())
    raw["stages"][0]["engine_args"]["quantization"] = "fp9"
    copy.write_text(yaml.safe_dump(raw))
    with pytest.raises(InvalidEngineArgs, match=r"stage 'dit': engine_args\.quantization is 'fp9'"):
        check_topology_file(copy)


def test_importing_the_engine_args_imports_no_ml_library() -> None:
    import subprocess
    import sys

    code = (
        "import sys, omni_runtime.spec.engine_args\n"
        "heavy = [m for m in ('torch', 'vllm', 'diffusers', 'omni_runtime.engines') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
