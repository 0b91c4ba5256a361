"""The `generation` engine: a non-autoregressive torch module run chunk by chunk.

A *module runner* loads one module from the stage's folder and maps an input chunk (a tensor) to an
output payload. The engine splits a request's input into chunks and yields one EngineOutput per
chunk, in order, so the next stage (or the client) can start on the first one. Each runner has its
engine here, a `GenerationEngine` subclass that names it (`VAEDecodeEngine`); the stage's engine arg
`runner` picks the engine in `engines.factory.ENGINES`, the one table of runners.

Engine args (`spec.engine_args.GenerationArgs`): `runner` (required), `chunk_size` (items per chunk along
`chunk_dim`, default 1), `chunk_dim` (default 0), `torch_dtype` (default float32), `device` (cuda when
available, else cpu). Other keys are left to the runner (`ModuleRunner.args`). The speech runners
(talkers, code2wav, token2wav) are engines of their own in `engines.speech`, which refuse unknown keys.

Input: `{"input": tensor}` (split here along `chunk_dim`; `dit_to_vae` gives a `processors.payloads.VaeInput`)
or `{"chunks": [tensor, ...]}` (already split upstream).
Output per chunk: the runner's payload plus `chunk_index` and `num_chunks`.
"""

from __future__ import annotations

import asyncio
import io
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

from omni_runtime.engines.base import Engine, EngineError, EngineInput, EngineOutput, InvalidRequest
from omni_runtime.engines.common import (
    default_device,
    named_dtype,
    one_build_at_a_time,
    release_device_memory,
    stage_model_path,
    typed_engine_args,
)
from omni_runtime.spec import ResolvedPipeline, StageSpec
from omni_runtime.spec.engine_args import GenerationArgs

__all__ = ["GenerationEngine", "ModuleRunner", "VAEDecodeEngine", "VAEDecodeRunner"]

log = logging.getLogger(__name__)


class ModuleRunner(ABC):
    """Loads one torch module from a folder and runs it on one chunk at a time."""

    name: ClassVar[str]

    def __init__(self, path: Path, device: str, dtype: Any, args: dict[str, Any]) -> None:
        self.path = path
        self.device = device
        self.dtype = dtype
        self.args = args

    @abstractmethod
    def load(self) -> None:
        """Load the module (called once, in a worker thread)."""

    @abstractmethod
    def run(self, chunk: Any) -> dict[str, Any]:
        """The output payload for one input chunk (called in a worker thread, one at a time)."""


class VAEDecodeRunner(ModuleRunner):
    """`vae_decode`: diffusers `AutoencoderKL` latents (B, C, h, w) -> `{"images": [png bytes...]}`.

    Loads from the stage folder, or its `vae/` subfolder when there is one (a whole diffusers
    pipeline folder). Latents are in the diffusion model's space, as a pipeline returns them with
    `output_type="latent"`: the runner undoes the VAE's `scaling_factor` / `shift_factor` first.
    Chunks split the batch axis: one chunk = `chunk_size` images.
    """

    name = "vae_decode"

    def load(self) -> None:
        from diffusers import AutoencoderKL
        from diffusers.image_processor import VaeImageProcessor

        folder = self.path / "vae" if (self.path / "vae" / "config.json").is_file() else self.path
        self.vae = AutoencoderKL.from_pretrained(folder, dtype=self.dtype, local_files_only=True)
        self.vae = self.vae.to(self.device).eval()
        scale = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.processor = VaeImageProcessor(vae_scale_factor=scale)

    def run(self, chunk: Any) -> dict[str, Any]:
        import torch

        if chunk.dim() != 4 or chunk.shape[1] != self.vae.config.latent_channels:
            raise InvalidRequest(
                f"vae_decode needs latents (batch, {self.vae.config.latent_channels}, height, width); "
                f"got shape {tuple(chunk.shape)}"
            )
        config = self.vae.config
        latents = chunk.to(self.device, self.dtype) / config.scaling_factor
        if getattr(config, "shift_factor", None) is not None:
            latents = latents + config.shift_factor
        with torch.inference_mode():
            pixels = self.vae.decode(latents, return_dict=False)[0]
        images = self.processor.postprocess(pixels.float(), output_type="pil")
        out = []
        for image in images:
            buf = io.BytesIO()
            image.save(buf, format="PNG")
            out.append(buf.getvalue())
        return {"images": out}


class GenerationEngine(Engine):
    """A generation stage: one module runner, chunked inputs, one output per chunk.

    A subclass names its runner in `runner_cls` and is listed in `engines.factory.ENGINES`.
    `stats()`: `running_requests`, `chunks_total`, `last_chunk_seconds`.
    """

    runner_cls: ClassVar[type[ModuleRunner]]

    def __init__(self, pipeline: ResolvedPipeline, stage: StageSpec) -> None:
        super().__init__(pipeline, stage)
        self.model_path = stage_model_path(pipeline, stage)
        self.args = typed_engine_args(stage, GenerationArgs)
        """The stage's engine args (InvalidEngineArgs at construction when they are wrong)."""
        self.chunk_size = self.args.chunk_size
        self.chunk_dim = self.args.chunk_dim
        self._dtype_name = self.args.torch_dtype
        self._device = self.args.device
        self._runner_args = dict(self.args.model_extra or {})
        """The keys that are not the engine's, for the runner (`ModuleRunner.args`)."""
        self.runner: ModuleRunner | None = None
        self.load_seconds = 0.0
        self._lock = threading.Lock()
        self._aborted: set[str] = set()
        self._running: set[str] = set()
        self._stats = {"chunks_total": 0.0, "last_chunk_seconds": 0.0}

    async def start(self) -> None:
        dtype = named_dtype(self.stage.name, self._dtype_name, "use float32, bfloat16 or float16")
        device = default_device(self._device)
        runner = self.runner_cls(self.model_path, device, dtype, self._runner_args)
        started = time.monotonic()
        try:
            await asyncio.to_thread(one_build_at_a_time(runner.load))
        except Exception as exc:
            raise EngineError(
                f"stage {self.stage.name!r}: runner {runner.name!r} failed to load {self.model_path}: {exc}"
            ) from exc
        self.load_seconds = time.monotonic() - started
        self.runner = runner

    def chunks(self, data: dict[str, Any]) -> list[Any]:
        """The request's input as a list of chunks (InvalidRequest when it has none)."""
        import torch

        if "chunks" in data:
            chunks = [torch.as_tensor(c) for c in data["chunks"]]
        elif "input" in data:
            tensor = torch.as_tensor(data["input"])
            if tensor.dim() <= self.chunk_dim:
                raise InvalidRequest(
                    f"stage {self.stage.name!r} splits its input along axis {self.chunk_dim}, "
                    f"but the input has shape {tuple(tensor.shape)}"
                )
            chunks = list(torch.split(tensor, self.chunk_size, dim=self.chunk_dim))
        else:
            raise InvalidRequest(
                f"stage {self.stage.name!r} needs 'input' (a tensor) or 'chunks' (a list of tensors); "
                f"got {sorted(data)}"
            )
        if not chunks:
            raise InvalidRequest(f"stage {self.stage.name!r} got an empty input")
        return chunks

    def _run(self, chunk: Any) -> dict[str, Any]:
        assert self.runner is not None
        with self._lock:
            started = time.monotonic()
            out = self.runner.run(chunk)
            self._stats["last_chunk_seconds"] = time.monotonic() - started
            self._stats["chunks_total"] += 1
        return out

    async def generate(self, request: EngineInput) -> AsyncIterator[EngineOutput]:
        if self.runner is None:
            raise EngineError(f"stage {self.stage.name!r} is not started")
        rid = request.request_id
        chunks = self.chunks(request.data)
        self._aborted.discard(rid)
        self._running.add(rid)
        try:
            for i, chunk in enumerate(chunks):
                if rid in self._aborted:
                    yield EngineOutput(rid, {}, finished=True, finish_reason="abort")
                    return
                try:
                    payload = await asyncio.to_thread(self._run, chunk)
                except InvalidRequest:
                    raise
                except Exception as exc:
                    raise EngineError(
                        f"stage {self.stage.name!r}: runner {self.runner.name!r} failed on chunk {i} "
                        f"of request {rid!r}: {exc}"
                    ) from exc
                last = i == len(chunks) - 1
                yield EngineOutput(
                    rid,
                    {**payload, "chunk_index": i, "num_chunks": len(chunks)},
                    finished=last,
                    finish_reason="stop" if last else None,
                )
        finally:
            self._running.discard(rid)
            self._aborted.discard(rid)

    async def abort(self, request_id: str) -> None:
        """Stop a running request before its next chunk (the chunk in progress completes)."""
        if request_id in self._running:
            self._aborted.add(request_id)

    async def stop(self) -> None:
        if self.runner is None:
            return
        await asyncio.to_thread(self._lock.acquire)  # a chunk in progress finishes first
        try:
            self.runner = None
        finally:
            self._lock.release()
        release_device_memory()

    def stats(self) -> dict[str, float]:
        return {"running_requests": float(len(self._running)), **self._stats}


class VAEDecodeEngine(GenerationEngine):
    """`generation` stage with engine arg `runner: vae_decode` (see `VAEDecodeRunner`)."""

    runner_cls = VAEDecodeRunner
