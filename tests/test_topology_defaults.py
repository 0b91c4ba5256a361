"""Every built-in topology serves its tiny model with the topology's own engine args: no overrides.

`DEFAULTS_SERVED` names, for each topology `omnikube pipelines` lists, where its tiny model is served with
the topology's engine args untouched (sampling_params may be made tiny: they are the request's defaults, not
what the engine can run). A topology added to the registry without such a check fails
`test_every_topology_has_a_defaults_check`.

Diffusion and speech stages are served that way by the tests named there. The AR stages are started here,
because every serve starts them with a smaller max_model_len and KV cache to save memory: each AR stage of a
topology is started from the registry with nothing given, as `omnikube serve <folder>` starts it (one that
another's start proves is named in `SAME_START`). A start that
returns has served one request: the engine's self-check runs a greedy token through `generate` before
`start()` returns (engines/ar/engine.py). One vLLM engine at a time.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from omni_runtime.registry import default_registry, get_pipeline
from omni_runtime.spec import StageKind, resolve_pipeline

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).parent

TINY_MODELS = {
    "bagel": "tiny-bagel",
    "flux": "tiny-flux",
    "glm-image": "tiny-glm-image",
    "prompt-enhanced-t2i": "tiny-prompt-enhanced-t2i",
    "qwen-image": "tiny-qwen-image",
    "qwen-image-edit": "tiny-qwen-image-edit",
    "qwen2-5-omni": "tiny-qwen2-5-omni",
    "qwen3-omni": "tiny-qwen3-omni",
    "stable-diffusion-3": "tiny-sd3",
    "stable-diffusion-3-img2img": "tiny-sd3-img2img",
    "text-chat": "tiny-qwen2-chat",
    "wan2-2-i2v": "tiny-wan2-2-i2v",
    "wan2-2-t2v": "tiny-wan2-2-t2v",
    "z-image": "tiny-z-image",
}
"""The tiny model (omni_runtime.tiny_models) of each built-in topology."""

HERE_AR = "test_topology_defaults.py::test_an_ar_stage_serves_with_its_topologys_engine_args"

DEFAULTS_SERVED: dict[str, list[str]] = {
    "bagel": ["test_serve_bagel.py::test_bagel_draws_over_the_thinkers_kv_with_its_companion"],  # both stages
    "flux": ["test_serve_t2i.py::test_flux_draws_the_requested_size"],
    "glm-image": ["test_glm_image.py::test_glm_image_topology_as_is_draws_the_requested_size"],  # both stages
    "prompt-enhanced-t2i": [
        "test_serve_t2i.py::test_enhanced_prompt_and_cfg_companion_reach_the_diffusion_stage",  # its dit
        HERE_AR,
    ],
    "qwen-image": ["test_serve_t2i.py::test_qwen_image_draws_the_requested_size"],
    "qwen-image-edit": ["test_serve_t2i.py::test_qwen_image_edit_takes_the_uploaded_image"],
    "qwen2-5-omni": ["test_speech_engines.py::test_qwen2_5_token2wav_decodes_windows_of_concurrent_requests_together",
                     "test_speech_engines.py::test_qwen2_5_talker_and_token2wav_equal_transformers", HERE_AR],
    "qwen3-omni": ["test_speech_engines.py::test_talker_and_code2wav_equal_transformers_for_concurrent_requests",
                   HERE_AR],
    "stable-diffusion-3": ["test_serve_t2i.py::test_text_to_image_honours_size_seed_and_n"],
    "stable-diffusion-3-img2img": ["test_serve_t2i.py::test_image_edit_takes_the_uploaded_image"],
    "text-chat": [HERE_AR],
    "wan2-2-i2v": ["test_serve_video.py::test_i2v_takes_the_first_frame_as_input_reference"],
    "wan2-2-t2v": ["test_serve_video.py::test_create_poll_download"],
    "z-image": ["test_z_image.py::test_z_image_draws_the_requested_size_and_its_seed_decides_it"],
}  # fmt: skip
"""Per topology, the tests that serve its tiny model with the topology's engine args (all its stages together)."""

SAME_START = {("prompt-enhanced-t2i", "enhancer"): ("text-chat", "llm")}
"""AR stages whose start another one's proves (CI time): the enhancer's folder is tiny-qwen2-chat copied
(tiny_models builds it from that folder) and both stages have the same (no) engine args."""

SERVED_AS_IS = {("bagel", "thinker")}
"""AR stages whose serve in DEFAULTS_SERVED leaves all their engine args as the topology has them (no smaller KV
pool or max_model_len): that serve is their start with the topology's engine args (CI time)."""

AR_STAGES = [
    (name, stage.name)
    for name in sorted(TINY_MODELS)
    for stage in get_pipeline(name).stages
    if stage.kind is StageKind.AR and (name, stage.name) not in SAME_START and (name, stage.name) not in SERVED_AS_IS
]


def _stage(topology: str, stage: str):
    return next(s for s in get_pipeline(topology).stages if s.name == stage)


def test_every_topology_has_a_defaults_check() -> None:
    """The registry's topologies and the ones checked here are the same, and each named test exists."""
    assert sorted(default_registry().names()) == sorted(DEFAULTS_SERVED) == sorted(TINY_MODELS)
    for checks in DEFAULTS_SERVED.values():
        for check in checks:
            file, name = check.split("::")
            tree = ast.parse((HERE / file).read_text(encoding="utf-8"))
            defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
            assert name in defined, f"{check} is not a test of {file}"
    for (topology, stage), (other, other_stage) in SAME_START.items():
        assert _stage(topology, stage).engine_args == _stage(other, other_stage).engine_args


@pytest.mark.models
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("topology", "stage"), AR_STAGES)
def test_an_ar_stage_serves_with_its_topologys_engine_args(topology: str, stage: str) -> None:
    """The AR stage loads with the topology's engine args and nothing else, and answers its self-check's
    request (a start that returns has); then it stops, its vLLM processes with it."""
    import asyncio

    from omni_runtime.engines.ar.engine import AREngine
    from omni_runtime.tiny_models import ensure

    pipeline = resolve_pipeline(get_pipeline(topology), name="defaults", model=str(ensure(TINY_MODELS[topology])))
    engine = AREngine(pipeline, pipeline.topology.stage(stage))
    assert engine.stage.engine_args == _stage(topology, stage).engine_args  # nothing given: the topology's own

    async def main() -> None:
        try:
            await engine.start()
            assert engine.llm is not None and engine.max_model_len > 1
        finally:
            await engine.stop()

    asyncio.run(main())
