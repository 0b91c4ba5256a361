"""Atomic, versioned, cross-process-safe builds of model folders in a cache directory.

A finished build is `<cache_dir>/<name>/` holding a stamp file, `.omnikube-tiny.json`, that records
the builder's version. A folder whose stamp is missing or names another version is rebuilt: the
builder writes into a temporary sibling folder, which is renamed into place only once complete, so a
reader never sees a half-written model. A lock file per name serialises builders across processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["STAMP_FILE", "build_atomically", "default_cache_dir", "read_stamp"]

STAMP_FILE = ".omnikube-tiny.json"
"""Written last into every finished build: {"name", "version", "build_seconds"}."""


def default_cache_dir() -> Path:
    """`$OMNIKUBE_CACHE/models` when OMNIKUBE_CACHE is set, else `~/.cache/omnikube/models`."""
    root = os.environ.get("OMNIKUBE_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "omnikube"
    return base / "models"


def read_stamp(path: Path) -> dict | None:
    """The stamp of a finished build at `path`, or None when there is none (or it is unreadable)."""
    try:
        return json.loads((path / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_atomically(
    name: str, version: str, cache_dir: Path, builder: Callable[[Path], None], *, force: bool = False
) -> Path:
    """Return `<cache_dir>/<name>`, running `builder(tmp_dir)` first unless a build of `version` exists.

    `builder` fills an empty folder; an exception leaves the previous state (and no temp folder) behind.
    """
    cache_dir = Path(cache_dir).expanduser()
    final = cache_dir / name
    if not force and _is_current(final, name, version):
        return final
    with _locked(cache_dir / f".{name}.lock"):
        if not force and _is_current(final, name, version):  # another process finished it meanwhile
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=cache_dir))
        try:
            started = time.monotonic()
            builder(tmp)
            stamp = {"name": name, "version": version, "build_seconds": round(time.monotonic() - started, 3)}
            (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")
            tmp.chmod(0o755)  # mkdtemp makes it private; the folder is a shared cache entry
            _swap_in(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _is_current(path: Path, name: str, version: str) -> bool:
    stamp = read_stamp(path)
    return stamp is not None and stamp.get("name") == name and stamp.get("version") == version


def _swap_in(tmp: Path, final: Path) -> None:
    """Put `tmp` at `final`; an older folder there is moved aside first and removed afterwards."""
    old = None
    if final.exists() or final.is_symlink():
        old = final.with_name(f".{final.name}.old-{os.getpid()}-{time.monotonic_ns()}")
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
