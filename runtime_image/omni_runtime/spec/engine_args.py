"""Typed engine args: one pydantic model per engine family, the one description of every key omnikube reads.

A stage's `engine_args` is a free map in the topology and in an OmniPipeline's `stages[].engineArgs`; which
keys mean something depends on the engine that runs the stage, chosen by its kind and (for generation
stages) its `runner`, as `engines.factory.ENGINES` chooses it. `ENGINE_ARGS_MODELS` is the same table with
the model of each engine's args, so `engine_args_for(stage)` can check a stage's args before any pod runs:
the operator reports a wrong one as Degraded `InvalidEngineArgs`, and a built-in topology with a wrong one
fails the unit tests. Keys that are not omnikube's pass through: vLLM's engine arguments on `ar` stages
(vLLM checks them when the stage starts), diffusers' `from_pretrained` arguments on `diffusion` stages, and
runner arguments on `vae_decode` stages. The speech runners read only their own keys and refuse others.

Every engine reads its stage's args through these models (`engines.common.typed_engine_args`, once, when it
is constructed) and holds no key list of its own, so each key, type, default and refusal is written here only.
Pure pydantic: importing it never pulls in torch or an engine.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, model_validator

from omni_runtime.spec.enums import StageKind
from omni_runtime.spec.pipeline import PipelineSpec, SpecError, StageSpec
from omni_runtime.spec.reasons import Reason

__all__ = [
    "ENGINE_ARGS_MODELS",
    "HIDDEN_ROUTE_EXCLUSIVE",
    "KV_EXPORT_EXCLUSIVE",
    "AccelSettings",
    "ArArgs",
    "BagelArgs",
    "Code2WavArgs",
    "DiffusionArgs",
    "EngineArgs",
    "GenerationArgs",
    "GlmImageArArgs",
    "InvalidEngineArgs",
    "RegistryOnlyKeys",
    "StepCacheSettings",
    "TalkerArgs",
    "Token2WavArgs",
    "VideoArgs",
    "check_engine_args",
    "engine_args_for",
    "engine_args_model",
]


class InvalidEngineArgs(SpecError):
    """A stage's engine args that its engine would refuse: a key of omnikube's with a wrong value, two keys
    that cannot be combined, or a key a runner does not read. `stage` and `field` say where."""

    reason: ClassVar[Reason] = Reason.INVALID_ENGINE_ARGS

    def __init__(self, message: str, *, stage: str, field: str) -> None:
        super().__init__(message)
        self.stage = stage
        self.field = field
        """The engine arg at fault (dotted for a nested key: `step_cache.interval`)."""


class _Conflict(ValueError):
    """Raised by a model's cross-key check; carries the key to name, so nobody parses the message."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class EngineArgs(BaseModel):
    """The engine args of one engine family (a subclass per family)."""

    contract_fields: ClassVar[frozenset[str]] = frozenset()
    """Fields that change what the stage sends or reads over an edge: in the pipeline contract
    (spec.contract), so replicas that differ in one never take part in one request."""
    neutral_fields: ClassVar[frozenset[str]] = frozenset()
    """Fields that do not (devices, capacity, bounds on requests): out of the contract. Every field of a family
    is in exactly one of the two sets, its mixins' included (tests/test_contract.py checks)."""
    neutral_extra: ClassVar[frozenset[str]] = frozenset()
    """Pass-through keys known not to change payloads; every other pass-through key is in the contract."""

    model_config = ConfigDict(frozen=True)

    passes_through: ClassVar[str] = ""
    """For people: where the keys that are not fields go ("" when the engine refuses them)."""


Device = Annotated[
    StrictStr | None,
    Field(description="Where the stage runs (`cpu`, `cuda`, `cuda:1`...); unset: cuda when available, else cpu."),
]


class RegistryOnlyKeys(BaseModel):
    """Keys of the registry's topologies that describe the stage to omnikube; never passed to the engine."""

    contract_fields: ClassVar[frozenset[str]] = frozenset(
        {"model_stage", "model_arch", "hf_config_name", "engine_output_type"}
    )

    model_stage: StrictStr | None = Field(
        None,
        description="Registry key (never passed on): which part of a multi-stage checkpoint this stage serves "
        "(thinker, talker, code2wav).",
    )
    model_arch: StrictStr | None = Field(
        None, description="Registry key (never passed on): the checkpoint's architecture class, as in config.json."
    )
    hf_config_name: StrictStr | None = Field(
        None,
        description="Registry key (never passed on): the sub-config of config.json the stage's model reads "
        "(e.g. `thinker_config`).",
    )
    engine_output_type: StrictStr | None = Field(
        None,
        description="Registry key (never passed on): what the stage hands downstream (`latent`: hidden states "
        "or codes; `text`; `audio`).",
    )


HIDDEN_ROUTE_EXCLUSIVE = ("speculative_config", "kv_transfer_config", "enable_prefix_caching", "async_scheduling")
"""vLLM engine args an AR stage cannot set with `hidden_state_layers` / `media_hidden_layer`: the hidden-state
route sets the first two itself and is not verified with the others."""


KV_EXPORT_EXCLUSIVE = ("kv_transfer_config", "speculative_config", "async_scheduling")
"""vLLM engine args an AR stage cannot set with `export_kv_cache`: the KV route sets the first itself (vLLM runs one
KV connector per engine), a drafter's layers would join the export, and async scheduling is not verified with it."""


class ArArgs(EngineArgs, RegistryOnlyKeys):
    """An `ar` stage on vLLM."""

    contract_fields = frozenset({"hidden_state_layers", "media_hidden_layer", "export_kv_cache", "context_format"})
    neutral_fields = frozenset({"tool_call_parser"})
    neutral_extra = frozenset(
        {
            "max_model_len", "kv_cache_memory_bytes", "gpu_memory_utilization", "max_num_seqs",
            "max_num_batched_tokens", "enforce_eager", "seed", "limit_mm_per_prompt", "tensor_parallel_size",
            "swap_space", "block_size", "disable_log_stats", "enable_chunked_prefill", "cpu_offload_gb",
            "distributed_executor_backend", "max_logprobs",
        }
    )  # fmt: skip

    model_config = ConfigDict(extra="allow")
    passes_through = (
        "Other keys are vLLM's engine arguments (AsyncEngineArgs; `runner` among them), checked when the stage "
        "starts: a name vLLM lacks fails the stage with the closest names. On a CPU, `kv_cache_memory_bytes` "
        "(1 GiB) and `enforce_eager` (true) are set unless given."
    )

    tool_call_parser: StrictStr | None = Field(
        None,
        description="The vLLM tool-call parser (as `vllm serve --tool-call-parser`, e.g. `hermes` for "
        "Qwen2.5/Qwen3) that reads tool calls from the stage's text and constrains `tool_choice` required or a "
        "named function; without it requests with tools are refused unless `tool_choice` is `none`. A name that "
        "is not a vLLM parser fails the stage at start with the list of names. Never passed to vLLM.",
    )
    hidden_state_layers: list[StrictInt] | None = Field(
        None,
        min_length=1,
        description="Layers whose hidden-state rows each request streams to the next stage, as Hugging Face "
        "`output_hidden_states` indices (0 the embeddings, k the output of layer k-1, -1 the last layer before "
        "the final norm); an index out of the model's range fails the stage at start. vLLM's "
        "`speculative_config` and `kv_transfer_config` are then omnikube's and its media processor cache is "
        "off. Never passed to vLLM.",
    )
    media_hidden_layer: StrictInt | Literal["talker"] | None = Field(
        None,
        description="The layer whose rows at a prompt's media positions go out with a request's first piece: an "
        "index as in `hidden_state_layers`, or `talker` (the checkpoint's `talker_config.accept_hidden_layer`). "
        "Same route and costs as `hidden_state_layers`, which it cannot be combined with. Never passed to vLLM.",
    )
    export_kv_cache: StrictBool = Field(
        False,
        description="Send each request's prompt KV cache (every attention layer's K after rope and V, in the cache "
        "dtype, once the prompt is prefilled) to the next stage with its final piece, the primary's and each CFG "
        "companion's: what a DiT attending to the AR stage's context reads (AR -> DiT, BAGEL). Its blocks stay in "
        "vLLM until sent; a request whose KV does not arrive fails naming its role. vLLM's `kv_transfer_config` is "
        "then omnikube's: not with `hidden_state_layers` / `media_hidden_layer` (one KV connector per engine), "
        "`speculative_config`, `async_scheduling` or a quantized `kv_cache_dtype`; one sequence per request (n 1). "
        "Never passed to vLLM.",
    )

    context_format: Literal["chat_template", "bagel"] = Field(
        "chat_template",
        description="How a context-only request (one whose next stage reads only its KV cache: `ar_kv_to_bagel`) "
        "is tokenized: `chat_template`, the model's template as every chat; `bagel`, BAGEL's contexts (every "
        "message's text as `<|im_start|>` + text + `<|im_end|>`, no role word, nothing after), what its "
        "generation expert was trained on. Chats the stage answers itself always use the template. Never passed "
        "to vLLM.",
    )

    @model_validator(mode="after")
    def _kv_export_alone(self) -> ArArgs:
        if not self.export_kv_cache:
            return self
        extra = self.model_extra or {}
        hidden = [k for k in ("hidden_state_layers", "media_hidden_layer") if getattr(self, k) is not None]
        if hidden:
            raise _Conflict(
                "export_kv_cache",
                f"engine_args export_kv_cache cannot be combined with {hidden[0]}: each needs vLLM's KV connector and "
                "vLLM runs one per engine; keep one of them",
            )
        taken = [k for k in KV_EXPORT_EXCLUSIVE if extra.get(k)]
        if taken:
            raise _Conflict(
                taken[0],
                f"engine_args {taken} cannot be combined with export_kv_cache (the KV route sets the KV transfer "
                "config, would export a drafter's layers too, and is not verified with async scheduling); remove them",
            )
        cache_dtype = extra.get("kv_cache_dtype")
        if cache_dtype not in (None, "auto"):
            raise _Conflict(
                "kv_cache_dtype",
                f"engine_args kv_cache_dtype {cache_dtype!r} cannot be combined with export_kv_cache: the KV leaves in "
                "the model's dtype and a quantized cache cannot be read back exactly; use auto or remove it",
            )
        return self

    @model_validator(mode="after")
    def _one_hidden_state_route(self) -> ArArgs:
        route = "media_hidden_layer" if self.media_hidden_layer is not None else None
        if self.hidden_state_layers is not None:
            if route is not None:
                raise _Conflict(
                    "media_hidden_layer",
                    "engine_args hidden_state_layers and media_hidden_layer cannot be combined (one sends every "
                    "row, the other media rows only); keep one, set the other to null",
                )
            route = "hidden_state_layers"
        if route is None:
            return self
        extra = self.model_extra or {}
        taken = [k for k in HIDDEN_ROUTE_EXCLUSIVE if extra.get(k)]
        if taken:
            raise _Conflict(
                taken[0],
                f"engine_args {taken} cannot be combined with hidden_state_layers / media_hidden_layer (the "
                "hidden-state route sets the speculative and KV transfer configs and is not verified with prefix "
                "caching or async scheduling); remove them or the layers",
            )
        if extra.get("mm_processor_cache_gb"):
            raise _Conflict(
                "mm_processor_cache_gb",
                f"engine_args mm_processor_cache_gb cannot be combined with {route} (a cached media item carries "
                "no grid for the talker); remove it",
            )
        return self


class StepCacheSettings(BaseModel):
    """A schedule-based step cache (engine arg `step_cache`): which steps skip the transformer blocks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: Literal["taylorseer"] = Field(
        description="taylorseer: diffusers' TaylorSeer cache (skipped steps extrapolate the denoiser's output)."
    )
    interval: int = Field(3, ge=2, le=50, description="After the warm-up, one step in `interval` runs in full.")
    warmup: int = Field(4, ge=1, le=1000, description="The first steps, all run in full (Taylor factors).")
    order: int = Field(1, ge=0, le=3, description="Taylor order of the extrapolation (0: reuse the last output).")


class AccelSettings(BaseModel):
    """The speed options of a diffusion stage (engines/diffusion/accel.py applies them)."""

    neutral_fields: ClassVar[frozenset[str]] = frozenset(
        {"enforce_eager", "quantization", "step_cache_threshold", "step_cache", "cuda_graphs", "attention_backend"}
    )

    model_config = ConfigDict(frozen=True)

    enforce_eager: bool = Field(
        False,
        description="Never compile the denoiser (GPU only; a CPU never compiles). Otherwise a GPU compiles the "
        "repeated transformer blocks at start-up.",
    )
    quantization: Literal["fp8"] | None = Field(
        None,
        description="fp8: FP8 (e4m3, per-row scaled) matmuls in the repeated blocks; Ada/Hopper GPUs only "
        "(compute capability 8.9 or newer), refused elsewhere when the stage starts.",
    )
    step_cache_threshold: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="First Block Cache threshold (e.g. 0.08), below 1; 0 turns step caching off. A request "
        "turns it off with `step_cache: false`.",
    )
    step_cache: StepCacheSettings | None = Field(
        None,
        description="A schedule-based step cache, e.g. {policy: taylorseer, interval: 3, warmup: 4}: after the "
        "warm-up steps one in `interval` runs in full, the others extrapolate; unset: off. Not together with "
        "step_cache_threshold; a request turns it off with `step_cache: false`.",
    )
    cuda_graphs: bool = Field(
        False,
        description="Replay the compiled denoiser step as CUDA graphs (GPU; one graph per input shape). Not "
        "with enforce_eager or a step cache.",
    )
    attention_backend: str = Field(
        "auto",
        min_length=1,
        description="auto (FlashAttention-3, cuDNN or SDPA by GPU), or a diffusers attention backend name.",
    )

    @model_validator(mode="after")
    def _options_that_apply_together(self) -> AccelSettings:
        step_cache = self.step_cache is not None or self.step_cache_threshold > 0
        if self.cuda_graphs and (self.enforce_eager or step_cache):
            why = "enforce_eager" if self.enforce_eager else "a step cache (its per-step decision runs in Python)"
            raise _Conflict("cuda_graphs", f"engine arg cuda_graphs=true cannot apply with {why}; remove one of them")
        if self.step_cache is not None and self.step_cache_threshold > 0:
            raise _Conflict(
                "step_cache",
                f"engine args step_cache ({self.step_cache.policy}) and step_cache_threshold "
                f"({self.step_cache_threshold}) are two step caches; keep one of them",
            )
        if self.step_cache_threshold >= 1.0:
            raise _Conflict("step_cache_threshold", "step_cache_threshold must be below 1")
        return self


class VideoArgs(BaseModel):
    """The args of a diffusion stage whose pipeline makes videos (its `__call__` takes `num_frames`)."""

    neutral_fields: ClassVar[frozenset[str]] = frozenset({"max_frames", "default_fps", "max_fps"})

    model_config = ConfigDict(frozen=True)

    max_frames: int = Field(241, ge=1, description="Video pipelines: most frames one video may have.")
    default_fps: int = Field(
        16, ge=1, description="Video pipelines: frames per second of a request that names none (Wan's native 16)."
    )
    max_fps: int = Field(60, ge=1, description="Video pipelines: the highest fps a request may ask for.")


class DiffusionArgs(EngineArgs, AccelSettings, VideoArgs, RegistryOnlyKeys):
    """A `diffusion` stage on diffusers."""

    contract_fields = frozenset({"torch_dtype"})
    neutral_fields = frozenset(
        {"device", "batch_window_ms", "max_batch_size", "max_pixels", "max_inference_steps", "sequence_parallel"}
    )

    model_config = ConfigDict(extra="allow")
    passes_through = (
        "Other keys go to diffusers' `DiffusionPipeline.from_pretrained` (e.g. Wan 2.2's `boundary_ratio`)."
    )

    torch_dtype: StrictStr | None = Field(
        None,
        description="A torch dtype name (float32, bfloat16, float16); unset: float32 on a CPU, bfloat16 on CUDA. "
        "Replaced, with a warning, by one the device runs; a name torch lacks fails the stage at start.",
    )
    device: Device = None
    batch_window_ms: float = Field(
        10.0, ge=0.0, description="Milliseconds the oldest waiting request waits for others to batch with."
    )
    max_batch_size: int = Field(8, ge=1, description="Most images (requests x n) in one pipeline call.")
    max_pixels: int = Field(2048 * 2048, ge=1, description="Largest height x width a request may ask for.")
    max_inference_steps: int = Field(
        200, ge=1, description="Most denoising steps (`num_inference_steps`, or entries of `sigmas`/`timesteps`)."
    )
    sequence_parallel: Literal["auto"] | Annotated[StrictInt, Field(ge=1)] | None = Field(
        "auto",
        description="Ranks (one per GPU) the denoiser's sequence is split over, or auto: every visible GPU when "
        "the denoiser has a context-parallel plan, else 1.",
    )


class BagelArgs(EngineArgs):
    """A `diffusion` stage with `runner: bagel`: BAGEL's generation expert drawing over the thinker's KV caches
    (`engines.diffusion.bagel`), loaded from the same checkpoint folder as the thinker."""

    contract_fields = frozenset({"runner", "torch_dtype", "kv_dtype"})
    neutral_fields = frozenset({"device", "max_inference_steps"})

    model_config = ConfigDict(extra="forbid")
    passes_through = ""

    runner: Literal["bagel"] = Field(description="The BAGEL generation engine: bagel.")
    torch_dtype: StrictStr | None = Field(
        None,
        description="A torch dtype name (float32, bfloat16); unset: float32 on a CPU, bfloat16 on CUDA. A name "
        "torch lacks fails the stage at start.",
    )
    device: Device = None
    max_inference_steps: int = Field(200, ge=1, description="Most denoising steps a request may ask for.")
    kv_dtype: StrictStr | None = Field(
        None,
        description="The dtype of the thinker's KV cache, which every payload must have (a payload of another "
        "dtype is refused, naming both); unset: the checkpoint's torch_dtype, what the thinker's vLLM runs unless "
        "its own `dtype` says otherwise.",
    )


class GenerationArgs(EngineArgs):
    """A `generation` stage with `runner: vae_decode` (diffusers AutoencoderKL latents to PNG images)."""

    contract_fields = frozenset({"runner", "chunk_size", "chunk_dim", "torch_dtype"})
    neutral_fields = frozenset({"device"})

    model_config = ConfigDict(extra="allow")
    passes_through = "Other keys are handed to the runner, which reads none today."

    runner: Literal["vae_decode"] = Field(description="The module runner: vae_decode.")
    chunk_size: int = Field(1, ge=1, description="Items (images) per chunk along chunk_dim; one output per chunk.")
    chunk_dim: int = Field(0, description="The input axis the engine splits into chunks.")
    torch_dtype: StrictStr = Field(
        "float32", description="A torch dtype name; one torch lacks fails the stage at start."
    )
    device: Device = None


class TalkerArgs(EngineArgs):
    """A `generation` stage running a talker: step-batched codec decoding fed by the thinker."""

    contract_fields = frozenset({"runner", "torch_dtype"})
    neutral_fields = frozenset({"device", "max_requests"})

    model_config = ConfigDict(extra="forbid")

    runner: Literal["qwen3_omni_talker", "qwen2_5_omni_talker"] = Field(
        description="The talker: qwen3_omni_talker or qwen2_5_omni_talker."
    )
    device: Device = None
    torch_dtype: StrictStr | None = Field(
        None,
        description="A torch dtype name; unset: bfloat16 on CUDA, float32 elsewhere. One torch lacks fails the "
        "stage at start.",
    )
    max_requests: int = Field(
        64, ge=1, description="Requests decoding at once (KV slots on a GPU); more running at once are refused."
    )


class Code2WavArgs(EngineArgs):
    """A `generation` stage with `runner: qwen3_omni_code2wav`: codec windows to audio as they arrive."""

    contract_fields = frozenset({"runner", "torch_dtype"})
    neutral_fields = frozenset({"device", "left_context", "max_frames_per_call"})

    model_config = ConfigDict(extra="forbid")

    runner: Literal["qwen3_omni_code2wav"] = Field(description="The decoder: qwen3_omni_code2wav.")
    device: Device = None
    torch_dtype: StrictStr | None = Field(
        None,
        description="`mixed` (bfloat16 decoder, float32 code embedding and pre-transformer) or a torch dtype name; "
        "unset: mixed on CUDA, float32 elsewhere.",
    )
    left_context: int = Field(25, ge=0, description="Earlier frames of the same request each window is decoded with.")
    max_frames_per_call: int = Field(300, ge=1, description="Most codec frames one decoder call takes.")


class Token2WavArgs(EngineArgs):
    """A `generation` stage with `runner: qwen2_5_omni_token2wav`: codec tokens to audio (DiT + BigVGAN)."""

    contract_fields = frozenset({"runner"})
    neutral_fields = frozenset({"device", "num_steps", "left_context"})

    model_config = ConfigDict(extra="forbid")

    runner: Literal["qwen2_5_omni_token2wav"] = Field(description="The decoder: qwen2_5_omni_token2wav.")
    device: Device = None
    num_steps: int = Field(10, ge=1, description="Flow-matching steps of the DiT per window.")
    left_context: int = Field(25, ge=0, description="Earlier codes of the same request each window is decoded with.")


class GlmImageArArgs(EngineArgs):
    """A `generation` stage with `runner: glm_image_ar`: GLM-Image's AR (transformers) emitting the image tokens
    its DiT stage reads (`engines.glm_image.ar`), loaded from the pipeline folder."""

    contract_fields = frozenset({"runner", "torch_dtype"})
    neutral_fields = frozenset({"device"})

    model_config = ConfigDict(extra="forbid")
    passes_through = ""

    runner: Literal["glm_image_ar"] = Field(description="GLM-Image's AR: glm_image_ar.")
    device: Device = None
    torch_dtype: StrictStr | None = Field(
        None, description="A torch dtype name; unset: float32. One torch lacks fails the stage at start."
    )


ENGINE_ARGS_MODELS: Mapping[tuple[StageKind, str | None], type[EngineArgs]] = {
    (StageKind.AR, None): ArArgs,
    (StageKind.DIFFUSION, None): DiffusionArgs,
    (StageKind.DIFFUSION, "bagel"): BagelArgs,
    (StageKind.GENERATION, "vae_decode"): GenerationArgs,
    (StageKind.GENERATION, "qwen3_omni_talker"): TalkerArgs,
    (StageKind.GENERATION, "qwen2_5_omni_talker"): TalkerArgs,
    (StageKind.GENERATION, "qwen3_omni_code2wav"): Code2WavArgs,
    (StageKind.GENERATION, "qwen2_5_omni_token2wav"): Token2WavArgs,
    (StageKind.GENERATION, "glm_image_ar"): GlmImageArArgs,
}
"""The args model of every engine, keyed as `engines.factory.ENGINES` (a test keeps the two keys equal): a
kind's default engine has `(kind, None)`: it runs a stage whose `runner` names no other engine of the kind (an AR
stage's `runner` is vLLM's own)."""


def _runners(kind: StageKind) -> list[str]:
    return sorted(runner for k, runner in ENGINE_ARGS_MODELS if k is kind and runner is not None)


def engine_args_model(stage: StageSpec) -> type[EngineArgs]:
    """The args model of the engine that runs `stage`; InvalidEngineArgs when its `runner` names none."""
    runner = stage.engine_args.get("runner")
    model = ENGINE_ARGS_MODELS.get((stage.kind, runner)) if isinstance(runner, str) else None
    model = model or ENGINE_ARGS_MODELS.get((stage.kind, None))
    if model is not None:
        return model
    what = "has no engine_args.runner" if runner is None else f"names runner {runner!r}"
    raise InvalidEngineArgs(
        f"stage {stage.name!r} {what}; set engine_args.runner to one of {_runners(stage.kind)} "
        f"(the runners of kind {stage.kind.value!r})",
        stage=stage.name,
        field="runner",
    )


def engine_args_for(stage: StageSpec) -> EngineArgs:
    """The stage's engine args as its engine's model (chosen by kind and `runner`, see ENGINE_ARGS_MODELS).

    Raises InvalidEngineArgs naming the stage and the first key at fault, what it is and what is allowed.
    """
    model = engine_args_model(stage)
    try:
        return model.model_validate(stage.engine_args)
    except ValidationError as err:
        field, problem = _first_problem(model, err, stage.engine_args)
        raise InvalidEngineArgs(f"stage {stage.name!r}: {problem}", stage=stage.name, field=field) from None


def check_engine_args(topology: PipelineSpec) -> None:
    """Check every stage's engine args (see engine_args_for); raises InvalidEngineArgs for the first wrong one."""
    for stage in topology.stages:
        engine_args_for(stage)


def _first_problem(model: type[EngineArgs], err: ValidationError, given: Mapping[str, Any]) -> tuple[str, str]:
    """(the key at fault, a sentence saying what it is and what to change) for the first key pydantic refused."""
    errors = err.errors()
    first = errors[0]
    if first["type"] == "extra_forbidden" and len(first["loc"]) > 1:  # a key inside a nested setting
        parent = _field_path(model, first["loc"][:-1])
        key = f"{parent}.{first['loc'][-1]}"
        nested = _nested_model_at(model, parent)
        takes = sorted(nested.model_fields) if nested is not None else []
        return key, f"engine_args.{key} is not a key of engine_args.{parent}; it takes {takes} (remove it)"
    if first["type"] == "extra_forbidden":
        key = str(first["loc"][0])
        runner = given.get("runner")
        return key, (
            f"engine_args.{key} is not read by runner {runner!r}; it takes {sorted(model.model_fields)} "
            "(remove it, or move it to the stage it belongs to)"
        )
    conflict = (first.get("ctx") or {}).get("error")
    if isinstance(conflict, _Conflict):
        return conflict.field, str(conflict)
    path = _field_path(model, first["loc"])
    # A union (e.g. `auto` or a number) fails once per branch: say every branch, once.
    said = [e["msg"][:1].lower() + e["msg"][1:] for e in errors if _field_path(model, e["loc"]) == path]
    allowed = " or ".join(dict.fromkeys(said))
    field = _field_info(model, path)
    hint = f" ({field.description})" if field is not None and field.description else ""
    value = _given_at(given, path)
    return path, f"engine_args.{path} is {value!r}: {allowed}; change it or remove it{hint}"


def _field_path(model: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    """The dotted key of an error's location, without pydantic's union-branch tags (`int`, `literal[...]`)."""
    names: list[str] = []
    current: type[BaseModel] | None = model
    for part in loc:
        if current is None or not isinstance(part, str) or part not in current.model_fields:
            break
        names.append(part)
        current = _nested_model(current, part)
    return ".".join(names) or ".".join(str(p) for p in loc)


def _nested_model(model: type[BaseModel], name: str) -> type[BaseModel] | None:
    annotation = model.model_fields[name].annotation
    for candidate in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _nested_model_at(model: type[BaseModel], path: str) -> type[BaseModel] | None:
    """The model of the nested setting at a dotted key (`step_cache`: StepCacheSettings), or None."""
    current: type[BaseModel] | None = model
    for name in path.split("."):
        if current is None or name not in current.model_fields:
            return None
        current = _nested_model(current, name)
    return current


def _field_info(model: type[BaseModel], path: str) -> Any:
    current: type[BaseModel] | None = model
    info = None
    for name in path.split("."):
        if current is None or name not in current.model_fields:
            return None
        info = current.model_fields[name]
        current = _nested_model(current, name)
    return info


def _given_at(given: Mapping[str, Any], path: str) -> Any:
    """The value the stage gave at a dotted key (the whole list, not the item pydantic refused in it)."""
    value: Any = given
    for name in path.split("."):
        value = value.get(name) if isinstance(value, Mapping) else None
    return value


def classified_fields(model: type[BaseModel]) -> tuple[frozenset[str], frozenset[str]]:
    """(contract, neutral) fields of an engine-args family, its mixins' included."""
    contract: set[str] = set()
    neutral: set[str] = set()
    for cls in model.__mro__:
        contract |= cls.__dict__.get("contract_fields", frozenset())
        neutral |= cls.__dict__.get("neutral_fields", frozenset())
    return frozenset(contract), frozenset(neutral)


def contract_engine_args(stage: StageSpec) -> dict[str, Any]:
    """The stage's engine args that are in the pipeline contract, defaults filled (an arg given at its
    default and one left out are the same contract), pass-through keys included unless known neutral; args its
    family refuses, all as given."""
    try:
        model = engine_args_model(stage)
        args = engine_args_for(stage)
    except InvalidEngineArgs:  # the stage cannot start with them (it says why when it tries): all of them
        return json.loads(json.dumps(dict(sorted(stage.engine_args.items())), default=str))
    contract, _ = classified_fields(model)
    out = {name: getattr(args, name) for name in sorted(contract)}
    out.update({k: v for k, v in sorted((args.model_extra or {}).items()) if k not in model.neutral_extra})
    return json.loads(json.dumps(out, default=str))
