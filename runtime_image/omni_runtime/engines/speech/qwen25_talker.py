"""Qwen2.5-Omni talker: the inputs `Qwen2_5OmniForConditionalGeneration.generate` builds, step by step.

Unlike Qwen3-Omni's, this talker conditions on the thinker's hidden states: every input row is
`thinker last layer (final-normed) + thinker embedding` of one token (research note §3). From the
thinker's rows (layer 0 = embeddings, layer N = last layer before the final norm, as the ar engine's
`hidden_state_layers: [0, -1]` streams them; the norm is applied here, where the checkpoint is) it
builds exactly what transformers 5.19 builds:

- prefill: the prompt's rows, then the speaker's text-bos embedding, then generated token 0's row;
  codec pad and codec bos embeddings added to the last two; all through `thinker_to_talker_proj`;
- decode step k: the codec embedding of code k + the row of generated token k+1, then text-eos once,
  then text-pad (the thinker's last token has no row: its row would come from the next step);
- one codec id per step (a single codebook at 50 Hz); codec pad or codec end stops (no code out);
  codec bos and ids past token2wav's codebook (other than the stops) are never drawn; the repetition
  penalty also counts the prompt's mask, pad and bos ids.

A step whose text row has not arrived WAITS (feeding pads would change the speech).

Prompts with audio / image / video: transformers zeroes the embedding part of the prompt's rows at
the media placeholder positions (the last-layer part stays), and the talker's positions are its own
3-D rope index (`get_rope_index` of the talker module) over the thinker's prompt ids + the speaker's
text-bos + generated token 0, from the media grids the thinker stage sends with its first chunk
(`MediaInputs` without rows); each decode step then runs at `cache length + rope delta`. Text and
audio-only prompts get plain positions (delta 0), as there.
Batching and KV caches per request: `kv_batch`. Sizes and dtypes follow the loaded modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_runtime.engines.speech import kv_batch
from omni_runtime.engines.speech.qwen3_talker import MediaInputs, MediaPromptError, check_grids, rope_index
from omni_runtime.engines.speech.sampling import Sampling, sample
from omni_runtime.engines.speech.weights import load_part, read_tensors

__all__ = ["Qwen25Request", "Qwen25Talker"]


@dataclass(eq=False)
class Qwen25Request:
    """One request's state in the decode loop (touched only by the loop's thread)."""

    id: str
    prompt_ids: list[int]
    speaker: int
    """The speaker's text-bos token id (its embedding: `speaker_bos`)."""
    speaker_bos: Any
    sampling: Sampling
    history: list[int]
    generator: Any = None
    media: MediaInputs | None = None
    media_positions: set[int] = field(default_factory=set)
    """Prompt positions of media placeholders: their rows get no embedding part."""
    tokens: list[int] = field(default_factory=list)
    """The thinker's generated token ids as they came (the first one enters the rope index)."""
    rope_delta: int = 0
    """Decode step positions are `length + rope_delta` (nonzero only with image / video grids)."""
    rows: list[Any] = field(default_factory=list)
    """One input row per thinker token (prompt, then generated): normed last layer + embedding."""
    text_done: bool = False
    kv: list[tuple[Any, Any]] | None = None
    length: int = 0
    code: int | None = None
    pending: bool = False
    """`code` was sampled and not yet emitted as a frame."""
    step: int = 0
    frames: int = 0
    finish_reason: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


class Qwen25Talker:
    """The talker of a Qwen2.5-Omni checkpoint, the thinker rows it needs, and the batched step."""

    def __init__(self, folder: Path, device: str, dtype: Any) -> None:
        import torch
        from transformers import Qwen2_5OmniConfig
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
            Qwen2_5OmniRMSNorm,
            Qwen2_5OmniTalkerForConditionalGeneration,
        )

        self.config = Qwen2_5OmniConfig.from_pretrained(folder)
        self.device, self.dtype = device, dtype
        c = self.config.talker_config
        self.talker = Qwen2_5OmniTalkerForConditionalGeneration._from_config(c, dtype=dtype)
        load_part(self.talker, folder, "talker.")
        self.talker.to(device).eval()
        text = self.config.thinker_config.get_text_config(decoder=True)
        self.thinker_layers = int(text.num_hidden_layers)
        self.hidden_size = int(text.hidden_size)
        self.norm = Qwen2_5OmniRMSNorm(self.hidden_size, eps=text.rms_norm_eps)
        self.norm.weight.data.copy_(read_tensors(folder, "thinker.model.norm.")["weight"])
        self.norm.to(device=device, dtype=dtype).eval()
        speakers = torch.load(folder / "spk_dict.pt", weights_only=True)
        self.speakers: dict[str, int] = {name.lower(): int(v["bos_token"]) for name, v in speakers.items()}
        # Only the rows the talker needs of the thinker's (large) embedding table.
        table = read_tensors(folder, "thinker.model.embed_tokens.")["weight"]
        wanted = {*self.speakers.values(), c.tts_text_end_token_id, c.tts_text_pad_token_id}
        self.embeds = {i: table[i].to(device=device, dtype=dtype) for i in wanted}
        del table
        self.text_eos = self.embeds[c.tts_text_end_token_id]
        self.text_pad = self.embeds[c.tts_text_pad_token_id]
        self.codec_bos, self.codec_pad = c.tts_codec_start_token_id, c.tts_codec_pad_token_id
        self.stops = {c.tts_codec_pad_token_id, c.tts_codec_end_token_id}
        self.prompt_history = [c.tts_codec_mask_token_id, c.tts_codec_pad_token_id, c.tts_codec_start_token_id]
        self.suppress = torch.zeros(c.vocab_size, dtype=torch.bool, device=device)
        self.suppress[c.tts_codec_start_token_id] = True
        # ids past token2wav's codebook are special tokens, never audio: only the stop ones may be drawn
        # (transformers would hand them to token2wav and fail there; a random talker draws them when sampling)
        self.suppress[int(self.config.token2wav_config.dit_config.num_embeds) :] = True
        for stop in self.stops:
            self.suppress[stop] = False
        thinker = self.config.thinker_config
        self.media_ids = {thinker.audio_token_index, thinker.image_token_index, thinker.video_token_index}
        self.image_id, self.video_id = thinker.image_token_index, thinker.video_token_index

    # -- building inputs ---------------------------------------------------------------------------

    def new_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        speaker: str,
        sampling: Sampling,
        media: MediaInputs | None = None,
    ) -> Qwen25Request:
        """Check the prompt, speaker and media grids (KeyError / MediaPromptError say what is wrong)."""
        import torch

        bos = self.speakers.get(speaker.lower())
        if bos is None:
            raise KeyError(f"speaker {speaker!r} is not one of this talker's: {sorted(self.speakers)}")
        vision = sorted({self.image_id, self.video_id} & set(prompt_ids))
        if vision and media is None:
            raise MediaPromptError(
                f"the thinker prompt holds image / video token ids {vision} but the thinker sent no media grids "
                "(thinker_media_grids) for them; the talker's rope positions need them. The ar engine sends them "
                "with hidden_state_layers: run the thinker stage on this omnikube version"
            )
        if media is not None:
            merge, audio = self.talker.config.spatial_merge_size, self.config.thinker_config.audio_token_index
            check_grids(prompt_ids, media, self.image_id, self.video_id, merge, audio)
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        request = Qwen25Request(
            request_id, list(prompt_ids), bos, self.embeds[bos], sampling, list(self.prompt_history), generator
        )
        request.media = media
        request.media_positions = {i for i, t in enumerate(prompt_ids) if t in self.media_ids}
        return request

    def check_rows(self, embeds: Any, hidden: Any, layer: int) -> None:
        """ValueError unless (layer 0 rows, layer `layer` rows) are this thinker's last-layer rows."""
        if layer != self.thinker_layers:
            raise ValueError(
                f"the thinker sent hidden-state layer {layer}; this talker needs its last layer "
                f"({self.thinker_layers}): set the thinker's hidden_state_layers to [0, -1]"
            )
        if tuple(embeds.shape) != tuple(hidden.shape) or embeds.dim() != 2 or embeds.shape[1] != self.hidden_size:
            raise ValueError(
                f"thinker rows of shapes {tuple(embeds.shape)} and {tuple(hidden.shape)}; expected two "
                f"(rows, {self.hidden_size})"
            )

    def add_rows(self, r: Qwen25Request, embeds: Any, hidden: Any) -> None:
        """Append the input rows of the next thinker tokens: final norm(last layer) + embedding."""
        import torch

        if not len(embeds):
            return
        with torch.inference_mode():
            e = torch.as_tensor(embeds).to(device=self.device, dtype=self.dtype)
            h = torch.as_tensor(hidden).to(device=self.device, dtype=self.dtype)
            start = len(r.rows)
            media = [i - start for i in r.media_positions if start <= i < start + len(e)]
            if media:  # transformers zeroes the embeddings at media positions (the thinker's are the media's)
                e = e.clone()
                e[torch.tensor(media, device=self.device)] = 0
            r.rows.extend(self.norm(h) + e)

    def _reply(self, r: Qwen25Request) -> Any | None:
        """The text row of decode step `r.step`, or None when the thinker has not produced it yet."""
        index = r.prompt_len + 1 + r.step  # generated token step+1
        if index < len(r.rows):
            return r.rows[index]
        if not r.text_done:
            return None
        return self.text_eos if index == len(r.rows) else self.text_pad

    # -- the loop ---------------------------------------------------------------------------------

    def prefill(self, r: Qwen25Request) -> None:
        """Run `r`'s prompt; leaves its first code sampled (or finishes it when there is nothing to say)."""
        import torch

        if len(r.rows) <= r.prompt_len:  # the thinker ended before its first token had a row
            r.finish_reason = "stop"
            return
        with torch.inference_mode():
            rows = torch.stack([*r.rows[: r.prompt_len], r.speaker_bos, r.rows[r.prompt_len]])
            codec = self.talker.get_input_embeddings()(
                torch.tensor([self.codec_pad, self.codec_bos], device=self.device)
            )
            rows[-2:] += codec
            embeds = self.talker.thinker_to_talker_proj(rows).unsqueeze(0)
            # the talker's text ids (transformers' `input_text_ids`): prompt, speaker text-bos, token 0
            first = r.tokens[0] if r.tokens else self.config.talker_config.tts_text_pad_token_id
            ids = [*r.prompt_ids, r.speaker, first]
            positions, r.rope_delta = rope_index(self.talker, ids, r.media, self.device)
            r.kv, r.length, hidden = kv_batch.prefill(self.talker.model, embeds, positions)
            self._sample(r, self.talker.codec_head(hidden))

    def _sample(self, r: Qwen25Request, logits: Any) -> None:
        code = sample(logits, r.sampling, history=r.history, suppress=self.suppress, generator=r.generator)
        r.history.append(code)
        r.code, r.pending = code, True

    def decode(self, batch: list[tuple[Qwen25Request, Any]]) -> None:
        """One talker step for each (request, its text row): batched, KV left-padded and masked."""
        import torch

        requests = [r for r, _ in batch]
        with torch.inference_mode():
            codes = torch.tensor([r.code for r in requests], device=self.device)
            rows = self.talker.get_input_embeddings()(codes) + torch.stack([text for _, text in batch])
            embeds = self.talker.thinker_to_talker_proj(rows).unsqueeze(1)
            hidden = kv_batch.step(self.talker.model, requests, embeds, [r.length + r.rope_delta for r in requests])
            logits = self.talker.codec_head(hidden)
            for i, r in enumerate(requests):
                r.step += 1
                self._sample(r, logits[i])

    def advance(self, requests: list[Qwen25Request]) -> tuple[dict[str, list[list[int]]], bool]:
        """One scheduler iteration over `requests`: prefills, codes out, one batched decode step.

        Returns ({request id: new frames, each [code]}, whether anything moved). Finished requests
        get `finish_reason` ("stop" on codec pad/end, "length" at max_tokens codes)."""
        moved = False
        frames: dict[str, list[list[int]]] = {}
        for r in requests:
            if r.kv is None and r.finish_reason is None and (r.text_done or len(r.rows) > r.prompt_len):
                self.prefill(r)
                moved = True
        for r in requests:
            if r.pending and r.finish_reason is None:
                r.pending = False
                moved = True
                if r.code in self.stops:
                    r.finish_reason = "stop"
                    continue
                frames[r.id] = [[int(r.code)]]  # type: ignore[arg-type]
                r.frames += 1
                if r.frames >= r.sampling.max_tokens:
                    r.finish_reason = "length"
        ready = []
        for r in requests:
            if r.kv is not None and not r.pending and r.code is not None and r.finish_reason is None:
                text = self._reply(r)
                if text is not None:
                    ready.append((r, text))
        if ready:
            self.decode(ready)
            moved = True
        return frames, moved
