"""Speech out: TTFP, RTF and E2EL of the tiny Qwen3-Omni with async chunks vs whole-output hand-off.

    .venv/bin/python bench/speech.py [--tokens 200] [--requests 4] [--connector shm]

Serves `tiny-qwen3-omni` with `omnikube serve` twice, one after the other (never at once: they would
fight over the cores): first with the topology's streamed edges (thinker -> talker per step,
talker -> code2wav 4 then 25 frames), then with `window: 0` on both edges (each stage waits for its
upstream's whole output). The same streaming workload, sent with the official `openai` client
(`modalities: ["text", "audio"]`, greedy, `--tokens` thinker tokens with ignore_eos), measures per
request TTFP (request sent -> first `delta.audio`), E2EL (-> last chunk) and RTF (E2EL / seconds of
audio received) at concurrency 1 and 4. Prints medians and the ratio async / whole; the target is a
TTFP ratio <= 0.10 at concurrency 1 (vLLM-Omni reports 6.46 s -> 0.52 s on GPUs).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from openai import AsyncOpenAI

REPO = Path(__file__).resolve().parents[1]
RATE = 24000
THINKER_ARGS = {"max_model_len": 2048, "kv_cache_memory_bytes": 256 * 1024**2, "seed": 0,
                "limit_mm_per_prompt": {"image": 0, "audio": 0, "video": 0}}  # fmt: skip
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1", "NO_PROXY": "*"}


def serve(model: Path, workdir: Path, whole: bool, connector: str) -> tuple[subprocess.Popen, str]:
    spec: dict = {
        "model": str(model),
        "name": "speech-bench",
        "stages": [{"name": "thinker", "engine_args": THINKER_ARGS}],
        "connectors": {"default": connector},
    }
    if whole:
        spec["connectors"]["edges"] = [
            {"from": "thinker", "to": "talker", "window": 0},
            {"from": "talker", "to": "code2wav", "window": 0},
        ]
    path = workdir / ("whole.yaml" if whole else "async.yaml")
    path.write_text(yaml.safe_dump(spec))
    log = workdir / (path.stem + ".log")
    cmd = [sys.executable, "-m", "omni_runtime.cli", "serve", str(path), "--run-dir", str(workdir / path.stem),
           "--ready-timeout", "900"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, **ENV}, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 960
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        for line in text.splitlines():
            if "OpenAI endpoint: " in line:
                return proc, line.split("OpenAI endpoint: ")[1].strip()
        if proc.poll() is not None:
            raise RuntimeError(f"omnikube serve exited with {proc.returncode}:\n{text[-3000:]}")
        time.sleep(1)
    stop(proc)
    raise TimeoutError("omnikube serve was not ready in time")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def one(api: AsyncOpenAI, tokens: int, extra: dict) -> dict[str, float]:
    started = time.perf_counter()
    first_audio = None
    samples = 0
    stream = await api.chat.completions.create(
        model="speech-bench", messages=[{"role": "user", "content": "Tell me a story about the sea."}],
        modalities=["text", "audio"], audio={"format": "pcm16"}, stream=True, max_tokens=tokens,
        temperature=0.0, extra_body={"ignore_eos": True, **extra},
    )  # fmt: skip
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.audio:
                first_audio = first_audio or time.perf_counter()
                samples += len(base64.b64decode(choice.delta.audio.data)) // 2
    end = time.perf_counter()
    seconds = samples / RATE
    return {"ttfp": (first_audio or end) - started, "e2el": end - started, "rtf": (end - started) / max(seconds, 1e-9),
            "audio_s": seconds}  # fmt: skip


async def workload(endpoint: str, tokens: int, concurrency: int, requests: int, extra: dict) -> list[dict]:
    api = AsyncOpenAI(base_url=endpoint, api_key="none", max_retries=0, timeout=1800)
    await one(api, 8, extra)  # warm-up
    results: list[dict] = []
    queue = list(range(requests))

    async def worker() -> None:
        while queue:
            queue.pop()
            results.append(await one(api, tokens, extra))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await api.close()
    return results


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=200, help="thinker tokens per answer")
    parser.add_argument("--requests", type=int, default=4, help="requests per concurrency level")
    parser.add_argument("--connector", default="shm", choices=["inline", "shm", "mooncake"])
    parser.add_argument("--extra", default="{}", help="JSON merged into each request (e.g. sampling_params_list)")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "runtime_image"))
    from omni_runtime.tiny_models import ensure

    model = ensure("tiny-qwen3-omni")
    extra = json.loads(args.extra)
    table: dict[tuple[str, int], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="speech-bench-") as tmp:
        for mode in ("async", "whole"):
            proc, endpoint = serve(model, Path(tmp), mode == "whole", args.connector)
            try:
                for concurrency in (1, 4):
                    n = max(args.requests, concurrency)
                    table[(mode, concurrency)] = asyncio.run(workload(endpoint, args.tokens, concurrency, n, extra))
            finally:
                stop(proc)
    print(f"\ntiny-qwen3-omni, {args.tokens} thinker tokens, connector {args.connector}, medians")
    print(f"{'mode':<7}{'conc':>5}{'TTFP s':>10}{'E2EL s':>10}{'RTF':>8}{'audio s':>9}")
    for (mode, conc), rows in table.items():
        print(f"{mode:<7}{conc:>5}{median(rows, 'ttfp'):>10.3f}{median(rows, 'e2el'):>10.3f}"
              f"{median(rows, 'rtf'):>8.3f}{median(rows, 'audio_s'):>9.2f}")  # fmt: skip
    for conc in (1, 4):
        a, w = table[("async", conc)], table[("whole", conc)]
        print(f"concurrency {conc}: TTFP async/whole = {median(a, 'ttfp') / median(w, 'ttfp'):.3f} "
              f"(target <= 0.10 at 1), RTF async/whole = {median(a, 'rtf') / median(w, 'rtf'):.3f}, "
              f"E2EL async/whole = {median(a, 'e2el') / median(w, 'e2el'):.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
