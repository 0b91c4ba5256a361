"""PNG encode of one 1024x1024 image: Pillow on one core vs the stage's encoder (`omni_runtime.engines.diffusion.png`).

    .venv/bin/python bench/png_encode.py            # threads: 1, 2, 4, ... up to this process's CPUs

Two images: photo-like (smooth gradients with grain, what a trained model draws) and noise-like (what the
random-weight FLUX-sized bench model draws: ~2.5 MB as PNG). Prints each encoder's median time and size, and the
ratio of the stage's encoder to Pillow at the same zlib level (the stage's level, 1) and at Pillow's default (6).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime_image"))
from omni_runtime.engines.diffusion import png  # noqa: E402
from omni_runtime.engines.diffusion.png import PNG_COMPRESS_LEVEL  # noqa: E402


def images(side: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:side, 0:side] / side
    waves = np.stack([np.sin(xx * 7 + yy * 3 + c) for c in range(3)], -1)
    photo = ((waves * 0.45 + 0.5) * 255 + rng.normal(0, 2, (side, side, 3))).clip(0, 255).astype(np.uint8)
    noise = ((waves * 0.2 + 0.5) * 255 + rng.normal(0, 40, (side, side, 3))).clip(0, 255).astype(np.uint8)
    return {"photo-like": Image.fromarray(photo), "noise-like": Image.fromarray(noise)}


def timed(fn: Any, repeats: int) -> tuple[float, int]:
    fn()  # warm
    times, size = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        size = len(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    cpus = len(os.sched_getaffinity(0))
    threads = sorted({1, *(2**i for i in range(1, 5) if 2**i <= cpus), min(cpus, 16)})
    print(f"# bench/png_encode.py {args.side}x{args.side} RGB, {cpus} CPUs, stage level {PNG_COMPRESS_LEVEL}")
    for name, image in images(args.side).items():
        pillow = {lvl: timed(lambda lvl=lvl, im=image: png.encode_pillow(im, lvl), args.repeats) for lvl in (6, 1)}
        for lvl, (sec, size) in pillow.items():
            print(f"{name:11s} Pillow level {lvl}          {1e3 * sec:7.1f} ms  {size // 1024:5d} KiB")
        for n in threads:
            with concurrent.futures.ThreadPoolExecutor(n) as pool:

                def ours(pool: Any = pool, im: Any = image) -> bytes:
                    return asyncio.run(png.encode(im, pool, PNG_COMPRESS_LEVEL))

                sec, size = timed(ours, args.repeats)
            print(
                f"{name:11s} stage encoder, {n:2d} thr  {1e3 * sec:7.1f} ms  {size // 1024:5d} KiB  "
                f"x{pillow[PNG_COMPRESS_LEVEL][0] / sec:.2f} vs Pillow level {PNG_COMPRESS_LEVEL}, "
                f"x{pillow[6][0] / sec:.2f} vs Pillow's default"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
