"""The diffusion engine's speed options on the CPU: settings refused with clear errors, FP8 refused where it
cannot run (and its matmul's error against the float layer), and both step caches (first block cache,
TaylorSeer) on the real tiny-flux folder, loaded, self-checked and prompted with text as a stage does (they
skip steps, stay within a PSNR bound of the full run, and a request can turn them off; SD3, whose blocks
diffusers' cache does not wrap, is refused at start). Compilation and
the GPU attention backends only run on a GPU: bench/diffusion_speed.py measures them there."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import torch
from servelib import diffusion_image

from omni_runtime.engines.base import EngineError, InvalidRequest
from omni_runtime.engines.diffusion.accel import Accel
from omni_runtime.engines.diffusion.engine import DiffusionEngine
from omni_runtime.engines.diffusion.fp8 import Fp8Linear, to_fp8
from omni_runtime.registry import get_pipeline
from omni_runtime.spec import StageOverride
from omni_runtime.spec.engine_args import AccelSettings, InvalidEngineArgs
from omni_runtime.spec.resolved import resolve_pipeline

PARAMS = {"num_inference_steps": 6, "height": 64, "width": 64}
CACHE_ARGS = {"torch_dtype": "float32", "batch_window_ms": 200, "step_cache_threshold": 0.9}
"""float32 not to make a CPU run work: PSNR_BOUND_DB was measured in float32 (cached vs full run)."""
PSNR_BOUND_DB = 25.0
"""tiny-flux, 6 steps, threshold 0.9 (5 of 6 steps from the cache): measured 52.1 dB against the full run."""
TAYLORSEER = {"policy": "taylorseer", "interval": 2, "warmup": 2, "order": 1}
"""6 steps: 0 and 1 in full (warm-up), then 3 and 5 in full, 2 and 4 extrapolated."""
TAYLORSEER_PSNR_BOUND_DB = 25.0
"""tiny-flux, 6 steps, TAYLORSEER (2 of 6 steps extrapolated): measured 50.7 dB against the full run."""


def _engine(model: Path | str, **engine_args: object) -> DiffusionEngine:
    stage = StageOverride(name="dit", engine_args=engine_args, sampling_params=PARAMS)
    pipeline = resolve_pipeline(get_pipeline("stable-diffusion-3"), name="t", model=str(model), stages=[stage])
    return DiffusionEngine(pipeline, pipeline.topology.stage("dit"))


def _pixels(png: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)), dtype=np.float64)


def _psnr(a: bytes, b: bytes) -> float:
    mse = float(((_pixels(a) - _pixels(b)) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


@pytest.mark.parametrize(
    ("args", "field", "message"),
    [
        ({"quantization": "int4"}, "quantization", r"engine_args\.quantization is 'int4': input should be 'fp8'"),
        (
            {"step_cache_threshold": 1.5},
            "step_cache_threshold",
            r"engine_args\.step_cache_threshold is 1\.5: input should be less than or equal to 1",
        ),
        (
            {"enforce_eager": "sometimes"},
            "enforce_eager",
            r"engine_args\.enforce_eager is 'sometimes': input should be a valid boolean",
        ),
        (
            {"attention_backend": ""},
            "attention_backend",
            r"engine_args\.attention_backend is '': string should have at least 1 character",
        ),
    ],
)
def test_bad_speed_settings_are_refused_with_what_is_allowed(args: dict, field: str, message: str) -> None:
    with pytest.raises(InvalidEngineArgs, match=message) as err:
        _engine("/models/none", **args)
    assert err.value.field == field and "stage 'dit'" in str(err.value) and "change it or remove it" in str(err.value)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            {"step_cache": {"policy": "teacache"}},
            r"engine_args\.step_cache\.policy is 'teacache': input should be 'taylorseer'",
        ),
        (
            {"step_cache": {"policy": "taylorseer", "interval": 1}},
            r"engine_args\.step_cache\.interval is 1: input should be greater than or equal to 2",
        ),
        (
            {"step_cache": {"policy": "taylorseer", "every": 2}},
            r"engine_args\.step_cache\.every is not a key of engine_args\.step_cache; it takes \['interval'",
        ),
        ({"step_cache": "taylorseer"}, r"engine_args\.step_cache is 'taylorseer': input should be a valid dictionary"),
        (
            {"step_cache": TAYLORSEER, "step_cache_threshold": 0.1},
            r"step_cache \(taylorseer\) and step_cache_threshold \(0\.1\) are two step caches; keep one",
        ),
        ({"cuda_graphs": True, "step_cache": TAYLORSEER}, r"cuda_graphs=true cannot apply with a step cache"),
        ({"cuda_graphs": True, "enforce_eager": True}, r"cuda_graphs=true cannot apply with enforce_eager"),
        ({"cuda_graphs": "sometimes"}, r"engine_args\.cuda_graphs is 'sometimes': input should be a valid boolean"),
    ],
)
def test_bad_step_cache_settings_are_refused_with_what_is_allowed(args: dict, message: str) -> None:
    with pytest.raises(InvalidEngineArgs, match=message):
        _engine("/models/none", **args)


def _accel(**settings: Any) -> Accel:
    return Accel("dit", AccelSettings.model_validate(settings))


def test_fused_qkv_with_fp8_stays_close_to_the_float_model_and_the_cpu_path_is_unchanged() -> None:
    """With fp8, a Flux denoiser's q/k/v projections become one FP8 matmul per attention (one activation
    quantization instead of three); the separate projections are dropped. The arithmetic is checked on the
    CPU (`torch._scaled_mm` runs there; the engine refuses fp8 on a CPU only because it is no faster). Without
    fp8, a CPU stage keeps diffusers' model as it is."""
    import copy

    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    ).to(torch.bfloat16)  # fmt: skip
    plain = copy.deepcopy(model)
    inputs = {
        "hidden_states": torch.randn(1, 64, 16, dtype=torch.bfloat16),
        "encoder_hidden_states": torch.randn(1, 8, 32, dtype=torch.bfloat16),
        "pooled_projections": torch.randn(1, 32, dtype=torch.bfloat16),
        "timestep": torch.tensor([0.5]),
        "guidance": torch.tensor([3.5]),
        "img_ids": torch.zeros(64, 3),
        "txt_ids": torch.zeros(8, 3),
    }

    class _Pipe:
        transformer = model

    cpu = _accel(attention_backend="native")
    cpu.apply(type("P", (), {"transformer": copy.deepcopy(model)})(), "cpu")
    assert cpu.fused_attentions == 0 and cpu.fp8_layers == 0
    accel = _accel(quantization="fp8", attention_backend="native")
    accel.apply(_Pipe(), "cpu")
    assert accel.fused_attentions == 3  # one double-stream block, two single-stream blocks
    assert accel.split_proj_out == 2 and accel.fast_gelu == 2  # two single blocks; ff and ff_context
    assert cpu.split_proj_out == 0 and cpu.fast_gelu == 0
    assert not any(hasattr(m, "to_q") for m in model.modules() if hasattr(m, "to_qkv"))
    with torch.inference_mode():
        got = model(**inputs).sample.float()
        want = plain(**inputs).sample.float()
    assert float((got - want).norm() / want.norm()) < 0.06
    # CUDA graphs capture the compiled step alone, and no rank's collectives: refused where that is not what runs.
    with pytest.raises(EngineError, match="cuda_graphs=true cannot apply with an uncompiled denoiser"):
        _accel(cuda_graphs=True).apply(_Pipe(), "cpu")
    with pytest.raises(EngineError, match="cuda_graphs=true cannot apply with sequence parallelism"):
        _accel(cuda_graphs=True).apply(_Pipe(), "cpu", parallel=lambda pipe: None)


def _tiny_flux(dtype: torch.dtype) -> tuple[Any, dict[str, torch.Tensor]]:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    ).to(dtype)  # fmt: skip
    inputs = {
        "hidden_states": torch.randn(1, 64, 16, dtype=dtype),
        "encoder_hidden_states": torch.randn(1, 8, 32, dtype=dtype),
        "pooled_projections": torch.randn(1, 32, dtype=dtype),
        "timestep": torch.tensor([0.5]),
        "guidance": torch.tensor([3.5]),
        "img_ids": torch.zeros(64, 3),
        "txt_ids": torch.zeros(8, 3),
    }
    return model, inputs


def test_split_single_block_proj_out_computes_the_same_as_the_whole_layer() -> None:
    """fp8 on Flux: each single block's proj_out(cat(attention, GELU(mlp))) runs as attention @ Wa^T + GELU(mlp) @
    Wm^T + b (no concatenation; each input quantized on its own rows) and GELU's tanh form as x * sigmoid(2z). In
    float that is the same function up to rounding; with FP8 (CPU `_scaled_mm`, as on the GPU) it stays as close
    to the float model as the whole FP8 layer does."""
    import copy

    from omni_runtime.engines.diffusion import flux

    model, inputs = _tiny_flux(torch.float32)
    split = copy.deepcopy(model)
    blocks = [*split.transformer_blocks, *split.single_transformer_blocks]
    assert flux.split_single_proj_out(blocks) == 2
    assert flux.fast_gelu(blocks) == 2  # the double block: ff and ff_context
    assert type(split.single_transformer_blocks[0]).__name__ == "FluxSingleTransformerBlock"  # name lists still match
    with torch.inference_mode():
        want, got = model(**inputs).sample, split(**inputs).sample
    assert float((got - want).norm() / want.norm()) < 1e-5  # float rounding only

    bf16, bf16_inputs = _tiny_flux(torch.bfloat16)
    whole = copy.deepcopy(bf16)
    to_fp8([*whole.transformer_blocks, *whole.single_transformer_blocks])  # FP8 with proj_out in one piece
    accel = _accel(quantization="fp8", attention_backend="native")
    accel.apply(type("P", (), {"transformer": bf16})(), "cpu")
    assert accel.split_proj_out == 2
    with torch.inference_mode():
        ref = want  # the float32 model (the same seed, so the same weights before rounding to bfloat16)
        split_err = float((bf16(**bf16_inputs).sample.float() - ref).norm() / ref.norm())
        whole_err = float((whole(**bf16_inputs).sample.float() - ref).norm() / ref.norm())
    assert split_err < 0.06 and split_err < 1.2 * whole_err, (split_err, whole_err)


async def test_fp8_is_refused_on_a_cpu_before_loading_anything() -> None:
    engine = _engine("/nonexistent/model", quantization="fp8", device="cpu")
    with pytest.raises(EngineError, match=r"fp8 needs an NVIDIA GPU of compute capability 8\.9.*runs on cpu"):
        await engine.start()
    assert engine.pipe is None
    engine = _engine("/nonexistent/model", cuda_graphs=True, device="cpu")
    with pytest.raises(EngineError, match=r"cuda_graphs=true needs an NVIDIA GPU; this stage runs on cpu"):
        await engine.start()
    assert engine.pipe is None


def test_the_cuda_graph_wrapper_runs_what_it_cannot_capture_as_is() -> None:
    """The denoiser step's CUDA-graph wrapper (captured on GPUs only, measured by bench/diffusion_speed.py)
    passes every call it cannot key straight to the forward: CPU tensors, outside inference mode,
    return_dict=True; nothing is captured or replayed then."""
    from omni_runtime.engines.diffusion.graphs import GraphedForward

    linear = torch.nn.Linear(4, 4)

    def forward(hidden_states: torch.Tensor, return_dict: bool = True) -> tuple[torch.Tensor]:
        return (linear(hidden_states),)

    graphed = GraphedForward("dit", forward)
    x = torch.randn(2, 4)
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(graphed(hidden_states=x, return_dict=False)[0], forward(x)[0])
            assert torch.equal(graphed(hidden_states=x)[0], forward(x)[0])
    assert torch.equal(graphed(hidden_states=x, return_dict=False)[0], forward(x)[0])
    assert graphed.replays == 0 and not graphed.graphs and not graphed.broken


def test_fp8_linear_stays_close_to_the_float_layer() -> None:
    """The FP8 layer's arithmetic (per-row scales, e4m3) through `torch._scaled_mm` on the CPU; the engine
    refuses fp8 on a CPU since it is no faster there, but the error is the same as on a GPU."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 128).to(torch.bfloat16)
    x = torch.randn(2, 7, 256, dtype=torch.bfloat16)
    fp8 = Fp8Linear.build(linear)
    with torch.inference_mode():
        got, want = fp8(x).float(), linear(x).float()
    assert got.shape == want.shape
    assert float((got - want).norm() / want.norm()) < 0.06
    assert not Fp8Linear.convertible(torch.nn.Linear(100, 128))  # _scaled_mm needs multiples of 16
    # One class for every FP8 layer: torch.compile guards on module classes, and a class per layer made it
    # compile every Flux block anew (57 blocks: start-up ran past minutes on the H200).
    assert type(Fp8Linear.build(torch.nn.Linear(32, 16))) is type(fp8)


@pytest.mark.models
def test_both_wan_experts_get_the_attention_backend_and_fp8(tiny_wan_t2v_model: Path) -> None:
    """Wan2.2 has two denoisers (`transformer`, `transformer_2`): the speed options apply to both, not only the
    first (before, the low-noise expert, half of every video's steps, ran uncompiled and in bf16). Compilation
    runs only on a GPU; it wraps the same block list."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(tiny_wan_t2v_model, local_files_only=True)
    accel = _accel(quantization="fp8", attention_backend="native")
    accel.apply(pipe, "cpu")
    fp8_class = type(Fp8Linear.build(torch.nn.Linear(32, 16)))
    per_expert = [sum(isinstance(m, fp8_class) for m in t.modules()) for t in (pipe.transformer, pipe.transformer_2)]
    assert per_expert[0] > 0 and per_expert == [per_expert[0]] * 2
    assert accel.fp8_layers == sum(per_expert)
    for expert in (pipe.transformer, pipe.transformer_2):
        backends = {m.processor._attention_backend for m in expert.modules() if hasattr(m, "processor")}
        assert backends == {"native"}


def _flux_engine(model: Path, engine_args: dict[str, object]) -> DiffusionEngine:
    """The `dit` stage of the flux topology on the real tiny-flux folder (CLIP + T5 text encoders, loaded by
    the engine's own `_load`, then its self-check), with these engine args; not started. Flux, since
    diffusers' first block cache does not wrap SD3's blocks (refused, tested below)."""
    stage = StageOverride(name="dit", engine_args=engine_args, sampling_params={**PARAMS, "guidance_scale": 3.5})
    pipeline = resolve_pipeline(get_pipeline("flux"), name="t", model=str(model), stages=[stage])
    return DiffusionEngine(pipeline, pipeline.topology.stage("dit"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cached(tiny_flux_model: Path) -> AsyncIterator[DiffusionEngine]:
    """One first-block-cache engine for the module; its start runs the self-check through the step cache."""
    engine = _flux_engine(tiny_flux_model, CACHE_ARGS)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


LIGHTHOUSE = "a lighthouse at dusk"  # with seed 3, the prompt of every image here


@pytest.mark.models
@pytest.mark.timeout(600)
@pytest.mark.asyncio(loop_scope="module")
async def test_step_cache_skips_steps_within_a_psnr_bound_and_a_request_can_turn_it_off(
    cached: DiffusionEngine,
) -> None:
    assert not cached.accel.compiled  # a CPU never compiles
    hits = cached.stats()["step_cache_hits_total"]
    fast = await diffusion_image(cached, "c1", LIGHTHOUSE, seed=3)
    assert cached.stats()["step_cache_hits_total"] > hits
    hits = cached.stats()["step_cache_hits_total"]
    full = await diffusion_image(cached, "c2", LIGHTHOUSE, seed=3, step_cache=False)
    assert cached.stats()["step_cache_hits_total"] == hits  # every step ran in full
    assert fast != full
    assert _psnr(fast, full) >= PSNR_BOUND_DB
    assert await diffusion_image(cached, "c3", LIGHTHOUSE, seed=3) == fast  # no state leaks from one call into the next
    # Requests that differ in the switch never share a pipeline call.
    await asyncio.gather(
        diffusion_image(cached, "m1", LIGHTHOUSE, seed=3),
        diffusion_image(cached, "m2", LIGHTHOUSE, seed=3, step_cache=False),
    )
    assert sorted(map(sorted, list(cached.batch_log)[-2:])) == [["m1"], ["m2"]]
    with pytest.raises(InvalidRequest, match="step_cache must be true or false"):
        await diffusion_image(cached, "bad", LIGHTHOUSE, seed=3, step_cache="no")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def taylorseer(tiny_flux_model: Path) -> AsyncIterator[DiffusionEngine]:
    """One TaylorSeer engine for the module (a step cache is an engine arg: one engine per policy)."""
    engine = _flux_engine(tiny_flux_model, {"torch_dtype": "float32", "batch_window_ms": 200, "step_cache": TAYLORSEER})
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


@pytest.mark.models
@pytest.mark.timeout(600)
@pytest.mark.asyncio(loop_scope="module")
async def test_taylorseer_step_cache_skips_the_scheduled_steps_within_a_psnr_bound_and_a_request_can_turn_it_off(
    taylorseer: DiffusionEngine,
) -> None:
    """The schedule-based cache skips the same steps whatever the weights (random ones too): 2 of 6 here."""
    stats = taylorseer.stats
    checks, hits = stats()["step_cache_checks_total"], stats()["step_cache_hits_total"]
    fast = await diffusion_image(taylorseer, "t1", LIGHTHOUSE, seed=3)
    assert (stats()["step_cache_checks_total"] - checks, stats()["step_cache_hits_total"] - hits) == (6, 2)
    hits = stats()["step_cache_hits_total"]
    full = await diffusion_image(taylorseer, "t2", LIGHTHOUSE, seed=3, step_cache=False)
    assert stats()["step_cache_hits_total"] == hits  # every step ran in full
    assert fast != full
    psnr = _psnr(fast, full)
    print(f"taylorseer (2 of 6 steps extrapolated) vs every step in full: PSNR {psnr:.1f} dB")
    assert psnr >= TAYLORSEER_PSNR_BOUND_DB
    # no state leaks from one call into the next
    assert await diffusion_image(taylorseer, "t3", LIGHTHOUSE, seed=3) == fast
    assert stats()["step_cache_hits_total"] == hits + 2


@pytest.mark.models
@pytest.mark.timeout(600)
@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"attention_backend": "warp-drive"}, "attention_backend 'warp-drive' cannot run here.*use auto, native"),
        ({"step_cache_threshold": 0.1}, "step caching does not apply to SD3Transformer2DModel"),
        ({"step_cache": {"policy": "taylorseer"}}, "step caching does not apply to SD3Transformer2DModel"),
    ],
)
async def test_settings_the_model_cannot_take_fail_the_start(tiny_sd3_model: Path, args: dict, message: str) -> None:
    engine = _engine(tiny_sd3_model, **args)
    with pytest.raises(EngineError, match=message):
        await engine.start()
    await engine.stop()
