"""Qwen3-Omni talker: its own decode loop on the transformers modules, batched step by step.

Each decode step's input is the sum of the 16 codebook embeddings of the last frame plus one
text-conditioning vector, not a token id, so this is plain torch, not vLLM. It builds exactly what
`Qwen3OmniMoeForConditionalGeneration.generate` builds (transformers 5.19), from the thinker's token
ids (the talker keeps a copy of the thinker's embedding table; text prompts need no hidden states,
research note §2) and, for a prompt with media, the thinker's layer-`accept_hidden_layer` rows at the
prompt's media placeholder positions (`MediaInputs`):

- prefill: the user turns `text_projection(embed(ids))`, at media positions `hidden_projection(row)`
  instead, then the assistant prefix
  `text_projection(embed(<|im_start|>assistant\\n))`, 4 x tts_pad, tts_bos, the first spoken token,
  plus the codec embeddings of [nothink, think_bos, think_eos, speaker, codec_pad, codec_bos];
- decode step k: frame k's summed codebook embeddings + the projection of spoken token k+1 (then
  tts_eos once, then tts_pad);
- per frame: code 0 from `codec_head`, codes 1-15 from the code predictor (15 sub-steps);
- stop on codec eos (2150), which gets no frame;
- positions: plain ones for text (and audio-only) prompts; with images or videos the talker's own
  3-D rope index over its input ids (user-turn ids, then tts_pad for the assistant part) and the
  media grids, as transformers' `_prepare_position_ids_for_generation`, each decode step then at
  `cache length + rope delta`.

Spoken tokens are the thinker's generated tokens except its last one (its end-of-turn token, or the
token where a length limit cut it), as in transformers and vLLM-Omni, where the hidden-state row of
a token exists only once the next one is sampled. So the newest pushed token is held back until
another arrives or the text is finished, and a step that needs a token not yet known WAITS.

Batching: prefills run one request at a time as requests arrive; decode steps run every request
that has its next input, together, with KV caches per request left-padded to one length and masked.
A request joins at the next step and leaves when it finishes. Sizes and dtypes follow the loaded
modules; nothing here is CUDA-specific.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_runtime.engines.speech import kv_batch
from omni_runtime.engines.speech.sampling import Sampling, sample
from omni_runtime.engines.speech.weights import load_part, read_tensors

__all__ = ["MediaInputs", "MediaPromptError", "Qwen3Talker", "TalkerRequest", "check_grids", "rope_index"]

CODE_PREDICTOR_TOP_K = 50
CODE_PREDICTOR_TOP_P = 0.8
"""transformers samples codes 1-15 with these when the talker samples (greedy when it is greedy)."""


class MediaPromptError(ValueError):
    """The prompt has audio / image / video positions but their thinker rows or grids are missing or
    do not fit it (the thinker stage must export them: engine arg `media_hidden_layer`)."""


@dataclass
class MediaInputs:
    """What the thinker exports for a prompt with media: its rows of layer `accept_hidden_layer` at
    the prompt's media placeholder positions, in prompt order, and the media shapes the talker's
    rope index reads (transformers passes the same to `talker.generate`)."""

    rows: Any = None
    """float tensor (media positions, thinker hidden size); None for Qwen2.5-Omni, whose talker gets
    every row of the prompt apart (only the grids come here)."""
    image_grid_thw: list[list[int]] = field(default_factory=list)
    video_grid_thw: list[list[int]] = field(default_factory=list)
    video_second_per_grid: list[float] = field(default_factory=list)
    audio_feature_lengths: list[int] = field(default_factory=list)
    use_audio_in_video: bool = False


def check_grids(
    prompt_ids: list[int], media: MediaInputs, image_token: int, video_token: int, merge: int, audio_token: int
) -> None:
    """The image / video grids must give the prompt's image / video positions, and beside them (the rope
    index then reads them) one audio length per audio (MediaPromptError says how not)."""
    if (media.image_grid_thw or media.video_grid_thw) and not media.use_audio_in_video:
        audios = sum(1 for i, t in enumerate(prompt_ids) if t == audio_token and (i == 0 or prompt_ids[i - 1] != t))
        if audios != len(media.audio_feature_lengths):
            raise MediaPromptError(
                f"the thinker sent {len(media.audio_feature_lengths)} audio_feature_lengths for a prompt with "
                f"{audios} audios beside its images / videos; one per audio is needed"
            )
    for kind, token, grids in (
        ("image", image_token, media.image_grid_thw),
        ("video", video_token, media.video_grid_thw),
    ):
        count = sum(1 for t in prompt_ids if t == token)
        if any(len(g) != 3 for g in grids) or sum(int(t * h * w) // merge**2 for t, h, w in grids) != count:
            raise MediaPromptError(
                f"the thinker sent {kind} grids {grids} for a prompt with {count} {kind} positions; each "
                f"grid is [t, h, w] and together they give t*h*w/{merge**2} positions"
            )
    if media.video_grid_thw and len(media.video_second_per_grid) != len(media.video_grid_thw):
        raise MediaPromptError(
            f"the thinker sent {len(media.video_grid_thw)} video grids but {len(media.video_second_per_grid)} "
            "video_second_per_grid values; one per video is needed"
        )


def rope_index(talker: Any, ids: list[int], media: MediaInputs | None, device: Any) -> tuple[Any, int]:
    """Prefill positions (3, 1, len(ids)) and the rope delta of the talker's input ids `ids`, by the
    talker's own transformers `get_rope_index` (Qwen3-Omni's and Qwen2.5-Omni's take the same
    arguments); plain positions and delta 0 without image / video grids (text and audio-only prompts)."""
    import torch

    length = len(ids)
    if media is None or not (media.image_grid_thw or media.video_grid_thw):
        return torch.arange(length, device=device).view(1, 1, -1).expand(3, 1, -1), 0

    def grid(values: list[list[int]]) -> Any:
        return torch.tensor(values, dtype=torch.long) if values else None

    positions, deltas = talker.get_rope_index(
        torch.tensor([ids], dtype=torch.long),
        image_grid_thw=grid(media.image_grid_thw),
        video_grid_thw=grid(media.video_grid_thw),
        attention_mask=torch.ones(1, length, dtype=torch.long),
        use_audio_in_video=media.use_audio_in_video,
        audio_seqlens=torch.tensor(media.audio_feature_lengths, dtype=torch.long)
        if media.audio_feature_lengths
        else None,
        second_per_grids=torch.tensor(media.video_second_per_grid, dtype=torch.float)
        if media.video_second_per_grid
        else None,
    )
    return positions.to(device), int(deltas.reshape(-1)[0].item())


@dataclass(eq=False)
class TalkerRequest:
    """One request's state in the decode loop (touched only by the loop's thread)."""

    id: str
    prompt_ids: list[int]
    speaker_id: int
    sampling: Sampling
    text: list[int] = field(default_factory=list)
    text_done: bool = False
    kv: list[tuple[Any, Any]] | None = None
    length: int = 0
    last_hidden: Any = None
    code0: int | None = None
    frame_embeds: Any = None
    history: list[int] = field(default_factory=list)
    frames: int = 0
    step: int = 0
    finish_reason: str | None = None
    generator: Any = None
    assistant: list[int] = field(default_factory=list)
    """The prompt from the last `<|im_start|>assistant` on (then the spoken tokens follow)."""
    media: MediaInputs | None = None
    rope_delta: int = 0
    """Decode step positions are `length + rope_delta` (nonzero only with image / video grids)."""


class Qwen3Talker:
    """The talker modules of a Qwen3-Omni checkpoint and the step that advances a batch of requests."""

    def __init__(self, folder: Path, device: str, dtype: Any) -> None:
        from transformers import Qwen3OmniMoeConfig
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeTalkerForConditionalGeneration,
        )

        config = Qwen3OmniMoeConfig.from_pretrained(folder)
        talker = Qwen3OmniMoeTalkerForConditionalGeneration._from_config(config.talker_config, dtype=dtype)
        load_part(talker, folder, "talker.")
        table = read_tensors(folder, "thinker.model.embed_tokens.")["weight"]
        self._setup(config, talker, table, device, dtype)

    @classmethod
    def from_modules(cls, config: Any, talker: Any, thinker_embed: Any, device: str, dtype: Any) -> Qwen3Talker:
        """A talker around modules already built (the GPU bench's random-weight Qwen3-Omni-sized one):
        `config` a `Qwen3OmniMoeConfig`, `thinker_embed` the thinker's embedding table [vocab, hidden]."""
        self = cls.__new__(cls)
        self._setup(config, talker, thinker_embed, device, dtype)
        return self

    def _setup(self, config: Any, talker: Any, table: Any, device: str, dtype: Any) -> None:
        import torch

        self.config = config
        self.device, self.dtype = device, dtype
        talker_config = self.config.talker_config
        self.talker = talker
        self.talker.to(device).eval()
        self.thinker_embed = table.to(device=device, dtype=dtype)
        self.speakers: dict[str, int] = dict(talker_config.speaker_id or {})
        self.eos = talker_config.codec_eos_token_id
        self.groups = talker_config.num_code_groups
        vocab = talker_config.text_config.vocab_size
        self.suppress = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.suppress[vocab - 1024 :] = True  # special codec ids are never sampled, except eos
        self.suppress[self.eos] = False
        c = self.config
        with torch.inference_mode():
            bos, eos, pad = self._project([c.tts_bos_token_id, c.tts_eos_token_id, c.tts_pad_token_id])
        self.tts_bos, self.tts_eos, self.tts_pad = bos, eos, pad
        thinker = c.thinker_config
        self.media_ids = {thinker.audio_token_id, thinker.image_token_id, thinker.video_token_id}

    # -- building inputs ---------------------------------------------------------------------------

    def _project(self, ids: list[int]) -> Any:
        import torch

        rows = self.thinker_embed[torch.tensor(ids, device=self.device)]
        return self.talker.text_projection(rows)

    def new_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        speaker: str,
        sampling: Sampling,
        media: MediaInputs | None = None,
    ) -> TalkerRequest:
        """Check the prompt, speaker and media (ValueError / MediaPromptError / KeyError say what is wrong)."""
        import torch

        speaker_id = self.speakers.get(speaker.lower())
        if speaker_id is None:
            raise KeyError(f"speaker {speaker!r} is not one of this talker's: {sorted(self.speakers)}")
        c = self.config
        starts = [i for i in range(len(prompt_ids) - 1) if prompt_ids[i] == c.im_start_token_id]
        assistant = [i for i in starts if prompt_ids[i + 1] == c.assistant_token_id]
        if not assistant:
            raise ValueError(
                f"the thinker prompt ({len(prompt_ids)} ids) has no '<|im_start|>assistant' turn; the talker "
                "speaks the assistant's reply, so the prompt must end with the chat template's generation prompt"
            )
        self._check_media(prompt_ids, media)
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        request = TalkerRequest(request_id, list(prompt_ids), speaker_id, sampling, generator=generator)
        request.assistant = list(prompt_ids[assistant[-1] :])
        request.media = media
        return request

    def _check_media(self, prompt_ids: list[int], media: MediaInputs | None) -> None:
        """The media rows and grids must fit the prompt's placeholders (MediaPromptError says how not)."""
        positions = sum(1 for t in prompt_ids if t in self.media_ids)
        if media is None or media.rows is None:
            if positions:
                found = sorted(self.media_ids & set(prompt_ids))
                raise MediaPromptError(
                    f"the thinker prompt holds {positions} media positions (token ids {found}) but the thinker "
                    "sent no hidden-state rows for them; set engine_args.media_hidden_layer: talker on the "
                    "thinker stage so it exports them"
                )
            return
        hidden = self.thinker_embed.shape[1]
        if media.rows.dim() != 2 or media.rows.shape[0] != positions or media.rows.shape[1] != hidden:
            raise MediaPromptError(
                f"the thinker sent media rows of shape {tuple(media.rows.shape)} for a prompt with {positions} "
                f"media positions; expected ({positions}, {hidden})"
            )
        c = self.config.thinker_config
        merge = self.talker.config.spatial_merge_size
        check_grids(prompt_ids, media, c.image_token_id, c.video_token_id, merge, c.audio_token_id)

    def _spoken(self, r: TalkerRequest) -> list[int]:
        """The assistant prefix and the tokens known to be spoken (the newest pushed one held back)."""
        return r.assistant + r.text[:-1]

    def prefill_ready(self, r: TalkerRequest) -> bool:
        return r.text_done or len(self._spoken(r)) >= 4

    def _trailing(self, r: TalkerRequest) -> Any | None:
        """The text vector of decode step `r.step`, or None when the thinker has not produced it yet."""
        known = self._spoken(r)
        index = 4 + r.step
        if index < len(known):
            return self._project([known[index]])[0]
        if not r.text_done:
            return None
        return self.tts_eos if index == len(known) else self.tts_pad

    def _user_rows(self, r: TalkerRequest) -> tuple[Any, list[int]]:
        """Projected rows of the user turns (every position whose turn's role token is `user`) and
        their ids: `text_projection(embed(id))`, or `hidden_projection(media row)` at media positions."""
        import torch

        c = self.config
        prompt_ids = r.prompt_ids
        keep: list[int] = []
        media_rows: list[int] = []  # index into r.media.rows of each user media position
        media_index = 0
        role = None
        for i, token in enumerate(prompt_ids):
            if token == c.im_start_token_id:
                role = prompt_ids[i + 1] if i + 1 < len(prompt_ids) else None
            elif role is None and i == 0:
                role = prompt_ids[1] if len(prompt_ids) > 1 else None
            is_media = token in self.media_ids
            if role == c.user_token_id:
                keep.append(token)
                if is_media:
                    media_rows.append(media_index)
            media_index += is_media
        out = self.thinker_embed.new_zeros(len(keep), self.talker.config.text_config.hidden_size)
        is_media = torch.tensor([t in self.media_ids for t in keep], dtype=torch.bool, device=self.device)
        text = [t for t in keep if t not in self.media_ids]
        if text:  # one projection per kind, as transformers does
            out[~is_media] = self._project(text)
        if media_rows:
            assert r.media is not None  # new_request checked it
            rows = r.media.rows[torch.tensor(media_rows)].to(device=self.device, dtype=self.dtype)
            out[is_media] = self.talker.hidden_projection(rows)
        return out, keep

    def _positions(self, r: TalkerRequest, ids: list[int]) -> Any:
        """Prefill positions (3, 1, len(ids)) and `r.rope_delta`, as transformers computes them."""
        positions, r.rope_delta = rope_index(self.talker, ids, r.media, self.device)
        return positions

    # -- the loop ---------------------------------------------------------------------------------

    def prefill(self, r: TalkerRequest) -> None:
        """Run `r`'s prompt; leaves its first code 0 sampled (or finishes it when there is nothing to say)."""
        import torch

        spoken = self._spoken(r)
        if len(spoken) < 4:  # the thinker ended without a token to speak
            r.finish_reason = "stop"
            return
        with torch.inference_mode():
            embeds, positions = self.prefill_inputs(r)
            r.kv, r.length, r.last_hidden = kv_batch.prefill(self.talker.model, embeds, positions)
            self._sample_code0(r, self.talker.codec_head(r.last_hidden))

    def prefill_inputs(self, r: TalkerRequest) -> tuple[Any, Any]:
        """The prefill's input rows [1, T, H] and positions [3, 1, T] (also what the GPU bench hands
        transformers' own talker `generate()`)."""
        import torch

        spoken = self._spoken(r)
        c = self.config.talker_config
        with torch.inference_mode():
            assistant = self._project(spoken[:4])
            hidden = self.talker.config.text_config.hidden_size
            text_rows = torch.cat([assistant[:3], self.tts_pad.expand(4, -1), self.tts_bos[None], assistant[3:4]])
            codec_ids = [c.codec_nothink_id, c.codec_think_bos_id, c.codec_think_eos_id, r.speaker_id]
            codec_ids += [c.codec_pad_id, c.codec_bos_id]
            codec = self.talker.get_input_embeddings()(torch.tensor(codec_ids, device=self.device))
            codec_rows = torch.cat([codec.new_zeros(3, hidden), codec])
            user_rows, user_ids = self._user_rows(r)
            embeds = torch.cat([user_rows, text_rows + codec_rows]).unsqueeze(0)
            # the talker's input ids: user-turn ids, then tts_pad for the assistant part (transformers')
            positions = self._positions(r, user_ids + [self.config.tts_pad_token_id] * text_rows.shape[0])
        return embeds, positions

    def _sample_code0(self, r: TalkerRequest, logits: Any) -> None:
        code = sample(logits, r.sampling, history=r.history, suppress=self.suppress, generator=r.generator)
        r.history.append(code)
        r.code0 = code

    def make_frames(self, batch: list[TalkerRequest]) -> list[list[int]]:
        """Codes 1-15 for each request's pending code 0 (one batched code-predictor pass): the frames."""
        import torch
        from transformers import DynamicCache

        predictor = self.talker.code_predictor
        embed_sets: list[list[Any]] = [[] for _ in batch]
        with torch.inference_mode():
            code0 = torch.tensor([r.code0 for r in batch], device=self.device)
            first = self.talker.get_input_embeddings()(code0)
            last = torch.stack([r.last_hidden for r in batch])
            step_input = torch.stack([last, first], dim=1)
            cache = DynamicCache()
            codes = [[int(c)] for c in code0]
            for i in range(len(batch)):
                embed_sets[i].append(first[i])
            for group in range(self.groups - 1):
                out = predictor.model(inputs_embeds=step_input, past_key_values=cache, use_cache=True)
                logits = predictor.lm_head[group](out.last_hidden_state[:, -1])
                chosen = []
                for i, r in enumerate(batch):
                    code = (
                        sample(
                            logits[i],
                            r.sampling,
                            generator=r.generator,
                            top_k=CODE_PREDICTOR_TOP_K,
                            top_p=CODE_PREDICTOR_TOP_P,
                            temperature=1.0,
                        )
                        if not r.sampling.greedy
                        else int(torch.argmax(logits[i]))
                    )
                    chosen.append(code)
                    codes[i].append(code)
                embeds = predictor.model.codec_embedding[group](torch.tensor(chosen, device=self.device))
                for i in range(len(batch)):
                    embed_sets[i].append(embeds[i])
                step_input = embeds.unsqueeze(1)
            for i, r in enumerate(batch):
                r.frame_embeds = torch.stack(embed_sets[i]).sum(0)
                r.code0 = None
                r.frames += 1
        return codes

    def decode(self, batch: list[tuple[TalkerRequest, Any]]) -> None:
        """One talker step for each (request, its text vector): batched, KV left-padded and masked."""
        import torch

        requests = [r for r, _ in batch]
        with torch.inference_mode():
            embeds = torch.stack([r.frame_embeds + text for r, text in batch]).unsqueeze(1)
            steps = [r.length + r.rope_delta for r in requests]
            hidden = kv_batch.step(self.talker.model, requests, embeds, steps)
            logits = self.talker.codec_head(hidden)
            for i, r in enumerate(requests):
                r.last_hidden = hidden[i]
                r.frame_embeds = None
                r.step += 1
                self._sample_code0(r, logits[i])

    def advance(self, requests: list[TalkerRequest]) -> tuple[dict[str, list[list[int]]], bool]:
        """One scheduler iteration over `requests`: prefills, frames, one batched decode step.

        Returns ({request id: new frames}, whether anything moved). Finished requests get
        `finish_reason` ("stop" on codec eos, "length" at max_tokens frames) and take no more steps.
        """
        moved = False
        frames: dict[str, list[list[int]]] = {}
        for r in requests:
            if r.kv is None and r.finish_reason is None and self.prefill_ready(r):
                self.prefill(r)
                moved = True
        pending = [r for r in requests if r.code0 is not None and r.finish_reason is None]
        for r in pending:
            if r.code0 == self.eos:
                r.finish_reason, r.code0 = "stop", None
                moved = True
        pending = [r for r in pending if r.finish_reason is None]
        if pending:
            for r, codes in zip(pending, self.make_frames(pending), strict=True):
                frames[r.id] = [codes]
                if r.frames >= r.sampling.max_tokens:
                    r.finish_reason = "length"
            moved = True
        ready = []
        for r in requests:
            if r.frame_embeds is not None and r.finish_reason is None:
                text = self._trailing(r)
                if text is not None:
                    ready.append((r, text))
        if ready:
            self.decode(ready)
            moved = True
        return frames, moved
