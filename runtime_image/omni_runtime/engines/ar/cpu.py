"""How an AR stage runs vLLM on a CPU, and the vLLM processes it must end: CPU defaults, cgroup-aware thread
counts, and the reaping of vLLM's child processes.

`cpu_defaults` fills in what a CPU deployment needs and vLLM's GPU-minded defaults get wrong, only where the
user set nothing (`CPU_ENGINE_DEFAULTS`, `CPU_ENV_DEFAULTS`). `started_since` and `reap` find and end the
processes vLLM started (engine core, workers), so a stopped or failed stage leaves none behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

__all__ = [
    "CPU_ENGINE_DEFAULTS",
    "CPU_ENV_DEFAULTS",
    "child_processes",
    "cpu_defaults",
    "cpu_threads",
    "reap",
    "started_since",
]

log = logging.getLogger(__name__)

CPU_ENGINE_DEFAULTS: dict[str, Any] = {
    "kv_cache_memory_bytes": 1024**3,
    "enforce_eager": True,
}
"""AsyncEngineArgs set on CPU unless the stage's engine_args (or the environment) already decide them.

- `kv_cache_memory_bytes` 1 GiB: on CPU vLLM otherwise reserves `gpu_memory_utilization` (0.92) of
  the NUMA node's *host* memory, and refuses to start when that much is not free (any shared
  machine). Skipped when `VLLM_CPU_KVCACHE_SPACE` (GiB, vLLM's older knob) is set.
- `enforce_eager` True: vLLM's CPU path otherwise compiles the model with torch inductor at startup
  (slow on a few cores); set `enforce_eager: false` to trade startup time for decode speed.
"""

CPU_ENV_DEFAULTS: dict[str, str] = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}
"""Environment set on CPU unless already set (before AsyncLLM starts its engine-core process).

- `VLLM_CPU_OMP_THREADS_BIND=nobind`: vLLM's `auto` pins OpenMP threads to every core of a NUMA node
  that the process's affinity mask shows; in a pod that mask is usually the whole node, not the
  pod's CPU limit, so pinning would oversubscribe. Set it to a core list ("0-7") on dedicated nodes.
- `OMP_NUM_THREADS`: when unset, the CPUs the process may really use (`cpu_threads`): the cgroup CPU
  limit (rounded down, at least 1) and the CPU affinity, whichever is fewer. So torch does not start one
  thread per host core inside a limited container, nor more threads than the cores a node's static CPU
  manager pinned the pod to.
"""


def _cgroup_cpu_limit() -> int | None:
    """Whole CPUs allowed by the cgroup v2 quota (`cpu.max`), or None when unlimited or unknown."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, int(int(quota) // int(period)))


def cpu_threads() -> int | None:
    """Threads worth running on the CPUs this process has: the fewer of its cgroup's whole-CPU limit and
    its CPU affinity (a Guaranteed pod under the static CPU manager is pinned to its cores); None when
    neither bounds it below the host's CPU count."""
    limit, pinned = _cgroup_cpu_limit(), len(os.sched_getaffinity(0))
    if limit is None and pinned >= (os.cpu_count() or pinned):
        return None  # nothing bounds it: torch's own default (one thread per core) is right
    return min(pinned, limit or pinned)


def cpu_defaults(engine_args: dict[str, Any], environ: MutableMapping[str, str] | None = None) -> dict[str, Any]:
    """`engine_args` with the CPU defaults filled in; sets the CPU environment defaults in `environ`
    (the process environment unless given).

    Only call this on CPU. Keys the user set (or `VLLM_CPU_KVCACHE_SPACE` for the KV cache) win.
    """
    env: MutableMapping[str, str] = os.environ if environ is None else environ
    args = dict(engine_args)
    for key, value in CPU_ENGINE_DEFAULTS.items():
        if key == "kv_cache_memory_bytes" and env.get("VLLM_CPU_KVCACHE_SPACE"):
            continue
        args.setdefault(key, value)
    for key, value in CPU_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    if "OMP_NUM_THREADS" not in env and (threads := cpu_threads()) is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return args


def child_processes() -> list[Any]:
    """Every process below this one (vLLM's engine core and workers, once started)."""
    import psutil

    return psutil.Process().children(recursive=True)


def _is_resource_tracker(proc: Any) -> bool:
    try:
        return any("resource_tracker" in part for part in proc.cmdline())
    except Exception:  # psutil.Error: gone or not ours to read
        return False


def started_since(before: set[int]) -> list[Any]:
    """The processes below this one whose pid is not in `before`, less the multiprocessing resource tracker
    (one per process, not ours to end)."""
    return [p for p in child_processes() if p.pid not in before and not _is_resource_tracker(p)]


def reap(procs: list[Any], stage_name: str, timeout: float = 15.0) -> None:
    """Wait for `procs` (the processes vLLM started), killing any that linger.

    vLLM's shutdown may SIGKILL its engine core without waiting for it, leaving a zombie; waiting
    on it here reaps it.
    """
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for proc in alive:
        log.warning("stage %s: vLLM process %s outlived shutdown; killing it", stage_name, proc.pid)
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=5.0)
