"""Input processors: turn an upstream stage's output into the downstream stage's `EngineInput.data`.

One function per name in `omni_runtime.spec.INPUT_PROCESSORS`, all with the same shape:

    processor(upstream: StageSpec, outputs: dict[str, Payload], context: ProcessorContext) -> Payload

`outputs` maps a role to that role's *whole* upstream output: `"primary"` always, plus one entry per
CFG companion the upstream stage ran (`"cfg_text"`...). For an AR stage that is the accumulated text
and token ids (the router joins the streamed deltas), not the last delta. With a streaming edge
(`window` > 0) the router calls the processor once per window with that window's output.

Tensors may arrive as torch tensors or numpy arrays (connectors hand back either); processors return
torch tensors. A payload missing what a processor needs raises `ProcessorError`, naming the key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omni_runtime.spec import StageSpec

__all__ = [
    "PROCESSORS",
    "Processor",
    "ProcessorContext",
    "ProcessorError",
    "apply_processor",
    "ar_text_to_prompt",
    "dit_to_vae",
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
    """What the router knows about the request when it feeds the next stage.

    `request` holds the client's request fields the stages may use (for example `negative_prompt`).
    """

    request_id: str
    request: dict[str, Any] = field(default_factory=dict)


Processor = Callable[[StageSpec, dict[str, Payload], ProcessorContext], Payload]


def _primary(upstream: StageSpec, outputs: dict[str, Payload]) -> Payload:
    try:
        return outputs[PRIMARY]
    except KeyError:
        raise ProcessorError(
            f"stage {upstream.name!r} sent no {PRIMARY!r} output (got roles {sorted(outputs)}); "
            "the router must pass the primary request's output under the role 'primary'"
        ) from None


def _need(upstream: StageSpec, payload: Payload, key: str, processor: str) -> Any:
    if key not in payload or payload[key] is None:
        raise ProcessorError(
            f"{processor}: the output of stage {upstream.name!r} has no {key!r} "
            f"(it has {sorted(payload)}); that stage must produce {key!r} for this edge"
        )
    return payload[key]


def _tensor(value: Any):
    import torch

    return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)


def identity(upstream: StageSpec, outputs: dict[str, Payload], context: ProcessorContext) -> Payload:
    """The primary output, unchanged (a shallow copy, so the caller may add keys)."""
    return dict(_primary(upstream, outputs))


def ar_text_to_prompt(upstream: StageSpec, outputs: dict[str, Payload], context: ProcessorContext) -> Payload:
    """Prompt enhancer -> text-to-image: `{"text"}` outputs -> `{"prompt", "negative_prompt"}`.

    The primary's text becomes `prompt`. The first companion of the upstream stage whose output
    arrived (role `cfg_text` in the registry) gives `negative_prompt`; without one, the client's own
    `negative_prompt` (from the context) is used, else None (the DiT then runs its default).
    """
    prompt = str(_need(upstream, _primary(upstream, outputs), "text", "ar_text_to_prompt")).strip()
    if not prompt:
        raise ProcessorError(
            f"ar_text_to_prompt: stage {upstream.name!r} produced empty text for request "
            f"{context.request_id!r}; raise its max_tokens or check its stop settings"
        )
    negative: str | None = None
    for companion in upstream.companions:
        if companion.role in outputs:
            negative = str(_need(upstream, outputs[companion.role], "text", "ar_text_to_prompt")).strip()
            break
    else:
        negative = context.request.get("negative_prompt")
    return {"prompt": prompt, "negative_prompt": negative}


def thinker_to_talker(upstream: StageSpec, outputs: dict[str, Payload], context: ProcessorContext) -> Payload:
    """Thinker -> talker (Qwen-Omni), for the whole output or one streamed chunk of it.

    Token route (Qwen3-Omni): the talker holds the thinker's embedding table, so the thinker's
    `prompt_token_ids` (first chunk only) and generated `token_ids` are all a text prompt needs. Gives
    `{"thinker_prompt_ids", "thinker_token_ids", "thinker_text"}` (prompt ids only when present). A
    prompt with media also needs the thinker's rows at its media positions: the first chunk's
    `media_hidden_states` (positions, H) and `media_grids` (the ar engine's `media_hidden_layer`)
    pass on as `thinker_media_rows` (float32) and `thinker_media_grids`.

    Row route (Qwen2.5-Omni): when the thinker streams hidden states (its engine arg
    `hidden_state_layers`, a dict {layer: (rows, H)}, rows contiguous over prompt + generated tokens)
    it also gives `thinker_embeds` (layer 0, the embeddings), `thinker_hidden` (the deepest layer
    sent, before the thinker's final norm: the talker applies it, since it holds the checkpoint) and
    `thinker_hidden_layer` (that layer's index), float32; a prompt with media has its first chunk's
    `media_grids` passed on as `thinker_media_grids` (the talker's rope index reads them).
    """
    import torch

    payload = _primary(upstream, outputs)
    token_ids = [int(t) for t in _need(upstream, payload, "token_ids", "thinker_to_talker")]
    prompt_ids = [int(t) for t in payload.get("prompt_token_ids") or []]
    out: Payload = {"thinker_token_ids": token_ids, "thinker_text": payload.get("text", "")}
    if prompt_ids:
        out["thinker_prompt_ids"] = prompt_ids
    if payload.get("media_hidden_states") is not None:
        media = _tensor(payload["media_hidden_states"])
        if media.dim() != 2:
            raise ProcessorError(
                f"thinker_to_talker: media_hidden_states of stage {upstream.name!r} has shape "
                f"{tuple(media.shape)}; expected (media positions, hidden_size)"
            )
        out["thinker_media_rows"] = media.to(torch.float32)
        out["thinker_media_grids"] = dict(payload.get("media_grids") or {})
    elif payload.get("media_grids") is not None:  # the row route: the rows come below, the grids here
        out["thinker_media_grids"] = dict(payload["media_grids"])
    hidden = payload.get("hidden_states")
    if hidden is None:
        return out
    try:
        layers = {int(k): _tensor(v) for k, v in dict(hidden).items()}
    except (TypeError, ValueError) as exc:
        raise ProcessorError(
            f"thinker_to_talker: hidden_states of stage {upstream.name!r} is not a dict of layer index -> "
            f"(rows, hidden_size) rows as the ar engine sends it ({exc})"
        ) from None
    if 0 not in layers or len(layers) < 2:
        raise ProcessorError(
            f"thinker_to_talker: stage {upstream.name!r} sent hidden-state layers {sorted(layers)}; the talker "
            "needs layer 0 (the embeddings) and the last layer: set its hidden_state_layers to [0, -1]"
        )
    deepest = max(layers)
    embeds, rows = layers[0], layers[deepest]
    if embeds.dim() != 2 or tuple(embeds.shape) != tuple(rows.shape):
        raise ProcessorError(
            f"thinker_to_talker: hidden-state layers 0 and {deepest} of stage {upstream.name!r} have shapes "
            f"{tuple(embeds.shape)} and {tuple(rows.shape)}; expected equal (rows, hidden_size)"
        )
    out["thinker_embeds"] = embeds.to(torch.float32)
    out["thinker_hidden"] = rows.to(torch.float32)
    out["thinker_hidden_layer"] = deepest
    return out


def talker_to_code2wav(upstream: StageSpec, outputs: dict[str, Payload], context: ProcessorContext) -> Payload:
    """Talker -> code-to-waveform: codec codes -> `{"input": LongTensor (Q, T)}`.

    Reads `codes` (T, Q) or (T,) when the talker gives a tensor, else `token_ids` (flat list: one
    codebook). Trailing stop tokens (the upstream stage's `stop_token_ids`) are dropped: they end the
    talker's sequence but are not audio. The generation stage chunks `input` along its last axis.
    """
    import torch

    payload = _primary(upstream, outputs)
    if payload.get("codes") is not None:
        codes = _tensor(payload["codes"]).to(torch.long)
        codes = codes.unsqueeze(1) if codes.dim() == 1 else codes
    else:
        ids = [int(t) for t in _need(upstream, payload, "token_ids", "talker_to_code2wav")]
        stops = set(upstream.sampling_params.get("stop_token_ids") or [])
        while ids and ids[-1] in stops:
            ids.pop()
        codes = torch.tensor(ids, dtype=torch.long).unsqueeze(1)
    if codes.dim() != 2:
        raise ProcessorError(
            f"talker_to_code2wav: codes of stage {upstream.name!r} have shape {tuple(codes.shape)}; "
            "expected (frames,) or (frames, codebooks)"
        )
    return {"input": codes.transpose(0, 1).contiguous()}


def dit_to_vae(upstream: StageSpec, outputs: dict[str, Payload], context: ProcessorContext) -> Payload:
    """Diffusion (latent output) -> VAE decode stage: `{"latents": (B, C, h, w)}` -> `{"input": ...}`.

    A single latent (C, h, w) gets a batch axis. The VAE stage decodes one image per batch item.
    """
    latents = _tensor(_need(upstream, _primary(upstream, outputs), "latents", "dit_to_vae"))
    if latents.dim() == 3:
        latents = latents.unsqueeze(0)
    if latents.dim() < 4:
        raise ProcessorError(
            f"dit_to_vae: latents of stage {upstream.name!r} have shape {tuple(latents.shape)}; "
            "expected (batch, channels, height, width)"
        )
    return {"input": latents}


PROCESSORS: dict[str, Processor] = {
    "identity": identity,
    "ar_text_to_prompt": ar_text_to_prompt,
    "thinker_to_talker": thinker_to_talker,
    "talker_to_code2wav": talker_to_code2wav,
    "dit_to_vae": dit_to_vae,
}
"""Implementations by name; the keys equal `INPUT_PROCESSORS`' (a test checks it)."""


def apply_processor(name: str, upstream: StageSpec, outputs: dict[str, Payload], context: ProcessorContext) -> Payload:
    """Run the processor called `name`; unknown names raise ProcessorError listing the known ones."""
    try:
        processor = PROCESSORS[name]
    except KeyError:
        raise ProcessorError(f"input processor {name!r} is unknown; use one of {sorted(PROCESSORS)}") from None
    return processor(upstream, outputs, context)
