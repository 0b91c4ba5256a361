"""`python -m omni_runtime.tiny_models [--out DIR] [--force] [names...]`: build, print `name<TAB>path`."""

from __future__ import annotations

import argparse
import os
import sys
import time

from omni_runtime.tiny_models import MODELS, default_cache_dir, ensure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m omni_runtime.tiny_models",
        description="Build tiny random-weight models locally (reusing finished builds); print their paths.",
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"models to build (default: all): {', '.join(MODELS)}")
    parser.add_argument("--out", default=None, help=f"cache folder (default: {default_cache_dir()})")
    parser.add_argument("--force", action="store_true", help="rebuild even when a current build exists")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; known models are {list(MODELS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for name in args.names or list(MODELS):
        started = time.monotonic()
        path = ensure(name, args.out, force=args.force)
        print(f"{name}\t{path}", flush=True)
        print(f"  {name}: {time.monotonic() - started:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
