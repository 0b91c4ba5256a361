"""Speech at GPU speed: Qwen3-Omni-sized talker + code2wav, baseline vs the slab/graph path, one run.

    python bench/speech_gpu.py                       # on a GPU (two GPUs: also the split layout)
    python bench/speech_gpu.py --tiny --device cpu   # the same code on the tiny config, for debugging
    python bench/speech_gpu.py --concurrency 1,32 --layouts colocated --baseline-frames 0 \
        --variants ours:bf16,ours:mixed-fused,ours-fw4:mixed-fused   # a short run: colocated c=1 and 32

Models: transformers' Qwen3-Omni talker and code2wav with random weights, sized by the
`Qwen3OmniMoeTalkerConfig` / `Qwen3OmniMoeCode2WavConfig` defaults (talker 20 layers, 128 experts,
top-8, code predictor 5 layers; code2wav 8 layers). Where a default is missing or unusable the released
Qwen3-Omni value is used and printed (16 code groups, shared expert 768, head_dim 128, mrope
[24, 20, 20]). Answers: `--frames` 188 codec frames (15 s of audio); codec eos is suppressed so every
answer has that length. Thinker: a synthetic stream of `--text-tokens` tokens at `--rate` tokens/s
per request; all requests of a round arrive at once.

- baseline: transformers' own `talker.generate()` (which needs the whole text first) then code2wav's
  `chunked_decode`, one request at a time; TTFP = text stream + generate + decode.
- ours: `slab_talker.SlabTalker` (KV slabs, grouped MoE, CUDA graphs) stepping every live request,
  frames cut into code2wav windows (first `--first-window`, then `--window` new frames with
  `--left-context` before, as the talker -> code2wav edge does), all ready windows decoded in one
  `Qwen3Code2Wav.decode` call on its own CUDA stream in its own thread (precision: `--code2wav`).
  TTFP = first thinker token in -> first audio packet out; RTF = (last packet - arrival) / audio seconds;
  audio-s/s = audio seconds of the round / the round's wall time.
  Colocated (both on GPU 0) and split (talker GPU 0, code2wav GPU 1; codes hop through host memory as
  they would through the shm edge).
- variants of ours, all in the same run: `before` (first window 4, eager code2wav, windows decoded in
  arrival order: the previous run's path), `ours-fw4` (code2wav CUDA graphs per (batch, frames) bucket,
  first windows decoded in a call of their own ahead of longer ones, first window 4) and `ours`
  (the same with `--first-window`, default 2); `-normal` (ours-normal): windows with left context at the
  default stream priority, first windows at the highest; `-cc`: the talker's code predictor sub-steps
  compiled (slab_talker "compiled", the engines' default on CUDA; else the loop); `-hi`: the talker on a
  highest-priority stream (and `-normal`). `--profile`: the top kernels of a c=max step per talker.
  `--code2wav` (or `:KIND` on a variant) picks the
  code2wav: bf16, mixed (bf16 decoder, fp32 code embedding and pre-transformer: the one over the 30 dB
  SNR bar at bf16 cost) or fp32, each optionally `-fused` (one compiled kernel per SnakeBeta); the run
  prints each kind's SNR against fp32 and checks it with the targets. Each line also prints where the median TTFP goes
  (frame 1, the first window's last frame and when its thinker token was due, window queued, decode
  started, first packet) and the playback stall (playing each answer in real time from its first
  packet: how long it waits for later packets in all; a smaller first window plays out sooner).
- `--engine-check`: the stage engines themselves (`make_engine` on the registry's qwen3-omni topology)
  on a tiny checkpoint written to a temp folder: on CUDA the talker engine runs the slab talker with its
  graphs and code2wav captures its graphs at start; a seeded request alone, again, among three others,
  and its frames through code2wav in windows against the one-shot length.
"""

from __future__ import annotations

import argparse
import copy
import queue
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime_image"))

import torch  # noqa: E402

from omni_runtime.engines.speech.code2wav import MIXED, Qwen3Code2Wav  # noqa: E402
from omni_runtime.engines.speech.qwen3_talker import Qwen3Talker  # noqa: E402
from omni_runtime.engines.speech.sampling import Sampling  # noqa: E402
from omni_runtime.engines.speech.slab_talker import SlabTalker  # noqa: E402

RATE = 24000
FULL = {  # where a transformers default is missing or unusable: the released Qwen3-Omni value
    "shared_expert_intermediate_size": 768,
    "head_dim": 128,
    "num_code_groups": 16,
    "mrope_section": [24, 20, 20],
}


def build_config(tiny: bool) -> Any:
    from transformers import Qwen3OmniMoeConfig
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeCode2WavConfig,
        Qwen3OmniMoeTalkerConfig,
    )

    from omni_runtime.tiny_models.qwen3_omni import CONFIG

    config = copy.deepcopy(CONFIG)
    config = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    if not tiny:
        keep = ("id2label", "label2id", "transformers_version", "architectures", "dtype", "_name_or_path")
        defaults = Qwen3OmniMoeTalkerConfig()
        text = {k: v for k, v in defaults.text_config.to_dict().items() if k not in keep}
        text.update(
            num_experts=text.pop("num_local_experts", 128),
            shared_expert_intermediate_size=FULL["shared_expert_intermediate_size"],
            head_dim=FULL["head_dim"],
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1000000,
                "interleaved": True,
                "mrope_section": FULL["mrope_section"],
            },  # fmt: skip
        )
        predictor = {k: v for k, v in defaults.code_predictor_config.to_dict().items() if k not in keep}
        predictor["num_code_groups"] = FULL["num_code_groups"]
        talker = config["talker_config"]
        talker.update(text_config=text, code_predictor_config=predictor, thinker_hidden_size=2048)
        talker["num_code_groups"] = FULL["num_code_groups"]
        config["thinker_config"]["text_config"]["hidden_size"] = 2048
        config["code2wav_config"] = {k: v for k, v in Qwen3OmniMoeCode2WavConfig().to_dict().items() if k not in keep}
    return Qwen3OmniMoeConfig(**config)


def build(config: Any, device: str, dtype: Any, c2w_devices: list[str]) -> tuple[Qwen3Talker, dict[str, Any]]:
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeCode2Wav,
        Qwen3OmniMoeTalkerForConditionalGeneration,
    )

    torch.manual_seed(0)
    with torch.device(device):
        talker = Qwen3OmniMoeTalkerForConditionalGeneration._from_config(config.talker_config, dtype=dtype)
        vocab = config.thinker_config.text_config.vocab_size
        table = torch.randn(vocab, config.thinker_config.text_config.hidden_size, dtype=dtype) * 0.02
    with torch.no_grad():  # transformers' init leaves the fused expert tensors as torch.empty left them
        for name, param in talker.named_parameters():
            if ".experts." in name:
                param.normal_(0.0, config.talker_config.text_config.initializer_range)
    base = Qwen3Talker.from_modules(config, talker, table, device, dtype)
    base.suppress[base.eos] = True  # every answer runs its full length (random weights would stop anywhere)
    coders = {}
    for dev in c2w_devices:
        with torch.device(dev):
            module = Qwen3OmniMoeCode2Wav._from_config(config.code2wav_config, dtype=dtype)
        bad = [name for name, param in module.named_parameters() if not torch.isfinite(param).all()]
        if bad:
            raise SystemExit(f"code2wav's random init left non-finite weights in {bad[:5]}")
        coders[dev] = Qwen3Code2Wav.from_module(module, dev, dtype, fuse=False)
    params = sum(p.numel() for p in talker.parameters()) / 1e9
    c2w = sum(p.numel() for p in next(iter(coders.values())).module.parameters()) / 1e6
    print(
        f"talker {params:.2f}B parameters, code2wav {c2w:.0f}M, {dtype}, talker on {device}, code2wav on {c2w_devices}"
    )
    return base, coders


def prompt_ids(config: Any) -> list[int]:
    user = [151644, config.user_token_id, 198] + [1000 + 37 * i for i in range(24)] + [151645, 198]
    return user + [config.im_start_token_id, config.assistant_token_id, 198]


def text_ids(count: int, seed: int) -> list[int]:
    return [2000 + (seed * 131 + 17 * i) % 50000 for i in range(count)]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


# -- baseline --------------------------------------------------------------------------------------


def baseline(base: Qwen3Talker, coder: Qwen3Code2Wav, args: argparse.Namespace) -> dict[str, float]:
    """transformers' talker.generate() on the whole text, then code2wav.chunked_decode; one request."""
    config = base.config
    r = base.new_request("base", prompt_ids(config), "ethan", Sampling())
    r.text = text_ids(args.text_tokens, 0)
    r.text_done = True
    vocab = config.talker_config.text_config.vocab_size
    with torch.inference_mode():
        embeds, _ = base.prefill_inputs(r)
        spoken = base._spoken(r)
        trailing = torch.cat([base._project(spoken[4:]), base.tts_eos[None]])[None]
        ids = torch.full(embeds.shape[:2], config.tts_pad_token_id, device=base.device)
        sync(base.device)
        start = time.perf_counter()
        out = base.talker.generate(
            inputs_embeds=embeds,
            trailing_text_hidden=trailing,
            tts_pad_embed=base.tts_pad[None, None],
            talker_input_ids=ids,
            attention_mask=torch.ones(embeds.shape[:2], dtype=torch.long, device=base.device),
            max_new_tokens=args.baseline_frames + 1,
            do_sample=True,
            top_k=50,
            top_p=1.0,
            temperature=0.9,
            repetition_penalty=1.05,
            eos_token_id=base.eos,
            suppress_tokens=list(range(vocab - 1024, vocab)),  # eos too: the full length, as ours
            output_hidden_states=True,
            return_dict_in_generate=True,
        )
        codes = torch.stack([h[-1] for h in out.hidden_states if h[-1] is not None], dim=1).transpose(1, 2)
        sync(base.device)
        generated = time.perf_counter()
        wav = coder.module.chunked_decode(codes.to(coder.device), chunk_size=300, left_context_size=25)
        sync(coder.device)
        done = time.perf_counter()
    frames = codes.shape[-1]
    audio = wav.shape[-1] / RATE
    text_wait = args.text_tokens / args.rate
    result = {
        "frames": frames,
        "talker_s": generated - start,
        "code2wav_s": done - generated,
        "ttfp_ms": 1000 * (text_wait + done - start),
        "rtf": (text_wait + done - start) / audio,
        "audio_s_per_s": audio / (done - start),
    }
    print(
        f"baseline (transformers talker.generate + code2wav, sequential): {frames} frames = {audio:.2f} s audio; "
        f"talker {result['talker_s']:.2f} s ({1000 * result['talker_s'] / frames:.1f} ms/frame), code2wav "
        f"{1000 * result['code2wav_s']:.0f} ms; TTFP {result['ttfp_ms']:.0f} ms (incl. {1000 * text_wait:.0f} ms "
        f"of text stream), RTF {result['rtf']:.3f}, {result['audio_s_per_s']:.2f} audio-s/s"
    )
    return result


# -- ours ------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Stream:
    request: Any
    text: list[int]
    fed: int = 0
    codes: list[list[int]] = field(default_factory=list)
    frame_times: list[float] = field(default_factory=list)
    sent: int = 0
    first_queued: float | None = None
    first_started: float | None = None
    first_packet: float | None = None
    last_packet: float = 0.0
    samples: int = 0
    windows: int = 0
    packets: list[tuple[float, float]] = field(default_factory=list)
    """(arrival time, audio seconds) of each packet."""


@dataclass
class Variant:
    """One configuration of our path: first window size, code2wav CUDA graphs, first windows first."""

    name: str
    first_window: int
    graphs: bool
    first_priority: bool
    code2wav: str = "bf16"
    """Which code2wav (CODE2WAV_KINDS): precision, and the fused SnakeBeta or not."""
    later_normal: bool = False
    """Windows with left context decoded at the default stream priority (first windows stay highest)."""
    substep: str = "loop"
    """How the talker's code predictor runs its sub-steps (slab_talker.SUBSTEPS): '-cc' = compiled."""
    talker_high: bool = False
    """'-hi': the talker on a high-priority stream (and later windows at the default priority)."""


CODE2WAV_KINDS = ("bf16", "bf16-fused", "mixed", "mixed-fused", "fp32", "fp32-fused")


def make_coder(base: Qwen3Code2Wav, kind: str) -> Qwen3Code2Wav:
    """A code2wav of `kind` with the same weights as `base` (bf16 on a GPU): bf16, mixed (bf16 decoder,
    fp32 code embedding and pre-transformer) or fp32, with '-fused' the compiled SnakeBeta."""
    if kind not in CODE2WAV_KINDS:
        raise SystemExit(f"--code2wav / --variants: code2wav kind {kind!r} is not one of {CODE2WAV_KINDS}")
    precision, fused = kind.removesuffix("-fused"), kind.endswith("-fused")
    if kind == "bf16" and base.module.dtype == torch.bfloat16:
        return base
    module = copy.deepcopy(base.module).float()
    dtype: Any = {"bf16": torch.bfloat16, "fp32": torch.float32, "mixed": MIXED}[precision]
    if dtype == torch.bfloat16:
        module.to(dtype)
    coder = Qwen3Code2Wav.from_module(module, base.device, dtype, fuse=fused)
    if fused and not coder.fused and str(base.device).startswith("cuda"):
        print(f"code2wav {kind}: the fused SnakeBeta did not compile here; it runs eagerly")
    return coder


class Code2WavWorker:
    """One thread: every window queued at the moment is decoded in one call (its own CUDA stream); with
    `first_priority`, first windows (no left context) go in a call of their own, ahead of the others."""

    def __init__(self, coder: Qwen3Code2Wav, first_priority: bool, later_normal: bool = False) -> None:
        self.coder = coder
        self.first_priority = first_priority
        self.later_normal = later_normal
        self.jobs: queue.Queue = queue.Queue()
        self.calls = 0
        self.windows = 0
        self.busy = 0.0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        waiting: list[Any] = []
        stopping = False
        while True:
            if not waiting:
                if stopping:
                    return
                job = self.jobs.get()
                if job is None:
                    return
                waiting.append(job)
            while not self.jobs.empty():
                extra = self.jobs.get_nowait()
                if extra is None:
                    stopping = True
                    break
                waiting.append(extra)
            first = [job for job in waiting if job[2] == 0] if self.first_priority else []
            batch = first or waiting
            waiting = [job for job in waiting if all(job is not b for b in batch)]
            started = time.perf_counter()
            for stream, _, context in batch:
                if context == 0 and stream.first_started is None:
                    stream.first_started = started
            urgent = not self.later_normal or any(context == 0 for _, _, context in batch)
            wavs = self.coder.decode([(codes, context) for _, codes, context in batch], urgent=urgent)
            now = time.perf_counter()
            self.busy += now - started
            self.calls += 1
            self.windows += len(batch)
            for (stream, _, _), wav in zip(batch, wavs, strict=True):
                if stream.first_packet is None:
                    stream.first_packet = now
                stream.last_packet = now
                stream.samples += wav.shape[0]
                stream.windows += 1
                stream.packets.append((now, wav.shape[0] / RATE))

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join()


def stall_ms(stream: _Stream) -> float:
    """Playback from the first packet on, in real time: how long it waits for packets in all."""
    if not stream.packets:
        return 0.0
    stalled = 0.0
    playing_until = stream.packets[0][0]
    for arrived, seconds in stream.packets:
        if arrived > playing_until:
            stalled += arrived - playing_until
            playing_until = arrived
        playing_until += seconds
    return 1000 * stalled


def _cut(stream: _Stream, worker: Code2WavWorker, args: argparse.Namespace, final: bool) -> None:
    """Queue the next window(s) of `stream` (first `first_window` frames, then `window`)."""
    while True:
        pending = len(stream.codes) - stream.sent
        need = args.first_window if stream.sent == 0 else args.window
        if stream.sent == 0 and (pending >= need or (final and pending > 0)):
            stream.first_queued = time.perf_counter()
        if pending <= 0 or (pending < need and not final):
            return
        new = min(pending, need)
        context = min(args.left_context, stream.sent)
        frames = stream.codes[stream.sent - context : stream.sent + new]
        worker.jobs.put((stream, torch.tensor(frames, dtype=torch.long).T.contiguous(), context))
        stream.sent += new


def round_trip(
    talker: SlabTalker, coder: Qwen3Code2Wav, count: int, args: argparse.Namespace, variant: Variant
) -> dict[str, Any]:
    base = talker.base
    coder.use_graphs = variant.graphs
    args = argparse.Namespace(**{**vars(args), "first_window": variant.first_window})
    worker = Code2WavWorker(coder, variant.first_priority, variant.later_normal)
    sampling = Sampling(temperature=0.9, top_k=50, max_tokens=args.frames)
    streams = []
    start = time.perf_counter()
    for i in range(count):
        r = talker.new_request(f"r{i}", prompt_ids(base.config), "ethan", sampling)
        streams.append(_Stream(r, text_ids(args.text_tokens, i + 1)))
    steps = 0
    while True:
        now = time.perf_counter()
        due = min(args.text_tokens, int((now - start) * args.rate) + 1)
        for s in streams:
            if s.fed < due:
                s.request.text.extend(s.text[s.fed : due])
                s.fed = due
            s.request.text_done = s.fed >= args.text_tokens
        live = [s.request for s in streams if s.request.finish_reason is None]
        if not live:
            break
        frames, moved = talker.advance(live)
        steps += moved
        for s in streams:
            new = frames.get(s.request.id)
            if new:
                s.codes.extend(new)
                s.frame_times.extend([time.perf_counter()] * len(new))
            _cut(s, worker, args, final=s.request.finish_reason is not None)
        if not moved:
            time.sleep(0.0005)
    worker.stop()
    end = max(s.last_packet for s in streams)
    audio = [s.samples / RATE for s in streams]
    ttfp = [1000 * ((s.first_packet or end) - start) for s in streams]
    rtf = [(s.last_packet - start) / a for s, a in zip(streams, audio, strict=True) if a]
    reasons = {s.request.finish_reason for s in streams}
    fw = args.first_window

    def part(times: list[float | None]) -> float:
        return statistics.median(1000 * ((t if t is not None else end) - start) for t in times)

    stalls = [stall_ms(s) for s in streams]
    return {
        "parts": (
            f"frame 1 at {part([s.frame_times[0] if s.frame_times else None for s in streams]):.0f}, "
            f"frame {fw} at {part([s.frame_times[fw - 1] if len(s.frame_times) >= fw else None for s in streams]):.0f}"
            f" (its thinker token due at {1000 * fw / args.rate:.0f}), first window queued "
            f"{part([s.first_queued for s in streams]):.0f}, "
            f"decode started {part([s.first_started for s in streams]):.0f}"
            f", first packet {part([s.first_packet for s in streams]):.0f}"
        ),
        "stall_ms": statistics.median(stalls),
        "stall_max_ms": max(stalls),
        "ttfp_ms": statistics.median(ttfp),
        "ttfp_max_ms": max(ttfp),
        "rtf": statistics.median(rtf),
        "rtf_max": max(rtf),
        "audio_s_per_s": sum(audio) / (end - start),
        "audio_s": statistics.median(audio),
        "steps": steps,
        "c2w_calls": worker.calls,
        "c2w_windows_per_call": worker.windows / max(worker.calls, 1),
        "c2w_busy_s": worker.busy,
        "wall_s": end - start,
        "reasons": ",".join(sorted(str(r) for r in reasons)),
    }


def graph_check(base: Qwen3Talker) -> None:
    """Greedy frames of 2 requests through the eager passes and through their CUDA graphs: equal?"""
    runs = []
    for graphs in (False, True):
        talker = SlabTalker(base, max_batch=2, max_length=128, graphs=graphs)
        requests = []
        for i in range(2):
            r = talker.new_request(f"g{i}", prompt_ids(base.config), "ethan", Sampling(temperature=0.0, max_tokens=12))
            r.text, r.text_done = text_ids(20 + 5 * i, i), True
            requests.append(r)
        out: dict[str, list[list[int]]] = {r.id: [] for r in requests}
        while any(r.finish_reason is None for r in requests):
            frames, _ = talker.advance([r for r in requests if r.finish_reason is None])
            for rid, new in frames.items():
                out[rid] += new
        runs.append(out)
        del talker
    same = runs[0] == runs[1]
    print(f"CUDA graphs replay the eager passes (greedy, 2 requests x 12 frames): {'equal' if same else 'DIFFERENT'}")
    if not same:
        for rid in runs[0]:
            print(f"  {rid}: eager {runs[0][rid][:2]} graphs {runs[1][rid][:2]}")


def pass_times(talker: SlabTalker, sizes: list[int]) -> None:
    """Replay time of each captured pass (CUDA events, 20 replays, no request active)."""
    talker.active.zero_()
    parts = []
    for n in sizes:
        for name in ("frames", "decode"):
            graph = talker._graphs[(name, n)]
            graph.replay()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(20):
                graph.replay()
            end.record()
            end.synchronize()
            parts.append(f"{name} n={n} {begin.elapsed_time(end) / 20:.2f} ms")
    print("graph replay per pass: " + ", ".join(parts))


def profile_passes(talker: SlabTalker, count: int, label: str, steps: int = 3) -> None:
    """The top kernels by total GPU time over `steps` replays of the frames and decode passes for
    `count` slots (no request active), and the number of kernels one step launches."""
    from torch.profiler import ProfilerActivity, profile

    n = talker._bucket(count)
    talker.active.zero_()
    for graphed in (True, False):  # kernels inside graph replays, else (if the profiler sees none) eager passes
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, torch.inference_mode():
            for _ in range(steps):
                if graphed:
                    talker._graphs[("frames", n)].replay()
                    talker._graphs[("decode", n)].replay()
                else:
                    talker._frames_pass(n)
                    talker._decode_pass(n)
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        if kernels:
            label += "" if graphed else " (eager passes: graph replays showed no kernels)"
            break
    total = sum(e.device_time for e in kernels) / 1000
    print(
        f"profile ({label}, n={n}, {steps} steps of frames + decode graph replays): {len(kernels) // steps} "
        f"kernels a step, {total / steps:.2f} ms of kernel time a step"
    )
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=14, max_name_column_width=70))


def precision_error(config: Any, reference: Any, coder: Qwen3Code2Wav, kind: str) -> float:
    """The same codes through code2wav `kind` and the fp32 copy of its weights: how far the audio moves (SNR)."""
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, config.code2wav_config.codebook_size, (4, coder.groups, 100), generator=g)
    with torch.inference_mode():
        low = coder.module(codes.to(coder.device)).float()
        high = reference(codes.to(coder.device)).float()
    diff = low - high
    rel = (diff.norm() / high.norm()).item()
    snr = 20 * torch.log10(high.norm() / diff.norm()).item() if diff.norm() > 0 else float("inf")
    print(
        f"code2wav {kind} vs fp32 on the same 4 x 100 frames: max |diff| {diff.abs().max().item():.2e} "
        f"(peak |fp32| {high.abs().max().item():.2e}), relative L2 error {rel:.2e}, SNR {snr:.1f} dB "
        f"(bar: SNR >= 30 dB, the error under 1/30 of the signal)"
    )
    return snr


ENGINE_PROMPT_TOKENS = 40


def engine_check(args: argparse.Namespace) -> None:
    """The stage engines themselves (`make_engine` on the registry's qwen3-omni topology, as a stage
    pod runs them) on a checkpoint folder of the tiny config written here: on CUDA the talker engine
    wraps the slab talker (CUDA graphs) and code2wav captures its graphs at start. One seeded request
    alone, the same request among three others, and its frames through code2wav in windows."""
    import asyncio
    import tempfile

    from safetensors.torch import save_file

    from omni_runtime.engines.base import EngineInput
    from omni_runtime.engines.factory import make_engine
    from omni_runtime.registry import get_pipeline
    from omni_runtime.spec import resolve_pipeline

    config = build_config(tiny=True)
    folder = Path(tempfile.mkdtemp(prefix="speech-engine-"))
    base, coders = build(config, "cpu", torch.float32, ["cpu"])
    config.save_pretrained(folder)
    tensors = {f"talker.{k}": v for k, v in base.talker.state_dict().items()}
    tensors.update({f"code2wav.{k}": v for k, v in next(iter(coders.values())).module.state_dict().items()})
    tensors["thinker.model.embed_tokens.weight"] = base.thinker_embed
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    pipeline = resolve_pipeline(get_pipeline("qwen3-omni"), name="bench", model=str(folder))

    async def talk(engine: Any, rid: str, seed: int, frames: int) -> tuple[list[list[int]], float]:
        text = text_ids(ENGINE_PROMPT_TOKENS, seed)
        params = {"temperature": 0.9, "top_k": 50, "max_tokens": frames, "seed": seed, "voice": "ethan"}

        async def chunks():
            for token in text[1:]:
                await asyncio.sleep(1 / args.rate)
                yield {"thinker_token_ids": [token]}

        request = EngineInput(rid, {"thinker_prompt_ids": prompt_ids(config), "thinker_token_ids": text[:1]}, params)
        request.chunks = chunks()
        out: list[list[int]] = []
        started, first = time.perf_counter(), None
        async for output in engine.generate(request):
            if "codes" in output.data:
                first = first or time.perf_counter()
                out.extend(output.data["codes"].tolist())
        return out, 1000 * ((first or time.perf_counter()) - started)

    async def speak(engine: Any, codes: list[list[int]], first_window: int) -> int:
        import numpy as np

        cuts = [0, first_window, *range(first_window + args.window, len(codes), args.window), len(codes)]
        pieces = [np.asarray(codes[a:b], dtype=np.int64) for a, b in zip(cuts, cuts[1:], strict=False) if a < b]

        async def chunks():
            for piece in pieces[1:]:
                yield {"codes": piece}

        request = EngineInput("speak", {"codes": pieces[0]}, {})
        request.chunks = chunks()
        return sum([len(o.data["audio"]) async for o in engine.generate(request) if "audio" in o.data])

    async def run() -> None:
        talker = make_engine(pipeline, "talker")
        code2wav = make_engine(pipeline, "code2wav")
        await talker.start()
        await code2wav.start()
        try:
            model = talker.model
            alone, ttfp = await talk(talker, "alone", 7, 40)
            again, _ = await talk(talker, "again", 7, 40)
            crowd = await asyncio.gather(*(talk(talker, f"c{i}", 7 if i == 0 else 100 + i, 40) for i in range(4)))
            other, _ = await talk(talker, "other", 8, 40)
            samples = await speak(code2wav, alone, args.first_window)
            coder = code2wav.model
            whole = torch.tensor(alone, dtype=torch.long).T.contiguous()
            one_shot = (await asyncio.to_thread(coder.decode, [(whole, 0)]))[0].shape[0]
            graphs = len(getattr(model, "_graphs", {}))
            detail = f"{graphs} CUDA graphs, code predictor sub-steps {getattr(model, 'substep_mode', 'loop')}"
            if getattr(model, "stream", None) is not None:
                detail += f", stream priority {model.stream.priority}"
            print(
                f"engine path: Qwen3TalkerEngine on {talker.device} ran {type(model).__name__} ({detail}), "
                f"Code2WavEngine on {code2wav.device} ({len(coder._graphs)} CUDA graphs); seeded request: "
                f"{len(alone)} frames, first frames after {ttfp:.0f} ms (tiny model); same seed again: "
                f"{'equal' if again == alone else 'DIFFERENT'}; same seed among 3 others: "
                f"{'equal' if crowd[0][0] == alone else 'DIFFERENT'}; another seed: "
                f"{'different' if other != alone else 'EQUAL'}; code2wav windows ({args.first_window}, then "
                f"{args.window}): {samples} samples, one-shot length {one_shot}: "
                f"{'exact' if samples == one_shot else 'MISMATCH'}"
            )
        finally:
            await talker.stop()
            await code2wav.stop()

    asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny test config (for debugging on a CPU)")
    parser.add_argument("--device", default="cuda", help="cuda or cpu")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--frames", type=int, default=188, help="codec frames per answer (188 = 15 s)")
    parser.add_argument("--baseline-frames", type=int, default=188)
    parser.add_argument("--text-tokens", type=int, default=60)
    parser.add_argument("--rate", type=float, default=50.0, help="thinker tokens per second per request")
    parser.add_argument("--first-window", type=int, default=2, help="our first window (frames)")
    parser.add_argument("--window", type=int, default=25)
    parser.add_argument("--left-context", type=int, default=25)
    parser.add_argument("--max-length", type=int, default=512, help="talker KV slab positions per slot")
    parser.add_argument("--layouts", default="colocated,split")
    parser.add_argument(
        "--variants",
        default="before,ours-fw4,ours",
        help="before: first window 4, eager code2wav, windows in arrival order (the previous run's path); "
        "ours-fw4: code2wav CUDA graphs + first windows first, first window 4; ours: the same, --first-window. "
        "A '-normal' suffix (ours-normal): windows with left context at the default stream priority, first windows "
        "at the highest; ':KIND' picks the variant's code2wav (ours:mixed-fused), else --code2wav",
    )
    parser.add_argument(
        "--code2wav",
        default="mixed-fused",
        help=f"code2wav of the variants that name none, one of {CODE2WAV_KINDS}: bf16 (fails the 30 dB bar), mixed "
        "(bf16 decoder, fp32 code embedding and pre-transformer), fp32; '-fused': the compiled SnakeBeta (GPU only)",
    )
    parser.add_argument("--engine-check", action="store_true", help="also run the stage engines (tiny config)")
    parser.add_argument(
        "--profile", action="store_true", help="torch.profiler over graph replays of each talker's passes (top kernels)"
    )
    args = parser.parse_args()
    sys.setswitchinterval(0.0005)  # two Python threads drive the GPU: hand the GIL over within 0.5 ms, not 5
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    gpus = torch.cuda.device_count() if cuda else 0
    talker_device = "cuda:0" if cuda else "cpu"
    layouts = {"colocated": talker_device}
    if "split" in args.layouts and gpus >= 2:
        layouts["split"] = "cuda:1"
    layouts = {k: v for k, v in layouts.items() if k in args.layouts.split(",")}
    concurrency = [int(c) for c in args.concurrency.split(",")]
    known = {
        "before": Variant("before", 4, False, False),
        "ours-fw4": Variant("ours-fw4", 4, True, True),
        "ours": Variant(f"ours-fw{args.first_window}", args.first_window, True, True),
    }
    variants = []
    flags = ("-normal", "-hi", "-cc")
    for spec in args.variants.split(","):
        name, _, kind = spec.partition(":")
        seen: list[str] = []
        while any(name.endswith(f) for f in flags):
            flag = next(f for f in flags if name.endswith(f))
            seen.insert(0, flag)
            name = name.removesuffix(flag)
        if name not in known:
            raise SystemExit(f"--variants: {spec!r} names none of {sorted(known)} (with {flags} and :KIND optional)")
        v = known[name]
        kind = kind or args.code2wav
        high = "-hi" in seen
        variants.append(
            Variant(
                f"{v.name}{''.join(seen)}/{kind}",
                v.first_window,
                v.graphs,
                v.first_priority,
                kind,
                "-normal" in seen or high,
                ("compiled" if cuda else "fixed") if "-cc" in seen else "loop",
                high,
            )
        )
    print(f"command: {' '.join(sys.argv)}")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0) if cuda else 'cpu'} x {gpus}")
    if args.engine_check:
        try:
            engine_check(args)
        except Exception as exc:  # report and measure on
            print(f"engine check failed: {type(exc).__name__}: {exc}")
    config = build_config(args.tiny)
    if not args.tiny:
        print(f"sizes not given by the transformers defaults (released Qwen3-Omni values): {FULL}")
    base, plain = build(config, talker_device, dtype, sorted(set(layouts.values())))
    kinds = sorted({v.code2wav for v in variants})
    coders = {(dev, kind): make_coder(plain[dev], kind) for dev in plain for kind in kinds}
    snr: dict[str, float] = {}
    reference = copy.deepcopy(plain[talker_device].module).float()
    for kind in kinds:
        snr[kind] = precision_error(config, reference, coders[(talker_device, kind)], kind)
    del reference
    if cuda:
        try:
            graph_check(base)
        except Exception as exc:  # report and measure on
            print(f"graph check failed: {type(exc).__name__}: {exc}")
    results: dict[str, Any] = {}
    if args.baseline_frames:
        try:
            results["baseline"] = baseline(base, plain[talker_device], args)
        except Exception as exc:  # the rest of the run still measures ours
            print(f"baseline failed: {type(exc).__name__}: {exc}")
    talkers: dict[tuple[str, bool], SlabTalker] = {}
    for key in sorted({(v.substep, v.talker_high) for v in variants}):
        talker = SlabTalker(
            base, max_batch=max(concurrency), max_length=args.max_length, substep=key[0], high_priority=key[1]
        )
        started = time.perf_counter()
        talker.capture(concurrency)
        buckets = sorted({talker._bucket(c) for c in concurrency})
        took = time.perf_counter() - started
        label = f"talker substep {talker.substep_mode}, {'high-priority stream' if talker.stream else 'current stream'}"
        print(f"{label}: CUDA graphs for batch buckets {buckets} in {took:.1f} s" if talker.use_graphs else label)
        if talker.use_graphs:
            pass_times(talker, sorted(buckets))
        talkers[key] = talker
    if cuda and any(v.graphs for v in variants):
        lengths = {args.left_context + args.window}
        for v in variants:
            lengths |= {v.first_window, v.first_window + args.window}
        sizes = [b for b in (1, 2, 4, 8, 16, 32, 64) if b < max(concurrency)] + [max(concurrency)]
        for (device, kind), coder in coders.items():
            started = time.perf_counter()
            coder.capture(sizes, sorted(lengths))
            print(
                f"code2wav {kind} on {device}: {len(coder._graphs)} CUDA graphs (batch {sizes} x frames "
                f"{sorted(lengths)}) in {time.perf_counter() - started:.1f} s"
            )
    for variant in variants:
        for layout, c2w_device in layouts.items():
            coder = coders[(c2w_device, variant.code2wav)]
            talker = talkers[(variant.substep, variant.talker_high)]
            warm = argparse.Namespace(**{**vars(args), "frames": 2 * args.window})
            round_trip(talker, coder, min(2, max(concurrency)), warm, variant)
            for c in concurrency:
                try:
                    r = round_trip(talker, coder, c, args, variant)
                except Exception as exc:  # report and measure on
                    print(f"{variant.name} {layout} c={c} failed: {type(exc).__name__}: {exc}")
                    continue
                results[f"{variant.name}-{layout}-{c}"] = r
                print(
                    f"{variant.name:22s} {layout:9s} c={c:3d}: TTFP median {r['ttfp_ms']:.0f} ms "
                    f"(max {r['ttfp_max_ms']:.0f}), RTF median {r['rtf']:.3f} (max {r['rtf_max']:.3f}), "
                    f"{r['audio_s_per_s']:.1f} audio-s/s, {r['audio_s']:.2f} s audio each, playback stall median "
                    f"{r['stall_ms']:.0f} ms (max {r['stall_max_ms']:.0f}), {r['steps']} steps in {r['wall_s']:.2f} s"
                    f" ({1000 * r['wall_s'] / max(r['steps'], 1):.1f} ms a step), code2wav {r['c2w_calls']} calls x "
                    f"{r['c2w_windows_per_call']:.1f} windows "
                    f"({r['c2w_busy_s']:.2f} s busy), finish {r['reasons']}\n    TTFP parts (median ms after "
                    f"arrival): {r['parts']}"
                )
    if args.profile and cuda:
        for talker in talkers.values():
            profile_passes(talker, max(concurrency), f"talker substep {talker.substep_mode}")
    b = results.get("baseline")
    top_c = max(concurrency)
    for variant in variants:
        for layout in layouts:
            top = results.get(f"{variant.name}-{layout}-{top_c}")
            if b and top:
                ratio = top["audio_s_per_s"] / b["audio_s_per_s"]
                print(
                    f"{variant.name} {layout}: audio-s/s at c={top_c} / sequential baseline = "
                    f"{top['audio_s_per_s']:.1f} / {b['audio_s_per_s']:.2f} = {ratio:.1f}x"
                )
            one, top = results.get(f"{variant.name}-{layout}-1"), results.get(f"{variant.name}-{layout}-{top_c}")
            if one and top and not args.tiny:
                checks = [
                    ("TTFP <= 100 ms at c=1", one["ttfp_ms"] <= 100),
                    (f"TTFP <= 250 ms at c={top_c}", top["ttfp_ms"] <= 250),
                    (f"RTF <= 0.25 at c={top_c}", top["rtf"] <= 0.25),
                    (f">= 128 audio-s/s at c={top_c}", top["audio_s_per_s"] >= 128),
                    (f"code2wav SNR {snr[variant.code2wav]:.1f} >= 30 dB", snr[variant.code2wav] >= 30),
                ]
                print(
                    f"targets ({variant.name}, {layout}, medians): "
                    + "; ".join(f"{n}: {'met' if ok else 'NOT met'}" for n, ok in checks)
                )


if __name__ == "__main__":
    main()
