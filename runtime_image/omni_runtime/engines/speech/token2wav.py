"""The token2wav stage engine (Qwen2.5-Omni): the talker's codec ids -> 24 kHz waveform, whole or windowed.

Qwen2.5-Omni's decoder is a DiT flow-matching model (mel from codes, a speaker's conditioning vector
and reference mel) followed by BigVGAN. The DiT attends within blocks of `block_size` mel frames
(`repeats` = 2 per code), some layers one block back or ahead; BigVGAN is a convolution stack.

- Whole output (the talker -> token2wav edge has `window: 0`): one decode per request once its last
  chunk has arrived, exactly transformers' `Qwen2_5OmniToken2WavModel` (the DiT's start noise from
  torch's global generator seeded with the request's `seed`, 0 unless given, under the engine's
  lock): the same codes, speaker and seed give transformers' waveform.
- Windowed (the edge has `window` > 0, e.g. first 4 codes then every 25): each chunk is decoded as
  it arrives, with at least `left_context` (25) earlier codes, the context's start rounded down to
  a DiT block boundary so the blocks fall as in a one-shot decode. The start noise is drawn per
  block from a generator seeded by (seed, block index), so a code gets the same noise whichever
  window decodes it. The window keeps the samples of its new codes only: n codes decode to
  n * samples_per_code - tail samples (tail measured per call, 0 for BigVGAN), so windows join
  with no sample lost or doubled. Codes whose DiT block reach (and BigVGAN's) lies inside the
  window equal a one-shot decode with the same noise; the last block or two of a window lack the
  codes after it (the DiT looks one block ahead), so they differ there: streaming's price.
  Windows of concurrent requests waiting at the same moment are decoded together: those of one length
  (and reference-mel length) in one DiT + BigVGAN call. They are not padded to one length as Qwen3's
  causal code2wav does: the DiT attends a block ahead and BigVGAN's convolutions see both sides, so a
  padded window's last codes would differ from its decode alone. Requests that run in step (the same
  window schedule) have windows of one length until their last; `stats()` counts calls and windows.

Speakers come from the checkpoint's `spk_dict.pt` (param `voice`, default Chelsie).
Input chunks: `Code2WavInput`, int codes (frames, 1) or (frames,) (the talker's codec ids of its one
codebook, end token excluded; time first as on every edge). Output: `AudioOutput`, float32 (samples,) at
`QWEN_CODEC_SAMPLE_RATE`, per window (one for a whole output). Engine args: `device`, `num_steps` (10,
the ODE steps of the DiT), `left_context` (25 codes).

Before the stage reports ready, `start()` decodes `SELF_CHECK_FRAMES` codes through `generate` (a
self-check, whole or windowed as the edge says); when that fails it stops and raises with what to change.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from omni_runtime.engines.base import (
    SELF_CHECK_ID,
    Engine,
    EngineError,
    EngineInput,
    EngineOutput,
    InvalidRequest,
    refuse_unknown_params,
    self_check,
)
from omni_runtime.engines.common import default_device, one_build_at_a_time, stage_model_path, typed_engine_args
from omni_runtime.processors.payloads import QWEN_CODEC_SAMPLE_RATE, AudioOutput, Code2WavInput, as_payload
from omni_runtime.spec import ResolvedPipeline, StageSpec
from omni_runtime.spec.engine_args import Token2WavArgs

__all__ = ["Qwen25Token2Wav", "Token2WavEngine", "WindowJob"]

log = logging.getLogger(__name__)

SELF_CHECK_FRAMES = 4
"""Codec frames (all code 0) the self-check decodes before the stage reports ready: one short window."""
DEFAULT_VOICE = "Chelsie"
GUIDANCE_SCALE = 0.5
SWAY_COEFFICIENT = -1.0
"""transformers' defaults for `Qwen2_5OmniToken2WavModel.forward`."""


@dataclass(frozen=True)
class WindowJob:
    """One request's window to decode: codes[start:] of all its `codes` so far."""

    codes: Any
    start: int
    voice: str
    seed: int


class Qwen25Token2Wav:
    """The token2wav module and speakers of a Qwen2.5-Omni checkpoint (always float32, as transformers)."""

    def __init__(self, folder: Path, device: str) -> None:
        import torch
        from transformers import Qwen2_5OmniConfig
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

        from omni_runtime.engines.speech.weights import load_part

        config = Qwen2_5OmniConfig.from_pretrained(folder).token2wav_config
        self.module = Qwen2_5OmniToken2WavModel._from_config(config, dtype=torch.float32)
        load_part(self.module, folder, "token2wav.")
        self.module.to(device).eval()
        self.device = device
        self.num_embeds = config.dit_config.num_embeds
        dit = config.dit_config
        self.repeats = int(dit.repeats)
        self.block = int(dit.block_size)
        self.mel_dim = int(dit.mel_dim)
        self.block_codes = max(1, self.block // self.repeats)
        """Codes per DiT block: a window's context starts on a multiple of this."""
        self.calls = 0
        """Window-decoding model calls so far (one call decodes every window of a group)."""
        self.speakers: dict[str, dict[str, Any]] = torch.load(folder / "spk_dict.pt", weights_only=True)

    def decode(self, codes: Any, voice: str, seed: int, num_steps: int) -> Any:
        import torch

        speaker = self.speakers[voice]
        torch.manual_seed(seed)
        with torch.inference_mode():
            wav = self.module(
                codes.view(1, -1).to(self.device),
                conditioning=speaker["cond"].to(self.device).float(),
                reference_mel=speaker["ref_mel"].to(self.device).float(),
                num_steps=num_steps,
            )
        return wav.reshape(-1).float().cpu()

    def _noise(self, seed: int, start: int, end: int) -> Any:
        """Start noise for mel frames [start, end): per DiT block, from a generator seeded by (seed, block)."""
        import torch

        first, last = start // self.block, (end - 1) // self.block
        blocks = [
            torch.randn(self.block, self.mel_dim, generator=torch.Generator().manual_seed(seed * 1_000_003 + b))
            for b in range(first, last + 1)
        ]
        return torch.cat(blocks)[start - first * self.block : end - first * self.block].unsqueeze(0)

    def _sample(self, codes: Any, noise: Any, speaker: dict[str, Any], num_steps: int) -> Any:
        """The DiT's mel for `codes` [1, n] from the given start noise (transformers' `sample`, whose
        noise comes from the global generator, with the noise passed in)."""
        import math

        import torch
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

        dit = self.module.code2wav_dit_model
        cond = speaker["cond"].to(self.device).float()
        ref_mel = speaker["ref_mel"].to(self.device).float()
        conditioning = cond.unsqueeze(1).repeat(1, noise.shape[1], 1)

        def ode(time_step: Any, hidden: Any) -> Any:
            out = dit(
                hidden_states=hidden,
                quantized_code=codes,
                speaker_embedding=conditioning,
                condition_vector=ref_mel,
                time_step=time_step,
                apply_cfg=True,
            )
            guided, null = torch.chunk(out, 2, dim=0)
            return guided + (guided - null) * GUIDANCE_SCALE

        times = torch.linspace(0, 1, num_steps, device=self.device, dtype=conditioning.dtype)
        times += SWAY_COEFFICIENT * (torch.cos(math.pi / 2 * times) - 1 + times)
        trajectory = RungeKutta4ODESolver(function=ode, initial_value=noise.to(self.device)).integrate(times)
        return trajectory[-1].permute(0, 2, 1)

    def decode_window(self, codes: Any, start: int, voice: str, seed: int, num_steps: int, left_context: int) -> Any:
        """Samples of codes[start:] (codes: all of a request's codes so far), decoded with at least
        `left_context` earlier codes from a DiT block boundary on; see the module docstring."""
        return self.decode_windows([WindowJob(codes, start, voice, seed)], num_steps, left_context)[0]

    def decode_windows(self, jobs: list[WindowJob], num_steps: int, left_context: int) -> list[Any]:
        """`decode_window` of every job, the jobs whose windows have the same length (and speakers the same
        reference-mel length) in one DiT + BigVGAN call each. Not padded to one length: the DiT attends a
        block ahead and BigVGAN's convolutions see both sides, so padding would change a window's last codes."""
        import torch

        per_code = self.repeats * self.samples_per_mel_frame
        prepared = []
        for job in jobs:
            start = job.start
            context_start = max(0, (start - left_context) // self.block_codes * self.block_codes) if start else 0
            window = job.codes[context_start:].view(1, -1)
            noise = self._noise(job.seed, context_start * self.repeats, job.codes.shape[0] * self.repeats)
            prepared.append((window, noise, self.speakers[job.voice], start - context_start))
        groups: dict[tuple[int, tuple[int, ...]], list[int]] = {}
        for i, (window, _, speaker, _) in enumerate(prepared):
            groups.setdefault((window.shape[1], tuple(speaker["ref_mel"].shape)), []).append(i)
        out: list[Any] = [None] * len(jobs)
        for members in groups.values():
            windows = torch.cat([prepared[i][0] for i in members]).to(self.device)
            noise = torch.cat([prepared[i][1] for i in members])
            speakers = {
                "cond": torch.cat([prepared[i][2]["cond"].reshape(1, -1) for i in members]),
                "ref_mel": torch.cat([prepared[i][2]["ref_mel"].reshape(1, *prepared[i][2]["ref_mel"].shape[-2:])
                                      for i in members]),
            }  # fmt: skip
            with torch.inference_mode():
                mel = self._sample(windows, noise, speakers, num_steps)
                wav = self.module.code2wav_bigvgan_model(mel).float().cpu().reshape(len(members), -1)
            self.calls += 1
            tail = windows.shape[1] * per_code - wav.shape[1]
            for row, i in enumerate(members):
                context = prepared[i][3]
                out[i] = wav[row, context * per_code - tail if context else 0 : windows.shape[1] * per_code - tail]
        return out

    @property
    def samples_per_mel_frame(self) -> int:
        import math

        return math.prod(self.module.config.bigvgan_config.upsample_rates)


class Token2WavEngine(Engine):
    """`generation` stage with engine arg `runner: qwen2_5_omni_token2wav` (see the module docstring)."""

    streams_input = True

    def __init__(self, pipeline: ResolvedPipeline, stage: StageSpec) -> None:
        super().__init__(pipeline, stage)
        self.model_path = stage_model_path(pipeline, stage)
        self.args = typed_engine_args(stage, Token2WavArgs)
        """The stage's engine args (InvalidEngineArgs at construction when they are wrong)."""
        self.device = default_device(self.args.device)
        self.num_steps = self.args.num_steps
        self.left_context = self.args.left_context
        self.window = max((edge.window for edge in pipeline.topology.upstream(stage.name)), default=0)
        """The upstream edge's window: 0 decodes whole outputs, more decodes each chunk as it arrives."""
        self.model: Qwen25Token2Wav | None = None
        self._lock = threading.Lock()
        self._aborted: set[str] = set()
        self._running: set[str] = set()
        self._queue: asyncio.Queue[tuple[WindowJob, asyncio.Future]] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._stats = {"windows_total": 0.0, "last_batch_size": 0.0}

    async def start(self) -> None:
        try:
            self.model = await asyncio.to_thread(one_build_at_a_time(Qwen25Token2Wav), self.model_path, self.device)
        except Exception as exc:
            raise EngineError(f"stage {self.stage.name!r}: cannot load token2wav of {self.model_path}: {exc}") from exc
        self._task = asyncio.create_task(self._batcher(), name=f"token2wav-{self.stage.name}")
        import torch

        try:
            await self_check(
                self,
                EngineInput(
                    SELF_CHECK_ID, as_payload(Code2WavInput(codes=torch.zeros(SELF_CHECK_FRAMES, dtype=torch.long)))
                ),
                f"decoding {SELF_CHECK_FRAMES} codec frames on {self.device}",
                "check the stage's engine_args device and num_steps, and that the model folder holds the "
                "token2wav of a complete checkpoint",
            )
        except EngineError:
            await self.stop()
            raise
        # the counters count served work from zero (the check is no client's)
        self._stats = dict.fromkeys(self._stats, 0.0)
        self.model.calls = 0

    async def _batcher(self) -> None:
        """Decode the windows waiting at the same moment (of concurrent requests) together."""
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            assert self.model is not None
            try:
                wavs = await asyncio.to_thread(self._decode_windows, [job for job, _ in batch])
            except Exception as exc:  # a decode fault fails the windows of that call, not the stage
                log.exception("token2wav window decode failed")
                for _, done in batch:
                    if not done.done():
                        done.set_exception(EngineError(f"stage {self.stage.name!r}: token2wav failed: {exc}"))
                continue
            self._stats["windows_total"] += len(batch)
            self._stats["last_batch_size"] = float(len(batch))
            for (_, done), wav in zip(batch, wavs, strict=True):
                if not done.done():
                    done.set_result(wav)

    def voices(self) -> list[str]:
        return sorted(name.lower() for name in self.model.speakers) if self.model is not None else []

    def _voice(self, requested: str | None) -> str:
        assert self.model is not None
        by_lower = {name.lower(): name for name in self.model.speakers}
        name = by_lower.get((requested or DEFAULT_VOICE).lower())
        if name is None:
            raise InvalidRequest(f"stage {self.stage.name!r}: voice {requested!r} is not one of {sorted(by_lower)}")
        return name

    def _codes(self, chunk: Code2WavInput) -> Any:
        """The chunk's codec ids, (frames, 1) or (frames,), as the flat LongTensor the model reads."""
        import torch

        assert self.model is not None
        if chunk.get("codes") is None:
            return None
        codes = torch.as_tensor(chunk["codes"])
        if codes.dtype.is_floating_point or codes.dim() > 2 or (codes.dim() == 2 and codes.shape[1] != 1):
            raise InvalidRequest(
                f"stage {self.stage.name!r} takes one codebook of integer codec ids, (frames,) or (frames, 1); "
                f"got shape {tuple(codes.shape)} of {codes.dtype}"
            )
        codes = codes.reshape(-1).to(torch.long)
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.model.num_embeds):
            raise InvalidRequest(
                f"stage {self.stage.name!r}: codec ids must lie in [0, {self.model.num_embeds}); "
                f"got {int(codes.min())}..{int(codes.max())}"
            )
        return codes

    def _decode(self, codes: Any, voice: str, seed: int) -> Any:
        assert self.model is not None
        with self._lock:
            return self.model.decode(codes, voice, seed, self.num_steps)

    def _decode_windows(self, jobs: list[WindowJob]) -> list[Any]:
        assert self.model is not None
        with self._lock:
            return self.model.decode_windows(jobs, self.num_steps, self.left_context)

    async def _decode_window(self, job: WindowJob) -> Any:
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((job, done))
        return await done

    async def generate(self, request: EngineInput) -> AsyncIterator[EngineOutput]:
        import torch

        if self.model is None:
            raise EngineError(f"stage {self.stage.name!r} is not started")
        rid = request.request_id
        refuse_unknown_params(self.stage.name, request.params, {"voice", "seed"})
        voice = self._voice(request.params.get("voice"))
        seed = int(request.params.get("seed") or 0)

        async def chunks():
            yield request.data
            if request.chunks is not None:
                async for chunk in request.chunks:
                    yield chunk

        parts: list[Any] = []
        emitted = samples = 0
        self._running.add(rid)
        try:
            async for chunk in chunks():
                codes = self._codes(cast(Code2WavInput, chunk))  # talker_to_code2wav checked its layout
                if codes is None or not codes.numel():
                    continue
                parts.append(codes)
                if not self.window:
                    continue
                if rid in self._aborted:
                    break
                history = torch.cat(parts)
                wav = await self._decode_window(WindowJob(history, emitted, voice, seed))
                emitted, samples = history.shape[0], samples + wav.shape[0]
                yield EngineOutput(rid, as_payload(AudioOutput(audio=wav.numpy(), sample_rate=QWEN_CODEC_SAMPLE_RATE)))
            if rid in self._aborted:
                yield EngineOutput(rid, {}, finished=True, finish_reason="abort")
                return
            codes = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
            if codes.numel() and not self.window:
                wav = await asyncio.to_thread(self._decode, codes, voice, seed)
                samples = wav.shape[0]
                yield EngineOutput(rid, as_payload(AudioOutput(audio=wav.numpy(), sample_rate=QWEN_CODEC_SAMPLE_RATE)))
            usage = {"codec_tokens": int(codes.numel()), "audio_samples": samples}
            yield EngineOutput(rid, {}, finished=True, finish_reason="stop", usage=usage)
        finally:
            self._running.discard(rid)
            self._aborted.discard(rid)

    async def abort(self, request_id: str) -> None:
        """Stop before the request's next decode (a decode in progress completes)."""
        if request_id in self._running:
            self._aborted.add(request_id)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self.model = None

    def stats(self) -> dict[str, float]:
        calls = float(self.model.calls) if self.model is not None else 0.0
        return {"running_requests": float(len(self._running)), "calls_total": calls, **self._stats}
