"""The token2wav stage engine (Qwen2.5-Omni): the talker's codec tokens -> 24 kHz waveform, whole output.

Qwen2.5-Omni's decoder is a DiT flow-matching model (mel from codes, a speaker's conditioning vector
and reference mel) followed by BigVGAN. transformers offers no streaming entry point for it (vLLM-Omni
adds block streaming with past/future caches), so this engine decodes a request's whole code
sequence once its last chunk has arrived: one audio output per request. Streaming is future work.

The DiT starts from Gaussian noise drawn from torch's global generator (transformers' `sample`
takes no generator), so each decode seeds it with the request's `seed` (0 unless given), under the
engine's lock: the same codes, speaker and seed give the same waveform, as in transformers with the
same seed. Speakers come from the checkpoint's `spk_dict.pt` (param `voice`, default Chelsie).

Input chunks: `{"codes": (frames,) or (frames, 1)}` or `{"input": (1, frames)}` (int; the talker's
codec ids, end token excluded). Output: `{"audio": float32 (samples,), "sample_rate": 24000}`.
Engine args: `device`, `num_steps` (10, the ODE steps of the DiT).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from omni_runtime.engines.base import Engine, EngineError, EngineInput, EngineOutput, InvalidRequest
from omni_runtime.engines.speech.stage_args import checked_engine_args, stage_device, stage_model_path
from omni_runtime.spec import ResolvedPipeline, StageSpec

__all__ = ["Qwen25Token2Wav", "Token2WavEngine"]

SAMPLE_RATE = 24000
DEFAULT_VOICE = "Chelsie"
ENGINE_ARGS = {"runner", "device", "num_steps"}


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


class Token2WavEngine(Engine):
    """`generation` stage with engine arg `runner: qwen2_5_omni_token2wav` (see the module docstring)."""

    streams_input = True

    def __init__(self, pipeline: ResolvedPipeline, stage: StageSpec) -> None:
        super().__init__(pipeline, stage)
        self.model_path = stage_model_path(pipeline, stage)
        args = checked_engine_args(stage, ENGINE_ARGS)
        self.device = stage_device(args)
        self.num_steps = int(args.get("num_steps", 10))
        if self.num_steps < 1:
            raise EngineError(f"stage {stage.name!r}: num_steps {self.num_steps} must be 1 or more")
        self.model: Qwen25Token2Wav | None = None
        self._lock = threading.Lock()
        self._aborted: set[str] = set()

    async def start(self) -> None:
        try:
            self.model = await asyncio.to_thread(Qwen25Token2Wav, self.model_path, self.device)
        except Exception as exc:
            raise EngineError(f"stage {self.stage.name!r}: cannot load token2wav of {self.model_path}: {exc}") from exc

    def voices(self) -> list[str]:
        return sorted(name.lower() for name in self.model.speakers) if self.model is not None else []

    def _voice(self, requested: str | None) -> str:
        assert self.model is not None
        by_lower = {name.lower(): name for name in self.model.speakers}
        name = by_lower.get((requested or DEFAULT_VOICE).lower())
        if name is None:
            raise InvalidRequest(f"stage {self.stage.name!r}: voice {requested!r} is not one of {sorted(by_lower)}")
        return name

    def _codes(self, chunk: dict[str, Any]) -> Any:
        import torch

        assert self.model is not None
        raw = chunk.get("codes") if chunk.get("codes") is not None else chunk.get("input")
        if raw is None:
            return None
        codes = torch.as_tensor(raw)
        if codes.dtype.is_floating_point or codes.dim() > 2 or (codes.dim() == 2 and 1 not in codes.shape):
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

    async def generate(self, request: EngineInput) -> AsyncIterator[EngineOutput]:
        import torch

        if self.model is None:
            raise EngineError(f"stage {self.stage.name!r} is not started")
        rid = request.request_id
        voice = self._voice(request.params.get("voice"))
        seed = int(request.params.get("seed") or 0)
        parts = []
        first = self._codes(request.data)
        if first is not None:
            parts.append(first)
        if request.chunks is not None:
            async for chunk in request.chunks:
                codes = self._codes(chunk)
                if codes is not None:
                    parts.append(codes)
        if rid in self._aborted:
            self._aborted.discard(rid)
            yield EngineOutput(rid, {}, finished=True, finish_reason="abort")
            return
        codes = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
        if codes.numel():
            wav = await asyncio.to_thread(self._decode, codes, voice, seed)
            yield EngineOutput(rid, {"audio": wav.numpy(), "sample_rate": SAMPLE_RATE})
        yield EngineOutput(rid, {}, finished=True, finish_reason="stop", usage={"codec_tokens": int(codes.numel())})

    async def abort(self, request_id: str) -> None:
        """Skip the decode of a request still receiving its codes (a decode in progress completes)."""
        self._aborted.add(request_id)

    async def stop(self) -> None:
        self.model = None
