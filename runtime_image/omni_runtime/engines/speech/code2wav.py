"""The code2wav stage engine (Qwen3-Omni): codec frames -> 24 kHz waveform, window by window.

Each input chunk (a window of new frames, as the talker -> code2wav edge cuts them: first after
`first_window` frames, then every `window`) is decoded as soon as it arrives, together with up to
`left_context` (25) earlier frames of the same request; windows of concurrent requests that are
waiting at the same moment are decoded in one call, right-padded to one length (the decoder is
causal, so padding on the right changes nothing before it). A whole output (edge `window: 0`) comes
as one chunk and is decoded in pieces of at most `max_frames_per_call` (300, as transformers).

No sample lost or doubled at a window boundary: a causal decode of n frames returns
n * 1920 - tail samples (tail = 555 for Qwen3-Omni's decoder, computed from each call's output as
vLLM-Omni does). Window w after c context frames therefore keeps its output from
c * 1920 - tail on, and the first window keeps everything: the concatenation has exactly the length
of a one-shot decode, aligned sample for sample. Sample values differ from the one-shot decode by
the context the window did not see (the decoder's attention reaches 72 frames back).

On a GPU the decodes run on a high-priority CUDA stream of their own (a window colocated with a
talker is scheduled ahead of the talker's kernels), and shapes met often are CUDA graphs: batch
buckets (1, 2, 4, 8, 16, 32) x frame buckets: the exact window lengths of the talker -> code2wav
edge (first window; window plus the context it can have: a 25-frame window after 25 frames of
context is 50 frames, not padded to 64), and 4, 8, 16, 32, 64 below the longest for shorter tails
(all five for an edge of whole outputs); captured at start. A call takes the smallest graph that
holds it (more rows and right padding change nothing: padded rows are dropped, the decoder is
causal), else runs eagerly.

Precision (`torch_dtype`): float32 (the default on a CPU, where the tiny models match transformers
exactly), bfloat16, or `mixed` (the default on a GPU): the decoder in bfloat16 and
the code embedding and pre-transformer in float32. On random Qwen3-Omni-sized weights pure bfloat16
puts the audio 28.4 dB from float32 (SNR, H200), most of that error from the pre-transformer (measured
layer by layer); with it in float32 the SNR is 32.7 dB (33.4 with the fused SnakeBeta; the bar: 30)
at nearly bfloat16 cost (it is a small part of the work). On a
GPU the SnakeBeta activations (most of the memory traffic at 24 kHz) run as one fused kernel
(torch.compile; float32 inside, one rounding) instead of six elementwise passes; the eager formula is
the fallback when compiling fails.

A first window (no left context) never waits in a call with longer windows: first windows are
decoded in a call of their own, ahead of the others waiting at that moment.

Input chunks: `Code2WavInput`, int codes (frames, 16), time first as on every edge (the decoder's own
(16, frames) layout is made here, at the model call). Output per chunk: `AudioOutput`, float32 (samples,)
at `QWEN_CODEC_SAMPLE_RATE`. Engine args: `device`, `torch_dtype`
(unless given: mixed on a GPU, float32 elsewhere; bfloat16), `left_context` (25), `max_frames_per_call` (300).

Before the stage reports ready, `start()` decodes `SELF_CHECK_FRAMES` frames through `generate` (a
self-check); when that fails it stops and raises with what to change, instead of failing every request.
"""

from __future__ import annotations

import asyncio
import logging
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
from omni_runtime.engines.common import (
    default_device,
    one_build_at_a_time,
    stage_dtype,
    stage_model_path,
    typed_engine_args,
)
from omni_runtime.processors.payloads import QWEN_CODEC_SAMPLE_RATE, AudioOutput, Code2WavInput, as_payload
from omni_runtime.spec import ResolvedPipeline, StageSpec
from omni_runtime.spec.engine_args import Code2WavArgs

__all__ = ["Code2WavEngine", "Qwen3Code2Wav", "graph_frames"]

log = logging.getLogger(__name__)

SELF_CHECK_FRAMES = 4
"""Codec frames (all code 0) the self-check decodes before the stage reports ready: one short window."""
GRAPH_BATCHES = (1, 2, 4, 8, 16, 32)
GRAPH_FRAMES = (4, 8, 16, 32, 64)
MIXED = "mixed"
"""`torch_dtype` value: bfloat16 decoder, float32 code embedding and pre-transformer."""


def graph_frames(first_window: int, window: int, left_context: int) -> list[int]:
    """Frame buckets for the code2wav graphs of a talker -> code2wav edge cut in `first_window`, then
    `window` frames: every window length it sends (a window plus the context it can have), so none is
    padded beyond its own size, and the power-of-two buckets below the longest for shorter tails.
    An edge of whole outputs (`window` 0) gets GRAPH_FRAMES."""
    if window <= 0:
        return list(GRAPH_FRAMES)
    first = first_window or window
    exact = {first}
    sent = first
    while True:  # the second window sees `first` frames of context, later ones up to left_context
        context = min(left_context, sent)
        exact.add(window + context)
        if context == left_context:
            break
        sent += window
    longest = max(exact)
    return sorted(exact | {f for f in GRAPH_FRAMES if f < longest})


def _snake(x: Any, alpha: Any, inv_beta: Any) -> Any:
    """SnakeBeta, x + sin(x * alpha)^2 / beta, computed in float32 and rounded once to x's dtype."""
    import torch

    high = x.float()
    return torch.addcmul(high, inv_beta, torch.sin(high * alpha).square()).to(x.dtype)


def _fuse_snakes(module: Any, device: str) -> bool:
    """Swap every SnakeBeta's forward for one compiled kernel (per-channel exp(alpha) and
    1 / (exp(beta) + eps) folded once). False, and nothing swapped, when compiling fails here."""
    import torch

    snakes = [m for m in module.modules() if type(m).__name__.endswith("SnakeBeta")]
    try:
        fused = torch.compile(_snake, dynamic=True, fullgraph=True)
        probe = torch.randn(2, 3, 5, device=device, dtype=next(module.parameters()).dtype)
        ones = torch.ones(1, 3, 1, device=device)
        torch.testing.assert_close(fused(probe, ones, ones), _snake(probe, ones, ones))
    except Exception as exc:  # the transformers forward still works, only slower
        log.warning("code2wav: cannot compile the fused SnakeBeta (%s); it runs eagerly", exc)
        return False
    for snake in snakes:
        with torch.no_grad():
            alpha = torch.exp(snake.alpha.float())[None, :, None]
            inv_beta = (1.0 / (torch.exp(snake.beta.float()) + snake.no_div_by_zero))[None, :, None]

        def forward(x: Any, alpha: Any = alpha, inv_beta: Any = inv_beta) -> Any:
            return fused(x, alpha, inv_beta)

        snake.forward = forward
    return True


def _to_mixed(module: Any) -> None:
    """bfloat16 everywhere but the code embedding and pre-transformer (float32); the pre-transformer's
    output is cast to bfloat16 where the upsampler takes it."""
    import torch

    module.to(torch.bfloat16)
    module.code_embedding.float()
    module.pre_transformer.float()

    def to_bf16(_mod: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (args[0].to(torch.bfloat16), *args[1:])

    module.upsample[0][0].register_forward_pre_hook(to_bf16)


class Qwen3Code2Wav:
    """The code2wav module of a Qwen3-Omni checkpoint and a batched, causal, context-trimmed decode."""

    def __init__(self, folder: Path, device: str, dtype: Any, fuse: bool = True) -> None:
        """`dtype`: a torch dtype or "mixed" (see the module docstring); `fuse`: the compiled SnakeBeta
        on a GPU (never on the CPU, whose path stays transformers' own)."""
        import torch
        from transformers import Qwen3OmniMoeConfig
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

        from omni_runtime.engines.speech.weights import load_part

        config = Qwen3OmniMoeConfig.from_pretrained(folder).code2wav_config
        module = Qwen3OmniMoeCode2Wav._from_config(config, dtype=torch.float32 if dtype == MIXED else dtype)
        load_part(module, folder, "code2wav.")
        self._setup(module, device, dtype, fuse)

    @classmethod
    def from_module(cls, module: Any, device: str, dtype: Any, fuse: bool = True) -> Qwen3Code2Wav:
        """Around a `Qwen3OmniMoeCode2Wav` already built (the GPU bench's random-weight one)."""
        self = cls.__new__(cls)
        self._setup(module, device, dtype, fuse)
        return self

    def _setup(self, module: Any, device: str, dtype: Any, fuse: bool) -> None:
        import torch

        config = module.config
        self.module = module
        self.module.to(device).eval()
        if dtype == MIXED:
            _to_mixed(self.module)
        self.device, self.dtype = device, dtype
        cuda = str(device).startswith("cuda")
        self.fused = bool(fuse and cuda and _fuse_snakes(self.module, device))
        """True: the SnakeBeta activations run as one compiled kernel each (GPU only)."""
        self.groups = config.num_quantizers
        self.codebook = config.codebook_size
        self.samples_per_frame = int(self.module.total_upsample)
        # on a GPU, decodes run on their own stream so a window never queues behind a talker step, at
        # the highest priority so that, colocated, its kernels go ahead of a talker pass's
        self.stream: Any = None
        if cuda:
            low, high = torch.cuda.Stream.priority_range()
            self.stream = torch.cuda.Stream(device, priority=min(low, high))
            self.normal_stream = torch.cuda.Stream(device, priority=max(low, high))
        self._graphs: dict[tuple[int, int], tuple[Any, Any, Any]] = {}
        self._pool: Any = None
        self.use_graphs = True
        """False: every call runs eagerly (the bench's comparison)."""

    def capture(self, batches: list[int], lengths: list[int]) -> None:
        """CUDA graphs of the decode for these (batch, frames) shapes (no-op off CUDA). A shape that fails
        to capture is logged and left to the eager path, which always works."""
        import torch

        if self.stream is None:
            return
        # cuDNN times its convolution algorithms for each shape in the warm-up and the graph keeps the
        # fastest (without benchmark mode it picks by heuristics); scoped to code2wav's capture. Costs
        # ~50 s once for the full-size model's 30 shapes (bench run 3), shared by later captures
        benchmark = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = True
        try:
            self._capture(batches, lengths)
        finally:
            torch.backends.cudnn.benchmark = benchmark

    def _capture(self, batches: list[int], lengths: list[int]) -> None:
        import torch

        for batch in sorted(set(batches)):
            for length in sorted(set(lengths)):
                if (batch, length) in self._graphs:
                    continue
                codes = torch.zeros(batch, self.groups, length, dtype=torch.long, device=self.device)
                try:
                    self.stream.wait_stream(torch.cuda.current_stream(self.device))
                    with torch.inference_mode(), torch.cuda.stream(self.stream):
                        for _ in range(2):  # warm-up outside the graph (cuDNN / cuBLAS pick their kernels)
                            self.module(codes)
                    graph = torch.cuda.CUDAGraph()
                    if self._pool is None:
                        self._pool = torch.cuda.graph_pool_handle()
                    with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool, stream=self.stream):
                        out = self.module(codes)[:, 0].float()
                except Exception as exc:  # the eager path still decodes this shape
                    log.warning(
                        "code2wav: no CUDA graph for %d x %d frames (%s); those calls run eagerly", batch, length, exc
                    )
                    continue
                self._graphs[(batch, length)] = (graph, codes, out)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        log.info("code2wav: CUDA graphs for (batch, frames) %s", sorted(self._graphs))

    def _graph_for(self, count: int, longest: int) -> tuple[Any, Any, Any] | None:
        """The captured graph with the fewest batch rows, then frames, that holds `count` x `longest`."""
        fits = [key for key in self._graphs if key[0] >= count and key[1] >= longest] if self.use_graphs else []
        return self._graphs[min(fits, key=lambda key: (key[0] * key[1], key))] if fits else None

    def decode(self, jobs: list[tuple[Any, int]], urgent: bool = True) -> list[Any]:
        """For each (codes [16, context + new], context frames): the float32 samples of the new frames.
        `urgent` False: on a GPU the call runs at the default stream priority (a colocated talker's
        kernels are not held back for it), else at the highest. Calls never overlap (one caller
        thread), so the graphs' shared memory pool is safe on either stream.

        One call for all jobs (right-padded with code 0). The first window of a request (context 0)
        keeps the whole causal output, n * spf - tail samples; later ones drop the context's
        c * spf - tail samples, so windows join without a gap or an overlap.
        """
        import contextlib

        import torch

        longest = max(codes.shape[1] for codes, _ in jobs)
        graph = self._graph_for(len(jobs), longest)
        rows, length = (graph[1].shape[0], graph[1].shape[2]) if graph is not None else (len(jobs), longest)
        padded = torch.zeros(rows, self.groups, length, dtype=torch.long)
        for i, (codes, _) in enumerate(jobs):
            padded[i, :, : codes.shape[1]] = codes
        stream = self.stream if urgent or self.stream is None else self.normal_stream
        on_stream = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with torch.inference_mode(), on_stream:  # the copies back wait on this stream, not the default one
            if graph is not None:
                runner, codes_in, wav = graph
                codes_in.copy_(padded)
                runner.replay()
            else:
                wav = self.module(padded.to(self.device))[:, 0].float()
            if stream is not None:  # wait without holding the GIL (a talker may share the process)
                from omni_runtime.engines.speech.kernels import wait_quietly

                wait_quietly(self.device, stream)
            tail = length * self.samples_per_frame - wav.shape[-1]  # 555 for Qwen3-Omni's decoder
            ends = [codes.shape[1] * self.samples_per_frame - tail for codes, _ in jobs]
            host = wav[: len(jobs), : max(ends)].cpu()  # one copy back (a graph's output is reused next call)
            out = []
            for i, (_, context) in enumerate(jobs):
                start = context * self.samples_per_frame - tail if context else 0
                out.append(host[i, start : ends[i]].clone())
        return out


@dataclass(eq=False)
class _Job:
    codes: Any
    context: int
    done: asyncio.Future


class Code2WavEngine(Engine):
    """`generation` stage with engine arg `runner: qwen3_omni_code2wav` (see the module docstring)."""

    streams_input = True

    def __init__(self, pipeline: ResolvedPipeline, stage: StageSpec) -> None:
        super().__init__(pipeline, stage)
        self.model_path = stage_model_path(pipeline, stage)
        self.args = typed_engine_args(stage, Code2WavArgs)
        """The stage's engine args (InvalidEngineArgs at construction when they are wrong)."""
        self.device = default_device(self.args.device)
        if self.args.torch_dtype == MIXED or (
            self.args.torch_dtype is None and self.device.startswith("cuda")
        ):  # the default on a GPU: about bfloat16 speed, and within the 30 dB bar
            self.dtype: Any = MIXED
        else:
            try:
                self.dtype = stage_dtype(stage.name, self.args.torch_dtype, "float32")
            except EngineError as exc:
                raise EngineError(f"{exc}, or {MIXED} (bfloat16 decoder, float32 pre-transformer)") from None
        self.left_context = self.args.left_context
        self.max_frames = self.args.max_frames_per_call
        ups = pipeline.topology.upstream(stage.name)
        window = ups[0].window if len(ups) == 1 else 0
        self.graph_frames = graph_frames(min(ups[0].first_window, window) if window else 0, window, self.left_context)
        """Frame buckets of the CUDA graphs captured at start (from the edge's window sizes)."""
        self.model: Qwen3Code2Wav | None = None
        self._queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._running: set[str] = set()
        self._aborted: set[str] = set()
        self._stats = {"calls_total": 0.0, "windows_total": 0.0, "last_batch_size": 0.0}

    async def start(self) -> None:
        try:
            self.model = await asyncio.to_thread(
                one_build_at_a_time(Qwen3Code2Wav), self.model_path, self.device, self.dtype
            )
        except Exception as exc:
            raise EngineError(f"stage {self.stage.name!r}: cannot load code2wav of {self.model_path}: {exc}") from exc
        if self.model.stream is not None:  # graphs of the common shapes (see the module docstring)
            await asyncio.to_thread(self.model.capture, list(GRAPH_BATCHES), self.graph_frames)
        self._task = asyncio.create_task(self._batcher(), name=f"code2wav-{self.stage.name}")
        import torch

        try:
            await self_check(
                self,
                EngineInput(
                    SELF_CHECK_ID,
                    as_payload(
                        Code2WavInput(codes=torch.zeros(SELF_CHECK_FRAMES, self.model.groups, dtype=torch.long))
                    ),
                ),
                f"decoding {SELF_CHECK_FRAMES} codec frames on {self.device} in {self.dtype}",
                "check the stage's engine_args device and torch_dtype (float32 runs everywhere), and that "
                "the model folder holds the code2wav of a complete checkpoint",
            )
        except EngineError:
            await self.stop()
            raise
        # the counters count served work from zero (the check is no client's)
        self._stats = dict.fromkeys(self._stats, 0.0)

    def _codes(self, chunk: Code2WavInput) -> Any:
        """The chunk's frames (frames, 16) as the decoder's LongTensor [16, frames] (InvalidRequest when
        malformed): the one place the edge's time-first layout turns into the model's."""
        import torch

        assert self.model is not None
        if chunk.get("codes") is None:
            return None
        codes = torch.as_tensor(chunk["codes"])
        groups = self.model.groups
        if codes.dim() != 2 or codes.shape[1] != groups or codes.dtype.is_floating_point:
            raise InvalidRequest(
                f"stage {self.stage.name!r} takes integer codec frames, codes (frames, {groups}); "
                f"got shape {tuple(codes.shape)} of {codes.dtype}"
            )
        codes = codes.T
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.model.codebook):
            raise InvalidRequest(
                f"stage {self.stage.name!r}: codec codes must lie in [0, {self.model.codebook}); "
                f"got {int(codes.min())}..{int(codes.max())}"
            )
        return codes.to(torch.long)

    async def decode_window(self, history: Any, new: int) -> Any:
        """Samples of the last `new` frames of `history` [16, frames], with up to left_context before."""
        context = min(self.left_context, history.shape[1] - new)
        job = _Job(history[:, history.shape[1] - new - context :], context, asyncio.get_running_loop().create_future())
        self._queue.put_nowait(job)
        return await job.done

    async def generate(self, request: EngineInput) -> AsyncIterator[EngineOutput]:
        import numpy as np
        import torch

        if self.model is None:
            raise EngineError(f"stage {self.stage.name!r} is not started")
        rid = request.request_id
        refuse_unknown_params(self.stage.name, request.params, ())  # its decode has no knobs
        self._running.add(rid)
        history = torch.zeros(self.model.groups, 0, dtype=torch.long)
        samples = 0

        async def chunks():
            yield request.data
            if request.chunks is not None:
                async for chunk in request.chunks:
                    yield chunk

        try:
            async for chunk in chunks():
                codes = self._codes(cast(Code2WavInput, chunk))  # talker_to_code2wav checked its layout
                if codes is None or codes.shape[1] == 0:
                    continue
                history = torch.cat([history, codes], dim=1)
                for start in range(0, codes.shape[1], self.max_frames):
                    if rid in self._aborted:
                        yield EngineOutput(rid, {}, finished=True, finish_reason="abort")
                        return
                    new = min(self.max_frames, codes.shape[1] - start)
                    end = history.shape[1] - codes.shape[1] + start + new
                    wav = await self.decode_window(history[:, :end], new)
                    samples += wav.shape[0]
                    audio = AudioOutput(audio=wav.numpy().astype(np.float32), sample_rate=QWEN_CODEC_SAMPLE_RATE)
                    yield EngineOutput(rid, as_payload(audio))
                history = history[:, -self.left_context :] if self.left_context else history[:, :0]
            yield EngineOutput(rid, {}, finished=True, finish_reason="stop", usage={"audio_samples": samples})
        finally:
            self._running.discard(rid)
            self._aborted.discard(rid)

    async def _batcher(self) -> None:
        waiting: list[_Job] = []
        while True:
            if not waiting:
                waiting.append(await self._queue.get())
            while not self._queue.empty():
                waiting.append(self._queue.get_nowait())
            # first windows (no left context: short, and a request's first audio waits on them) go in a
            # call of their own, ahead of the longer windows waiting with them
            first = [job for job in waiting if job.context == 0]
            jobs = first or waiting
            waiting = [job for job in waiting if job not in jobs] if first else []
            assert self.model is not None
            try:
                outputs = await asyncio.to_thread(self.model.decode, [(j.codes, j.context) for j in jobs])
            except Exception as exc:  # a decode fault fails the windows in that call, not the stage
                log.exception("code2wav decode failed")
                for job in jobs:
                    if not job.done.done():
                        job.done.set_exception(EngineError(f"stage {self.stage.name!r}: code2wav failed: {exc}"))
                continue
            self._stats["calls_total"] += 1
            self._stats["windows_total"] += len(jobs)
            self._stats["last_batch_size"] = float(len(jobs))
            for job, wav in zip(jobs, outputs, strict=True):
                if not job.done.done():
                    job.done.set_result(wav)

    async def abort(self, request_id: str) -> None:
        """Stop before the request's next window (a window being decoded completes)."""
        if request_id in self._running:
            self._aborted.add(request_id)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self.model = None

    def stats(self) -> dict[str, float]:
        return {"running_requests": float(len(self._running)), **self._stats}
