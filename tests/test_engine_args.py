"""Typed engine args (`spec.engine_args`): each family's model says what its engine reads today, every built-in
topology passes its checks, and a wrong value, combination or key is refused naming the stage and the key.

Each engine reads its stage's args as its family's model (`engine.args`, made once when it is constructed) and
holds no key list, defaults table or settings model of its own, so there is nothing left to drift apart; what a
constructed engine (no model loaded) takes as its defaults is still compared with the models.
"""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

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
    TalkerArgs,
    Token2WavArgs,
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


# --- the table ------------------------------------------------------------------------------------------


def test_every_engine_has_an_args_model_and_every_model_an_engine() -> None:
    assert set(ENGINE_ARGS_MODELS) == set(engine("factory").ENGINES)


def test_a_generation_models_runner_field_names_the_runners_it_is_chosen_by() -> None:
    for (kind, runner), model in ENGINE_ARGS_MODELS.items():
        if runner is None:
            assert "runner" not in model.model_fields, model  # an AR stage's runner is vLLM's own
            continue
        assert kind in (StageKind.GENERATION, StageKind.DIFFUSION)  # a diffusion runner: bagel
        chosen_by = {r for (_, r), m in ENGINE_ARGS_MODELS.items() if m is model}
        assert set(model.model_fields["runner"].annotation.__args__) == chosen_by  # type: ignore[union-attr]


# --- each engine reads its family's model ------------------------------------------------------------

DUPLICATES = (
    "ENGINE_ARGS",
    "DIFFUSION_ENGINE_ARGS",
    "ACCEL_ENGINE_ARGS",
    "VIDEO_ENGINE_ARGS",
    "REGISTRY_ONLY_ENGINE_ARGS",
    "_REGISTRY_ONLY",
    "HIDDEN_STATE_ARG",
    "MEDIA_HIDDEN_ARG",
    "TOOL_CALL_PARSER_ARG",
    "checked_engine_args",
)
"""The engine-side copies of the models' facts that phase 1 found (the models replaced every one)."""


def engine_modules() -> list[ModuleType]:
    import pkgutil

    import omni_runtime.engines as package

    names = [m.name for m in pkgutil.walk_packages(package.__path__, prefix="omni_runtime.engines.")]
    return [importlib.import_module(name) for name in sorted(names) if not name.endswith("qwen2_5_omni_eagle")]


def test_no_engine_module_holds_a_key_list_or_a_settings_model_of_its_own() -> None:
    for module in engine_modules():
        held = [name for name in DUPLICATES if hasattr(module, name)]
        assert not held, (module.__name__, held)
        for name, value in vars(module).items():
            if isinstance(value, type) and issubclass(value, BaseModel) and value is not BaseModel:
                if name.startswith("_") and value.__module__ == module.__name__:
                    continue  # a private reader of a checkpoint's own config files (bagel.weights), no engine arg
                # a settings model it uses is the spec's, imported (AccelSettings, StepCacheSettings...)
                assert value.__module__.startswith("omni_runtime.spec."), (module.__name__, name)


@pytest.mark.parametrize(
    ("kind", "args", "cls"),
    [
        (StageKind.AR, {"max_model_len": 512}, ("ar", "AREngine")),
        (StageKind.DIFFUSION, {}, ("diffusion", "DiffusionEngine")),
        (StageKind.GENERATION, {"runner": "vae_decode"}, ("generation", "VAEDecodeEngine")),
        (StageKind.GENERATION, {"runner": "qwen3_omni_talker"}, ("talker", "Qwen3TalkerEngine")),
        (StageKind.GENERATION, {"runner": "qwen2_5_omni_talker"}, ("talker", "Qwen25TalkerEngine")),
        (StageKind.GENERATION, {"runner": "qwen3_omni_code2wav"}, ("code2wav", "Code2WavEngine")),
        (StageKind.GENERATION, {"runner": "qwen2_5_omni_token2wav"}, ("token2wav", "Token2WavEngine")),
    ],
    ids=["ar", "diffusion", "vae_decode", "qwen3-talker", "qwen25-talker", "code2wav", "token2wav"],
)
def test_each_engine_reads_its_args_as_the_spec_model_of_its_stage(
    kind: StageKind, args: dict[str, Any], cls: tuple[str, str]
) -> None:
    made = built(kind, args, getattr(engine(cls[0]), cls[1]))
    model = ENGINE_ARGS_MODELS[(kind, args.get("runner") if kind is StageKind.GENERATION else None)]
    assert type(made.args) is model
    assert made.args == engine_args_for(made.stage)


def test_every_key_of_each_model_is_one_its_engine_takes() -> None:
    for (kind, runner), model in ENGINE_ARGS_MODELS.items():
        required = {"runner": runner} if runner is not None else {}
        module, _, name = engine("factory").ENGINES[(kind, runner)].partition(":")
        built(kind, defaults(model, **required), getattr(importlib.import_module(module), name))


def test_what_the_diffusion_engine_hands_to_from_pretrained_is_what_the_model_leaves_as_extras() -> None:
    diffusion = engine("diffusion")
    dit = built(StageKind.DIFFUSION, defaults(DiffusionArgs) | {"boundary_ratio": 0.875}, diffusion.DiffusionEngine)
    assert dit._load_kwargs == {"boundary_ratio": 0.875}
    assert built(StageKind.DIFFUSION, {"model_stage": "dit"}, diffusion.DiffusionEngine)._load_kwargs == {}


def test_diffusion_defaults_are_the_models() -> None:
    given = defaults(DiffusionArgs)
    assert given["sequence_parallel"] == "auto" and (given["torch_dtype"], given["device"]) == (None, None)
    dit = built(StageKind.DIFFUSION, {}, engine("diffusion").DiffusionEngine)
    assert (dit.batch_window * 1000, dit.max_batch_size, dit.max_pixels, dit.max_inference_steps) == (
        given["batch_window_ms"],
        given["max_batch_size"],
        given["max_pixels"],
        given["max_inference_steps"],
    )
    assert (dit.args.max_frames, dit.args.default_fps, dit.args.max_fps) == (241, 16, 60)
    speed = {key: getattr(dit.accel.settings, key) for key in AccelSettings.model_fields}
    assert speed == AccelSettings().model_dump()  # speed options off


def test_the_ar_engine_hands_vllm_the_models_extras_only() -> None:
    ar = built(StageKind.AR, {"max_model_len": 512, "model_stage": "thinker", "tool_call_parser": "hermes"},
               engine("ar").AREngine)  # fmt: skip
    assert ar.args.model_extra == {"max_model_len": 512}
    assert set(ArArgs.model_fields) >= set(RegistryOnlyKeys.model_fields)
    assert ArArgs.model_config.get("extra") == "allow"  # vLLM's keys pass through, checked at start


def test_generation_args_are_what_the_generation_engine_takes() -> None:
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
    assert model.model_config.get("extra") == "forbid"  # the runner refuses keys it does not read
    given = defaults(model, runner=runner)
    made = built(StageKind.GENERATION, {"runner": runner}, getattr(mod, cls))
    assert {key: getattr(made, attr) for key, attr in read.items()} == {key: given[key] for key in read}
    built(StageKind.GENERATION, given, getattr(mod, cls))  # every key of the model is one it takes
    with pytest.raises(InvalidEngineArgs, match=f"engine_args.enforce_eager is not read by runner '{runner}'"):
        built(StageKind.GENERATION, {"runner": runner, "enforce_eager": True}, getattr(mod, cls))


def test_an_engine_given_another_engines_stage_is_refused_naming_both_models() -> None:
    with pytest.raises(InvalidEngineArgs, match="takes Code2WavArgs, not the TalkerArgs of this engine") as err:
        built(StageKind.GENERATION, {"runner": "qwen3_omni_code2wav"}, engine("talker").Qwen3TalkerEngine)
    assert (err.value.stage, err.value.field) == ("s", "runner")


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
        (
            "diffusion",
            {"step_cache": {"policy": "taylorseer", "every": 2}},
            "step_cache.every",
            ["not a key of engine_args.step_cache", "'interval'"],
        ),
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


def test_a_stage_process_given_a_wrong_engine_arg_ends_with_an_engine_failed_termination(tmp_path: Path) -> None:
    """The engine refuses its args when it is made (InvalidEngineArgs, in the stage server's load), and the stage
    process exits 1 with the same EngineFailed termination message as any engine that cannot load, naming the
    stage and the key (the operator checks the args first; this is the process's own line of defence)."""
    import asyncio

    from omni_runtime.connectors.mooncake_master import free_port
    from omni_runtime.spec.reasons import Reason
    from omni_runtime.stage.main import serve
    from omni_runtime.stage.settings import StageSettings
    from omni_runtime.stage.termination import Termination
    from omni_runtime.wire.auth import PipelineKey

    spec = PipelineSpec(
        name="p",
        stages=[
            StageSpec(name="dit", kind=StageKind.DIFFUSION, engine_args={"quantization": "fp9"}, final_output=True)
        ],
    )
    config = tmp_path / "resolved.json"
    config.write_text(resolve_pipeline(spec, name="p", model="/models/none").model_dump_json(by_alias=True))
    termination = tmp_path / "termination-log"
    termination.write_text("")
    key = tmp_path / "pipeline-key"
    settings = StageSettings(
        config=str(config), pipeline_key_file=str(key), stage="dit", host="127.0.0.1", port=free_port(),
        http_port=free_port(), termination_log=str(termination),
    )  # fmt: skip
    assert asyncio.run(serve(settings, key=PipelineKey.write_new(key))) == 1
    told = Termination.parse(termination.read_text())
    assert told is not None and told.reason is Reason.ENGINE_FAILED, termination.read_text()
    assert "stage 'dit': engine_args.quantization is 'fp9'" in told.message
