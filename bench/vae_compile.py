"""The FLUX VAE's decode of one 1024x1024 image: eager vs `torch.compile` of its decoder (random weights, bf16).

    python3 bench/vae_compile.py                       # one GPU; default inductor mode
    python3 bench/vae_compile.py --modes default max-autotune-no-cudagraphs

The diffusion engine compiles the denoiser's blocks only; the VAE decode runs eagerly (89 ms of a 2.95 s FP8 Flux
request on an H200). This measures what compiling the decoder would give before the engine does it: time per
decode after warm-up, the compile time (inductor's on-disk cache makes a second run's compile short), and the
largest pixel difference against eager (pixels in [-1, 1]).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diffusion_batching import FLUX_VAE  # noqa: E402


def timed(fn: Any, repeats: int) -> tuple[float, Any]:
    """Milliseconds per call after two warm calls, and the last output."""
    import torch

    with torch.inference_mode():
        fn()
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            out = fn()
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats * 1000, out


def main() -> int:
    import torch
    from diffusers import AutoencoderKL

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["default"], help="torch.compile modes to compare")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    vae = AutoencoderKL(**FLUX_VAE).to("cuda", torch.bfloat16).eval()
    side = args.size // 8
    z = torch.randn(1, FLUX_VAE["latent_channels"], side, side, device="cuda", dtype=torch.bfloat16)
    eager_ms, want = timed(lambda: vae.decode(z).sample, args.repeats)
    print(f"vae decode {args.size}x{args.size} eager {eager_ms:.1f} ms", flush=True)
    decoder = vae.decoder
    for mode in args.modes:
        torch._dynamo.reset()
        vae.decoder = torch.compile(decoder, mode=None if mode == "default" else mode)
        t0 = time.perf_counter()
        with torch.inference_mode():
            vae.decode(z)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        ms, got = timed(lambda: vae.decode(z).sample, args.repeats)
        diff = float((got.float() - want.float()).abs().max())
        print(
            f"vae decode {args.size}x{args.size} compiled ({mode}) {ms:.1f} ms = x{eager_ms / ms:.2f} eager, "
            f"compile {compile_s:.0f} s, max abs pixel difference {diff:.4f} (of 2)",
            flush=True,
        )
        vae.decoder = decoder
    return 0


if __name__ == "__main__":
    sys.exit(main())
