"""Where containers' output goes, and how tests read it.

Each container's stdout and stderr go, interleaved, to `<state dir>/pods/<namespace>_<pod>/<container>.log`;
restarts append to the same file. Logs stay after the pod is deleted (the runner's state folder belongs to
whoever started it).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["log_path", "read_log"]


def log_path(state_dir: Path, namespace: str, pod: str, container: str) -> Path:
    return Path(state_dir) / "pods" / f"{namespace}_{pod}" / f"{container}.log"


def read_log(state_dir: Path, namespace: str, pod: str, container: str) -> str:
    """The container's output so far ("" when it has written nothing or not started)."""
    path = log_path(state_dir, namespace, pod, container)
    return path.read_text(errors="replace") if path.exists() else ""
