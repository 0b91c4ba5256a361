"""The payload of every stage edge, declared once: one TypedDict per payload kind, with each field's dtype and shape.

An engine builds its `EngineOutput.data` as one of these, an edge's processor (`processors.edges`) reads
one and returns the next stage's, and the stage server's windowing and the router's audio read the
markers its fields carry (`Items`, `downstream_only`: `processors.markers`), not lists of key names kept beside them.

    ar ─ArOutput─▶ thinker_to_talker ─TalkerInput─▶ talker ─TalkerOutput─▶ talker_to_code2wav
       ─Code2WavInput─▶ code2wav | token2wav ─AudioOutput─▶ router
    ar ─ArOutput─▶ ar_text_to_prompt ─DiffusionPrompt─▶ diffusion ─LatentsOutput─▶ dit_to_vae ─VaeInput─▶ vae
    ar (export_kv_cache) ─ArOutput.kv_cache: KvCachePayload (`processors.kv_cache`)─▶ ar_kv_to_bagel
       ─BagelContexts (the KV of each role)─▶ BAGEL's generation stage (diffusion, runner bagel)

**One array layout: time first.** Every array on an edge has its time (or sequence, or batch) axis
first: codec codes are (frames, codebooks), hidden-state rows (rows, hidden), media rows (media
positions, hidden), audio (samples,), latents (batch, channels, height, width), a prompt's KV cache
(tokens, layers, kv_heads, head_dim). An engine whose model
wants another order transposes at its model call and nowhere else (code2wav's decoder takes
(codebooks, frames)). The one exception is audio with channels, (channels, samples) as WAV encoders and
the router read it: its time runs along the last axis (`Items(axis=-1)`); the speech engines send mono.

Arrays arrive as torch tensors or numpy arrays (connectors hand back either; `Array`); processors
return torch tensors. Importing this module imports neither torch nor an engine: the wire and the
router read it.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Annotated, Any, TypedDict

from omni_runtime.processors.kv_cache import BagelContexts, KvCachePayload
from omni_runtime.processors.markers import Array, DtypeKind, Items, Layout, downstream_only

__all__ = [
    "PAYLOAD_KINDS",
    "QWEN_CODEC_SAMPLE_RATE",
    "ArOutput",
    "Array",
    "AudioOutput",
    "Code2WavInput",
    "DiffusionPrompt",
    "DtypeKind",
    "GlmImageDitInput",
    "GlmImagePriorTokens",
    "Items",
    "BagelContexts",
    "KvCachePayload",
    "LatentsOutput",
    "Layout",
    "MediaGrids",
    "TalkerInput",
    "TalkerOutput",
    "VaeInput",
    "as_payload",
    "downstream_only_keys",
    "field_layout",
    "item_keys",
]

QWEN_CODEC_SAMPLE_RATE = 24000
"""Samples per second of the audio that Qwen-Omni's codecs decode to (Qwen3-Omni's code2wav, Qwen2.5-Omni's
token2wav), and so of an `AudioOutput` that names no `sample_rate`."""


class MediaGrids(TypedDict, total=False):
    """The media shapes of a thinker's prompt, in prompt order per modality, as vLLM's processor made them:
    what the Qwen-Omni talkers' rope index reads (transformers' names)."""

    image_grid_thw: list[list[int]]
    """(t, h, w) per image."""
    video_grid_thw: list[list[int]]
    """(t, h, w) per video."""
    video_second_per_grid: list[float]
    """Seconds per temporal grid step, per video."""
    audio_feature_lengths: list[int]
    """Feature frames per audio."""
    use_audio_in_video: bool
    """True when a video's own audio track is interleaved with its frames."""


class ArOutput(TypedDict, total=False):
    """One piece of an `ar` stage's output (a delta when it streams; `engines.ar`)."""

    text: str
    """The piece's new text (the whole text once folded)."""
    token_ids: Annotated[list[int], Items()]
    """The piece's new token ids."""
    prompt_token_ids: list[int]
    """The rendered prompt's token ids: on the first piece only."""
    logprobs: list[Any]
    """One row per new token, when asked (`engines.ar.extras`)."""
    index: int
    """Which of the request's `n` sequences the piece belongs to (only when `n` > 1)."""
    tool_calls: list[dict[str, Any]]
    """OpenAI tool-call deltas parsed from the piece (tool parsing on)."""
    message: dict[str, Any]
    """The whole reply parsed (`content`, `tool_calls`): on the last piece, tool parsing on."""
    finish_reason: str | None
    """The finish reason the parsed reply reports (tool parsing on)."""
    stream_finish_reason: str | None
    """The finish reason a stream reports (tool parsing on)."""
    hidden_states: Annotated[dict[str, Array], downstream_only]
    """float32 (rows, hidden) per layer index (engine arg `hidden_state_layers`): row i belongs to token i of
    `prompt_token_ids + token_ids`, contiguous across a request's pieces."""
    media_hidden_states: Annotated[Array, Layout((("media positions", "hidden"),), DtypeKind.FLOAT), downstream_only]
    """float32 rows of the media placeholder positions of the prompt, in prompt order (engine arg
    `media_hidden_layer`): on the first piece only."""
    media_grids: Annotated[MediaGrids, downstream_only]
    """The prompt's media shapes (first piece, a prompt with media)."""
    kv_cache: Annotated[KvCachePayload, downstream_only]
    """The prompt's K and V of every attention layer after its prefill (engine arg `export_kv_cache`): on the
    final piece only, of the primary and of each CFG companion alike."""


class TalkerInput(TypedDict, total=False):
    """What `thinker_to_talker` gives a talker, per thinker chunk (`engines.speech.talker`)."""

    thinker_token_ids: list[int]
    """The thinker's new token ids."""
    thinker_text: str
    """The thinker's new text."""
    thinker_prompt_ids: list[int]
    """The thinker's prompt token ids: first chunk only."""
    thinker_media_rows: Annotated[Array, Layout((("media positions", "hidden"),), DtypeKind.FLOAT)]
    """float32 thinker rows at the prompt's media positions (Qwen3-Omni): first chunk only."""
    thinker_media_grids: MediaGrids
    """The prompt's media shapes: first chunk only, a prompt with media."""
    thinker_embeds: Annotated[Array, Layout((("rows", "hidden"),), DtypeKind.FLOAT)]
    """float32 layer-0 rows, the embeddings (Qwen2.5-Omni)."""
    thinker_hidden: Annotated[Array, Layout((("rows", "hidden"),), DtypeKind.FLOAT)]
    """float32 rows of the deepest layer sent, before the thinker's final norm (Qwen2.5-Omni)."""
    thinker_hidden_layer: int
    """The index of the layer `thinker_hidden` holds."""


class TalkerOutput(TypedDict, total=False):
    """One piece of a talker's output: the codec frames it made since the last piece."""

    codes: Annotated[Array, Layout((("frames",), ("frames", "codebooks")), DtypeKind.INT), Items()]
    """int64 codec codes (frames, codebooks): 16 codebooks for Qwen3-Omni, 1 for Qwen2.5-Omni."""
    token_ids: Annotated[list[int], Items()]
    """Codec ids of one codebook, of a talker that is an `ar` stage (stop tokens at the end included)."""


class Code2WavInput(TypedDict):
    """What `talker_to_code2wav` gives a codec decoder (code2wav, token2wav), per window."""

    codes: Annotated[Array, Layout((("frames", "codebooks"),), DtypeKind.INT)]
    """int64 codec codes (frames, codebooks), stop tokens dropped."""


class AudioOutput(TypedDict, total=False):
    """One piece of a speech stage's audio (code2wav, token2wav): what the router encodes as WAV or PCM."""

    audio: Annotated[Array, Items(axis=-1)]
    """float32 samples in [-1, 1], (samples,) (or (channels, samples): time last, see the module docstring)."""
    sample_rate: int
    """Samples per second (QWEN_CODEC_SAMPLE_RATE when absent)."""


class DiffusionPrompt(TypedDict):
    """What `ar_text_to_prompt` gives a diffusion stage."""

    prompt: str
    """The prompt, stripped."""
    negative_prompt: str | None
    """The companion's text, else the client's own, else None (the model's default)."""


class LatentsOutput(TypedDict, total=False):
    """A diffusion stage's output in latent space (`output_type: latent`), for a separate VAE stage."""

    latents: Annotated[
        Array,
        Layout((("channels", "height", "width"), ("batch", "channels", "height", "width")), DtypeKind.FLOAT),
        Items(),
    ]
    """Latents (batch, channels, height, width) in the diffusion model's space; (channels, height, width) for one."""


class VaeInput(TypedDict):
    """What `dit_to_vae` gives a `vae_decode` generation stage (split into chunks along the batch)."""

    input: Annotated[Array, Layout((("batch", "channels", "height", "width"),), DtypeKind.FLOAT)]
    """Latents (batch, channels, height, width)."""


class GlmImagePriorTokens(TypedDict):
    """What GLM-Image's AR stage (`glm_image_ar`) outputs: its image tokens, ready as the DiT's prior tokens.

    The AR emits a small preview grid, then the target grid at 1/32 of the image, then its end token; the target
    grid's tokens, upsampled x2 (nearest) to the DiT's 1/16 grid, are `prior_token_ids`, as
    `GlmImagePipeline.generate_prior_tokens` gives them.
    """

    prior_token_ids: Annotated[Array, Layout((("batch", "tokens"),), DtypeKind.INT)]
    """The target image's VQ codes on the DiT's grid, (1, (height/16) * (width/16))."""
    prior_token_image_ids: Annotated[Array, Layout((("tokens",),), DtypeKind.INT)] | None
    """i2i: every input picture's VQ codes on the DiT's grid, concatenated; None for t2i."""
    source_image_grid_thw: Annotated[Array, Layout((("images", "thw"),), DtypeKind.INT)] | None
    """i2i: each input picture's (1, h, w) grid on the DiT's grid, one row per picture; None for t2i."""
    prompt: str
    """The prompt the AR read (the DiT's glyph encoder reads it too)."""
    image: bytes | None
    """i2i: the input picture's file bytes, which the DiT encodes with its VAE; None for t2i."""
    height: int
    width: int
    """The target size in pixels the AR drew its grid for (multiples of 32)."""


class GlmImageDitInput(TypedDict):
    """What `glm_ar_to_dit` gives GLM-Image's DiT stage (the diffusion engine): the prompt, the picture for i2i,
    and the AR's tokens as the pipeline's `prior_token_ids` / `prior_token_image_ids` / `source_image_grid_thw`."""

    prompt: str
    image: bytes | None
    prior_token_ids: Annotated[Array, Layout((("batch", "tokens"),), DtypeKind.INT)]
    prior_token_image_ids: list[Any] | None
    """i2i: one tensor per request (the pipeline's per-sample list); None for t2i."""
    source_image_grid_thw: list[Any] | None
    """i2i: one (images, 3) tensor per request; None for t2i."""
    height: int
    width: int


PAYLOAD_KINDS: tuple[type, ...] = (
    TalkerOutput,
    ArOutput,
    LatentsOutput,
    AudioOutput,
    TalkerInput,
    Code2WavInput,
    DiffusionPrompt,
    VaeInput,
    KvCachePayload,
    BagelContexts,
    GlmImagePriorTokens,
    GlmImageDitInput,
)
"""Every payload kind; the order is the precedence of their `Items` fields (a talker's codes before token ids)."""


def _extras(kind: type) -> dict[str, tuple[Any, ...]]:
    """Each field of `kind` with its `Annotated` markers (empty for a plain field)."""
    hints = typing.get_type_hints(kind, include_extras=True)
    return {name: getattr(hint, "__metadata__", ()) for name, hint in hints.items()}


def field_layout(kind: type, name: str) -> Layout | None:
    """The `Layout` declared for array field `name` of payload kind `kind`; None for a field that is no array."""
    return next((m for m in _extras(kind)[name] if isinstance(m, Layout)), None)


def item_keys() -> dict[str, int]:
    """The fields that count a piece's items, in precedence order, each with the axis its items run along."""
    out: dict[str, int] = {}
    for kind in PAYLOAD_KINDS:
        for name, extras in _extras(kind).items():
            for marker in extras:
                if isinstance(marker, Items):
                    out.setdefault(name, marker.axis)
    return out


def downstream_only_keys() -> tuple[str, ...]:
    """The fields an engine output carries for the next stage only (a thinker's rows and media shapes)."""
    return tuple(name for kind in PAYLOAD_KINDS for name, extras in _extras(kind).items() if downstream_only in extras)


def as_payload(data: Mapping[str, object]) -> dict[str, Any]:
    """A payload of one of these kinds as the plain dict an `EngineOutput` or a connector carries (the same
    object: a TypedDict is a dict at run time; the static type says which keys it has)."""
    return typing.cast(dict[str, Any], data)
