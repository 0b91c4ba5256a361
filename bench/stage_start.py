"""Stage start-up cost: vLLM's worker inside its engine core (our default) vs in a process of its own.

    .venv/bin/python bench/stage_start.py [--rounds 2] [--out bench/results-cpu2-stage-start.txt]

`omnikube stage` starts with `VLLM_ENABLE_V1_MULTIPROCESSING=0` unless the environment already sets it
(`omni_runtime.stage.settings.STAGE_ENV_DEFAULTS`): on CPU, vLLM's platform otherwise forces its
multiprocessing executor, a third process per AR stage that imports vLLM once more. This starts
`omnikube serve` of a one-replica tiny chat pipeline (the tiny Qwen2 model of the tests) as a user would,
alternately with our default and with `VLLM_ENABLE_V1_MULTIPROCESSING=1` in its environment (the opt-out a
pod's `env` has), and prints per run the seconds until the router answers and the CPU-seconds the stage's
process tree used until then (every process still alive under the stage, read from /proc at that moment),
then the ratios default / opt-out of the medians. One start of each goes first and is not counted (the first
vLLM import of a new environment fills the OS file cache and vLLM's own caches). The runs are sequential; other
load on the machine moves both alike only when it is steady.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

from omni_runtime.tiny_models import ensure

REPO = Path(__file__).resolve().parents[1]

MP_KEY = "VLLM_ENABLE_V1_MULTIPROCESSING"


def spec(model: Path) -> dict:
    return {
        "model": str(model),
        "name": "start-bench",
        "stages": [{"name": "llm", "engine_args": {"max_model_len": 512, "kv_cache_memory_bytes": 64 << 20}}],
    }


def tree_cpu_s(pid: int) -> float:
    """User + system CPU-seconds of `pid` and every process under it now (reaped children included)."""
    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def one_run(model: Path, opt_out: bool, workdir: Path) -> tuple[float, float, int]:
    """(seconds to the router's endpoint, stage tree CPU-seconds then, processes in the stage's tree)."""
    workdir.mkdir(parents=True)
    file = workdir / "pipeline.yaml"
    file.write_text(yaml.safe_dump(spec(model)))
    env = {k: v for k, v in os.environ.items() if k != MP_KEY}
    env["HF_HUB_OFFLINE"] = "1"
    if opt_out:
        env[MP_KEY] = "1"
    log = workdir / "serve.log"
    run_dir = workdir / "run"
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "omni_runtime.cli", "serve", str(file), "--run-dir", str(run_dir)],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env,
        )  # fmt: skip
    try:
        while not re.search(r"OpenAI endpoint: \S+", log.read_text(errors="replace")):
            if proc.poll() is not None:
                raise RuntimeError(f"omnikube serve exited {proc.returncode}:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        ready_s = time.monotonic() - started
        (stage,) = [p for p in json.loads((run_dir / "processes.json").read_text()) if p["name"].startswith("stage ")]
        cpu = tree_cpu_s(stage["pid"])
        n = 1 + len(psutil.Process(stage["pid"]).children(recursive=True))
        return ready_s, cpu, n
    finally:
        proc.send_signal(2)
        proc.wait(120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model = ensure("tiny-qwen2-chat")
    results: dict[bool, list[tuple[float, float, int]]] = {False: [], True: []}
    lines = [f"stage start-up, tiny-qwen2-chat, {os.cpu_count()} cores, {args.rounds} round(s)"]
    with tempfile.TemporaryDirectory(prefix="stage-start-") as tmp:
        for opt_out in (True, False):  # warm-up, not counted
            one_run(model, opt_out, Path(tmp) / f"warmup-{int(opt_out)}")
        for r in range(args.rounds):
            for opt_out in (True, False):
                ready, cpu, n = one_run(model, opt_out, Path(tmp) / f"{r}-{int(opt_out)}")
                results[opt_out].append((ready, cpu, n))
                label = f"{MP_KEY}=1 (opt-out)" if opt_out else "default (worker in the engine core)"
                lines.append(
                    f"  round {r}: {label:40s} ready {ready:6.1f} s   stage tree {cpu:6.1f} CPU-s   {n} processes"
                )
                print(lines[-1], flush=True)
    med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for k, v in results.items()}
    lines.append(
        f"median ready: default {med[False][0]:.1f} s, opt-out {med[True][0]:.1f} s -> ratio "
        f"{med[False][0] / med[True][0]:.2f}"
    )
    lines.append(
        f"median stage CPU: default {med[False][1]:.1f} CPU-s, opt-out {med[True][1]:.1f} CPU-s -> ratio "
        f"{med[False][1] / med[True][1]:.2f}"
    )
    print("\n".join(lines[-2:]))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
