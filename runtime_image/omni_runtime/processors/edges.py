"""Input processors: turn an upstream stage's output into the downstream stage's `EngineInput.data`.

One function per name in `omni_runtime.spec.INPUT_PROCESSORS`, all with the same shape:

    processor(upstream: StageSpec, outputs: dict[str, Payload], context: ProcessorContext) -> payload

The receiving stage server runs them (`stage.inputs`), on what its connectors handed it. `outputs` maps
a role to that role's upstream output: `"primary"` always, plus one entry per CFG companion the upstream
stage ran (`"cfg_text"`...). For an AR stage that is its text and token ids folded over the pieces the
edge carried: the whole output, or, with a windowed edge (`window` > 0), one window's, since the stage
runs the processor once per window. What each processor reads and returns is a payload kind of
`processors.payloads`, which also fixes the array layout (time first).

Tensors may arrive as torch tensors or numpy arrays (connectors hand back either); processors return
torch tensors. A payload missing what a processor needs, or with an array of the wrong number of
dimensions or kind of number, raises `ProcessorError` naming the edge (`source->target`) and the field.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from omni_runtime.processors.kv_cache import BagelContexts, KvCachePayload
from omni_runtime.processors.payloads import (
    ArOutput,
    Code2WavInput,
    DiffusionPrompt,
    DtypeKind,
    GlmImageDitInput,
    GlmImagePriorTokens,
    LatentsOutput,
    MediaGrids,
    TalkerInput,
    TalkerOutput,
    VaeInput,
    as_payload,
    field_layout,
)
from omni_runtime.spec import StageSpec

__all__ = [
    "PROCESSORS",
    "Processor",
    "ProcessorContext",
    "ProcessorError",
    "apply_processor",
    "ar_kv_to_bagel",
    "ar_text_to_prompt",
    "dit_to_vae",
    "glm_ar_to_dit",
    "identity",
    "talker_to_code2wav",
    "thinker_to_talker",
]

Payload = dict[str, Any]
PRIMARY = "primary"


class ProcessorError(ValueError):
    """An upstream output lacks what the edge's processor needs (a pipeline/engine mismatch: 5xx)."""


@dataclass
class ProcessorContext:
    """What the receiving stage knows about the request when it feeds its engine.

    `request` holds the client's request fields the stages may use (for example `negative_prompt`);
    `target` is the receiving stage's name, so that an error names the edge (None: unknown, in a test).
    """

    request_id: str
    request: dict[str, Any] = field(default_factory=dict)
    target: str | None = None


Processor = Callable[[StageSpec, dict[str, Payload], ProcessorContext], Mapping[str, Any]]
"""A processor returns one payload kind of `processors.payloads` (identity: the upstream's own)."""


def _edge(upstream: StageSpec, context: ProcessorContext) -> str:
    """The edge as errors name it: `source->target`."""
    return f"{upstream.name}->{context.target or '(downstream stage)'}"


def _primary(upstream: StageSpec, outputs: dict[str, Payload]) -> Payload:
    try:
        return outputs[PRIMARY]
    except KeyError:
        raise ProcessorError(
            f"stage {upstream.name!r} sent no {PRIMARY!r} output (got roles {sorted(outputs)}); "
            "the router must pass the primary request's output under the role 'primary'"
        ) from None


def _need(upstream: StageSpec, context: ProcessorContext, payload: Mapping[str, Any], key: str) -> Any:
    if key not in payload or payload[key] is None:
        raise ProcessorError(
            f"edge {_edge(upstream, context)}: field {key!r} is missing (the output of stage {upstream.name!r} "
            f"has {sorted(payload)}); that stage must produce {key!r} for this edge"
        )
    return payload[key]


def _tensor(value: Any):
    import torch

    return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)


def _grids(value: Any) -> MediaGrids:
    """A copy of a thinker's media grids (the talker checks their keys against `MediaGrids`)."""
    return cast(MediaGrids, dict(value))


def _array(upstream: StageSpec, context: ProcessorContext, kind: type, payload: Mapping[str, Any], key: str) -> Any:
    """Field `key` of `payload` (of payload kind `kind`) as a torch tensor, checked against the `Layout` that
    `kind` declares for it: its number of dimensions and kind of number. None when absent."""
    value = payload.get(key)
    if value is None:
        return None
    layout = field_layout(kind, key)
    assert layout is not None, f"{kind.__name__}.{key} declares no Layout"
    try:
        tensor = _tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ProcessorError(
            f"edge {_edge(upstream, context)}: field {key!r} is {type(value).__name__}, not an array "
            f"{layout.describe()} ({exc})"
        ) from None
    if tensor.dim() not in {len(axes) for axes in layout.shapes}:
        raise ProcessorError(
            f"edge {_edge(upstream, context)}: field {key!r} has shape {tuple(tensor.shape)}; "
            f"expected {layout.describe()}"
        )
    floating = tensor.dtype.is_floating_point or tensor.dtype.is_complex
    if floating != (layout.dtype is DtypeKind.FLOAT):
        raise ProcessorError(
            f"edge {_edge(upstream, context)}: field {key!r} has dtype {tensor.dtype}; expected "
            f"{layout.dtype.value} numbers {layout.describe()}"
        )
    return tensor


def identity(upstream: StageSpec, outputs: dict[str, Payload], context: ProcessorContext) -> Payload:
    """The primary output, unchanged (a shallow copy, so the caller may add keys)."""
    return dict(_primary(upstream, outputs))


def ar_text_to_prompt(upstream: StageSpec, outputs: dict[str, Payload], context: ProcessorContext) -> DiffusionPrompt:
    """Prompt enhancer -> text-to-image: `ArOutput` (its `text`) -> `DiffusionPrompt`.

    The primary's text becomes `prompt`. The first companion of the upstream stage whose output
    arrived (role `cfg_text` in the registry) gives `negative_prompt`; without one, the client's own
    `negative_prompt` (from the context) is used, else None (the DiT then runs its default).
    """
    prompt = str(_need(upstream, context, _primary(upstream, outputs), "text")).strip()
    if not prompt:
        raise ProcessorError(
            f"ar_text_to_prompt: stage {upstream.name!r} produced empty text for request "
            f"{context.request_id!r}; raise its max_tokens or check its stop settings"
        )
    negative: str | None = None
    for companion in upstream.companions:
        if companion.role in outputs:
            negative = str(_need(upstream, context, outputs[companion.role], "text")).strip()
            break
    else:
        negative = context.request.get("negative_prompt")
    return DiffusionPrompt(prompt=prompt, negative_prompt=negative)


def thinker_to_talker(upstream: StageSpec, outputs: dict[str, Payload], context: ProcessorContext) -> TalkerInput:
    """Thinker -> talker (Qwen-Omni): `ArOutput` -> `TalkerInput`, for the whole output or one streamed chunk.

    Token route (Qwen3-Omni): the talker holds the thinker's embedding table, so the thinker's
    `prompt_token_ids` (first chunk only) and generated `token_ids` are all a text prompt needs: they
    become `thinker_prompt_ids` (only when present), `thinker_token_ids` and `thinker_text`. A prompt
    with media also needs the thinker's rows at its media positions: the first chunk's
    `media_hidden_states` and `media_grids` (the ar engine's `media_hidden_layer`) pass on as
    `thinker_media_rows` (float32) and `thinker_media_grids`.

    Row route (Qwen2.5-Omni): when the thinker streams hidden states (its engine arg
    `hidden_state_layers`, rows contiguous over prompt + generated tokens) it also gives
    `thinker_embeds` (layer 0, the embeddings), `thinker_hidden` (the deepest layer sent, before the
    thinker's final norm: the talker applies it, since it holds the checkpoint) and
    `thinker_hidden_layer` (that layer's index), float32; a prompt with media has its first chunk's
    `media_grids` passed on as `thinker_media_grids` (the talker's rope index reads them).
    """
    import torch

    payload = _primary(upstream, outputs)
    edge = _edge(upstream, context)
    token_ids = [int(t) for t in _need(upstream, context, payload, "token_ids")]
    prompt_ids = [int(t) for t in payload.get("prompt_token_ids") or []]
    out = TalkerInput(thinker_token_ids=token_ids, thinker_text=payload.get("text", ""))
    if prompt_ids:
        out["thinker_prompt_ids"] = prompt_ids
    media = _array(upstream, context, ArOutput, payload, "media_hidden_states")
    if media is not None:
        out["thinker_media_rows"] = media.to(torch.float32)
        out["thinker_media_grids"] = _grids(payload.get("media_grids") or {})
    elif payload.get("media_grids") is not None:  # the row route: the rows come below, the grids here
        out["thinker_media_grids"] = _grids(payload["media_grids"])
    hidden = payload.get("hidden_states")
    if hidden is None:
        return out
    try:
        layers = {int(k): _tensor(v) for k, v in dict(hidden).items()}
    except (TypeError, ValueError) as exc:
        raise ProcessorError(
            f"edge {edge}: field 'hidden_states' of stage {upstream.name!r} is not a dict of layer index -> "
            f"(rows, hidden) rows as the ar engine sends it ({exc})"
        ) from None
    if 0 not in layers or len(layers) < 2:
        raise ProcessorError(
            f"edge {edge}: stage {upstream.name!r} sent hidden-state layers {sorted(layers)}; the talker "
            "needs layer 0 (the embeddings) and the last layer: set its hidden_state_layers to [0, -1]"
        )
    deepest = max(layers)
    embeds, rows = layers[0], layers[deepest]
    if embeds.dim() != 2 or tuple(embeds.shape) != tuple(rows.shape):
        raise ProcessorError(
            f"edge {edge}: field 'hidden_states' layers 0 and {deepest} of stage {upstream.name!r} have shapes "
            f"{tuple(embeds.shape)} and {tuple(rows.shape)}; expected equal (rows, hidden)"
        )
    if not embeds.dtype.is_floating_point or not rows.dtype.is_floating_point:
        raise ProcessorError(
            f"edge {edge}: field 'hidden_states' layers 0 and {deepest} of stage {upstream.name!r} have dtypes "
            f"{embeds.dtype} and {rows.dtype}; expected floating point (rows, hidden)"
        )
    out["thinker_embeds"] = embeds.to(torch.float32)
    out["thinker_hidden"] = rows.to(torch.float32)
    out["thinker_hidden_layer"] = deepest
    return out


def talker_to_code2wav(upstream: StageSpec, outputs: dict[str, Payload], context: ProcessorContext) -> Code2WavInput:
    """Talker -> codec decoder: `TalkerOutput` -> `Code2WavInput`, int64 codes (frames, codebooks).

    Reads `codes` (frames, codebooks), or (frames,) for one codebook, when the talker gives an array,
    else `token_ids` (one codebook, of an ar talker): its trailing stop tokens (the upstream stage's
    `stop_token_ids`) are dropped, since they end the talker's sequence but are not audio. The layout
    stays time first; the decoder transposes at its model call.
    """
    import torch

    payload = _primary(upstream, outputs)
    codes = _array(upstream, context, TalkerOutput, payload, "codes")
    if codes is not None:
        codes = codes.to(torch.long)
        codes = codes.unsqueeze(1) if codes.dim() == 1 else codes
    else:
        ids = [int(t) for t in _need(upstream, context, payload, "token_ids")]
        stops = set(upstream.sampling_params.get("stop_token_ids") or [])
        while ids and ids[-1] in stops:
            ids.pop()
        codes = torch.tensor(ids, dtype=torch.long).unsqueeze(1)
    return Code2WavInput(codes=codes.contiguous())


def dit_to_vae(upstream: StageSpec, outputs: dict[str, Payload], context: ProcessorContext) -> VaeInput:
    """Diffusion (latent output) -> VAE decode stage: `LatentsOutput` -> `VaeInput`.

    A single latent (channels, height, width) gets a batch axis. The VAE stage decodes one image per batch item.
    """
    payload = _primary(upstream, outputs)
    _need(upstream, context, payload, "latents")
    latents = _array(upstream, context, LatentsOutput, payload, "latents")
    if latents.dim() == 3:
        latents = latents.unsqueeze(0)
    return VaeInput(input=latents)


def ar_kv_to_bagel(upstream: StageSpec, outputs: dict[str, Payload], context: ProcessorContext) -> BagelContexts:
    """BAGEL's thinker -> generation expert: each role's `ArOutput.kv_cache` (`KvCachePayload`) -> `BagelContexts`.

    The primary's KV is required; a companion's is passed on under its role when its output arrived. A companion
    output that arrived without its KV is an error naming the role (the thinker lacks `export_kv_cache`): never
    a context silently dropped. Which roles the image needs is the dit's to say (its guidance: a companion at
    scale 1 was never planned), so a role absent here fails there, named, if the guidance needs it.
    """
    contexts: dict[str, KvCachePayload] = {}
    for role in (PRIMARY, *(c.role for c in upstream.companions)):
        output = _primary(upstream, outputs) if role == PRIMARY else outputs.get(role)
        if output is None:
            continue
        kv = output.get("kv_cache")
        if kv is None:
            raise ProcessorError(
                f"edge {_edge(upstream, context)}: the {role} output of stage {upstream.name!r} has no 'kv_cache' "
                f"(it has {sorted(output)}); set engine_args.export_kv_cache: true on that stage"
            )
        contexts[role] = kv
    return BagelContexts(contexts=contexts)


def glm_ar_to_dit(upstream: StageSpec, outputs: dict[str, Payload], context: ProcessorContext) -> GlmImageDitInput:
    """GLM-Image's AR -> its DiT: `GlmImagePriorTokens` -> `GlmImageDitInput`.

    The tokens are already on the DiT's grid (the AR stage upsampled them, as the pipeline does); here they take
    the shapes `GlmImagePipeline.__call__` reads: i2i's source tokens and grids as one-element per-sample lists.
    The prompt and the picture ride along: the DiT's glyph encoder reads the prompt, its VAE the picture.
    """
    payload = _primary(upstream, outputs)
    _need(upstream, context, payload, "prior_token_ids")
    prior = _array(upstream, context, GlmImagePriorTokens, payload, "prior_token_ids")
    image_ids, grids = payload.get("prior_token_image_ids"), payload.get("source_image_grid_thw")
    if (image_ids is None) != (grids is None):
        raise ProcessorError(
            f"edge {_edge(upstream, context)}: stage {upstream.name!r} sent only one of prior_token_image_ids and "
            "source_image_grid_thw; an i2i output has both, a t2i output neither"
        )
    return GlmImageDitInput(
        prompt=str(_need(upstream, context, payload, "prompt")),
        image=payload.get("image"),
        prior_token_ids=prior.long(),
        prior_token_image_ids=None if image_ids is None else [_tensor(image_ids).long()],
        source_image_grid_thw=None if grids is None else [_tensor(grids).long()],
        height=int(_need(upstream, context, payload, "height")),
        width=int(_need(upstream, context, payload, "width")),
    )


PROCESSORS: dict[str, Processor] = {
    "identity": identity,
    "ar_text_to_prompt": ar_text_to_prompt,
    "thinker_to_talker": thinker_to_talker,
    "talker_to_code2wav": talker_to_code2wav,
    "dit_to_vae": dit_to_vae,
    "ar_kv_to_bagel": ar_kv_to_bagel,
    "glm_ar_to_dit": glm_ar_to_dit,
}
"""Implementations by name; the keys equal `INPUT_PROCESSORS`' (a test checks it)."""


def apply_processor(name: str, upstream: StageSpec, outputs: dict[str, Payload], context: ProcessorContext) -> Payload:
    """Run the processor called `name` on the edge from `upstream` to `context.target`; unknown names raise
    ProcessorError listing the known ones, and so does a payload the processor refuses (naming the edge)."""
    try:
        processor = PROCESSORS[name]
    except KeyError:
        raise ProcessorError(f"input processor {name!r} is unknown; use one of {sorted(PROCESSORS)}") from None
    return as_payload(processor(upstream, outputs, context))
