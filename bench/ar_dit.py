"""AR -> DiT over KV (BAGEL): E2E per image with the KV hand-off between processes vs the same image in one process.

    .venv/bin/python bench/ar_dit.py [--images 8] [--steps 10] [--size 128] [--connectors shm mooncake]

Serves `tiny-bagel` (the registry's `bagel` topology) with `omnikube serve`, once per connector of its
thinker -> dit edge (one after the other: they would fight over the cores; mooncake in p2p mode, TCP on
loopback), and sends `--images` text-to-image requests one at a time with the `openai` client (text guidance
on: each request hands over two KV caches, the prompt's and the cfg_text companion's). Per image: E2E (request
sent -> PNG received), and from the dit's metrics the KV bytes and the hand-off seconds (the time to get the KV
caches out of the connector: `omnikube_stage_kv_cache_transfer_seconds`), so its share of E2E.

Baseline, in this process: the same generation (the same generator, steps, size and guidance) from a
plain-torch prefill of the same framed tokens, prefill included. The ratio staged / in-process says what the
whole two-stage path costs (vLLM's prefill and scheduling, the router, the KV hand-off, the PNG), and the
hand-off share what the KV transfer alone costs. Target: the hand-off <= 3 % of E2E over shm.

On one H200 (when lent): the same script with a BAGEL-7B-sized random checkpoint needs a CUDA vLLM wheel carried
to the device; see the closing notes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml
from openai import AsyncOpenAI

REPO = Path(__file__).resolve().parents[1]
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1", "NO_PROXY": "*"}
PROMPT = "a lighthouse on a cliff at sunset, oil painting"
MOONCAKE = {"mode": "p2p", "global_segment_size": 64 * 1024**2, "local_buffer_size": 16 * 1024**2}


def serve(model: Path, workdir: Path, connector: str, steps: int, size: int) -> tuple[subprocess.Popen, str]:
    spec: dict = {
        "model": str(model),
        "name": "bagel-bench",
        "stages": [{"name": "dit", "sampling_params": {"num_inference_steps": steps, "height": size, "width": size}}],
        "connectors": {"default": connector, **({"mooncake": MOONCAKE} if connector == "mooncake" else {})},
    }
    path = workdir / f"{connector}.yaml"
    path.write_text(yaml.safe_dump(spec))
    log = workdir / f"{connector}.log"
    cmd = [sys.executable, "-m", "omni_runtime.cli", "serve", str(path), "--run-dir", str(workdir / connector),
           "--ready-timeout", "900"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, **ENV}, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 960
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if "OpenAI endpoint: " in line:
                return proc, line.split("OpenAI endpoint: ")[1].strip()
        if proc.poll() is not None:
            raise RuntimeError(f"omnikube serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
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


def dit_metrics(run_dir: Path) -> dict[str, float]:
    """The dit's KV histograms' sums and counts, from its /metrics."""
    import json

    processes = json.loads((run_dir / "processes.json").read_text())
    (dit,) = [p for p in processes if p["name"].startswith("stage dit/")]
    text = urllib.request.urlopen(dit["probe"].replace("/readyz", "/metrics"), timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("omnikube_stage_kv_cache_bytes", "omnikube_stage_kv_cache_transfer_seconds"):
            for suffix in ("_sum", "_count"):
                if line.startswith(name + suffix + "{"):
                    out[name + suffix] = out.get(name + suffix, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def staged(endpoint: str, images: int, run_dir: Path) -> dict[str, float]:
    api = AsyncOpenAI(base_url=endpoint, api_key="none", max_retries=0, timeout=1800)
    await api.images.generate(model="bagel-bench", prompt=PROMPT, extra_body={"seed": 0})  # warm-up
    before = dit_metrics(run_dir)
    e2e = []
    for i in range(images):
        started = time.perf_counter()
        await api.images.generate(model="bagel-bench", prompt=PROMPT, extra_body={"seed": i + 1})
        e2e.append(time.perf_counter() - started)
    after = dit_metrics(run_dir)
    await api.close()
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return {
        "e2e": statistics.median(e2e),
        "kv_bytes": delta["omnikube_stage_kv_cache_bytes_sum"] / images,
        "handoff": delta["omnikube_stage_kv_cache_transfer_seconds_sum"] / images,
        "caches": delta["omnikube_stage_kv_cache_bytes_count"] / images,
    }


def in_process(model: Path, images: int, steps: int, size: int) -> float:
    """Median seconds of the same image drawn in this process: torch prefill of both contexts + generation."""
    import torch
    from transformers import AutoTokenizer

    from omni_runtime.engines.diffusion.bagel import BagelGenerator
    from omni_runtime.registry import get_pipeline
    from omni_runtime.spec.guidance import BagelGuidance

    dit = get_pipeline("bagel").stage("dit")
    generator = BagelGenerator.from_pretrained(model, getattr(torch, dit.engine_args["torch_dtype"]))
    tokenizer = AutoTokenizer.from_pretrained(model)
    guidance = BagelGuidance(**{k: v for k, v in dit.sampling_params.items() if k in BagelGuidance.model_fields})
    ids = generator.frame_text(tokenizer.encode(PROMPT, add_special_tokens=False))
    times = []
    for i in range(images + 1):
        started = time.perf_counter()
        contexts = {"primary": generator.prefill(ids), "cfg_text": generator.prefill(generator.frame_text([]))}
        with torch.inference_mode():
            generator.generate(contexts, size, size, steps, i, guidance)
        if i:  # the first is the warm-up
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--connectors", nargs="+", default=["shm", "mooncake"])
    args = parser.parse_args()
    from omni_runtime.tiny_models import ensure

    model = ensure("tiny-bagel")
    baseline = in_process(model, args.images, args.steps, args.size)
    print(f"tiny-bagel, {args.size}x{args.size}, {args.steps} steps, text guidance on, {args.images} images each")
    print(f"  in one process (torch prefill + generation): {baseline * 1000:8.1f} ms/image")
    with tempfile.TemporaryDirectory(prefix="bench-ar-dit-") as tmp:
        for connector in args.connectors:
            proc, endpoint = serve(model, Path(tmp), connector, args.steps, args.size)
            try:
                r = asyncio.run(staged(endpoint, args.images, Path(tmp) / connector))
            finally:
                stop(proc)
            share = r["handoff"] / r["e2e"]
            print(
                f"  staged over {connector:8s}: {r['e2e'] * 1000:8.1f} ms/image (x{r['e2e'] / baseline:.2f} of one "
                f"process); KV {r['kv_bytes'] / 1024:.1f} KiB in {r['caches']:.0f} caches, hand-off "
                f"{r['handoff'] * 1000:.2f} ms = {share:.2%} of E2E (target <= 3% over shm)"
            )


if __name__ == "__main__":
    main()
