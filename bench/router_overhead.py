"""Router overhead: chat through omnikube's router + stage vs the same model behind vLLM's own server.

    nice -n 10 .venv/bin/python bench/router_overhead.py [--rounds 5] [--requests 16] [--max-tokens 32]

Both sides serve the tiny Qwen2 chat model with the same engine arguments and stay up together; rounds
alternate between them in ABBA order (vLLM, omnikube, omnikube, vLLM, ...), each round sending the same streaming
workload with the official `openai` client, so that a noisy neighbour slows both sides alike instead of
one run. A round measures the median TTFT (request sent -> first content token) and TPOT
((last - first token) / (tokens - 1)) at concurrency 1 and 16; the ratio omnikube / vLLM is taken per
pair of neighbouring rounds, and the median ratio is printed with its range (min..max). The target is
<= 1.10.

The workload (`WORKLOAD`) mixes plain chat with structured output (`response_format` json_schema, which
vLLM's structured-output backend constrains on both sides) and tool calls (`TOOL_CALL_REQUESTS`: `tools`
with `tool_choice` required, both sides parsing with vLLM's `hermes` parser); a streamed tool call's
`delta.tool_calls` pieces count as its tokens.
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
sys.path.insert(0, str(REPO / "e2e" / "cluster"))

from localcluster import free_port  # noqa: E402

ENGINE_ARGS = {"max_model_len": 512, "kv_cache_memory_bytes": 256 * 1024**2, "enforce_eager": True, "seed": 0}
TOOL_PARSER = "hermes"
"""Both sides: `--enable-auto-tool-choice --tool-call-parser` for vLLM, `tool_call_parser` for the stage."""
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1", "NO_PROXY": "*"}


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with opener.open(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready after {timeout}s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def start_vllm(model: Path, port: int, log: Path) -> subprocess.Popen:
    args = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(ENGINE_ARGS["max_model_len"]),
        "--kv-cache-memory-bytes",
        str(ENGINE_ARGS["kv_cache_memory_bytes"]),
        "--enforce-eager",
        "--seed",
        "0",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        TOOL_PARSER,
    ]
    return subprocess.Popen(
        args, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **ENV}
    )


def start_omnikube(model: Path, port: int, workdir: Path) -> subprocess.Popen:
    spec = {
        "model": str(model),
        "pipeline": "text-chat",
        "name": "bench",
        "served_model_name": "tiny",
        "stages": [{"name": "llm", "engine_args": {**ENGINE_ARGS, "tool_call_parser": TOOL_PARSER}}],
        "limits": {"max_concurrent_requests": 64, "max_queued_requests": 256},
    }
    path = workdir / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec))
    args = [
        sys.executable,
        "-m",
        "omni_runtime.cli",
        "serve",
        str(path),
        "--port",
        str(port),
        "--run-dir",
        str(workdir / "run"),
    ]
    return subprocess.Popen(
        args,
        stdout=(workdir / "serve.log").open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **ENV},
    )


CHUNKS: list[tuple[int, int]] = []
"""(content chunks, completion tokens) per request: shows whether a server coalesces tokens."""

ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"number": {"type": "integer"}, "fact": {"type": "string", "maxLength": 40}},
    "required": ["number", "fact"],
    "additionalProperties": False,
}


def plain_chat(i: int) -> dict:
    """A free-text answer that runs to max_tokens (ignore_eos), the baseline path."""
    return {
        "messages": [{"role": "user", "content": f"Tell me about the number {i}."}],
        "extra_body": {"ignore_eos": True},
    }


def structured_output(i: int) -> dict:
    """`response_format` json_schema (strict): the structured-output path of the text stage."""
    return {
        "messages": [{"role": "user", "content": f"Give one fact about the number {i} as JSON."}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "fact", "schema": ANSWER_SCHEMA, "strict": True},
        },
    }


LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {"number": {"type": "integer"}},
            "required": ["number"],
            "additionalProperties": False,
        },
    },
}


def tool_call(i: int) -> dict:
    """`tools` with `tool_choice` required: vLLM's structural tag constrains the call, its parser reads it."""
    return {
        "messages": [{"role": "user", "content": f"Look up the number {i}."}],
        "tools": [LOOKUP_TOOL],
        "tool_choice": "required",
    }


TOOL_CALL_REQUESTS: list = [tool_call]
"""Builders (i -> request kwargs) of tool-call requests (`tools` + `tool_choice`)."""

WORKLOAD = [plain_chat, plain_chat, plain_chat, structured_output, *TOOL_CALL_REQUESTS]
"""Request i is built by WORKLOAD[i % len(WORKLOAD)]: the same prompts in every round, on both sides."""


async def one_request(client: AsyncOpenAI, i: int, max_tokens: int) -> tuple[float, float] | None:
    kwargs = WORKLOAD[i % len(WORKLOAD)](i)
    started = time.perf_counter()
    first = last = None
    chunks = tokens = 0
    stream = await client.chat.completions.create(
        model="tiny",
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        **kwargs,
    )
    async for chunk in stream:
        if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].delta.tool_calls):
            now = time.perf_counter()
            first = first or now
            last = now
            chunks += 1
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    tokens = tokens or chunks  # TPOT is per token, whatever the chunking
    CHUNKS.append((chunks, tokens))
    if first is None or last is None or tokens < 2:
        return None
    return first - started, (last - first) / (tokens - 1)


async def workload(base_url: str, concurrency: int, requests: int, max_tokens: int) -> tuple[float, float]:
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
    sem = asyncio.Semaphore(concurrency)

    async def run(i: int):
        async with sem:
            return await one_request(client, i, max_tokens)

    await asyncio.gather(*(run(i) for i in range(min(4, requests))))  # warm-up
    results = [r for r in await asyncio.gather(*(run(i) for i in range(requests))) if r]
    await client.close()
    if len(results) < requests // 2:
        raise RuntimeError(f"only {len(results)} of {requests} requests streamed tokens")
    return statistics.median(r[0] for r in results), statistics.median(r[1] for r in results)


def one_round(name: str, base_url: str, concurrency: int, args: argparse.Namespace) -> tuple[float, float]:
    ttft, tpot = asyncio.run(workload(base_url, concurrency, args.requests, args.max_tokens))
    chunks = statistics.median(ch for ch, _ in CHUNKS)
    tokens = statistics.median(t for _, t in CHUNKS)
    CHUNKS.clear()
    print(
        f"  {name:9} concurrency {concurrency:2}: TTFT {ttft * 1000:8.1f} ms   TPOT {tpot * 1000:7.2f} ms   "
        f"(median {tokens:.0f} tokens in {chunks:.0f} chunks)",
        flush=True,
    )
    return ttft, tpot


def summary(label: str, ratios: list[float]) -> str:
    return f"{label} ratio {statistics.median(ratios):.2f} (range {min(ratios):.2f}..{max(ratios):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="rounds per side and concurrency (A/B pairs)")
    parser.add_argument("--requests", type=int, default=16, help="requests per round")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from omni_runtime.tiny_models import ensure

    model = ensure("tiny-qwen2-chat")
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        try:
            vllm_port, ours_port = free_port(), free_port()
            vllm_proc = start_vllm(model, vllm_port, work / "vllm.log")
            procs.append(vllm_proc)
            wait_http(f"http://127.0.0.1:{vllm_port}/health", vllm_proc)
            ours_proc = start_omnikube(model, ours_port, work)
            procs.append(ours_proc)
            wait_http(f"http://127.0.0.1:{ours_port}/health", ours_proc)
            sides = {"vLLM": f"http://127.0.0.1:{vllm_port}/v1", "omnikube": f"http://127.0.0.1:{ours_port}/v1"}
            ratios: dict[int, tuple[list[float], list[float]]] = {}
            for c in (1, 16):
                ttft_ratios, tpot_ratios = ratios.setdefault(c, ([], []))
                for r in range(args.rounds):
                    print(f"round {r + 1}/{args.rounds}, concurrency {c}", flush=True)
                    # ABBA: who goes first alternates, so a warming or cooling machine favours neither side
                    if r % 2 == 0:
                        base = one_round("vLLM", sides["vLLM"], c, args)
                        ours = one_round("omnikube", sides["omnikube"], c, args)
                    else:
                        ours = one_round("omnikube", sides["omnikube"], c, args)
                        base = one_round("vLLM", sides["vLLM"], c, args)
                    ttft_ratios.append(ours[0] / base[0])
                    tpot_ratios.append(ours[1] / base[1])
        except Exception:
            for log in (work / "vllm.log", work / "serve.log"):
                if log.exists():
                    print(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)
            raise
        finally:
            for proc in procs:
                stop(proc)
    print()
    for c, (ttft_ratios, tpot_ratios) in ratios.items():
        print(
            f"concurrency {c:2}: {summary('TTFT', ttft_ratios)}   {summary('TPOT', tpot_ratios)}"
            f"   (omnikube / vLLM over {len(ttft_ratios)} round pairs; target <= 1.10)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
